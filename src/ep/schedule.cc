// fabric::ep's inter-node schedule (ep/schedule.h): which bytes a round sends each peer, with which
// immediates, the counts slots, and where things are in the proxy's two regions. Pure functions,
// apart from the words' atomic loads and stores; the proxy thread is in proxy.cc.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>

#include "common/align.h"
#include "common/codec.h"
#include "ep/schedule.h"

namespace fabric::ep {

namespace {

constexpr uint64_t kPage = 4096;

}  // namespace

bool on_other_nodes(int a, int b, int gpus_per_node) {
  return a / gpus_per_node != b / gpus_per_node;
}

std::vector<int> remote_peers(int rank, int world_size, int gpus_per_node) {
  std::vector<int> out;
  for (int r = 0; r < world_size; ++r) {
    if (on_other_nodes(rank, r, gpus_per_node)) out.push_back(r);
  }
  return out;
}

int remote_index(int rank, int peer, int gpus_per_node) {
  if (!on_other_nodes(rank, peer, gpus_per_node)) return -1;
  // Ranks below peer on other nodes than rank's: all of them, less those on rank's node.
  const int node_first = rank / gpus_per_node * gpus_per_node;
  const int below_on_node = std::clamp(peer - node_first, 0, gpus_per_node);
  return peer - below_on_node;
}

uint32_t encode_imm(ImmKind kind, int source, uint32_t round) {
  return (kImmTag << 28) | ((static_cast<uint32_t>(kind) & 0x7u) << 25) |
         ((static_cast<uint32_t>(source) & 0x1ffu) << 16) | (round & ((1u << kImmRoundBits) - 1));
}

Result<DecodedImm> decode_imm(uint32_t imm) {
  if ((imm >> 28) != kImmTag) {
    return Status(
        ErrorCode::kInvalidArgument,
        fmt::format("immediate {:#010x} is not an all-to-all's (tag {:#x})", imm, imm >> 28));
  }
  const uint32_t kind = (imm >> 25) & 0x7u;
  if (kind < static_cast<uint32_t>(ImmKind::kDispatchCounts) ||
      kind > static_cast<uint32_t>(ImmKind::kCombineAck)) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("immediate {:#010x} has the unknown kind {}", imm, kind));
  }
  return DecodedImm{static_cast<ImmKind>(kind), static_cast<int>((imm >> 16) & 0x1ffu),
                    imm & ((1u << kImmRoundBits) - 1)};
}

uint64_t chunk_count(uint64_t bytes, uint64_t chunk_bytes) {
  if (bytes == 0) return 0;
  return chunk_bytes == 0 ? 1 : (bytes + chunk_bytes - 1) / chunk_bytes;
}

void append_chunks(std::vector<Chunk>& out, uint64_t bytes, uint64_t chunk_bytes) {
  const uint64_t n = chunk_count(bytes, chunk_bytes);
  const uint64_t each = chunk_bytes == 0 ? bytes : chunk_bytes;
  for (uint64_t i = 0; i < n; ++i) {
    out.push_back(Chunk{i * each, std::min(each, bytes - i * each)});
  }
}

std::vector<Chunk> split_chunks(uint64_t bytes, uint64_t chunk_bytes) {
  std::vector<Chunk> out;
  append_chunks(out, bytes, chunk_bytes);
  return out;
}

uint64_t dispatch_bytes(const Layout& layout, uint32_t entries) {
  return layout.entry_bytes * entries;
}

uint64_t combine_bytes(const Layout& layout, uint32_t rows) {
  return static_cast<uint64_t>(rows) * layout.combine_row_bytes;
}

uint64_t round_bytes(const Layout& layout, bool combine, uint32_t value) {
  return combine ? combine_bytes(layout, value) : dispatch_bytes(layout, value);
}

std::vector<Chunk> round_chunks(const Layout& layout, bool combine, uint32_t value,
                                uint64_t chunk_bytes) {
  return split_chunks(round_bytes(layout, combine, value), chunk_bytes);
}

void store_counts(std::byte* slot, const Counts& c) {
  // The counts' wire format (little-endian, as detail::ByteWriter writes): round, value, 8 zero
  // bytes. Written in place: the proxy stores one per peer and round.
  static_assert(std::endian::native == std::endian::little, "wire format is little-endian");
  std::memcpy(slot, &c.round, 4);
  std::memcpy(slot + 4, &c.value, 4);
  std::memset(slot + 8, 0, kCountsBytes - 8);
}

uint64_t counts_write_bytes(bool combine, uint32_t value) {
  return kCountsBytes + (combine ? 4ull * value : 0u);
}

Counts load_counts(const std::byte* slot) {
  detail::ByteReader r(std::span<const std::byte>(slot, kCountsBytes));
  Counts c;
  (void)(r.u32(c.round) && r.u32(c.value));
  return c;
}

Result<ProxyLayout> ProxyLayout::of(const AllToAllConfig& config, const Layout& layout) {
  const int per_node = config.gpus_per_node == 0 ? config.world_size : config.gpus_per_node;
  if (config.world_size % per_node != 0) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("gpus_per_node {} does not divide world_size {}: every node needs "
                              "as many ranks",
                              per_node, config.world_size));
  }
  ProxyLayout l;
  l.num_remote = config.world_size - per_node;
  const uint64_t n = static_cast<uint64_t>(l.num_remote);
  l.counts_offset = round_up(kWords * kMaxRanks * 8, kPage);
  l.combine_slots = config.max_tokens_per_rank * config.top_k;
  l.combine_map_offset = round_up(l.counts_offset + 2 * n * kCountsBytes, kPage);
  l.combine_ids_bytes = round_up(4ull * l.combine_slots, 16);
  l.combine_counts_bytes = kCountsBytes + l.combine_ids_bytes;
  l.combine_counts_send_offset = round_up(l.combine_map_offset + 4ull * l.combine_slots, kPage);
  l.combine_counts_recv_offset =
      round_up(l.combine_counts_send_offset + n * l.combine_counts_bytes, kPage);
  l.control_bytes = round_up(l.combine_counts_recv_offset + n * l.combine_counts_bytes, kPage);
  l.dispatch_area_bytes = layout.dispatch_area_bytes;
  l.combine_area_bytes = layout.combine_bytes;
  l.dispatch_send_offset = 0;
  l.combine_send_offset = round_up(n * l.dispatch_area_bytes, kPage);
  l.dispatch_recv_offset = round_up(l.combine_send_offset + n * l.combine_area_bytes, kPage);
  l.combine_recv_offset = round_up(l.dispatch_recv_offset + n * l.dispatch_area_bytes, kPage);
  l.data_bytes = round_up(l.combine_recv_offset + n * l.combine_area_bytes, kPage);
  return l;
}

uint64_t load_word(const std::byte* control, ProxyLayout::Word w, int rank) {
  auto* p = reinterpret_cast<uint64_t*>(const_cast<std::byte*>(control) +
                                        ProxyLayout::word_offset(w, rank));
  return std::atomic_ref<uint64_t>(*p).load(std::memory_order_acquire);
}

void store_word(std::byte* control, ProxyLayout::Word w, int rank, uint64_t value) {
  auto* p = reinterpret_cast<uint64_t*>(control + ProxyLayout::word_offset(w, rank));
  std::atomic_ref<uint64_t>(*p).store(value, std::memory_order_release);
}

}  // namespace fabric::ep
