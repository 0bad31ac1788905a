// fabric::ep's device-side structures, shared by the kernels (ep/kernels.cu) and the host code
// that sets them up (ep/params.h) and reads what they report (ep/all_to_all.cc): the signals in
// every rank's buffer, the private state, the error report and the kernels' parameters. Plain
// data, no CUDA headers: the host side is built and tested without CUDA.
//
// Compiled by nvcc as C++17 and by the host compiler as C++20: no fabric/ headers here.
#pragma once

#include <cstdint>

namespace fabric::ep::device {

inline constexpr int kMaxRanks = 32;  // == fabric::ep::kMaxRanks (checked in params.cc)
inline constexpr uint32_t kMaxTopK = 32;
inline constexpr uint32_t kMaxLocalExperts = 1024;

// The four halves, as errors name them; also the index of each one's round and block counter.
enum Half : uint32_t { kDispatchSend = 0, kDispatchRecv = 1, kCombineSend = 2, kCombineRecv = 3 };

enum ErrorKind : uint32_t {
  kNoError = 0,
  kTimedOut = 1,   // a wait for a peer's signal ran past the timeout
  kBadExpert = 2,  // dispatch_send met an expert index >= num_experts (the pair was dropped)
};

// The first failure of a rank, in pinned host memory mapped into the device: written once, by
// the thread that claims State::error_taken, `kind` last (after a system fence).
struct ErrorReport {
  uint32_t kind;  // ErrorKind
  uint32_t half;  // Half
  uint32_t peer;  // kTimedOut: the rank waited for; kBadExpert: the token
  uint32_t round;
  uint64_t seen;    // kTimedOut: the signal's last value; kBadExpert: the index
  uint64_t detail;  // kBadExpert: the top-k slot
};

// The first bytes of every rank's exported buffer. Word [i] of each array is written only by
// rank i (over NVLink, or by this rank itself for i == rank), with a release store after the data
// it announces, and read by the buffer's owner with acquire loads. Rounds count from 1; a word
// is 0 until its first round.
struct Signals {
  // (round << 32) | entries: rank i's tokens of that round are in its dispatch area here.
  uint64_t dispatch_flag[kMaxRanks];
  // round: rank i has read, up to that round, everything this rank dispatched to it.
  uint64_t dispatch_ack[kMaxRanks];
  // (round << 32) | extent: rank i's expert outputs of that round for this rank's tokens
  // [0, extent) are in the combine area.
  uint64_t combine_flag[kMaxRanks];
  // round: rank i has read, up to that round, its combine area (this rank may write it again).
  uint64_t combine_ack[kMaxRanks];
};
static_assert(sizeof(Signals) == 4 * kMaxRanks * sizeof(uint64_t));

// One rank's private device state, zeroed at creation.
struct State {
  uint32_t round[4];        // the last round each half ran (by Half)
  uint32_t blocks_done[4];  // blocks of the half's running kernel that have finished its work
  uint32_t abort;           // set by a wait that timed out: kernels then skip their work
  uint32_t error_taken;     // claimed by the first failure, which writes the ErrorReport
  uint32_t send_count[kMaxRanks];  // dispatch_send: entries written to each rank this round
  // combine_send, per rank: for a rank of this node, 1 + the highest token of its rows; for one
  // of another node, the rows staged for it so far this round (each takes the next place).
  uint32_t combine_extent[kMaxRanks];
  uint32_t recv_count[kMaxRanks];  // dispatch_recv: entries received from each rank this round
  uint32_t total_rows;             // dispatch_recv: rows of this round's output
};

// Where a row of dispatch_recv's output came from; combine_send sends the row's output there.
struct RowSource {
  int32_t rank;
  int32_t token;
  int32_t slot;  // the top-k slot
  int32_t unused;
};
static_assert(sizeof(RowSource) == 16);

// Everything a kernel needs about the all-to-all; passed by value to each launch (fixed after
// connect(), so a captured graph holds the same values).
struct Params {
  int rank;
  int world;
  uint32_t num_experts;
  uint32_t num_local_experts;
  uint32_t hidden;
  uint32_t top_k;
  uint32_t scale_columns;
  uint32_t num_sms;
  uint64_t token_bytes;
  uint64_t entry_bytes;
  uint64_t entry_token_offset;
  uint64_t entry_scale_offset;
  uint64_t max_recv_rows;
  uint64_t timeout_ns;
  // Bit r: rank r is on another node (its data goes through this rank's proxy area).
  uint32_t remote_mask;
  // [max_tokens_per_rank x top_k], in the proxy's control region: for a slot (t, k) of this
  // rank's tokens whose expert is on another node, the index of its row in that rank's combine
  // receive area (written by the proxy from the ids before it raises the combine flag). Null
  // without a proxy.
  const uint32_t* combine_map;
  // Per peer rank, where each half's data goes or comes from and which word carries its signal:
  // for a rank of this node, its buffer as mapped here (or this rank's own) and the Signals
  // words in it; for a rank of another node, this rank's areas in the proxy's data region (GPU
  // memory, or pinned host memory mapped here) and the proxy's words in its control region
  // (ep/proxy.h: the proxy moves bytes and signals across). A combine area for a rank of another
  // node is compact: each row takes the next place, its slot id (token x top_k + slot) goes to
  // the same place of combine_ids_dst.
  uint8_t* dispatch_dst[kMaxRanks];             // [d]: the area for this rank's entries to d
  uint64_t* dispatch_flag_out[kMaxRanks];       // [d]: raised after them
  const uint8_t* dispatch_src[kMaxRanks];       // [s]: s's entries for this rank
  const uint64_t* dispatch_flag_in[kMaxRanks];  // [s]: raised by (or for) s after them
  uint64_t* dispatch_ack_out[kMaxRanks];        // [s]: this rank has read s's entries
  const uint64_t* dispatch_ack_in[kMaxRanks];   // [d]: d has read this rank's entries
  uint8_t* combine_dst[kMaxRanks];              // [r]: the combine area for rank r's tokens
  uint64_t* combine_flag_out[kMaxRanks];        // [r]: raised after them
  const uint8_t* combine_src[kMaxRanks];        // [r]: the rows rank r wrote for this rank
  const uint64_t* combine_flag_in[kMaxRanks];   // [r]: raised by (or for) r after them
  uint64_t* combine_ack_out[kMaxRanks];         // [r]: this rank has read r's rows
  const uint64_t* combine_ack_in[kMaxRanks];    // [r]: r has read the rows this rank wrote
  uint32_t* combine_ids_dst[kMaxRanks];         // [r], r on another node: the rows' slot ids
  State* state;
  RowSource* rows;          // [max_recv_rows]
  uint32_t* expert_offset;  // [num_local_experts]: first row of each local expert this round
  uint32_t* expert_cursor;  // [num_local_experts]: rows of it taken so far this round
  ErrorReport* report;      // device address of the pinned report
};

}  // namespace fabric::ep::device
