// fabric::ep: MoE expert-parallel all-to-all (dispatch and combine) between GPUs: over NVLink
// between the GPUs of one node, and through a host proxy and a TransferEngine between nodes
// (docs/moe.md).
//
// Each rank holds num_experts / world_size experts (rank r the experts [r * L, (r + 1) * L),
// L = num_local_experts). Dispatch sends every token to the ranks of its top-k experts, once per
// distinct destination rank, and the receiver lays out one row per (token, local expert) pair;
// combine sends each row's expert output back to the token's rank, which sums them weighted by
// the top-k weights (in fp32, output bf16). Each is split into a send and a receive half so that a
// caller can overlap compute between them.
//
// Every rank exports one GPU buffer (its receive areas and flags); its peers of the same node map
// it with CUDA IPC and the send kernels store tokens straight into it, then raise a
// per-(source, round) flag. For a peer of another node the kernels store into this rank's proxy
// area (pinned host memory, registered with the proxy's engine) and raise a host-visible word;
// the proxy thread writes the bytes into the peer's proxy area with immediates, and the peer's
// proxy raises the same per-(source, round) flag there once they have all arrived. The
// receive kernels wait for those flags on the GPU: no host synchronisation on the hot path, and a
// sequence of calls can be captured in a CUDA graph and replayed. Every GPU wait gives up after
// AllToAllConfig::timeout and records an error that the next call (or check()) returns.
//
// Library: fabric::ep (CMake target fabric::ep, pkg-config fabric-ep), on fabric::fabric.
// Available when fabric-lib is built with CUDA; otherwise AllToAll::create returns kUnsupported.
// validate(), Layout and the argument checks are plain host code, built everywhere.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fabric/address.h"
#include "fabric/status.h"

namespace fabric::ep {

enum class TokenDtype : uint8_t {
  kBf16 = 1,     // tokens in bf16, no scales
  kFp8E4m3 = 2,  // tokens in fp8 e4m3, one fp32 scale per kScaleBlock elements along hidden
};

// fp8 tokens carry one fp32 scale per this many elements of a row.
inline constexpr uint32_t kScaleBlock = 128;
// Ranks of one all-to-all, over all its nodes.
inline constexpr int kMaxRanks = 32;
inline constexpr uint32_t kMaxTopK = 32;
inline constexpr uint32_t kMaxLocalExperts = 1024;

struct AllToAllConfig {
  int rank = 0;
  int world_size = 1;
  // Ranks of one node (NVLink joins them); 0 means world_size (one node). It must divide
  // world_size: ranks r and q share a node when r / gpus_per_node == q / gpus_per_node. Peers of
  // this rank's node are reached over CUDA IPC, those of other nodes through the proxy.
  int gpus_per_node = 0;
  uint32_t num_experts = 0;  // a multiple of world_size
  uint32_t hidden = 0;       // elements of a token: a multiple of 8 (bf16) or of kScaleBlock (fp8)
  uint32_t top_k = 0;        // experts per token, 1 to kMaxTopK
  uint32_t max_tokens_per_rank = 0;  // the most tokens one dispatch of one rank carries
  TokenDtype dtype = TokenDtype::kBf16;
  // How long a kernel waits for a peer's flag before it gives up and records kTimeout.
  std::chrono::milliseconds timeout{10000};
  int cuda_device = -1;  // the GPU of this rank; -1: the calling thread's current device
  // The inter-node path (read only when the ranks span several nodes): the TransferEngine
  // provider of this rank's proxy ("auto", "tcp", "shm", "verbs", ...: fabric::Config::provider)
  // and its NICs (GroupConfig::nics; empty: the provider's first). Every rank must use the same
  // provider.
  std::string provider = "auto";
  std::vector<std::string> nics;
  // Where the proxy's staging and receive areas are (the bytes the kernels write for, and read
  // from, the ranks of other nodes): "host" (pinned host memory, which the kernels reach over
  // PCIe), "gpu" (GPU memory, which the proxy's engine must reach itself: GPUDirect RDMA;
  // create() fails with kUnsupported where it would stage it through host memory), or "auto":
  // "gpu" when the proxy's engine reaches GPU memory itself, else "host". The words, counts and
  // slot ids stay in pinned host memory either way. Ranks may differ.
  std::string proxy_memory = "auto";
};

// Checks a configuration; the error (kInvalidArgument) names the field and the value. Never
// blocks.
Status validate(const AllToAllConfig& config);

// Where things are in a rank's exported buffer, and the sizes of the caller's tensors. All
// offsets and sizes are in bytes unless the name says otherwise; every offset is a multiple of 16.
//
// The buffer holds, in order:
//  - the signals: four arrays of kMaxRanks 64-bit words (dispatch flags, dispatch acks, combine
//    flags, combine acks), indexed by the rank that writes them;
//  - world_size dispatch areas, one per source rank, each of max_tokens_per_rank entries; an
//    entry is one token as sent to this rank: metadata (source token index, its top-k expert
//    indices and weights), the token's bytes, then its scales (fp8), each part rounded up to 16;
//  - the combine area: max_tokens_per_rank x top_k bf16 rows of hidden, the expert output of this
//    rank's token t for its top-k slot k at row t * top_k + k.
struct Layout {
  uint32_t num_local_experts = 0;
  uint32_t scale_columns = 0;  // fp32 scales per token: hidden / kScaleBlock for fp8, 0 for bf16
  uint64_t token_bytes = 0;    // one token in the caller's tensor
  uint64_t scale_bytes = 0;    // its scales
  uint64_t entry_meta_bytes = 0;
  uint64_t entry_token_offset = 0;  // within an entry
  uint64_t entry_scale_offset = 0;
  uint64_t entry_bytes = 0;
  uint64_t signal_bytes = 0;
  uint64_t dispatch_offset = 0;      // the first dispatch area
  uint64_t dispatch_area_bytes = 0;  // one source rank's area
  uint64_t combine_offset = 0;
  uint64_t combine_bytes = 0;
  uint64_t combine_row_bytes = 0;    // one row of the combine area: hidden bf16
  uint64_t combine_token_bytes = 0;  // one token's top_k rows in the combine area
  uint64_t buffer_bytes = 0;         // the whole exported buffer
  // Rows of dispatch_recv's output (and combine_send's input): one per (token, local expert)
  // pair at most, world_size x max_tokens_per_rank x top_k.
  uint64_t max_recv_rows = 0;

  // Errors: those of validate().
  static Result<Layout> of(const AllToAllConfig& config);
  // The entry of source rank `source`'s token in slot `slot` of this rank's dispatch areas.
  uint64_t dispatch_entry(int source, uint32_t slot) const {
    return dispatch_offset + static_cast<uint64_t>(source) * dispatch_area_bytes +
           static_cast<uint64_t>(slot) * entry_bytes;
  }
};

// The halves' arguments: device pointers (and host counts). Tensors are dense row-major and
// 16-byte aligned (index and weight tensors: 8 and 4).
struct DispatchSendArgs {
  const void* tokens = nullptr;         // [num_tokens, hidden] in config.dtype
  const float* scales = nullptr;        // fp8: [num_tokens, hidden / kScaleBlock]; bf16: null
  const int64_t* topk_idx = nullptr;    // [num_tokens, top_k]; negative: no expert
  const float* topk_weights = nullptr;  // [num_tokens, top_k], or null (then no out_weights)
  uint32_t num_tokens = 0;              // at most max_tokens_per_rank; 0 is allowed
};

// Output in the flat layout: local expert e's rows are [offsets[e], offsets[e] + counts[e]),
// experts in order, rows within an expert in no particular order. Rows from offsets[L] on are
// left as they were.
struct DispatchRecvArgs {
  void* out_tokens = nullptr;         // [max_recv_rows, hidden] in config.dtype
  float* out_scales = nullptr;        // fp8: [max_recv_rows, hidden / kScaleBlock]; bf16: null
  float* out_weights = nullptr;       // [max_recv_rows]: the pair's top-k weight; or null
  int32_t* out_source = nullptr;      // [max_recv_rows, 2]: source rank, token index; or null
  int32_t* expert_counts = nullptr;   // [num_local_experts]
  int32_t* expert_offsets = nullptr;  // [num_local_experts + 1], or null
};

struct CombineSendArgs {
  // [max_recv_rows, hidden] bf16: row i is the expert output for dispatch_recv's row i (rows
  // past the last dispatched one are not read).
  const void* expert_out = nullptr;
};

struct CombineRecvArgs {
  const int64_t* topk_idx = nullptr;    // the same indices as the dispatch's
  const float* topk_weights = nullptr;  // [num_tokens, top_k]
  uint32_t num_tokens = 0;              // the dispatch's
  void* out = nullptr;                  // [num_tokens, hidden] bf16
};

// Argument checks of the four halves (host only, never blocks): kInvalidArgument naming the
// argument. The launchers run them first.
Status check_dispatch_send(const AllToAllConfig& config, const DispatchSendArgs& args);
Status check_dispatch_recv(const AllToAllConfig& config, const DispatchRecvArgs& args);
Status check_combine_send(const AllToAllConfig& config, const CombineSendArgs& args);
Status check_combine_recv(const AllToAllConfig& config, const CombineRecvArgs& args);

// What the inter-node proxy of a rank did (AllToAll::proxy_stats()): totals since creation over
// every peer of another node, index [0] dispatch, [1] combine. Times are steady-clock
// nanoseconds summed over rounds and peers: divide by the rounds for a mean. All zero without
// peers on other nodes.
struct ProxyStats {
  uint64_t rounds_sent[2] = {};  // rounds posted to a peer
  uint64_t writes_sent[2] = {};  // their writes (a counts slot, then one per chunk of data)
  uint64_t bytes_sent[2] = {};
  // The GPU's ready words seen -> the writes posted. The rounds that the GPU has staged for
  // several peers when the proxy looks are posted together (one scatter per part), and that
  // posting's time is counted once: post_ns / rounds_sent is the cost per peer and round.
  uint64_t post_ns[2] = {};
  // Posted -> the peer's last write of the round completed (engine, fabric); a peer's writes
  // complete with the scatters it shares with the other peers of its posting.
  uint64_t complete_ns[2] = {};
  uint64_t rounds_received[2] = {};
  uint64_t receive_ns[2] = {};  // a peer's counts seen -> its last chunk seen and the flag raised
  uint64_t passes = 0;          // passes of the proxy's loop
  uint64_t naps = 0;            // idle naps between passes
};

// One rank's side of an all-to-all. Created collectively: every rank creates its object,
// passes handle() to every other rank (any side channel: torch.distributed in Python), and
// calls connect() with all of them. Then every rank calls the same sequence of halves:
//
//   dispatch_send, dispatch_recv, [compute], combine_send, combine_recv, dispatch_send, ...
//
// (combine may be left out: dispatch_send may follow dispatch_recv), on streams that keep that
// order (one stream, or events between streams). The launchers enqueue kernels and return; they
// never wait for the GPU, so the sequence can be captured in a CUDA graph. Not thread-safe.
//
// Failures on the GPU (a peer silent for longer than the timeout, an expert index out of range)
// are recorded by the kernel in pinned host memory; the next launcher call, and check(), return
// the first one. The proxy's failures (a peer of another node unreachable, kPeerUnreachable, or
// silent past the timeout, kTimeout) are returned the same way. After one, the object cannot be
// used again: destroy it on every rank.
class AllToAll {
 public:
  // Allocates and zeroes this rank's buffer on its GPU and exports it; with peers on other nodes
  // also the proxy's engine (config.provider) and regions (pinned host memory for its control
  // words, host or GPU memory for its areas: config.proxy_memory). Blocking.
  // Errors: those of validate(), kUnsupported (built without CUDA, no CUDA device, the provider
  // absent, proxy_memory "gpu" on an engine that stages GPU memory), kFabric (a CUDA call
  // failed, the engine could not open).
  static Result<std::unique_ptr<AllToAll>> create(const AllToAllConfig& config);
  // Stops the proxy (bounded: its engine's close cancels writes after at most 2 s), unmaps the
  // peers' buffers and frees this rank's. Blocking (cudaFree waits for the GPU). Every rank
  // should stop calling the halves (a barrier) before any destroys its object.
  ~AllToAll();
  AllToAll(const AllToAll&) = delete;
  AllToAll& operator=(const AllToAll&) = delete;

  const AllToAllConfig& config() const;
  const Layout& layout() const;

  // This rank's export: versioned bytes (the configuration, the GPU, a CUDA IPC handle, and with
  // peers on other nodes the proxy's engine address and area descriptor).
  Bytes handle() const;
  // Maps the buffer of every peer of this node, and starts the proxy towards the others.
  // `handles`: every rank's handle() in rank order (this rank's included). Blocking; once.
  // Errors: kInvalidArgument (wrong count, a handle out of its rank's place, a peer configured
  // differently: the field is named), kAlreadyExists (connected already), kRemoteAccess (CUDA
  // could not map a peer's buffer: no peer access, or the same process).
  Status connect(const std::vector<Bytes>& handles);

  // The halves: enqueue on `cuda_stream` (a cudaStream_t; null: the legacy default stream).
  // Errors: the argument checks' kInvalidArgument; kInvalidArgument for a half out of order or
  // before connect(); the recorded GPU failure (kTimeout, kInvalidArgument); kFabric when a
  // launch fails.
  Status dispatch_send(const DispatchSendArgs& args, void* cuda_stream);
  Status dispatch_recv(const DispatchRecvArgs& args, void* cuda_stream);
  Status combine_send(const CombineSendArgs& args, void* cuda_stream);
  Status combine_recv(const CombineRecvArgs& args, void* cuda_stream);

  // The first failure a kernel recorded, or ok. Never blocks (reads pinned host memory): call it
  // after synchronising with the stream to learn about the launches before it.
  Status check() const;
  // The proxy's counters (zero without peers on other nodes). Never blocks; any thread.
  ProxyStats proxy_stats() const;
  // Where the proxy's areas are, as resolved from AllToAllConfig::proxy_memory: "none" (no peers
  // on other nodes), "host" or "gpu" (GPU memory the proxy's engine reaches itself).
  std::string proxy_memory() const;

  class Impl;

 private:
  explicit AllToAll(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace fabric::ep
