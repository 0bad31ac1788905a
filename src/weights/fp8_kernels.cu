// The host launcher of the FP8 block quantiser; device code in fp8_kernels.cuh.
#include "weights/fp8_kernels.cuh"
#include "weights/fp8_kernels.h"

namespace fabric::weights::device {

cudaError_t launch_quantize_fp8_blocks(const void* bf16, uint64_t rows, uint64_t cols,
                                       uint32_t block, uint64_t tiles, uint64_t tile_cols,
                                       void* out, float* scales, cudaStream_t stream) {
  // 16-byte loads and 8-byte stores where every row and tile starts aligned for them.
  const bool vectorised = cols % kGroupCols == 0 && block % kGroupCols == 0 &&
                          reinterpret_cast<uintptr_t>(bf16) % 16 == 0 &&
                          reinterpret_cast<uintptr_t>(out) % 8 == 0;
  quantize_fp8_blocks<<<static_cast<unsigned>(tiles), kQuantThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(bf16), rows, cols, block, tile_cols, vectorised,
      static_cast<__nv_fp8_storage_t*>(out), scales);
  return cudaGetLastError();
}

}  // namespace fabric::weights::device
