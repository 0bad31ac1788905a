// Worker: the data path of a transfer: started, its ops handed to the PostingQueues (queued per
// (NIC, peer), posted round-robin under a budget: posting_queues.h) and what they ask for done,
// completions polled, and the transfer advanced and finished once nothing is outstanding
// (events drained once per pass: docs/engine.md).

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <utility>

#include "common/log.h"
#include "engine/plan.h"
#include "engine/worker.h"

namespace fabric::engine {

void Worker::start_transfer(TransferPtr owned) {
  Transfer& t = live_.adopt(std::move(owned));
  if (stopping_ && !t.while_stopping) {
    t.error = cancelled("engine closed before the transfer was posted");
    finish(t);
    return;
  }
  if (!t.message.empty()) messages_->stamp(t.message);
  t.pending = t.ops.size();
  if (!t.read_prep.empty()) {
    // A read from a staged region: the owner copies the ranges into its mirror first; the ops
    // wait for its Acks (release_held).
    t.held = true;
    writer_->commit_read_prep(t, self_);
    send_commits();
    if (t.acks == 0) release_held(t);  // nothing went out: the ops fail with the error
  } else if (t.src && t.src->staged() && !t.reading) {
    stage_sources(t);  // ops are queued as their device-to-host copies complete
  } else {
    for (Op& op : t.ops) enqueue(op);
  }
  if (!t.ipc.empty()) send_ipc_commits(t, false);  // the CUDA IPC path (worker_staged.cc)
  if (t.ops.empty()) make_ready(t);                // else the last op to complete does
}

void Worker::enqueue(Op& op) {
  // Planned before its NIC was marked down (or a deferred immediate on a lost rail): it goes
  // over a surviving NIC instead. Probes are the one kind of work a NIC that is down takes.
  if (health_->down(op.domain) && op.transfer->probe_nic < 0 && movable(op)) {
    retarget(op, health_->survivor(op.domain));
  }
  if (Status s = queues_->enqueue(op, now_); !s) complete_op(op, s);
}

bool Worker::post_all() {
  bool any = false;
  for (uint32_t i = 0; i < domains_.size(); ++i) {
    any |= queues_->post_some(i, now_);
    any |= run_queue_events();  // before the next NIC posts (a NIC found unreachable: its work)
  }
  return any;
}

bool Worker::run_queue_events() {
  // The loop's top level only (pass, post_all, finish_stop): nothing below calls this, so no
  // handler runs inside another. Handling an event may raise more (a fence note's transfer that
  // finishes at once ends a check): they come in the next round, after those before them.
  bool any = false;
  for (int round = 0; round < kEventRounds; ++round) {
    const bool notes = !queues_->notes().empty() || !fence_notes_.empty();
    if (notes) {
      send_fence_notes(queues_->notes());
      send_fence_notes(fence_notes_);
    }
    const bool settled = run_fence_settled();
    if (!queues_->take_events(queue_events_)) {
      if (!notes && !settled) return any;
      any = true;
      continue;
    }
    any = true;
    for (PostingQueues::Event& e : queue_events_) {
      switch (e.kind) {
        case PostingQueues::Event::Kind::kComplete:
          complete_op(*e.op, e.status);
          break;
        case PostingQueues::Event::Kind::kCheck:
          start_check(e.nic, e.peer, *e.op);
          break;
        case PostingQueues::Event::Kind::kUnreachable:
          mark_down(e.nic, e.peer, e.status.message());
          break;
      }
    }
    queue_events_.clear();  // keeps its capacity
  }
  return true;  // some may be left: the next pass takes them (and does not sleep before it)
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
        if (op.abandoned) {  // given up on or replaced; the provider has let go of it now
          queues_->let_go();
          messages_->release_send_slot(op);
          Transfer& t = *op.transfer;
          if (--t.abandoned == 0 && t.finished) live_.retire(t.id);
          break;
        }
        WorkerCounters::bump(c.error == ErrorCode::kOk ? counters_->nic[index].completed
                                                       : counters_->nic[index].failed);
        if (c.error == ErrorCode::kOk && op.kind != Op::Kind::kSend && op.length > 0) {
          measure(index, op);
        }
        Status status;
        if (c.error != ErrorCode::kOk) {
          status = Status(c.error, fmt::format("{} of {} bytes on NIC '{}' failed: {}",
                                               op.kind == Op::Kind::kSend ? "send" : kind_name(op),
                                               op.length, d.domain->info().name, c.error_message));
        }
        // The queues keep a suspect (isolation), or say what to do with it as events, which the
        // pass takes after its polls (run_queue_events).
        if (queues_->completed(op, status, now_)) complete_op(op, status);
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
      if (services_.on_unexpected) {
        services_.on_unexpected(unexpected_, callbacks_here());
      }
      unexpected_.clear();
    }
  }
  return true;
}

void Worker::complete_op(Op& op, const Status& completion) {
  messages_->release_send_slot(op);
  Transfer& t = *op.transfer;
  Status status = completion;
  if (op.kind == Op::Kind::kRead && status.is_ok() && t.src->staged() && t.error.is_ok()) {
    // Into a staged region's mirror: the op is done once its bytes are in device memory too
    // (settle_landed); its transfer stays pending until then.
    status = writer_->land(op);
    if (status.is_ok()) return;
    status = Status(status.code(), fmt::format("copying {} bytes read into device memory: {}",
                                               op.length, status.message()));
  }
  if (op.commit != nullptr) {
    CommitSend& cs = *op.commit;
    --cs.live;
    if (!status.is_ok()) {
      // Another copy may still be (or have been) delivered and acknowledged.
      if (cs.acked || cs.live > 0) {
        settle(t);
        return;
      }
      const uint32_t to = health_->other_up(op.domain);
      if (health_->active() && to != op.domain && !stopping_ && t.error.is_ok() &&
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
      writer_->give_up(cs);  // its Ack will never come
    }
  }
  if (!status.is_ok() && t.error.is_ok()) t.error = status;
  if (op.commit != nullptr && t.held && t.acks == 0) release_held(t);  // a read's last Commit
  if (status.is_ok() && op.dst_index != Op::kNoDst) record_staged(op);
  settle(t);
}

void Worker::start_check(uint32_t nic, transport::PeerHandle peer, const Op& suspect) {
  if (!queues_->wants_check(nic, peer)) return;  // taken out since it was asked for
  TransferPtr t = pool_.take();
  t->id = kInternalTransfer | next_internal_++;
  t->check_nic = static_cast<int>(nic);
  t->check_peer = peer;
  t->peers.push_back(*suspect.owner);
  const Address& owner = t->peers[0];
  uint32_t rail = remote_rail(nic, owner.num_nics());
  for (uint32_t i = 0; i < owner.num_nics(); ++i) {
    if (owner.nics()[i].name == *suspect.peer) rail = i;
  }
  Op& op = t->ops.emplace_back(scratch_op(*t, nic, owner, owner.nics()[rail], scratch(nic)));
  t->pending = 1;
  queues_->set_check(nic, peer, op);  // posted after the queue's backoff
  live_.adopt(std::move(t));
}

void Worker::check_done(Transfer& t) {
  // What the queues make of it (the suspect posted again, another check, the suspects failed)
  // comes as events, taken at the pass's top level.
  queues_->check_done(static_cast<uint32_t>(t.check_nic), t.check_peer, t.error, now_);
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
      Transfer* t = live_.find(id);
      if (t != nullptr && !t->finished) advance(*t);
    }
    ready_batch_.clear();
  }
  return true;
}

void Worker::finish(Transfer& t) {
  if (!t.commits.empty()) forget_commits(t);
  if (t.probe_nic >= 0) {
    health_->probe_done(static_cast<uint32_t>(t.probe_nic), t.error.is_ok(), now_);
  }
  if (t.check_nic >= 0) check_done(t);
  // A write-fence note (urgent) that failed is sent again by its own timer (worker_fence.cc).
  if ((t.id & kInternalTransfer) != 0 && t.probe_nic < 0 && t.check_nic < 0 && !t.error.is_ok() &&
      !(t.ops.size() == 1 && t.ops[0].urgent)) {
    detail::log().warn("group {}: an engine message could not be delivered: {}", group_,
                       t.error.to_string());
  }
  if ((t.id & kInternalTransfer) == 0) count_end(t);
  if (t.callbacks.counter != nullptr) t.callbacks.counter->record(t.error);
  if (!t.error.is_ok()) {
    if (t.callbacks.on_error) {
      jobs_.push_back([cb = std::move(t.callbacks.on_error), s = std::move(t.error)] { cb(s); });
    }
  } else if (t.callbacks.on_done) {
    jobs_.push_back(std::move(t.callbacks.on_done));
  }
  t.finished = true;
  // Destroys t, unless the provider still holds some of its ops (a dead peer's).
  if (t.abandoned == 0) live_.retire(t.id);
}

void Worker::count_outcome(const Transfer& t, const Status& error) {
  const bool message = std::any_of(t.ops.begin(), t.ops.end(),
                                   [](const Op& op) { return op.kind == Op::Kind::kSend; });
  WorkerCounters& c = *counters_;
  if (error.is_ok()) {
    WorkerCounters::bump(message ? c.messages_completed : c.transfers_completed);
    return;
  }
  WorkerCounters::bump(message ? c.messages_failed : c.transfers_failed);
  const auto code = static_cast<size_t>(error.code());
  if (code < c.errors.size()) WorkerCounters::bump(c.errors[code]);
}

void Worker::count_end(const Transfer& t) {
  count_outcome(t, t.error);
  if (t.submitted_at == std::chrono::steady_clock::time_point{}) return;
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(now_ - t.submitted_at);
  const uint64_t n = us.count() > 0 ? static_cast<uint64_t>(us.count()) : 0;
  const size_t bucket =
      n < 2 ? 0 : std::min<size_t>(std::bit_width(n) - 1, LatencyHistogram::kBuckets - 1);
  WorkerCounters::bump(counters_->latency[bucket]);
}

void WorkerCounters::fill(GroupStats& g) const {
  constexpr auto r = std::memory_order_relaxed;
  g.nics.resize(nics);
  for (size_t i = 0; i < nics; ++i) {
    g.nics[i] = {nic[i].posted.load(r), nic[i].completed.load(r), nic[i].failed.load(r),
                 nic[i].retries.load(r)};
  }
  g.internal_work_requests_posted = internal_posted.load(r);
  for (size_t i = 0; i < errors.size(); ++i) g.errors_by_code[i] = errors[i].load(r);
  g.worker_passes = passes.load(r);
  g.worker_sleeps = sleeps.load(r);
  g.worker_wakeups = wakeups.load(r);
  g.submissions_ring_full = ring_full.load(r);
  g.transfers_completed = transfers_completed.load(r);
  g.transfers_failed = transfers_failed.load(r);
  g.messages_completed = messages_completed.load(r);
  g.messages_failed = messages_failed.load(r);
  // The submissions were read first: one submitted and ended while the snapshot was taken can
  // make ended exceed started for a moment; in_flight is clamped at zero then.
  const uint64_t ended =
      g.transfers_completed + g.transfers_failed + g.messages_completed + g.messages_failed;
  const uint64_t started = g.transfers_submitted + g.messages_sent;
  g.in_flight = started > ended ? started - ended : 0;
  for (size_t i = 0; i < latency.size(); ++i) g.completion_latency.counts[i] = latency[i].load(r);
}

}  // namespace fabric::engine
