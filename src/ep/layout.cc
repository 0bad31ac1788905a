// fabric::ep host code that needs no GPU (fabric/ep.h): configuration checks, the buffer layout
// and the halves' argument checks. Built in every configuration (unit-tested in CI).
#include <fmt/format.h>

#include <limits>

#include "common/align.h"
#include "common/invalid.h"
#include "ep/dtype.h"
#include "fabric/ep.h"

namespace fabric::ep {

namespace {

constexpr uint64_t kRegionAlign = 4096;  // each region of the buffer starts on a page

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

}  // namespace fabric::ep
