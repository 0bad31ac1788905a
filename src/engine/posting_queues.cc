// PostingQueues: queueing, round-robin posting under a budget, completions of posted ops, and
// what the watchdog and failover ask of the queues (posting_queues.h). Isolation is in
// posting_queues_isolation.cc.

#include "engine/posting_queues.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "common/log.h"

namespace fabric::engine {

PostingQueues::PostingQueues(uint32_t group, const Config& config, Below below)
    : group_(group),
      post_budget_(config.post_budget),
      peer_timeout_(config.peer_timeout),
      nics_(below.domains.size()),
      messages_(below.messages),
      health_(below.health),
      counters_(below.counters) {
  for (size_t i = 0; i < nics_.size(); ++i) nics_[i].domain = below.domains[i];
}

Status PostingQueues::enqueue(Op& op, Clock::time_point now) {
  Nic& n = nics_[op.domain];
  auto peer = n.domain->resolve_peer(*op.peer);
  if (!peer) return peer.status();
  PeerQueue& q = n.queues[*peer];
  q.peer = *peer;
  q.nic = op.domain;
  q.nic_inflight = &n.inflight;
  if (q.owner.empty() && op.owner != nullptr) q.owner = op.owner->nics()[0].name;
  if (q.ops.empty() && q.inflight_count == 0) q.last_progress = now;
  if (op.urgent) {
    q.ops.push_front(&op);
  } else {
    q.ops.push_back(&op);
  }
  ++queued_;
  make_ready(n, q);
  return Status::ok();
}

void PostingQueues::make_ready(Nic& n, PeerQueue& q) {
  if (q.ready) return;
  q.ready = true;
  n.ready.push_back(q.peer);
}

transport::PostResult PostingQueues::post(uint32_t nic, Op& op, transport::PeerHandle peer) {
  transport::Domain& d = *nics_[nic].domain;
  transport::PostResult r;
  if (op.kind == Op::Kind::kWrite) {
    r = d.post_write({reinterpret_cast<uint64_t>(&op), op.local, op.length, op.local_desc, peer,
                      op.remote_addr, op.remote_key, op.has_imm, op.imm});
  } else if (op.kind == Op::Kind::kRead) {
    r = d.post_read({reinterpret_cast<uint64_t>(&op), const_cast<void*>(op.local), op.length,
                     op.local_desc, peer, op.remote_addr, op.remote_key});
  } else if (!messages_->fill_send(op, abandoned_ > 0)) {
    // A send takes a registered buffer for as long as it is posted. Buffers held by sends
    // abandoned on a dead NIC may not come back soon: then the pool may grow (bounded).
    r = transport::PostResult::again();
  } else {
    r = d.post_send({reinterpret_cast<uint64_t>(&op), op.local, op.length, op.local_desc, peer});
  }
  WorkerCounters::Nic& c = counters_->nic[nic];
  if (r.kind == transport::PostResult::Kind::kPosted) {
    WorkerCounters::bump(c.posted);
    if ((op.transfer->id & kInternalTransfer) != 0)
      WorkerCounters::bump(counters_->internal_posted);
  } else if (r.kind == transport::PostResult::Kind::kAgain) {
    WorkerCounters::bump(c.retries);
  }
  return r;
}

void PostingQueues::posted_or_failed(PeerQueue& q, Op& op, const transport::PostResult& r) {
  if (r.kind == transport::PostResult::Kind::kPosted) {
    q.link(op);
    ++posted_;
  } else {
    complete(op, r.error);
  }
}

bool PostingQueues::post_some(uint32_t nic, Clock::time_point now) {
  Nic& n = nics_[nic];
  bool any = false;
  uint32_t budget = post_budget_;
  const size_t peers = n.ready.size();
  for (size_t i = 0; i < peers && budget > 0; ++i) {
    const transport::PeerHandle peer = n.ready.front();
    n.ready.pop_front();
    PeerQueue& q = n.queues[peer];
    if (q.isolating()) {  // posting_queues_isolation.cc: one work request at a time until it is
                          // over
      post_isolated(nic, q, now);
      if (q.isolating() || !q.ops.empty()) {
        n.ready.push_back(peer);
      } else {
        q.ready = false;
      }
      any = true;
      continue;
    }
    while (!q.ops.empty() && budget > 0) {
      Op& op = *q.ops.front();
      // The write fence: the peer has not acknowledged this engine yet.
      if (fence_ && q.announced_epoch != fence_->epoch() && held_for_hello(nic, q, op, now)) {
        break;
      }
      auto r = post(nic, op, peer);
      if (r.kind == transport::PostResult::Kind::kAgain) break;  // this peer waits; others go on
      // Refused as unreachable while another NIC is up (NicHealth::unreachable_here): the op
      // stays queued and the worker marks the NIC down, its work moving to the others.
      if (r.kind == transport::PostResult::Kind::kFailed &&
          health_->unreachable_here(
              nic, r.error,
              op.transfer->probe_nic < 0 && op.transfer->check_nic < 0 && movable(op))) {
        detail::log().warn("group {}: NIC '{}' cannot reach a peer ({}) while another NIC is up",
                           group_, n.domain->info().name, r.error.message());
        n.ready.push_back(peer);  // q keeps its order: it still holds the op
        events_.push_back(
            {Event::Kind::kUnreachable, nullptr,
             Status(ErrorCode::kPeerUnreachable, "a post failed: the peer is unreachable"), nic,
             peer});
        n.domain->flush();  // what the backend held back of this pass goes out (domain.h)
        return true;
      }
      q.ops.pop_front();
      --queued_;
      any = true;
      posted_or_failed(q, op, r);
      if (r.kind == transport::PostResult::Kind::kPosted) {
        if (op.kind != Op::Kind::kSend && op.length > 0) health_->posted(nic, now);
        --budget;
      }
    }
    if (q.ops.empty()) {
      q.ready = false;
    } else {
      n.ready.push_back(peer);
    }
  }
  if (any) n.domain->flush();  // what the backend held back goes out together (domain.h)
  return any;
}

bool PostingQueues::completed(Op& op, const Status& status, Clock::time_point now) {
  PeerQueue& q = *op.queue;
  // Evidence that the peer is alive, for the watchdogs (peer_timeout, nic_timeout). Not a
  // write-fence note's: on tcp a send completes once the socket has taken it, and the fence
  // re-sends its Hello every few ms until answered, so a dead link would look alive for ever
  // while the writes it holds back wait (a fresh-clone run: all links down, no callback for
  // 11 s, a Hello completing on the dead NIC 16 times a second).
  if (!op.urgent) q.last_progress = now;
  q.unlink(op);
  --posted_;
  if (op.lone) {
    lone_done(q.nic, q, op, status, now);
    return false;
  }
  return status.is_ok() || !isolate(q.nic, q, op, status, now);
}

bool PostingQueues::held_for_hello(uint32_t nic, PeerQueue& q, const Op& op,
                                   Clock::time_point now) {
  // Only writes of bytes into a registered region, and reads of one: zero-byte writes and writes
  // into a peer's scratch buffer (never unregistered) touch nothing a fence would protect. A
  // read's answer leaves the owner on the connection the fence's note takes, ahead of it.
  if (op.kind == Op::Kind::kSend || op.length == 0 || op.dst_mem == nullptr ||
      op.owner == nullptr || !nics_[nic].domain->info().key_checked_once) {
    return false;
  }
  const bool go = fence_->may_write(*op.owner, nic, now, notes_);
  if (go) q.announced_epoch = fence_->epoch();
  return !go;
}

void PostingQueues::post_urgent(uint32_t nic, PeerQueue& q) {
  if (q.ops.empty() || !q.ops.front()->urgent) return;
  Op& op = *q.ops.front();
  auto r = post(nic, op, q.peer);
  if (r.kind == transport::PostResult::Kind::kAgain) return;
  q.ops.pop_front();
  --queued_;
  posted_or_failed(q, op, r);
}

// --- what the watchdog and failover need ------------------------------------------------------

void PostingQueues::find_dead(Clock::time_point now,
                              std::vector<std::pair<uint32_t, transport::PeerHandle>>& out) {
  for (uint32_t i = 0; i < nics_.size(); ++i) {
    // A peer with work queued but nothing posted may be waiting for room that another peer's
    // stalled requests hold (the provider says "again" for the whole endpoint). It is not
    // declared dead while such a stalled peer exists on the domain: that one goes first, and
    // the waiting peer's clock starts afresh (so it is declared dead within 2 x peer_timeout at
    // most). Without this, a dead peer's requests filling the endpoint made a live peer that
    // had not posted yet look dead too (tests/reliability/dying_peer_test.cc).
    bool stalled_inflight = false;
    for (const auto& [peer, q] : nics_[i].queues) {
      stalled_inflight |= q.inflight_count > 0 && now - q.last_progress > peer_timeout_ / 2;
    }
    for (auto& [peer, q] : nics_[i].queues) {
      // Busy (work queued or posted) and no completion since peer_timeout: dead.
      const bool busy = q.inflight_count > 0 || !q.ops.empty() || q.isolating();
      if (!busy || now - q.last_progress <= peer_timeout_) continue;
      if (q.inflight_count == 0 && stalled_inflight) {
        q.last_progress = now;
        continue;
      }
      out.emplace_back(i, peer);
    }
  }
}

void PostingQueues::look(Clock::time_point now, std::chrono::milliseconds timeout,
                         std::vector<std::vector<NicHealth::QueueLook>>& looks,
                         std::vector<std::vector<transport::PeerHandle>>& peers) const {
  looks.resize(nics_.size());
  peers.resize(nics_.size());
  for (size_t i = 0; i < nics_.size(); ++i) {
    looks[i].clear();
    peers[i].clear();
    for (const auto& [peer, q] : nics_[i].queues) {
      const bool late = now - q.last_progress > timeout;
      looks[i].push_back({&q.owner, (q.inflight_count > 0 || !q.ops.empty()) && late, !late});
      peers[i].push_back(peer);
    }
  }
}

void PostingQueues::peers_of(uint32_t nic, Clock::time_point now, std::chrono::milliseconds timeout,
                             std::vector<std::pair<transport::PeerHandle, bool>>& out) const {
  for (const auto& [peer, q] : nics_[nic].queues) {
    out.emplace_back(peer, now - q.last_progress > timeout);
  }
}

bool PostingQueues::stalled_towards(uint32_t nic, const Bytes& owner, Clock::time_point now,
                                    std::chrono::milliseconds timeout) const {
  for (const auto& [peer, q] : nics_[nic].queues) {
    if (q.owner == owner && (q.inflight_count > 0 || !q.ops.empty()) &&
        now - q.last_progress > timeout) {
      return true;
    }
  }
  return false;
}

const PeerQueue* PostingQueues::find(uint32_t nic, transport::PeerHandle peer) const {
  auto it = nics_[nic].queues.find(peer);
  return it == nics_[nic].queues.end() ? nullptr : &it->second;
}

const Bytes* PostingQueues::owner_name(uint32_t nic, transport::PeerHandle peer) const {
  const PeerQueue* q = find(nic, peer);
  return q != nullptr ? &q->owner : nullptr;
}

Address PostingQueues::owner_of(uint32_t nic, transport::PeerHandle peer) const {
  Address owner;
  const PeerQueue* q = find(nic, peer);
  if (q == nullptr) return owner;
  for (const Op* op = q->inflight; op != nullptr; op = op->next) {
    if (op->owner != nullptr) owner = *op->owner;
  }
  for (const Op* op : q->ops) {
    if (op->owner != nullptr) owner = *op->owner;
  }
  return owner;
}

PostingQueues::Taken PostingQueues::take_out(uint32_t nic, transport::PeerHandle peer,
                                             bool posted_too) {
  Taken taken;
  Nic& n = nics_[nic];
  auto it = n.queues.find(peer);
  if (it == n.queues.end()) return taken;
  PeerQueue& q = it->second;
  taken.owner = q.owner;
  taken.queued.assign(q.ops.begin(), q.ops.end());
  taken.queued.insert(taken.queued.end(), q.suspects.begin(), q.suspects.end());
  taken.suspects = q.suspects.size();
  report_refusal(q);
  taken.checking = q.check != nullptr;
  queued_ -= taken.queued.size();
  q.ops.clear();
  q.suspects.clear();
  if (q.check != nullptr && !q.check_posted) taken.check = std::exchange(q.check, nullptr);
  if (posted_too) {
    while (q.inflight != nullptr) {
      Op* op = q.inflight;
      q.unlink(*op);
      taken.posted.push_back(op);
    }
  }
  std::erase(n.ready, peer);
  if (q.inflight_count == 0) {
    n.queues.erase(it);  // q is gone from here on
  } else {
    q.ready = false;
  }
  // The connection is dropped (a later post connects afresh): nothing posted on it can complete
  // any more, so its work requests are abandoned to the provider.
  if (posted_too) n.domain->forget_peer(peer);
  return taken;
}

void PostingQueues::take_messages(uint32_t nic, transport::PeerHandle peer,
                                  std::vector<Op*>& queued, std::vector<Op*>& posted) {
  auto it = nics_[nic].queues.find(peer);
  if (it == nics_[nic].queues.end()) return;
  PeerQueue& q = it->second;
  std::erase_if(q.ops, [&](Op* op) {
    const bool move = op->kind == Op::Kind::kSend && movable(*op);
    if (move) queued.push_back(op);
    return move;
  });
  queued_ -= queued.size();
  for (Op* op = q.inflight; op != nullptr; op = op->next) {
    if (op->kind == Op::Kind::kSend && movable(*op)) posted.push_back(op);
  }
  for (Op* op : posted) q.unlink(*op);  // still in the provider's hands
}

void PostingQueues::take_all_queued(std::vector<Op*>& out) {
  for (Nic& n : nics_) {
    for (auto& [peer, q] : n.queues) {
      out.insert(out.end(), q.ops.begin(), q.ops.end());
      out.insert(out.end(), q.suspects.begin(), q.suspects.end());
      report_refusal(q);  // (an event: the worker runs it before it stops)
      if (q.check != nullptr && !q.check_posted) out.push_back(q.check);
      q.check = nullptr;
      q.ops.clear();
      q.suspects.clear();
      q.ready = false;
    }
    n.ready.clear();
  }
  queued_ = 0;
}

}  // namespace fabric::engine
