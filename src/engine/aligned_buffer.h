// Buffers the worker registers on its NICs (scratch, send and receive pools): allocated with
// std::aligned_alloc, freed with std::free.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>

namespace fabric::engine {

inline constexpr size_t kBufferAlignment = 64;

inline uint64_t round_up(uint64_t n, uint64_t to) {
  return (n + to - 1) / to * to;
}

struct AlignedFree {
  void operator()(std::byte* p) const noexcept { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<std::byte, AlignedFree>;

}  // namespace fabric::engine
