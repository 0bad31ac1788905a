// Device code shared by the kernels that take a table of pieces in one launch (the CUDA IPC
// batch copy, the grouped FP8 quantiser): which piece a CUDA block works on. C++17, no fabric
// headers (what nvcc compiles here).
#pragma once

#include <cstdint>

namespace fabric::cuda::device {

// The index of the last of `first[0..n)` (ascending, first[0] == 0) at or before `x`.
template <typename T>
__device__ __forceinline__ uint32_t piece_of(const T* first, uint32_t n, T x) {
  uint32_t lo = 0, hi = n;
  while (hi - lo > 1) {
    const uint32_t mid = (lo + hi) / 2;
    if (first[mid] <= x) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

}  // namespace fabric::cuda::device
