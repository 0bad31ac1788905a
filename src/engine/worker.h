// Worker: the one thread that owns the NICs (domains) of a device group. It takes accepted
// transfers from an inbox, posts their work requests with per-peer queues (a full queue towards
// one peer never holds back another), polls completions, tallies immediates, reposts receive
// buffers, and hands every user callback to the engine's callback thread.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/bounded_queue.h"
#include "engine/callback_thread.h"
#include "engine/imm_counters.h"
#include "engine/ipc_copies.h"
#include "engine/live_transfers.h"
#include "engine/messages.h"
#include "engine/messenger.h"
#include "engine/nic_health.h"
#include "engine/op_builder.h"
#include "engine/posting_queues.h"
#include "engine/regions.h"
#include "engine/staged_path.h"
#include "engine/staged_writer.h"
#include "engine/transfer_pool.h"
#include "engine/transfer_state.h"
#include "engine/worker_counters.h"
#include "engine/write_fence.h"
#include "fabric/config.h"
#include "fabric/stats.h"
#include "transport/domain.h"

namespace fabric::engine {

// The worker's files (docs/engine.md, "Files"): worker.cc (creation, the loop, stopping, idling),
// worker_datapath.cc, worker_messages.cc (routing what the Messenger receives, internal
// messages), worker_failover.cc (the peer watchdog, and moving the work of a NIC that NicHealth
// finds down), worker_staged.cc (doing what the staged path's and CUDA IPC's components return),
// worker_fence.cc. Its components, which own their state and call nothing above them:
// PostingQueues (posting_queues.h, and posting_queues_isolation.cc: the per (NIC, peer) queues,
// round-robin posting, the in-flight lists, isolation), Messenger (messenger.h), StagedWriter
// (staged_writer.h: the writer's side of the staged path: gates, Commits awaiting Acks),
// StagedPath (staged_path.h: the owner's side of Commits), IpcCopies (ipc_copies.h: the owner's
// CUDA IPC copies), NicHealth (nic_health.h: which NICs are up, probes, measured rates),
// WriteFence (write_fence.h), TransferPool (transfer_pool.h), LiveTransfers (live_transfers.h).

inline Status cancelled(std::string_view why) {
  return Status(ErrorCode::kCancelled, std::string(why));
}

// What the worker needs from its engine.
struct WorkerServices {
  CallbackThread* callbacks;
  ImmCounters* imms;
  // Called on the worker with immediates that arrived with no expectation; `here`: the
  // handler runs on this thread (callbacks on the worker, or a caller-driven pass), else on
  // the callback thread.
  std::function<void(std::vector<uint32_t>&, bool here)> on_unexpected;
  // The engine's registrations (staged-path and CUDA IPC Commits name their region); outlives
  // the worker's thread.
  const RegionTable* regions = nullptr;
};

// True on a worker thread (of any engine): the engine's blocking calls refuse to run there.
bool on_worker_thread();

class Worker {
 public:
  // Takes ownership of the group's domains (rail order) and registers a scratch buffer on
  // each: the local source and remote target of zero-byte writes. Does not start the thread.
  static Result<std::unique_ptr<Worker>> create(
      uint32_t group, const Config& config, int cpu,
      std::vector<std::unique_ptr<transport::Domain>> domains, WorkerServices services);
  ~Worker();

  void start();
  // Stops taking work; lets posted work requests finish for up to Config::close_timeout;
  // fails everything left with kCancelled (callbacks queued); joins the thread; closes the
  // domains. Must run after no more submissions can arrive.
  void stop();

  uint32_t num_domains() const { return static_cast<uint32_t>(domains_.size()); }
  const transport::Domain& domain(uint32_t i) const { return *domains_[i].domain; }
  // The scratch buffer of NIC i, for the group address.
  uint64_t scratch_addr(uint32_t i) const { return domains_[i].scratch->remote_addr(); }
  uint64_t scratch_key(uint32_t i) const { return domains_[i].scratch->remote_key(); }
  // NIC i's scratch buffer: the local side of zero-byte writes.
  Scratch scratch(uint32_t i) {
    return {domains_[i].scratch_buf.get(), domains_[i].scratch->local_desc()};
  }
  int cpu() const { return cpu_; }
  // The group's own address, named in Commits so that the owner can acknowledge over any rail.
  // Set by the engine before start().
  void set_address(const Address& self) {
    self_ = self.encode();
    if (fence_writes_) open_fence();
  }
  // Failover: which of the group's NICs are up (not marked down). Thread-safe; submitting
  // threads plan new transfers over the NICs that are up.
  std::vector<bool> up_nics() const;
  // The same into `out` (its capacity kept: no allocation once it has the group's size).
  void up_nics(std::vector<bool>& out) const { health_->up_nics(out); }
  // Changes whenever up_nics() would give another answer (NicHealth::stamp).
  uint64_t up_stamp() const { return health_->stamp(); }
  // This worker's counts, for TransferEngine::stats().
  void fill_stats(GroupStats& g) const { counters_->fill(g); }
  // Weighted sharding: each NIC's measured write rate in bytes per second (0: not measured
  // yet), the weights of plan_single_up / split_even_up. Thread-safe.
  void nic_rates(std::vector<uint64_t>& out) const { health_->rates(out); }

  // Hands an accepted transfer to the worker. Thread-safe, non-blocking.
  void submit(TransferPtr transfer);
  // A transfer from this group's pool, for a submission (any thread; engine/transfer_pool.h).
  TransferPtr take_transfer() { return pool_.take(); }
  // Runs fn on the worker thread and waits for its result (inline when the worker is not
  // running). Thread-safe; must not be called from the worker itself.
  template <typename F>
  auto call(F&& fn) -> decltype(fn()) {
    using R = decltype(fn());
    std::packaged_task<R()> task(std::forward<F>(fn));
    auto fut = task.get_future();
    run_on_worker([&task] { task(); });
    progress_until(
        [&fut] { return fut.wait_for(std::chrono::seconds(0)) == std::future_status::ready; });
    return fut.get();
  }
  // GroupConfig::caller_progress: the group has no thread of its own.
  bool caller_driven() const { return caller_driven_; }
  // One pass of the loop on the calling thread (caller-driven groups): drains submissions,
  // posts, polls and runs the callbacks due. False when it did nothing, when another thread is
  // in a pass, or when the group is not caller-driven or has stopped.
  bool progress();
  // Caller-driven groups: drives passes (or lets the thread that is driving them work) until
  // `done` holds. Worker-thread groups: returns at once (their thread makes the progress; the
  // caller waits by its own means).
  void progress_until(const std::function<bool()>& done);
  // Releases provider registrations on the worker thread (or inline when it is not running),
  // then the staging mirror they registered, if any, then runs `done` (may be null).
  void release(std::vector<std::unique_ptr<transport::MemoryRegistration>> regs,
               std::unique_ptr<cuda::HostBuffer> mirror, std::function<void(const Status&)> done);

  // Worker-thread operations, for call().
  Result<std::vector<std::unique_ptr<transport::MemoryRegistration>>> register_on_all(
      void* ptr, uint64_t length, bool remote_read);
  Status start_receives(Messenger::Handler handler, uint64_t buffer_bytes, uint32_t count) {
    return messages_->start_receives(std::move(handler), buffer_bytes, count);
  }

 private:
  struct DomainState {
    std::unique_ptr<transport::Domain> domain;
    AlignedBuffer scratch_buf;
    std::unique_ptr<transport::MemoryRegistration> scratch;
  };
  Worker(uint32_t group, const Config& config, int cpu);
  void run_on_worker(std::function<void()> fn);
  // Wakes a sleeping worker thread: one eventfd write per sleep, whoever clears the flag.
  void wake();
  void run();
  // One pass of the loop: true when it did something; `finished` once a stop has completed.
  bool pass(bool& finished);
  bool drain_inbox();
  void start_transfer(TransferPtr t);
  // Posts on every NIC (PostingQueues::post_some), then does what the queues asked for.
  bool post_all();
  // Queues `op` on the PostingQueues (over a surviving NIC if its own is down).
  void enqueue(Op& op);
  // Does what the PostingQueues asked for since the last call (posting_queues.h, Event), in
  // order, after sending the write-fence notes they and the WriteFence returned and running the
  // fence rounds that ended; in rounds until none is left (kEventRounds at most: the rest waits
  // for the next pass). Called only at the top level of a pass (docs/engine.md): nothing a
  // handler calls comes back here. True when it did something.
  bool run_queue_events();
  static constexpr int kEventRounds = 8;
  // A posted op given up on (its queue was taken out) stays the provider's until it completes.
  void abandon(Op& op) {
    queues_->abandon(op);
    ++op.transfer->abandoned;
  }
  // A transfer of the engine's ends: how, its error code and completion time for stats().
  void count_end(const Transfer& t);
  // Counts `t` as ended with `error` (a transfer or a message; no completion time).
  void count_outcome(const Transfer& t, const Status& error);
  bool poll(uint32_t domain_index);
  void measure(uint32_t domain_index, const Op& op);  // a write completed: feed the RateMeter
  void complete_op(Op& op, const Status& status);
  // Completions are reported upward as events, not calls: an op or an Ack that leaves its
  // transfer with nothing outstanding puts the transfer's id on ready_ (settle, make_ready), and
  // the loop advances the transfers there once per pass (drain_ready). So nothing deep in
  // enqueue, a completion or a resend ever advances, finishes or frees a transfer under its
  // caller.
  void settle(Transfer& t) {
    if (--t.pending == 0) make_ready(t);
  }
  void make_ready(Transfer& t) { ready_.push_back(t.id); }
  bool drain_ready();
  // Called by drain_ready with nothing outstanding: what is left (Commits, deferred
  // immediates) goes out, or the transfer finishes. Calling it again changes nothing.
  void advance(Transfer& t);
  void finish(Transfer& t);
  // A receive completed: the Messenger reads it, this routes what it says, the buffer goes back.
  void on_recv(const transport::Completion& c, uint32_t domain);
  // The staged path (worker_staged.cc): doing what writer_, staged_ and ipc_ return.
  void stage_sources(Transfer& t);
  void release_gates();  // queues (or fails) the ops writer_ released
  // A read from a staged region: its ops, held while the owner copied the ranges into its
  // mirror, are queued (or failed with the transfer's error) once the last Ack came.
  void release_held(Transfer& t);
  void settle_landed();  // reads whose bytes writer_ copied on into device memory are done
  bool poll_copies();
  void record_staged(Op& op);
  void flush_commits(Transfer& t, uint32_t dst_index, bool final);
  void send_commits();  // stamps and sends the Commits writer_ returned
  // Does what the StagedPath asked for since the last call (staged_path.h, Event), in order.
  void run_staged_events();
  void send_ack(const Address& to, uint32_t domain, const Ack& ack);
  void handle_ack(std::span<const std::byte> body);
  // An urgent message goes ahead of the work already queued towards the peer; one sent
  // while_stopping is sent even once the engine stops.
  void send_internal(Address owner, uint32_t domain, Bytes message, bool urgent = false,
                     bool while_stopping = false);
  // Queues a copy of a Commit on NIC `to` (its first, failover, or its Ack overdue).
  void resend_commit(CommitSend& cs, uint32_t to);
  void forget_commits(Transfer& t);
  void watch_acks();
  void watch_peers();
  void declare_dead(uint32_t nic, transport::PeerHandle peer);
  // Failover: NicHealth decides (nic_health.h), these move the work.
  // Describes every NIC's queues to NicHealth (looks_), and acts on its verdict for each NIC.
  void watch_nics();
  void look_at_queues();
  // Marks `nic` down in health_ (`why`: what showed it; default: the watchdog's stall against
  // another NIC's progress) and moves its work to the surviving NICs.
  void mark_down(uint32_t nic, transport::PeerHandle stalled, std::string_view why = {});
  // Moves a NIC's queued work towards `peer` to the surviving NICs; with posted_too, also its
  // posted work (data-only writes re-posted, the rest failed) and drops the connection.
  void fail_over(uint32_t nic, transport::PeerHandle peer, bool posted_too);
  // Posts a copy of a posted op on NIC `to` in its place (the original is abandoned).
  void repost_copy(Op& op, uint32_t to);
  // Moves the messages of a stalled queue on a NIC that is not marked down to another NIC.
  void reroute_messages(uint32_t nic, transport::PeerHandle peer);
  void retarget(Op& op, uint32_t to);
  // Starts a probe of `nic` (down) towards `owner`; it ends in NicHealth::probe_done.
  void probe(uint32_t nic, const Address& owner);
  // Isolation (posting_queues_isolation.cc): the check of a suspect's peer that the queues
  // asked for (a zero-byte write to its scratch buffer), and its end, told to the queues.
  void start_check(uint32_t nic, transport::PeerHandle peer, const Op& suspect);
  void check_done(Transfer& t);
  // The CUDA IPC path (docs/cuda-ipc.md): the writer's Commits, the owner's copies (ipc_).
  void send_ipc_commits(Transfer& t, bool final);
  static bool ipc_left(const Transfer& t) { return StagedWriter::ipc_left(t); }
  void hand_ipc_done();  // the jobs ipc_ finished, to staged_ (their Acks, immediates)
  void flush_ipc_batches();
  void sweep_ipc();
  // The write fence (write_fence.h, docs/hardening.md "Unregister is a barrier"): the calls
  // that feed fence_ and send what it returns (worker_fence.cc).
  void open_fence();
  // Sends `notes` (urgent) and empties it; run_queue_events sends the queues' and fence_notes_.
  void send_fence_notes(std::vector<WriteFence::Note>& notes);
  // Runs the `done` of the fence rounds that ended; true when there was any.
  bool run_fence_settled();
  void handle_fence_note(const MessageHeader& header, std::span<const std::byte> body,
                         uint32_t domain);
  // Called with the registrations of a region closed: runs `done` once every writer known to
  // this engine has shown that nothing it posted before is still arriving: ok, or kTimeout
  // naming the writers that did not answer within the fence's timeout.
  void fence_writers(std::function<void(const Status&)> done);
  void watch_fences();
  // A peer declared dead (by its first NIC name): no fence waits for it, and a write towards
  // it announces this engine afresh.
  void peer_gone_from_fence(const Bytes& first_nic);
  // The engine stops: tells every owner it announced itself to, from each NIC, behind the writes
  // posted there, that it will write no more.
  void say_goodbye();
  void end_fences();  // the domains are closed (finish_stop): every round is done
  void begin_stop();
  void finish_stop();
  void idle(bool active);

  const uint32_t group_;
  const Config config_;
  // Idle transfers for this group's submissions and the worker's own (transfer_pool.h). Before
  // everything that holds a transfer, so destroyed after it.
  static constexpr size_t kPooledTransfers = 1024;
  TransferPool pool_{kPooledTransfers};
  int cpu_;
  WorkerServices services_;
  std::vector<DomainState> domains_;
  // Two-sided messages: send and receive pools, stamps, dedup (made in create(), on domains_).
  std::unique_ptr<Messenger> messages_;
  // The writer's side of the staged path: gates and their host-bound copiers, Commits awaiting
  // Acks (made in create()).
  std::unique_ptr<StagedWriter> writer_;
  // The owner's side of Commits: jobs, commit records, device-bound copiers (made in create()).
  std::unique_ptr<StagedPath> staged_;
  // The CUDA IPC path's owner copies: imports, copiers, batches (made in create()).
  std::unique_ptr<IpcCopies> ipc_;
  // Failover and weighted sharding: which NICs are up, their rates (made in create()).
  std::unique_ptr<NicHealth> health_;
  // Every NIC's queues towards every peer, posting round-robin, isolation (made in create()).
  std::unique_ptr<PostingQueues> queues_;
  std::vector<PostingQueues::Event> queue_events_;  // run_queue_events: keeps its capacity
  // watch_nics: each NIC's queues as NicHealth sees them, and the peers they lead to.
  std::vector<std::vector<NicHealth::QueueLook>> looks_;
  std::vector<std::vector<transport::PeerHandle>> look_peers_;
  uint64_t next_internal_ = 0;
  Bytes self_;

  // The write fence (write_fence.h), on domains whose provider checks a key once per write
  // (DomainInfo::key_checked_once); null elsewhere.
  bool fence_writes_ = false;  // some domain is key_checked_once
  std::unique_ptr<WriteFence> fence_;
  // What fence_ returned to send, wherever it was fed (a note received in a poll, a region
  // released deep in a transfer's end): sent by run_queue_events, at the pass's top level.
  std::vector<WriteFence::Note> fence_notes_;

  // Worker-thread state.
  LiveTransfers live_{kPooledTransfers};
  // Transfers with nothing outstanding, to advance (an id may be there twice, or name a
  // transfer gone since: drain_ready skips those); ready_batch_ keeps its capacity.
  std::vector<TransferId> ready_;
  std::vector<TransferId> ready_batch_;
  std::chrono::steady_clock::time_point next_watch_;
  std::chrono::steady_clock::time_point now_;  // read once per loop pass
  bool stopping_ = false;
  std::chrono::steady_clock::time_point stop_deadline_;
  std::chrono::steady_clock::time_point last_active_;
  std::vector<transport::Completion> completions_;
  std::vector<uint32_t> imm_batch_;
  std::vector<CallbackThread::Job> jobs_;
  // Hands jobs_ to the callback thread, or runs them here (Config::callbacks_on_worker).
  void run_jobs();
  std::vector<uint32_t> unexpected_;

  // Inbox, shared with submitting threads. Transfers come through the lock-free ring (each entry
  // owns its transfer); when it is full, through inbox_transfers_ under inbox_mu_, and while
  // that list holds any (overflowing_), every submission queues behind them there, so that a
  // thread's submissions start in the order it made them. Commands always take the lock.
  struct RingEntry {
    Transfer* transfer;
    TransferPool* pool;
  };
  BoundedQueue<RingEntry> ring_;
  std::atomic<bool> overflowing_{false};
  std::mutex inbox_mu_;
  std::vector<TransferPtr> inbox_transfers_;
  std::vector<std::function<void()>> inbox_commands_;
  // The worker's side of the inbox: swapped with the inbox under the lock, emptied, and swapped
  // back at the next drain, so neither side allocates once both have grown.
  std::vector<TransferPtr> drained_transfers_;
  std::vector<std::function<void()>> drained_commands_;
  std::atomic<bool> inbox_nonempty_{false};
  // Written by the worker around each sleep and read by every submitter: a line of its own.
  std::unique_ptr<WorkerCounters> counters_;  // made in create(), once the NICs are known
  alignas(64) std::atomic<bool> sleeping_{false};
  char sleeping_pad_[64 - sizeof(std::atomic<bool>)];
  std::atomic<bool> stop_requested_{false};
  std::atomic<bool> running_{false};
  int event_fd_ = -1;
  std::thread thread_;
  bool caller_driven_ = false;
  // Whether callbacks run on the thread of the pass (Config::callbacks_on_worker, or a
  // caller-driven group) rather than on the engine's callback thread.
  bool callbacks_here() const { return config_.callbacks_on_worker || caller_driven_; }
  std::mutex pass_mu_;  // caller-driven: held by the thread in a pass
};

}  // namespace fabric::engine
