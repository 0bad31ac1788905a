// The staging ring's bookkeeping: ranges of a buffer of `size` bytes taken first in, first out,
// each carrying what its release waits for (T). A range is reused only once it was released.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <utility>

namespace fabric::weights {

// Every range starts aligned for any dtype.
inline constexpr uint64_t kRingAlign = 256;
inline uint64_t ring_align(uint64_t n) {
  return (n + kRingAlign - 1) / kRingAlign * kRingAlign;
}

template <typename T>
class RingRanges {
 public:
  struct Range {
    uint64_t start = 0;
    uint64_t end = 0;
    T held{};
  };

  explicit RingRanges(uint64_t size) : size_(size) {}

  uint64_t size() const { return size_; }
  // Where the next n bytes go: after the last range, or at 0 when they do not fit there.
  uint64_t next_start(uint64_t n) const {
    const uint64_t start = ring_align(head_);
    return start <= size_ && n <= size_ - start ? start : 0;
  }
  // Whether [start, start + n), as next_start gave it, meets a live range. Ranges are taken in
  // address order and wrap to 0 at most once among the live ones (a second wrap would have
  // passed the oldest), so only two can be met first: the oldest and, after a wrap, the one
  // taken at 0. (A scan of every live range cost 90 us a take with 300 of them.)
  bool overlaps(uint64_t start, uint64_t n) const {
    if (live_.empty()) return false;
    const uint64_t s0 = live_.front().start, e0 = live_.front().end;
    if (start == ring_align(head_) && start <= size_ && n <= size_ - start) {
      return start < e0 && s0 < start + n;
    }
    // Back to 0: a live range taken at 0 since the last wrap, or the oldest reaching down.
    return live_.back().start < s0 || s0 < start + n;
  }
  // Takes [start, start + n) (a start from next_start that overlaps nothing).
  void hold(uint64_t start, uint64_t n, T held = T{}) {
    live_.push_back(Range{start, start + n, std::move(held)});
    head_ = start + n;
    held_ += n;
    if (held_ > high_water_) high_water_ = held_;
  }
  bool empty() const { return live_.empty(); }
  Range& oldest() { return live_.front(); }
  std::deque<Range>& live() { return live_; }
  void release_oldest() {
    held_ -= live_.front().end - live_.front().start;
    live_.pop_front();
  }
  uint64_t held() const { return held_; }
  uint64_t high_water() const { return high_water_; }

 private:
  uint64_t size_;
  uint64_t head_ = 0;
  uint64_t held_ = 0;
  uint64_t high_water_ = 0;
  std::deque<Range> live_;
};

}  // namespace fabric::weights
