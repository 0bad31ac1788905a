// fabric::ep's inter-node path, host side (docs/moe.md, "Between nodes"): the schedule (which
// bytes go to which peer, with which immediates, and how many each receiver expects) as pure
// functions, and the Proxy, a host thread that carries the kernels' rounds to and from the ranks
// of other nodes through a TransferEngine group of its own in caller-driven progress.
//
// Host-only (no CUDA): built and unit-tested everywhere (tests/ep/ep_proxy_test.cc, where a
// test double named FakeGpu plays the kernels' part on host memory).
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

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "fabric/address.h"
#include "fabric/ep.h"
#include "fabric/status.h"
#include "fabric/transfer.h"

namespace fabric {
class TransferEngine;
}

namespace fabric::ep {

// --- the schedule (pure) -----------------------------------------------------------------------

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
// `bytes` split into chunks of at most `chunk_bytes` (0: one chunk); none for 0 bytes.
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

// The data writes of one round to one peer (after its counts write), chunks of at most
// `chunk_bytes` (0: one), one data immediate each: `value` entries (dispatch) or rows (combine)
// from 0. None for 0.
std::vector<Chunk> round_chunks(const Layout& layout, bool combine, uint32_t value,
                                uint64_t chunk_bytes);
// round_chunks(...) appended to `out` (the proxy reuses one vector).
void append_round_chunks(std::vector<Chunk>& out, const Layout& layout, bool combine,
                         uint32_t value, uint64_t chunk_bytes);
// round_chunks(...).size(), without building them (the receiving side's count per round).
uint64_t round_chunk_count(const Layout& layout, bool combine, uint32_t value,
                           uint64_t chunk_bytes);

// The words as the host sees them: acquire loads and release stores on 64-bit words of the
// control region (the GPU side uses ld.acquire.sys / st.release.sys on the same words).
uint64_t load_word(const std::byte* control, ProxyLayout::Word w, int rank);
void store_word(std::byte* control, ProxyLayout::Word w, int rank, uint64_t value);

// --- the proxy ---------------------------------------------------------------------------------

struct ProxyOptions {
  // The engine's provider and NICs (Config::provider, GroupConfig::nics).
  std::string provider = "auto";
  std::vector<std::string> nics;
  // A peer that sends nothing of a round this long after this rank's GPU reached that round is
  // reported as kTimeout; writes to a peer that has gone fail as kPeerUnreachable after at most
  // this long (the engine's peer_timeout).
  std::chrono::milliseconds timeout{10000};
  uint64_t chunk_bytes = 1 << 20;  // see split_chunks
  // Idle passes before the thread naps for idle_sleep (then it polls again).
  uint32_t idle_spins = 256;
  std::chrono::microseconds idle_sleep{20};
  // Called on the proxy thread once every byte of a peer's round has arrived, before its flag
  // is raised (for the all-to-all: writes a NIC made into GPU memory made visible to the GPU).
  // An error is the proxy's failure, and the flag stays down.
  std::function<Status(int peer, bool combine, uint32_t round)> before_flag;
};

// The two regions of one rank's proxy (ProxyLayout), zeroed and 16-byte aligned, the caller's.
struct ProxyAreas {
  std::span<std::byte> control;  // host memory, control_bytes
  std::span<std::byte> data;     // host or GPU memory, data_bytes; never touched by the proxy
};
// Called once by Proxy::create, after the engine is open: `direct` says whether it moves GPU
// memory itself (every NIC of its group reaches it) rather than staging it through host memory.
using ProxyAllocator = std::function<Result<ProxyAreas>(const ProxyLayout& layout, bool direct)>;

// One rank's proxy. Created with its regions, then connect() with every rank's handle() starts
// the thread. Thread-safe: status() may be called from any thread while the proxy runs.
class Proxy {
 public:
  // Opens the engine (one caller-driven group), asks `allocate` for the regions and registers
  // them; they must outlive the proxy. Blocking. Errors: those of ProxyLayout::of and of
  // `allocate`, kInvalidArgument (a region too small or misaligned), the engine's (kUnsupported
  // for an absent provider, kFabric).
  static Result<std::unique_ptr<Proxy>> create(const AllToAllConfig& config, const Layout& layout,
                                               const ProxyOptions& options,
                                               const ProxyAllocator& allocate);
  // Stops the thread and closes the engine (bounded: the engine's close_timeout, posted writes
  // are cancelled after it). Never waits for a peer beyond that.
  ~Proxy();
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;

  const ProxyLayout& layout() const { return layout_; }
  // Versioned bytes: the two regions' descriptors (which carry the engine's address).
  Bytes handle() const;
  // `handles`: every rank's handle() in rank order; those of this node's ranks are not read
  // (they may be empty). Starts the thread. Once. Errors: kInvalidArgument (count, a malformed
  // handle, regions of other sizes), kAlreadyExists.
  Status connect(const std::vector<Bytes>& handles);
  // The first failure, or ok: kPeerUnreachable (a write to a peer failed), kTimeout (a peer
  // silent for longer than the timeout), kInternal (a peer broke the protocol). The thread
  // stops at the first one. Never blocks.
  Status status() const;
  // The counters so far. Never blocks; any thread.
  ProxyStats stats() const;

 private:
  struct Peer;
  Proxy(const AllToAllConfig& config, const Layout& layout, const ProxyLayout& proxy_layout,
        const ProxyOptions& options);
  void run();
  bool pass();
  bool send_rounds(bool combine);
  void post_rounds(bool combine, uint32_t round, std::chrono::steady_clock::time_point seen);
  bool receive_round(Peer& p, bool combine);
  bool forward_acks(Peer& p, bool combine);
  bool take_acks(Peer& p, bool combine);
  bool map_rows(const Peer& p, uint32_t round);
  uint32_t most(bool combine) const;  // entries (dispatch) or rows (combine) an area holds
  void fail(Status s);
  // One part (counts, slot ids or bytes) of a round's posting to several peers: one scatter
  // from the control or the data region, whose completion ends one outstanding write of each of
  // `peers` (those its targets go to). Kept on a free list: a posting allocates nothing once
  // the records have grown to their size.
  struct Posting {
    bool combine = false;
    uint32_t round = 0;
    std::vector<ScatterTarget> targets;
    std::vector<Peer*> peers;
    std::string to() const;  // "rank 3" or "ranks 1, 2, 3"
  };
  Posting* take_posting(bool combine, uint32_t round);
  void give_back(Posting* p);
  void post(Posting& part, bool control, uint32_t imm, Scatter::Sharding sharding);
  void posted_done(Posting* p);
  void posted_failed(Posting* p, const Status& s);

  AllToAllConfig config_;
  Layout a2a_;
  ProxyLayout layout_;
  ProxyOptions options_;
  ProxyAreas areas_;
  // Members in creation order; the destructor joins the thread, then closes the engine (its
  // callbacks touch peers_ and failure_), then the rest goes.
  mutable std::atomic<bool> failed_{false};
  mutable std::mutex failure_mu_;
  Status failure_;
  std::vector<std::unique_ptr<Peer>> peers_;
  std::unique_ptr<TransferEngine> engine_;
  MemoryHandle control_handle_;
  MemoryHandle data_handle_;
  Bytes descriptor_;
  PeerGroup remote_group_;  // every remote peer: the scatters' group
  // The proxy thread's scratch for one pass's postings, kept to reuse their memory: the peers
  // whose rounds are staged and one peer's chunks.
  struct Ready {
    Peer* peer;
    uint32_t round;
    uint32_t value;
  };
  std::vector<Ready> ready_;
  std::vector<Chunk> chunks_;
  // The postings' records (their callbacks run on the proxy thread, or on the thread that
  // closes the engine once this thread has stopped: never two at once).
  std::vector<std::unique_ptr<Posting>> postings_;
  std::vector<Posting*> free_postings_;
  // The proxy thread's own: the last round this rank's GPU raised of each kind (dispatch,
  // combine) and when the proxy first saw it (a peer's data of that round is due from then).
  uint32_t local_round_[2] = {0, 0};
  // ProxyStats' fields, written by the proxy thread (and completions), read by stats().
  struct Counters {
    std::atomic<uint64_t> rounds_sent[2] = {0, 0}, writes_sent[2] = {0, 0}, bytes_sent[2] = {0, 0},
                          post_ns[2] = {0, 0}, complete_ns[2] = {0, 0}, rounds_received[2] = {0, 0},
                          receive_ns[2] = {0, 0}, passes{0}, naps{0};
  };
  Counters counters_;
  std::chrono::steady_clock::time_point local_seen_at_[2];
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace fabric::ep
