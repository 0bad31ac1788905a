// fabric::ep's inter-node schedule (docs/moe.md, "Between nodes"): which ranks are on other
// nodes, which bytes a round sends each of them, with which immediates, how many each receiver
// expects, and where things are in the proxy's two regions. Pure functions, apart from the words'
// atomic loads and stores; implemented in schedule.cc, used by the proxy (ep/proxy.h), the
// host side of the kernels' routes (ep/wiring.h) and the tests' FakeGpu. Host-only (no CUDA).
//
// The proxy's two regions, laid out by ProxyLayout and registered with the proxy's engine:
//  - the control region (host memory, pinned and mapped into the GPU by AllToAll; plain memory in
//    the tests), which the proxy's thread reads and writes:
//    - the words: eight arrays of kMaxRanks 64-bit words indexed by peer rank. Four are written
//      by the GPU and read by the proxy ("out"), four written by the proxy and read by the GPU
//      ("in");
//    - the counts slots: per kind (dispatch, combine), one 16-byte slot per remote peer to send
//      from and one per remote peer to receive into;
//    - the combine map: for each (token, slot) of this rank's tokens, where its row is in the
//      combine receive area of the peer that sent it (written by this rank's proxy);
//    - the combine slot ids: per remote peer, the ids of the rows this rank's GPU staged for it
//      (in row order) and the ids of the rows it sent here;
//  - the data region, which only the GPU and the engine touch, so that it may be GPU memory (the
//    engine then moves it directly where its NICs reach GPU memory, else staged):
//    - the staging: per remote peer, a dispatch area (entries in the peer's format) and a compact
//      combine area (the rows for the peer, each once) that this rank's kernels fill;
//    - the receive areas: the same two per remote peer, written by that peer's proxy.
// A remote peer's areas are at its index among this rank's remote peers (remote_peers()).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "fabric/ep.h"
#include "fabric/status.h"

namespace fabric::ep {

// Whether ranks `a` and `b` are on different nodes (node = rank / gpus_per_node).
bool on_other_nodes(int a, int b, int gpus_per_node);
// The ranks of other nodes than `rank`'s, in rank order: rank `rank`'s remote index of each.
std::vector<int> remote_peers(int rank, int world_size, int gpus_per_node);
// `peer`'s index among `rank`'s remote peers, or -1 when it is on `rank`'s node.
int remote_index(int rank, int peer, int gpus_per_node);

// What an immediate announces. Values are part of the wire format.
enum class ImmKind : uint32_t {
  kDispatchCounts = 1,  // a counts slot of a dispatch (16 bytes)
  kDispatchData = 2,    // one chunk of a dispatch's entries
  kDispatchAck = 3,     // the sender of the immediate has read the receiver's dispatch
  kCombineCounts = 4,
  kCombineData = 5,
  kCombineAck = 6,
};

// An immediate: bits 31..28 kImmTag, 27..25 the kind, 24..16 the rank that sends it, 15..0 the
// round modulo 2^16 (a peer is at most one round ahead, and every value is reset once consumed).
inline constexpr uint32_t kImmTag = 0xE;
inline constexpr uint32_t kImmRoundBits = 16;
uint32_t encode_imm(ImmKind kind, int source, uint32_t round);
struct DecodedImm {
  ImmKind kind;
  int source;
  uint32_t round;  // modulo 2^16
};
// Errors: kInvalidArgument (not an all-to-all immediate, an unknown kind).
Result<DecodedImm> decode_imm(uint32_t imm);

// One data write of a round: `length` bytes from `offset` of the sender's staging area for the
// peer (data region: entries or rows) into the same offset of the receiver's receive area for
// the sender.
struct Chunk {
  uint64_t offset = 0;
  uint64_t length = 0;
  friend bool operator==(const Chunk&, const Chunk&) = default;
};
// How many chunks of at most `chunk_bytes` (0: one chunk) `bytes` take: none for 0 bytes. The
// one count of data writes (and immediates) that sender and receiver agree on.
uint64_t chunk_count(uint64_t bytes, uint64_t chunk_bytes);
// `bytes` split into chunk_count(bytes, chunk_bytes) chunks, contiguous from 0, each of
// `chunk_bytes` but the last; appended to `out` (the proxy reuses one vector).
void append_chunks(std::vector<Chunk>& out, uint64_t bytes, uint64_t chunk_bytes);
std::vector<Chunk> split_chunks(uint64_t bytes, uint64_t chunk_bytes);
// A dispatch to one peer: `entries` entries of the layout, contiguous from the area's start.
uint64_t dispatch_bytes(const Layout& layout, uint32_t entries);
// A combine to one peer: `rows` rows (bf16, hidden), each the expert output for one of the
// peer's (token, slot) pairs, sent once, in no particular order.
uint64_t combine_bytes(const Layout& layout, uint32_t rows);

// The counts slot of one round: what follows it, so that the receiver knows what to expect.
struct Counts {
  uint32_t round = 0;
  uint32_t value = 0;  // dispatch: entries; combine: rows
};
inline constexpr uint64_t kCountsBytes = 16;
void store_counts(std::byte* slot, const Counts& c);
Counts load_counts(const std::byte* slot);
// The counts write of a round: the counts slot, and for a combine the `value` rows' slot ids
// (uint32 each, in row order) right behind it, so that one write with the counts immediate
// brings both.
uint64_t counts_write_bytes(bool combine, uint32_t value);

// Where things are in a rank's two proxy regions. Offsets are multiples of 4096 (the regions'
// parts) or of 16 (a peer's area in a part).
struct ProxyLayout {
  // The words, each array kMaxRanks long, indexed by peer rank.
  enum Word : uint32_t {
    // out: written by the GPU (release stores), read by the proxy.
    kDispatchReady = 0,  // [d] (round << 32) | entries: this rank's dispatch to d is staged
    kCombineReady = 1,   // [d] (round << 32) | rows: this rank's combine to d is staged
    kDispatchDone = 2,   // [s] round: the GPU has read s's dispatch of that round
    kCombineDone = 3,    // [s] round: the GPU has read s's combine rows of that round
    // in: written by the proxy, read by the GPU; the intranode signals' meanings.
    kDispatchFlag = 4,  // [s] (round << 32) | entries: s's dispatch is in its receive area
    kCombineFlag = 5,   // [s] (round << 32) | rows: s's combine rows are in its receive area
    kDispatchAck = 6,   // [d] round: d has read this rank's dispatch (staging reusable)
    kCombineAck = 7,    // [d] round: d has read this rank's combine rows
    kWords = 8,
  };
  int num_remote = 0;
  // --- the control region: the words from 0, then these.
  uint64_t counts_offset = 0;  // dispatch: [send, recv][remote] x kCountsBytes
  // The combine map: combine_slots uint32, [token x top_k + slot]: the slot's row index in the
  // combine receive area of the rank that holds its expert (for ranks of other nodes).
  uint64_t combine_map_offset = 0;
  uint32_t combine_slots = 0;  // max_tokens_per_rank x top_k: the most rows of a combine round
  // One peer's slot ids (uint32 each, in row order): combine_slots of them, rounded up to 16.
  uint64_t combine_ids_bytes = 0;
  // Combine: per remote peer its counts slot, then its slot ids (kCountsBytes +
  // combine_ids_bytes), the counts write's source (send) or destination (recv).
  uint64_t combine_counts_bytes = 0;
  uint64_t combine_counts_send_offset = 0;  // [remote] x combine_counts_bytes: staged here
  uint64_t combine_counts_recv_offset = 0;  // [remote] x combine_counts_bytes: received here
  uint64_t control_bytes = 0;               // the whole control region
  // --- the data region.
  uint64_t dispatch_send_offset = 0;
  uint64_t combine_send_offset = 0;
  uint64_t dispatch_recv_offset = 0;
  uint64_t combine_recv_offset = 0;
  uint64_t dispatch_area_bytes = 0;  // one peer's: Layout::dispatch_area_bytes
  uint64_t combine_area_bytes = 0;   // one peer's rows: Layout::combine_bytes (combine_slots rows)
  uint64_t data_bytes = 0;           // the whole data region

  // Errors: kInvalidArgument (gpus_per_node does not divide world_size).
  static Result<ProxyLayout> of(const AllToAllConfig& config, const Layout& layout);

  static constexpr uint64_t word_offset(Word w, int rank) {
    return (static_cast<uint64_t>(w) * kMaxRanks + static_cast<uint64_t>(rank)) * 8;
  }
  // recv: 0 for the slots this rank sends from, 1 for those it receives into.
  uint64_t counts_slot(bool recv, bool combine, int remote) const {
    const uint64_t r = static_cast<uint64_t>(remote);
    if (combine) {
      return (recv ? combine_counts_recv_offset : combine_counts_send_offset) +
             r * combine_counts_bytes;
    }
    return counts_offset + (recv ? static_cast<uint64_t>(num_remote) : 0u) * kCountsBytes +
           r * kCountsBytes;
  }
  uint64_t combine_ids_send(int remote) const {
    return counts_slot(false, true, remote) + kCountsBytes;
  }
  uint64_t combine_ids_recv(int remote) const {
    return counts_slot(true, true, remote) + kCountsBytes;
  }
  uint64_t dispatch_send(int remote) const {
    return dispatch_send_offset + static_cast<uint64_t>(remote) * dispatch_area_bytes;
  }
  uint64_t combine_send(int remote) const {
    return combine_send_offset + static_cast<uint64_t>(remote) * combine_area_bytes;
  }
  uint64_t dispatch_recv(int remote) const {
    return dispatch_recv_offset + static_cast<uint64_t>(remote) * dispatch_area_bytes;
  }
  uint64_t combine_recv(int remote) const {
    return combine_recv_offset + static_cast<uint64_t>(remote) * combine_area_bytes;
  }
};

// The data bytes of one round to one peer (after its counts write): `value` entries (dispatch,
// dispatch_bytes) or rows (combine, combine_bytes) from 0 of the peer's area. They go as
// split_chunks(round_bytes(...), chunk_bytes), one data immediate each.
uint64_t round_bytes(const Layout& layout, bool combine, uint32_t value);
// split_chunks(round_bytes(layout, combine, value), chunk_bytes).
std::vector<Chunk> round_chunks(const Layout& layout, bool combine, uint32_t value,
                                uint64_t chunk_bytes);

// The words as the host sees them: acquire loads and release stores on 64-bit words of the
// control region (the GPU side uses ld.acquire.sys / st.release.sys on the same words).
uint64_t load_word(const std::byte* control, ProxyLayout::Word w, int rank);
void store_word(std::byte* control, ProxyLayout::Word w, int rank, uint64_t value);

}  // namespace fabric::ep
