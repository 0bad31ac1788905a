// The host launcher of the FP8 block quantiser; device code in fp8_kernels.cuh.
#include "weights/fp8_kernels.cuh"
#include "weights/fp8_kernels.h"

namespace fabric::weights::device {

cudaError_t launch_quantize_fp8_blocks(const void* bf16, uint64_t rows, uint64_t cols,
                                       uint32_t block, uint64_t tiles, uint64_t tile_cols,
                                       void* out, float* scales, cudaStream_t stream) {
  const bool vectorised = vectorisable(bf16, out, cols, block);
  quantize_fp8_blocks<<<static_cast<unsigned>(tiles), kQuantThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(bf16), rows, cols, block, tile_cols, vectorised,
      static_cast<__nv_fp8_storage_t*>(out), scales);
  return cudaGetLastError();
}

cudaError_t launch_quantize_fp8_group(const Fp8GroupMatrix* matrices, uint32_t count,
                                      uint32_t block, cudaStream_t stream) {
  static_assert(kMaxFp8GroupMatrices == kMaxGroupJobs);
  static_assert(sizeof(GroupTable) + sizeof(uint32_t) <= 4096, "a kernel parameter's limit");
  GroupTable table{};
  table.count = count;
  uint64_t tiles = 0;
  for (uint32_t i = 0; i < count; ++i) {
    const Fp8GroupMatrix& m = matrices[i];
    const uint64_t tile_rows = (m.rows + block - 1) / block,
                   tile_cols = (m.cols + block - 1) / block;
    table.jobs[i] = GroupJob{static_cast<const __nv_bfloat16*>(m.bf16),
                             static_cast<__nv_fp8_storage_t*>(m.out),
                             m.scales,
                             m.rows,
                             m.cols,
                             static_cast<uint32_t>(tile_cols),
                             vectorisable(m.bf16, m.out, m.cols, block)};
    table.first_tile[i] = tiles;
    tiles += tile_rows * tile_cols;
  }
  table.first_tile[count] = tiles;
  if (count == 0 || tiles == 0) return cudaSuccess;
  quantize_fp8_group<<<static_cast<unsigned>(tiles), kQuantThreads, 0, stream>>>(table, block);
  return cudaGetLastError();
}

}  // namespace fabric::weights::device
