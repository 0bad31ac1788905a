// Worker: isolation of one bad work request (docs/hardening.md, "One bad write").
//
// A provider may answer one bad write (a stale remote key: the region was unregistered) by
// dropping the whole connection, so that every other work request in flight towards the same
// peer fails too (libfabric tcp does). The innocent ones must not fail for it. So a work request
// that fails with kRemoteAccess or kPeerUnreachable becomes a suspect: once nothing is in flight
// towards the peer any more, the suspects are posted again one at a time (the provider
// reconnects on the next post). Alone:
//   - one that completes was innocent: it completes (data is idempotent; a message's receiver
//     drops a second copy). A write that carried a fabric immediate is re-posted without it,
//     since the first may have been counted before the connection dropped; it then fails with an
//     error that says so (Config::reliable_imm makes immediates exact across such failures);
//   - one that fails with kRemoteAccess is the bad one: it fails, alone;
//   - one that fails otherwise may be the bad one or may have met a peer that is gone: a check
//     (a zero-byte write to the peer's scratch buffer, whose key is known good) tells. If the
//     check fails, the peer is unreachable and every suspect fails with that. If the check
//     completes, the suspect is posted alone again, up to kLoneTries times, and then fails as
//     kRemoteAccess: refused while the peer accepted other writes.
#include <fmt/format.h>

#include <algorithm>

#include "common/log.h"
#include "engine/plan.h"
#include "engine/worker.h"

namespace fabric::engine {

namespace {

constexpr uint8_t kLoneTries = 3;
constexpr std::chrono::microseconds kFirstBackoff{1000};
constexpr std::chrono::microseconds kMaxBackoff{100000};

bool suspect_code(ErrorCode code) {
  return code == ErrorCode::kPeerUnreachable || code == ErrorCode::kRemoteAccess;
}

// The engine closes with a write failed on a connection the peer dropped and not isolated yet:
// whether it was at fault or an innocent bystander is not known, and will not be.
Status closed_unresolved(const Op& op, const Status& error) {
  return Status(ErrorCode::kCancelled,
                fmt::format("the engine closed before this {} could be posted again alone to "
                            "tell whether it was at fault ({})",
                            op.kind == Op::Kind::kSend ? "message" : "write", error.message()));
}

}  // namespace

void Worker::answered(PeerQueue& q) {
  q.failing_since = now_;
  q.backoff = kFirstBackoff;
}

void Worker::make_ready(DomainState& d, PeerQueue& q) {
  if (q.ready) return;
  q.ready = true;
  d.ready.push_back(q.peer);
}

bool Worker::isolate(DomainState& d, PeerQueue& q, Op& op, const Status& error) {
  const Transfer& t = *op.transfer;
  if (stopping_ && error.code() == ErrorCode::kPeerUnreachable && t.probe_nic < 0 &&
      t.check_nic < 0 && !op.urgent) {
    complete_op(op, closed_unresolved(op, error));
    return true;
  }
  // A write-fence note (urgent) is not retried here: its sender sends it again until answered.
  if (stopping_ || t.probe_nic >= 0 || t.check_nic >= 0 || op.urgent ||
      !suspect_code(error.code())) {
    return false;
  }
  if (!q.isolating()) {
    q.failing_since = now_;
    q.backoff = kFirstBackoff;
    q.not_before = now_ + q.backoff;
    detail::log().warn(
        "group {}: a {} of {} bytes towards a peer on NIC '{}' failed ({}); posting the failed "
        "work requests towards that peer again one at a time, to find the one at fault",
        group_, op.kind == Op::Kind::kSend ? "message" : "write", op.length, d.domain->info().name,
        error.message());
    // The peer may have dropped the connection because it took this engine for dead (a write
    // fence it did not see answered): announce afresh before writing again (write_fence.cc).
    if (fence_) fence_->forget_owner(q.owner);
  }
  if (op.kind == Op::Kind::kWrite && op.has_imm) {
    op.had_imm = true;
    op.has_imm = false;
  }
  // A message's registered buffer goes back to the pool while it waits (others' messages need
  // it); posting it again takes a buffer afresh.
  messages_->release_send_slot(op);
  q.suspects.push_back(&op);
  ++queued_;
  q.broken = true;
  make_ready(d, q);
  return true;
}

void Worker::post_isolated(DomainState& d, PeerQueue& q) {
  if (q.check_posted || q.inflight_count > 0 || now_ < q.not_before) return;
  if (q.broken) {  // nothing is posted towards the peer now: connect afresh
    d.domain->reset_peer(q.peer);
    q.broken = false;
  }
  if (fence_) {  // a write-fence note first: the suspects may wait for its answer
    post_urgent(d, q);
    if (q.inflight_count > 0) return;
  }
  if (q.check != nullptr) {
    auto r = post(d, *q.check, q.peer);
    if (r.kind == transport::PostResult::Kind::kAgain) return;
    if (r.kind == transport::PostResult::Kind::kPosted) {
      q.check_posted = true;
      q.link(*q.check);
      ++posted_;
    } else {
      Op& check = *q.check;
      complete_op(check, r.error);  // check_done runs: q may be gone from here on
    }
    return;
  }
  if (q.suspects.empty()) return;
  Op& op = *q.suspects.front();
  const uint32_t nic = static_cast<uint32_t>(&d - domains_.data());
  if (fence_ && q.announced_epoch != fence_->epoch() && held_for_hello(nic, q, op)) return;
  auto r = post(d, op, q.peer);
  if (r.kind == transport::PostResult::Kind::kAgain) return;
  q.suspects.pop_front();
  --queued_;
  if (r.kind == transport::PostResult::Kind::kPosted) {
    op.lone = true;
    ++op.lone_tries;
    q.link(op);
    ++posted_;
  } else {
    complete_op(op, r.error);
  }
}

void Worker::lone_done(DomainState& d, PeerQueue& q, Op& op, const Status& status) {
  op.lone = false;
  if (status.is_ok()) {
    answered(q);
    if (!op.had_imm) {
      complete_op(op, status);
      return;
    }
    complete_op(op, Status(ErrorCode::kPeerUnreachable,
                           fmt::format("the connection to the peer on NIC '{}' dropped with this "
                                       "write carrying immediate {} in flight (another write's "
                                       "failure dropped it); its data was written again, but the "
                                       "immediate may or may not have been counted, so it is not "
                                       "sent again (Config::reliable_imm avoids this)",
                                       d.domain->info().name, op.imm)));
    return;
  }
  if (stopping_ && status.code() == ErrorCode::kPeerUnreachable) {
    complete_op(op, closed_unresolved(op, status));
    return;
  }
  if (status.code() == ErrorCode::kRemoteAccess || !suspect_code(status.code()) || stopping_) {
    // Refused alone: this one is at fault. A provider that drops the connection on a refused
    // key (libfabric tcp) just did so again: the next work towards the peer waits until the
    // connection is made afresh, instead of failing on the dropped one.
    if (status.code() == ErrorCode::kRemoteAccess && !stopping_) {
      q.broken = true;
      q.not_before = now_ + kFirstBackoff;
      make_ready(d, q);
    }
    complete_op(op, status);
    return;
  }
  // Failed alone, not as a refused key: bad key or unreachable peer? A check tells.
  messages_->release_send_slot(op);
  q.suspects.push_front(&op);
  ++queued_;
  check_peer(d, q);
}

void Worker::check_peer(DomainState& d, PeerQueue& q) {
  const uint32_t nic = static_cast<uint32_t>(&d - domains_.data());
  q.broken = true;
  q.not_before = now_ + q.backoff;
  q.backoff = std::min(q.backoff * 2, kMaxBackoff);
  make_ready(d, q);
  const Op& suspect = *q.suspects.front();
  if (suspect.owner == nullptr) {
    fail_suspects(q, Status(ErrorCode::kPeerUnreachable,
                            "the connection to the peer dropped and the peer cannot be checked"));
    return;
  }
  TransferPtr t = pool_.take();
  t->id = kInternalTransfer | next_internal_++;
  t->check_nic = static_cast<int>(nic);
  t->check_peer = q.peer;
  t->peers.push_back(*suspect.owner);
  const Address& owner = t->peers[0];
  uint32_t rail = remote_rail(nic, owner.num_nics());
  for (uint32_t i = 0; i < owner.num_nics(); ++i) {
    if (owner.nics()[i].name == *suspect.peer) rail = i;
  }
  const NicAddress& peer = owner.nics()[rail];
  Op& op = t->ops.emplace_back(scratch_op(*t, nic, owner, peer, scratch(nic)));
  t->pending = 1;
  q.check = &op;
  q.check_posted = false;
  live_.adopt(std::move(t));
}

void Worker::check_done(Transfer& t) {
  DomainState& d = domains_[static_cast<uint32_t>(t.check_nic)];
  auto it = d.queues.find(t.check_peer);
  if (it == d.queues.end()) return;  // the peer was declared dead meanwhile
  PeerQueue& q = it->second;
  q.check = nullptr;
  q.check_posted = false;
  if (q.suspects.empty()) return;
  if (!t.error.is_ok()) {
    if (now_ - q.failing_since < config_.peer_timeout && !stopping_) {
      check_peer(d, q);  // again, a little later
      return;
    }
    fail_suspects(q, Status(ErrorCode::kPeerUnreachable,
                            fmt::format("the connection to the peer on NIC '{}' dropped, and "
                                        "writes to the peer kept failing for {} ms, checks "
                                        "included: {}",
                                        d.domain->info().name, config_.peer_timeout.count(),
                                        t.error.message())));
    return;
  }
  answered(q);
  make_ready(d, q);
  Op& op = *q.suspects.front();
  if (op.lone_tries < kLoneTries) return;  // posted alone once more
  q.suspects.pop_front();
  --queued_;
  complete_op(op, Status(ErrorCode::kRemoteAccess,
                         fmt::format("the peer on NIC '{}' refused this write {} times when it "
                                     "was posted alone, while it accepted a check write (was "
                                     "the target region unregistered?)",
                                     d.domain->info().name, op.lone_tries)));
}

void Worker::fail_suspects(PeerQueue& q, const Status& error) {
  // The work queued behind the suspects goes the same way: the peer is unreachable.
  std::vector<Op*> ops(q.suspects.begin(), q.suspects.end());
  ops.insert(ops.end(), q.ops.begin(), q.ops.end());
  queued_ -= ops.size();
  q.suspects.clear();
  q.ops.clear();
  for (Op* op : ops) complete_op(*op, error);
}

}  // namespace fabric::engine
