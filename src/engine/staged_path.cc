// Worker: the writer's side of the staged path and the Commits it shares with reliable
// immediates; the owner's side is the StagedPath (staged_path.h, staged_owner.cc).
// GPU memory that the NICs cannot reach moves through the pinned host mirror of its region.
// Sender: ops reading a staged source wait, in gates of about staging_chunk_bytes, for their
// device-to-host copies. Writer into a staged destination: ranges that landed in the owner's
// mirror are committed (a Commit message) as they accumulate; the owner copies them into its
// GPU, counts the Commit's immediate after the copies, and acknowledges; the transfer
// completes on the last Ack.

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "common/log.h"
#include "engine/plan.h"
#include "engine/worker.h"

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
      } else {
        gate_done(*reinterpret_cast<Gate*>(d.token), d.status);
      }
    }
  }
  if (staged_->has_copiers() && staged_->poll()) {  // Commits copied into device memory
    any = true;
    run_staged_events();
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
  cs.seq = messages_->stamp(msg);
  cs.message = &msg;
  cs.owner = &owner;
  unacked_.emplace(cs.seq, &cs);
  if (t.acks++ == 0) awaiting_acks_.push_back(&t);
  t.ack_deadline = now_ + config_.peer_timeout;
  resend_commit(cs, health_->message_nic());
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

void Worker::run_staged_events() {
  // Handling an event may add more (a CUDA IPC Commit that fails at once is acknowledged):
  // those come in the next round, after the ones that were there before them.
  while (!staged_->events().empty()) {
    std::vector<StagedPath::Event> events;
    events.swap(staged_->events());
    for (StagedPath::Event& e : events) {
      switch (e.kind) {
        case StagedPath::Event::Kind::kStartIpc:
          start_ipc_copy(*e.job);
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
      health_->active() ? config_.nic_timeout : std::chrono::milliseconds(config_.peer_timeout / 4);
  {
    size_t resent = 0;
    for (TransferId id : waiting) {
      Transfer* found = live_.find(id);
      if (found == nullptr || found->finished) continue;
      Transfer& t = *found;
      for (CommitSend& cs : t.commits) {
        if (cs.acked || cs.live > 0 || now_ - cs.sent <= resend_after) continue;
        resend_commit(cs, health_->other_up(cs.domain));
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
      t->error = Status(
          ErrorCode::kPeerUnreachable,
          fmt::format("the owner did not acknowledge the transfer's Commit message (for a staged "
                      "destination: the copy into its device memory; with Config::reliable_imm: "
                      "the immediate counted) within {} ms",
                      config_.peer_timeout.count()));
    }
    t->acks = 0;
    forget_commits(*t);
    std::erase(awaiting_acks_, t);
    if (t->pending == 0) make_ready(*t);
  }
}

}  // namespace fabric::engine
