// StagedWriter (staged_writer.h): the writer's side of the staged path. Sender: ops reading a
// staged source wait, in gates of about chunk_bytes, for their device-to-host copies. Writer
// into a staged destination: ranges that landed in the owner's mirror are committed (a Commit
// message) as they accumulate; the owner copies them into its GPU, counts the Commit's
// immediate after the copies, and acknowledges; the transfer completes on the last Ack.

#include "engine/staged_writer.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

namespace fabric::engine {

namespace {

// The destination's immediate rides on Commit `c`, and is no longer the destination's to send.
template <class Dst>
void ride(Commit& c, Dst& d) {
  c.has_imm = true;
  c.imm = d.imm;
  c.imm_times = d.imm_times;
  d.has_imm = false;
}

}  // namespace

void StagedWriter::release(Gate& gate, Status status) {
  released_.push_back({gate.transfer, gate.first, gate.count, std::move(status)});
}

void StagedWriter::stage(Transfer& t) {
  const LocalRegion& src = *t.src;
  auto copier = copiers_.get(src.memory);
  size_t i = 0;
  while (i < t.ops.size()) {
    if (t.ops[i].length == 0) {  // zero-byte writes read the scratch buffer
      released_.push_back({&t, i++, 1, Status::ok()});
      continue;
    }
    Gate& gate = t.gates.emplace_back(Gate{&t, i, 0});
    Status status = copier ? Status::ok() : copier.status();
    uint64_t bytes = 0;
    while (status.is_ok() && i < t.ops.size() && t.ops[i].length > 0 &&
           bytes < options_.chunk_bytes) {
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
      release(gate, std::move(status));
    }
  }
}

// A fence's token is a Gate's address, or a landing read's Op's with the low bit set (both are
// aligned to 8 bytes).
constexpr uint64_t kLandingBit = 1;

bool StagedWriter::poll() {
  done_.clear();
  if (copiers_.poll(done_) == 0) return false;
  for (cuda::Copier::Done& d : done_) {
    if ((d.token & kLandingBit) != 0) {
      landed_.push_back({reinterpret_cast<Op*>(d.token & ~kLandingBit), d.status});
    } else {
      release(*reinterpret_cast<Gate*>(d.token), d.status);
    }
  }
  return true;
}

Status StagedWriter::land(Op& op) {
  const LocalRegion& dst = *op.transfer->src;
  auto copier = copiers_.get(dst.memory);
  if (!copier) return copier.status();
  auto* host = static_cast<std::byte*>(const_cast<void*>(op.local));
  Status s = (*copier)->copy(dst.ptr + (host - dst.host), host, op.length,
                             cuda::Copier::Direction::kToDevice);
  if (s.is_ok()) s = (*copier)->fence(reinterpret_cast<uint64_t>(&op) | kLandingBit);
  return s;
}

void StagedWriter::commit_read_prep(Transfer& t, const Bytes& reply_to) {
  const RemoteMemory& src = t.dsts[0];
  const uint64_t room = options_.message_room;
  const uint64_t fixed = Commit::kFixedBytes + reply_to.size();
  const uint64_t per_message = room > fixed ? (room - fixed) / Commit::kRangeBytes : 0;
  if (per_message == 0) {
    if (t.error.is_ok()) {
      t.error = Status(ErrorCode::kInvalidArgument,
                       "max_message_bytes is too small for the staged path's commit messages");
    }
    return;
  }
  for (size_t pos = 0; pos < t.read_prep.size(); pos += per_message) {
    const size_t n = std::min<size_t>(per_message, t.read_prep.size() - pos);
    add_commit(t, src, src.staged_region(), std::span(t.read_prep).subspan(pos, n), reply_to).read =
        true;
  }
  t.read_prep.clear();
}

Commit& StagedWriter::add_commit(Transfer& t, const RemoteMemory& dst, uint64_t region,
                                 std::span<const Range> ranges, const Bytes& reply_to) {
  Outgoing& o = outgoing_.emplace_back();
  o.transfer = &t;
  o.owner = &dst.owner();
  o.commit.transfer = t.id;
  o.commit.reply_to = reply_to;
  o.commit.region = region;
  o.commit.ranges.assign(ranges.begin(), ranges.end());
  return o.commit;
}

bool StagedWriter::record(const Op& op) {
  Transfer& t = *op.transfer;
  if (!t.error.is_ok()) return false;
  StagedDst& sd = t.staged[op.dst_index];
  if (!sd.unflushed.empty() &&
      sd.unflushed.back().offset + sd.unflushed.back().length == op.dst_offset) {
    sd.unflushed.back().length += op.length;
  } else {
    sd.unflushed.push_back({op.dst_offset, op.length});
  }
  sd.unflushed_bytes += op.length;
  // Commit as the data accumulates, so the owner's copies overlap the rest of the transfer.
  return sd.unflushed_bytes >= options_.chunk_bytes;
}

void StagedWriter::commit_staged(Transfer& t, uint32_t dst_index, bool final,
                                 const Bytes& reply_to) {
  StagedDst& sd = t.staged[dst_index];
  const RemoteMemory& dst = t.dsts[dst_index];
  const uint64_t room = options_.message_room;
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
    Commit& c =
        add_commit(t, dst, dst.staged_region(), std::span(sd.unflushed).subspan(pos, n), reply_to);
    pos += n;
    if (imm_now && pos == sd.unflushed.size()) ride(c, sd);
  } while (pos < sd.unflushed.size());
  sd.unflushed.clear();
  sd.unflushed_bytes = 0;
}

bool StagedWriter::staged_left(const Transfer& t) {
  for (const StagedDst& sd : t.staged) {
    if (!sd.unflushed.empty() || sd.has_imm) return true;
  }
  return false;
}

bool StagedWriter::ipc_left(const Transfer& t) {
  for (const IpcDst& d : t.ipc) {
    if (!d.ranges.empty() || d.has_imm) return true;
  }
  return false;
}

void StagedWriter::commit_ipc(Transfer& t, bool final, const Bytes& reply_to) {
  if (!t.error.is_ok()) return;
  const uint64_t room = options_.message_room;
  for (IpcDst& d : t.ipc) {
    if (d.ranges.empty() && !(final && d.has_imm)) continue;
    const RemoteMemory& dst = t.dsts[d.dst_index];
    const LocalRegion& src = *t.src;
    const uint64_t fixed =
        Commit::kFixedBytes + reply_to.size() + Commit::kIpcFixedBytes + src.ipc->handle.size();
    const uint64_t per_message =
        room > fixed ? (room - fixed) / (Commit::kRangeBytes + Commit::kIpcRangeBytes) : 0;
    if (per_message == 0) {
      t.error = Status(ErrorCode::kInvalidArgument,
                       "max_message_bytes is too small for the CUDA IPC path's commit messages");
      d.ranges.clear();
      d.has_imm = false;
      continue;
    }
    // The immediate rides on the last range Commit when one message holds every range;
    // otherwise it follows, alone, after their Acks (the worker calls again with `final`).
    const bool imm_now =
        d.has_imm && (d.ranges.size() <= per_message || (final && d.ranges.empty()));
    size_t pos = 0;
    do {
      const size_t n = std::min<size_t>(per_message, d.ranges.size() - pos);
      Commit& c =
          add_commit(t, dst, dst.cuda_ipc()->region, std::span(d.ranges).subspan(pos, n), reply_to);
      c.read = t.reading;
      IpcSource& is = c.ipc.emplace();
      is.exported = *src.ipc;
      is.region = src.id;
      is.length = src.length;
      is.offsets.assign(d.src_offsets.begin() + static_cast<std::ptrdiff_t>(pos),
                        d.src_offsets.begin() + static_cast<std::ptrdiff_t>(pos + n));
      pos += n;
      if (imm_now && pos == d.ranges.size()) ride(c, d);
    } while (pos < d.ranges.size());
    d.ranges.clear();
    d.src_offsets.clear();
  }
}

CommitSend& StagedWriter::track(Transfer& t, const Bytes& message, uint64_t seq,
                                const Address& owner, Clock::time_point now) {
  CommitSend& cs = t.commits.emplace_back();
  cs.transfer = &t;
  cs.seq = seq;
  cs.message = &message;
  cs.owner = &owner;
  unacked_.emplace(cs.seq, &cs);
  if (t.acks++ == 0) awaiting_.push_back(&t);
  t.ack_deadline = now + options_.peer_timeout;
  return cs;
}

void StagedWriter::queued(CommitSend& cs, uint32_t nic, Clock::time_point now) {
  ++cs.live;
  cs.domain = nic;
  cs.sent = now;
}

void StagedWriter::give_up(CommitSend& cs) {
  cs.acked = true;
  unacked_.erase(cs.seq);
  --cs.transfer->acks;
}

Transfer* StagedWriter::on_ack(const Ack& ack) {
  // Late (the transfer gave up on it), or a second Ack of a Commit sent twice: ignored.
  auto it = unacked_.find(ack.commit);
  if (it == unacked_.end() || it->second->transfer->id != ack.transfer) return nullptr;
  CommitSend& cs = *it->second;
  unacked_.erase(it);
  cs.acked = true;
  Transfer& t = *cs.transfer;
  if (ack.code != ErrorCode::kOk && t.error.is_ok()) {
    const bool known = static_cast<int>(ack.code) <= static_cast<int>(ErrorCode::kInternal);
    t.error = Status(known ? ack.code : ErrorCode::kInternal,
                     fmt::format("the owner of the destination: {}", ack.message));
  }
  if (--t.acks > 0) return nullptr;
  std::erase(awaiting_, &t);
  return &t;
}

StagedWriter::Overdue& StagedWriter::watch(Clock::time_point now, Clock::duration resend_after) {
  overdue_.resend.clear();
  overdue_.failed.clear();
  for (Transfer* t : awaiting_) {
    if (t->acks > 0 && now > t->ack_deadline) {
      overdue_.failed.push_back(t);
      continue;
    }
    if (t->finished) continue;
    // A Commit delivered without an Ack for a while: the Ack (or the Commit) may be stuck on
    // a dead link, or lost with a connection the provider dropped after it reported the send
    // complete, so a copy goes again (the owner counts it once).
    for (CommitSend& cs : t->commits) {
      if (cs.acked || cs.live > 0 || now - cs.sent <= resend_after) continue;
      overdue_.resend.push_back(&cs);
    }
  }
  for (Transfer* t : overdue_.failed) {
    if (t->error.is_ok()) {
      t->error = Status(
          ErrorCode::kPeerUnreachable,
          fmt::format("the owner did not acknowledge the transfer's Commit message (for a staged "
                      "destination: the copy into its device memory; with Config::reliable_imm: "
                      "the immediate counted) within {} ms",
                      options_.peer_timeout.count()));
    }
    t->acks = 0;
    forget(*t);
  }
  return overdue_;
}

void StagedWriter::forget(Transfer& t) {
  for (CommitSend& cs : t.commits) {
    if (!cs.acked) unacked_.erase(cs.seq);
    cs.acked = true;
  }
  std::erase(awaiting_, &t);
}

}  // namespace fabric::engine
