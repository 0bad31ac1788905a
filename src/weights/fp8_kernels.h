// The FP8 block quantiser's launcher, in the C++17 that nvcc compiles here: no fabric headers.
// fp8_cuda.cc wraps it in weights_projection.h's quantize_fp8_blocks_cuda.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fabric::weights::device {

// Enqueues one block per block x block tile on `stream`; `tile_cols` = ceil(cols / block).
cudaError_t launch_quantize_fp8_blocks(const void* bf16, uint64_t rows, uint64_t cols,
                                       uint32_t block, uint64_t tiles, uint64_t tile_cols,
                                       void* out, float* scales, cudaStream_t stream);

// One matrix of a grouped launch.
struct Fp8GroupMatrix {
  const void* bf16;
  uint64_t rows, cols;
  void* out;
  float* scales;
};

// Enqueues the matrices' tiles (rows and cols non-zero, at most 64 matrices, and at most
// 2^31 - 1 tiles in all) in one launch on `stream`.
cudaError_t launch_quantize_fp8_group(const Fp8GroupMatrix* matrices, uint32_t count,
                                      uint32_t block, cudaStream_t stream);
constexpr uint32_t kMaxFp8GroupMatrices = 64;

}  // namespace fabric::weights::device
