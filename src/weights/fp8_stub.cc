// Builds without CUDA: the FP8 kernel is not there (the CPU reference is).
#include "fabric/weights_projection.h"

namespace fabric::weights {

Status quantize_fp8_blocks_cuda(const void*, uint64_t, uint64_t, uint32_t, void*, float*, void*) {
  return Status(ErrorCode::kUnsupported,
                "quantize_fp8_blocks_cuda: this build of fabric-lib has no CUDA");
}

Status quantize_fp8_blocks_cuda_many(std::span<const Fp8Matrix>, uint32_t, void*) {
  return Status(ErrorCode::kUnsupported,
                "quantize_fp8_blocks_cuda_many: this build of fabric-lib has no CUDA");
}

bool has_cuda_projections() {
  return false;
}

Status copy_2d_cuda(void*, uint64_t, const void*, uint64_t, uint64_t, uint64_t, void*) {
  return Status(ErrorCode::kUnsupported, "copy_2d_cuda: this build of fabric-lib has no CUDA");
}

Status synchronize_cuda(void*) {
  return Status(ErrorCode::kUnsupported, "synchronize_cuda: this build of fabric-lib has no CUDA");
}

}  // namespace fabric::weights
