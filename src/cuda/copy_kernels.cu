// Device side of launch_batch_copy (cuda/copy_kernels.h).
#include <cstring>

#include "cuda/copy_kernels.h"
#include "cuda/grid_search.cuh"

namespace fabric::cuda {

namespace {

// Each thread block copies one chunk of kChunkBytes (or a range's shorter tail): every thread
// loads kUnroll 16-byte words before it stores any, so that a block keeps 16 KiB of reads in
// flight. Reads of a peer GPU's memory over NVLink take microseconds each: a thread that waited
// for each load before the next one would leave the link mostly idle.
constexpr uint32_t kThreads = 256;
constexpr uint32_t kUnroll = 4;
constexpr uint64_t kChunkBytes = uint64_t{kThreads} * kUnroll * 16;

// The launch's parameter: the ranges and, per range, its first block (a prefix sum; entry n is
// the grid's size). A few capacities, so that a launch of a few ranges passes a few hundred
// bytes, not the 28 KiB of a full batch.
template <uint32_t kCap>
struct Batch {
  uint32_t n;
  uint32_t first_block[kCap + 1];
  CopyRange ranges[kCap];
};
static_assert(sizeof(Batch<kMaxBatchRanges>) <= 32764, "a kernel parameter of CUDA 12.1+");

template <uint32_t kCap>
__global__ void __launch_bounds__(kThreads) batch_copy(const __grid_constant__ Batch<kCap> b) {
  // The range holding this block: the last one whose first block is at or before it.
  const uint32_t block = blockIdx.x;
  const uint32_t lo = device::piece_of(b.first_block, b.n, block);
  const CopyRange& r = b.ranges[lo];
  const uint64_t begin = uint64_t{block - b.first_block[lo]} * kChunkBytes;
  if (begin >= r.bytes) return;
  const uint64_t n = r.bytes - begin < kChunkBytes ? r.bytes - begin : kChunkBytes;
  auto* d = static_cast<uint8_t*>(r.dst) + begin;
  const auto* s = static_cast<const uint8_t*>(r.src) + begin;
  if (((reinterpret_cast<uintptr_t>(d) | reinterpret_cast<uintptr_t>(s) | n) & 15) == 0) {
    auto* dv = reinterpret_cast<uint4*>(d);
    const auto* sv = reinterpret_cast<const uint4*>(s);
    const uint64_t words = n / 16;
    uint4 v[kUnroll];
#pragma unroll
    for (uint32_t k = 0; k < kUnroll; ++k) {
      const uint64_t i = threadIdx.x + uint64_t{k} * kThreads;
      if (i < words) v[k] = sv[i];
    }
#pragma unroll
    for (uint32_t k = 0; k < kUnroll; ++k) {
      const uint64_t i = threadIdx.x + uint64_t{k} * kThreads;
      if (i < words) dv[i] = v[k];
    }
  } else {
    for (uint64_t k = threadIdx.x; k < n; k += kThreads) d[k] = s[k];
  }
}

template <uint32_t kCap>
cudaError_t launch(const CopyRange* ranges, uint32_t n, cudaStream_t stream) {
  static thread_local Batch<kCap> b;  // up to 28 KiB: not on the caller's stack
  b.n = n;
  uint64_t blocks = 0;
  for (uint32_t i = 0; i < n; ++i) {
    b.first_block[i] = static_cast<uint32_t>(blocks);
    b.ranges[i] = ranges[i];
    blocks += ranges[i].bytes == 0 ? 1 : (ranges[i].bytes + kChunkBytes - 1) / kChunkBytes;
  }
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  b.first_block[n] = static_cast<uint32_t>(blocks);
  batch_copy<kCap><<<static_cast<uint32_t>(blocks), kThreads, 0, stream>>>(b);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_batch_copy(const CopyRange* ranges, uint32_t n, cudaStream_t stream) {
  if (n == 0 || n > kMaxBatchRanges) return cudaErrorInvalidValue;
  if (n <= 4) return launch<4>(ranges, n, stream);
  if (n <= 64) return launch<64>(ranges, n, stream);
  return launch<kMaxBatchRanges>(ranges, n, stream);
}

}  // namespace fabric::cuda
