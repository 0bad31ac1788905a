#include "engine/worker.h"

#include <fmt/format.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include "common/log.h"

#include <cstdlib>
#include <cstring>

#include "topology/topology.h"

namespace fabric::engine {

namespace {

constexpr size_t kBufferAlignment = 64;
constexpr uint64_t kScratchBytes = 64;
constexpr auto kMaxBlock = std::chrono::milliseconds(100);

Status cancelled(std::string_view why) {
  return Status(ErrorCode::kCancelled, std::string(why));
}

}  // namespace

LocalRegion::~LocalRegion() {
  if (worker != nullptr && !regs.empty()) worker->release(std::move(regs));
}

Worker::Worker(uint32_t group, const Config& config, int cpu)
    : group_(group), config_(config), cpu_(cpu) {}

Result<std::unique_ptr<Worker>> Worker::create(
    uint32_t group, const Config& config, int cpu,
    std::vector<std::unique_ptr<transport::Domain>> domains, WorkerServices services) {
  std::unique_ptr<Worker> w(new Worker(group, config, cpu));
  w->services_ = std::move(services);
  w->completions_.resize(std::max<uint32_t>(config.cq_batch, 1));
  w->event_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (w->event_fd_ < 0) {
    return Status(ErrorCode::kInternal, fmt::format("eventfd failed: {}", std::strerror(errno)));
  }
  for (auto& domain : domains) {
    DomainState d;
    d.domain = std::move(domain);
    d.scratch_buf.reset(
        static_cast<std::byte*>(std::aligned_alloc(kBufferAlignment, kScratchBytes)));
    std::memset(d.scratch_buf.get(), 0, kScratchBytes);
    auto reg = d.domain->register_memory(d.scratch_buf.get(), kScratchBytes);
    if (!reg) return reg.status();
    d.scratch = std::move(*reg);
    w->domains_.push_back(std::move(d));
  }
  // Registered send buffers on the first NIC, which carries all two-sided messages.
  auto pool = std::make_unique<SendPool>();
  pool->slot_bytes =
      (config.max_message_bytes + kBufferAlignment - 1) / kBufferAlignment * kBufferAlignment;
  const uint64_t total = pool->slot_bytes * std::max<uint32_t>(config.send_buffers, 1);
  pool->storage.reset(static_cast<std::byte*>(std::aligned_alloc(kBufferAlignment, total)));
  auto reg = w->domains_[0].domain->register_memory(pool->storage.get(), total);
  if (!reg) return reg.status();
  pool->reg = std::move(*reg);
  for (int32_t i = static_cast<int32_t>(std::max<uint32_t>(config.send_buffers, 1)) - 1; i >= 0;
       --i) {
    pool->free.push_back(i);
  }
  w->send_pool_ = std::move(pool);
  return w;
}

Worker::~Worker() {
  stop();
  // Registrations before the domains they live on.
  recv_pool_.reset();
  send_pool_.reset();
  live_.clear();
  for (auto& d : domains_) d.scratch.reset();
  if (event_fd_ >= 0) ::close(event_fd_);
}

void Worker::start() {
  running_.store(true);
  thread_ = std::thread([this] { run(); });
}

void Worker::stop() {
  if (!thread_.joinable()) return;
  stop_requested_.store(true);
  uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(event_fd_, &one, sizeof(one));
  thread_.join();
  std::vector<std::unique_ptr<Transfer>> transfers;
  std::vector<std::function<void()>> commands;
  {
    std::lock_guard lock(inbox_mu_);
    running_.store(false);
    transfers.swap(inbox_transfers_);
    commands.swap(inbox_commands_);
  }
  for (auto& c : commands) c();
  for (auto& t : transfers) {
    if (t->callbacks.on_error) {
      services_.callbacks->push(
          [cb = std::move(t->callbacks.on_error)] { cb(cancelled("engine closed")); });
    }
  }
}

void Worker::submit(std::unique_ptr<Transfer> transfer) {
  {
    std::lock_guard lock(inbox_mu_);
    inbox_transfers_.push_back(std::move(transfer));
    inbox_nonempty_.store(true);
  }
  if (sleeping_.load()) {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(event_fd_, &one, sizeof(one));
  }
}

void Worker::run_on_worker(std::function<void()> fn) {
  {
    std::lock_guard lock(inbox_mu_);
    if (running_.load()) {
      inbox_commands_.push_back(std::move(fn));
      inbox_nonempty_.store(true);
      fn = nullptr;
    }
  }
  if (fn) {
    fn();  // not running: nothing else touches the domains
    return;
  }
  if (sleeping_.load()) {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(event_fd_, &one, sizeof(one));
  }
}

void Worker::release(std::vector<std::unique_ptr<transport::MemoryRegistration>> regs) {
  // On the worker itself, `regs` is destroyed right here when the call returns.
  if (std::this_thread::get_id() == thread_.get_id()) return;
  auto holder = std::make_shared<decltype(regs)>(std::move(regs));
  run_on_worker([holder] { holder->clear(); });
}

Result<std::vector<std::unique_ptr<transport::MemoryRegistration>>> Worker::register_on_all(
    void* ptr, uint64_t length) {
  std::vector<std::unique_ptr<transport::MemoryRegistration>> regs;
  for (auto& d : domains_) {
    auto reg = d.domain->register_memory(ptr, length);
    if (!reg) return reg.status();
    regs.push_back(std::move(*reg));
  }
  return regs;
}

Status Worker::start_receives(std::function<void(std::span<const std::byte>)> handler,
                              uint64_t buffer_bytes, uint32_t count) {
  if (recv_pool_) {
    return Status(ErrorCode::kAlreadyExists,
                  fmt::format("group {} already has a receive handler", group_));
  }
  auto pool = std::make_unique<ReceivePool>();
  pool->handler = std::move(handler);
  const uint64_t slot = (buffer_bytes + kBufferAlignment - 1) / kBufferAlignment * kBufferAlignment;
  pool->storage.reset(static_cast<std::byte*>(std::aligned_alloc(kBufferAlignment, slot * count)));
  if (!pool->storage) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("cannot allocate {} receive buffers of {} bytes", count, slot));
  }
  auto reg = domains_[0].domain->register_memory(pool->storage.get(), slot * count);
  if (!reg) return reg.status();
  pool->reg = std::move(*reg);
  pool->slots.reserve(count);
  for (uint32_t i = 0; i < count; ++i)
    pool->slots.push_back({pool->storage.get() + i * slot, slot});
  recv_pool_ = std::move(pool);
  for (RecvSlot& s : recv_pool_->slots) repost(s);
  return Status::ok();
}

void Worker::repost(RecvSlot& slot) {
  transport::RecvRequest req{reinterpret_cast<uint64_t>(&slot), slot.buf, slot.size,
                             recv_pool_->reg->local_desc()};
  auto r = domains_[0].domain->post_recv(req);
  if (r.kind != transport::PostResult::Kind::kPosted) {
    detail::log().error(
        "group {}: cannot repost a receive buffer on '{}': {}", group_,
        domains_[0].domain->info().name,
        r.kind == transport::PostResult::Kind::kAgain ? "queue full" : r.error.to_string());
  }
}

// --- the loop -------------------------------------------------------------------------------

void Worker::run() {
  pthread_setname_np(pthread_self(), fmt::format("fabric-w{}", group_).c_str());
  if (cpu_ >= 0) {
    Status s = topology::pin_current_thread(cpu_);
    if (!s) detail::log().warn("group {}: {}", group_, s.to_string());
  }
  last_active_ = std::chrono::steady_clock::now();
  for (;;) {
    now_ = std::chrono::steady_clock::now();  // one clock read per pass
    bool active = drain_inbox();
    if (!stopping_ && stop_requested_.load()) begin_stop();
    for (uint32_t i = 0; i < domains_.size(); ++i) active |= poll(i);
    for (auto& d : domains_) active |= post_some(d);
    watch_peers();
    if (!jobs_.empty()) services_.callbacks->push(jobs_);
    if (stopping_ && (posted_ == abandoned_ || now_ >= stop_deadline_)) {
      break;
    }
    idle(active);
  }
  finish_stop();
}

bool Worker::drain_inbox() {
  if (!inbox_nonempty_.load()) return false;
  std::vector<std::unique_ptr<Transfer>> transfers;
  std::vector<std::function<void()>> commands;
  {
    std::lock_guard lock(inbox_mu_);
    transfers.swap(inbox_transfers_);
    commands.swap(inbox_commands_);
    inbox_nonempty_.store(false);
  }
  for (auto& c : commands) c();
  for (auto& t : transfers) start_transfer(std::move(t));
  return true;
}

void Worker::start_transfer(std::unique_ptr<Transfer> owned) {
  Transfer& t = *owned;
  live_.emplace(t.id, std::move(owned));
  if (stopping_) {
    t.error = cancelled("engine closed before the transfer was posted");
    finish(t);
    return;
  }
  t.pending = t.ops.size() + 1;  // +1 holds the transfer open while its ops are queued
  for (Op& op : t.ops) enqueue(op);
  if (--t.pending == 0) advance(t);
}

void Worker::enqueue(Op& op) {
  DomainState& d = domains_[op.domain];
  auto peer = d.domain->resolve_peer(*op.peer);
  if (!peer) {
    complete_op(op, peer.status());
    return;
  }
  PeerQueue& q = d.queues[*peer];
  q.peer = *peer;
  if (q.ops.empty() && q.inflight_count == 0) q.last_progress = now_;
  q.ops.push_back(&op);
  ++queued_;
  if (!q.ready) {
    q.ready = true;
    d.ready.push_back(*peer);
  }
}

transport::PostResult Worker::post(DomainState& d, Op& op, transport::PeerHandle peer) {
  if (op.kind == Op::Kind::kWrite) {
    return d.domain->post_write({reinterpret_cast<uint64_t>(&op), op.local, op.length,
                                 op.local_desc, peer, op.remote_addr, op.remote_key, op.has_imm,
                                 op.imm});
  }
  // A send takes a registered buffer for as long as it is posted.
  if (op.send_slot < 0) {
    if (send_pool_->free.empty()) return transport::PostResult::again();
    op.send_slot = send_pool_->free.back();
    send_pool_->free.pop_back();
    std::byte* buf =
        send_pool_->storage.get() + static_cast<uint64_t>(op.send_slot) * send_pool_->slot_bytes;
    std::memcpy(buf, op.transfer->message.data(), op.transfer->message.size());
    op.local = buf;
    op.local_desc = send_pool_->reg->local_desc();
  }
  return d.domain->post_send(
      {reinterpret_cast<uint64_t>(&op), op.local, op.length, op.local_desc, peer});
}

bool Worker::post_some(DomainState& d) {
  bool any = false;
  uint32_t budget = config_.post_budget;
  const size_t peers = d.ready.size();
  for (size_t i = 0; i < peers && budget > 0; ++i) {
    const transport::PeerHandle peer = d.ready.front();
    d.ready.pop_front();
    PeerQueue& q = d.queues[peer];
    while (!q.ops.empty() && budget > 0) {
      Op& op = *q.ops.front();
      auto r = post(d, op, peer);
      if (r.kind == transport::PostResult::Kind::kAgain) break;  // this peer waits; others go on
      q.ops.pop_front();
      --queued_;
      any = true;
      if (r.kind == transport::PostResult::Kind::kPosted) {
        q.link(op);
        ++posted_;
        --budget;
      } else {
        complete_op(op, r.error);
      }
    }
    if (q.ops.empty()) {
      q.ready = false;
    } else {
      d.ready.push_back(peer);
    }
  }
  return any;
}

bool Worker::poll(uint32_t index) {
  DomainState& d = domains_[index];
  const size_t n = d.domain->poll(completions_);
  if (n == 0) return false;
  for (size_t i = 0; i < n; ++i) {
    const transport::Completion& c = completions_[i];
    switch (c.kind) {
      case transport::Completion::Kind::kLocal: {
        Op& op = *reinterpret_cast<Op*>(c.wr_id);
        --posted_;
        if (op.abandoned) {  // its transfer already failed; the provider has let go of it now
          --abandoned_;
          Transfer& t = *op.transfer;
          if (--t.abandoned == 0 && t.finished) live_.erase(t.id);
          break;
        }
        op.queue->last_progress = now_;
        op.queue->unlink(op);
        if (c.error == ErrorCode::kOk) {
          complete_op(op, Status::ok());
        } else {
          complete_op(
              op, Status(c.error, fmt::format("{} of {} bytes on NIC '{}' failed: {}",
                                              op.kind == Op::Kind::kSend ? "send" : "write",
                                              op.length, d.domain->info().name, c.error_message)));
        }
        break;
      }
      case transport::Completion::Kind::kImm:
        imm_batch_.push_back(c.imm);
        break;
      case transport::Completion::Kind::kRecv:
        on_recv(c);
        break;
      case transport::Completion::Kind::kRemoteError:
        detail::log().warn("group {} NIC '{}': {}", group_, d.domain->info().name, c.error_message);
        break;
    }
  }
  if (!imm_batch_.empty()) {
    services_.imms->arrive(imm_batch_, jobs_, unexpected_);
    imm_batch_.clear();
    if (!unexpected_.empty()) {
      if (services_.on_unexpected) services_.on_unexpected(unexpected_);
      unexpected_.clear();
    }
  }
  return true;
}

void Worker::on_recv(const transport::Completion& c) {
  RecvSlot& slot = *reinterpret_cast<RecvSlot*>(c.wr_id);
  if (c.error != ErrorCode::kOk) {
    if (stopping_ || c.error == ErrorCode::kCancelled) return;
    detail::log().warn("group {}: a receive failed: {}", group_, c.error_message);
    repost(slot);
    return;
  }
  Bytes message(slot.buf, slot.buf + c.length);
  repost(slot);
  ReceivePool* pool = recv_pool_.get();
  jobs_.push_back([pool, m = std::move(message)] { pool->handler(m); });
}

void Worker::complete_op(Op& op, const Status& status) {
  if (op.send_slot >= 0) {
    send_pool_->free.push_back(op.send_slot);
    op.send_slot = -1;
  }
  Transfer& t = *op.transfer;
  if (!status.is_ok() && t.error.is_ok()) t.error = status;
  if (--t.pending == 0) advance(t);
}

void Worker::advance(Transfer& t) {
  if (t.error.is_ok() && !t.deferred_started && !t.deferred.empty()) {
    if (stopping_) {
      t.error = cancelled("engine closed before the transfer's immediate was sent");
      finish(t);
      return;
    }
    t.deferred_started = true;
    t.pending = t.deferred.size() + 1;
    for (Op& op : t.deferred) enqueue(op);
    if (--t.pending == 0) advance(t);
    return;
  }
  finish(t);
}

void Worker::finish(Transfer& t) {
  if (!t.error.is_ok()) {
    if (t.callbacks.on_error) {
      jobs_.push_back([cb = std::move(t.callbacks.on_error), s = std::move(t.error)] { cb(s); });
    }
  } else if (t.callbacks.on_done) {
    jobs_.push_back(std::move(t.callbacks.on_done));
  }
  t.finished = true;
  // Destroys t, unless the provider still holds some of its ops (a dead peer's).
  if (t.abandoned == 0) live_.erase(t.id);
}

void Worker::watch_peers() {
  const auto now = now_;
  if (now < next_watch_) return;
  next_watch_ = now + std::chrono::milliseconds(10);
  for (auto& d : domains_) {
    std::vector<PeerQueue*> dead;
    for (auto& [peer, q] : d.queues) {
      // Busy (work queued or posted) and no completion since peer_timeout: dead.
      const bool busy = q.inflight_count > 0 || !q.ops.empty();
      if (busy && now - q.last_progress > config_.peer_timeout) dead.push_back(&q);
    }
    for (PeerQueue* q : dead) declare_dead(d, *q);
  }
}

void Worker::declare_dead(DomainState& d, PeerQueue& q) {
  const Status error(
      ErrorCode::kPeerUnreachable,
      fmt::format("no completion from the peer on NIC '{}' for {} ms with {} work requests "
                  "posted and {} queued; the peer is considered dead",
                  d.domain->info().name, config_.peer_timeout.count(), q.inflight_count,
                  q.ops.size()));
  detail::log().warn("group {}: {}", group_, error.message());
  const transport::PeerHandle peer = q.peer;
  std::vector<Op*> unposted(q.ops.begin(), q.ops.end());
  queued_ -= unposted.size();
  q.ops.clear();
  std::vector<Op*> posted;
  while (q.inflight != nullptr) {
    Op* op = q.inflight;
    q.unlink(*op);
    posted.push_back(op);
  }
  d.queues.erase(peer);  // q is gone from here on
  std::erase(d.ready, peer);
  d.domain->forget_peer(peer);
  for (Op* op : posted) {
    op->abandoned = true;
    ++op->transfer->abandoned;
    ++abandoned_;
    complete_op(*op, error);
  }
  for (Op* op : unposted) complete_op(*op, error);
}

// --- stopping -------------------------------------------------------------------------------

void Worker::begin_stop() {
  stopping_ = true;
  stop_deadline_ = std::chrono::steady_clock::now() + config_.close_timeout;
  std::vector<Op*> unposted;
  for (auto& d : domains_) {
    for (auto& [peer, q] : d.queues) {
      unposted.insert(unposted.end(), q.ops.begin(), q.ops.end());
      q.ops.clear();
      q.ready = false;
    }
    d.ready.clear();
  }
  queued_ = 0;
  for (Op* op : unposted) complete_op(*op, cancelled("engine closed before it was posted"));
}

void Worker::finish_stop() {
  if (posted_ > abandoned_) {
    detail::log().warn("group {}: closing with {} work requests still in flight after {} ms",
                       group_, posted_ - abandoned_, config_.close_timeout.count());
  }
  std::vector<Transfer*> left;
  for (auto& [id, t] : live_) {
    if (!t->finished) left.push_back(t.get());
  }
  for (Transfer* t : left) {
    if (t->error.is_ok()) t->error = cancelled("engine closed with the transfer in flight");
    t->abandoned = 0;  // the domains close next; the provider lets go of everything
    finish(*t);
  }
  live_.clear();
  if (!jobs_.empty()) services_.callbacks->push(jobs_);
}

void Worker::idle(bool active) {
  const auto now = now_;
  if (active || posted_ > abandoned_ || queued_ > 0 || stopping_) {
    last_active_ = now;
    return;
  }
  if (config_.idle_sleep.count() == 0 || now - last_active_ < config_.spin_time) return;

  // Sleep until a submission, fabric activity, or the end of a nap.
  pollfd fds[1 + 64];
  nfds_t nfds = 0;
  fds[nfds++] = {event_fd_, POLLIN, 0};
  bool all_fds = true;
  for (auto& d : domains_) {
    int fd = d.domain->wait_fd();
    if (fd < 0 || nfds >= std::size(fds)) {
      all_fds = false;
      continue;
    }
    if (!d.domain->ready_to_wait()) return;  // events pending: poll again
    fds[nfds++] = {fd, POLLIN, 0};
  }
  sleeping_.store(true);
  if (!inbox_nonempty_.load() && !stop_requested_.load()) {
    auto nap = all_fds ? std::chrono::duration_cast<std::chrono::nanoseconds>(kMaxBlock)
                       : std::chrono::duration_cast<std::chrono::nanoseconds>(config_.idle_sleep);
    timespec ts{static_cast<time_t>(nap.count() / 1000000000),
                static_cast<long>(nap.count() % 1000000000)};
    ::ppoll(fds, nfds, &ts, nullptr);
  }
  sleeping_.store(false);
  uint64_t drained = 0;
  [[maybe_unused]] ssize_t n = ::read(event_fd_, &drained, sizeof(drained));
}

}  // namespace fabric::engine
