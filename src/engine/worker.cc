#include "engine/worker.h"

#include <fmt/format.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include "common/log.h"

#include <cstdlib>
#include <cstring>
#include <random>
#include <utility>

#include "engine/plan.h"
#include "topology/topology.h"

namespace fabric::engine {

namespace {

constexpr size_t kBufferAlignment = 64;
constexpr uint64_t kScratchBytes = 64;
constexpr auto kMaxBlock = std::chrono::milliseconds(100);
// The longest block while work requests are in flight: bounds the cost of a provider that
// needs a poll to make progress yet let fi_trywait succeed.
constexpr auto kMaxInflightBlock = std::chrono::milliseconds(1);
// Ids of the worker's own transfers (acknowledgments): never equal to an engine transfer id.

uint64_t round_up(uint64_t n, uint64_t to) {
  return (n + to - 1) / to * to;
}

Status cancelled(std::string_view why) {
  return Status(ErrorCode::kCancelled, std::string(why));
}

}  // namespace

LocalRegion::~LocalRegion() {
  if (worker != nullptr && !regs.empty()) {
    worker->release(std::move(regs), std::move(mirror), std::move(on_released));
  } else if (on_released) {
    on_released(Status::ok());
  }
}

Worker::Worker(uint32_t group, const Config& config, int cpu)
    : group_(group),
      config_(config),
      cpu_(cpu),
      caller_driven_(group < config.groups.size() && config.groups[group].caller_progress) {}

Result<std::unique_ptr<Worker>> Worker::create(
    uint32_t group, const Config& config, int cpu,
    std::vector<std::unique_ptr<transport::Domain>> domains, WorkerServices services) {
  std::unique_ptr<Worker> w(new Worker(group, config, cpu));
  w->services_ = std::move(services);
  w->completions_.resize(std::max<uint32_t>(config.cq_batch, 1));
  w->nic_up_ = std::make_unique<std::atomic<bool>[]>(domains.size());
  for (size_t i = 0; i < domains.size(); ++i) w->nic_up_[i].store(true);
  w->nic_rate_ = std::make_unique<std::atomic<uint64_t>[]>(domains.size());
  for (size_t i = 0; i < domains.size(); ++i) w->nic_rate_[i].store(0);
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
    w->fence_writes_ |= d.domain->info().key_checked_once;
    w->domains_.push_back(std::move(d));
  }
  // Registered send buffers, on every NIC: a message goes over the first NIC that is up.
  w->send_pool_ = std::make_unique<SendPool>();
  w->send_pool_->slot_bytes =
      round_up(config.max_message_bytes + kMessageHeaderBytes, kBufferAlignment);
  w->send_pool_->per_chunk = std::max<uint32_t>(config.send_buffers, 1);
  if (Status s = w->add_send_chunk(); !s) return s;
  // The engine's own receive buffers on every NIC, posted before anything can be sent here.
  for (uint32_t i = 0; i < w->domains_.size(); ++i) {
    auto control = w->make_pool(i, config.max_message_bytes + kMessageHeaderBytes,
                                std::max<uint32_t>(config.control_buffers, 1));
    if (!control) return control.status();
    w->control_pools_.push_back(std::move(*control));
    for (RecvSlot& slot : w->control_pools_.back()->slots) w->repost(slot);
  }
  // Receivers tell this worker's messages apart from any other's (a restarted engine's too).
  std::random_device random;
  w->sender_id_ = (uint64_t{random()} << 32) ^ random();
  return w;
}

Worker::~Worker() {
  stop();
  // Registrations before the domains they live on.
  recv_pools_.clear();
  control_pools_.clear();
  send_pool_.reset();
  commit_jobs_.clear();
  live_.clear();
  copiers_.clear();
  for (auto& d : domains_) d.scratch.reset();
  if (event_fd_ >= 0) ::close(event_fd_);
}

void Worker::start() {
  running_.store(true);
  if (caller_driven_) {
    last_active_ = std::chrono::steady_clock::now();
    return;  // TransferEngine::progress drives it
  }
  thread_ = std::thread([this] { run(); });
}

namespace {
thread_local bool tls_on_worker = false;

// Marks the current thread as running a worker pass (restored after: a caller-driven pass may
// run on a thread that also does other work).
class OnWorker {
 public:
  OnWorker() : saved_(tls_on_worker) { tls_on_worker = true; }
  ~OnWorker() { tls_on_worker = saved_; }
  OnWorker(const OnWorker&) = delete;
  OnWorker& operator=(const OnWorker&) = delete;

 private:
  bool saved_;
};
}  // namespace

bool on_worker_thread() {
  return tls_on_worker;
}

bool Worker::progress() {
  if (!caller_driven_ || !running_.load()) return false;
  std::unique_lock lock(pass_mu_, std::try_to_lock);
  if (!lock || stopping_) return false;
  OnWorker on_worker;
  bool finished = false;
  return pass(finished);
}

void Worker::progress_until(const std::function<bool()>& done) {
  if (!caller_driven_) return;
  while (!done()) {
    if (!progress()) std::this_thread::yield();
  }
}

void Worker::stop() {
  if (caller_driven_) {
    if (!running_.load()) return;
    stop_requested_.store(true);
    {
      std::lock_guard lock(pass_mu_);
      OnWorker on_worker;
      for (bool finished = false; !finished;) {
        if (!pass(finished)) std::this_thread::yield();
      }
      finish_stop();
    }
  } else {
    if (!thread_.joinable()) return;
    stop_requested_.store(true);
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(event_fd_, &one, sizeof(one));
    thread_.join();
  }
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

void Worker::wake() {
  // One wake-up per sleep: the caller that clears the flag writes, the others need not.
  if (sleeping_.load() && sleeping_.exchange(false)) {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(event_fd_, &one, sizeof(one));
  }
}

void Worker::submit(std::unique_ptr<Transfer> transfer) {
  {
    std::lock_guard lock(inbox_mu_);
    inbox_transfers_.push_back(std::move(transfer));
    inbox_nonempty_.store(true);
  }
  wake();
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
  wake();
}

void Worker::release(std::vector<std::unique_ptr<transport::MemoryRegistration>> regs,
                     std::unique_ptr<cuda::HostBuffer> mirror,
                     std::function<void(const Status&)> done) {
  // On the worker itself, all is destroyed right here, registrations first; then the writers
  // still sending are fenced (write_fence.cc) before `done` runs.
  if (std::this_thread::get_id() == thread_.get_id()) {
    regs.clear();
    mirror.reset();
    fence_writers(std::move(done));
    return;
  }
  struct Holder {
    std::vector<std::unique_ptr<transport::MemoryRegistration>> regs;
    std::unique_ptr<cuda::HostBuffer> mirror;
    std::function<void(const Status&)> done;
  };
  auto holder =
      std::make_shared<Holder>(Holder{std::move(regs), std::move(mirror), std::move(done)});
  run_on_worker([this, holder] {
    holder->regs.clear();
    holder->mirror.reset();
    fence_writers(std::move(holder->done));
  });
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

Result<std::unique_ptr<Worker::ReceivePool>> Worker::make_pool(uint32_t domain,
                                                               uint64_t buffer_bytes,
                                                               uint32_t count) {
  auto pool = std::make_unique<ReceivePool>();
  const uint64_t slot = round_up(buffer_bytes, kBufferAlignment);
  pool->storage.reset(static_cast<std::byte*>(std::aligned_alloc(kBufferAlignment, slot * count)));
  if (!pool->storage) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("cannot allocate {} receive buffers of {} bytes", count, slot));
  }
  auto reg = domains_[domain].domain->register_memory(pool->storage.get(), slot * count);
  if (!reg) return reg.status();
  pool->reg = std::move(*reg);
  pool->slots.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    pool->slots.push_back({pool->storage.get() + i * slot, slot, pool->reg->local_desc(), domain});
  }
  return pool;
}

Status Worker::start_receives(std::function<void(std::span<const std::byte>)> handler,
                              uint64_t buffer_bytes, uint32_t count) {
  if (!recv_pools_.empty()) {
    return Status(ErrorCode::kAlreadyExists,
                  fmt::format("group {} already has a receive handler", group_));
  }
  // Every buffer takes the largest message a peer may send, whichever pool it lands in; every
  // NIC gets `count` of them, since a message may come over any rail.
  std::vector<std::unique_ptr<ReceivePool>> pools;
  for (uint32_t i = 0; i < domains_.size(); ++i) {
    auto pool = make_pool(
        i, std::max(buffer_bytes, config_.max_message_bytes + kMessageHeaderBytes), count);
    if (!pool) return pool.status();
    pools.push_back(std::move(*pool));
  }
  recv_pools_ = std::move(pools);
  user_handler_ = std::make_shared<MessageHandler>(std::move(handler));
  for (auto& pool : recv_pools_) {
    for (RecvSlot& s : pool->slots) repost(s);
  }
  return Status::ok();
}

void Worker::repost(RecvSlot& slot) {
  transport::RecvRequest req{reinterpret_cast<uint64_t>(&slot), slot.buf, slot.size, slot.desc};
  auto r = domains_[slot.domain].domain->post_recv(req);
  if (r.kind != transport::PostResult::Kind::kPosted) {
    detail::log().error(
        "group {}: cannot repost a receive buffer on '{}': {}", group_,
        domains_[slot.domain].domain->info().name,
        r.kind == transport::PostResult::Kind::kAgain ? "queue full" : r.error.to_string());
  }
}

// --- the loop -------------------------------------------------------------------------------

void Worker::run_jobs() {
  if ((!config_.callbacks_on_worker && !caller_driven_) || stopping_) {
    services_.callbacks->push(jobs_);
    return;
  }
  for (auto& job : jobs_) CallbackThread::run_one(job);
  jobs_.clear();
}

void Worker::run() {
  OnWorker on_worker;
  pthread_setname_np(pthread_self(), fmt::format("fabric-w{}", group_).c_str());
  if (cpu_ >= 0) {
    Status s = topology::pin_current_thread(cpu_);
    if (!s) detail::log().warn("group {}: {}", group_, s.to_string());
  }
  last_active_ = std::chrono::steady_clock::now();
  for (;;) {
    bool finished = false;
    const bool active = pass(finished);
    if (finished) break;
    idle(active);
  }
  finish_stop();
}

bool Worker::pass(bool& finished) {
  now_ = std::chrono::steady_clock::now();  // one clock read per pass
  bool active = drain_inbox();
  if (!stopping_ && stop_requested_.load()) begin_stop();
  // Post before polling: a fresh submission reaches the wire without waiting for a pass of
  // polls (each of which runs the provider's progress), and polls then see it sooner.
  for (auto& d : domains_) active |= post_some(d);
  for (uint32_t i = 0; i < domains_.size(); ++i) active |= poll(i);
  if (!ipc_open_.empty()) flush_ipc_batches();  // the Commits those polls read
  if (!copiers_.empty()) active |= poll_copies();
  for (auto& d : domains_) active |= post_some(d);
  watch_peers();
  active |= drain_ready();
  if (!jobs_.empty()) run_jobs();
  finished = stopping_ && (posted_ == abandoned_ || now_ >= stop_deadline_);
  return active;
}

bool Worker::drain_inbox() {
  if (!inbox_nonempty_.load()) return false;
  {
    std::lock_guard lock(inbox_mu_);
    drained_transfers_.swap(inbox_transfers_);
    drained_commands_.swap(inbox_commands_);
    inbox_nonempty_.store(false);
  }
  for (auto& c : drained_commands_) c();
  for (auto& t : drained_transfers_) start_transfer(std::move(t));
  drained_commands_.clear();  // keeps their capacity for the next swap
  drained_transfers_.clear();
  return true;
}

void Worker::start_transfer(std::unique_ptr<Transfer> owned) {
  Transfer& t = *owned;
  live_.emplace(t.id, std::move(owned));
  if (stopping_ && !t.while_stopping) {
    t.error = cancelled("engine closed before the transfer was posted");
    finish(t);
    return;
  }
  if (!t.message.empty()) stamp(t.message);
  t.pending = t.ops.size();
  if (t.src && t.src->staged()) {
    stage_sources(t);  // ops are queued as their device-to-host copies complete
  } else {
    for (Op& op : t.ops) enqueue(op);
  }
  if (!t.ipc.empty()) send_ipc_commits(t, false);  // the CUDA IPC path (ipc_worker.cc)
  if (t.ops.empty()) make_ready(t);                // else the last op to complete does
}

void Worker::enqueue(Op& op) {
  // Planned before its NIC was marked down (or a deferred immediate on a lost rail): it goes
  // over a surviving NIC instead. Probes are the one kind of work a NIC that is down takes.
  if (domains_[op.domain].down && op.transfer->probe_nic < 0 && movable(op)) {
    std::vector<bool> up(domains_.size());
    for (size_t i = 0; i < domains_.size(); ++i) up[i] = !domains_[i].down;
    retarget(op, failover_nic(op.domain, up, failover_salt_++));
  }
  DomainState& d = domains_[op.domain];
  auto peer = d.domain->resolve_peer(*op.peer);
  if (!peer) {
    complete_op(op, peer.status());
    return;
  }
  PeerQueue& q = d.queues[*peer];
  q.peer = *peer;
  q.nic_inflight = &d.inflight;
  if (q.owner.empty() && op.owner != nullptr) q.owner = op.owner->nics()[0].name;
  if (q.ops.empty() && q.inflight_count == 0) q.last_progress = now_;
  if (op.urgent) {
    q.ops.push_front(&op);
  } else {
    q.ops.push_back(&op);
  }
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
    SendPool& pool = *send_pool_;
    if (pool.free.empty()) {
      // Slots held by sends abandoned on a dead NIC may never come back soon: grow (bounded).
      if (abandoned_ == 0 || pool.chunks.size() >= kMaxSendChunks) {
        return transport::PostResult::again();
      }
      if (Status s = add_send_chunk(); !s) {
        detail::log().warn("group {}: could not add send buffers: {}", group_, s.to_string());
        return transport::PostResult::again();
      }
    }
    op.send_slot = pool.free.back();
    pool.free.pop_back();
    std::byte* buf = pool.at(op.send_slot);
    std::memcpy(buf, op.message->data(), op.message->size());
    op.local = buf;
  }
  op.local_desc = send_pool_->desc(op.send_slot, op.domain);  // the op may have moved NICs
  return d.domain->post_send(
      {reinterpret_cast<uint64_t>(&op), op.local, op.length, op.local_desc, peer});
}

bool Worker::post_some(DomainState& d) {
  const uint32_t index = static_cast<uint32_t>(&d - domains_.data());
  bool any = false;
  uint32_t budget = config_.post_budget;
  const size_t peers = d.ready.size();
  for (size_t i = 0; i < peers && budget > 0; ++i) {
    const transport::PeerHandle peer = d.ready.front();
    d.ready.pop_front();
    PeerQueue& q = d.queues[peer];
    if (q.isolating()) {  // isolation.cc: one work request at a time until it is over
      post_isolated(d, q);
      auto it = d.queues.find(peer);  // a failed check may have ended the queue's isolation
      if (it != d.queues.end() && (it->second.isolating() || !it->second.ops.empty())) {
        d.ready.push_back(peer);
      } else if (it != d.queues.end()) {
        it->second.ready = false;
      }
      any = true;
      continue;
    }
    while (!q.ops.empty() && budget > 0) {
      Op& op = *q.ops.front();
      // The write fence: the peer has not acknowledged this engine yet (write_fence.cc).
      if (fence_writes_ && q.announced_epoch != announce_epoch_ && held_for_hello(index, q, op)) {
        break;
      }
      auto r = post(d, op, peer);
      if (r.kind == transport::PostResult::Kind::kAgain) break;  // this peer waits; others go on
      q.ops.pop_front();
      --queued_;
      any = true;
      if (r.kind == transport::PostResult::Kind::kPosted) {
        q.link(op);
        ++posted_;
        if (op.kind == Op::Kind::kWrite && op.length > 0) d.rate.posted(now_);
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
        if (op.abandoned) {  // given up on or replaced; the provider has let go of it now
          --abandoned_;
          release_send_slot(op);
          Transfer& t = *op.transfer;
          if (--t.abandoned == 0 && t.finished) live_.erase(t.id);
          break;
        }
        op.queue->last_progress = now_;
        if (c.error == ErrorCode::kOk && op.kind == Op::Kind::kWrite && op.length > 0) {
          measure(index, op);
        }
        PeerQueue& q = *op.queue;
        q.unlink(op);
        Status status;
        if (c.error != ErrorCode::kOk) {
          status = Status(c.error, fmt::format("{} of {} bytes on NIC '{}' failed: {}",
                                               op.kind == Op::Kind::kSend ? "send" : "write",
                                               op.length, d.domain->info().name, c.error_message));
        }
        if (op.lone) {
          lone_done(d, q, op, status);
        } else if (status.is_ok() || !isolate(d, q, op, status)) {
          complete_op(op, status);
        }
        break;
      }
      case transport::Completion::Kind::kImm:
        imm_batch_.push_back(c.imm);
        break;
      case transport::Completion::Kind::kRecv:
        on_recv(c, index);
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

uint64_t Worker::stamp(Bytes& message) {
  const uint64_t seq = ++next_seq_;
  stamp_header(message, sender_id_, seq);
  return seq;
}

uint32_t Worker::message_nic() const {
  for (uint32_t i = 0; i < domains_.size(); ++i) {
    if (!domains_[i].down) return i;
  }
  return 0;
}

void Worker::on_recv(const transport::Completion& c, uint32_t domain) {
  RecvSlot& slot = *reinterpret_cast<RecvSlot*>(c.wr_id);
  if (c.error != ErrorCode::kOk) {
    if (stopping_ || c.error == ErrorCode::kCancelled) return;
    detail::log().warn("group {}: a receive failed: {}", group_, c.error_message);
    repost(slot);
    return;
  }
  if (c.length < kMessageHeaderBytes) {
    detail::log().warn("group {}: dropped a message of {} bytes, shorter than its header", group_,
                       c.length);
    repost(slot);
    return;
  }
  const MessageHeader header = *read_header(std::span(slot.buf, c.length));
  const std::span<const std::byte> body(slot.buf + kMessageHeaderBytes,
                                        c.length - kMessageHeaderBytes);
  if (!seen_[header.sender].insert(header.seq)) {
    // A copy failover sent again, and the first one arrived too: delivered once. A Commit's
    // writer still waits for an Ack, which may be what got lost.
    if (header.kind == MessageKind::kCommit) commit_duplicate(header, domain);
    repost(slot);
    return;
  }
  const MessageKind kind = header.kind;
  switch (kind) {
    case MessageKind::kUser:
      if (user_handler_) {
        jobs_.push_back([h = user_handler_, m = Bytes(body.begin(), body.end())] { (*h)(m); });
      } else {
        detail::log().warn(
            "group {}: dropped a message of {} bytes: no receive handler is set "
            "(set_receive_handler)",
            group_, body.size());
      }
      break;
    case MessageKind::kCommit:
      handle_commit(header, body, domain);
      break;
    case MessageKind::kAck:
      handle_ack(body);
      break;
    case MessageKind::kHello:
    case MessageKind::kHelloAck:
    case MessageKind::kFence:
    case MessageKind::kFenceAck:
    case MessageKind::kGoodbye:
      handle_fence_note(header, body, domain);
      break;
    default:
      detail::log().warn("group {}: dropped a message of unknown kind {}", group_,
                         static_cast<unsigned>(kind));
  }
  repost(slot);
}

Status Worker::add_send_chunk() {
  SendPool& pool = *send_pool_;
  SendPool::Chunk chunk;
  const uint64_t total = pool.slot_bytes * pool.per_chunk;
  chunk.storage.reset(static_cast<std::byte*>(std::aligned_alloc(kBufferAlignment, total)));
  for (auto& d : domains_) {
    auto reg = d.domain->register_memory(chunk.storage.get(), total);
    if (!reg) return reg.status();
    chunk.regs.push_back(std::move(*reg));
  }
  const auto first = static_cast<int32_t>(pool.chunks.size() * pool.per_chunk);
  pool.chunks.push_back(std::move(chunk));
  for (int32_t i = static_cast<int32_t>(pool.per_chunk) - 1; i >= 0; --i) {
    pool.free.push_back(first + i);
  }
  return Status::ok();
}

void Worker::release_send_slot(Op& op) {
  if (op.send_slot < 0) return;
  send_pool_->free.push_back(op.send_slot);
  op.send_slot = -1;
}

uint32_t Worker::other_up_nic(uint32_t nic) {
  std::vector<bool> up(domains_.size());
  for (size_t i = 0; i < up.size(); ++i) up[i] = !domains_[i].down && i != nic;
  return failover_nic(nic, up, failover_salt_++);
}

void Worker::complete_op(Op& op, const Status& status) {
  release_send_slot(op);
  Transfer& t = *op.transfer;
  if (op.commit != nullptr) {
    CommitSend& cs = *op.commit;
    --cs.live;
    if (!status.is_ok()) {
      // Another copy may still be (or have been) delivered and acknowledged.
      if (cs.acked || cs.live > 0) {
        settle(t);
        return;
      }
      const uint32_t to = other_up_nic(op.domain);
      if (failover_active() && to != op.domain && !stopping_ && t.error.is_ok() &&
          now_ < t.ack_deadline) {
        detail::log().warn(
            "group {}: a commit message failed on NIC '{}' ({}); sending it again "
            "over '{}'",
            group_, domains_[op.domain].domain->info().name, status.message(),
            domains_[to].domain->info().name);
        resend_commit(cs, to);
        settle(t);
        return;
      }
      cs.acked = true;  // given up: its Ack will never come
      unacked_.erase(cs.seq);
      --t.acks;
    }
  }
  if (!status.is_ok() && t.error.is_ok()) t.error = status;
  if (status.is_ok() && op.dst_index != Op::kNoDst) record_staged(op);
  settle(t);
}

void Worker::advance(Transfer& t) {
  if (t.pending > 0 || t.acks > 0) return;  // work requests or acknowledgments outstanding
  if (!t.error.is_ok()) {
    finish(t);
    return;
  }
  // Every write has landed. What is left: Commits of staged destinations (with their
  // immediates), and immediates that follow the data of multi-piece writes.
  bool more = !t.deferred_started && !t.deferred.empty();
  for (const StagedDst& sd : t.staged) more |= !sd.unflushed.empty() || sd.has_imm;
  more |= ipc_left(t);
  if (!more) {
    finish(t);
    return;
  }
  if (stopping_) {
    t.error = cancelled("engine closed before the transfer's immediate was sent");
    finish(t);
    return;
  }
  for (uint32_t i = 0; i < t.staged.size(); ++i) {
    if (!t.staged[i].unflushed.empty() || t.staged[i].has_imm) flush_commits(t, i, true);
  }
  if (ipc_left(t)) send_ipc_commits(t, true);
  if (!t.deferred_started && !t.deferred.empty()) {
    t.deferred_started = true;
    t.pending += t.deferred.size();
    for (Op& op : t.deferred) enqueue(op);
  }
  // Nothing went out after all (every Commit and op failed at once): look again next drain.
  if (t.pending == 0 && t.acks == 0) make_ready(t);
}

bool Worker::drain_ready() {
  if (ready_.empty()) return false;
  // Advancing may make transfers ready again (a deferred immediate failing at once): those wait
  // for the next round, a few rounds per pass at most, so that a pass always ends.
  for (int round = 0; round < 4 && !ready_.empty(); ++round) {
    ready_batch_.swap(ready_);
    for (TransferId id : ready_batch_) {
      auto it = live_.find(id);
      if (it != live_.end() && !it->second->finished) advance(*it->second);
    }
    ready_batch_.clear();
  }
  return true;
}

void Worker::finish(Transfer& t) {
  if (!t.commits.empty()) {
    std::erase(awaiting_acks_, &t);
    forget_commits(t);
  }
  if (t.probe_nic >= 0) probe_done(t);
  if (t.check_nic >= 0) check_done(t);
  // A write-fence note (urgent) that failed is sent again by its own timer (write_fence.cc).
  if ((t.id & kInternalTransfer) != 0 && t.probe_nic < 0 && t.check_nic < 0 && !t.error.is_ok() &&
      !(t.ops.size() == 1 && t.ops[0].urgent)) {
    detail::log().warn("group {}: an engine message could not be delivered: {}", group_,
                       t.error.to_string());
  }
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
  sweep_ipc();
  if (!awaiting_acks_.empty()) watch_acks();
  if (!fences_.empty()) watch_fences();
  watch_nics();
  for (auto& d : domains_) {
    // A peer with work queued but nothing posted may be waiting for room that another peer's
    // stalled requests hold (the provider says "again" for the whole endpoint). It is not
    // declared dead while such a stalled peer exists on the domain: that one goes first, and
    // the waiting peer's clock starts afresh (so it is declared dead within 2 x peer_timeout at
    // most). Without this, a dead peer's requests filling the endpoint made a live peer that
    // had not posted yet look dead too (tests/reliability/dying_peer_test.cc).
    bool stalled_inflight = false;
    for (const auto& [peer, q] : d.queues) {
      stalled_inflight |= q.inflight_count > 0 && now - q.last_progress > config_.peer_timeout / 2;
    }
    std::vector<PeerQueue*> dead;
    for (auto& [peer, q] : d.queues) {
      // Busy (work queued or posted) and no completion since peer_timeout: dead.
      const bool busy = q.inflight_count > 0 || !q.ops.empty() || q.isolating();
      if (!busy || now - q.last_progress <= config_.peer_timeout) continue;
      if (q.inflight_count == 0 && stalled_inflight) {
        q.last_progress = now;
        continue;
      }
      dead.push_back(&q);
    }
    for (PeerQueue* q : dead) declare_dead(d, *q);
  }
}

void Worker::declare_dead(DomainState& d, PeerQueue& q) {
  declare_dead(
      d, q,
      Status(ErrorCode::kPeerUnreachable,
             fmt::format("no completion from the peer on NIC '{}' for {} ms with {} work requests "
                         "posted and {} queued ({} being retried one at a time{}); the peer is "
                         "considered dead",
                         d.domain->info().name, config_.peer_timeout.count(), q.inflight_count,
                         q.ops.size() + q.suspects.size(), q.suspects.size(),
                         q.check != nullptr ? ", a check pending" : "")));
}

void Worker::declare_dead(DomainState& d, PeerQueue& q, const Status& error) {
  detail::log().warn("group {}: {}", group_, error.message());
  const transport::PeerHandle peer = q.peer;
  const Bytes owner = q.owner;
  std::vector<Op*> unposted(q.ops.begin(), q.ops.end());
  unposted.insert(unposted.end(), q.suspects.begin(), q.suspects.end());
  queued_ -= unposted.size();
  if (q.check != nullptr && !q.check_posted) unposted.push_back(q.check);
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
  if (fence_writes_) writer_dead(owner);
}

// --- weighted sharding (docs/netlab.md, "Unequal links") --------------------------------------

void Worker::measure(uint32_t index, const Op& op) {
  DomainState& d = domains_[index];
  // Idle: op (still linked) is the last work request posted on this NIC, towards any peer.
  const bool idle = d.inflight <= 1;
  if (d.rate.completed(op.length, now_, idle)) {
    nic_rate_[index].store(d.rate.bytes_per_second(), std::memory_order_relaxed);
  }
}

std::vector<uint64_t> Worker::nic_rates() const {
  std::vector<uint64_t> rates(domains_.size());
  for (size_t i = 0; i < rates.size(); ++i) rates[i] = nic_rate_[i].load(std::memory_order_relaxed);
  return rates;
}

// --- failover (docs/failover.md) --------------------------------------------------------------

std::vector<bool> Worker::up_nics() const {
  std::vector<bool> up(domains_.size());
  for (size_t i = 0; i < up.size(); ++i) up[i] = nic_up_[i].load(std::memory_order_relaxed);
  return up;
}

bool Worker::movable(const Op& op) const {
  // Work that was never posted can go over any NIC: rail-aligned addresses and keys come from
  // the op's destination, and every NIC of the peer has receive buffers for messages.
  return op.owner != nullptr;
}

bool Worker::failover_active() const {
  return config_.nic_timeout.count() > 0 && config_.nic_timeout < config_.peer_timeout &&
         domains_.size() >= 2;
}

void Worker::repost_copy(Op& op, uint32_t to) {
  Transfer& t = *op.transfer;
  op.abandoned = true;
  ++t.abandoned;
  ++abandoned_;
  Op& copy = t.retries.emplace_back(op);
  copy.abandoned = false;
  copy.lone = false;    // a fresh post on another NIC, not an isolation retry
  copy.send_slot = -1;  // the original keeps its buffer until the provider lets go of it
  copy.queue = nullptr;
  copy.prev = copy.next = nullptr;
  retarget(copy, to);
  if (copy.commit != nullptr) copy.commit->sent = now_;
  ++domains_[op.domain].failed_over;
  enqueue(copy);
}

void Worker::reroute_messages(uint32_t nic, PeerQueue& q) {
  // Only to a NIC whose own work towards the same peer is not stalled too: messages moved onto
  // a queue that is as late as this one would be moved back at the next look (a busy or slow
  // machine stalls every NIC at once; then it is peer_timeout's call).
  std::vector<bool> up(domains_.size());
  for (size_t i = 0; i < up.size(); ++i) {
    up[i] = !domains_[i].down && i != nic;
    for (auto& [p2, q2] : domains_[i].queues) {
      if (up[i] && q2.owner == q.owner && (q2.inflight_count > 0 || !q2.ops.empty()) &&
          now_ - q2.last_progress > config_.nic_timeout) {
        up[i] = false;
      }
    }
  }
  const uint32_t to = failover_nic(nic, up, failover_salt_++);
  if (to == nic || !up[to]) return;
  std::vector<Op*> unposted, posted;
  std::erase_if(q.ops, [&](Op* op) {
    const bool move = op->kind == Op::Kind::kSend && movable(*op);
    if (move) unposted.push_back(op);
    return move;
  });
  for (Op* op = q.inflight; op != nullptr; op = op->next) {
    if (op->kind == Op::Kind::kSend && movable(*op)) posted.push_back(op);
  }
  if (unposted.empty() && posted.empty()) return;
  detail::log().warn(
      "group {}: {} message(s) made no progress on NIC '{}' for {} ms; sending them over '{}'",
      group_, unposted.size() + posted.size(), domains_[nic].domain->info().name,
      config_.nic_timeout.count(), domains_[to].domain->info().name);
  queued_ -= unposted.size();
  for (Op* op : posted) {
    q.unlink(*op);  // still in the provider's hands, now as an abandoned request
    repost_copy(*op, to);
  }
  for (Op* op : unposted) {
    retarget(*op, to);
    enqueue(*op);
  }
}

void Worker::retarget(Op& op, uint32_t to) {
  engine::retarget(op, to, scratch(to));
}

void Worker::watch_nics() {
  if (!failover_active()) return;
  const auto timeout = config_.nic_timeout;
  auto stalled = [&](const PeerQueue& q) {
    return (q.inflight_count > 0 || !q.ops.empty()) && now_ - q.last_progress > timeout;
  };
  for (uint32_t i = 0; i < domains_.size(); ++i) {
    DomainState& d = domains_[i];
    if (d.down) {
      // Work still on a NIC that is down (probes; ops posted before it went down) gets the
      // same bound: moved or failed once it has made no progress for nic_timeout.
      std::vector<PeerQueue*> stuck;
      for (auto& [peer, q] : d.queues) {
        if (stalled(q)) stuck.push_back(&q);
      }
      for (PeerQueue* q : stuck) fail_over(i, *q, true);
      if (!d.probing && !stopping_ && now_ >= d.next_probe) {
        if (!d.probe_owner.empty()) {
          probe(i);
        } else {  // nothing to probe with (it stalled on engine messages only): try it again
          d.down = false;
          nic_up_[i].store(true);
        }
      }
      continue;
    }
    const PeerQueue* culprit = nullptr;
    for (auto& [peer, q] : d.queues) {
      if (!stalled(q) || q.owner.empty()) continue;
      // Down only if another NIC that is up reached the same peer within nic_timeout: else the
      // peer itself may be gone, which is peer_timeout's call.
      for (uint32_t j = 0; j < domains_.size() && culprit == nullptr; ++j) {
        if (j == i || domains_[j].down) continue;
        for (auto& [p2, q2] : domains_[j].queues) {
          if (q2.owner == q.owner && now_ - q2.last_progress <= timeout) {
            culprit = &q;
            break;
          }
        }
      }
      if (culprit != nullptr) break;
    }
    if (culprit != nullptr) {
      mark_down(i, *culprit);
      continue;
    }
    // No evidence against the NIC (no other NIC reached the same peer lately), but messages
    // stalled on it: they try another NIC, where a dead link would be bypassed. The receiver
    // drops a copy it already has.
    std::vector<PeerQueue*> stuck;
    for (auto& [peer, q] : d.queues) {
      if (stalled(q)) stuck.push_back(&q);
    }
    for (PeerQueue* q : stuck) reroute_messages(i, *q);
  }
}

void Worker::mark_down(uint32_t nic, const PeerQueue& culprit) {
  DomainState& d = domains_[nic];
  for (const Op* op = culprit.inflight; op != nullptr; op = op->next) {
    if (op->owner != nullptr) d.probe_owner = *op->owner;
  }
  for (const Op* op : culprit.ops) {
    if (op->owner != nullptr) d.probe_owner = *op->owner;
  }
  d.down = true;
  d.down_since = now_;
  d.next_probe = now_ + config_.nic_probe_interval;
  nic_up_[nic].store(false);
  detail::log().warn(
      "group {}: NIC '{}' marked down: no completion towards a peer for {} ms while another NIC "
      "reached it; its work moves to the surviving NICs",
      group_, d.domain->info().name, config_.nic_timeout.count());
  // Unposted work moves at once. Posted work moves (or fails) where it stalled; elsewhere it
  // may still complete, and is moved only if it stalls in turn.
  std::vector<PeerQueue*> queues;
  for (auto& [peer, q] : d.queues) queues.push_back(&q);
  for (PeerQueue* q : queues) {
    const bool stalled = now_ - q->last_progress > config_.nic_timeout;
    fail_over(nic, *q, stalled);
  }
}

void Worker::fail_over(uint32_t nic, PeerQueue& q, bool posted_too) {
  DomainState& d = domains_[nic];
  const transport::PeerHandle peer = q.peer;
  std::vector<Op*> unposted(q.ops.begin(), q.ops.end());
  unposted.insert(unposted.end(), q.suspects.begin(), q.suspects.end());
  queued_ -= unposted.size();
  q.ops.clear();
  q.suspects.clear();
  if (q.check != nullptr && !q.check_posted) {
    Op* check = std::exchange(q.check, nullptr);
    complete_op(*check, Status(ErrorCode::kPeerUnreachable, "NIC marked down"));
  }
  std::vector<Op*> posted;
  if (posted_too) {
    while (q.inflight != nullptr) {
      Op* op = q.inflight;
      q.unlink(*op);
      posted.push_back(op);
    }
  }
  if (q.inflight_count == 0) {
    d.queues.erase(peer);  // q is gone from here on
    std::erase(d.ready, peer);
  } else {
    q.ready = false;
    std::erase(d.ready, peer);
  }
  // The connection is dropped (a probe or a later transfer connects afresh): nothing posted on
  // it can complete any more, so its work requests are abandoned to the provider.
  if (posted_too) d.domain->forget_peer(peer);
  std::vector<bool> up(domains_.size());
  for (size_t i = 0; i < domains_.size(); ++i) up[i] = !domains_[i].down;
  const std::string& name = d.domain->info().name;
  for (Op* op : posted) {
    Transfer& t = *op->transfer;
    const uint32_t to = failover_nic(nic, up, failover_salt_++);
    const bool idempotent = (op->kind == Op::Kind::kWrite && !op->has_imm) ||
                            (op->kind == Op::Kind::kSend && movable(*op));
    if (idempotent && t.probe_nic < 0 && to != nic) {
      // Data only: the same bytes to the same place, so posting it again is harmless whether or
      // not the first one landed. A message: the receiver drops a second copy. The copy
      // completes in the original's place. The connection was dropped: the original's buffer
      // is free again.
      release_send_slot(*op);
      repost_copy(*op, to);
      continue;
    }
    op->abandoned = true;
    ++op->transfer->abandoned;
    ++abandoned_;
    Status error;
    if (to == nic && t.probe_nic < 0) {
      error = Status(ErrorCode::kPeerUnreachable,
                     fmt::format("NIC '{}' went down with this work in flight and no other NIC "
                                 "of the group is up",
                                 name));
    } else if (t.probe_nic >= 0) {
      error = Status(ErrorCode::kPeerUnreachable, "probe did not complete");
    } else if (op->kind == Op::Kind::kWrite && op->has_imm) {
      error = Status(ErrorCode::kPeerUnreachable,
                     fmt::format("NIC '{}' went down with a write carrying immediate {} in flight: "
                                 "the peer may or may not have counted it, so it is not sent "
                                 "again (Config::reliable_imm avoids this)",
                                 name, op->imm));
    } else {
      error =
          Status(ErrorCode::kPeerUnreachable,
                 fmt::format("NIC '{}' went down with a {} of {} bytes in flight that cannot be "
                             "sent again (it may have been delivered)",
                             name, op->kind == Op::Kind::kSend ? "message" : "write", op->length));
    }
    complete_op(*op, error);
  }
  for (Op* op : unposted) {
    const uint32_t to = failover_nic(nic, up, failover_salt_++);
    if (movable(*op) && op->transfer->probe_nic < 0 && to != nic) {
      retarget(*op, to);  // never posted: nothing can have landed, immediates included
      ++d.failed_over;
      enqueue(*op);
    } else {
      complete_op(*op,
                  Status(ErrorCode::kPeerUnreachable,
                         fmt::format("NIC '{}' is down and no other NIC can take this {}", name,
                                     op->kind == Op::Kind::kSend ? "message" : "write")));
    }
  }
}

void Worker::probe(uint32_t nic) {
  DomainState& d = domains_[nic];
  auto t = std::make_unique<Transfer>();
  t->id = kInternalTransfer | next_internal_++;
  t->probe_nic = static_cast<int>(nic);
  t->peers.push_back(d.probe_owner);
  t->ops.push_back(scratch_op(*t, nic, t->peers[0], scratch(nic)));
  d.probing = true;
  start_transfer(std::move(t));
}

void Worker::probe_done(Transfer& t) {
  DomainState& d = domains_[static_cast<uint32_t>(t.probe_nic)];
  d.probing = false;
  if (!t.error.is_ok() || !d.down) {
    d.next_probe = now_ + config_.nic_probe_interval;
    return;
  }
  d.down = false;
  d.rate.reset();  // measured afresh: until then it counts as fast as the fastest
  nic_rate_[static_cast<uint32_t>(t.probe_nic)].store(0);
  nic_up_[static_cast<uint32_t>(t.probe_nic)].store(true);
  detail::log().warn(
      "group {}: NIC '{}' is back up after {} ms ({} work requests moved off it)", group_,
      d.domain->info().name,
      std::chrono::duration_cast<std::chrono::milliseconds>(now_ - d.down_since).count(),
      d.failed_over);
  d.failed_over = 0;
}

// --- stopping -------------------------------------------------------------------------------

void Worker::begin_stop() {
  stopping_ = true;
  stop_deadline_ = std::chrono::steady_clock::now() + config_.close_timeout;
  std::vector<Op*> unposted;
  for (auto& d : domains_) {
    for (auto& [peer, q] : d.queues) {
      unposted.insert(unposted.end(), q.ops.begin(), q.ops.end());
      unposted.insert(unposted.end(), q.suspects.begin(), q.suspects.end());
      if (q.check != nullptr && !q.check_posted) unposted.push_back(q.check);
      q.check = nullptr;
      q.ops.clear();
      q.suspects.clear();
      q.ready = false;
    }
    d.ready.clear();
  }
  queued_ = 0;
  for (Op* op : unposted) complete_op(*op, cancelled("engine closed before it was posted"));
  if (fence_writes_) say_goodbye();  // behind what is posted: owners stop fencing this engine
}

void Worker::finish_stop() {
  // Copies still in flight point into transfers and regions: let them end first.
  for (CopierEntry& c : copiers_) c.copier->drain();
  ipc_open_.clear();
  ipc_batches_.clear();
  commit_jobs_.clear();
  awaiting_acks_.clear();
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
  for (auto& d : domains_) d.domain->close();  // peers see this endpoint gone now (shm)
  end_fences();  // unregistrations waiting on writers: nothing can land any more
}

void Worker::idle(bool active) {
  const auto now = now_;
  bool copying = false;
  for (const CopierEntry& c : copiers_) copying |= c.copier->outstanding() > 0;
  // Queued work waits for room in a provider queue that only polling makes: keep polling.
  if (active || queued_ > 0 || stopping_ || copying) {
    last_active_ = now;
    return;
  }
  if (config_.idle_sleep.count() == 0) return;  // pure busy-poll
  const bool inflight = posted_ > abandoned_;
  if (inflight) {
    if (config_.inflight_spin.count() < 0 || now - last_active_ < config_.inflight_spin) return;
  } else if (now - last_active_ < config_.spin_time) {
    return;
  }

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
  // In flight on a NIC without a descriptor: only polling notices its completions.
  if (inflight && !all_fds) return;
  sleeping_.store(true);
  if (!inbox_nonempty_.load() && !stop_requested_.load()) {
    std::chrono::nanoseconds nap = config_.idle_sleep;
    if (inflight) {
      nap = kMaxInflightBlock;
    } else if (all_fds) {
      nap = kMaxBlock;
    }
    timespec ts{static_cast<time_t>(nap.count() / 1000000000),
                static_cast<long>(nap.count() % 1000000000)};
    ::ppoll(fds, nfds, &ts, nullptr);
  }
  sleeping_.store(false);
  if (fds[0].revents & POLLIN) {  // a submitter wrote: consume it (no read when it did not)
    uint64_t drained = 0;
    [[maybe_unused]] ssize_t n = ::read(event_fd_, &drained, sizeof(drained));
  }
}

}  // namespace fabric::engine

// --- the staged path ------------------------------------------------------------------------
// GPU memory that the NICs cannot reach moves through the pinned host mirror of its region.
// Sender: ops reading a staged source wait, in gates of about staging_chunk_bytes, for their
// device-to-host copies. Writer into a staged destination: ranges that landed in the owner's
// mirror are committed (a Commit message) as they accumulate; the owner copies them into its
// GPU, counts the Commit's immediate after the copies, and acknowledges; the transfer
// completes on the last Ack.

namespace fabric::engine {

Result<cuda::Copier*> Worker::copier_for(const cuda::PointerInfo& device, Tokens tokens) {
  for (CopierEntry& c : copiers_) {
    if (c.device.kind == device.kind && c.device.device == device.device && c.tokens == tokens) {
      return c.copier.get();
    }
  }
  auto copier = cuda::Copier::create(device);
  if (!copier) return copier.status();
  copiers_.push_back({device, std::move(*copier), tokens});
  return copiers_.back().copier.get();
}

void Worker::stage_sources(Transfer& t) {
  const LocalRegion& src = *t.src;
  auto copier = copier_for(src.memory, Tokens::kGates);
  size_t i = 0;
  while (i < t.ops.size()) {
    if (t.ops[i].length == 0) {  // zero-byte writes read the scratch buffer
      enqueue(t.ops[i++]);
      continue;
    }
    Gate& gate = t.gates.emplace_back(Gate{&t, i, 0});
    Status status = copier ? Status::ok() : copier.status();
    uint64_t bytes = 0;
    while (status.is_ok() && i < t.ops.size() && t.ops[i].length > 0 &&
           bytes < config_.staging_chunk_bytes) {
      Op& op = t.ops[i++];
      auto* host = static_cast<std::byte*>(const_cast<void*>(op.local));
      status = (*copier)->copy(src.ptr + (host - src.host), host, op.length,
                               cuda::Copier::Direction::kToHost);
      bytes += op.length;
      ++gate.count;
    }
    if (status.is_ok()) status = (*copier)->fence(reinterpret_cast<uint64_t>(&gate));
    if (!status.is_ok()) {
      if (gate.count == 0) {  // no copier: the gate takes the op it could not copy
        gate.count = 1;
        ++i;
      }
      gate_done(gate, status);
    }
  }
}

bool Worker::poll_copies() {
  bool any = false;
  for (size_t e = 0; e < copiers_.size(); ++e) {
    if (copiers_[e].copier->outstanding() == 0) continue;
    copies_done_.clear();
    if (copiers_[e].copier->poll(copies_done_) == 0) continue;
    any = true;
    const Tokens tokens = copiers_[e].tokens;
    for (const cuda::Copier::Done& d : copies_done_) {
      if (tokens == Tokens::kIpcBatches) {
        ipc_batch_done(reinterpret_cast<IpcBatch*>(d.token), d.status);
      } else if (tokens == Tokens::kCommits) {
        auto* job = reinterpret_cast<CommitJob*>(d.token);
        if (!d.status.is_ok()) job->status = d.status;
        commit_done(*job);
      } else {
        gate_done(*reinterpret_cast<Gate*>(d.token), d.status);
      }
    }
  }
  return any;
}

void Worker::gate_done(Gate& gate, const Status& status) {
  for (size_t k = 0; k < gate.count; ++k) {
    Op& op = gate.transfer->ops[gate.first + k];
    if (!status.is_ok()) {
      complete_op(op, Status(status.code(), fmt::format("staging {} bytes from device memory: {}",
                                                        op.length, status.message())));
    } else if (stopping_) {
      complete_op(op, cancelled("engine closed before it was posted"));
    } else {
      enqueue(op);
    }
  }
}

void Worker::record_staged(Op& op) {
  Transfer& t = *op.transfer;
  if (!t.error.is_ok()) return;
  StagedDst& sd = t.staged[op.dst_index];
  if (!sd.unflushed.empty() &&
      sd.unflushed.back().offset + sd.unflushed.back().length == op.dst_offset) {
    sd.unflushed.back().length += op.length;
  } else {
    sd.unflushed.push_back({op.dst_offset, op.length});
  }
  sd.unflushed_bytes += op.length;
  // Commit as the data accumulates, so the owner's copies overlap the rest of the transfer.
  if (sd.unflushed_bytes >= config_.staging_chunk_bytes && !stopping_) {
    flush_commits(t, op.dst_index, false);
  }
}

void Worker::flush_commits(Transfer& t, uint32_t dst_index, bool final) {
  StagedDst& sd = t.staged[dst_index];
  const RemoteMemory& dst = t.dsts[dst_index];
  const Bytes& reply_to = self_;
  const uint64_t room = config_.max_message_bytes + kMessageHeaderBytes;
  const uint64_t fixed = Commit::kFixedBytes + reply_to.size();
  const uint64_t per_message = room > fixed ? (room - fixed) / Commit::kRangeBytes : 0;
  const bool imm_now = final && sd.has_imm && sd.unflushed.size() <= per_message;
  if (sd.unflushed.empty() && !imm_now) return;
  if (per_message == 0 && !sd.unflushed.empty()) {
    if (t.error.is_ok()) {
      t.error = Status(ErrorCode::kInvalidArgument,
                       "max_message_bytes is too small for the staged path's commit messages");
    }
    sd.unflushed.clear();
    return;
  }
  size_t pos = 0;
  do {
    const size_t n = std::min<size_t>(per_message, sd.unflushed.size() - pos);
    Commit c;
    c.transfer = t.id;
    c.reply_to = reply_to;
    c.region = dst.staged_region();
    c.ranges.assign(sd.unflushed.begin() + static_cast<std::ptrdiff_t>(pos),
                    sd.unflushed.begin() + static_cast<std::ptrdiff_t>(pos + n));
    pos += n;
    if (imm_now && pos == sd.unflushed.size()) {
      c.has_imm = true;
      c.imm = sd.imm;
      c.imm_times = sd.imm_times;
      sd.has_imm = false;
    }
    send_commit(t, c, dst.owner());
  } while (pos < sd.unflushed.size());
  sd.unflushed.clear();
  sd.unflushed_bytes = 0;
}

void Worker::send_commit(Transfer& t, const Commit& c, const Address& owner) {
  Bytes& msg = t.control_msgs.emplace_back(c.encode());
  CommitSend& cs = t.commits.emplace_back();
  cs.transfer = &t;
  cs.seq = stamp(msg);
  cs.message = &msg;
  cs.owner = &owner;
  unacked_.emplace(cs.seq, &cs);
  if (t.acks++ == 0) awaiting_acks_.push_back(&t);
  t.ack_deadline = now_ + config_.peer_timeout;
  resend_commit(cs, message_nic());
}

void Worker::resend_commit(CommitSend& cs, uint32_t to) {
  Transfer& t = *cs.transfer;
  const Address& owner = *cs.owner;
  Op& op = t.control.emplace_back(send_op(t, to, owner, *cs.message));
  op.commit = &cs;
  ++t.pending;
  ++cs.live;
  cs.domain = to;
  cs.sent = now_;
  enqueue(op);
}

void Worker::forget_commits(Transfer& t) {
  for (CommitSend& cs : t.commits) {
    if (!cs.acked) unacked_.erase(cs.seq);
    cs.acked = true;
  }
}

void Worker::handle_commit(const MessageHeader& header, std::span<const std::byte> body,
                           uint32_t domain) {
  auto commit = Commit::decode(body);
  auto reply = commit ? Address::decode(commit->reply_to) : Result<Address>(Status::ok());
  if (!commit || !reply || reply->empty()) {
    detail::log().warn("group {}: dropped a malformed commit message", group_);
    return;
  }
  auto owned = std::make_unique<CommitJob>();
  CommitJob& job = *owned;
  job.commit = std::move(*commit);
  job.sender = header.sender;
  job.seq = header.seq;
  job.reply_domain = domain;
  CommitJob* key = owned.get();
  commit_jobs_.emplace(key, std::move(owned));
  const CommitKey record{header.sender, header.seq};
  commit_records_[record] = CommitRecord{key, ErrorCode::kOk, {}, 0, {}};
  commit_order_.push_back(record);
  while (commit_order_.size() > kMaxCommitRecords) {
    commit_records_.erase(commit_order_.front());
    commit_order_.pop_front();
  }
  if (job.commit.ipc) {  // the CUDA IPC path (ipc_worker.cc)
    start_ipc_copy(job);
    return;
  }
  if (job.commit.region == 0) {
    // A reliable immediate (Config::reliable_imm) for host memory: the writes it follows have
    // completed, so the data is in place; nothing to copy, count it now.
    if (!job.commit.ranges.empty()) {
      job.status = Status(ErrorCode::kRemoteAccess, "commit of ranges without a staged region");
    }
    commit_done(job);
    return;
  }
  job.region = services_.regions ? services_.regions->find(job.commit.region) : nullptr;
  if (!job.region || job.region->worker != this || !job.region->staged()) {
    job.status = Status(ErrorCode::kRemoteAccess,
                        fmt::format("staged region {:#x} is not registered on this group (was "
                                    "it unregistered?)",
                                    job.commit.region));
    commit_done(job);
    return;
  }
  const LocalRegion& region = *job.region;
  for (const Range& r : job.commit.ranges) {
    if (r.offset > region.length || r.length > region.length - r.offset) {
      job.status = Status(ErrorCode::kRemoteAccess,
                          fmt::format("staged commit of {} bytes at offset {} exceeds the region "
                                      "({} bytes)",
                                      r.length, r.offset, region.length));
      commit_done(job);
      return;
    }
  }
  if (job.commit.ranges.empty()) {
    commit_done(job);
    return;
  }
  auto copier = copier_for(region.memory, Tokens::kCommits);
  Status s = copier ? Status::ok() : copier.status();
  for (const Range& r : job.commit.ranges) {
    if (!s.is_ok()) break;
    s = (*copier)->copy(region.ptr + r.offset, region.host + r.offset, r.length,
                        cuda::Copier::Direction::kToDevice);
  }
  if (s.is_ok()) s = (*copier)->fence(reinterpret_cast<uint64_t>(&job));
  if (!s.is_ok()) {
    job.status = s;
    commit_done(job);
  }
}

void Worker::commit_done(CommitJob& job) {
  if (job.status.is_ok() && job.commit.has_imm && job.commit.imm_times > 0) {
    std::vector<uint32_t> imms(job.commit.imm_times, job.commit.imm);
    std::vector<uint32_t> unexpected;
    services_.imms->arrive(imms, jobs_, unexpected);
    if (!unexpected.empty() && services_.on_unexpected) services_.on_unexpected(unexpected);
  }
  if (!job.status.is_ok()) {
    detail::log().warn("group {}: staged commit failed: {}", group_, job.status.to_string());
  }
  Ack ack{job.commit.transfer, job.seq, job.status.code(), job.status.message()};
  auto record = commit_records_.find({job.sender, job.seq});
  if (record != commit_records_.end()) {
    record->second =
        CommitRecord{nullptr, ack.code, ack.message, ack.transfer, job.commit.reply_to};
  }
  send_ack(*Address::decode(job.commit.reply_to), job.reply_domain, ack);
  commit_jobs_.erase(&job);
}

void Worker::commit_duplicate(const MessageHeader& header, uint32_t domain) {
  auto it = commit_records_.find({header.sender, header.seq});
  if (it == commit_records_.end()) {
    detail::log().warn(
        "group {}: a commit message arrived again after its result was "
        "forgotten; not acknowledged",
        group_);
    return;
  }
  CommitRecord& r = it->second;
  if (r.job != nullptr) {  // still being copied: its Ack goes back the way this copy came
    r.job->reply_domain = domain;
    return;
  }
  auto reply = Address::decode(r.reply);
  if (!reply) return;
  send_ack(*reply, domain, Ack{r.transfer, header.seq, r.code, r.message});
}

void Worker::send_ack(const Address& to, uint32_t domain, const Ack& ack) {
  send_internal(to, domain, ack.encode());
}

void Worker::handle_ack(std::span<const std::byte> body) {
  auto ack = Ack::decode(body);
  if (!ack) {
    detail::log().warn("group {}: dropped a malformed staged-path acknowledgment", group_);
    return;
  }
  // Late (the transfer gave up on it), or a second Ack of a Commit sent twice: ignored.
  auto it = unacked_.find(ack->commit);
  if (it == unacked_.end() || it->second->transfer->id != ack->transfer) return;
  CommitSend& cs = *it->second;
  unacked_.erase(it);
  cs.acked = true;
  Transfer& t = *cs.transfer;
  if (ack->code != ErrorCode::kOk && t.error.is_ok()) {
    const bool known = static_cast<int>(ack->code) <= static_cast<int>(ErrorCode::kInternal);
    t.error = Status(known ? ack->code : ErrorCode::kInternal,
                     fmt::format("the owner of the destination: {}", ack->message));
  }
  if (--t.acks == 0) {
    std::erase(awaiting_acks_, &t);
    if (t.pending == 0) make_ready(t);
  }
}

void Worker::send_internal(Address owner, uint32_t domain, Bytes message, bool urgent,
                           bool while_stopping) {
  auto t = std::make_unique<Transfer>();
  t->id = kInternalTransfer | next_internal_++;
  t->while_stopping = while_stopping;
  t->peers.push_back(std::move(owner));
  t->message = std::move(message);
  t->ops.push_back(send_op(*t, domain, t->peers[0], t->message));
  t->ops.back().urgent = urgent;
  start_transfer(std::move(t));
}

void Worker::watch_acks() {
  std::vector<Transfer*> overdue;
  std::vector<TransferId> waiting;
  for (Transfer* t : awaiting_acks_) {
    if (t->acks > 0 && now_ > t->ack_deadline) {
      overdue.push_back(t);
    } else {
      waiting.push_back(t->id);
    }
  }
  // A Commit delivered without an Ack for a while: the Ack (or the Commit) may be stuck on a
  // dead link, or lost with a connection the provider dropped after it reported the send
  // complete, so a copy goes over the next NIC that is up (the same one when it is the only
  // one). The owner counts it once.
  const auto resend_after =
      failover_active() ? config_.nic_timeout : std::chrono::milliseconds(config_.peer_timeout / 4);
  {
    size_t resent = 0;
    for (TransferId id : waiting) {
      auto it = live_.find(id);
      if (it == live_.end() || it->second->finished) continue;
      Transfer& t = *it->second;
      for (CommitSend& cs : t.commits) {
        if (cs.acked || cs.live > 0 || now_ - cs.sent <= resend_after) continue;
        resend_commit(cs, other_up_nic(cs.domain));
        ++resent;
      }
    }
    if (resent > 0) {
      detail::log().warn(
          "group {}: {} commit message(s) without an acknowledgment for {} ms: sent again over "
          "the next NIC that is up",
          group_, resent, resend_after.count());
    }
  }
  for (Transfer* t : overdue) {
    if (t->error.is_ok()) {
      t->error = Status(ErrorCode::kPeerUnreachable,
                        fmt::format("the owner of a staged destination did not acknowledge the "
                                    "copy into its device memory within {} ms",
                                    config_.peer_timeout.count()));
    }
    t->acks = 0;
    forget_commits(*t);
    std::erase(awaiting_acks_, t);
    if (t->pending == 0) make_ready(*t);
  }
}

}  // namespace fabric::engine
