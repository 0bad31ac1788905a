#include "ops.h"

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <numeric>
#include <random>

namespace fabric::bench {

namespace {

// Bounds on waiting, so that a broken fabric fails the run instead of hanging it.
constexpr milliseconds kPassTimeout{60'000};
constexpr milliseconds kRoundTimeout{10'000};
// Immediates: the ones peers answer (imm-only round trips, barriers), the warm-up, and from
// kFirstPassImm on one fresh value per pass, so that each pass counts only its own arrivals.
constexpr uint32_t kPing = 1;
constexpr uint32_t kPong = 2;
constexpr uint32_t kWarmupImm = 3;
// Source offsets are multiples of this.
constexpr uint64_t kSourceAlign = 4096;
// Untimed round trips before the timed ones.
constexpr uint64_t kWarmupRounds = 20;

double us(Clock::duration d) {
  return std::chrono::duration<double, std::micro>(d).count();
}

// Completion of a numbered sequence of transfers, with the time each finished. The window rule
// of a pass is "submit transfer i only once every transfer below i - window has finished".
// Shared with the callbacks, which may outlive an abandoned pass.
class Completions {
 public:
  // `drive`: a caller-driven group's progress() (Config caller_progress): the waits run it,
  // since nothing else moves the group and its callbacks run inside it. Empty: waits block.
  // `hold`: kept while the waits may drive (Session::foreground()).
  explicit Completions(size_t total, std::function<bool()> drive = {},
                       std::shared_ptr<void> hold = {})
      : state_(std::make_shared<State>(total)), drive_(std::move(drive)), hold_(std::move(hold)) {}

  Callbacks callbacks(size_t index) {
    return Callbacks{[st = state_, index] { st->finish(index, Status::ok()); },
                     [st = state_, index](const Status& s) { st->finish(index, s); }};
  }
  // Blocks until transfers [0, n) have all finished (done or failed); false at the deadline.
  bool wait_prefix(size_t n, Clock::time_point deadline) const {
    if (drive_) {
      for (;;) {
        {
          std::lock_guard lock(state_->mu);
          if (state_->prefix >= n) return true;
        }
        if (Clock::now() >= deadline) return false;
        drive_();
      }
    }
    std::unique_lock lock(state_->mu);
    return state_->cv.wait_until(lock, deadline, [&] { return state_->prefix >= n; });
  }
  size_t failed() const {
    std::lock_guard lock(state_->mu);
    return state_->failed;
  }
  Status first_error() const {
    std::lock_guard lock(state_->mu);
    return state_->first_error;
  }
  // When transfer i finished; only valid once wait_prefix covered it.
  Clock::time_point done_at(size_t i) const {
    std::lock_guard lock(state_->mu);
    return state_->done_at[i];
  }
  Status status() const {
    std::lock_guard lock(state_->mu);
    if (state_->failed == 0) return Status::ok();
    return Status(state_->first_error.code(),
                  fmt::format("{} transfer(s) failed, first: {}", state_->failed,
                              state_->first_error.message()));
  }

 private:
  struct State {
    explicit State(size_t total) : finished(total, 0), done_at(total) {}
    void finish(size_t index, const Status& s) {
      const auto now = Clock::now();
      {
        std::lock_guard lock(mu);
        finished[index] = 1;
        done_at[index] = now;
        while (prefix < finished.size() && finished[prefix]) ++prefix;
        if (!s && failed++ == 0) first_error = s;
      }
      cv.notify_all();
    }
    std::mutex mu;
    std::condition_variable cv;
    std::vector<uint8_t> finished;
    std::vector<Clock::time_point> done_at;
    size_t prefix = 0;  // transfers [0, prefix) have all finished
    size_t failed = 0;
    Status first_error;
  };
  std::shared_ptr<State> state_;
  std::function<bool()> drive_;
  std::shared_ptr<void> hold_;
};

}  // namespace

std::string_view op_name(Op op) {
  switch (op) {
    case Op::kSingle:
      return "single";
    case Op::kPaged:
      return "paged";
    case Op::kImm:
      return "imm";
    case Op::kScatter:
      return "scatter";
    case Op::kBarrier:
      return "barrier";
    case Op::kRead:
      return "read";
    case Op::kPagedRead:
      return "paged-read";
    case Op::kReadRtt:
      return "read-rtt";
  }
  return "?";
}

bool is_read(Op op) {
  return op == Op::kRead || op == Op::kPagedRead || op == Op::kReadRtt;
}

std::string Row::label() const {
  switch (op) {
    case Op::kSingle:
      return fmt::format("single {}", human_bytes(bytes));
    case Op::kPaged:
      return fmt::format("paged {} x {}", human_bytes(page_bytes), pages);
    case Op::kImm:
      return "imm";
    case Op::kScatter:
      return fmt::format("scatter {} x {} peers", human_bytes(bytes), peers);
    case Op::kBarrier:
      return fmt::format("barrier {} peers", peers);
    case Op::kRead:
      return fmt::format("read {}", human_bytes(bytes));
    case Op::kPagedRead:
      return fmt::format("paged read {} x {}", human_bytes(page_bytes), pages);
    case Op::kReadRtt:
      return fmt::format("read round trips {}", human_bytes(bytes));
  }
  return "?";
}

Plan plan_for(const Row& row, const Budget& b) {
  Plan p;
  switch (row.op) {
    case Op::kSingle:
    case Op::kRead:
      p.transfers = std::clamp<uint64_t>(b.pass_bytes / row.bytes, 2, b.max_transfers);
      p.wrs = p.transfers;
      p.bytes = p.transfers * row.bytes;
      break;
    case Op::kPaged:
    case Op::kPagedRead: {
      const uint64_t per_transfer = row.page_bytes * row.pages;
      const uint64_t most = std::max<uint64_t>(1, b.max_pages / row.pages);
      p.transfers = std::clamp<uint64_t>(b.pass_bytes / per_transfer, 1, most);
      p.wrs = p.transfers * row.pages;
      p.bytes = p.transfers * per_transfer;
      break;
    }
    case Op::kScatter:
      p.transfers =
          std::clamp<uint64_t>(b.pass_bytes / (row.bytes * row.peers), 2, b.max_transfers);
      p.wrs = p.transfers * row.peers;
      p.bytes = p.wrs * row.bytes;
      break;
    case Op::kImm:
      p.transfers = b.messages;
      p.wrs = b.messages;
      break;
    case Op::kBarrier:
      p.transfers = b.rounds;
      p.wrs = b.rounds * row.peers;
      break;
    case Op::kReadRtt:
      p.transfers = b.rounds;
      p.wrs = b.rounds;
      p.bytes = b.rounds * row.bytes;
      break;
  }
  p.window = row.op == Op::kReadRtt ? 1 : std::min(b.window, p.transfers);
  return p;
}

// --- Session -----------------------------------------------------------------------------------

Session::Session(TransferEngine& engine, Registration src, const PageBuffer& src_bytes,
                 StartPeer start_peer, uint64_t seed)
    : engine_(engine),
      src_(std::move(src)),
      src_bytes_(src_bytes),
      start_peer_(std::move(start_peer)),
      seed_(seed) {}

Session::~Session() {
  {
    std::lock_guard lock(between_mu_);
    stop_between_ = true;
  }
  between_cv_.notify_all();
  if (between_.joinable()) between_.join();
  // Before read_dst_ goes (a closed engine refuses, having let go of it already).
  if (read_dst_reg_) engine_.unregister_memory(read_dst_reg_->handle).ignore();
}

std::function<bool()> Session::driver() {
  if (!caller_driven_) return {};
  return [this] { return engine_.progress(0); };
}

void Session::set_caller_driven(bool on) {
  caller_driven_ = on;
  if (!on || between_.joinable()) return;
  // Between the timed phases (peer commands, verification) nothing else drives the group, yet
  // peers need answers from it (a peer's unregister fences this writer): a thread of ours
  // drives it then, napping while idle, and stands aside while a phase's waits drive it.
  between_ = std::thread([this] {
    auto idle_since = Clock::now();
    std::unique_lock lock(between_mu_);
    while (!stop_between_) {
      // Blocked, not napping, through a phase: its counts (sys/op, csw/op) stay the phase's.
      between_cv_.wait(lock, [this] { return stop_between_ || foreground_ == 0; });
      lock.unlock();
      // Idle: naps that grow (50 us, then 2 ms after 50 ms), so that the baselines run
      // between our passes keep the cores.
      if (engine_.progress(0)) {
        idle_since = Clock::now();
      } else {
        std::this_thread::sleep_for(Clock::now() - idle_since > std::chrono::milliseconds(50)
                                        ? std::chrono::microseconds(2000)
                                        : std::chrono::microseconds(50));
      }
      lock.lock();
    }
  });
}

std::shared_ptr<void> Session::foreground() {
  if (!caller_driven_) return {};
  {
    std::lock_guard lock(between_mu_);
    ++foreground_;
  }
  return std::shared_ptr<void>(nullptr, [this](void*) {
    std::lock_guard lock(between_mu_);
    if (--foreground_ == 0) between_cv_.notify_all();
  });
}

Status Session::ensure_peers(uint32_t n) {
  while (peers_.size() < n) {
    auto p = start_peer_();
    if (!p) return p.status();
    // Every peer answers kPing with kPong: imm-only round trips and barriers use it.
    if (Status s = (*p)->answer(kPing, kPong); !s) return s;
    peers_.push_back(std::move(*p));
  }
  return Status::ok();
}

Status Session::warm_up() {
  Completions done(peers_.size(), driver(), foreground());
  for (size_t i = 0; i < peers_.size(); ++i) {
    ImmWrite w;
    w.peer = peers_[i]->address();
    w.imm = kWarmupImm;
    auto id = engine_.submit(w, done.callbacks(i));
    if (!id) return id.status();
  }
  if (!done.wait_prefix(peers_.size(), Clock::now() + kPassTimeout)) {
    return Status(ErrorCode::kTimeout, "the warm-up immediates did not complete");
  }
  return done.status();
}

Status Session::quit_peers() {
  Status first;
  for (auto& p : peers_) {
    if (Status s = p->quit(); !s && first.is_ok()) first = s;
  }
  peers_.clear();
  return first;
}

Result<PassResult> Session::run(const Row& row, const Budget& b, uint32_t iteration) {
  switch (row.op) {
    case Op::kSingle:
      return single(row, b, iteration);
    case Op::kPaged:
      return paged(row, b, iteration);
    case Op::kImm:
      return imm(row, b, iteration);
    case Op::kScatter:
      return scatter(row, b, iteration);
    case Op::kBarrier:
      return barrier(row, b, iteration);
    case Op::kRead:
      return read(row, b, iteration);
    case Op::kPagedRead:
      return paged_read(row, b, iteration);
    case Op::kReadRtt:
      return read_rtt(row, b, iteration);
  }
  return Status(ErrorCode::kInvalidArgument, "unknown operation");
}

namespace {

// A worker count over a pass, per op of the pass (NaN for a pass without ops).
double per_op(uint64_t count, uint64_t ops) {
  return ops == 0 ? std::nan("") : static_cast<double>(count) / static_cast<double>(ops);
}

}  // namespace

void Session::count_per_op(PassResult& r, const Window& w) {
  r.wakeups_per_op = per_op(w.wakeups, r.ops);
  r.sleeps_per_op = per_op(w.sleeps, r.ops);
  const double ops = r.ops == 0 ? std::nan("") : static_cast<double>(r.ops);
  r.syscalls_per_op = w.sys.syscalls / ops;
  r.switches_per_op = w.sys.context_switches / ops;
}

Session::Window Session::run_window(uint64_t count, uint64_t window, const SubmitFn& submit,
                                    const std::vector<Expectation>& expects) {
  Window w;
  Completions done(count, driver(), foreground());
  std::vector<Clock::time_point> submitted_at(count);
  const GroupStats before = engine_.stats().groups[0];
  const SysCounters::Totals sys_before = sys_.read();
  const auto start = Clock::now();
  const auto deadline = start + kPassTimeout;
  for (uint64_t i = 0; i < count; ++i) {
    if (i >= window && !done.wait_prefix(i - window + 1, deadline)) break;
    if (done.failed() > 0) break;
    // The callbacks are made before the clock starts: post us is the time inside submit().
    Callbacks callbacks = done.callbacks(i);
    const auto t0 = Clock::now();
    submitted_at[i] = t0;
    Result<TransferId> id = submit(i, std::move(callbacks));
    w.submit_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    if (!id) {
      w.error = id.status();
      break;
    }
    ++w.submitted;
  }
  Status finished;
  if (!done.wait_prefix(w.submitted, deadline)) {
    finished = Status(ErrorCode::kTimeout, "transfers did not complete within the timeout");
  } else {
    finished = done.status();
  }
  for (size_t k = 0; k < expects.size() && finished.is_ok() && w.submitted == count; ++k) {
    const Expectation& e = expects[k];
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    finished = peers_[e.peer]->expect(e.imm, e.count, std::max(left, milliseconds(1)));
  }
  w.seconds = seconds_since(start);
  const SysCounters::Totals sys_after = sys_.read();
  w.sys.syscalls = sys_after.syscalls - sys_before.syscalls;
  w.sys.context_switches = sys_after.context_switches - sys_before.context_switches;
  const GroupStats after = engine_.stats().groups[0];
  w.wakeups = after.worker_wakeups - before.worker_wakeups;
  w.sleeps = after.worker_sleeps - before.worker_sleeps;
  if (w.error.is_ok()) w.error = finished;
  if (w.error.is_ok() && w.submitted != count) {
    w.error = Status(ErrorCode::kTimeout, "transfers did not complete within the timeout");
  }
  if (w.error.is_ok()) {
    w.lat_us.reserve(count);
    for (uint64_t i = 0; i < count; ++i) w.lat_us.push_back(us(done.done_at(i) - submitted_at[i]));
  }
  return w;
}

Result<double> Session::cpu_of(size_t peers) {
  double total = cpu_seconds();
  for (size_t i = 0; i < peers; ++i) {
    auto c = peers_[i]->cpu();
    if (!c) return c.status();
    total += *c;
  }
  return total;
}

uint64_t Session::src_offset(uint32_t iteration, uint64_t i, uint64_t size) const {
  const uint64_t positions = (src_bytes_.size() - size) / kSourceAlign + 1;
  return ((iteration * 1000003ull + i) * 7919 + 13) % positions * kSourceAlign;
}

Status Session::verify(PeerClient& peer, uint64_t len, uint64_t first, uint64_t step,
                       uint64_t count, const std::function<uint64_t(uint64_t k)>& expected,
                       const std::function<std::string(uint64_t k)>& describe) {
  auto expected_of = [&](uint64_t lo, uint64_t n) {
    uint64_t h = kHashSeed;
    for (uint64_t k = lo; k < lo + n; ++k) h = hash_combine(h, expected(k));
    return h;
  };
  auto got = peer.hash(len, first, step, count);
  if (!got) return got.status();
  if (*got == expected_of(0, count)) return Status::ok();
  // Narrow down to the first bad range: the first half that differs, log2(count) requests.
  uint64_t lo = 0, n = count;
  while (n > 1) {
    const uint64_t half = n / 2;
    auto h = peer.hash(len, first + lo * step, step, half);
    if (!h) return h.status();
    if (*h == expected_of(lo, half)) {
      lo += half;
      n -= half;
    } else {
      n = half;
    }
  }
  return Status(ErrorCode::kInternal,
                fmt::format("verification failed: {} (bytes [{}, {}) at peer {})", describe(lo),
                            first + lo * step, first + lo * step + len, peer.pid()));
}

Status Session::verify_local(uint64_t len, uint64_t first, uint64_t step, uint64_t count,
                             const std::function<uint64_t(uint64_t k)>& expected,
                             const std::function<std::string(uint64_t k)>& describe) const {
  for (uint64_t k = 0; k < count; ++k) {
    const uint64_t at = first + k * step;
    if (hash_bytes(read_dst_.data() + at, len) != expected(k)) {
      return Status(ErrorCode::kInternal,
                    fmt::format("verification failed: {} (bytes [{}, {}) of the client's read "
                                "destination)",
                                describe(k), at, at + len));
    }
  }
  return Status::ok();
}

Status Session::prepare_reads(uint64_t dst_bytes) {
  PeerClient& peer = *peers_[0];
  if (!src_hash_) src_hash_ = hash_bytes(src_bytes_.data(), src_bytes_.size());
  if (Status s = peer.ensure_source(src_bytes_.size(), seed_); !s) return s;
  if (peer.source_hash() != *src_hash_) {
    return Status(ErrorCode::kInternal,
                  fmt::format("peer {}: its read source does not hold the client's pattern "
                              "(hash {:016x}, expected {:016x})",
                              peer.pid(), peer.source_hash(), *src_hash_));
  }
  if (!peer.source().readable()) {
    return Status(ErrorCode::kInternal,
                  fmt::format("peer {}: its read source's descriptor is not readable", peer.pid()));
  }
  if (read_dst_.size() < dst_bytes) {
    if (read_dst_reg_) {
      if (Status s = engine_.unregister_memory(read_dst_reg_->handle); !s) return s;
      read_dst_reg_.reset();
    }
    read_dst_ = PageBuffer();  // the old buffer goes before the new one comes
    read_dst_ = PageBuffer(dst_bytes);
    if (read_dst_.data() == nullptr) {
      return Status(ErrorCode::kOutOfRange,
                    fmt::format("cannot allocate a {}-byte read destination", dst_bytes));
    }
    auto reg = engine_.register_memory(read_dst_.data(), read_dst_.size());
    if (!reg) return reg.status();
    read_dst_reg_ = *reg;
  }
  std::memset(read_dst_.data(), static_cast<int>(kPoison), dst_bytes);
  return serve_reads(true);
}

Status Session::serve_reads(bool on) {
  return caller_driven_ ? peers_[0]->serving(on) : Status::ok();
}

Result<PeerGroup> Session::group_of(uint32_t n) {
  if (auto it = groups_.find(n); it != groups_.end()) return it->second;
  std::vector<Address> members;
  for (uint32_t i = 0; i < n; ++i) members.push_back(peers_[i]->address());
  auto g = engine_.add_peer_group(std::move(members));
  if (!g) return g.status();
  groups_.emplace(n, *g);
  return *g;
}

// --- the operations ----------------------------------------------------------------------------

Result<PassResult> Session::single(const Row& row, const Budget& b, uint32_t iteration) {
  const Plan plan = plan_for(row, b);
  const uint64_t size = row.bytes;
  PeerClient& peer = *peers_[0];
  if (Status s = peer.ensure_buffer(plan.bytes); !s) return s;
  if (Status s = peer.poison(0, plan.bytes); !s) return s;
  const uint32_t imm = fresh_imm();
  auto cpu0 = cpu_of(1);
  if (!cpu0) return cpu0.status();
  // Write i lands in its own slot i, so that every write of the pass can be verified.
  // One request, its offsets set per write: copying the descriptor (a reference count) is
  // the caller's cost, not submit()'s, as paged and scatter rows build theirs before the pass.
  SingleWrite sw;
  sw.src = src_.handle;
  sw.dst = peer.memory();
  sw.length = size;
  sw.imm = imm;
  Window w = run_window(plan.transfers, plan.window,
                        [&](uint64_t i, Callbacks cb) {
                          sw.src_offset = src_offset(iteration, i, size);
                          sw.dst_offset = i * size;
                          return engine_.submit(sw, std::move(cb));
                        },
                        {{0, imm, plan.transfers}});
  auto cpu1 = cpu_of(1);
  if (!w.error) return w.error;
  if (!cpu1) return cpu1.status();
  if (Status s = verify(
          peer, size, 0, size, plan.transfers,
          [&](uint64_t i) {
            return hash_bytes(src_bytes_.data() + src_offset(iteration, i, size), size);
          },
          [&](uint64_t i) { return fmt::format("single write {} of the pass", i); });
      !s) {
    return s;
  }
  PassResult r;
  r.seconds = w.seconds;
  r.bytes = plan.bytes;
  r.ops = plan.transfers;
  r.post_us = w.submit_seconds * 1e6 / static_cast<double>(plan.wrs);
  count_per_op(r, w);
  r.cpu_seconds = *cpu1 - *cpu0;
  r.lat_us = std::move(w.lat_us);
  return r;
}

Result<PassResult> Session::paged(const Row& row, const Budget& b, uint32_t iteration) {
  const Plan plan = plan_for(row, b);
  const uint64_t page = row.page_bytes;
  const uint64_t stride = page + kPageGap;
  const uint64_t dst_pages = plan.transfers * row.pages;
  const uint64_t dst_bytes = dst_pages * stride;
  const uint64_t src_pages = src_bytes_.size() / stride;
  if (dst_pages > UINT32_MAX || src_pages == 0) {
    return Status(ErrorCode::kOutOfRange, fmt::format("{}: too many pages", row.label()));
  }
  PeerClient& peer = *peers_[0];
  if (Status s = peer.ensure_buffer(dst_bytes); !s) return s;
  if (Status s = peer.poison(0, dst_bytes); !s) return s;

  // Page lists, drawn before the clock starts. Destination pages: a random permutation of the
  // pass's pages, so that no page is written twice in a pass. Source pages: random, repeats
  // allowed. from[d]: the source page that lands in destination page d.
  std::mt19937_64 rng(seed_ * 1000003 + iteration * 7919 + page * 31 + row.pages);
  std::vector<uint32_t> perm(dst_pages);
  std::iota(perm.begin(), perm.end(), 0u);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::uniform_int_distribution<uint32_t> any_src(0, static_cast<uint32_t>(src_pages - 1));
  std::vector<uint32_t> from(dst_pages);
  std::vector<PagedWrite> writes(plan.transfers);
  const uint32_t imm = fresh_imm();
  for (uint64_t j = 0; j < plan.transfers; ++j) {
    PagedWrite& w = writes[j];
    w.src = src_.handle;
    w.dst = peer.memory();
    w.page_bytes = page;
    w.src_stride = stride;
    w.dst_stride = stride;
    w.imm = imm;
    w.dst_pages.assign(perm.begin() + static_cast<ptrdiff_t>(j * row.pages),
                       perm.begin() + static_cast<ptrdiff_t>((j + 1) * row.pages));
    w.src_pages.resize(row.pages);
    for (uint64_t i = 0; i < row.pages; ++i) {
      w.src_pages[i] = any_src(rng);
      from[w.dst_pages[i]] = w.src_pages[i];
    }
  }

  auto cpu0 = cpu_of(1);
  if (!cpu0) return cpu0.status();
  Window w =
      run_window(plan.transfers, plan.window,
                 [&](uint64_t j, Callbacks cb) { return engine_.submit(writes[j], std::move(cb)); },
                 {{0, imm, dst_pages}});
  auto cpu1 = cpu_of(1);
  if (!w.error) return w.error;
  if (!cpu1) return cpu1.status();
  if (Status s = verify(
          peer, page, 0, stride, dst_pages,
          [&](uint64_t d) {
            return hash_bytes(src_bytes_.data() + static_cast<uint64_t>(from[d]) * stride, page);
          },
          [&](uint64_t d) {
            return fmt::format("destination page {} (source page {})", d, from[d]);
          });
      !s) {
    return s;
  }
  std::vector<std::byte> poison(kPageGap, kPoison);
  const uint64_t gap_hash = hash_bytes(poison.data(), poison.size());
  if (Status s = verify(
          peer, kPageGap, page, stride, dst_pages, [&](uint64_t) { return gap_hash; },
          [&](uint64_t d) {
            return fmt::format("the gap after destination page {} was written", d);
          });
      !s) {
    return s;
  }
  PassResult r;
  r.seconds = w.seconds;
  r.bytes = plan.bytes;
  r.ops = plan.wrs;
  r.post_us = w.submit_seconds * 1e6 / static_cast<double>(plan.wrs);
  count_per_op(r, w);
  r.cpu_seconds = *cpu1 - *cpu0;
  r.lat_us = std::move(w.lat_us);
  return r;
}

Result<PassResult> Session::imm(const Row& row, const Budget& b, uint32_t iteration) {
  (void)iteration;
  const Plan plan = plan_for(row, b);
  PeerClient& peer = *peers_[0];
  PassResult r;

  // Round trips: an imm-only write to the peer, whose answer (an imm-only write back) the
  // client waits for with wait_imm. Untimed warm-up round trips first.
  const uint64_t rounds = kWarmupRounds + b.rounds;
  const uint64_t base = engine_.imm_count(kPong);
  const auto deadline = Clock::now() + kPassTimeout;
  Completions pings(rounds, driver(), foreground());
  for (uint64_t k = 0; k < rounds; ++k) {
    if (Clock::now() > deadline) {
      return Status(ErrorCode::kTimeout, fmt::format("{} of {} round trips in {} s", k, rounds,
                                                     kPassTimeout.count() / 1000));
    }
    ImmWrite w;
    w.peer = peer.address();
    w.imm = kPing;
    const auto t0 = Clock::now();
    auto id = engine_.submit(w, pings.callbacks(k));
    if (!id) return id.status();
    if (!engine_.wait_imm(kPong, base + k + 1, kRoundTimeout)) {
      return Status(ErrorCode::kTimeout,
                    fmt::format("round trip {}: no answer within {} ms", k, kRoundTimeout.count()));
    }
    if (k >= kWarmupRounds) r.lat_us.push_back(us(Clock::now() - t0));
  }
  if (!pings.wait_prefix(rounds, Clock::now() + kPassTimeout)) {
    return Status(ErrorCode::kTimeout, "round-trip writes did not complete");
  }
  if (Status s = pings.status(); !s) return s;
  if (engine_.imm_count(kPong) != base + rounds) {
    return Status(ErrorCode::kInternal, fmt::format("{} answers arrived for {} round trips",
                                                    engine_.imm_count(kPong) - base, rounds));
  }

  // Message rate: imm-only writes, a window in flight, all counted by the peer.
  const uint32_t imm = fresh_imm();
  auto cpu0 = cpu_of(1);
  if (!cpu0) return cpu0.status();
  ImmWrite iw;  // one request for the pass, as in single()
  iw.peer = peer.address();
  iw.imm = imm;
  Window w = run_window(plan.transfers, plan.window,
                        [&](uint64_t, Callbacks cb) { return engine_.submit(iw, std::move(cb)); },
                        {{0, imm, plan.transfers}});
  auto cpu1 = cpu_of(1);
  if (!w.error) return w.error;
  if (!cpu1) return cpu1.status();
  r.seconds = w.seconds;
  r.ops = plan.transfers;
  r.post_us = w.submit_seconds * 1e6 / static_cast<double>(plan.wrs);
  count_per_op(r, w);
  r.cpu_seconds = *cpu1 - *cpu0;
  return r;
}

Result<PassResult> Session::scatter(const Row& row, const Budget& b, uint32_t iteration) {
  const Plan plan = plan_for(row, b);
  const uint64_t size = row.bytes;
  const uint32_t n = row.peers;
  if (Status s = ensure_peers(n); !s) return s;
  auto group = group_of(n);
  if (!group) return group.status();
  const uint64_t dst_bytes = plan.transfers * size;
  for (uint32_t i = 0; i < n; ++i) {
    if (Status s = peers_[i]->ensure_buffer(dst_bytes); !s) return s;
    if (Status s = peers_[i]->poison(0, dst_bytes); !s) return s;
  }
  // Scatter j sends target i (to peer i) from source range j * n + i into the peer's slot j.
  const uint32_t imm = fresh_imm();
  std::vector<Scatter> scatters(plan.transfers);
  for (uint64_t j = 0; j < plan.transfers; ++j) {
    Scatter& sc = scatters[j];
    sc.src = src_.handle;
    sc.group = *group;
    sc.imm = imm;
    for (uint32_t i = 0; i < n; ++i) {
      sc.targets.push_back(ScatterTarget{peers_[i]->memory(), size,
                                         src_offset(iteration, j * n + i, size), j * size});
    }
  }
  std::vector<Expectation> expects;
  for (uint32_t i = 0; i < n; ++i) expects.push_back({i, imm, plan.transfers});
  auto cpu0 = cpu_of(n);
  if (!cpu0) return cpu0.status();
  Window w = run_window(
      plan.transfers, plan.window,
      [&](uint64_t j, Callbacks cb) { return engine_.submit(scatters[j], std::move(cb)); },
      expects);
  auto cpu1 = cpu_of(n);
  if (!w.error) return w.error;
  if (!cpu1) return cpu1.status();
  for (uint32_t i = 0; i < n; ++i) {
    if (Status s = verify(
            *peers_[i], size, 0, size, plan.transfers,
            [&](uint64_t j) {
              return hash_bytes(src_bytes_.data() + src_offset(iteration, j * n + i, size), size);
            },
            [&](uint64_t j) { return fmt::format("scatter {}, target {}", j, i); });
        !s) {
      return s;
    }
  }
  PassResult r;
  r.seconds = w.seconds;
  r.bytes = plan.bytes;
  r.ops = plan.wrs;
  r.post_us = w.submit_seconds * 1e6 / static_cast<double>(plan.wrs);
  count_per_op(r, w);
  r.cpu_seconds = *cpu1 - *cpu0;
  r.lat_us = std::move(w.lat_us);
  return r;
}

Result<PassResult> Session::barrier(const Row& row, const Budget& b, uint32_t iteration) {
  (void)iteration;
  const uint32_t n = row.peers;
  if (Status s = ensure_peers(n); !s) return s;
  auto group = group_of(n);
  if (!group) return group.status();
  // A round: a Barrier (an imm-only write to each of the n peers), each peer answering with an
  // imm-only write back; the round ends when the client has counted all n answers.
  PassResult r;
  const uint64_t rounds = kWarmupRounds + b.rounds;
  const uint64_t base = engine_.imm_count(kPong);
  Completions done(rounds, driver(), foreground());
  auto cpu0 = cpu_of(n);
  if (!cpu0) return cpu0.status();
  double submit_seconds = 0;
  Clock::time_point start;
  const auto deadline = Clock::now() + kPassTimeout;
  for (uint64_t k = 0; k < rounds; ++k) {
    if (Clock::now() > deadline) {
      return Status(ErrorCode::kTimeout, fmt::format("{} of {} barriers in {} s", k, rounds,
                                                     kPassTimeout.count() / 1000));
    }
    Barrier bar;
    bar.group = *group;
    bar.imm = kPing;
    Callbacks callbacks = done.callbacks(k);  // made before the clock starts, as above
    const auto t0 = Clock::now();
    if (k == kWarmupRounds) start = t0;
    auto id = engine_.submit(bar, std::move(callbacks));
    const auto t1 = Clock::now();
    if (!id) return id.status();
    if (!engine_.wait_imm(kPong, base + n * (k + 1), kRoundTimeout)) {
      return Status(ErrorCode::kTimeout,
                    fmt::format("barrier {}: {} of {} answers within {} ms", k,
                                engine_.imm_count(kPong) - base - n * k, n, kRoundTimeout.count()));
    }
    if (k >= kWarmupRounds) {
      r.lat_us.push_back(us(Clock::now() - t0));
      submit_seconds += std::chrono::duration<double>(t1 - t0).count();
    }
  }
  r.seconds = seconds_since(start);
  auto cpu1 = cpu_of(n);
  if (!cpu1) return cpu1.status();
  if (!done.wait_prefix(rounds, Clock::now() + kPassTimeout)) {
    return Status(ErrorCode::kTimeout, "barrier writes did not complete");
  }
  if (Status s = done.status(); !s) return s;
  if (engine_.imm_count(kPong) != base + n * rounds) {
    return Status(ErrorCode::kInternal,
                  fmt::format("{} answers arrived for {} barriers to {} peers",
                              engine_.imm_count(kPong) - base, rounds, n));
  }
  r.ops = b.rounds;
  r.post_us = submit_seconds * 1e6 / static_cast<double>(b.rounds * n);
  r.cpu_seconds = *cpu1 - *cpu0;
  return r;
}

Result<PassResult> Session::read(const Row& row, const Budget& b, uint32_t iteration) {
  const Plan plan = plan_for(row, b);
  const uint64_t size = row.bytes;
  if (Status s = prepare_reads(plan.bytes); !s) return s;
  PeerClient& peer = *peers_[0];
  auto cpu0 = cpu_of(1);
  if (!cpu0) return cpu0.status();
  // Read i comes from the peer's source where single write i came from in the client's, into
  // slot i of the client's destination; one request, its offsets set per read (as in single()).
  SingleRead sr;
  sr.dst = read_dst_reg_->handle;
  sr.src = peer.source();
  sr.length = size;
  Window w = run_window(plan.transfers, plan.window,
                        [&](uint64_t i, Callbacks cb) {
                          sr.src_offset = src_offset(iteration, i, size);
                          sr.dst_offset = i * size;
                          return engine_.submit(sr, std::move(cb));
                        },
                        {});
  auto cpu1 = cpu_of(1);
  if (!w.error) return w.error;
  if (!cpu1) return cpu1.status();
  if (Status s = serve_reads(false); !s) return s;
  if (Status s = verify_local(
          size, 0, size, plan.transfers,
          [&](uint64_t i) {
            return hash_bytes(src_bytes_.data() + src_offset(iteration, i, size), size);
          },
          [&](uint64_t i) { return fmt::format("single read {} of the pass", i); });
      !s) {
    return s;
  }
  PassResult r;
  r.seconds = w.seconds;
  r.bytes = plan.bytes;
  r.ops = plan.transfers;
  r.post_us = w.submit_seconds * 1e6 / static_cast<double>(plan.wrs);
  count_per_op(r, w);
  r.cpu_seconds = *cpu1 - *cpu0;
  r.lat_us = std::move(w.lat_us);
  return r;
}

Result<PassResult> Session::paged_read(const Row& row, const Budget& b, uint32_t iteration) {
  const Plan plan = plan_for(row, b);
  const uint64_t page = row.page_bytes;
  const uint64_t stride = page + kPageGap;
  const uint64_t dst_pages = plan.transfers * row.pages;
  const uint64_t dst_bytes = dst_pages * stride;
  const uint64_t src_pages = src_bytes_.size() / stride;
  if (dst_pages > UINT32_MAX || src_pages == 0) {
    return Status(ErrorCode::kOutOfRange, fmt::format("{}: too many pages", row.label()));
  }
  if (Status s = prepare_reads(dst_bytes); !s) return s;
  PeerClient& peer = *peers_[0];

  // Page lists as in paged(): destination pages (here, in the client) a random permutation of
  // the pass's pages, source pages (in the peer's source) random, repeats allowed.
  std::mt19937_64 rng(seed_ * 1000003 + iteration * 7919 + page * 31 + row.pages);
  std::vector<uint32_t> perm(dst_pages);
  std::iota(perm.begin(), perm.end(), 0u);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::uniform_int_distribution<uint32_t> any_src(0, static_cast<uint32_t>(src_pages - 1));
  std::vector<uint32_t> from(dst_pages);
  std::vector<PagedRead> reads(plan.transfers);
  for (uint64_t j = 0; j < plan.transfers; ++j) {
    PagedRead& pr = reads[j];
    pr.dst = read_dst_reg_->handle;
    pr.src = peer.source();
    pr.page_bytes = page;
    pr.src_stride = stride;
    pr.dst_stride = stride;
    pr.dst_pages.assign(perm.begin() + static_cast<ptrdiff_t>(j * row.pages),
                        perm.begin() + static_cast<ptrdiff_t>((j + 1) * row.pages));
    pr.src_pages.resize(row.pages);
    for (uint64_t i = 0; i < row.pages; ++i) {
      pr.src_pages[i] = any_src(rng);
      from[pr.dst_pages[i]] = pr.src_pages[i];
    }
  }

  auto cpu0 = cpu_of(1);
  if (!cpu0) return cpu0.status();
  Window w = run_window(
      plan.transfers, plan.window,
      [&](uint64_t j, Callbacks cb) { return engine_.submit(reads[j], std::move(cb)); }, {});
  auto cpu1 = cpu_of(1);
  if (!w.error) return w.error;
  if (!cpu1) return cpu1.status();
  if (Status s = serve_reads(false); !s) return s;
  if (Status s = verify_local(
          page, 0, stride, dst_pages,
          [&](uint64_t d) {
            return hash_bytes(src_bytes_.data() + static_cast<uint64_t>(from[d]) * stride, page);
          },
          [&](uint64_t d) {
            return fmt::format("destination page {} (source page {})", d, from[d]);
          });
      !s) {
    return s;
  }
  std::vector<std::byte> poison(kPageGap, kPoison);
  const uint64_t gap_hash = hash_bytes(poison.data(), poison.size());
  if (Status s = verify_local(
          kPageGap, page, stride, dst_pages, [&](uint64_t) { return gap_hash; },
          [&](uint64_t d) {
            return fmt::format("the gap after destination page {} was written", d);
          });
      !s) {
    return s;
  }
  PassResult r;
  r.seconds = w.seconds;
  r.bytes = plan.bytes;
  r.ops = plan.wrs;
  r.post_us = w.submit_seconds * 1e6 / static_cast<double>(plan.wrs);
  count_per_op(r, w);
  r.cpu_seconds = *cpu1 - *cpu0;
  r.lat_us = std::move(w.lat_us);
  return r;
}

Result<PassResult> Session::read_rtt(const Row& row, const Budget& b, uint32_t iteration) {
  // Round trips: one read at a time, the next submitted once the last one's done callback has
  // run: the request to the owner and the data back, as the caller sees it (with a
  // caller-driven group, the waiting thread drives it; the owner's code takes no part).
  // Untimed warm-up round trips first. Read k lands in slot k of the destination.
  const uint64_t size = row.bytes;
  const uint64_t rounds = kWarmupRounds + b.rounds;
  if (Status s = prepare_reads(rounds * size); !s) return s;
  PeerClient& peer = *peers_[0];
  SingleRead sr;
  sr.dst = read_dst_reg_->handle;
  sr.src = peer.source();
  sr.length = size;
  PassResult r;
  Window w;
  Completions done(rounds, driver(), foreground());
  auto cpu0 = cpu_of(1);
  if (!cpu0) return cpu0.status();
  GroupStats before;
  SysCounters::Totals sys_before;
  Clock::time_point start;
  const auto deadline = Clock::now() + kPassTimeout;
  for (uint64_t k = 0; k < rounds; ++k) {
    if (Clock::now() > deadline) {
      return Status(ErrorCode::kTimeout, fmt::format("{} of {} read round trips in {} s", k, rounds,
                                                     kPassTimeout.count() / 1000));
    }
    sr.src_offset = src_offset(iteration, k, size);
    sr.dst_offset = k * size;
    Callbacks callbacks = done.callbacks(k);  // made before the clock starts, as in barrier()
    if (k == kWarmupRounds) {
      before = engine_.stats().groups[0];
      sys_before = sys_.read();
      start = Clock::now();
    }
    const auto t0 = Clock::now();
    auto id = engine_.submit(sr, std::move(callbacks));
    const auto t1 = Clock::now();
    if (!id) return id.status();
    if (!done.wait_prefix(k + 1, Clock::now() + kRoundTimeout)) {
      return Status(ErrorCode::kTimeout, fmt::format("read round trip {}: not done within {} ms", k,
                                                     kRoundTimeout.count()));
    }
    if (done.failed() > 0) return done.status();
    if (k >= kWarmupRounds) {
      r.lat_us.push_back(us(Clock::now() - t0));
      w.submit_seconds += std::chrono::duration<double>(t1 - t0).count();
    }
  }
  r.seconds = seconds_since(start);
  const SysCounters::Totals sys_after = sys_.read();
  const GroupStats after = engine_.stats().groups[0];
  auto cpu1 = cpu_of(1);
  if (!cpu1) return cpu1.status();
  if (Status s = serve_reads(false); !s) return s;
  w.sys.syscalls = sys_after.syscalls - sys_before.syscalls;
  w.sys.context_switches = sys_after.context_switches - sys_before.context_switches;
  w.wakeups = after.worker_wakeups - before.worker_wakeups;
  w.sleeps = after.worker_sleeps - before.worker_sleeps;
  if (Status s = verify_local(
          size, 0, size, rounds,
          [&](uint64_t k) {
            return hash_bytes(src_bytes_.data() + src_offset(iteration, k, size), size);
          },
          [&](uint64_t k) { return fmt::format("read round trip {} of the pass", k); });
      !s) {
    return s;
  }
  r.bytes = b.rounds * size;
  r.ops = b.rounds;
  r.post_us = w.submit_seconds * 1e6 / static_cast<double>(b.rounds);
  count_per_op(r, w);
  r.cpu_seconds = *cpu1 - *cpu0;
  return r;
}

}  // namespace fabric::bench
