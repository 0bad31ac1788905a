// NicHealth: which of a worker's NICs are up, as a component (docs/failover.md, docs/engine.md
// "Files").
//
// It owns each NIC's failover state (marked down, since when, the next probe and the peer it
// probes towards, a probe in flight, the work moved off it), its measured write rate (weighted
// sharding), the up and rate arrays published to submitting threads, and the salt that spreads
// moved work over the survivors. It decides: which NIC the watchdog finds down (judge), when a
// NIC that is down is probed, which NIC takes the work of another, whether a post refused as
// unreachable shows the NIC at fault. It calls nothing above it and touches no queue: the worker
// describes its queues (QueueLook), and moves the Ops and posts the probes that the answers ask
// for (worker_failover.cc).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/rate_meter.h"
#include "fabric/address.h"
#include "fabric/config.h"
#include "fabric/status.h"

namespace fabric::engine {

class NicHealth {
 public:
  using Clock = std::chrono::steady_clock;

  // One queue of a NIC (towards one peer NIC) as the watchdog sees it.
  struct QueueLook {
    const Bytes* owner = nullptr;  // the peer engine's first NIC name (empty: not known)
    bool stalled = false;          // work queued or posted, and no progress for nic_timeout
    bool recent = false;           // progress within nic_timeout
  };
  // What the watchdog found on one NIC, for the worker to act on.
  struct Verdict {
    enum class Kind : uint8_t {
      kNone,
      kStuckWhileDown,  // the NIC is down: move `stalled` (posted work too), then probe_due()
      kMarkDown,        // mark_down() it, then move all its queues
      kReroute,         // no evidence against the NIC: move the messages of `stalled`
    };
    Kind kind = Kind::kNone;
    std::vector<size_t> stalled;  // indices into the NIC's looks
    size_t culprit = 0;           // kMarkDown: the stalled queue another NIC's progress shows
  };

  // `names`: the NICs' names (rail order), for the log. Reads Config::nic_timeout,
  // peer_timeout and nic_probe_interval.
  NicHealth(uint32_t group, std::vector<std::string> names, const Config& config);

  // Failover is on: nic_timeout set, below peer_timeout, and two NICs at least.
  bool active() const { return active_; }
  uint32_t size() const { return static_cast<uint32_t>(nics_.size()); }
  bool down(uint32_t nic) const { return nics_[nic].down; }
  std::chrono::milliseconds nic_timeout() const { return nic_timeout_; }

  // --- published (thread-safe)
  // Which NICs are up (not marked down), into `out` (its capacity kept).
  void up_nics(std::vector<bool>& out) const;
  // A value that changes whenever up_nics() would give another answer, unique to this NicHealth
  // and this state among all NicHealths of the process (a process-wide count): a submitting
  // thread that filled its copy of up_nics() at stamp() s need not read it again while stamp()
  // is s. Read before up_nics().
  uint64_t stamp() const { return stamp_.load(std::memory_order_acquire); }
  // Each NIC's measured write rate in bytes per second (0: not measured yet).
  void rates(std::vector<uint64_t>& out) const;

  // --- worker thread
  // The NIC that takes the work of `nic`: `nic` itself when it is up, else a NIC that is up
  // (rotating), else `nic`.
  uint32_t survivor(uint32_t nic);
  // A NIC that is up other than `nic` and those `excluded` marks (may be empty), rotating;
  // `nic` when there is none.
  uint32_t other_up(uint32_t nic, const std::vector<bool>& excluded = {});
  // The first NIC that is up (messages go there), or 0 when none is.
  uint32_t message_nic() const;
  // Whether a post that failed with `error` on `nic` shows the NIC, not the peer, at fault: the
  // provider called the peer unreachable from this NIC while another NIC of the group is up,
  // and the op (`movable`: not a probe or check, and could go over another NIC) could go there.
  bool unreachable_here(uint32_t nic, const Status& error, bool movable) const;

  // The watchdog's look at `nic` (nothing changes here): `looks[j]` are NIC j's queues, in the
  // worker's order. kMarkDown when one of its queues stalled while another NIC that is up made
  // progress towards the same peer: else the peer itself may be gone, peer_timeout's call.
  Verdict judge(uint32_t nic, std::span<const std::vector<QueueLook>> looks) const;
  // Marks `nic` down at `now` (logged: `why`, or the watchdog's stall by default); `owner`: the
  // peer engine to probe towards (empty: keep the one it had). The worker then moves its work.
  void mark_down(uint32_t nic, Clock::time_point now, const Address& owner,
                 std::string_view why = {});
  // A NIC that is down, after its stalled work moved: the peer to probe it towards now (the
  // probe counts as in flight until probe_done), or nothing. With no peer to probe towards (it
  // stalled on engine messages only), the NIC is taken as up again at once.
  std::optional<Address> probe_due(uint32_t nic, Clock::time_point now, bool stopping);
  // The probe of `nic` ended (`ok`: it completed): the NIC is up again (logged, rate measured
  // afresh), or the next probe is due after nic_probe_interval.
  void probe_done(uint32_t nic, bool ok, Clock::time_point now);
  // A work request moved off `nic` (for the log line when it comes back up).
  void moved_off(uint32_t nic) { ++nics_[nic].failed_over; }
  // Weighted sharding: a write of nonzero length was posted on `nic`; one of `bytes` completed
  // (`idle`: it was the last posted there).
  void posted(uint32_t nic, Clock::time_point now) { nics_[nic].rate.posted(now); }
  void completed(uint32_t nic, uint64_t bytes, Clock::time_point now, bool idle);

 private:
  struct Nic {
    std::string name;
    bool down = false;
    Clock::time_point down_since;
    Clock::time_point next_probe;
    Address probe_owner;       // the peer engine it lost a queue towards
    bool probing = false;      // a probe is in flight
    uint64_t failed_over = 0;  // work requests moved off it, for the log
    RateMeter rate;            // its write rate, published in rate_
  };
  void set_up(uint32_t nic, bool up);

  const uint32_t group_;
  const std::chrono::milliseconds nic_timeout_;
  const std::chrono::milliseconds probe_interval_;
  const bool active_;
  std::vector<Nic> nics_;
  std::unique_ptr<std::atomic<bool>[]> up_;        // published to submitting threads
  std::atomic<uint64_t> stamp_;                    // stamp(): renewed after up_ changes
  std::unique_ptr<std::atomic<uint64_t>[]> rate_;  // RateMeter estimates, likewise
  uint32_t salt_ = 0;
  std::vector<bool> scratch_up_;  // survivor / other_up: kept to avoid allocating
};

}  // namespace fabric::engine
