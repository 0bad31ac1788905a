// ImmCounters: per-immediate tallies of arrivals, expectations that fire once a count is
// reached, and waits. Thread-safe: workers record arrivals, users expect and wait.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "fabric/status.h"

namespace fabric::engine {

class ImmCounters {
 public:
  using Callback = std::function<void()>;

  // Records arrivals. Appends the callbacks of expectations now met to `due`, and the
  // immediates that arrived with no pending expectation to `unexpected`.
  void arrive(std::span<const uint32_t> imms, std::vector<Callback>& due,
              std::vector<uint32_t>& unexpected);

  // Adds an expectation of `count` unclaimed arrivals. If already met, its callback is
  // appended to `due` at once and nothing stays pending.
  Status expect(uint32_t imm, uint64_t count, Callback cb, std::vector<Callback>& due);
  Status cancel(uint32_t imm);
  uint64_t count(uint32_t imm) const;
  // Polls for up to the wait spin (set_wait_spin) before it sleeps: an arrival soon after the
  // call is seen without a wake-up.
  bool wait(uint32_t imm, uint64_t total, std::chrono::milliseconds timeout) const;
  void set_wait_spin(std::chrono::microseconds spin) { wait_spin_ = spin; }
  void reset(uint32_t imm);
  // Drops every pending expectation (engine close); returns how many there were.
  size_t clear_expectations();
  // Every arrival recorded since the engine started (reset_imm does not take any back).
  uint64_t total() const { return total_.load(std::memory_order_relaxed); }

 private:
  struct Entry {
    uint64_t arrived = 0;   // every arrival since start or reset
    uint64_t claimed = 0;   // arrivals consumed by expectations that fired
    uint64_t expected = 0;  // 0: no pending expectation
    Callback callback;
  };
  // Fires the expectation of `e` if met.
  static void check(Entry& e, std::vector<Callback>& due);

  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  mutable int waiters_ = 0;
  std::unordered_map<uint32_t, Entry> entries_;
  std::atomic<uint64_t> total_{0};
  std::chrono::microseconds wait_spin_{0};
};

}  // namespace fabric::engine
