// System calls and context switches of this whole process (every thread: the submitting one,
// the engine's workers, its callback thread), counted by the kernel through perf_event_open: a
// software counter of context switches and the raw_syscalls:sys_enter tracepoint, one of each
// per thread. fabric-bench prints them per op next to each row, so what a row costs in system
// calls and thread hops is measured, not inferred. Either count may be unavailable (no
// perf_event_open, or no tracefs: `mount -t tracefs nodev /sys/kernel/tracing`); it reads NaN
// then and `unavailable()` says why.
#pragma once

#include <cmath>
#include <string>
#include <unordered_map>

namespace fabric::bench {

class SysCounters {
 public:
  struct Totals {
    double syscalls = std::nan("");
    double context_switches = std::nan("");
  };

  SysCounters();
  ~SysCounters();
  SysCounters(const SysCounters&) = delete;
  SysCounters& operator=(const SysCounters&) = delete;

  // The counts summed over the process's threads. A thread that appeared since the last read
  // is counted from now on (its earlier calls are not).
  Totals read();
  // Why a count reads NaN, or empty when both are counted.
  const std::string& unavailable() const { return why_; }

 private:
  struct Fds {
    int syscalls = -1;
    int switches = -1;
  };
  void track_threads();

  int tracepoint_ = -1;  // the id of raw_syscalls:sys_enter, or -1
  bool switches_ok_ = true;
  std::unordered_map<int, Fds> threads_;  // by thread id
  std::string why_;
};

}  // namespace fabric::bench
