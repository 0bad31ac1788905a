// KvDecoder: page pool, immediate allocation, the pull/cancel handshake and dead-peer handling
// of a decode rank. One mutex guards all state; engine calls that only queue work (sends,
// expect_imm, cancel_expect_imm) may run under it, user callbacks never do.
#include <fmt/format.h>

#include <algorithm>
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

class KvDecoder::Impl : public std::enable_shared_from_this<Impl> {
 public:
  Impl(TransferEngine& engine, const KvLayout& layout, const Registration& memory,
       const Options& options)
      : engine_(engine),
        layout_(layout),
        memory_(memory),
        options_(options),
        page_used_(layout.num_pages, false),
        free_pages_(layout.num_pages) {}

  Status init() {
    self_ = engine_.address().encode();
    memory_bytes_ = memory_.descriptor.encode();
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
    for (auto& [id, r] : requests_) {
      if (r.state != State::kReady) engine_.cancel_expect_imm(r.imm).ignore();
    }
  }

  Result<std::vector<uint32_t>> submit(DecodeRequest rq) {
    if (rq.prefill_ranks.empty()) {
      return Status(ErrorCode::kInvalidArgument, "DecodeRequest.prefill_ranks is empty");
    }
    auto plan =
        plan_slices(layout_.with_rank(static_cast<uint32_t>(rq.prefill_ranks.size()), 0), layout_);
    if (!plan) {
      return Status(ErrorCode::kInvalidArgument,
                    fmt::format("DecodeRequest.prefill_ranks ({} ranks): {}",
                                rq.prefill_ranks.size(), plan.status().message()));
    }
    const uint32_t n = rq.pages.empty() ? rq.num_pages : static_cast<uint32_t>(rq.pages.size());
    if (n == 0) return Status(ErrorCode::kInvalidArgument, "DecodeRequest has no pages");
    const uint64_t expected =
        uint64_t{layout_.num_layers} * n * slices_into(*plan, layout_.tp_rank);
    std::vector<uint32_t> sources = sources_of(*plan, layout_.tp_rank);

    std::vector<std::pair<Address, Bytes>> sends;
    std::vector<uint32_t> pages;
    {
      std::lock_guard lock(mu_);
      if (closed_) return Status(ErrorCode::kClosed, "the KvDecoder is closed");
      if (requests_.count(rq.id)) {
        return Status(ErrorCode::kAlreadyExists, fmt::format("request {} is live", rq.id));
      }
      if (rq.pages.empty()) {
        if (free_pages_ < n) {
          return Status(ErrorCode::kOutOfRange,
                        fmt::format("request {} needs {} pages, {} free", rq.id, n, free_pages_));
        }
        for (uint32_t p = 0; p < layout_.num_pages && pages.size() < n; ++p) {
          if (!page_used_[p]) pages.push_back(p);
        }
      } else {
        pages = rq.pages;
        std::vector<uint32_t> sorted = pages;
        std::sort(sorted.begin(), sorted.end());
        for (size_t i = 0; i < sorted.size(); ++i) {
          if (sorted[i] >= layout_.num_pages) {
            return Status(ErrorCode::kInvalidArgument,
                          fmt::format("DecodeRequest.pages: page {} is outside the pool of {}",
                                      sorted[i], layout_.num_pages));
          }
          if ((i > 0 && sorted[i] == sorted[i - 1]) || page_used_[sorted[i]]) {
            return Status(ErrorCode::kAlreadyExists,
                          fmt::format("DecodeRequest.pages: page {} is taken", sorted[i]));
          }
        }
      }
      auto imm = allocate_imm();
      if (!imm) return imm.status();
      engine_.reset_imm(*imm);
      std::weak_ptr<Impl> weak = weak_from_this();
      const RequestId id = rq.id;
      const uint32_t value = *imm;
      if (Status st = engine_.expect_imm(value, expected,
                                         [weak, id, value] {
                                           if (auto self = weak.lock()) self->on_imm(id, value);
                                         });
          !st) {
        imms_held_.erase(value);
        return st;
      }
      for (uint32_t p : pages) page_used_[p] = true;
      free_pages_ -= n;
      Request& r = requests_[id];
      r.pages = pages;
      r.imm = value;
      r.on_ready = std::move(rq.on_ready);
      r.on_error = std::move(rq.on_error);
      wire::Message pull;
      pull.type = wire::Type::kPull;
      pull.request = id;
      pull.decode_rank = layout_.tp_rank;
      pull.imm = value;
      pull.prefill_tp = static_cast<uint32_t>(rq.prefill_ranks.size());
      pull.layout = layout_;
      pull.pages = pages;
      pull.memory = memory_bytes_;
      Bytes encoded = wire::encode(pull);
      for (uint32_t s : sources) {
        const Address& a = rq.prefill_ranks[s];
        r.sources.push_back(Source{s, a, a.to_hex()});
        sends.emplace_back(a, encoded);
      }
    }
    for (auto& [peer, bytes] : sends) send(peer, bytes);
    return pages;
  }

  Status cancel(RequestId id) {
    Actions actions;
    {
      std::lock_guard lock(mu_);
      auto it = requests_.find(id);
      if (it == requests_.end() || it->second.state != State::kPulling) {
        return Status(ErrorCode::kNotFound, fmt::format("request {} is not being pulled", id));
      }
      begin_cancel(it, Status(ErrorCode::kCancelled, fmt::format("request {} cancelled", id)),
                   actions);
    }
    run(actions);
    return Status::ok();
  }

  Status release(RequestId id) {
    std::lock_guard lock(mu_);
    auto it = requests_.find(id);
    if (it == requests_.end() || it->second.state != State::kReady) {
      return Status(ErrorCode::kNotFound, fmt::format("request {} is not ready", id));
    }
    free_pages(it->second.pages);
    requests_.erase(it);
    return Status::ok();
  }

  void fail_peer(const std::string& key, const Status& why) {
    Actions actions;
    {
      std::lock_guard lock(mu_);
      for (auto it = requests_.begin(); it != requests_.end();) {
        auto next = std::next(it);
        Request& r = it->second;
        bool hit = false;
        for (auto& s : r.sources) {
          if (s.key == key && !s.finished && !s.dead) {
            s.dead = true;
            hit = true;
            r.quarantine_until = Clock::now() + options_.quarantine;
          }
        }
        if (hit && r.state == State::kPulling) {
          begin_cancel(it, why, actions);
        } else if (hit) {
          check_done(it, actions);
        }
        it = next;
      }
    }
    run(actions);
  }

  uint32_t free_page_count() const {
    std::lock_guard lock(mu_);
    return free_pages_;
  }
  size_t live() const {
    std::lock_guard lock(mu_);
    return std::count_if(requests_.begin(), requests_.end(),
                         [](auto& kv) { return kv.second.state != State::kReady; });
  }
  const KvLayout& layout() const { return layout_; }

 private:
  enum class State { kPulling, kCancelling, kReady };
  struct Source {
    uint32_t rank;
    Address address;
    std::string key;
    bool finished = false;  // said Finished: nothing in flight from it
    bool dead = false;      // declared dead: held until quarantine_until
  };
  struct Request {
    std::vector<uint32_t> pages;
    uint32_t imm = 0;
    State state = State::kPulling;
    std::vector<Source> sources;
    Status status;
    Clock::time_point quarantine_until{};
    std::function<void(RequestId, std::span<const uint32_t>)> on_ready;
    std::function<void(RequestId, const Status&)> on_error;
  };
  struct Held {
    std::vector<uint32_t> pages;
    uint32_t imm;
    Clock::time_point until;
  };
  using Iter = std::unordered_map<RequestId, Request>::iterator;

  static void run(Actions& actions) {
    for (auto& a : actions) a();
  }

  Result<uint32_t> allocate_imm() {
    if (imms_held_.size() >= options_.imm_count) {
      return Status(ErrorCode::kOutOfRange, "every immediate of the decoder's range is held");
    }
    for (;;) {
      uint32_t v = options_.imm_first + next_imm_;
      next_imm_ = (next_imm_ + 1) % options_.imm_count;
      if (imms_held_.insert(v).second) return v;
    }
  }

  void free_pages(const std::vector<uint32_t>& pages) {
    for (uint32_t p : pages) page_used_[p] = false;
    free_pages_ += static_cast<uint32_t>(pages.size());
  }

  void send(const Address& peer, const Bytes& bytes) {
    std::weak_ptr<Impl> weak = weak_from_this();
    std::string key = peer.to_hex();
    auto failed = [weak, key](const Status& s) {
      if (auto self = weak.lock()) {
        self->fail_peer(
            key, Status(ErrorCode::kPeerUnreachable, "prefill rank unreachable: " + s.to_string()));
      }
    };
    auto r = engine_.submit_send(peer, bytes, Callbacks{nullptr, failed});
    if (!r) failed(r.status());
  }

  // Under mu_. Stops a pulling request: withdraws its expectation and asks every source that
  // may still write to confirm it stopped.
  void begin_cancel(Iter it, Status why, Actions& actions) {
    Request& r = it->second;
    r.state = State::kCancelling;
    r.status = std::move(why);
    // If the expectation was already met, on_imm is queued and ends the request.
    engine_.cancel_expect_imm(r.imm).ignore();
    wire::Message m;
    m.type = wire::Type::kCancel;
    m.request = it->first;
    m.decode_rank = layout_.tp_rank;
    m.sender = self_;
    Bytes bytes = wire::encode(m);
    for (auto& s : r.sources) {
      if (!s.finished && !s.dead) {
        actions.push_back(
            [self = shared_from_this(), a = s.address, bytes] { self->send(a, bytes); });
      }
    }
    check_done(it, actions);
  }

  // Under mu_. Ends a cancelling request once no source can still write.
  void check_done(Iter it, Actions& actions) {
    Request& r = it->second;
    if (r.state != State::kCancelling) return;
    bool any_dead = false;
    for (auto& s : r.sources) {
      if (!s.finished && !s.dead) return;
      any_dead |= s.dead;
    }
    finish_error(it, any_dead, actions);
  }

  void finish_error(Iter it, bool hold, Actions& actions) {
    Request& r = it->second;
    if (hold) {
      held_.push_back(Held{r.pages, r.imm, r.quarantine_until});
    } else {
      free_pages(r.pages);
      imms_held_.erase(r.imm);
    }
    if (r.on_error) {
      actions.push_back(
          [fn = std::move(r.on_error), id = it->first, st = r.status] { fn(id, st); });
    }
    requests_.erase(it);
  }

  void on_imm(RequestId id, uint32_t imm) {
    Actions actions;
    {
      std::lock_guard lock(mu_);
      auto it = requests_.find(id);
      if (closed_ || it == requests_.end() || it->second.imm != imm) return;
      Request& r = it->second;
      if (r.state == State::kPulling) {
        r.state = State::kReady;
        imms_held_.erase(r.imm);
        if (r.on_ready) {
          actions.push_back([fn = std::move(r.on_ready), id, pages = r.pages] { fn(id, pages); });
        }
      } else if (r.state == State::kCancelling) {
        // Every write landed: nothing can be in flight, whoever has not answered yet.
        finish_error(it, false, actions);
      }
    }
    run(actions);
  }

  void on_message(std::span<const std::byte> bytes) {
    auto m = wire::decode(bytes);
    if (!m) {
      fabric::detail::log().warn("kv decoder: dropped a message: {}", m.status().to_string());
      return;
    }
    if (m->type == wire::Type::kPing) return;
    if (m->type != wire::Type::kFinished) {
      fabric::detail::log().warn("kv decoder: dropped a message of type {}",
                                 static_cast<int>(m->type));
      return;
    }
    Actions actions;
    {
      std::lock_guard lock(mu_);
      auto it = requests_.find(m->request);
      if (closed_ || it == requests_.end()) return;
      Request& r = it->second;
      for (auto& s : r.sources) {
        if (s.rank == m->prefill_rank) s.finished = true;
      }
      if (r.state == State::kPulling) {
        begin_cancel(it,
                     Status(static_cast<ErrorCode>(m->code),
                            fmt::format("prefill rank {}: {}", m->prefill_rank, m->text)),
                     actions);
      } else {
        check_done(it, actions);
      }
    }
    run(actions);
  }

  void tick() {
    std::vector<Address> peers;
    {
      std::lock_guard lock(mu_);
      const auto now = Clock::now();
      for (auto it = held_.begin(); it != held_.end();) {
        if (it->until <= now) {
          free_pages(it->pages);
          imms_held_.erase(it->imm);
          it = held_.erase(it);
        } else {
          ++it;
        }
      }
      std::unordered_set<std::string> seen;
      for (auto& [id, r] : requests_) {
        if (r.state == State::kReady) continue;
        for (auto& s : r.sources) {
          if (!s.finished && !s.dead && seen.insert(s.key).second) peers.push_back(s.address);
        }
      }
    }
    if (peers.empty()) return;
    wire::Message ping;
    ping.type = wire::Type::kPing;
    ping.decode_rank = layout_.tp_rank;
    ping.sender = self_;
    Bytes bytes = wire::encode(ping);
    for (auto& p : peers) send(p, bytes);
  }

  TransferEngine& engine_;
  const KvLayout layout_;
  const Registration memory_;
  const Options options_;
  Bytes self_;
  Bytes memory_bytes_;

  mutable std::mutex mu_;
  bool closed_ = false;
  std::vector<bool> page_used_;
  uint32_t free_pages_;
  uint32_t next_imm_ = 0;
  std::unordered_set<uint32_t> imms_held_;
  std::unordered_map<RequestId, Request> requests_;
  std::vector<Held> held_;
  detail::Ticker ticker_;  // last: stopped first
};

Result<std::unique_ptr<KvDecoder>> KvDecoder::create(TransferEngine& engine, const KvLayout& layout,
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
  if (options.imm_count == 0 || options.imm_first + uint64_t{options.imm_count} > (1ull << 32)) {
    return Status(ErrorCode::kInvalidArgument, "Options.imm_first + imm_count exceeds 2^32");
  }
  auto impl = std::make_shared<Impl>(engine, layout, memory, options);
  if (Status st = impl->init(); !st) return st;
  return std::unique_ptr<KvDecoder>(new KvDecoder(std::move(impl)));
}

KvDecoder::KvDecoder(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
KvDecoder::~KvDecoder() {
  impl_->shutdown();
}
Result<std::vector<uint32_t>> KvDecoder::submit(DecodeRequest request) {
  return impl_->submit(std::move(request));
}
Status KvDecoder::cancel(RequestId id) {
  return impl_->cancel(id);
}
Status KvDecoder::release(RequestId id) {
  return impl_->release(id);
}
void KvDecoder::fail_peer(const Address& peer) {
  impl_->fail_peer(peer.to_hex(), Status(ErrorCode::kPeerUnreachable,
                                         "prefill rank " + peer.short_name() + " left"));
}
uint32_t KvDecoder::free_pages() const {
  return impl_->free_page_count();
}
size_t KvDecoder::live_requests() const {
  return impl_->live();
}
const KvLayout& KvDecoder::layout() const {
  return impl_->layout();
}

}  // namespace fabric::kv
