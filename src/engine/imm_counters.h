// ImmCounters: per-immediate tallies of arrivals, expectations that fire once a count is
// reached, and waits. Thread-safe: workers record arrivals, users expect and wait.
//
// Arrivals take no lock: each immediate has a slot in an open-addressed table (found by hashing,
// claimed once by a compare-and-swap on its key, never freed), whose arrival count is one atomic
// add. An expectation is a target count in the slot's state word; the arrival that reaches it
// moves the state from pending to firing with a compare-and-swap (exactly one thread wins), takes
// the callback, and sets the slot idle again. Users' calls on expectations (expect, cancel,
// reset) are serialised among themselves by a mutex the arrival path never takes. Waits spin on
// the slot's count for the wait spin, then sleep on a condition variable that arrivals notify
// only while somebody sleeps there.
//
// More distinct immediates than the table holds go to a locked overflow map: correct, slower.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "fabric/status.h"

namespace fabric::engine {

class ImmCounters {
 public:
  using Callback = std::function<void()>;
  static constexpr size_t kDefaultSlots = 16384;
  // Table slots (rounded up to a power of two).
  explicit ImmCounters(size_t slots = kDefaultSlots);
  ~ImmCounters();
  ImmCounters(const ImmCounters&) = delete;
  ImmCounters& operator=(const ImmCounters&) = delete;

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
  // A slot's state: the phase in the low two bits, a pending (or firing) expectation's target
  // arrival count above them.
  enum Phase : uint64_t { kIdle = 0, kPending = 1, kFiring = 2 };
  static constexpr uint64_t kPhaseMask = 3;
  static uint64_t make_state(uint64_t target, Phase p) { return target << 2 | p; }
  static Phase phase_of(uint64_t s) { return static_cast<Phase>(s & kPhaseMask); }
  static uint64_t target_of(uint64_t s) { return s >> 2; }

  struct alignas(64) Slot {
    std::atomic<uint64_t> key{0};      // the immediate + 1; 0: free
    std::atomic<uint64_t> arrived{0};  // every arrival since start or reset
    std::atomic<uint64_t> state{0};
    std::atomic<uint64_t> claimed{0};  // arrivals consumed by expectations that fired
    // Written by expect (idle -> pending), taken by the thread that fires it (pending -> firing
    // -> idle), cleared by cancel and reset: never touched by two threads at once.
    Callback callback;
  };
  // Probes at most this many slots before the overflow map.
  static constexpr size_t kMaxProbes = 64;

  Slot* find(uint32_t imm) const;  // null when `imm` has no slot yet
  Slot* find_or_add(uint32_t imm) const;
  // Moves `s` from pending to firing if its target is met, takes the callback into `due`.
  static void try_fire(Slot& s, std::vector<Callback>& due);
  // Waits out a firing in progress (the firer only moves a callback); returns the state then.
  static uint64_t settled_state(const Slot& s);
  template <typename F>
  void for_each_slot(F&& f);

  const size_t mask_;
  const std::unique_ptr<Slot[]> slots_;
  mutable std::mutex overflow_mu_;
  mutable std::unordered_map<uint32_t, std::unique_ptr<Slot>> overflow_;
  std::mutex user_mu_;  // expect, cancel, reset, clear_expectations
  mutable std::mutex wait_mu_;
  mutable std::condition_variable cv_;
  mutable std::atomic<int> waiters_{0};
  std::atomic<uint64_t> total_{0};
  std::chrono::microseconds wait_spin_{0};
};

}  // namespace fabric::engine
