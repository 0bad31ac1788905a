// Device code of the FP8 block quantiser (weights_projection.h): one CUDA block per tile.
// C++17 (what nvcc compiles here): no fabric headers.
// Bit-exact with quantize_fp8_blocks_cpu: the tile's amax is exact whatever the reduction
// order (max is), scale = amax / 448 and x / scale are IEEE divisions (no fast-math), and the
// hardware conversion rounds to nearest even and saturates as float_to_e4m3 does.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace fabric::weights::device {

constexpr int kQuantThreads = 256;
constexpr float kE4M3Max = 448.0f;

__global__ void __launch_bounds__(kQuantThreads)
    quantize_fp8_blocks(const __nv_bfloat16* __restrict__ in, uint64_t rows, uint64_t cols,
                        uint32_t block, uint64_t tile_cols, __nv_fp8_storage_t* __restrict__ out,
                        float* __restrict__ scales) {
  __shared__ float warp_max[kQuantThreads / 32];
  const uint64_t tile = blockIdx.x;
  const uint64_t r0 = tile / tile_cols * block, c0 = tile % tile_cols * block;
  const uint64_t h = min(static_cast<uint64_t>(block), rows - r0);
  const uint64_t w = min(static_cast<uint64_t>(block), cols - c0);
  const uint64_t n = h * w;

  float amax = 0.0f;
  for (uint64_t i = threadIdx.x; i < n; i += kQuantThreads) {
    const uint64_t at = (r0 + i / w) * cols + c0 + i % w;
    amax = fmaxf(amax, fabsf(__bfloat162float(in[at])));
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

  for (uint64_t i = threadIdx.x; i < n; i += kQuantThreads) {
    const uint64_t at = (r0 + i / w) * cols + c0 + i % w;
    const float q = fminf(fmaxf(__fdiv_rn(__bfloat162float(in[at]), scale), -kE4M3Max), kE4M3Max);
    out[at] = __nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3);
  }
}

}  // namespace fabric::weights::device
