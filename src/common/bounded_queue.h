// A bounded lock-free multi-producer multi-consumer queue of trivially copyable values (the
// sequence-numbered cell array of Dmitry Vyukov's bounded MPMC queue). Each cell carries a
// sequence number that says whose turn it is: a producer claims a slot by advancing `tail_`
// with a compare-and-swap, writes the value and publishes it by bumping the cell's sequence
// (release); a consumer does the same on `head_`. No allocation after construction, no lock,
// and a push or pop never waits for another thread: a full (or empty) queue is an answer, not
// a wait.
//
// Used for the worker's submission ring (many submitting threads, one worker) and the pool of
// recycled transfers (the worker gives back, submitting threads take).
#pragma once

#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <type_traits>

namespace fabric {

template <typename T>
class BoundedQueue {
  static_assert(std::is_trivially_copyable_v<T>, "values are copied in and out of cells");

 public:
  // Capacity: `min_capacity` rounded up to a power of two, at least 2.
  explicit BoundedQueue(size_t min_capacity)
      : mask_(std::bit_ceil(min_capacity < 2 ? size_t{2} : min_capacity) - 1),
        cells_(std::make_unique<Cell[]>(mask_ + 1)) {
    for (size_t i = 0; i <= mask_; ++i) cells_[i].seq.store(i, std::memory_order_relaxed);
  }
  BoundedQueue(const BoundedQueue&) = delete;
  BoundedQueue& operator=(const BoundedQueue&) = delete;

  size_t capacity() const { return mask_ + 1; }

  // False when the queue is full (the value is not taken).
  bool try_push(T value) {
    size_t pos = tail_.load(std::memory_order_relaxed);
    for (;;) {
      Cell& cell = cells_[pos & mask_];
      const size_t seq = cell.seq.load(std::memory_order_acquire);
      const auto diff = static_cast<std::ptrdiff_t>(seq - pos);
      if (diff == 0) {  // the cell is free for this position: claim it
        if (tail_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
          cell.value = value;
          cell.seq.store(pos + 1, std::memory_order_release);
          return true;
        }
      } else if (diff < 0) {  // the cell still holds the value of one lap ago: full
        return false;
      } else {  // another producer took this position: look again
        pos = tail_.load(std::memory_order_relaxed);
      }
    }
  }

  // False when the queue is empty.
  bool try_pop(T& out) {
    size_t pos = head_.load(std::memory_order_relaxed);
    for (;;) {
      Cell& cell = cells_[pos & mask_];
      const size_t seq = cell.seq.load(std::memory_order_acquire);
      const auto diff = static_cast<std::ptrdiff_t>(seq - (pos + 1));
      if (diff == 0) {  // published for this position: take it
        if (head_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
          out = cell.value;
          cell.seq.store(pos + mask_ + 1, std::memory_order_release);  // free for the next lap
          return true;
        }
      } else if (diff < 0) {  // not published yet: empty (or a producer mid-push)
        return false;
      } else {
        pos = head_.load(std::memory_order_relaxed);
      }
    }
  }

  // Whether a pop would find nothing published at this moment (a hint: producers may be
  // pushing). One load of the head cell.
  bool empty_hint() const {
    const size_t pos = head_.load(std::memory_order_relaxed);
    return cells_[pos & mask_].seq.load(std::memory_order_acquire) != pos + 1;
  }

 private:
  // Cells apart from each other and from the indices, so that a producer writing one cell and
  // the consumer reading the one before do not share a cache line.
  static constexpr size_t kLine = 64;
  struct alignas(kLine) Cell {
    std::atomic<size_t> seq{0};
    T value{};
  };

  const size_t mask_;
  std::unique_ptr<Cell[]> cells_;
  alignas(kLine) std::atomic<size_t> tail_{0};  // producers
  alignas(kLine) std::atomic<size_t> head_{0};  // consumers
};

}  // namespace fabric
