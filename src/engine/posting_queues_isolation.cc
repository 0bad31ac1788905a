// PostingQueues: isolation of one bad work request (docs/hardening.md, "One bad write").
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
#include "engine/posting_queues.h"

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
                            kind_name(op), error.message()));
}

}  // namespace

void PostingQueues::answered(PeerQueue& q, Clock::time_point now) {
  q.failing_since = now;
  q.backoff = kFirstBackoff;
}

bool PostingQueues::isolate(uint32_t nic, PeerQueue& q, Op& op, const Status& error,
                            Clock::time_point now) {
  const Transfer& t = *op.transfer;
  if (stopping_ && error.code() == ErrorCode::kPeerUnreachable && t.probe_nic < 0 &&
      t.check_nic < 0 && !op.urgent) {
    complete(op, closed_unresolved(op, error));
    return true;
  }
  // A write-fence note (urgent) is not retried here: its sender sends it again until answered.
  if (stopping_ || t.probe_nic >= 0 || t.check_nic >= 0 || op.urgent ||
      !suspect_code(error.code())) {
    return false;
  }
  if (!q.isolating()) {
    q.failing_since = now;
    q.backoff = kFirstBackoff;
    q.not_before = now + q.backoff;
    detail::log().warn(
        "group {}: a {} of {} bytes towards a peer on NIC '{}' failed ({}); posting the failed "
        "work requests towards that peer again one at a time, to find the one at fault",
        group_, kind_name(op), op.length, nics_[nic].domain->info().name, error.message());
    // The peer may have dropped the connection because it took this engine for dead (a write
    // fence it did not see answered): announce afresh before writing again.
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
  make_ready(nics_[nic], q);
  return true;
}

void PostingQueues::post_isolated(uint32_t nic, PeerQueue& q, Clock::time_point now) {
  if (q.check_posted || q.inflight_count > 0 || now < q.not_before) return;
  if (q.broken) {  // nothing is posted towards the peer now: connect afresh
    nics_[nic].domain->reset_peer(q.peer);
    q.broken = false;
  }
  if (fence_) {  // a write-fence note first: the suspects may wait for its answer
    post_urgent(nic, q);
    if (q.inflight_count > 0) return;
  }
  if (q.check != nullptr) {
    auto r = post(nic, *q.check, q.peer);
    if (r.kind == transport::PostResult::Kind::kAgain) return;
    if (r.kind == transport::PostResult::Kind::kPosted) q.check_posted = true;
    posted_or_failed(q, *q.check, r);  // a failed check ends in check_done
    return;
  }
  if (q.suspects.empty()) return;
  Op& op = *q.suspects.front();
  if (fence_ && q.announced_epoch != fence_->epoch() && held_for_hello(nic, q, op, now)) return;
  auto r = post(nic, op, q.peer);
  if (r.kind == transport::PostResult::Kind::kAgain) return;
  q.suspects.pop_front();
  --queued_;
  if (r.kind == transport::PostResult::Kind::kPosted) {
    op.lone = true;
    ++op.lone_tries;
  }
  posted_or_failed(q, op, r);
}

void PostingQueues::lone_done(uint32_t nic, PeerQueue& q, Op& op, const Status& status,
                              Clock::time_point now) {
  op.lone = false;
  const std::string& name = nics_[nic].domain->info().name;
  if (status.is_ok()) {
    answered(q, now);
    if (!op.had_imm) {
      complete(op, status);
      return;
    }
    complete(op, Status(ErrorCode::kPeerUnreachable,
                        fmt::format("the connection to the peer on NIC '{}' dropped with this "
                                    "write carrying immediate {} in flight (another write's "
                                    "failure dropped it); its data was written again, but the "
                                    "immediate may or may not have been counted, so it is not "
                                    "sent again (Config::reliable_imm avoids this)",
                                    name, op.imm)));
    return;
  }
  if (stopping_ && status.code() == ErrorCode::kPeerUnreachable) {
    complete(op, closed_unresolved(op, status));
    return;
  }
  if (status.code() == ErrorCode::kRemoteAccess && !stopping_ && op.owner != nullptr) {
    // Refused alone: this one is at fault. A provider that drops the connection on a refused
    // key (libfabric tcp) just did so again, and the peer may not have let go of it yet when
    // the next connection comes: seen on tcp, the first write after the refusal was reported
    // failed with EPIPE on the fresh connection. So the refusal is reported once a check has
    // gone through over a fresh connection; nothing else is posted towards the peer meanwhile.
    q.refused = &op;
    q.refusal = status;
    ++queued_;
    check_peer(nic, q, now);
    return;
  }
  if (status.code() == ErrorCode::kRemoteAccess || !suspect_code(status.code()) || stopping_) {
    complete(op, status);  // at fault (or the engine is closing): it fails, alone
    return;
  }
  // Failed alone, not as a refused key: bad key or unreachable peer? A check tells.
  messages_->release_send_slot(op);
  q.suspects.push_front(&op);
  ++queued_;
  check_peer(nic, q, now);
}

void PostingQueues::check_peer(uint32_t nic, PeerQueue& q, Clock::time_point now) {
  q.broken = true;
  q.not_before = now + q.backoff;
  q.backoff = std::min(q.backoff * 2, kMaxBackoff);
  make_ready(nics_[nic], q);
  Op& suspect = q.refused != nullptr ? *q.refused : *q.suspects.front();
  if (suspect.owner == nullptr) {
    fail_suspects(q, Status(ErrorCode::kPeerUnreachable,
                            "the connection to the peer dropped and the peer cannot be checked"));
    return;
  }
  events_.push_back({Event::Kind::kCheck, &suspect, Status::ok(), nic, q.peer});
}

bool PostingQueues::wants_check(uint32_t nic, transport::PeerHandle peer) const {
  const PeerQueue* q = find(nic, peer);
  return q != nullptr && (!q->suspects.empty() || q->refused != nullptr) && q->check == nullptr;
}

void PostingQueues::set_check(uint32_t nic, transport::PeerHandle peer, Op& check) {
  PeerQueue& q = nics_[nic].queues.at(peer);
  q.check = &check;
  q.check_posted = false;
}

void PostingQueues::check_done(uint32_t nic, transport::PeerHandle peer, const Status& error,
                               Clock::time_point now) {
  auto it = nics_[nic].queues.find(peer);
  if (it == nics_[nic].queues.end()) return;  // the peer was declared dead meanwhile
  PeerQueue& q = it->second;
  q.check = nullptr;
  q.check_posted = false;
  if (q.suspects.empty() && q.refused == nullptr) return;
  const std::string& name = nics_[nic].domain->info().name;
  if (!error.is_ok()) {
    if (now - q.failing_since < peer_timeout_ && !stopping_) {
      check_peer(nic, q, now);  // again, a little later
      return;
    }
    fail_suspects(q, Status(ErrorCode::kPeerUnreachable,
                            fmt::format("the connection to the peer on NIC '{}' dropped, and "
                                        "writes to the peer kept failing for {} ms, checks "
                                        "included: {}",
                                        name, peer_timeout_.count(), error.message())));
    return;
  }
  answered(q, now);
  make_ready(nics_[nic], q);
  report_refusal(q);
  if (q.suspects.empty()) return;
  Op& op = *q.suspects.front();
  if (op.lone_tries < kLoneTries) return;  // posted alone once more
  q.suspects.pop_front();
  --queued_;
  complete(op, Status(ErrorCode::kRemoteAccess,
                      fmt::format("the peer on NIC '{}' refused this write {} times when it "
                                  "was posted alone, while it accepted a check write (was "
                                  "the target region unregistered?)",
                                  name, op.lone_tries)));
}

void PostingQueues::report_refusal(PeerQueue& q) {
  if (q.refused == nullptr) return;
  --queued_;
  complete(*std::exchange(q.refused, nullptr), std::exchange(q.refusal, Status::ok()));
}

void PostingQueues::fail_suspects(PeerQueue& q, const Status& error) {
  report_refusal(q);  // refused before the peer went quiet: that is its error
  // The work queued behind the suspects goes the same way: the peer is unreachable.
  queued_ -= q.suspects.size() + q.ops.size();
  for (Op* op : q.suspects) complete(*op, error);
  for (Op* op : q.ops) complete(*op, error);
  q.suspects.clear();
  q.ops.clear();
}

}  // namespace fabric::engine
