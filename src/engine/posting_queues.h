// PostingQueues: the posting queues of one worker's NICs, as a component (docs/engine.md,
// "Files").
//
// It owns, for every NIC of the group, a queue per peer NIC (PeerQueue: the ops waiting to be
// posted, the posted ones, the isolation state, the write fence's epoch), the round-robin list
// of peers with work, the count of ops posted on the NIC, and the group's totals (queued,
// posted, abandoned). One object for all the group's NICs rather than one per NIC: the watchdog,
// NicHealth's look and failover compare queues across NICs (the same peer engine over another
// NIC), and the totals the worker sleeps on are the group's.
//
// It posts through the Domains it is given and uses only components below it, which call
// nothing above them: the Messenger (a send's registered buffer), NicHealth (whether a refused
// post shows the NIC at fault; a write's post for the rate meter), the WriteFence (whether a
// write must wait for its owner's HelloAck) and the WorkerCounters. What it cannot decide
// itself goes back to the worker as Events (an op to complete with a status, a check to build,
// a NIC found unreachable) and as write-fence notes to send, in the order they arose; the
// worker takes them (take_events, notes) at the top level of its pass, never inside a call, and
// acts on them. It never completes an op or touches a transfer but for the op's own fields.
//
// Isolation (docs/hardening.md, "One bad write") is its own state machine over a queue
// (posting_queues_isolation.cc): failed suspects posted again one at a time, checks, backoff,
// resets.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/messenger.h"
#include "engine/nic_health.h"
#include "engine/transfer_state.h"
#include "engine/worker_counters.h"
#include "engine/write_fence.h"
#include "fabric/config.h"
#include "fabric/status.h"
#include "transport/domain.h"

namespace fabric::engine {

// The work requests of one domain towards one peer NIC: those waiting to be posted (FIFO), and
// those posted and not yet completed (an intrusive list, for the dead-peer watchdog).
struct PeerQueue {
  transport::PeerHandle peer = 0;
  uint32_t nic = 0;  // the NIC it posts on
  std::deque<Op*> ops;
  bool ready = false;  // listed in its NIC's round-robin list
  Op* inflight = nullptr;
  size_t inflight_count = 0;
  std::chrono::steady_clock::time_point last_progress;
  // The peer engine's first NIC name: tells which queues of different NICs lead to one peer.
  Bytes owner;
  // The count of ops posted on this queue's NIC, towards any peer (PostingQueues::Nic::inflight).
  size_t* nic_inflight = nullptr;
  // Isolation (docs/hardening.md, "One bad write"): work requests that failed in a way another
  // one could have caused (the provider dropped the connection), posted again one at a time.
  // While any is left, or the peer is being checked, nothing else is posted towards the peer.
  std::deque<Op*> suspects;
  Op* check = nullptr;  // the check (a zero-byte write to the peer's scratch buffer), if any
  bool check_posted = false;
  // The write found at fault (refused alone), and its error: reported once a check has gone
  // through over a fresh connection, so that work submitted after the report finds a
  // connection that works (the peer may drop the first one made after a refusal too).
  Op* refused = nullptr;
  Status refusal;
  bool broken = false;  // the last failure may have broken the connection: reset it first
  // The write fence: the WriteFence::epoch() at which the peer was found to have
  // acknowledged this engine's Hello (write_fence.cc); another value: look again.
  uint64_t announced_epoch = 0;
  // Failing since (no lone post or check has completed since), and when to post next: the
  // provider needs a moment to notice a dropped connection and connect afresh.
  std::chrono::steady_clock::time_point failing_since;
  std::chrono::steady_clock::time_point not_before;
  std::chrono::microseconds backoff{0};

  // Also while a reset is due: nothing more is posted on a connection a refusal broke.
  bool isolating() const {
    return !suspects.empty() || check != nullptr || broken || refused != nullptr;
  }

  void link(Op& op) {
    op.queue = this;
    op.prev = nullptr;
    op.next = inflight;
    if (inflight) inflight->prev = &op;
    inflight = &op;
    ++inflight_count;
    if (nic_inflight != nullptr) ++*nic_inflight;
  }
  void unlink(Op& op) {
    if (op.prev) op.prev->next = op.next;
    if (op.next) op.next->prev = op.prev;
    if (inflight == &op) inflight = op.next;
    op.prev = op.next = nullptr;
    op.queue = nullptr;
    --inflight_count;
    if (nic_inflight != nullptr) --*nic_inflight;
  }
};

// Work that was never posted can go over any NIC: rail-aligned addresses and keys come from the
// op's destination, and every NIC of the peer has receive buffers for messages.
inline bool movable(const Op& op) {
  return op.owner != nullptr;
}

class PostingQueues {
 public:
  using Clock = std::chrono::steady_clock;

  // What the queues ask the worker to do, in order.
  struct Event {
    enum class Kind : uint8_t {
      kComplete,     // complete `op` with `status`
      kCheck,        // isolation: build a check of queue (nic, peer) and give it to set_check;
                     // `op`: the suspect, whose owner and peer NIC it checks
      kUnreachable,  // a post on `nic` found `peer` unreachable while another NIC is up: mark
                     // the NIC down (`status`: why), the op stays queued
    };
    Kind kind = Kind::kComplete;
    Op* op = nullptr;
    Status status;
    uint32_t nic = 0;
    transport::PeerHandle peer = 0;
  };
  // What take_out took from a queue.
  struct Taken {
    Bytes owner;              // the peer engine's first NIC name
    std::vector<Op*> posted;  // unlinked, still in the provider's hands (posted_too only)
    std::vector<Op*> queued;  // never posted: the queue's ops, then its suspects
    size_t suspects = 0;      // of `queued`
    Op* check = nullptr;      // the isolation check, if not posted
    bool checking = false;    // a check, posted or not
  };
  // The components below, which must outlive the queues. `fence` may be null (set_fence).
  struct Below {
    std::vector<transport::Domain*> domains;  // rail order
    Messenger* messages = nullptr;
    NicHealth* health = nullptr;
    WorkerCounters* counters = nullptr;
  };

  // Reads Config::post_budget and peer_timeout.
  PostingQueues(uint32_t group, const Config& config, Below below);

  // The write fence, once the worker has one (it is made when the group's address is known).
  void set_fence(WriteFence* fence) { fence_ = fence; }
  // The engine stops: isolation gives up on what it cannot resolve (no more checks).
  void stop() { stopping_ = true; }

  // --- the data path
  // Queues `op` on its NIC towards its peer (an urgent one at the front). Fails (nothing
  // queued) when the peer's name does not resolve.
  Status enqueue(Op& op, Clock::time_point now);
  // Posts round-robin across the NIC's peers, at most Config::post_budget work requests. A peer
  // the provider answers "again" keeps its order and waits; the others go on. True when it did
  // something.
  bool post_some(uint32_t nic, Clock::time_point now);
  // A posted op's completion was polled (not an abandoned one's: let_go). True: the worker
  // completes it with `status`; false: the queues keep it (a suspect) or have said what to do
  // with it (events).
  bool completed(Op& op, const Status& status, Clock::time_point now);
  // An abandoned op's completion was polled: the provider has let go of it.
  void let_go() {
    --posted_;
    --abandoned_;
  }
  // A posted op that is given up on (its queue was taken out) stays the provider's: counted
  // until let_go.
  void abandon(Op& op) {
    op.abandoned = true;
    ++abandoned_;
  }

  // --- isolation (posting_queues_isolation.cc)
  // Whether queue (nic, peer) still waits for the check a kCheck event asked for (it may have
  // been taken out since); then set_check gives it the check the worker built.
  bool wants_check(uint32_t nic, transport::PeerHandle peer) const;
  void set_check(uint32_t nic, transport::PeerHandle peer, Op& check);
  // The check transfer of queue (nic, peer) ended (`error`: how).
  void check_done(uint32_t nic, transport::PeerHandle peer, const Status& error,
                  Clock::time_point now);

  // --- what the watchdog and failover need
  // Queues that are busy (work queued, posted or isolating) with no progress for peer_timeout:
  // dead, into `out` as (nic, peer). A queue with nothing posted is spared (its clock starts
  // afresh) while another queue of its NIC stalls with work posted: that one goes first.
  void find_dead(Clock::time_point now,
                 std::vector<std::pair<uint32_t, transport::PeerHandle>>& out);
  // Every NIC's queues as NicHealth sees them (nic_timeout: `timeout`), and the peers they lead
  // to, in the same order.
  void look(Clock::time_point now, std::chrono::milliseconds timeout,
            std::vector<std::vector<NicHealth::QueueLook>>& looks,
            std::vector<std::vector<transport::PeerHandle>>& peers) const;
  // The peers of `nic`'s queues, each with whether it stalled (no progress for `timeout`).
  void peers_of(uint32_t nic, Clock::time_point now, std::chrono::milliseconds timeout,
                std::vector<std::pair<transport::PeerHandle, bool>>& out) const;
  // Whether a queue of `nic` towards `owner` has work and no progress for `timeout`.
  bool stalled_towards(uint32_t nic, const Bytes& owner, Clock::time_point now,
                       std::chrono::milliseconds timeout) const;
  // The peer engine to probe a NIC towards, from queue (nic, peer)'s ops (empty: none known).
  Address owner_of(uint32_t nic, transport::PeerHandle peer) const;
  const Bytes* owner_name(uint32_t nic, transport::PeerHandle peer) const;
  // Takes the queued work (and the check, if not posted) out of queue (nic, peer); with
  // posted_too its posted work too, and the domain forgets the peer (the connection is
  // dropped). The queue is erased once nothing it posted is left in it.
  Taken take_out(uint32_t nic, transport::PeerHandle peer, bool posted_too);
  // Takes out the queue's movable messages, queued and posted (unlinked).
  void take_messages(uint32_t nic, transport::PeerHandle peer, std::vector<Op*>& queued,
                     std::vector<Op*>& posted);
  // The engine stops: every op not posted yet, every NIC (the checks not posted included).
  void take_all_queued(std::vector<Op*>& out);

  // --- counts
  size_t queued() const { return queued_; }
  size_t posted() const { return posted_; }        // in the provider's hands
  size_t abandoned() const { return abandoned_; }  // of those, given up on
  size_t inflight(uint32_t nic) const { return nics_[nic].inflight; }
  // The queue of (nic, peer), if any (tests and the log).
  const PeerQueue* find(uint32_t nic, transport::PeerHandle peer) const;

  // --- what the worker takes after each call
  // Swaps the events that arose since the last call into `out` (empty); false when none.
  bool take_events(std::vector<Event>& out) {
    if (events_.empty()) return false;
    out.swap(events_);
    return true;
  }
  // Write-fence notes to send (urgent), for the worker to empty.
  std::vector<WriteFence::Note>& notes() { return notes_; }

 private:
  struct Nic {
    transport::Domain* domain = nullptr;
    std::unordered_map<transport::PeerHandle, PeerQueue> queues;
    std::deque<transport::PeerHandle> ready;  // peers with queued ops, in round-robin order
    size_t inflight = 0;                      // ops posted, towards any peer
  };

  // Posts `op` and counts the outcome for stats().
  transport::PostResult post(uint32_t nic, Op& op, transport::PeerHandle peer);
  // A post's outcome for an op taken off a queue: linked, or a kComplete event.
  void posted_or_failed(PeerQueue& q, Op& op, const transport::PostResult& r);
  void complete(Op& op, Status status) {
    events_.push_back({Event::Kind::kComplete, &op, std::move(status), 0, 0});
  }
  // True when `op` must wait for its owner to acknowledge this engine's Hello (sent, as notes).
  bool held_for_hello(uint32_t nic, PeerQueue& q, const Op& op, Clock::time_point now);
  // Posts the urgent op (a write-fence note) at the front of q, if any.
  void post_urgent(uint32_t nic, PeerQueue& q);
  void make_ready(Nic& n, PeerQueue& q);  // listed in n.ready, for post_some
  // Isolation (posting_queues_isolation.cc).
  bool isolate(uint32_t nic, PeerQueue& q, Op& op, const Status& error, Clock::time_point now);
  void post_isolated(uint32_t nic, PeerQueue& q, Clock::time_point now);
  void lone_done(uint32_t nic, PeerQueue& q, Op& op, const Status& status, Clock::time_point now);
  void check_peer(uint32_t nic, PeerQueue& q, Clock::time_point now);
  // Completes the write found at fault, if any, with its refusal.
  void report_refusal(PeerQueue& q);
  static void answered(PeerQueue& q, Clock::time_point now);
  // Fails the suspects of a queue and the work queued behind them with `error`.
  void fail_suspects(PeerQueue& q, const Status& error);

  const uint32_t group_;
  const uint32_t post_budget_;
  const std::chrono::milliseconds peer_timeout_;
  std::vector<Nic> nics_;
  Messenger* messages_;
  NicHealth* health_;
  WorkerCounters* counters_;
  WriteFence* fence_ = nullptr;
  bool stopping_ = false;
  size_t queued_ = 0;     // work requests in peer queues
  size_t posted_ = 0;     // work requests in the provider's hands
  size_t abandoned_ = 0;  // of those, given up on (dead peers, moved work)
  std::vector<Event> events_;
  std::vector<WriteFence::Note> notes_;
};

}  // namespace fabric::engine
