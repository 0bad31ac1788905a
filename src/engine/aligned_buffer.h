// Buffers the worker registers on its NICs (scratch, send and receive pools): allocated with
// std::aligned_alloc, freed with std::free.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "common/align.h"

namespace fabric::engine {

inline constexpr size_t kBufferAlignment = 64;

using fabric::round_up;  // common/align.h

struct AlignedFree {
  void operator()(std::byte* p) const noexcept { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<std::byte, AlignedFree>;

}  // namespace fabric::engine
