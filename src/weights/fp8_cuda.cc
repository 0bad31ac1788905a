// quantize_fp8_blocks_cuda (weights_projection.h) in CUDA builds: checks, then the launcher.
#include <fmt/format.h>

#include "cuda/cuda_status.h"
#include "fabric/weights_projection.h"
#include "weights/fp8_kernels.h"

namespace fabric::weights {

Status quantize_fp8_blocks_cuda(const void* bf16, uint64_t rows, uint64_t cols, uint32_t block,
                                void* out, float* scales, void* stream) {
  if (block == 0) return Status(ErrorCode::kInvalidArgument, "quantize_fp8: block is 0");
  if (rows == 0 || cols == 0) return Status::ok();
  const Shape tiles = fp8_scale_shape(rows, cols, block);
  const uint64_t grid = tiles[0] * tiles[1];
  if (grid > 0x7fffffffu) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("quantize_fp8: {} tiles exceed one launch", grid));
  }
  const cudaError_t err = device::launch_quantize_fp8_blocks(
      bf16, rows, cols, block, grid, tiles[1], out, scales, static_cast<cudaStream_t>(stream));
  if (err != cudaSuccess) {
    Status s = cuda::cuda_error("quantize_fp8 launch", err);
    return Status(s.code() == ErrorCode::kUnsupported ? s.code() : ErrorCode::kInternal,
                  s.message());
  }
  return Status::ok();
}

bool has_cuda_projections() {
  return true;
}

}  // namespace fabric::weights
