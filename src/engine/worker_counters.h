// The worker's statistics counters, bumped by the Worker and its PostingQueues.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <tuple>

#include "fabric/stats.h"

namespace fabric::engine {

// What a worker counts for TransferEngine::stats() (fabric/stats.h). The worker thread is the
// only writer of all but `wakeups` (a plain relaxed store of load + 1, no read-modify-write);
// stats() reads with relaxed loads. Each NIC's counters and the submitters' wake-up count have
// cache lines of their own.
struct WorkerCounters {
  using Counter = std::atomic<uint64_t>;
  struct alignas(64) Nic {
    Counter posted{0}, completed{0}, failed{0}, retries{0};
  };
  explicit WorkerCounters(size_t nics) : nics(nics), nic(new Nic[nics]) {}
  static void bump(Counter& c) {
    c.store(c.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  }
  // Adds this worker's counts to `g`.
  void fill(GroupStats& g) const;

  size_t nics;
  std::unique_ptr<Nic[]> nic;
  alignas(64) Counter internal_posted{0};
  // The engine's transfers and messages that ended, as their callbacks are queued.
  Counter transfers_completed{0}, transfers_failed{0}, messages_completed{0}, messages_failed{0};
  Counter passes{0};
  Counter sleeps{0};
  std::array<Counter, std::tuple_size_v<decltype(GroupStats::errors_by_code)>> errors{};
  std::array<Counter, LatencyHistogram::kBuckets> latency{};
  alignas(64) Counter wakeups{0};  // bumped by submitters (fetch_add)
  Counter ring_full{0};            // by submitters that took the overflow list (fetch_add)
};

}  // namespace fabric::engine
