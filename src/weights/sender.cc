// WeightSender: the Ready inbox, the staging ring, the projections into it and the batches of
// writes cut from the schedule's entries. One push at a time (the caller's thread); the
// receive handler (engine callback thread) only fills the inbox, under its own mutex.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>

#include "common/invalid.h"
#include "fabric/weights/flow.h"
#include "fabric/weights_projection.h"
#include "weights/gather_plan.h"
#include "weights/ring.h"
#include "weights/send_plan.h"

namespace fabric::weights {

using fabric::invalid;  // common/invalid.h
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Ready messages by version and inference rank. Shared with the engine's receive handler,
// which may outlive the sender.
struct Inbox {
  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, std::map<uint32_t, Ready>> ready;
};

// The writes of one batch: what the ranges posted in it wait for. Kept alive by every
// transfer's callbacks, so that the counter outlives them whatever the sender does.
struct Batch {
  CompletionCounter counter;
  uint64_t submitted = 0;
};

}  // namespace

class WeightSender::Impl {
 public:
  Impl(TransferEngine& engine, const SenderOptions& options)
      : engine_(engine), options_(options), ring_ranges_(0) {}

  ~Impl() {
    // Writes of an interrupted push still read the ring: wait for them (bounded).
    for (const auto& b : batches_) {
      if (!b->counter.wait(b->submitted, options_.timeout)) break;
    }
  }

  Status init() {
    if (options_.num_nics == 0) return invalid("WeightSender: num_nics is 0");
    return engine_.set_receive_handler([inbox = inbox_](std::span<const std::byte> bytes) {
      auto ready = decode_ready(bytes);
      if (!ready) return;  // not ours
      {
        std::lock_guard lock(inbox->mu);
        inbox->ready[ready->version][ready->inference] = *ready;
      }
      inbox->cv.notify_all();
    });
  }

  Status connect(const Schedule& schedule, std::vector<Endpoint> endpoints,
                 std::vector<Address> addresses, const StagingRing& ring) {
    if (endpoints.size() != schedule.num_inference || addresses.size() != endpoints.size()) {
      return invalid(fmt::format(
          "WeightSender.connect: {} endpoints and {} addresses for a schedule of {} inference "
          "ranks",
          endpoints.size(), addresses.size(), schedule.num_inference));
    }
    if (ring.bytes == 0 || ring.data == nullptr) {
      return invalid("WeightSender.connect: the staging ring is empty");
    }
    std::sort(endpoints.begin(), endpoints.end(),
              [](const Endpoint& a, const Endpoint& b) { return a.layout.rank < b.layout.rank; });
    auto plan = plan_sends(schedule, endpoints, options_.rank);
    if (!plan) return plan.status();
    auto peers = engine_.add_peer_group(addresses);
    if (!peers) return peers.status();
    if (connected_) engine_.remove_peer_group(peers_).ignore();
    // Writes of a push that failed still read the old ring: wait for them before forgetting it.
    drain_quietly();
    schedule_ = schedule;
    plan_ = std::move(*plan);
    endpoints_ = std::move(endpoints);
    peers_ = *peers;
    ring_ = ring;
    ring_ranges_ = RingRanges<std::shared_ptr<Batch>>(ring.bytes);
    batch_limit_ =
        options_.batch_bytes ? options_.batch_bytes : std::max<uint64_t>(1, ring.bytes / 4);
    done_.assign(schedule_.params.size(), false);
    connected_ = true;
    return Status::ok();
  }

  Status begin(uint64_t version, void* stream) {
    if (!connected_) return invalid("WeightSender: push before connect");
    drain_quietly();
    const auto t0 = Clock::now();
    stats_ = PushStats{};
    done_.assign(schedule_.params.size(), false);
    queued_.clear();
    queued_bytes_ = 0;
    stream_ = stream;
    gpu_work_ = false;
    pushing_ = false;
    std::unique_lock lock(inbox_->mu);
    auto have_all = [&] {
      auto it = inbox_->ready.find(version);
      if (it == inbox_->ready.end()) return plan_.targets.empty();
      return std::all_of(plan_.targets.begin(), plan_.targets.end(),
                         [&](uint32_t r) { return it->second.count(r) > 0; });
    };
    if (!inbox_->cv.wait_until(lock, t0 + options_.timeout, have_all)) {
      std::vector<uint32_t> missing;
      auto it = inbox_->ready.find(version);
      for (uint32_t r : plan_.targets) {
        if (it == inbox_->ready.end() || !it->second.count(r)) missing.push_back(r);
      }
      return Status(ErrorCode::kTimeout,
                    fmt::format("version {}: inference ranks [{}] did not prepare within {} s",
                                version, fmt::join(missing, ", "),
                                std::chrono::duration<double>(options_.timeout).count()));
    }
    ready_.assign(endpoints_.size(), Ready{});
    if (auto it = inbox_->ready.find(version); it != inbox_->ready.end()) {
      for (const auto& [r, ready] : it->second) {
        if (r < ready_.size()) ready_[r] = ready;
      }
    }
    // Versions up to this one are done with; later ones may already have arrived.
    inbox_->ready.erase(inbox_->ready.begin(), inbox_->ready.upper_bound(version));
    lock.unlock();
    for (uint32_t r : plan_.targets) {
      const uint32_t copies =
          static_cast<uint32_t>(endpoints_[r].places.empty() ? 1 : endpoints_[r].places[0].size());
      if (ready_[r].copy >= copies) {
        return invalid(fmt::format("version {}: inference rank {} asked for copy {} of {}", version,
                                   r, ready_[r].copy, copies));
      }
    }
    stats_.wait_ready = seconds_since(t0);
    pushing_ = true;
    return Status::ok();
  }

  Status stage(uint32_t param, std::span<const Source> sources, bool persistent) {
    if (!pushing_) return invalid("WeightSender.stage: no push begun");
    if (param >= schedule_.params.size()) {
      return invalid(
          fmt::format("WeightSender.stage: parameter {} of {}", param, schedule_.params.size()));
    }
    if (done_[param] || plan_.entries[param].empty()) return Status::ok();
    const auto t0 = Clock::now();
    const double wait0 = stats_.wait_ring, flush0 = flush_s_;
    Status st = project(param, sources, persistent);
    stats_.project += seconds_since(t0) - (stats_.wait_ring - wait0) - (flush_s_ - flush0);
    if (!st) return st;
    if (queued_bytes_ >= batch_limit_) return flush();
    return Status::ok();
  }

  Result<PushStats> finish() {
    if (!pushing_) return invalid("WeightSender.finish: no push begun");
    pushing_ = false;
    if (Status st = flush(); !st) return st;
    const auto t0 = Clock::now();
    while (!ring_ranges_.empty()) {
      if (Status st = release_oldest(); !st) return st;
    }
    stats_.drain = seconds_since(t0);
    batches_.clear();
    stats_.temp_high_water = ring_ranges_.high_water();
    return stats_;
  }

  Result<PushStats> push(uint64_t version, const std::vector<std::string>& names,
                         std::span<const Source> sources, void* stream) {
    if (names.size() != sources.size()) {
      return invalid(
          fmt::format("WeightSender.push: {} names for {} sources", names.size(), sources.size()));
    }
    if (Status st = begin(version, stream); !st) return st;
    std::unordered_map<std::string_view, size_t> by_name;
    by_name.reserve(names.size());
    for (size_t i = 0; i < names.size(); ++i) by_name.emplace(names[i], i);
    std::vector<Source> in;
    for (uint32_t param : plan_.layout_order) {
      if (done_[param] || plan_.entries[param].empty()) continue;
      const ScheduledParam& p = schedule_.params[param];
      in.clear();
      for (const std::string& s : p.projection.sources) {
        auto it = by_name.find(s);
        if (it == by_name.end()) {
          pushing_ = false;
          return invalid(
              fmt::format("training parameter '{}' (a source of '{}'): this rank "
                          "holds none of it",
                          s, p.name));
        }
        in.push_back(sources[it->second]);
      }
      if (Status st = stage(param, in, /*persistent=*/true); !st) {
        pushing_ = false;
        return st;
      }
    }
    return finish();
  }

  void set_on_posted(std::function<void(uint32_t)> fn) { on_posted_ = std::move(fn); }

  Status plan_gathers(std::vector<TrainerRank> trainers) {
    if (!connected_) return invalid("WeightSender.plan_gathers: before connect");
    if (trainers.size() != schedule_.num_trainers) {
      return invalid(
          fmt::format("WeightSender.plan_gathers: {} training ranks for a schedule "
                      "of {}",
                      trainers.size(), schedule_.num_trainers));
    }
    auto steps = weights::plan_gathers(schedule_, plan_.order, trainers, options_.rank);
    if (!steps) return steps.status();
    gathers_ = std::move(*steps);
    return Status::ok();
  }

  const GatherStep& gather(uint32_t param, uint32_t source) const {
    static const GatherStep kNone;
    if (param >= gathers_.size() || source >= gathers_[param].size()) return kNone;
    return gathers_[param][source];
  }

  const Schedule& schedule() const { return schedule_; }
  const std::vector<uint32_t>& order() const { return plan_.order; }
  bool sends(uint32_t param) const {
    return param < plan_.entries.size() && !plan_.entries[param].empty();
  }

 private:
  struct Queued {
    uint32_t param;
    uint64_t start;  // in the ring
  };

  // Copies `height` rows of `width` bytes; through CUDA when either side is on the GPU.
  Status copy(std::byte* dst, uint64_t dst_pitch, const std::byte* src, uint64_t src_pitch,
              uint64_t width, uint64_t height, bool src_on_gpu) {
    if (ring_.on_gpu || src_on_gpu) {
      gpu_work_ = true;
      return copy_2d_cuda(dst, dst_pitch, src, src_pitch, width, height, stream_);
    }
    for (uint64_t r = 0; r < height && width > 0; ++r) {
      std::memcpy(dst + r * dst_pitch, src + r * src_pitch, width);
    }
    return Status::ok();
  }

  // Concatenates the sources along `dim` of their shapes into dst (identity: one source).
  Status join(std::byte* dst, const ScheduledParam& p, std::span<const Source> sources,
              uint32_t dim, uint32_t element) {
    const Shape& first = p.source_shapes[0];
    uint64_t outer = 1, inner = element, total = 0;
    for (uint32_t d = 0; d < dim && d < first.size(); ++d) outer *= first[d];
    for (size_t d = dim + 1; d < first.size(); ++d) inner *= first[d];
    for (const Shape& s : p.source_shapes) total += (dim < s.size() ? s[dim] : 1) * inner;
    uint64_t at = 0;
    for (size_t i = 0; i < sources.size(); ++i) {
      const Shape& s = p.source_shapes[i];
      const uint64_t row = (dim < s.size() ? s[dim] : 1) * inner;
      if (Status st = copy(dst + at, total, static_cast<const std::byte*>(sources[i].data), row,
                           row, outer, sources[i].on_gpu);
          !st) {
        return st;
      }
      at += row;
    }
    return Status::ok();
  }

  Status project(uint32_t param, std::span<const Source> sources, bool persistent) {
    const ScheduledParam& p = schedule_.params[param];
    if (sources.size() != p.source_shapes.size()) {
      return invalid(fmt::format("parameter '{}': {} sources given, its projection has {}", p.name,
                                 sources.size(), p.source_shapes.size()));
    }
    for (size_t i = 0; i < sources.size(); ++i) {
      const uint64_t want = num_elements(p.source_shapes[i]) * element_bytes(p.source_dtypes[i]);
      if (sources[i].bytes != want || (want > 0 && sources[i].data == nullptr)) {
        return invalid(
            fmt::format("parameter '{}': source '{}' has {} bytes, its shape [{}] of {} has {}",
                        p.name, p.projection.sources[i], sources[i].bytes,
                        fmt::join(p.source_shapes[i], ", "), to_string(p.source_dtypes[i]), want));
      }
    }
    const uint64_t n = num_elements(p.shape) * element_bytes(p.dtype);
    if (!is_fp8(p.projection.kind)) {
      auto start = take(n, p.name);
      if (!start) return start.status();
      std::byte* dst = static_cast<std::byte*>(ring_.data) + *start;
      const uint32_t dim = p.projection.kind == ProjectionKind::kConcat ? p.projection.dim : 0;
      if (Status st = join(dst, p, sources, dim, element_bytes(p.dtype)); !st) return st;
      queue(param, *start, n);
      return Status::ok();
    }
    // FP8: the weight and its scales come from one quantisation, into one ring range (so
    // neither half is reused while the other is pending); several sources (a fused gate/up)
    // are joined first, into the same range.
    const auto [rows, cols] = fp8_matrix(p);
    const uint32_t block = p.projection.block;
    if (block == 0) return invalid(fmt::format("parameter '{}': FP8 block is 0", p.name));
    const Shape tiles = fp8_scale_shape(rows, cols, block);
    const uint64_t q_bytes = rows * cols, s_bytes = tiles[0] * tiles[1] * 4;
    const bool weight = p.projection.kind == ProjectionKind::kFp8Quantize;
    const uint64_t other_n = weight ? s_bytes : q_bytes;
    const bool joined = sources.size() > 1;
    const uint64_t other_at = ring_align(n);
    const uint64_t temp_at = ring_align(other_at + other_n);
    const uint64_t total = joined ? temp_at + rows * cols * 2 : other_at + other_n;
    for (const Source& s : sources) {
      if (s.on_gpu != ring_.on_gpu) {
        return invalid(
            fmt::format("parameter '{}': its FP8 sources must be on the staging ring's side ({})",
                        p.name, ring_.on_gpu ? "GPU" : "CPU"));
      }
    }
    auto start = take(total, p.name);
    if (!start) return start.status();
    std::byte* base = static_cast<std::byte*>(ring_.data) + *start;
    std::byte* q = weight ? base : base + other_at;
    auto* scales = reinterpret_cast<float*>(weight ? base + other_at : base);
    const void* input = sources[0].data;
    if (joined) {
      if (Status st = join(base + temp_at, p, sources, p.projection.dim, 2); !st) return st;
      input = base + temp_at;
    }
    if (ring_.on_gpu) {
      gpu_work_ = true;
      auto& group = pending_fp8_[block];
      group.push_back(Fp8Matrix{input, rows, cols, q, scales});
      ++pending_count_;
      // Sources that may be freed after this call are quantised at once; others wait for a
      // launch of 64 matrices (the kernel's group) or the batch's end.
      if (!persistent || pending_count_ >= 64) {
        if (Status st = launch_fp8(); !st) return st;
      }
    } else {
      if (Status st = quantize_fp8_blocks_cpu(
              std::span(static_cast<const uint16_t*>(input), rows * cols), rows, cols, block,
              std::span(reinterpret_cast<uint8_t*>(q), rows * cols),
              std::span(scales, tiles[0] * tiles[1]));
          !st) {
        return Status(st.code(), fmt::format("parameter '{}': {}", p.name, st.message()));
      }
    }
    queue(param, *start, n);
    const int64_t partner = plan_.partner[param];
    if (partner >= 0 && sends(static_cast<uint32_t>(partner))) {
      done_[static_cast<size_t>(partner)] = true;
      queue(static_cast<uint32_t>(partner), *start + other_at, other_n);
    }
    return Status::ok();
  }

  void queue(uint32_t param, uint64_t start, uint64_t n) {
    done_[param] = true;
    queued_.push_back(Queued{param, start});
    queued_bytes_ += n;
  }

  Status launch_fp8() {
    for (auto& [block, group] : pending_fp8_) {
      if (group.empty()) continue;
      Status st = quantize_fp8_blocks_cuda_many(group, block, stream_);
      group.clear();
      if (!st) return st;
    }
    pending_count_ = 0;
    return Status::ok();
  }

  // n bytes of the ring, held at once; waits (posting what is queued, when the oldest range is
  // not posted yet) for older ranges' writes to complete.
  Result<uint64_t> take(uint64_t n, const std::string& name) {
    if (n > ring_ranges_.size()) {
      return invalid(fmt::format(
          "parameter '{}': its projection needs {} bytes, more than max_temp_bytes ({})", name, n,
          ring_ranges_.size()));
    }
    for (;;) {
      const uint64_t start = ring_ranges_.next_start(n);
      if (!ring_ranges_.overlaps(start, n)) {
        ring_ranges_.hold(start, n);
        return start;
      }
      // The oldest range's writes must be posted to be waited on; only then is what is queued
      // posted early (flushing before every wait posted one parameter at a time).
      if (!ring_ranges_.oldest().held) {
        if (Status st = flush(); !st) return st;
      }
      const auto t0 = Clock::now();
      Status st = release_oldest();
      stats_.wait_ring += seconds_since(t0);
      if (!st) return st;
    }
  }

  Status release_oldest() {
    std::shared_ptr<Batch> batch = ring_ranges_.oldest().held;
    ring_ranges_.release_oldest();
    if (!batch) return Status::ok();  // never posted (a failed push)
    if (!batch->counter.wait(batch->submitted, options_.timeout)) {
      return Status(ErrorCode::kTimeout,
                    fmt::format("weights push: writes not complete after {} s",
                                std::chrono::duration<double>(options_.timeout).count()));
    }
    if (batch->counter.failed() > 0) return batch->counter.first_error();
    return Status::ok();
  }

  // What a failed push left in flight: waited for, errors dropped.
  void drain_quietly() {
    while (!ring_ranges_.empty()) release_oldest().ignore();
    pending_fp8_.clear();
    pending_count_ = 0;
    batches_.clear();
  }

  Callbacks callbacks(const std::shared_ptr<Batch>& batch) {
    Callbacks c;
    c.counter = &batch->counter;
    c.on_done = [batch] {};
    c.on_error = [batch](const Status&) {};
    ++batch->submitted;
    ++stats_.writes;
    return c;
  }

  // Posts the queued parameters' writes: contiguous entries as one scatter per inference rank
  // (each target counts one immediate, as a single write would), strided ones as paged writes;
  // with several NICs every entry is its own write pinned to the schedule's NIC.
  Status flush() {
    if (queued_.empty()) return Status::ok();
    const auto t_flush = Clock::now();
    if (Status st = launch_fp8(); !st) return st;
    if (gpu_work_) {
      if (Status st = synchronize_cuda(stream_); !st) return st;
      gpu_work_ = false;
    }
    stats_.project += seconds_since(t_flush);
    const auto t_post = Clock::now();
    auto batch = std::make_shared<Batch>();
    batches_.push_back(batch);
    // The queued ranges are the newest live ones: they wait for this batch.
    for (auto it = ring_ranges_.live().rbegin(); it != ring_ranges_.live().rend() && !it->held;
         ++it) {
      it->held = batch;
    }
    scatter_.resize(endpoints_.size());
    for (auto& t : scatter_) t.clear();
    Status failed;
    for (const Queued& q : queued_) {
      for (const Entry& e : plan_.entries[q.param]) {
        stats_.bytes += e.bytes();
        const Ready& ready = ready_[e.inference];
        const Endpoint& ep = endpoints_[e.inference];
        const Place& place =
            ep.places[static_cast<size_t>(plan_.local[e.inference][q.param])][ready.copy];
        const RemoteMemory& dst = ep.regions[place.region];
        if (e.runs == 1 && options_.num_nics == 1) {
          scatter_[e.inference].push_back(
              ScatterTarget{dst, e.length, q.start + e.src_offset, place.offset + e.dst_offset});
          continue;
        }
        Result<TransferId> id = TransferId{0};
        if (e.runs == 1) {
          SingleWrite w{ring_.registration.handle,
                        q.start + e.src_offset,
                        dst,
                        place.offset + e.dst_offset,
                        e.length,
                        ready.imm,
                        Routing::pinned(e.nic)};
          id = engine_.submit(w, callbacks(batch));
        } else {
          PagedWrite w;
          w.src = ring_.registration.handle;
          w.dst = dst;
          w.page_bytes = e.length;
          w.src_pages.resize(e.runs);
          for (uint32_t i = 0; i < e.runs; ++i) w.src_pages[i] = i;
          w.dst_pages = w.src_pages;
          w.src_stride = e.src_stride;
          w.src_offset = q.start + e.src_offset;
          w.dst_stride = e.dst_stride;
          w.dst_offset = place.offset + e.dst_offset;
          w.imm = ready.imm;
          id = engine_.submit(w, callbacks(batch));
        }
        if (!id) {
          --batch->submitted;
          --stats_.writes;
          if (failed.is_ok()) failed = id.status();
        }
      }
    }
    for (uint32_t r = 0; r < scatter_.size() && failed.is_ok(); ++r) {
      if (scatter_[r].empty()) continue;
      Scatter s;
      s.src = ring_.registration.handle;
      s.group = peers_;
      s.targets = std::move(scatter_[r]);
      s.imm = ready_[r].imm;
      auto id = engine_.submit(s, callbacks(batch));
      if (!id) {
        --batch->submitted;
        --stats_.writes;
        failed = id.status();
      }
    }
    stats_.post += seconds_since(t_post);
    std::vector<uint32_t> posted;
    posted.reserve(queued_.size());
    for (const Queued& q : queued_) posted.push_back(q.param);
    queued_.clear();
    queued_bytes_ = 0;
    flush_s_ += seconds_since(t_flush);
    if (!failed.is_ok()) return failed;
    if (on_posted_) {
      for (uint32_t p : posted) on_posted_(p);
    }
    return Status::ok();
  }

  TransferEngine& engine_;
  SenderOptions options_;

  std::shared_ptr<Inbox> inbox_ = std::make_shared<Inbox>();

  bool connected_ = false;
  Schedule schedule_;
  SendPlan plan_;                    // plan_sends(schedule_, endpoints_, rank)
  std::vector<Endpoint> endpoints_;  // by inference rank
  PeerGroup peers_;
  StagingRing ring_;
  RingRanges<std::shared_ptr<Batch>> ring_ranges_;
  uint64_t batch_limit_ = 1;
  std::function<void(uint32_t)> on_posted_;
  std::vector<std::vector<GatherStep>> gathers_;  // [param][source], this rank's

  // One push.
  bool pushing_ = false;
  std::vector<Ready> ready_;  // by inference rank
  void* stream_ = nullptr;
  bool gpu_work_ = false;  // CUDA work enqueued since the last synchronisation
  std::vector<bool> done_;
  std::vector<Queued> queued_;  // staged, not posted
  uint64_t queued_bytes_ = 0;
  std::map<uint32_t, std::vector<Fp8Matrix>> pending_fp8_;  // by block, not launched yet
  uint64_t pending_count_ = 0;
  std::vector<std::shared_ptr<Batch>> batches_;
  std::vector<std::vector<ScatterTarget>> scatter_;  // per inference rank, reused
  PushStats stats_;
  double flush_s_ = 0;
};

WeightSender::WeightSender(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
WeightSender::~WeightSender() = default;

Result<std::unique_ptr<WeightSender>> WeightSender::create(TransferEngine& engine,
                                                           const SenderOptions& options) {
  auto impl = std::make_unique<Impl>(engine, options);
  if (Status st = impl->init(); !st) return st;
  return std::unique_ptr<WeightSender>(new WeightSender(std::move(impl)));
}

Status WeightSender::connect(const Schedule& schedule, std::vector<Endpoint> endpoints,
                             std::vector<Address> addresses, const StagingRing& ring) {
  return impl_->connect(schedule, std::move(endpoints), std::move(addresses), ring);
}
const Schedule& WeightSender::schedule() const {
  return impl_->schedule();
}
const std::vector<uint32_t>& WeightSender::order() const {
  return impl_->order();
}
bool WeightSender::sends(uint32_t param) const {
  return impl_->sends(param);
}
Status WeightSender::begin(uint64_t version, void* stream) {
  return impl_->begin(version, stream);
}
Status WeightSender::stage(uint32_t param, std::span<const Source> sources, bool persistent) {
  return impl_->stage(param, sources, persistent);
}
Result<PushStats> WeightSender::finish() {
  return impl_->finish();
}
Result<PushStats> WeightSender::push(uint64_t version, const std::vector<std::string>& names,
                                     std::span<const Source> sources, void* stream) {
  return impl_->push(version, names, sources, stream);
}
Status WeightSender::plan_gathers(std::vector<TrainerRank> trainers) {
  return impl_->plan_gathers(std::move(trainers));
}
const GatherStep& WeightSender::gather(uint32_t param, uint32_t source) const {
  return impl_->gather(param, source);
}
void WeightSender::set_on_posted(std::function<void(uint32_t)> fn) {
  impl_->set_on_posted(std::move(fn));
}

}  // namespace fabric::weights
