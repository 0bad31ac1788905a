// Dtypes, shapes and the projected shape of each projection kind.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "fabric/weights.h"

namespace fabric::weights {

uint32_t element_bytes(DType dtype) {
  switch (dtype) {
    case DType::kUInt8:
    case DType::kFloat8E4M3:
      return 1;
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
    case DType::kFloat32:
      return 4;
  }
  return 0;
}

std::string_view to_string(DType dtype) {
  switch (dtype) {
    case DType::kUInt8:
      return "u8";
    case DType::kBFloat16:
      return "bf16";
    case DType::kFloat16:
      return "f16";
    case DType::kFloat32:
      return "f32";
    case DType::kFloat8E4M3:
      return "fp8_e4m3";
  }
  return "?";
}

Result<DType> parse_dtype(std::string_view name) {
  for (DType d :
       {DType::kUInt8, DType::kBFloat16, DType::kFloat16, DType::kFloat32, DType::kFloat8E4M3}) {
    if (to_string(d) == name) return d;
  }
  return Status(ErrorCode::kInvalidArgument,
                fmt::format("unknown dtype '{}' (u8, bf16, f16, f32, fp8_e4m3)", name));
}

std::string_view to_string(ProjectionKind kind) {
  switch (kind) {
    case ProjectionKind::kIdentity:
      return "identity";
    case ProjectionKind::kConcat:
      return "concat";
    case ProjectionKind::kFp8Quantize:
      return "fp8_quantize";
    case ProjectionKind::kFp8Scale:
      return "fp8_scale";
  }
  return "?";
}

uint64_t num_elements(const Shape& shape) {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

uint64_t local_bytes(const InferenceParam& param) {
  uint64_t n = num_elements(param.shape);
  if (param.placement.dim >= 0 && static_cast<size_t>(param.placement.dim) < param.shape.size()) {
    const uint64_t full = param.shape[static_cast<size_t>(param.placement.dim)];
    n = full == 0 ? 0 : n / full * param.placement.range.length;
  }
  return n * element_bytes(param.dtype);
}

Result<Shape> projected_shape(std::string_view name, const Projection& projection,
                              const std::vector<Shape>& source_shapes) {
  auto bad = [&](std::string what) {
    return Status(ErrorCode::kInvalidArgument, fmt::format("parameter '{}': {} projection: {}",
                                                           name, to_string(projection.kind), what));
  };
  if (source_shapes.empty()) return bad("no sources");
  // Several sources are concatenated along `dim` (kConcat's result; the FP8 kinds quantise it).
  Shape input = source_shapes[0];
  if (source_shapes.size() > 1) {
    if (projection.kind == ProjectionKind::kIdentity) return bad("takes exactly one source");
    const Shape& first = source_shapes[0];
    if (projection.dim >= first.size()) {
      return bad(
          fmt::format("dim {} outside the sources' {} dimensions", projection.dim, first.size()));
    }
    input[projection.dim] = 0;
    for (size_t i = 0; i < source_shapes.size(); ++i) {
      const Shape& s = source_shapes[i];
      bool same = s.size() == first.size();
      for (size_t d = 0; same && d < s.size(); ++d) same = d == projection.dim || s[d] == first[d];
      if (!same) {
        return bad(
            fmt::format("source {} has shape [{}], which does not stack with [{}] along dim {}", i,
                        fmt::join(s, ", "), fmt::join(first, ", "), projection.dim));
      }
      input[projection.dim] += s[projection.dim];
    }
  } else if (projection.kind == ProjectionKind::kConcat && projection.dim >= input.size()) {
    return bad(
        fmt::format("dim {} outside the sources' {} dimensions", projection.dim, input.size()));
  }
  switch (projection.kind) {
    case ProjectionKind::kIdentity:
    case ProjectionKind::kConcat:
      return input;
    case ProjectionKind::kFp8Quantize:
    case ProjectionKind::kFp8Scale: {
      if (input.size() != 2) {
        return bad(fmt::format("needs a 2-D {}, got [{}]",
                               source_shapes.size() > 1 ? "concatenation" : "source",
                               fmt::join(input, ", ")));
      }
      if (projection.block == 0) return bad("block is 0");
      if (projection.kind == ProjectionKind::kFp8Quantize) return input;
      const uint64_t b = projection.block;
      return Shape{(input[0] + b - 1) / b, (input[1] + b - 1) / b};
    }
  }
  return bad("unknown kind");
}

}  // namespace fabric::weights
