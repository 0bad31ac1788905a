// fabric::ep host code that needs no GPU: configuration checks, the buffer layout, the halves'
// argument checks and the handle codec. Built in every configuration (unit-tested in CI).
#include <fmt/format.h>

#include <limits>

#include "common/codec.h"
#include "ep/handle.h"
#include "fabric/ep.h"

namespace fabric::ep {

namespace {

constexpr uint64_t kRegionAlign = 4096;  // each region of the buffer starts on a page

constexpr uint64_t round_up(uint64_t v, uint64_t to) {
  return (v + to - 1) / to * to;
}

Status invalid(std::string message) {
  return Status(ErrorCode::kInvalidArgument, std::move(message));
}

const char* dtype_name(TokenDtype d) {
  switch (d) {
    case TokenDtype::kBf16:
      return "bf16";
    case TokenDtype::kFp8E4m3:
      return "fp8_e4m3";
  }
  return "unknown";
}

bool aligned(const void* p, uintptr_t to) {
  return (reinterpret_cast<uintptr_t>(p) & (to - 1)) == 0;
}

// A device pointer argument: required (unless `optional`), and aligned.
Status pointer(const char* half, const char* name, const void* p, uintptr_t align,
               bool optional = false) {
  if (p == nullptr) {
    if (optional) return Status::ok();
    return invalid(fmt::format("{}: {} is null", half, name));
  }
  if (!aligned(p, align)) {
    return invalid(fmt::format("{}: {} ({}) is not {}-byte aligned", half, name, p, align));
  }
  return Status::ok();
}

// Scales go with fp8 tokens and never with bf16 ones.
Status scales_match(const char* half, const char* name, const AllToAllConfig& c, const float* p) {
  if (c.dtype == TokenDtype::kBf16 && p != nullptr) {
    return invalid(fmt::format("{}: {} given, but bf16 tokens have no scales", half, name));
  }
  if (c.dtype == TokenDtype::kFp8E4m3 && p == nullptr) {
    return invalid(fmt::format("{}: {} is null, but fp8 tokens need their scales", half, name));
  }
  return pointer(half, name, p, 4, true);
}

}  // namespace

Status validate(const AllToAllConfig& c) {
  if (c.world_size < 1 || c.world_size > kMaxRanks) {
    return invalid(fmt::format("world_size {} is outside [1, {}]", c.world_size, kMaxRanks));
  }
  if (c.rank < 0 || c.rank >= c.world_size) {
    return invalid(fmt::format("rank {} is outside [0, world_size {})", c.rank, c.world_size));
  }
  if (c.gpus_per_node < 0) {
    return invalid(fmt::format("gpus_per_node {} is negative", c.gpus_per_node));
  }
  if (c.gpus_per_node != 0 && c.world_size % c.gpus_per_node != 0) {
    return invalid(
        fmt::format("gpus_per_node {} does not divide world_size {}: every node needs "
                    "as many ranks",
                    c.gpus_per_node, c.world_size));
  }
  if (c.num_experts == 0 || c.num_experts % static_cast<uint32_t>(c.world_size) != 0) {
    return invalid(fmt::format("num_experts {} is not a positive multiple of world_size {}",
                               c.num_experts, c.world_size));
  }
  if (c.num_experts / static_cast<uint32_t>(c.world_size) > kMaxLocalExperts) {
    return invalid(fmt::format("num_experts {} gives {} experts per rank, more than {}",
                               c.num_experts, c.num_experts / c.world_size, kMaxLocalExperts));
  }
  if (c.dtype != TokenDtype::kBf16 && c.dtype != TokenDtype::kFp8E4m3) {
    return invalid(fmt::format("dtype {} is neither bf16 nor fp8_e4m3", static_cast<int>(c.dtype)));
  }
  const uint32_t hidden_multiple = c.dtype == TokenDtype::kBf16 ? 8 : kScaleBlock;
  if (c.hidden == 0 || c.hidden % hidden_multiple != 0) {
    return invalid(fmt::format("hidden {} is not a positive multiple of {} (for {} tokens)",
                               c.hidden, hidden_multiple, dtype_name(c.dtype)));
  }
  if (c.top_k == 0 || c.top_k > kMaxTopK) {
    return invalid(fmt::format("top_k {} is outside [1, {}]", c.top_k, kMaxTopK));
  }
  if (c.max_tokens_per_rank == 0) return invalid("max_tokens_per_rank is 0");
  const uint64_t rows = static_cast<uint64_t>(c.world_size) * c.max_tokens_per_rank * c.top_k;
  if (rows > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
    return invalid(
        fmt::format("world_size x max_tokens_per_rank x top_k = {} rows is more than "
                    "{} (max_tokens_per_rank {} is too large)",
                    rows, std::numeric_limits<int32_t>::max(), c.max_tokens_per_rank));
  }
  if (c.timeout.count() <= 0) {
    return invalid(fmt::format("timeout {} ms is not positive", c.timeout.count()));
  }
  if (c.cuda_device < -1) {
    return invalid(fmt::format("cuda_device {} is neither a device nor -1", c.cuda_device));
  }
  if (c.proxy_memory != "auto" && c.proxy_memory != "host" && c.proxy_memory != "gpu") {
    return invalid(
        fmt::format("proxy_memory '{}' is none of 'auto', 'host' and 'gpu'", c.proxy_memory));
  }
  return Status::ok();
}

Result<Layout> Layout::of(const AllToAllConfig& c) {
  if (Status s = validate(c); !s) return s;
  Layout l;
  l.num_local_experts = c.num_experts / static_cast<uint32_t>(c.world_size);
  const uint64_t elem = c.dtype == TokenDtype::kBf16 ? 2 : 1;
  l.scale_columns = c.dtype == TokenDtype::kFp8E4m3 ? c.hidden / kScaleBlock : 0;
  l.token_bytes = elem * c.hidden;
  l.scale_bytes = 4ull * l.scale_columns;
  // Metadata: the source token index, then top_k expert indices (int32), then top_k weights.
  l.entry_meta_bytes = round_up(4 + 8ull * c.top_k, 16);
  l.entry_token_offset = l.entry_meta_bytes;
  l.entry_scale_offset = l.entry_token_offset + round_up(l.token_bytes, 16);
  l.entry_bytes = l.entry_scale_offset + round_up(l.scale_bytes, 16);
  l.signal_bytes = 4ull * kMaxRanks * sizeof(uint64_t);
  l.dispatch_offset = round_up(l.signal_bytes, kRegionAlign);
  l.dispatch_area_bytes = l.entry_bytes * c.max_tokens_per_rank;
  l.combine_offset =
      round_up(l.dispatch_offset + l.dispatch_area_bytes * static_cast<uint64_t>(c.world_size),
               kRegionAlign);
  l.combine_row_bytes = 2ull * c.hidden;
  l.combine_token_bytes = l.combine_row_bytes * c.top_k;
  l.combine_bytes = l.combine_token_bytes * c.max_tokens_per_rank;
  l.buffer_bytes = round_up(l.combine_offset + l.combine_bytes, kRegionAlign);
  l.max_recv_rows = static_cast<uint64_t>(c.world_size) * c.max_tokens_per_rank * c.top_k;
  return l;
}

Status check_dispatch_send(const AllToAllConfig& c, const DispatchSendArgs& a) {
  constexpr const char* kHalf = "dispatch_send";
  if (a.num_tokens > c.max_tokens_per_rank) {
    return invalid(fmt::format("{}: num_tokens {} is more than max_tokens_per_rank {}", kHalf,
                               a.num_tokens, c.max_tokens_per_rank));
  }
  if (a.num_tokens == 0) {  // nothing is read: empty tensors may be null
    return c.dtype == TokenDtype::kBf16 ? scales_match(kHalf, "scales", c, a.scales) : Status::ok();
  }
  if (Status s = scales_match(kHalf, "scales", c, a.scales); !s) return s;
  if (Status s = pointer(kHalf, "tokens", a.tokens, 16); !s) return s;
  if (Status s = pointer(kHalf, "topk_idx", a.topk_idx, 8); !s) return s;
  return pointer(kHalf, "topk_weights", a.topk_weights, 4, true);
}

Status check_dispatch_recv(const AllToAllConfig& c, const DispatchRecvArgs& a) {
  constexpr const char* kHalf = "dispatch_recv";
  if (Status s = pointer(kHalf, "out_tokens", a.out_tokens, 16); !s) return s;
  if (Status s = scales_match(kHalf, "out_scales", c, a.out_scales); !s) return s;
  if (Status s = pointer(kHalf, "out_weights", a.out_weights, 4, true); !s) return s;
  if (Status s = pointer(kHalf, "out_source", a.out_source, 4, true); !s) return s;
  if (Status s = pointer(kHalf, "expert_counts", a.expert_counts, 4); !s) return s;
  return pointer(kHalf, "expert_offsets", a.expert_offsets, 4, true);
}

Status check_combine_send(const AllToAllConfig&, const CombineSendArgs& a) {
  return pointer("combine_send", "expert_out", a.expert_out, 16);
}

Status check_combine_recv(const AllToAllConfig& c, const CombineRecvArgs& a) {
  constexpr const char* kHalf = "combine_recv";
  if (a.num_tokens > c.max_tokens_per_rank) {
    return invalid(fmt::format("{}: num_tokens {} is more than max_tokens_per_rank {}", kHalf,
                               a.num_tokens, c.max_tokens_per_rank));
  }
  if (a.num_tokens == 0) return Status::ok();
  if (Status s = pointer(kHalf, "topk_idx", a.topk_idx, 8); !s) return s;
  if (Status s = pointer(kHalf, "topk_weights", a.topk_weights, 4); !s) return s;
  return pointer(kHalf, "out", a.out, 16);
}

// --- handles -----------------------------------------------------------------------------------

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
  if (peer.world_size != mine.world_size) {
    return differs("world_size", peer.world_size, mine.world_size);
  }
  if (peer.gpus_per_node != mine.gpus_per_node) {
    return differs("gpus_per_node", peer.gpus_per_node, mine.gpus_per_node);
  }
  if (peer.num_experts != mine.num_experts) {
    return differs("num_experts", peer.num_experts, mine.num_experts);
  }
  if (peer.hidden != mine.hidden) return differs("hidden", peer.hidden, mine.hidden);
  if (peer.top_k != mine.top_k) return differs("top_k", peer.top_k, mine.top_k);
  if (peer.max_tokens_per_rank != mine.max_tokens_per_rank) {
    return differs("max_tokens_per_rank", peer.max_tokens_per_rank, mine.max_tokens_per_rank);
  }
  if (peer.dtype != mine.dtype) {
    return differs("dtype", dtype_name(peer.dtype), dtype_name(mine.dtype));
  }
  if (peer.buffer_bytes != mine.buffer_bytes) {
    return differs("buffer_bytes", peer.buffer_bytes, mine.buffer_bytes);
  }
  return Status::ok();
}

}  // namespace fabric::ep
