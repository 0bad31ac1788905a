// Batched device-to-device copies in one kernel launch: the CUDA IPC path's owner copies the
// many small ranges of a paged write this way instead of one cudaMemcpyAsync each (on an H200,
// 512 pages of 4 KiB: 157 GB/s against 1.2 GB/s; of 64 KiB: 1147 against 19 GB/s, measured by
// fabric-bench-gpu with a kernel that reads uploaded page tables). Here the ranges travel as the
// kernel's parameter, so nothing is uploaded first.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fabric::cuda {

struct CopyRange {
  void* dst;
  const void* src;
  uint64_t bytes;
};

// Ranges one launch takes: its parameter is then about 28 KiB (CUDA 12.1 and later pass up
// to 32 764 bytes; launches of up to 4 or 64 ranges pass less).
inline constexpr uint32_t kMaxBatchRanges = 1024;

// Copies n (1..kMaxBatchRanges) ranges on `stream`, a thread block per 16 KiB of each range,
// in 16-byte words where both ends and the length allow it, else byte by byte.
cudaError_t launch_batch_copy(const CopyRange* ranges, uint32_t n, cudaStream_t stream);

}  // namespace fabric::cuda
