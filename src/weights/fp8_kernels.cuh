// Device code of the FP8 block quantiser (weights_projection.h): one CUDA block per tile.
// C++17 (what nvcc compiles here): no fabric headers but the device code of cuda/grid_search.cuh.
//
// Bit-exact with quantize_fp8_blocks_cpu: the tile's amax is exact whatever the reduction
// order (max is), scale = amax / 448 and x / scale are IEEE divisions (__fdiv_rn, whatever the
// flags), and the hardware conversion rounds to nearest even and saturates as float_to_e4m3
// does. Threads cover a tile as 16 rows x 16 column groups of 8 elements: where the matrix's
// rows allow it (cols a multiple of 8, pointers 16- and 8-byte aligned) each thread loads 8
// bf16 in one 16-byte load and stores 8 e4m3 in one 8-byte store; otherwise element by element.
// Two passes over the tile (amax, then quantise); the second reads what the first brought into
// L1/L2.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "cuda/grid_search.cuh"

namespace fabric::weights::device {

constexpr int kQuantThreads = 256;
constexpr int kGroupCols = 8;                             // elements per thread per row step
constexpr int kColThreads = 16;                           // threads across a row
constexpr int kRowThreads = kQuantThreads / kColThreads;  // rows per step
constexpr float kE4M3Max = 448.0f;

// Whether a matrix's rows allow 16-byte loads and 8-byte stores: every row and tile starts
// aligned for them.
__host__ inline bool vectorisable(const void* in, const void* out, uint64_t cols, uint32_t block) {
  return cols % kGroupCols == 0 && block % kGroupCols == 0 &&
         reinterpret_cast<uintptr_t>(in) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 8 == 0;
}

__device__ __forceinline__ uint8_t quantize_one(float x, float scale) {
  const float q = fminf(fmaxf(__fdiv_rn(x, scale), -kE4M3Max), kE4M3Max);
  return __nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3);
}

// One tile of one matrix, by one block of kQuantThreads threads.
__device__ __forceinline__ void quantize_tile(const __nv_bfloat16* __restrict__ in, uint64_t rows,
                                              uint64_t cols, uint32_t block, uint64_t tile_cols,
                                              bool vectorised, __nv_fp8_storage_t* __restrict__ out,
                                              float* __restrict__ scales, uint64_t tile) {
  __shared__ float warp_max[kQuantThreads / 32];
  const uint64_t r0 = tile / tile_cols * block, c0 = tile % tile_cols * block;
  const uint32_t h = static_cast<uint32_t>(min(static_cast<uint64_t>(block), rows - r0));
  const uint32_t w = static_cast<uint32_t>(min(static_cast<uint64_t>(block), cols - c0));
  const uint32_t tx = threadIdx.x % kColThreads, ty = threadIdx.x / kColThreads;

  float amax = 0.0f;
  for (uint32_t r = ty; r < h; r += kRowThreads) {
    const __nv_bfloat16* row = in + (r0 + r) * cols + c0;
    if (vectorised) {
      for (uint32_t c = tx * kGroupCols; c < w; c += kColThreads * kGroupCols) {
        const uint4 v = *reinterpret_cast<const uint4*>(row + c);
        const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&v);
        for (int k = 0; k < kGroupCols; ++k) amax = fmaxf(amax, fabsf(__bfloat162float(e[k])));
      }
    } else {
      for (uint32_t c = tx; c < w; c += kColThreads) {
        amax = fmaxf(amax, fabsf(__bfloat162float(row[c])));
      }
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  }
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = warp_max[0];
  for (int i = 1; i < kQuantThreads / 32; ++i) amax = fmaxf(amax, warp_max[i]);
  const float scale = amax > 0.0f ? __fdiv_rn(amax, kE4M3Max) : 1.0f;
  if (threadIdx.x == 0) scales[tile] = scale;

  for (uint32_t r = ty; r < h; r += kRowThreads) {
    const __nv_bfloat16* row = in + (r0 + r) * cols + c0;
    __nv_fp8_storage_t* dst = out + (r0 + r) * cols + c0;
    if (vectorised) {
      for (uint32_t c = tx * kGroupCols; c < w; c += kColThreads * kGroupCols) {
        const uint4 v = *reinterpret_cast<const uint4*>(row + c);
        const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&v);
        uint2 packed;
        uint8_t* b = reinterpret_cast<uint8_t*>(&packed);
        for (int k = 0; k < kGroupCols; ++k) b[k] = quantize_one(__bfloat162float(e[k]), scale);
        *reinterpret_cast<uint2*>(dst + c) = packed;
      }
    } else {
      for (uint32_t c = tx; c < w; c += kColThreads) {
        dst[c] = quantize_one(__bfloat162float(row[c]), scale);
      }
    }
  }
}

__global__ void __launch_bounds__(kQuantThreads)
    quantize_fp8_blocks(const __nv_bfloat16* __restrict__ in, uint64_t rows, uint64_t cols,
                        uint32_t block, uint64_t tile_cols, bool vectorised,
                        __nv_fp8_storage_t* __restrict__ out, float* __restrict__ scales) {
  quantize_tile(in, rows, cols, block, tile_cols, vectorised, out, scales, blockIdx.x);
}

// Several matrices in one launch (the many small projections of a model stored per expert):
// their tiles numbered one after another, each block finds its matrix by its first tile. The
// table travels as the kernel's parameter (kMaxGroupJobs x 48 bytes, under the 4 KiB limit).
constexpr int kMaxGroupJobs = 64;

struct GroupJob {
  const __nv_bfloat16* in;
  __nv_fp8_storage_t* out;
  float* scales;
  uint64_t rows, cols;
  uint32_t tile_cols;  // ceil(cols / block)
  uint32_t vectorised;
};

struct GroupTable {
  GroupJob jobs[kMaxGroupJobs];
  uint64_t first_tile[kMaxGroupJobs + 1];  // job j's tiles: [first_tile[j], first_tile[j + 1])
  uint32_t count;
};

__global__ void __launch_bounds__(kQuantThreads)
    quantize_fp8_group(const __grid_constant__ GroupTable table, uint32_t block) {
  const uint64_t tile = blockIdx.x;
  const uint32_t lo = cuda::device::piece_of(table.first_tile, table.count, tile);
  const GroupJob& j = table.jobs[lo];
  quantize_tile(j.in, j.rows, j.cols, block, j.tile_cols, j.vectorised != 0, j.out, j.scales,
                tile - table.first_tile[lo]);
}

}  // namespace fabric::weights::device
