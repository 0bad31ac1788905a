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

}  // namespace fabric::weights::device
