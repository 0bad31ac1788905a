// quantize_fp8_blocks_cuda (weights_projection.h) in CUDA builds: checks, then the launcher;
// the copies and the stream synchronisation of the push's projections.
#include <fmt/format.h>

#include <vector>

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

Status quantize_fp8_blocks_cuda_many(std::span<const Fp8Matrix> matrices, uint32_t block,
                                     void* stream) {
  if (block == 0) return Status(ErrorCode::kInvalidArgument, "quantize_fp8: block is 0");
  std::vector<device::Fp8GroupMatrix> group;
  uint64_t tiles = 0;
  auto launch = [&]() -> Status {
    const cudaError_t err =
        device::launch_quantize_fp8_group(group.data(), static_cast<uint32_t>(group.size()), block,
                                          static_cast<cudaStream_t>(stream));
    group.clear();
    tiles = 0;
    if (err != cudaSuccess) {
      Status s = cuda::cuda_error("quantize_fp8 launch", err);
      return Status(s.code() == ErrorCode::kUnsupported ? s.code() : ErrorCode::kInternal,
                    s.message());
    }
    return Status::ok();
  };
  for (const Fp8Matrix& m : matrices) {
    if (m.rows == 0 || m.cols == 0) continue;
    const Shape t = fp8_scale_shape(m.rows, m.cols, block);
    const uint64_t n = t[0] * t[1];
    if (n > 0x7fffffffu) {
      return Status(ErrorCode::kInvalidArgument,
                    fmt::format("quantize_fp8: {} tiles exceed one launch", n));
    }
    if (group.size() == device::kMaxFp8GroupMatrices || tiles + n > 0x7fffffffu) {
      if (Status s = launch(); !s) return s;
    }
    group.push_back({m.bf16, m.rows, m.cols, m.out, m.scales});
    tiles += n;
  }
  return group.empty() ? Status::ok() : launch();
}

bool has_cuda_projections() {
  return true;
}

namespace {
Status internal(std::string_view what, cudaError_t err) {
  Status s = cuda::cuda_error(what, err);
  return Status(s.code() == ErrorCode::kUnsupported ? s.code() : ErrorCode::kInternal, s.message());
}
}  // namespace

Status copy_2d_cuda(void* dst, uint64_t dst_pitch, const void* src, uint64_t src_pitch,
                    uint64_t width, uint64_t height, void* stream) {
  if (width == 0 || height == 0) return Status::ok();
  const auto s = static_cast<cudaStream_t>(stream);
  const cudaError_t err = height == 1 ? cudaMemcpyAsync(dst, src, width, cudaMemcpyDefault, s)
                                      : cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width,
                                                          height, cudaMemcpyDefault, s);
  return err == cudaSuccess ? Status::ok() : internal("weights copy", err);
}

Status synchronize_cuda(void* stream) {
  const cudaError_t err = cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
  return err == cudaSuccess ? Status::ok() : internal("weights stream synchronize", err);
}

}  // namespace fabric::weights
