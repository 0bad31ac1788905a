// fabric::ep's handle codec (ep/handle.h): what a rank exports, versioned little-endian bytes,
// and the checks that a peer's handle belongs to the same all-to-all. Host code, built in every
// configuration (unit-tested and fuzzed in CI).
#include "ep/handle.h"

#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "common/codec.h"
#include "common/invalid.h"
#include "ep/dtype.h"

namespace fabric::ep {

PeerHandle make_handle(const AllToAllConfig& c, const Layout& l) {
  PeerHandle h;
  h.rank = c.rank;
  h.world_size = c.world_size;
  h.gpus_per_node = c.gpus_per_node == 0 ? c.world_size : c.gpus_per_node;
  h.num_experts = c.num_experts;
  h.hidden = c.hidden;
  h.top_k = c.top_k;
  h.max_tokens_per_rank = c.max_tokens_per_rank;
  h.dtype = c.dtype;
  h.buffer_bytes = l.buffer_bytes;
  return h;
}

Bytes encode(const PeerHandle& h) {
  detail::ByteWriter w;
  w.u32(PeerHandle::kMagic);
  w.u16(PeerHandle::kVersion);
  w.u16(0);
  w.u32(static_cast<uint32_t>(h.rank));
  w.u32(static_cast<uint32_t>(h.world_size));
  w.u32(static_cast<uint32_t>(h.gpus_per_node));
  w.u32(h.num_experts);
  w.u32(h.hidden);
  w.u32(h.top_k);
  w.u32(h.max_tokens_per_rank);
  w.u8(static_cast<uint8_t>(h.dtype));
  w.u64(h.buffer_bytes);
  w.bytes(h.device);
  w.u64(h.pid);
  w.bytes(h.ipc);
  w.u32(static_cast<uint32_t>(h.proxy.size()));
  w.bytes(h.proxy);
  return w.take();
}

Result<PeerHandle> decode_handle(std::span<const std::byte> bytes) {
  detail::ByteReader r(bytes);
  uint32_t magic = 0, rank = 0, world = 0, per_node = 0;
  uint16_t version = 0, reserved = 0;
  if (!r.u32(magic) || magic != PeerHandle::kMagic) {
    return invalid(
        fmt::format("not an all-to-all handle ({} bytes without its magic number)", bytes.size()));
  }
  auto truncated = [&] {
    return invalid(fmt::format("all-to-all handle truncated at {} bytes", bytes.size()));
  };
  if (!r.u16(version)) return truncated();
  if (version != PeerHandle::kVersion) {
    return invalid(fmt::format("all-to-all handle version {}, this build reads version {}", version,
                               PeerHandle::kVersion));
  }
  PeerHandle h;
  uint8_t dtype = 0;
  std::vector<std::byte> device, ipc;
  uint32_t proxy_bytes = 0;
  const bool ok =
      r.u16(reserved) && r.u32(rank) && r.u32(world) && r.u32(per_node) && r.u32(h.num_experts) &&
      r.u32(h.hidden) && r.u32(h.top_k) && r.u32(h.max_tokens_per_rank) && r.u8(dtype) &&
      r.u64(h.buffer_bytes) && r.bytes(h.device.size(), device) && r.u64(h.pid) &&
      r.bytes(PeerHandle::kIpcBytes, ipc) && r.u32(proxy_bytes) && r.bytes(proxy_bytes, h.proxy);
  if (!ok) return truncated();
  if (r.remaining() != 0) {
    return invalid(fmt::format("all-to-all handle has {} bytes too many", r.remaining()));
  }
  h.rank = static_cast<int>(rank);
  h.world_size = static_cast<int>(world);
  h.gpus_per_node = static_cast<int>(per_node);
  h.dtype = static_cast<TokenDtype>(dtype);
  std::copy(device.begin(), device.end(), h.device.begin());
  std::copy(ipc.begin(), ipc.end(), h.ipc.begin());
  return h;
}

Status check_peer(const PeerHandle& mine, const PeerHandle& peer, int index) {
  if (peer.rank != index) {
    return invalid(
        fmt::format("handle {} is rank {}'s: handles go in rank order", index, peer.rank));
  }
  auto differs = [&](const char* field, auto theirs, auto ours) {
    return invalid(fmt::format("rank {} has {} {}, this rank (rank {}) has {}", index, field,
                               theirs, mine.rank, ours));
  };
  const bool same_node =
      mine.gpus_per_node > 0 && index / mine.gpus_per_node == mine.rank / mine.gpus_per_node;
  if (index != mine.rank && same_node && peer.pid == mine.pid) {
    return Status(ErrorCode::kUnsupported,
                  fmt::format("rank {} runs in this process (pid {}): CUDA IPC maps only other "
                              "processes' memory, so each rank needs a process of its own",
                              index, peer.pid));
  }
  // The fields that must agree, in this order: the first that differs is named.
  Status s = Status::ok();
  auto same = [&](const char* field, auto theirs, auto ours) {
    if (s && theirs != ours) s = differs(field, theirs, ours);
  };
  same("world_size", peer.world_size, mine.world_size);
  same("gpus_per_node", peer.gpus_per_node, mine.gpus_per_node);
  same("num_experts", peer.num_experts, mine.num_experts);
  same("hidden", peer.hidden, mine.hidden);
  same("top_k", peer.top_k, mine.top_k);
  same("max_tokens_per_rank", peer.max_tokens_per_rank, mine.max_tokens_per_rank);
  if (s && peer.dtype != mine.dtype) {
    s = differs("dtype", dtype_name(peer.dtype), dtype_name(mine.dtype));
  }
  same("buffer_bytes", peer.buffer_bytes, mine.buffer_bytes);
  return s;
}

}  // namespace fabric::ep
