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
  if (fence_) peer_gone_from_fence(owner);
}

// --- weighted sharding (docs/netlab.md, "Unequal links") --------------------------------------

void Worker::measure(uint32_t index, const Op& op) {
  // Idle: op (still linked) is the last work request posted on this NIC, towards any peer.
  health_->completed(index, op.length, now_, domains_[index].inflight <= 1);
}

std::vector<uint64_t> Worker::nic_rates() const {
  std::vector<uint64_t> rates;
  nic_rates(rates);
  return rates;
}

std::vector<bool> Worker::up_nics() const {
  std::vector<bool> up;
  up_nics(up);
  return up;
}

bool Worker::movable(const Op& op) const {
  // Work that was never posted can go over any NIC: rail-aligned addresses and keys come from
  // the op's destination, and every NIC of the peer has receive buffers for messages.
  return op.owner != nullptr;
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
  health_->moved_off(op.domain);
  enqueue(copy);
}

void Worker::reroute_messages(uint32_t nic, PeerQueue& q) {
  // Only to a NIC whose own work towards the same peer is not stalled too: messages moved onto
  // a queue that is as late as this one would be moved back at the next look (a busy or slow
  // machine stalls every NIC at once; then it is peer_timeout's call).
  std::vector<bool> stalled_too(domains_.size());
  for (size_t i = 0; i < stalled_too.size(); ++i) {
    if (i == nic || health_->down(static_cast<uint32_t>(i))) continue;
    for (auto& [p2, q2] : domains_[i].queues) {
      if (q2.owner == q.owner && (q2.inflight_count > 0 || !q2.ops.empty()) &&
          now_ - q2.last_progress > config_.nic_timeout) {
        stalled_too[i] = true;
      }
    }
  }
  const uint32_t to = health_->other_up(nic, stalled_too);
  if (to == nic) return;
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

void Worker::look_at_queues() {
  const auto timeout = config_.nic_timeout;
  looks_.resize(domains_.size());
  look_queues_.resize(domains_.size());
  for (size_t i = 0; i < domains_.size(); ++i) {
    looks_[i].clear();
    look_queues_[i].clear();
    for (auto& [peer, q] : domains_[i].queues) {
      const bool late = now_ - q.last_progress > timeout;
      looks_[i].push_back({&q.owner, (q.inflight_count > 0 || !q.ops.empty()) && late, !late});
      look_queues_[i].push_back(&q);
    }
  }
}

void Worker::watch_nics() {
  if (!health_->active()) return;
  using Kind = NicHealth::Verdict::Kind;
  bool moved = true;  // the queues changed since they were looked at
  for (uint32_t i = 0; i < domains_.size(); ++i) {
    if (moved) look_at_queues();
    const NicHealth::Verdict v = health_->judge(i, looks_);
    std::vector<PeerQueue*> stalled;
    for (size_t k : v.stalled) stalled.push_back(look_queues_[i][k]);
    moved = v.kind != Kind::kNone;
    switch (v.kind) {
      case Kind::kNone:
        break;
      case Kind::kStuckWhileDown:
        // Work still on a NIC that is down (probes; ops posted before it went down) gets the
        // same bound: moved or failed once it has made no progress for nic_timeout.
        for (PeerQueue* q : stalled) fail_over(i, *q, true);
        if (auto owner = health_->probe_due(i, now_, stopping_)) probe(i, *owner);
        break;
      case Kind::kMarkDown:
        mark_down(i, *look_queues_[i][v.culprit]);
        break;
      case Kind::kReroute:
        // No evidence against the NIC (no other NIC reached the same peer lately), but messages
        // stalled on it: they try another NIC, where a dead link would be bypassed. The
        // receiver drops a copy it already has.
        for (PeerQueue* q : stalled) reroute_messages(i, *q);
        break;
    }
  }
}

void Worker::mark_down(uint32_t nic, const PeerQueue& culprit, std::string_view why) {
  DomainState& d = domains_[nic];
  Address owner;  // the peer engine to probe the NIC towards
  for (const Op* op = culprit.inflight; op != nullptr; op = op->next) {
    if (op->owner != nullptr) owner = *op->owner;
  }
  for (const Op* op : culprit.ops) {
    if (op->owner != nullptr) owner = *op->owner;
  }
  health_->mark_down(nic, now_, owner, why);
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
  const std::string& name = d.domain->info().name;
  for (Op* op : posted) {
    Transfer& t = *op->transfer;
    const uint32_t to = health_->survivor(nic);
    const bool idempotent = (op->kind == Op::Kind::kWrite && !op->has_imm) ||
                            (op->kind == Op::Kind::kSend && movable(*op));
    if (idempotent && t.probe_nic < 0 && to != nic) {
      // Data only: the same bytes to the same place, so posting it again is harmless whether or
      // not the first one landed. A message: the receiver drops a second copy. The copy
      // completes in the original's place. The connection was dropped: the original's buffer
      // is free again.
      messages_->release_send_slot(*op);
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
    const uint32_t to = health_->survivor(nic);
    if (movable(*op) && op->transfer->probe_nic < 0 && to != nic) {
      retarget(*op, to);  // never posted: nothing can have landed, immediates included
      health_->moved_off(nic);
      enqueue(*op);
    } else {
      complete_op(*op,
                  Status(ErrorCode::kPeerUnreachable,
                         fmt::format("NIC '{}' is down and no other NIC can take this {}", name,
                                     op->kind == Op::Kind::kSend ? "message" : "write")));
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
