// KvPrefiller: per request, the pulls of the decode ranks; per layer, the paged writes of each
// slice; the Finished answers that let decoders reuse pages. One mutex guards all state;
// engine submissions (which only queue work) may run under it, user callbacks never do.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "common/log.h"
#include "fabric/kv/flow.h"
#include "kv/ticker.h"
#include "kv/wire.h"

namespace fabric::kv {

using Clock = std::chrono::steady_clock;
using Actions = std::vector<std::function<void()>>;
using PullKey = std::pair<RequestId, uint32_t>;  // (request, decode rank)

class KvPrefiller::Impl : public std::enable_shared_from_this<Impl> {
 public:
  Impl(TransferEngine& engine, const KvLayout& layout, const Registration& memory,
       const Options& options)
      : engine_(engine), layout_(layout), memory_(memory), options_(options) {}

  Status init() {
    std::weak_ptr<Impl> weak = weak_from_this();
    Status st = engine_.set_receive_handler([weak](std::span<const std::byte> bytes) {
      if (auto self = weak.lock()) self->on_message(bytes);
    });
    if (!st) return st;
    ticker_.start(options_.heartbeat, [this] { tick(); });
    return Status::ok();
  }

  void shutdown() {
    ticker_.stop();
    std::lock_guard lock(mu_);
    closed_ = true;
  }

  Status start(RequestId id, std::vector<uint32_t> pages, uint32_t decode_tp, FinishedFn fn,
               LayerFn on_layer) {
    if (pages.empty()) return Status(ErrorCode::kInvalidArgument, "start: no pages");
    for (uint32_t p : pages) {
      if (p >= layout_.num_pages) {
        return Status(
            ErrorCode::kInvalidArgument,
            fmt::format("start: page {} is outside the pool of {}", p, layout_.num_pages));
      }
    }
    auto plan = plan_slices(layout_, layout_.with_rank(decode_tp, 0));
    if (!plan) {
      return Status(ErrorCode::kInvalidArgument,
                    fmt::format("start: decode TP {}: {}", decode_tp, plan.status().message()));
    }
    Actions actions;
    {
      std::lock_guard lock(mu_);
      if (closed_) return Status(ErrorCode::kClosed, "the KvPrefiller is closed");
      if (requests_.count(id)) {
        return Status(ErrorCode::kAlreadyExists, fmt::format("request {} is live", id));
      }
      auto [it, inserted] = requests_.try_emplace(id);
      Request& r = it->second;
      r.pages = std::move(pages);
      r.expected = targets_of(*plan, layout_.tp_rank);
      r.layers.assign(layout_.num_layers, false);
      r.on_finished = std::move(fn);
      r.on_layer = std::move(on_layer);
      r.deadline = Clock::now() + options_.pull_timeout;
      // Decode ranks that cancelled before this start: nothing to wait for from them.
      std::erase_if(r.expected, [&](uint32_t rank) {
        if (!tombstones_.count({id, rank})) return false;
        r.status = Status(ErrorCode::kCancelled,
                          fmt::format("request {} cancelled by decode rank {}", id, rank));
        return true;
      });
      for (uint32_t rank : r.expected) {
        auto o = orphans_.find({id, rank});
        if (o != orphans_.end()) {
          wire::Message m = std::move(o->second.message);
          orphans_.erase(o);
          add_pull(it, std::move(m), actions);
        }
      }
      maybe_end_request(it, actions);
    }
    run(actions);
    return Status::ok();
  }

  Status layer_done(RequestId id, uint32_t layer) {
    Actions actions;
    {
      std::lock_guard lock(mu_);
      auto it = requests_.find(id);
      if (it == requests_.end()) {
        return Status(ErrorCode::kNotFound, fmt::format("request {} is not live", id));
      }
      if (layer >= layout_.num_layers) {
        return Status(ErrorCode::kOutOfRange,
                      fmt::format("layer {} of a {}-layer cache", layer, layout_.num_layers));
      }
      Request& r = it->second;
      if (r.layers[layer] || r.cancelled) return Status::ok();
      r.layers[layer] = true;
      for (auto& [rank, p] : r.pulls) {
        if (!p.stopping && !p.ended) submit_layer(it->first, r, p, layer);
        maybe_end_pull(it, p, actions);
      }
      maybe_end_request(it, actions);
    }
    run(actions);
    return Status::ok();
  }

  Status cancel(RequestId id) {
    Actions actions;
    {
      std::lock_guard lock(mu_);
      auto it = requests_.find(id);
      if (it == requests_.end()) {
        return Status(ErrorCode::kNotFound, fmt::format("request {} is not live", id));
      }
      Request& r = it->second;
      r.cancelled = true;
      Status why(ErrorCode::kCancelled, fmt::format("request {} cancelled by the prefiller", id));
      if (r.status.is_ok()) r.status = why;
      // Pulls that have not arrived are refused when they do.
      for (uint32_t rank : r.expected) {
        if (!r.pulls.count(rank))
          tombstones_[{id, rank}] = Clock::now() + 2 * options_.pull_timeout;
      }
      for (auto& [rank, p] : r.pulls) stop_pull(p, why);
      for (auto& [rank, p] : r.pulls) maybe_end_pull(it, p, actions);
      maybe_end_request(it, actions);
    }
    run(actions);
    return Status::ok();
  }

  void fail_peer(const std::string& key, const Status& why) {
    Actions actions;
    {
      std::lock_guard lock(mu_);
      for (auto it = requests_.begin(); it != requests_.end();) {
        auto next = std::next(it);
        for (auto& [rank, p] : it->second.pulls) {
          if (p.key == key) stop_pull(p, why);
        }
        for (auto& [rank, p] : it->second.pulls) maybe_end_pull(it, p, actions);
        maybe_end_request(it, actions);
        it = next;
      }
      for (auto it = orphans_.begin(); it != orphans_.end();) {
        it = it->second.key == key ? orphans_.erase(it) : std::next(it);
      }
    }
    run(actions);
  }

  Result<Watcher> watch_layers(UvmWatchers& watchers, RequestId id,
                               std::function<void(uint32_t)> observer) {
    std::weak_ptr<Impl> weak = weak_from_this();
    const uint32_t layers = layout_.num_layers;
    return watchers.watch([weak, id, layers, observer](uint64_t old_value, uint64_t new_value) {
      auto self = weak.lock();
      if (!self) return false;
      for (uint64_t l = old_value; l < new_value && l < layers; ++l) {
        self->layer_done(id, static_cast<uint32_t>(l)).ignore();
        if (observer) observer(static_cast<uint32_t>(l));
      }
      return new_value < layers;
    });
  }

  size_t live() const {
    std::lock_guard lock(mu_);
    return requests_.size();
  }
  const KvLayout& layout() const { return layout_; }

 private:
  struct Pull {
    uint32_t decode_rank = 0;
    Address reply;
    std::string key;
    KvLayout layout;  // the decoder's
    std::vector<uint32_t> pages;
    RemoteMemory dst;
    uint32_t imm = 0;
    std::vector<SliceCopy> slices;
    std::vector<bool> sent;
    std::vector<uint32_t> layer_inflight;  // writes of each layer not completed yet
    uint32_t unsent = 0;
    uint32_t inflight = 0;
    bool stopping = false;
    bool ended = false;
    Status status;
  };
  struct Request {
    std::vector<uint32_t> pages;
    std::vector<uint32_t> expected;  // decode ranks that pull from this rank
    std::map<uint32_t, Pull> pulls;
    std::vector<bool> layers;
    uint32_t ended = 0;
    bool cancelled = false;
    Status status;  // the first error
    Clock::time_point deadline;
    FinishedFn on_finished;
    LayerFn on_layer;
  };
  struct Orphan {
    wire::Message message;
    std::string key;
    Clock::time_point until;
  };
  using Iter = std::unordered_map<RequestId, Request>::iterator;

  static void run(Actions& actions) {
    for (auto& a : actions) a();
  }

  void send(const Address& peer, const Bytes& bytes) {
    std::weak_ptr<Impl> weak = weak_from_this();
    std::string key = peer.to_hex();
    auto failed = [weak, key](const Status& s) {
      if (auto self = weak.lock()) {
        self->fail_peer(
            key, Status(ErrorCode::kPeerUnreachable, "decode rank unreachable: " + s.to_string()));
      }
    };
    auto r = engine_.submit_send(peer, bytes, Callbacks{nullptr, failed});
    if (!r) failed(r.status());
  }

  void finished_message(RequestId id, uint32_t decode_rank, const Address& to, const Status& st,
                        Actions& actions) {
    wire::Message m;
    m.type = wire::Type::kFinished;
    m.request = id;
    m.decode_rank = decode_rank;
    m.prefill_rank = layout_.tp_rank;
    m.code = static_cast<uint32_t>(st.code());
    m.text = st.message();
    actions.push_back(
        [self = shared_from_this(), to, bytes = wire::encode(m)] { self->send(to, bytes); });
  }

  static void stop_pull(Pull& p, const Status& why) {
    if (p.ended || p.stopping) return;
    p.stopping = true;
    p.status = why;
  }

  // Under mu_. A pull that arrived (now, or earlier as an orphan) for a started request.
  void add_pull(Iter it, wire::Message m, Actions& actions) {
    Request& r = it->second;
    const RequestId id = it->first;
    auto memory = RemoteMemory::decode(m.memory);
    Status bad;
    std::vector<SliceCopy> slices;
    if (!memory) {
      bad = memory.status();
    } else if (m.prefill_tp != layout_.tp_size) {
      bad = Status(
          ErrorCode::kInvalidArgument,
          fmt::format("the decoder planned for a prefill TP size of {}, this rank is of TP {}",
                      m.prefill_tp, layout_.tp_size));
    } else if (m.pages.size() != r.pages.size()) {
      bad = Status(ErrorCode::kInvalidArgument,
                   fmt::format("the decoder asked for {} pages, the prefill holds {}",
                               m.pages.size(), r.pages.size()));
    } else if (auto plan = plan_slices(layout_, m.layout); !plan) {
      bad = plan.status();
    } else {
      slices = slices_between(*plan, layout_.tp_rank, m.decode_rank);
      if (slices.empty()) {
        bad = Status(ErrorCode::kInvalidArgument,
                     fmt::format("prefill rank {} holds no head of decode rank {}", layout_.tp_rank,
                                 m.decode_rank));
      }
    }
    if (r.pulls.count(m.decode_rank)) return;  // a duplicate
    Pull& p = r.pulls[m.decode_rank];
    p.decode_rank = m.decode_rank;
    if (memory) {
      p.dst = *memory;
      p.reply = memory->owner();
      p.key = p.reply.to_hex();
    }
    p.layout = m.layout;
    p.pages = std::move(m.pages);
    p.imm = m.imm;
    p.slices = std::move(slices);
    p.sent.assign(layout_.num_layers, false);
    p.layer_inflight.assign(layout_.num_layers, 0);
    p.unsent = layout_.num_layers;
    if (!bad.is_ok() || r.cancelled) {
      stop_pull(p, bad.is_ok() ? r.status : bad);
    } else {
      for (uint32_t l = 0; l < layout_.num_layers; ++l) {
        if (r.layers[l]) submit_layer(id, r, p, l);
      }
    }
    maybe_end_pull(it, p, actions);
  }

  // Under mu_. Every slice of one layer into one decode rank: one paged write each.
  void submit_layer(RequestId id, Request& r, Pull& p, uint32_t layer) {
    p.sent[layer] = true;
    --p.unsent;
    for (const SliceCopy& s : p.slices) {
      PagedWrite w;
      w.src = memory_.handle;
      w.dst = p.dst;
      w.page_bytes = s.length;
      w.src_pages = r.pages;
      w.src_stride = layout_.page_step();
      w.src_offset = layout_.page_offset(layer, 0) + s.src_offset;
      w.dst_pages = p.pages;
      w.dst_stride = p.layout.page_step();
      w.dst_offset = p.layout.page_offset(layer, 0) + s.dst_offset;
      w.imm = p.imm;
      std::weak_ptr<Impl> weak = weak_from_this();
      const uint32_t rank = p.decode_rank;
      auto done = [weak, id, rank, layer](const Status& st) {
        if (auto self = weak.lock()) self->write_done(id, rank, layer, st);
      };
      ++p.inflight;
      ++p.layer_inflight[layer];
      auto t = engine_.submit(w, Callbacks{[done] { done(Status::ok()); }, done});
      if (!t) {
        --p.inflight;
        --p.layer_inflight[layer];
        stop_pull(p, t.status());
        return;
      }
    }
  }

  void write_done(RequestId id, uint32_t rank, uint32_t layer, const Status& st) {
    Actions actions;
    {
      std::lock_guard lock(mu_);
      auto it = requests_.find(id);
      if (it == requests_.end()) return;
      auto p = it->second.pulls.find(rank);
      if (p == it->second.pulls.end()) return;
      --p->second.inflight;
      if (--p->second.layer_inflight[layer] == 0 && st.is_ok() && !p->second.stopping &&
          it->second.on_layer) {
        actions.push_back([fn = it->second.on_layer, id, rank, layer] { fn(id, rank, layer); });
      }
      if (!st.is_ok()) stop_pull(p->second, st);
      maybe_end_pull(it, p->second, actions);
      maybe_end_request(it, actions);
    }
    run(actions);
  }

  // Under mu_.
  void maybe_end_pull(Iter it, Pull& p, Actions& actions) {
    if (p.ended || p.inflight > 0) return;
    if (p.stopping) {
      if (!p.reply.empty()) finished_message(it->first, p.decode_rank, p.reply, p.status, actions);
      if (it->second.status.is_ok()) it->second.status = p.status;
    } else if (p.unsent > 0) {
      return;
    }
    p.ended = true;
    ++it->second.ended;
  }

  // Under mu_. Ends the request once every pull it waits for has ended.
  void maybe_end_request(Iter it, Actions& actions) {
    Request& r = it->second;
    size_t waiting_for = r.cancelled ? r.pulls.size() : r.expected.size();
    if (r.ended < waiting_for) return;
    if (r.on_finished) {
      actions.push_back(
          [fn = std::move(r.on_finished), id = it->first, st = r.status] { fn(id, st); });
    }
    requests_.erase(it);
  }

  void on_message(std::span<const std::byte> bytes) {
    auto m = wire::decode(bytes);
    if (!m) {
      fabric::detail::log().warn("kv prefiller: dropped a message: {}", m.status().to_string());
      return;
    }
    Actions actions;
    {
      std::lock_guard lock(mu_);
      if (closed_) return;
      const PullKey key{m->request, m->decode_rank};
      if (m->type == wire::Type::kPull) {
        auto memory = RemoteMemory::decode(m->memory);
        if (tombstones_.count(key)) {
          // Cancelled before it arrived: nothing was or will be written.
          if (memory) {
            finished_message(m->request, m->decode_rank, memory->owner(),
                             Status(ErrorCode::kCancelled, "cancelled before the pull arrived"),
                             actions);
          }
        } else if (auto it = requests_.find(m->request); it != requests_.end()) {
          add_pull(it, std::move(*m), actions);
          maybe_end_request(it, actions);
        } else if (memory) {
          std::string k = memory->owner().to_hex();
          orphans_[key] = Orphan{std::move(*m), std::move(k), Clock::now() + options_.pull_timeout};
        }
      } else if (m->type == wire::Type::kCancel) {
        auto sender = Address::decode(m->sender);
        auto it = requests_.find(m->request);
        Pull* p = nullptr;
        if (it != requests_.end()) {
          auto pit = it->second.pulls.find(m->decode_rank);
          if (pit != it->second.pulls.end()) p = &pit->second;
        }
        Status why(ErrorCode::kCancelled, fmt::format("request {} cancelled by decode rank {}",
                                                      m->request, m->decode_rank));
        if (p != nullptr && !p->ended) {
          stop_pull(*p, why);  // Finished goes out once its writes are out of flight
          maybe_end_pull(it, *p, actions);
          maybe_end_request(it, actions);
        } else {
          // Not arrived yet, or every write of it already completed: nothing is in flight.
          if (p == nullptr) {
            tombstones_[key] = Clock::now() + 2 * options_.pull_timeout;
            orphans_.erase(key);
          }
          if (sender) finished_message(m->request, m->decode_rank, *sender, why, actions);
          if (p == nullptr && it != requests_.end()) {
            // The request stops waiting for this rank.
            auto& ex = it->second.expected;
            ex.erase(std::remove(ex.begin(), ex.end(), m->decode_rank), ex.end());
            if (it->second.status.is_ok()) it->second.status = why;
            maybe_end_request(it, actions);
          }
        }
      }
    }
    run(actions);
  }

  void tick() {
    std::vector<Address> peers;
    Actions actions;
    {
      std::lock_guard lock(mu_);
      if (closed_) return;
      const auto now = Clock::now();
      for (auto it = tombstones_.begin(); it != tombstones_.end();) {
        it = it->second <= now ? tombstones_.erase(it) : std::next(it);
      }
      for (auto it = orphans_.begin(); it != orphans_.end();) {
        if (it->second.until <= now) {
          if (auto mem = RemoteMemory::decode(it->second.message.memory)) {
            finished_message(it->first.first, it->first.second, mem->owner(),
                             Status(ErrorCode::kTimeout, "the prefiller never started the request"),
                             actions);
          }
          it = orphans_.erase(it);
        } else {
          ++it;
        }
      }
      std::unordered_set<std::string> seen;
      for (auto it = requests_.begin(); it != requests_.end();) {
        auto next = std::next(it);
        Request& r = it->second;
        if (!r.cancelled && r.deadline <= now && r.pulls.size() < r.expected.size()) {
          // Decode ranks that never pulled: give up on them.
          Status why(ErrorCode::kTimeout, "a decode rank never pulled the request");
          for (uint32_t rank : r.expected) {
            if (!r.pulls.count(rank)) {
              tombstones_[{it->first, rank}] = now + 2 * options_.pull_timeout;
              if (r.status.is_ok()) r.status = why;
            }
          }
          r.expected.clear();
          for (auto& [rank, p] : r.pulls) r.expected.push_back(rank);
          r.ended = 0;
          for (auto& [rank, p] : r.pulls) r.ended += p.ended;
          maybe_end_request(it, actions);
        } else {
          for (auto& [rank, p] : r.pulls) {
            if (!p.ended && !p.reply.empty() && seen.insert(p.key).second) peers.push_back(p.reply);
          }
        }
        it = next;
      }
    }
    run(actions);
    wire::Message ping;
    ping.type = wire::Type::kPing;
    ping.prefill_rank = layout_.tp_rank;
    ping.sender = engine_.address().encode();
    Bytes bytes = wire::encode(ping);
    for (auto& p : peers) send(p, bytes);
  }

  TransferEngine& engine_;
  const KvLayout layout_;
  const Registration memory_;
  const Options options_;

  mutable std::mutex mu_;
  bool closed_ = false;
  std::unordered_map<RequestId, Request> requests_;
  std::map<PullKey, Orphan> orphans_;
  std::map<PullKey, Clock::time_point> tombstones_;
  detail::Ticker ticker_;  // last: stopped first
};

Result<std::unique_ptr<KvPrefiller>> KvPrefiller::create(TransferEngine& engine,
                                                         const KvLayout& layout,
                                                         const Registration& memory,
                                                         const Options& options) {
  if (Status st = layout.validate(); !st) return st;
  if (memory.descriptor.empty() || memory.descriptor.length() < layout.region_bytes()) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("the registered region ({} bytes) is smaller than the layout ({} "
                              "bytes: {})",
                              memory.descriptor.empty() ? 0 : memory.descriptor.length(),
                              layout.region_bytes(), layout.to_string()));
  }
  auto impl = std::make_shared<Impl>(engine, layout, memory, options);
  if (Status st = impl->init(); !st) return st;
  return std::unique_ptr<KvPrefiller>(new KvPrefiller(std::move(impl)));
}

KvPrefiller::KvPrefiller(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
KvPrefiller::~KvPrefiller() {
  impl_->shutdown();
}
Status KvPrefiller::start(RequestId id, std::vector<uint32_t> pages, uint32_t decode_tp,
                          FinishedFn on_finished, LayerFn on_layer) {
  return impl_->start(id, std::move(pages), decode_tp, std::move(on_finished), std::move(on_layer));
}
Status KvPrefiller::layer_done(RequestId id, uint32_t layer) {
  return impl_->layer_done(id, layer);
}
Status KvPrefiller::cancel(RequestId id) {
  return impl_->cancel(id);
}
void KvPrefiller::fail_peer(const Address& peer) {
  impl_->fail_peer(peer.to_hex(), Status(ErrorCode::kPeerUnreachable,
                                         "decode rank " + peer.short_name() + " left"));
}
Result<Watcher> KvPrefiller::watch_layers(UvmWatchers& watchers, RequestId id,
                                          std::function<void(uint32_t)> observer) {
  return impl_->watch_layers(watchers, id, std::move(observer));
}
size_t KvPrefiller::live_requests() const {
  return impl_->live();
}
const KvLayout& KvPrefiller::layout() const {
  return impl_->layout();
}

}  // namespace fabric::kv
