// Device side of launch_batch_copy (cuda/copy_kernels.h).
#include <cstring>

#include "cuda/copy_kernels.h"

namespace fabric::cuda {

namespace {

struct Batch {
  uint32_t n;
  CopyRange ranges[kMaxBatchRanges];
};
static_assert(sizeof(Batch) <= 32764, "a kernel parameter of CUDA 12.1 and later");

__global__ void batch_copy(const __grid_constant__ Batch b) {
  for (uint32_t i = blockIdx.x; i < b.n; i += gridDim.x) {
    auto* d = static_cast<uint8_t*>(b.ranges[i].dst);
    const auto* s = static_cast<const uint8_t*>(b.ranges[i].src);
    const uint64_t n = b.ranges[i].bytes;
    if (((reinterpret_cast<uintptr_t>(d) | reinterpret_cast<uintptr_t>(s) | n) & 15) == 0) {
      auto* dv = reinterpret_cast<uint4*>(d);
      const auto* sv = reinterpret_cast<const uint4*>(s);
      for (uint64_t k = threadIdx.x; k < n / 16; k += blockDim.x) dv[k] = sv[k];
    } else {
      for (uint64_t k = threadIdx.x; k < n; k += blockDim.x) d[k] = s[k];
    }
  }
}

}  // namespace

cudaError_t launch_batch_copy(const CopyRange* ranges, uint32_t n, cudaStream_t stream) {
  if (n == 0 || n > kMaxBatchRanges) return cudaErrorInvalidValue;
  static thread_local Batch b;  // 24 KiB: not on the caller's stack
  b.n = n;
  std::memcpy(b.ranges, ranges, n * sizeof(CopyRange));
  batch_copy<<<n, 256, 0, stream>>>(b);
  return cudaGetLastError();
}

}  // namespace fabric::cuda
