// RateMeter: a NIC's write rate for weighted sharding (docs/netlab.md, "Unequal links"),
// measured only over the time the NIC had writes posted, so that idle gaps between transfers
// do not read as a slow link. Worker-thread only; pure arithmetic on the times it is given.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>

namespace fabric::engine {

class RateMeter {
 public:
  using Clock = std::chrono::steady_clock;
  // A sample closes at least this long after its window opened (or when the NIC goes idle).
  static constexpr std::chrono::milliseconds kPeriod{20};
  // Time constant of the average, in busy time: a sample spanning t weighs 1 - exp(-t / kTau).
  // (200 ms and 1 s measured worse on the lab's unequal links at 1 MiB writes: docs/netlab.md.)
  static constexpr std::chrono::milliseconds kTau{100};

  // A write was posted at `now`: opens a window when none is open.
  void posted(Clock::time_point now) {
    if (open_) return;
    open_ = true;
    start_ = now;
    bytes_ = 0;
  }
  // A posted write of `bytes` completed at `now`; `idle`: nothing else is posted on the NIC
  // now, so the window closes (the time until the next post is not the link's). Returns true
  // when the estimate changed.
  bool completed(uint64_t bytes, Clock::time_point now, bool idle) {
    if (!open_) posted(now);
    bytes_ += bytes;
    const auto elapsed = now - start_;
    if (!idle && elapsed < kPeriod) return false;
    open_ = !idle;
    start_ = now;
    const uint64_t window = bytes_;
    bytes_ = 0;
    const double seconds = std::chrono::duration<double>(elapsed).count();
    if (seconds <= 0) return false;
    const double sample = static_cast<double>(window) / seconds;
    const double alpha =
        rate_ == 0 ? 1.0 : 1.0 - std::exp(-seconds / std::chrono::duration<double>(kTau).count());
    rate_ += alpha * (sample - rate_);
    return true;
  }
  // Bytes per second; 0 until the first sample.
  uint64_t bytes_per_second() const { return static_cast<uint64_t>(rate_); }
  // Forgets the estimate (a NIC back from failover is measured afresh).
  void reset() { *this = RateMeter(); }

 private:
  bool open_ = false;
  Clock::time_point start_{};
  uint64_t bytes_ = 0;
  double rate_ = 0;
};

}  // namespace fabric::engine
