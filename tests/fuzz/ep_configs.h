// The all-to-all configurations behind the ep_handle seeds (make_seeds.cc) and the handles the
// target checks decoded peers against (ep_handle_fuzz.cc): one node of two fp8 ranks, and two
// nodes of two bf16 ranks (whose handles carry a proxy handle).
#pragma once

#include <cstdint>
#include <vector>

#include "ep/handle.h"
#include "fabric/ep.h"

namespace fabric::ep::fuzz {

inline std::vector<AllToAllConfig> configs() {
  // The first as DeepSeek-V3's decode (256 experts, top 8, fp8); gpus_per_node 0 is one node.
  return {{.world_size = 2,
           .num_experts = 256,
           .hidden = 7168,
           .top_k = 8,
           .max_tokens_per_rank = 128,
           .dtype = TokenDtype::kFp8E4m3,
           .nics = {}},
          {.world_size = 4,
           .gpus_per_node = 2,
           .num_experts = 64,
           .hidden = 4096,
           .top_k = 4,
           .max_tokens_per_rank = 64,
           .dtype = TokenDtype::kBf16,
           .nics = {}}};
}

// Rank `rank`'s handle under `c` (valid), as the rank would publish it from process `pid`.
inline PeerHandle handle(AllToAllConfig c, int rank, uint64_t pid) {
  c.rank = rank;
  PeerHandle h = make_handle(c, *Layout::of(c));
  h.pid = pid;
  for (size_t i = 0; i < h.ipc.size(); ++i) h.ipc[i] = std::byte(i);
  h.device.fill(std::byte{0x5a});
  h.device[0] = std::byte(rank);
  return h;
}

}  // namespace fabric::ep::fuzz
