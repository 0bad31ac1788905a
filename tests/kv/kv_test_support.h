// Shared by the KV tests and their peer process: a small model geometry, the reference
// contents of a cache, and one rank (engine + registered cache) of either role.
#pragma once

#include <cstring>
#include <memory>
#include <vector>

#include "fabric/kv/flow.h"
#include "test_support.h"

namespace fabric::kv::testing {

// 4 layers of 8 pages of 4 tokens, 4 KV heads of 16 bytes, K and V.
inline KvLayout test_layout(uint32_t tp, uint32_t rank, uint32_t pages = 8) {
  KvLayout l;
  l.num_layers = 4;
  l.num_pages = pages;
  l.tokens_per_page = 4;
  l.num_kv_heads = 4;
  l.head_bytes = 16;
  l.tp_size = tp;
  l.tp_rank = rank;
  return l;
}

// Byte b of token t of head h of part p of logical page k of layer l of request `seed`.
inline uint8_t ref_byte(uint64_t seed, uint32_t l, uint32_t k, uint32_t p, uint32_t h, uint32_t t,
                        uint32_t b) {
  return static_cast<uint8_t>(1 +
                              (seed * 97 + l * 131 + k * 71 + p * 37 + h * 17 + t * 5 + b) % 251);
}

// Writes request `seed`'s logical pages into `pages` of a cache laid out as L.
inline void fill_request(const KvLayout& L, std::byte* base, const std::vector<uint32_t>& pages,
                         uint64_t seed) {
  for (uint32_t l = 0; l < L.num_layers; ++l)
    for (uint32_t k = 0; k < pages.size(); ++k)
      for (uint32_t p = 0; p < L.parts(); ++p)
        for (uint32_t h = L.first_head(); h < L.first_head() + L.local_heads(); ++h)
          for (uint32_t t = 0; t < L.tokens_per_page; ++t)
            for (uint32_t b = 0; b < L.head_bytes; ++b)
              base[L.page_offset(l, pages[k]) + L.head_offset(p, h) + t * L.head_bytes + b] =
                  std::byte{ref_byte(seed, l, k, p, h, t, b)};
}

// Whether `pages` of the cache hold request `seed` exactly; the first mismatch in `where`.
inline bool check_request(const KvLayout& L, const std::byte* base,
                          const std::vector<uint32_t>& pages, uint64_t seed, std::string* where) {
  for (uint32_t l = 0; l < L.num_layers; ++l)
    for (uint32_t k = 0; k < pages.size(); ++k)
      for (uint32_t p = 0; p < L.parts(); ++p)
        for (uint32_t h = L.first_head(); h < L.first_head() + L.local_heads(); ++h)
          for (uint32_t t = 0; t < L.tokens_per_page; ++t)
            for (uint32_t b = 0; b < L.head_bytes; ++b) {
              auto got = static_cast<uint8_t>(
                  base[L.page_offset(l, pages[k]) + L.head_offset(p, h) + t * L.head_bytes + b]);
              if (got != ref_byte(seed, l, k, p, h, t, b)) {
                if (where)
                  *where = "layer " + std::to_string(l) + " page " + std::to_string(pages[k]) +
                           " part " + std::to_string(p) + " head " + std::to_string(h) + " token " +
                           std::to_string(t) + " byte " + std::to_string(b);
                return false;
              }
            }
  return true;
}

// One rank: an engine and its registered cache.
struct Rank {
  std::unique_ptr<TransferEngine> engine;
  KvLayout layout;
  std::vector<std::byte> cache;
  Registration reg;
};

inline Result<std::unique_ptr<Rank>> make_rank(const Config& config, const KvLayout& layout) {
  auto e = TransferEngine::create(config);
  if (!e) return e.status();
  auto r = std::make_unique<Rank>();
  r->engine = std::move(*e);
  r->layout = layout;
  r->cache.assign(layout.region_bytes(), std::byte{0});
  auto reg = r->engine->register_memory(r->cache.data(), r->cache.size());
  if (!reg) return reg.status();
  r->reg = *reg;
  return r;
}

}  // namespace fabric::kv::testing
