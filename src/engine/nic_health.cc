// NicHealth: the failover state of a worker's NICs and the decisions made on it (nic_health.h,
// docs/failover.md).

#include "engine/nic_health.h"

#include <utility>

#include "common/log.h"
#include "engine/plan.h"

namespace fabric::engine {

namespace {
// NicHealth::stamp's source: never 0 (a thread's copy that was never filled) nor reused.
uint64_t next_stamp() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}
}  // namespace

NicHealth::NicHealth(uint32_t group, std::vector<std::string> names, const Config& config)
    : group_(group),
      nic_timeout_(config.nic_timeout),
      probe_interval_(config.nic_probe_interval),
      active_(config.nic_timeout.count() > 0 && config.nic_timeout < config.peer_timeout &&
              names.size() >= 2),
      nics_(names.size()),
      up_(std::make_unique<std::atomic<bool>[]>(names.size())),
      stamp_(next_stamp()),
      rate_(std::make_unique<std::atomic<uint64_t>[]>(names.size())) {
  for (size_t i = 0; i < names.size(); ++i) {
    nics_[i].name = std::move(names[i]);
    up_[i].store(true);
    rate_[i].store(0);
  }
}

void NicHealth::up_nics(std::vector<bool>& out) const {
  out.resize(nics_.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = up_[i].load(std::memory_order_relaxed);
}

void NicHealth::rates(std::vector<uint64_t>& out) const {
  out.resize(nics_.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = rate_[i].load(std::memory_order_relaxed);
}

void NicHealth::set_up(uint32_t nic, bool up) {
  nics_[nic].down = !up;
  if (up_[nic].exchange(up) != up) stamp_.store(next_stamp(), std::memory_order_release);
}

uint32_t NicHealth::survivor(uint32_t nic) {
  scratch_up_.resize(nics_.size());
  for (size_t i = 0; i < nics_.size(); ++i) scratch_up_[i] = !nics_[i].down;
  return failover_nic(nic, scratch_up_, salt_++);
}

uint32_t NicHealth::other_up(uint32_t nic, const std::vector<bool>& excluded) {
  scratch_up_.resize(nics_.size());
  for (size_t i = 0; i < nics_.size(); ++i) {
    scratch_up_[i] = !nics_[i].down && i != nic && (i >= excluded.size() || !excluded[i]);
  }
  const uint32_t to = failover_nic(nic, scratch_up_, salt_++);
  return to < nics_.size() && scratch_up_[to] ? to : nic;
}

uint32_t NicHealth::message_nic() const {
  for (uint32_t i = 0; i < nics_.size(); ++i) {
    if (!nics_[i].down) return i;
  }
  return 0;
}

bool NicHealth::unreachable_here(uint32_t nic, const Status& error, bool movable) const {
  if (error.code() != ErrorCode::kPeerUnreachable || !active_ || nics_[nic].down || !movable) {
    return false;
  }
  for (uint32_t j = 0; j < nics_.size(); ++j) {
    if (j != nic && !nics_[j].down) return true;
  }
  return false;
}

NicHealth::Verdict NicHealth::judge(uint32_t nic,
                                    std::span<const std::vector<QueueLook>> looks) const {
  Verdict v;
  const std::vector<QueueLook>& mine = looks[nic];
  for (size_t k = 0; k < mine.size(); ++k) {
    if (mine[k].stalled) v.stalled.push_back(k);
  }
  if (nics_[nic].down) {
    v.kind = Verdict::Kind::kStuckWhileDown;
    return v;
  }
  for (size_t k : v.stalled) {
    const QueueLook& q = mine[k];
    if (q.owner == nullptr || q.owner->empty()) continue;
    for (uint32_t j = 0; j < looks.size(); ++j) {
      if (j == nic || nics_[j].down) continue;
      for (const QueueLook& q2 : looks[j]) {
        if (q2.recent && q2.owner != nullptr && *q2.owner == *q.owner) {
          v.kind = Verdict::Kind::kMarkDown;
          v.culprit = k;
          return v;
        }
      }
    }
  }
  if (!v.stalled.empty()) v.kind = Verdict::Kind::kReroute;
  return v;
}

void NicHealth::mark_down(uint32_t nic, Clock::time_point now, const Address& owner,
                          std::string_view why) {
  Nic& n = nics_[nic];
  if (!owner.empty()) n.probe_owner = owner;
  n.down_since = now;
  n.next_probe = now + probe_interval_;
  set_up(nic, false);
  if (why.empty()) {
    detail::log().warn(
        "group {}: NIC '{}' marked down: no completion towards a peer for {} ms while another "
        "NIC reached it; its work moves to the surviving NICs",
        group_, n.name, nic_timeout_.count());
  } else {
    detail::log().warn("group {}: NIC '{}' marked down: {}; its work moves to the surviving NICs",
                       group_, n.name, why);
  }
}

std::optional<Address> NicHealth::probe_due(uint32_t nic, Clock::time_point now, bool stopping) {
  Nic& n = nics_[nic];
  if (!n.down || n.probing || stopping || now < n.next_probe) return std::nullopt;
  if (n.probe_owner.empty()) {  // nothing to probe with: try it again
    set_up(nic, true);
    return std::nullopt;
  }
  n.probing = true;
  return n.probe_owner;
}

void NicHealth::probe_done(uint32_t nic, bool ok, Clock::time_point now) {
  Nic& n = nics_[nic];
  n.probing = false;
  if (!ok || !n.down) {
    n.next_probe = now + probe_interval_;
    return;
  }
  n.rate.reset();  // measured afresh: until then it counts as fast as the fastest
  rate_[nic].store(0);
  set_up(nic, true);
  detail::log().warn(
      "group {}: NIC '{}' is back up after {} ms ({} work requests moved off it)", group_, n.name,
      std::chrono::duration_cast<std::chrono::milliseconds>(now - n.down_since).count(),
      n.failed_over);
  n.failed_over = 0;
}

void NicHealth::completed(uint32_t nic, uint64_t bytes, Clock::time_point now, bool idle) {
  Nic& n = nics_[nic];
  if (n.rate.completed(bytes, now, idle)) {
    rate_[nic].store(n.rate.bytes_per_second(), std::memory_order_relaxed);
  }
}

}  // namespace fabric::engine
