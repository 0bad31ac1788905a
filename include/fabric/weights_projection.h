// fabric::weights projections: what a training rank applies to a gathered parameter before it
// writes it (fabric/weights.h names them in each parameter's Projection).
//
// The CPU functions are the reference: the pipeline uses them for host tensors and the tests
// check the CUDA kernel against them bit for bit. FP8 quantisation follows DeepSeek-V3's weight
// format: one float32 scale per block x block tile (128 x 128), scale = amax / 448 (1 for an
// all-zero tile), element = e4m3(clamp(x / scale, -448, 448)) rounded to nearest, ties to even;
// dequantised weight = element * scale.
//
// None of these block; bad sizes are kInvalidArgument with the field named.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "fabric/status.h"
#include "fabric/weights.h"

namespace fabric::weights {

inline constexpr float kFp8E4M3Max = 448.0f;

// Round to nearest even, saturating to +-448; NaN gives 0x7f.
uint8_t float_to_e4m3(float value);
float e4m3_to_float(uint8_t bits);
inline float bf16_to_float(uint16_t bits);

// Tiles of the scale tensor for a rows x cols weight: {ceil(rows / block), ceil(cols / block)}.
Shape fp8_scale_shape(uint64_t rows, uint64_t cols, uint32_t block);

// Quantises a rows x cols BF16 matrix (raw bf16 bits) into `out` (rows * cols bytes of e4m3)
// and `scales` (fp8_scale_shape's elements, row-major).
Status quantize_fp8_blocks_cpu(std::span<const uint16_t> bf16, uint64_t rows, uint64_t cols,
                               uint32_t block, std::span<uint8_t> out, std::span<float> scales);

// Concatenates row-major sources along `dim` into `out`. Each source's shape must match the
// others but for `dim`; `out` holds exactly the sum of their bytes.
Status concat_cpu(const std::vector<std::span<const std::byte>>& sources,
                  const std::vector<Shape>& shapes, uint32_t dim, uint32_t element_bytes,
                  std::span<std::byte> out);

// The CUDA kernel of quantize_fp8_blocks_cpu, bit-exact with it: device pointers, enqueued on
// `stream` (a cudaStream_t; nullptr is the legacy default stream), returns once enqueued.
// kUnsupported in a build without CUDA; a launch error is kInternal with CUDA's message.
Status quantize_fp8_blocks_cuda(const void* bf16, uint64_t rows, uint64_t cols, uint32_t block,
                                void* out, float* scales, void* stream);
// Several matrices' quantisations in as few launches as it takes (64 matrices a launch): the
// same bytes as quantize_fp8_blocks_cuda on each, for the many small parameters of a model
// stored one expert per tensor, where one launch per matrix costs more than its work.
struct Fp8Matrix {
  const void* bf16;  // rows x cols raw bf16 bits, device memory
  uint64_t rows = 0, cols = 0;
  void* out;      // rows * cols bytes of e4m3
  float* scales;  // fp8_scale_shape's elements
};
Status quantize_fp8_blocks_cuda_many(std::span<const Fp8Matrix> matrices, uint32_t block,
                                     void* stream);
// True in builds with the CUDA kernel.
bool has_cuda_projections();

// The copies of identity and concatenation projections on the GPU: `height` rows of `width`
// bytes from `src` (rows `src_pitch` apart) to `dst` (rows `dst_pitch` apart), either side host
// or device memory, enqueued on `stream` (a cudaStream_t); returns once enqueued (a pageable
// host side makes it synchronous). kUnsupported without CUDA; kInternal with CUDA's message.
Status copy_2d_cuda(void* dst, uint64_t dst_pitch, const void* src, uint64_t src_pitch,
                    uint64_t width, uint64_t height, void* stream);
// Waits until everything enqueued on `stream` has run. Blocks. kUnsupported without CUDA.
Status synchronize_cuda(void* stream);

inline float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  static_assert(sizeof(f) == sizeof(wide));
  __builtin_memcpy(&f, &wide, sizeof(f));
  return f;
}

}  // namespace fabric::weights
