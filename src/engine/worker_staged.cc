// Worker: its side of the staged path, the Commits it shares with reliable immediates, and the
// CUDA IPC path's owner copies. The components decide and keep the state: StagedWriter
// (staged_writer.h: gates, Commits awaiting Acks), StagedPath (staged_path.h: the owner's side
// of Commits), IpcCopies (ipc_copies.h: the owner's CUDA IPC copies). This does what they return:
// queues released ops, sends Commits and Acks, counts immediates, settles transfers.

#include <fmt/format.h>

#include <utility>

#include "common/log.h"
#include "engine/op_builder.h"
#include "engine/worker.h"

namespace fabric::engine {

void Worker::stage_sources(Transfer& t) {
  writer_->stage(t);  // ops are queued as their device-to-host copies complete
  release_gates();
}

void Worker::release_gates() {
  // Nothing below comes back here or adds to the list: enqueue only queues (an op whose peer
  // does not resolve is completed with that error, which only settles its transfer), and
  // complete_op with an error only settles. Indexed all the same.
  std::vector<StagedWriter::Release>& released = writer_->released();
  for (size_t r = 0; r < released.size(); ++r) {
    Transfer& t = *released[r].transfer;
    const size_t first = released[r].first;
    const size_t count = released[r].count;
    const Status status = released[r].status;
    for (size_t k = 0; k < count; ++k) {
      Op& op = t.ops[first + k];
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
  released.clear();
}

void Worker::release_held(Transfer& t) {
  if (!t.held) return;
  t.held = false;
  Status failed = t.error;
  if (failed.is_ok() && stopping_) failed = cancelled("engine closed before the read was posted");
  for (Op& op : t.ops) {
    if (failed.is_ok()) {
      enqueue(op);
    } else {
      complete_op(op, failed);
    }
  }
}

void Worker::settle_landed() {
  std::vector<StagedWriter::Landed>& landed = writer_->landed();
  for (const StagedWriter::Landed& l : landed) {
    Transfer& t = *l.op->transfer;
    if (!l.status.is_ok() && t.error.is_ok()) {
      t.error = Status(l.status.code(), fmt::format("copying {} bytes read into device memory: {}",
                                                    l.op->length, l.status.message()));
    }
    settle(t);
  }
  landed.clear();
}

bool Worker::poll_copies() {
  bool any = false;
  if (writer_->has_copiers() && writer_->poll()) {  // gates whose copies to the host completed
    any = true;
    release_gates();
    settle_landed();
  }
  if (ipc_->has_copiers() && ipc_->poll()) {  // CUDA IPC Commits copied
    any = true;
    hand_ipc_done();
    run_staged_events();
  }
  if (staged_->has_copiers() && staged_->poll()) {  // Commits copied into device memory
    any = true;
    run_staged_events();
  }
  return any;
}

void Worker::record_staged(Op& op) {
  if (writer_->record(op) && !stopping_) flush_commits(*op.transfer, op.dst_index, false);
}

void Worker::flush_commits(Transfer& t, uint32_t dst_index, bool final) {
  writer_->commit_staged(t, dst_index, final, self_);
  send_commits();
}

void Worker::send_ipc_commits(Transfer& t, bool final) {
  writer_->commit_ipc(t, final, self_);
  send_commits();
}

void Worker::send_commits() {
  // Nothing below comes back here or adds Commits: resend_commit only queues, and a Commit's
  // send that fails at once is sent again over another NIC (resend_commit) or given up on.
  std::vector<StagedWriter::Outgoing>& out = writer_->outgoing();
  for (size_t i = 0; i < out.size(); ++i) {
    Transfer& t = *out[i].transfer;
    const Address& owner = *out[i].owner;
    Bytes& msg = t.control_msgs.emplace_back(out[i].commit.encode());
    const uint64_t seq = messages_->stamp(msg);
    resend_commit(writer_->track(t, msg, seq, owner, now_), health_->message_nic());
  }
  out.clear();
}

void Worker::resend_commit(CommitSend& cs, uint32_t to) {
  Transfer& t = *cs.transfer;
  Op& op = t.control.emplace_back(send_op(t, to, *cs.owner, *cs.message));
  op.commit = &cs;
  ++t.pending;
  StagedWriter::queued(cs, to, now_);
  enqueue(op);
}

void Worker::forget_commits(Transfer& t) {
  writer_->forget(t);
}

void Worker::handle_ack(std::span<const std::byte> body) {
  auto ack = Ack::decode(body);
  if (!ack) {
    detail::log().warn("group {}: dropped a malformed staged-path acknowledgment", group_);
    return;
  }
  Transfer* t = writer_->on_ack(*ack);
  if (t == nullptr) return;
  if (t->held) {
    release_held(*t);  // a read's owner has copied the ranges into its mirror
  } else if (t->pending == 0) {
    make_ready(*t);
  }
}

void Worker::watch_acks() {
  if (!writer_->awaiting()) return;
  // A Commit without an Ack for a while goes again over the next NIC that is up (the same one
  // when it is the only one); the owner counts it once.
  const auto resend_after =
      health_->active() ? config_.nic_timeout : std::chrono::milliseconds(config_.peer_timeout / 4);
  StagedWriter::Overdue& overdue = writer_->watch(now_, resend_after);
  for (Transfer* t : overdue.failed) {
    if (t->held) {
      release_held(*t);  // fails the read's ops with the transfer's error
    } else if (t->pending == 0) {
      make_ready(*t);
    }
  }
  if (!overdue.resend.empty()) {
    const size_t resent = overdue.resend.size();
    for (CommitSend* cs : overdue.resend) resend_commit(*cs, health_->other_up(cs->domain));
    detail::log().warn(
        "group {}: {} commit message(s) without an acknowledgment for {} ms: sent again over "
        "the next NIC that is up",
        group_, resent,
        std::chrono::duration_cast<std::chrono::milliseconds>(resend_after).count());
  }
}

void Worker::run_staged_events() {
  // Handling an event may add more (a CUDA IPC Commit that fails at once is acknowledged):
  // those come in the next round, after the ones that were there before them.
  while (!staged_->events().empty()) {
    std::vector<StagedPath::Event> events;
    events.swap(staged_->events());
    for (StagedPath::Event& e : events) {
      switch (e.kind) {
        case StagedPath::Event::Kind::kStartIpc:
          ipc_->start(*e.job, now_);
          hand_ipc_done();
          break;
        case StagedPath::Event::Kind::kCountImm: {
          std::vector<uint32_t> imms(e.times, e.imm);
          std::vector<uint32_t> unexpected;
          services_.imms->arrive(imms, jobs_, unexpected);
          if (!unexpected.empty() && services_.on_unexpected)
            services_.on_unexpected(unexpected, callbacks_here());
          break;
        }
        case StagedPath::Event::Kind::kSendAck:
          send_ack(e.to, e.domain, e.ack);
          break;
      }
    }
  }
}

void Worker::hand_ipc_done() {
  for (CommitJob* job : ipc_->done()) staged_->commit_done(*job);
  ipc_->done().clear();
}

void Worker::flush_ipc_batches() {
  ipc_->flush();
  hand_ipc_done();
  run_staged_events();
}

void Worker::sweep_ipc() {
  ipc_->sweep(now_);
}

void Worker::send_ack(const Address& to, uint32_t domain, const Ack& ack) {
  send_internal(to, domain, ack.encode());
}

}  // namespace fabric::engine
