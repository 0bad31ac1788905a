// An all-to-all rank's handle: what a peer of its node needs to map its buffer (a CUDA IPC
// handle), what a peer of another node needs to reach its proxy (the proxy's handle: the engine
// address and the proxy area's descriptor), and what both need to check that they were created
// alike. Versioned little-endian bytes (common/codec.h); the codec is in handle.cc.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

#include "fabric/ep.h"

namespace fabric::ep {

struct PeerHandle {
  static constexpr uint32_t kMagic = 0x41504546;  // "FEPA"
  static constexpr uint16_t kVersion = 2;         // 2 added `proxy`
  static constexpr size_t kIpcBytes = 64;         // sizeof(cudaIpcMemHandle_t)

  int rank = 0;
  int world_size = 0;
  int gpus_per_node = 0;  // resolved: never 0
  uint32_t num_experts = 0;
  uint32_t hidden = 0;
  uint32_t top_k = 0;
  uint32_t max_tokens_per_rank = 0;
  TokenDtype dtype = TokenDtype::kBf16;
  uint64_t buffer_bytes = 0;
  std::array<std::byte, 16> device{};  // the GPU's UUID
  uint64_t pid = 0;                    // of the exporting process
  std::array<std::byte, kIpcBytes> ipc{};
  Bytes proxy;  // Proxy::handle() (ep/proxy.h); empty when every rank is on one node

  friend bool operator==(const PeerHandle&, const PeerHandle&) = default;
};

// The configuration part of this rank's handle (`config` must be valid); the caller fills in
// `device`, `pid` and `ipc` from its export.
PeerHandle make_handle(const AllToAllConfig& config, const Layout& layout);
Bytes encode(const PeerHandle& h);
// Errors: kInvalidArgument (not a handle, a version this build does not read, truncated).
Result<PeerHandle> decode_handle(std::span<const std::byte> bytes);

// Whether `peer`, found at position `index` of connect()'s list, belongs to the same all-to-all
// as this rank's `mine`. Errors: kInvalidArgument naming the first field that differs (or a
// handle out of its place), kUnsupported for another rank of this node in this same process
// (ranks of other nodes go through the proxy, which does not mind).
Status check_peer(const PeerHandle& mine, const PeerHandle& peer, int index);

}  // namespace fabric::ep
