// Worker: creation, the loop (inbox, passes, callbacks due), registration on every NIC,
// stopping and idling. The rest of the class is in the files worker.h lists.
#include "engine/worker.h"

#include <fmt/format.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include "common/fence.h"
#include "common/log.h"

#include <cstdlib>
#include <cstring>
#include <utility>

#include "engine/plan.h"
#include "topology/topology.h"

namespace fabric::engine {

namespace {

constexpr uint64_t kScratchBytes = 64;
constexpr auto kMaxBlock = std::chrono::milliseconds(100);
// The longest block while work requests are in flight: bounds the cost of a provider that
// needs a poll to make progress yet let fi_trywait succeed.
constexpr auto kMaxInflightBlock = std::chrono::milliseconds(1);
// Ids of the worker's own transfers (acknowledgments): never equal to an engine transfer id.

}  // namespace

LocalRegion::~LocalRegion() {
  if (copy_engines) {  // unlocked once the NICs let go, before unregister_memory returns
    on_released = [released = std::move(on_released), device = *copy_engines,
                   p = ptr](const Status& s) {
      cuda::unpin_for_copies(device, p);
      if (released) released(s);
    };
  }
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
      ring_(config.submission_ring),
      caller_driven_(group < config.groups.size() && config.groups[group].caller_progress) {}

Result<std::unique_ptr<Worker>> Worker::create(
    uint32_t group, const Config& config, int cpu,
    std::vector<std::unique_ptr<transport::Domain>> domains, WorkerServices services) {
  std::unique_ptr<Worker> w(new Worker(group, config, cpu));
  w->services_ = std::move(services);
  w->writer_ = std::make_unique<StagedWriter>(
      StagedWriter::Options{config.staging_chunk_bytes,
                            config.max_message_bytes + kMessageHeaderBytes, config.peer_timeout});
  w->staged_ = std::make_unique<StagedPath>(group, w->services_.regions, w.get());
  w->ipc_ = std::make_unique<IpcCopies>(w->services_.regions, w.get(),
                                        IpcCopies::Options{config.cuda_ipc_streams});
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
    auto reg = d.domain->register_memory(d.scratch_buf.get(), kScratchBytes, false);
    if (!reg) return reg.status();
    d.scratch = std::move(*reg);
    w->fence_writes_ |= d.domain->info().key_checked_once;
    w->domains_.push_back(std::move(d));
  }
  w->counters_ = std::make_unique<WorkerCounters>(w->domains_.size());
  std::vector<std::string> names;
  for (auto& d : w->domains_) names.push_back(d.domain->info().name);
  w->health_ = std::make_unique<NicHealth>(group, std::move(names), config);
  std::vector<transport::Domain*> nics;
  for (auto& d : w->domains_) nics.push_back(d.domain.get());
  auto messages =
      Messenger::create(group, std::move(nics),
                        {config.max_message_bytes, config.send_buffers, config.control_buffers});
  if (!messages) return messages.status();
  w->messages_ = std::move(*messages);
  std::vector<transport::Domain*> queue_nics;
  for (auto& d : w->domains_) queue_nics.push_back(d.domain.get());
  w->queues_ = std::make_unique<PostingQueues>(
      group, config,
      PostingQueues::Below{std::move(queue_nics), w->messages_.get(), w->health_.get(),
                           w->counters_.get()});
  return w;
}

Worker::~Worker() {
  stop();
  for (RingEntry e{}; ring_.try_pop(e);) TransferPtr(e.transfer, TransferRecycler{e.pool});
  // Registrations before the domains they live on.
  messages_.reset();
  staged_.reset();  // its jobs hold regions, which release on the domains
  live_.clear();
  writer_.reset();  // the copiers (drained by stop())
  ipc_.reset();
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
  std::vector<TransferPtr> transfers;
  std::vector<std::function<void()>> commands;
  {
    std::lock_guard lock(inbox_mu_);
    running_.store(false);
    transfers.swap(inbox_transfers_);
    commands.swap(inbox_commands_);
  }
  // The ring's last entries: no submitter is left (close() waits for them before stopping).
  for (RingEntry e{}; ring_.try_pop(e);) {
    transfers.push_back(TransferPtr(e.transfer, TransferRecycler{e.pool}));
  }
  for (auto& c : commands) c();
  for (auto& t : transfers) {
    if ((t->id & kInternalTransfer) == 0) count_outcome(*t, cancelled("engine closed"));
    if (t->callbacks.counter != nullptr) t->callbacks.counter->record(cancelled("engine closed"));
    if (t->callbacks.on_error) {
      services_.callbacks->push(
          [cb = std::move(t->callbacks.on_error)] { cb(cancelled("engine closed")); });
    }
  }
}

void Worker::wake() {
  // One wake-up per sleep: the caller that clears the flag writes, the others need not.
  if (sleeping_.load() && sleeping_.exchange(false)) {
    counters_->wakeups.fetch_add(1, std::memory_order_relaxed);
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(event_fd_, &one, sizeof(one));
  }
}

void Worker::submit(TransferPtr transfer) {
  const RingEntry entry{transfer.get(), transfer.get_deleter().pool};
  if (!overflowing_.load(std::memory_order_acquire) && ring_.try_push(entry)) {
    (void)transfer.release();  // the ring's entry owns it now
  } else {
    counters_->ring_full.fetch_add(1, std::memory_order_relaxed);
    std::lock_guard lock(inbox_mu_);
    inbox_transfers_.push_back(std::move(transfer));
    overflowing_.store(true);
    inbox_nonempty_.store(true);
  }
  // Pairs with the fence in idle(): either the worker sees this submission before it sleeps,
  // or this thread sees it sleeping and wakes it. A caller-driven group never sleeps (idle()
  // runs only on a worker thread): no fence, which costs tens of cycles, and nothing to wake.
  if (caller_driven_) return;
  full_fence();
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
  // still sending are fenced (worker_fence.cc) before `done` runs.
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
    void* ptr, uint64_t length, bool remote_read) {
  std::vector<std::unique_ptr<transport::MemoryRegistration>> regs;
  for (auto& d : domains_) {
    auto reg = d.domain->register_memory(ptr, length, remote_read);
    if (!reg) return reg.status();
    regs.push_back(std::move(*reg));
  }
  return regs;
}

// --- the loop -------------------------------------------------------------------------------

void Worker::run_jobs() {
  if (!callbacks_here() || stopping_) {
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
  WorkerCounters::bump(counters_->passes);
  bool active = drain_inbox();
  if (!stopping_ && stop_requested_.load()) {
    begin_stop();
    run_queue_events();  // the Goodbyes
  }
  // Post before polling: a fresh submission reaches the wire without waiting for a pass of
  // polls (each of which runs the provider's progress), and polls then see it sooner.
  active |= post_all();
  for (uint32_t i = 0; i < domains_.size(); ++i) active |= poll(i);
  // The events are taken here, at the top level, never inside the calls that raised them: what
  // the completions asked for (isolation, fence notes received).
  active |= run_queue_events();
  if (ipc_->has_open()) flush_ipc_batches();  // the Commits those polls read
  if (writer_->has_copiers() || ipc_->has_copiers() || staged_->has_copiers()) {
    active |= poll_copies();
  }
  active |= post_all();
  watch_peers();
  active |= drain_ready();
  active |= run_queue_events();  // what ending transfers (checks) and the watchdog asked for
  if (!jobs_.empty()) run_jobs();
  finished = stopping_ && (queues_->posted() == queues_->abandoned() || now_ >= stop_deadline_);
  return active;
}

bool Worker::drain_inbox() {
  // At most one ring's worth per pass, so that a pass ends while submitters keep pushing.
  bool active = false;
  RingEntry e{};
  for (size_t n = ring_.capacity(); n > 0 && ring_.try_pop(e); --n) {
    start_transfer(TransferPtr(e.transfer, TransferRecycler{e.pool}));
    active = true;
  }
  if (!inbox_nonempty_.load()) return active;
  {
    std::lock_guard lock(inbox_mu_);
    drained_transfers_.swap(inbox_transfers_);
    drained_commands_.swap(inbox_commands_);
    inbox_nonempty_.store(false);
    overflowing_.store(false);
  }
  for (auto& c : drained_commands_) c();
  for (auto& t : drained_transfers_) start_transfer(std::move(t));
  drained_commands_.clear();  // keeps their capacity for the next swap
  drained_transfers_.clear();
  return true;
}

// --- stopping -------------------------------------------------------------------------------

void Worker::begin_stop() {
  stopping_ = true;
  stop_deadline_ = std::chrono::steady_clock::now() + config_.close_timeout;
  queues_->stop();
  std::vector<Op*> unposted;
  queues_->take_all_queued(unposted);
  for (Op* op : unposted) complete_op(*op, cancelled("engine closed before it was posted"));
  if (fence_) say_goodbye();  // behind what is posted: owners stop fencing this engine
}

void Worker::finish_stop() {
  // Events the last pass left (a pass takes a bounded number of rounds), while their ops'
  // transfers are alive; stopping, they raise no more for ever (no Commit is sent again).
  while (run_queue_events()) {
  }
  // Copies still in flight point into transfers and regions: let them end first.
  writer_->drain();
  ipc_->drain();
  staged_->drain();
  writer_->forget_all();
  if (const size_t left = queues_->posted() - queues_->abandoned(); left > 0) {
    detail::log().warn("group {}: closing with {} work requests still in flight after {} ms",
                       group_, left, config_.close_timeout.count());
  }
  // The domains close first: what is still posted stops (queue pairs and endpoints go), and
  // peers see this endpoint gone (shm). A callback that says "cancelled" then runs when
  // nothing of its transfer reads or writes memory any more.
  for (auto& d : domains_) d.domain->close();
  std::vector<Transfer*> left;
  live_.for_each([&left](Transfer& t) {
    if (!t.finished) left.push_back(&t);
  });
  for (Transfer* t : left) {
    if (t->error.is_ok()) t->error = cancelled("engine closed with the transfer in flight");
    t->abandoned = 0;  // the domains closed: the provider let go of everything
    finish(*t);
  }
  live_.clear();
  if (!jobs_.empty()) services_.callbacks->push(jobs_);
  end_fences();  // unregistrations waiting on writers: nothing can land any more
}

void Worker::idle(bool active) {
  const auto now = now_;
  const bool copying = writer_->copying() || ipc_->copying() || staged_->copying();
  // Queued work waits for room in a provider queue that only polling makes: keep polling.
  if (active || queues_->queued() > 0 || stopping_ || copying) {
    last_active_ = now;
    return;
  }
  if (config_.idle_sleep.count() == 0) return;  // pure busy-poll
  const bool inflight = queues_->posted() > queues_->abandoned();
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
  full_fence();  // pairs with the one in submit()
  if (ring_.empty_hint() && !inbox_nonempty_.load() && !stop_requested_.load()) {
    std::chrono::nanoseconds nap = config_.idle_sleep;
    if (inflight) {
      nap = kMaxInflightBlock;
    } else if (all_fds) {
      nap = kMaxBlock;
    }
    timespec ts{static_cast<time_t>(nap.count() / 1000000000),
                static_cast<long>(nap.count() % 1000000000)};
    WorkerCounters::bump(counters_->sleeps);
    ::ppoll(fds, nfds, &ts, nullptr);
  }
  sleeping_.store(false);
  if (fds[0].revents & POLLIN) {  // a submitter wrote: consume it (no read when it did not)
    uint64_t drained = 0;
    [[maybe_unused]] ssize_t n = ::read(event_fd_, &drained, sizeof(drained));
  }
}

}  // namespace fabric::engine
