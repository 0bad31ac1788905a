// Worker: the peer watchdog (dead peers), and the worker's side of NIC failover: NicHealth
// (nic_health.h) says which NIC is down, which NIC takes its work and when to probe; this moves
// the Ops of its queues to the NICs still up and posts the probes that bring it back
// (docs/failover.md). Weighted sharding's rates (docs/netlab.md "Unequal links") are fed to
// NicHealth here.

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "common/log.h"
#include "engine/plan.h"
#include "engine/worker.h"

namespace fabric::engine {

void Worker::watch_peers() {
  const auto now = now_;
  if (now < next_watch_) return;
  next_watch_ = now + std::chrono::milliseconds(10);
  sweep_ipc();
  watch_acks();  // Commits awaiting their Acks, if any
  if (fence_ && fence_->has_rounds()) watch_fences();
  watch_nics();
  std::vector<std::pair<uint32_t, transport::PeerHandle>> dead;
  queues_->find_dead(now, dead);
  for (auto [nic, peer] : dead) declare_dead(nic, peer);
}

void Worker::declare_dead(uint32_t nic, transport::PeerHandle peer) {
  PostingQueues::Taken taken = queues_->take_out(nic, peer, /*posted_too=*/true);
  const Status error(
      ErrorCode::kPeerUnreachable,
      fmt::format("no completion from the peer on NIC '{}' for {} ms with {} work requests "
                  "posted and {} queued ({} being retried one at a time{}); the peer is "
                  "considered dead",
                  domains_[nic].domain->info().name, config_.peer_timeout.count(),
                  taken.posted.size(), taken.queued.size(), taken.suspects,
                  taken.checking ? ", a check pending" : ""));
  detail::log().warn("group {}: {}", group_, error.message());
  if (taken.check != nullptr) taken.queued.push_back(taken.check);
  for (Op* op : taken.posted) {
    abandon(*op);
    complete_op(*op, error);
  }
  for (Op* op : taken.queued) complete_op(*op, error);
  if (fence_) peer_gone_from_fence(taken.owner);
}

// --- weighted sharding (docs/netlab.md, "Unequal links") --------------------------------------

void Worker::measure(uint32_t index, const Op& op) {
  // Idle: op (still linked) is the last work request posted on this NIC, towards any peer.
  health_->completed(index, op.length, now_, queues_->inflight(index) <= 1);
}

std::vector<bool> Worker::up_nics() const {
  std::vector<bool> up;
  up_nics(up);
  return up;
}

void Worker::repost_copy(Op& op, uint32_t to) {
  Transfer& t = *op.transfer;
  abandon(op);
  Op& copy = t.retries.emplace_back(op);
  copy.abandoned = false;
  copy.lone = false;    // a fresh post on another NIC, not an isolation retry
  copy.send_slot = -1;  // the original keeps its buffer until the provider lets go of it
  copy.queue = nullptr;
  copy.prev = copy.next = nullptr;
  retarget(copy, to);
  if (copy.commit != nullptr) copy.commit->sent = now_;
  health_->moved_off(op.domain);
  enqueue(copy);
}

void Worker::reroute_messages(uint32_t nic, transport::PeerHandle peer) {
  const Bytes* owner = queues_->owner_name(nic, peer);
  if (owner == nullptr) return;
  // Only to a NIC whose own work towards the same peer is not stalled too: messages moved onto
  // a queue that is as late as this one would be moved back at the next look (a busy or slow
  // machine stalls every NIC at once; then it is peer_timeout's call).
  std::vector<bool> stalled_too(domains_.size());
  for (uint32_t i = 0; i < stalled_too.size(); ++i) {
    if (i == nic || health_->down(i)) continue;
    stalled_too[i] = queues_->stalled_towards(i, *owner, now_, config_.nic_timeout);
  }
  const uint32_t to = health_->other_up(nic, stalled_too);
  if (to == nic) return;
  std::vector<Op*> unposted, posted;
  queues_->take_messages(nic, peer, unposted, posted);
  if (unposted.empty() && posted.empty()) return;
  detail::log().warn(
      "group {}: {} message(s) made no progress on NIC '{}' for {} ms; sending them over '{}'",
      group_, unposted.size() + posted.size(), domains_[nic].domain->info().name,
      config_.nic_timeout.count(), domains_[to].domain->info().name);
  for (Op* op : posted) repost_copy(*op, to);  // still in the provider's hands, abandoned
  for (Op* op : unposted) {
    retarget(*op, to);
    enqueue(*op);
  }
}

void Worker::retarget(Op& op, uint32_t to) {
  engine::retarget(op, to, scratch(to));
}

void Worker::look_at_queues() {
  queues_->look(now_, config_.nic_timeout, looks_, look_peers_);
}

void Worker::watch_nics() {
  if (!health_->active()) return;
  using Kind = NicHealth::Verdict::Kind;
  bool moved = true;  // the queues changed since they were looked at
  for (uint32_t i = 0; i < domains_.size(); ++i) {
    if (moved) look_at_queues();
    const NicHealth::Verdict v = health_->judge(i, looks_);
    std::vector<transport::PeerHandle> stalled;
    for (size_t k : v.stalled) stalled.push_back(look_peers_[i][k]);
    moved = v.kind != Kind::kNone;
    switch (v.kind) {
      case Kind::kNone:
        break;
      case Kind::kStuckWhileDown:
        // Work still on a NIC that is down (probes; ops posted before it went down) gets the
        // same bound: moved or failed once it has made no progress for nic_timeout.
        for (transport::PeerHandle peer : stalled) fail_over(i, peer, true);
        if (auto owner = health_->probe_due(i, now_, stopping_)) probe(i, *owner);
        break;
      case Kind::kMarkDown:
        mark_down(i, look_peers_[i][v.culprit]);
        break;
      case Kind::kReroute:
        // No evidence against the NIC (no other NIC reached the same peer lately), but messages
        // stalled on it: they try another NIC, where a dead link would be bypassed. The
        // receiver drops a copy it already has.
        for (transport::PeerHandle peer : stalled) reroute_messages(i, peer);
        break;
    }
  }
}

void Worker::mark_down(uint32_t nic, transport::PeerHandle culprit, std::string_view why) {
  // The peer engine to probe the NIC towards.
  health_->mark_down(nic, now_, queues_->owner_of(nic, culprit), why);
  // Unposted work moves at once. Posted work moves (or fails) where it stalled; elsewhere it
  // may still complete, and is moved only if it stalls in turn.
  std::vector<std::pair<transport::PeerHandle, bool>> peers;
  queues_->peers_of(nic, now_, config_.nic_timeout, peers);
  for (auto [peer, stalled] : peers) fail_over(nic, peer, stalled);
}

void Worker::fail_over(uint32_t nic, transport::PeerHandle peer, bool posted_too) {
  PostingQueues::Taken taken = queues_->take_out(nic, peer, posted_too);
  if (taken.check != nullptr) {
    complete_op(*taken.check, Status(ErrorCode::kPeerUnreachable, "NIC marked down"));
  }
  const std::vector<Op*>& posted = taken.posted;
  const std::vector<Op*>& unposted = taken.queued;
  const std::string& name = domains_[nic].domain->info().name;
  for (Op* op : posted) {
    Transfer& t = *op->transfer;
    const uint32_t to = health_->survivor(nic);
    const bool idempotent = (op->kind == Op::Kind::kWrite && !op->has_imm) ||
                            op->kind == Op::Kind::kRead ||
                            (op->kind == Op::Kind::kSend && movable(*op));
    if (idempotent && t.probe_nic < 0 && to != nic) {
      // Data only: the same bytes to the same place, so posting it again is harmless whether or
      // not the first one landed; a read reads the same bytes again. A message: the receiver
      // drops a second copy. The copy completes in the original's place, and the original is
      // abandoned to the provider (a read's answer may still land if the link comes back:
      // docs/failover.md). A message's send buffer is free again.
      messages_->release_send_slot(*op);
      repost_copy(*op, to);
      continue;
    }
    abandon(*op);
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
                             name, kind_name(*op), op->length));
    }
    complete_op(*op, error);
  }
  for (Op* op : unposted) {
    const uint32_t to = health_->survivor(nic);
    if (movable(*op) && op->transfer->probe_nic < 0 && to != nic) {
      retarget(*op, to);  // never posted: nothing can have landed, immediates included
      health_->moved_off(nic);
      enqueue(*op);
    } else {
      complete_op(*op, Status(ErrorCode::kPeerUnreachable,
                              fmt::format("NIC '{}' is down and no other NIC can take this {}",
                                          name, kind_name(*op))));
    }
  }
}

void Worker::probe(uint32_t nic, const Address& owner) {
  TransferPtr t = pool_.take();
  t->id = kInternalTransfer | next_internal_++;
  t->probe_nic = static_cast<int>(nic);
  t->peers.push_back(owner);
  t->ops.push_back(scratch_op(*t, nic, t->peers[0], scratch(nic)));
  start_transfer(std::move(t));
}

}  // namespace fabric::engine
