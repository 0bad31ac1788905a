// Worker: the peer watchdog (dead peers), weighted sharding by measured NIC rates, and NIC
// failover: a NIC marked down, its work moved to the NICs still up, probes that bring it back
// (docs/failover.md, docs/netlab.md "Unequal links").

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "common/log.h"
#include "engine/plan.h"
#include "engine/worker.h"

namespace fabric::engine {

uint32_t Worker::other_up_nic(uint32_t nic) {
  std::vector<bool> up(domains_.size());
  for (size_t i = 0; i < up.size(); ++i) up[i] = !domains_[i].down && i != nic;
  return failover_nic(nic, up, failover_salt_++);
}

void Worker::watch_peers() {
  const auto now = now_;
  if (now < next_watch_) return;
  next_watch_ = now + std::chrono::milliseconds(10);
  sweep_ipc();
  if (!awaiting_acks_.empty()) watch_acks();
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
  DomainState& d = domains_[index];
  // Idle: op (still linked) is the last work request posted on this NIC, towards any peer.
  const bool idle = d.inflight <= 1;
  if (d.rate.completed(op.length, now_, idle)) {
    nic_rate_[index].store(d.rate.bytes_per_second(), std::memory_order_relaxed);
  }
}

std::vector<uint64_t> Worker::nic_rates() const {
  std::vector<uint64_t> rates;
  nic_rates(rates);
  return rates;
}

void Worker::nic_rates(std::vector<uint64_t>& out) const {
  out.resize(domains_.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = nic_rate_[i].load(std::memory_order_relaxed);
}

std::vector<bool> Worker::up_nics() const {
  std::vector<bool> up;
  up_nics(up);
  return up;
}

void Worker::up_nics(std::vector<bool>& out) const {
  out.resize(domains_.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = nic_up_[i].load(std::memory_order_relaxed);
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

void Worker::mark_down(uint32_t nic, const PeerQueue& culprit, std::string_view why) {
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
  if (why.empty()) {
    detail::log().warn(
        "group {}: NIC '{}' marked down: no completion towards a peer for {} ms while another "
        "NIC reached it; its work moves to the surviving NICs",
        group_, d.domain->info().name, config_.nic_timeout.count());
  } else {
    detail::log().warn("group {}: NIC '{}' marked down: {}; its work moves to the surviving NICs",
                       group_, d.domain->info().name, why);
  }
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
  TransferPtr t = pool_.take();
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

}  // namespace fabric::engine
