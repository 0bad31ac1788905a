// The CPU reference of each projection (fabric/weights_projection.h).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/invalid.h"
#include "fabric/weights_projection.h"

namespace fabric::weights {
using fabric::invalid;  // common/invalid.h

uint8_t float_to_e4m3(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const auto sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return 0x7f;  // NaN
  if (std::fabs(value) >= kFp8E4M3Max) return sign | 0x7e;
  const int exponent = static_cast<int>(magnitude >> 23) - 127;
  if (exponent < -6) {
    // Below the smallest normal (2^-6): multiples of 2^-9. a * 512 is exact; round half even.
    const float scaled = std::fabs(value) * 512.0f;
    auto q = static_cast<uint32_t>(scaled);
    const float rest = scaled - static_cast<float>(q);
    if (rest > 0.5f || (rest == 0.5f && (q & 1))) ++q;
    return sign | static_cast<uint8_t>(q);  // q == 8 is the smallest normal's encoding
  }
  // Normal: rebias the exponent (7) and keep 3 of the 23 mantissa bits, ties to even. A carry
  // out of the mantissa moves to the next exponent, which the encoding does by itself.
  uint32_t r = (static_cast<uint32_t>(exponent + 7) << 23) | (magnitude & 0x7fffffu);
  r += 0x7ffffu + ((r >> 20) & 1);
  return sign | static_cast<uint8_t>(std::min<uint32_t>(r >> 20, 0x7e));
}

float e4m3_to_float(uint8_t bits) {
  const float sign = (bits & 0x80) ? -1.0f : 1.0f;
  const int exponent = (bits >> 3) & 0xf;
  const int mantissa = bits & 0x7;
  if (exponent == 0xf && mantissa == 0x7) return std::nanf("");
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -9);
  return sign * std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
}

Shape fp8_scale_shape(uint64_t rows, uint64_t cols, uint32_t block) {
  if (block == 0) return {0, 0};
  return {(rows + block - 1) / block, (cols + block - 1) / block};
}

Status quantize_fp8_blocks_cpu(std::span<const uint16_t> bf16, uint64_t rows, uint64_t cols,
                               uint32_t block, std::span<uint8_t> out, std::span<float> scales) {
  if (block == 0) return invalid("quantize_fp8: block is 0");
  if (bf16.size() != rows * cols) {
    return invalid(fmt::format("quantize_fp8: input has {} elements, not rows * cols = {}",
                               bf16.size(), rows * cols));
  }
  if (out.size() != rows * cols) {
    return invalid(fmt::format("quantize_fp8: out has {} bytes, not {}", out.size(), rows * cols));
  }
  const Shape tiles = fp8_scale_shape(rows, cols, block);
  if (scales.size() != tiles[0] * tiles[1]) {
    return invalid(fmt::format("quantize_fp8: scales has {} elements, not {} x {}", scales.size(),
                               tiles[0], tiles[1]));
  }
  for (uint64_t ti = 0; ti < tiles[0]; ++ti) {
    for (uint64_t tj = 0; tj < tiles[1]; ++tj) {
      const uint64_t r0 = ti * block, r1 = std::min<uint64_t>(rows, r0 + block);
      const uint64_t c0 = tj * block, c1 = std::min<uint64_t>(cols, c0 + block);
      float amax = 0.0f;
      for (uint64_t r = r0; r < r1; ++r) {
        for (uint64_t c = c0; c < c1; ++c) {
          amax = std::max(amax, std::fabs(bf16_to_float(bf16[r * cols + c])));
        }
      }
      const float scale = amax > 0.0f ? amax / kFp8E4M3Max : 1.0f;
      scales[ti * tiles[1] + tj] = scale;
      for (uint64_t r = r0; r < r1; ++r) {
        for (uint64_t c = c0; c < c1; ++c) {
          const float q =
              std::clamp(bf16_to_float(bf16[r * cols + c]) / scale, -kFp8E4M3Max, kFp8E4M3Max);
          out[r * cols + c] = float_to_e4m3(q);
        }
      }
    }
  }
  return Status::ok();
}

Status concat_cpu(const std::vector<std::span<const std::byte>>& sources,
                  const std::vector<Shape>& shapes, uint32_t dim, uint32_t element_bytes,
                  std::span<std::byte> out) {
  if (sources.size() != shapes.size() || sources.empty()) {
    return invalid("concat: one shape per source, and at least one source");
  }
  auto shape = projected_shape("concat", Projection{ProjectionKind::kConcat, {}, dim, 128}, shapes);
  if (!shape) return shape.status();
  uint64_t outer = 1, inner = element_bytes;
  for (uint32_t d = 0; d < dim; ++d) outer *= (*shape)[d];
  for (size_t d = dim + 1; d < shape->size(); ++d) inner *= (*shape)[d];
  if (out.size() != num_elements(*shape) * element_bytes) {
    return invalid(fmt::format("concat: out has {} bytes, not {}", out.size(),
                               num_elements(*shape) * element_bytes));
  }
  const uint64_t out_row = (*shape)[dim] * inner;
  uint64_t at = 0;  // where this source's block starts within an output row
  for (size_t i = 0; i < sources.size(); ++i) {
    const uint64_t row = shapes[i][dim] * inner;
    if (sources[i].size() != outer * row) {
      return invalid(
          fmt::format("concat: source {} has {} bytes, not {}", i, sources[i].size(), outer * row));
    }
    for (uint64_t o = 0; o < outer; ++o) {
      if (row) std::memcpy(out.data() + o * out_row + at, sources[i].data() + o * row, row);
    }
    at += row;
  }
  return Status::ok();
}

}  // namespace fabric::weights
