// Rounding sizes and offsets up to an alignment (regions, areas and their parts).
#pragma once

#include <cstdint>

namespace fabric {

// `v` rounded up to a multiple of `to` (> 0).
constexpr uint64_t round_up(uint64_t v, uint64_t to) {
  return (v + to - 1) / to * to;
}

}  // namespace fabric
