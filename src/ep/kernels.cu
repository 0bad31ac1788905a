// fabric::ep's kernels (launchers in ep/kernels.h): dispatch and combine with every peer rank.
// For a rank of this node they store straight into its buffer, mapped here with CUDA IPC (over
// NVLink), and raise the Signals words in it; for a rank of another node they stage into this
// rank's proxy areas (pinned host memory, or GPU memory the proxy's NICs reach) and raise the
// proxy's words, which the proxy thread (ep/proxy.h) answers across the fabric. The kernels tell
// the two apart only through Params: the routes the host sets up (ep/params.h) and remote_mask
// (a combine to another node is compact, with slot ids, and read back through the proxy's map).
//
// Memory ordering, in one place (docs/moe.md has the whole protocol):
//  - Data goes to a peer's buffer or a proxy area with ordinary stores, and each signal word
//    with st.release.sys after a __threadfence_system() that follows every block's data stores
//    (the last-block pattern below). The owner's kernels read the word with ld.acquire.sys (the
//    proxy thread with an acquire load), then __syncthreads() (or a kernel boundary) before any
//    thread reads the data. The system scope is the one that covers another GPU and the host.
//  - Data written by a peer is read with ordinary (coherent) loads, never ld.global.nc: the
//    non-coherent path may keep what the same SM read in an earlier round. Only the caller's
//    tensors, which nothing writes while a kernel runs, are read through it.
//  - Every wait gives up after Params::timeout_ns (%globaltimer), sets State::abort and records
//    the failure; a kernel that finds abort set does no work and raises no signal.
#include <cuda_bf16.h>

#include "ep/kernels.h"

namespace fabric::ep::device {

namespace {

constexpr int kWarp = 32;
constexpr unsigned kAllLanes = 0xffffffffu;
constexpr int kCopyThreads = 512;  // dispatch_send, dispatch_recv's copy, combine_send
constexpr int kCopyWarps = kCopyThreads / kWarp;
constexpr int kCountThreads = 1024;  // dispatch_recv's count (one block)
constexpr int kReduceThreads = 256;  // combine_recv
constexpr int kUnroll = 4;           // 16-byte words in flight per lane in a copy

// --- memory access -----------------------------------------------------------------------------

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint32_t load_volatile(const uint32_t* p) {
  return *reinterpret_cast<const volatile uint32_t*>(p);
}

// The caller's tensors (read-only while the kernel runs).
__device__ __forceinline__ uint4 load_input16(const uint8_t* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// Data a peer (or an earlier kernel) wrote.
__device__ __forceinline__ uint4 load16(const uint8_t* p) {
  return *reinterpret_cast<const uint4*>(p);
}

__device__ __forceinline__ void store16(uint8_t* p, uint4 v) {
  *reinterpret_cast<uint4*>(p) = v;
}

// One warp copies `bytes` (a multiple of 16; both ends 16-byte aligned) from the caller's
// tensor at `src` to `dst` (local or a peer's), kUnroll words in flight per lane.
__device__ __forceinline__ void warp_copy_input(uint8_t* dst, const uint8_t* src, uint64_t bytes,
                                                int lane) {
  constexpr uint64_t kStride = 16 * kWarp;
  uint64_t off = 16 * static_cast<uint64_t>(lane);
  for (; off + (kUnroll - 1) * kStride < bytes; off += kUnroll * kStride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = load_input16(src + off + u * kStride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) store16(dst + off + u * kStride, v[u]);
  }
  for (; off < bytes; off += kStride) store16(dst + off, load_input16(src + off));
}

// --- signals and failures ----------------------------------------------------------------------

// Records this rank's first failure in the pinned report; later ones are dropped.
__device__ void record_failure(const Params& p, uint32_t kind, uint32_t half, uint32_t peer,
                               uint32_t round, uint64_t seen, uint64_t detail) {
  if (atomicCAS(&p.state->error_taken, 0u, 1u) != 0u) return;
  volatile ErrorReport* r = p.report;
  r->half = half;
  r->peer = peer;
  r->round = round;
  r->seen = seen;
  r->detail = detail;
  __threadfence_system();
  r->kind = kind;
  __threadfence_system();
}

// Spins until the round in `*word` (bits [shift, shift + 32)) has reached `want` (wrap-safe:
// rounds are 32-bit), then returns true with the word's value in *value. Gives up, returning
// false, once this rank has aborted or after the timeout (then it aborts the rank and records
// the failure against `peer`).
__device__ bool wait_round(const Params& p, const uint64_t* word, int shift, uint32_t want,
                           uint32_t half, int peer, uint32_t round, uint64_t* value) {
  const uint64_t start = now_ns();
  for (;;) {
    const uint64_t v = load_acquire_sys(word);
    if (static_cast<int32_t>(static_cast<uint32_t>(v >> shift) - want) >= 0) {
      *value = v;
      return true;
    }
    if (load_volatile(&p.state->abort) != 0) return false;
    if (now_ns() - start > p.timeout_ns) {
      atomicExch(&p.state->abort, 1u);
      record_failure(p, kTimedOut, half, static_cast<uint32_t>(peer), round, v, 0);
      return false;
    }
  }
}

// The start of every kernel of a half: thread 0 reads the half's round (the last one plus one)
// and whether the rank has aborted. Returns the round; *ok is false after an abort.
__device__ uint32_t begin(const Params& p, Half half, bool* ok) {
  __shared__ uint32_t s_round;
  __shared__ int s_ok;
  if (threadIdx.x == 0) {
    s_round = load_volatile(&p.state->round[half]) + 1;
    s_ok = load_volatile(&p.state->abort) == 0;
  }
  __syncthreads();
  *ok = s_ok != 0;
  return s_round;
}

// Threads [0, world) wait for the round in *words[t] (a word of this rank's own signals, or of its
// proxy area for a rank of another node) to reach `want`; false in every thread of the block if
// any wait failed. Values land in values[t].
__device__ bool wait_all(const Params& p, const uint64_t* const* words, int shift, uint32_t want,
                         Half half, uint32_t round, uint64_t* values) {
  __shared__ int s_ok;
  if (threadIdx.x == 0) s_ok = 1;
  __syncthreads();
  const int t = static_cast<int>(threadIdx.x);
  if (t < p.world) {
    uint64_t v = 0;
    if (!wait_round(p, words[t], shift, want, half, t, round, &v)) s_ok = 0;
    if (values != nullptr) values[t] = v;
  }
  // The acquire loads above, then this barrier, before any thread of the block reads data.
  __syncthreads();
  return s_ok != 0;
}

// The end of every multi-block kernel: true in every thread of the last block to finish, once
// every block's stores (to peers included) are fenced at system scope.
__device__ bool last_block(uint32_t* blocks_done) {
  __shared__ int s_last;
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    s_last = atomicAdd(blocks_done, 1u) == gridDim.x - 1;
    if (s_last) __threadfence_system();  // acquire side: the other blocks' stores come first
  }
  __syncthreads();
  return s_last != 0;
}

// --- dispatch_send -----------------------------------------------------------------------------

// One warp per token: the token goes once to each distinct rank among its top-k experts, into
// that rank's dispatch area for this rank, at a slot taken from State::send_count. The last block
// raises every rank's dispatch flag with the number of entries it got (0 included).
__global__ void __launch_bounds__(kCopyThreads)
    dispatch_send_kernel(const __grid_constant__ Params p, const uint8_t* tokens,
                         const float* scales, const int64_t* topk_idx, const float* topk_weights,
                         uint32_t num_tokens) {
  bool ok = false;
  const uint32_t round = begin(p, kDispatchSend, &ok);
  // Every destination has read what this rank sent it the round before.
  if (ok) {
    ok = wait_all(p, p.dispatch_ack_in, 0, round - 1, kDispatchSend, round, nullptr);
  }
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  if (ok) {
    const uint32_t warps = gridDim.x * kCopyWarps;
    for (uint32_t t = blockIdx.x * kCopyWarps + threadIdx.x / kWarp; t < num_tokens; t += warps) {
      int32_t expert = -1;
      float weight = 0.f;
      if (static_cast<uint32_t>(lane) < p.top_k) {
        const uint64_t at = static_cast<uint64_t>(t) * p.top_k + lane;
        const int64_t e = topk_idx[at];
        if (e >= static_cast<int64_t>(p.num_experts)) {
          record_failure(p, kBadExpert, kDispatchSend, t, round, static_cast<uint64_t>(e), lane);
        } else if (e >= 0) {
          expert = static_cast<int32_t>(e);
        }
        if (topk_weights != nullptr) weight = topk_weights[at];
      }
      const uint32_t rank_bit =
          expert >= 0 ? 1u << (static_cast<uint32_t>(expert) / p.num_local_experts) : 0u;
      for (uint32_t dests = __reduce_or_sync(kAllLanes, rank_bit); dests != 0; dests &= dests - 1) {
        const int d = __ffs(static_cast<int>(dests)) - 1;
        uint32_t slot = 0;
        if (lane == 0) slot = atomicAdd(&p.state->send_count[d], 1u);
        slot = __shfl_sync(kAllLanes, slot, 0);
        uint8_t* entry = p.dispatch_dst[d] + static_cast<uint64_t>(slot) * p.entry_bytes;
        // Metadata: int32 token, int32 experts[top_k], float weights[top_k].
        auto* meta = reinterpret_cast<int32_t*>(entry);
        if (lane == 0) meta[0] = static_cast<int32_t>(t);
        if (static_cast<uint32_t>(lane) < p.top_k) {
          meta[1 + lane] = expert;
          reinterpret_cast<float*>(meta)[1 + p.top_k + lane] = weight;
        }
        warp_copy_input(entry + p.entry_token_offset,
                        tokens + static_cast<uint64_t>(t) * p.token_bytes, p.token_bytes, lane);
        if (scales != nullptr) {
          const float* from = scales + static_cast<uint64_t>(t) * p.scale_columns;
          auto* to = reinterpret_cast<float*>(entry + p.entry_scale_offset);
          for (uint32_t c = lane; c < p.scale_columns; c += kWarp) to[c] = __ldg(from + c);
        }
      }
    }
  }
  if (last_block(&p.state->blocks_done[kDispatchSend]) && threadIdx.x == 0) {
    const bool raise = load_volatile(&p.state->abort) == 0;
    for (int d = 0; d < p.world; ++d) {
      const uint32_t entries = load_volatile(&p.state->send_count[d]);
      p.state->send_count[d] = 0;
      if (raise) {
        store_release_sys(p.dispatch_flag_out[d], (static_cast<uint64_t>(round) << 32) | entries);
      }
    }
    p.state->blocks_done[kDispatchSend] = 0;
    p.state->round[kDispatchSend] = round;
  }
}

// --- dispatch_recv -----------------------------------------------------------------------------

// The entry of slot `slot` of source `source`'s dispatch area (in this rank's buffer, or in its
// proxy area for a source of another node).
__device__ __forceinline__ const uint8_t* entry_of(const Params& p, int source, uint32_t slot) {
  return p.dispatch_src[source] + static_cast<uint64_t>(slot) * p.entry_bytes;
}

// The local expert of a global index, or -1 when it is not this rank's.
__device__ __forceinline__ int32_t local_expert(const Params& p, int32_t expert) {
  if (expert < 0 || static_cast<uint32_t>(expert) >= p.num_experts) return -1;
  const uint32_t first = static_cast<uint32_t>(p.rank) * p.num_local_experts;
  const uint32_t e = static_cast<uint32_t>(expert);
  return e >= first && e < first + p.num_local_experts ? static_cast<int32_t>(e - first) : -1;
}

// One block: waits for every source's flag of this round, counts the rows of each local expert
// and lays them out (experts in order), for dispatch_copy_kernel.
__global__ void __launch_bounds__(kCountThreads)
    dispatch_count_kernel(const __grid_constant__ Params p, int32_t* expert_counts,
                          int32_t* expert_offsets) {
  __shared__ uint64_t s_flag[kMaxRanks];
  __shared__ uint32_t s_start[kMaxRanks + 1];
  __shared__ uint32_t s_rows[kMaxLocalExperts];
  bool ok = false;
  const uint32_t round = begin(p, kDispatchRecv, &ok);
  for (uint32_t e = threadIdx.x; e < p.num_local_experts; e += blockDim.x) s_rows[e] = 0;
  if (ok) {
    ok = wait_all(p, p.dispatch_flag_in, 32, round, kDispatchRecv, round, s_flag);
  }
  if (threadIdx.x == 0) {
    s_start[0] = 0;
    for (int s = 0; s < p.world; ++s) {
      const uint32_t entries = ok ? static_cast<uint32_t>(s_flag[s]) : 0u;
      p.state->recv_count[s] = entries;
      s_start[s + 1] = s_start[s] + entries;
    }
  }
  __syncthreads();
  const uint32_t total_entries = s_start[p.world];
  for (uint32_t i = threadIdx.x; i < total_entries; i += blockDim.x) {
    int s = 0;
    while (s_start[s + 1] <= i) ++s;
    const auto* meta = reinterpret_cast<const int32_t*>(entry_of(p, s, i - s_start[s]));
    for (uint32_t k = 0; k < p.top_k; ++k) {
      const int32_t e = local_expert(p, meta[1 + k]);
      if (e >= 0) atomicAdd(&s_rows[e], 1u);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t row = 0;
    for (uint32_t e = 0; e < p.num_local_experts; ++e) {
      p.expert_offset[e] = row;
      p.expert_cursor[e] = 0;
      expert_counts[e] = static_cast<int32_t>(s_rows[e]);
      if (expert_offsets != nullptr) expert_offsets[e] = static_cast<int32_t>(row);
      row += s_rows[e];
    }
    if (expert_offsets != nullptr) expert_offsets[p.num_local_experts] = static_cast<int32_t>(row);
    p.state->total_rows = row;
    p.state->round[kDispatchRecv] = round;
  }
}

// One warp per received entry: a row for each of its top-k slots whose expert is local, the
// token (and scales) copied into every such row. The last block acknowledges every source.
__global__ void __launch_bounds__(kCopyThreads)
    dispatch_copy_kernel(const __grid_constant__ Params p, uint8_t* out_tokens, float* out_scales,
                         float* out_weights, int32_t* out_source) {
  __shared__ uint32_t s_start[kMaxRanks + 1];
  __shared__ int32_t s_row[kCopyWarps][kMaxTopK];
  __shared__ uint32_t s_round;
  __shared__ int s_ok;
  if (threadIdx.x == 0) {
    s_round = load_volatile(&p.state->round[kDispatchRecv]);  // set by dispatch_count_kernel
    s_ok = load_volatile(&p.state->abort) == 0;
    s_start[0] = 0;
    for (int s = 0; s < p.world; ++s) {
      s_start[s + 1] = s_start[s] + load_volatile(&p.state->recv_count[s]);
    }
  }
  __syncthreads();
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  const uint32_t total_entries = s_ok ? s_start[p.world] : 0u;
  const uint32_t warps = gridDim.x * kCopyWarps;
  for (uint32_t i = blockIdx.x * kCopyWarps + warp; i < total_entries; i += warps) {
    int s = 0;
    while (s_start[s + 1] <= i) ++s;
    const uint8_t* entry = entry_of(p, s, i - s_start[s]);
    const auto* meta = reinterpret_cast<const int32_t*>(entry);
    const int32_t token = meta[0];
    int32_t e = -1;
    float weight = 0.f;
    if (static_cast<uint32_t>(lane) < p.top_k) {
      e = local_expert(p, meta[1 + lane]);
      weight = reinterpret_cast<const float*>(meta)[1 + p.top_k + lane];
    }
    const uint32_t mine = __ballot_sync(kAllLanes, e >= 0);
    if (e >= 0) {
      const uint32_t row = p.expert_offset[e] + atomicAdd(&p.expert_cursor[e], 1u);
      s_row[warp][__popc(mine & ((1u << lane) - 1))] = static_cast<int32_t>(row);
      p.rows[row] = RowSource{s, token, lane, 0};
      if (out_weights != nullptr) out_weights[row] = weight;
      if (out_source != nullptr) {
        out_source[2 * static_cast<uint64_t>(row)] = s;
        out_source[2 * static_cast<uint64_t>(row) + 1] = token;
      }
    }
    __syncwarp();
    const int rows = __popc(mine);
    const uint8_t* from = entry + p.entry_token_offset;
    for (uint64_t off = 16 * static_cast<uint64_t>(lane); off < p.token_bytes; off += 16 * kWarp) {
      const uint4 v = load16(from + off);
      for (int r = 0; r < rows; ++r) {
        store16(out_tokens + static_cast<uint64_t>(s_row[warp][r]) * p.token_bytes + off, v);
      }
    }
    if (out_scales != nullptr) {
      const auto* scale = reinterpret_cast<const float*>(entry + p.entry_scale_offset);
      for (uint32_t c = lane; c < p.scale_columns; c += kWarp) {
        const float v = scale[c];
        for (int r = 0; r < rows; ++r) {
          out_scales[static_cast<uint64_t>(s_row[warp][r]) * p.scale_columns + c] = v;
        }
      }
    }
    __syncwarp();  // s_row is rewritten by the warp's next entry
  }
  // Every read of this rank's dispatch areas is done: the sources may write them again.
  if (last_block(&p.state->blocks_done[kDispatchRecv]) && threadIdx.x == 0) {
    if (s_ok && load_volatile(&p.state->abort) == 0) {
      for (int s = 0; s < p.world; ++s) {
        store_release_sys(p.dispatch_ack_out[s], s_round);
      }
    }
    p.state->blocks_done[kDispatchRecv] = 0;
  }
}

// --- combine_send ------------------------------------------------------------------------------

// One warp per row of the last dispatch_recv: the row's expert output goes into its token's
// rank's combine area, at (token, top-k slot); for a rank of another node, into the next place
// of the compact staging for it, with the row's slot id beside it. The last block raises every
// rank's combine flag.
__global__ void __launch_bounds__(kCopyThreads)
    combine_send_kernel(const __grid_constant__ Params p, const uint8_t* expert_out) {
  bool ok = false;
  const uint32_t round = begin(p, kCombineSend, &ok);
  // Every rank has read its combine area of the round before.
  if (ok) {
    ok = wait_all(p, p.combine_ack_in, 0, round - 1, kCombineSend, round, nullptr);
  }
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const uint64_t row_bytes = 2ull * p.hidden;
  if (ok) {
    const uint32_t rows = load_volatile(&p.state->total_rows);
    const uint32_t warps = gridDim.x * kCopyWarps;
    for (uint32_t i = blockIdx.x * kCopyWarps + threadIdx.x / kWarp; i < rows; i += warps) {
      const RowSource src = p.rows[i];
      const uint64_t slot = static_cast<uint64_t>(src.token) * p.top_k + src.slot;
      uint8_t* to = nullptr;
      if ((p.remote_mask >> src.rank) & 1u) {
        uint32_t place = 0;
        if (lane == 0) {
          place = atomicAdd(&p.state->combine_extent[src.rank], 1u);
          p.combine_ids_dst[src.rank][place] = static_cast<uint32_t>(slot);
        }
        place = __shfl_sync(kAllLanes, place, 0);
        to = p.combine_dst[src.rank] + place * row_bytes;
      } else {
        to = p.combine_dst[src.rank] + slot * row_bytes;
        if (lane == 0) atomicMax(&p.state->combine_extent[src.rank], src.token + 1u);
      }
      warp_copy_input(to, expert_out + static_cast<uint64_t>(i) * row_bytes, row_bytes, lane);
    }
  }
  if (last_block(&p.state->blocks_done[kCombineSend]) && threadIdx.x == 0) {
    const bool raise = load_volatile(&p.state->abort) == 0;
    for (int d = 0; d < p.world; ++d) {
      const uint32_t extent = load_volatile(&p.state->combine_extent[d]);
      p.state->combine_extent[d] = 0;
      if (raise) {
        store_release_sys(p.combine_flag_out[d], (static_cast<uint64_t>(round) << 32) | extent);
      }
    }
    p.state->blocks_done[kCombineSend] = 0;
    p.state->round[kCombineSend] = round;
  }
}

// --- combine_recv ------------------------------------------------------------------------------

// One block per token: out[t] = sum over valid top-k slots k of weight[t, k] x row (t, k), in
// fp32, rounded to bf16. Row (t, k) is where its expert's rank wrote it: this rank's combine area
// for a rank of this node; for one of another node, the place the proxy's map gives in that
// rank's compact receive area. The last block acknowledges every rank.
__global__ void __launch_bounds__(kReduceThreads)
    combine_recv_kernel(const __grid_constant__ Params p, const int64_t* topk_idx,
                        const float* topk_weights, uint32_t num_tokens, uint8_t* out) {
  __shared__ float s_weight[kMaxTopK];
  __shared__ const uint8_t* s_row[kMaxTopK];
  __shared__ uint32_t s_slots;  // bit k: slot k has a valid expert (a slot without one was
                                // never dispatched, and its combine row holds nothing)
  bool ok = false;
  const uint32_t round = begin(p, kCombineRecv, &ok);
  if (ok) {
    ok = wait_all(p, p.combine_flag_in, 32, round, kCombineRecv, round, nullptr);
  }
  const uint64_t row_bytes = 2ull * p.hidden;
  const uint32_t words = p.hidden / 8;  // 8 bf16 in 16 bytes
  for (uint32_t t = blockIdx.x; ok && t < num_tokens; t += gridDim.x) {
    if (threadIdx.x < kWarp) {
      const uint64_t at = static_cast<uint64_t>(t) * p.top_k + threadIdx.x;
      bool valid = false;
      if (threadIdx.x < p.top_k) {
        const int64_t e = topk_idx[at];
        valid = e >= 0 && e < static_cast<int64_t>(p.num_experts);
        s_weight[threadIdx.x] = valid ? topk_weights[at] : 0.f;
        const uint32_t owner = valid ? static_cast<uint32_t>(e) / p.num_local_experts : 0u;
        // A row from another node is where the proxy's map says (the map is in host memory,
        // ordered before the flag waited for above; the proxy checks every index it writes).
        s_row[threadIdx.x] =
            (p.remote_mask >> owner) & 1u
                ? p.combine_src[owner] +
                      static_cast<uint64_t>(load_volatile(p.combine_map + at)) * row_bytes
                : p.combine_src[owner] + at * row_bytes;
      }
      const uint32_t slots = __ballot_sync(kAllLanes, valid);
      if (threadIdx.x == 0) s_slots = slots;
    }
    __syncthreads();
    const uint32_t slots = s_slots;
    for (uint32_t w = threadIdx.x; w < words; w += blockDim.x) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (uint32_t rest = slots; rest != 0; rest &= rest - 1) {
        const uint32_t k = static_cast<uint32_t>(__ffs(static_cast<int>(rest)) - 1);
        const float weight = s_weight[k];
        const uint4 v = load16(s_row[k] + 16ull * w);
        const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = __bfloat1622float2(h[j]);
          acc[2 * j] += weight * f.x;
          acc[2 * j + 1] += weight * f.y;
        }
      }
      uint4 r;
      auto* o = reinterpret_cast<__nv_bfloat162*>(&r);
#pragma unroll
      for (int j = 0; j < 4; ++j) o[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
      store16(out + static_cast<uint64_t>(t) * row_bytes + 16ull * w, r);
    }
    __syncthreads();  // s_weight is rewritten for the next token
  }
  // Every read of this rank's combine area is done: the ranks may write it again.
  if (last_block(&p.state->blocks_done[kCombineRecv]) && threadIdx.x == 0) {
    if (load_volatile(&p.state->abort) == 0) {
      for (int d = 0; d < p.world; ++d) {
        store_release_sys(p.combine_ack_out[d], round);
      }
    }
    p.state->blocks_done[kCombineRecv] = 0;
    p.state->round[kCombineRecv] = round;
  }
}

uint32_t blocks_for(uint64_t items, uint64_t per_block, uint32_t cap) {
  const uint64_t n = (items + per_block - 1) / per_block;
  return static_cast<uint32_t>(n < 1 ? 1 : (n > cap ? cap : n));
}

}  // namespace

cudaError_t launch_dispatch_send(const Params& p, const void* tokens, const float* scales,
                                 const int64_t* topk_idx, const float* topk_weights,
                                 uint32_t num_tokens, cudaStream_t stream) {
  const uint32_t blocks = blocks_for(num_tokens, kCopyWarps, p.num_sms);
  dispatch_send_kernel<<<blocks, kCopyThreads, 0, stream>>>(
      p, static_cast<const uint8_t*>(tokens), scales, topk_idx, topk_weights, num_tokens);
  return cudaGetLastError();
}

cudaError_t launch_dispatch_recv(const Params& p, void* out_tokens, float* out_scales,
                                 float* out_weights, int32_t* out_source, int32_t* expert_counts,
                                 int32_t* expert_offsets, cudaStream_t stream) {
  dispatch_count_kernel<<<1, kCountThreads, 0, stream>>>(p, expert_counts, expert_offsets);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  // The entries: world x max_tokens at most, one warp each.
  const uint64_t entries = p.max_recv_rows / p.top_k;
  const uint32_t blocks = blocks_for(entries, kCopyWarps, p.num_sms);
  dispatch_copy_kernel<<<blocks, kCopyThreads, 0, stream>>>(p, static_cast<uint8_t*>(out_tokens),
                                                            out_scales, out_weights, out_source);
  return cudaGetLastError();
}

cudaError_t launch_combine_send(const Params& p, const void* expert_out, cudaStream_t stream) {
  const uint32_t blocks = blocks_for(p.max_recv_rows, kCopyWarps, p.num_sms);
  combine_send_kernel<<<blocks, kCopyThreads, 0, stream>>>(p,
                                                           static_cast<const uint8_t*>(expert_out));
  return cudaGetLastError();
}

cudaError_t launch_combine_recv(const Params& p, const int64_t* topk_idx, const float* topk_weights,
                                uint32_t num_tokens, void* out, cudaStream_t stream) {
  const uint32_t blocks = blocks_for(num_tokens, 1, 2 * p.num_sms);
  combine_recv_kernel<<<blocks, kReduceThreads, 0, stream>>>(p, topk_idx, topk_weights, num_tokens,
                                                             static_cast<uint8_t*>(out));
  return cudaGetLastError();
}

}  // namespace fabric::ep::device
