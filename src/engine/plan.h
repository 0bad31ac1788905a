// Sharding plans: how a transfer is split across the NICs of a device group. Pure functions,
// so that every policy is unit-tested without a fabric.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "fabric/status.h"
#include "fabric/transfer.h"

namespace fabric::engine {

struct ShardParams {
  uint64_t min_bytes;     // below this, one shard
  uint64_t alignment;     // shard boundaries are multiples of this
  uint64_t max_wr_bytes;  // the largest work request the NICs take
};

// A piece of a write: `length` bytes at `offset` from the write's start, on local NIC `domain`.
struct Shard {
  uint32_t domain;
  uint64_t offset;
  uint64_t length;
  friend bool operator==(const Shard&, const Shard&) = default;
};

// Weighted sharding: `weights[i]` is NIC i's share weight (the worker's measured rate, bytes
// per second). Empty: all equal. A zero weight means "not measured yet" and counts as the
// largest measured one; a weight within 1/kWeightSnapDivisor of the largest counts as the
// largest (measurements of equal links differ by a few percent, and an uneven split of equal
// links costs what it shifts); every weight is raised to at least 1/kWeightFloorDivisor of the
// largest (so a slow or recovered NIC keeps getting work, and with it a fresh measurement).
// When the NICs a plan uses end up with equal weights, the plan is exactly the unweighted one.
inline constexpr uint64_t kWeightSnapDivisor = 8;
inline constexpr uint64_t kWeightFloorDivisor = 16;

// Splits a single write. Sharded: at most routing.shards (0: all) shards on NICs rotation,
// rotation + 1, ... (mod num_domains); with equal weights of equal aligned size, the last taking
// the remainder; with unequal weights shard i takes about length * w_i / sum(w) (whole
// alignment units, largest remainders first), the last shard also the bytes below one unit.
// Pinned: everything on routing.nic. Pieces larger than max_wr_bytes are split further on the
// same NIC. A zero-length write is one zero-length shard. Covers [0, length) exactly.
std::vector<Shard> plan_single(uint64_t length, uint32_t num_domains, const Routing& routing,
                               uint32_t rotation, const ShardParams& params,
                               std::span<const uint64_t> weights = {});
// The same into `out` (cleared first; its buffer reused): no allocation for a plan of equal
// weights once `out` has grown.
void plan_single(std::vector<Shard>& out, uint64_t length, uint32_t num_domains,
                 const Routing& routing, uint32_t rotation, const ShardParams& params,
                 std::span<const uint64_t> weights = {});

// Splits `count` items (pages, targets) into one contiguous run per NIC; run i goes to NIC
// (rotation + i) mod num_domains. Equal weights: sizes differing by at most one, the first runs
// the larger. Unequal: run i takes about count * w_i / sum(w) items. Empty runs are omitted.
struct Run {
  uint32_t domain;
  size_t begin;
  size_t end;
  friend bool operator==(const Run&, const Run&) = default;
};
std::vector<Run> split_even(size_t count, uint32_t num_domains, uint32_t rotation,
                            std::span<const uint64_t> weights = {});
// The same into `out` (cleared first): no allocation with equal weights once `out` has grown.
void split_even(std::vector<Run>& out, size_t count, uint32_t num_domains, uint32_t rotation,
                std::span<const uint64_t> weights = {});

// Failover (docs/failover.md): plans over the NICs that are up. `up[i]` says whether NIC i
// of the group is up; when none is, every NIC counts as up (the transfer then fails by the
// peer's timeout instead of at submission).
//
// plan_single over the up NICs: sharded writes rotate over the up NICs only, k-of-N sharding
// takes k of them; a write pinned to a NIC that is down goes to failover_nic() instead.
// `weights` (empty, or one per NIC of the group) weigh the up NICs only: NICs that are down get
// nothing.
std::vector<Shard> plan_single_up(uint64_t length, const std::vector<bool>& up,
                                  const Routing& routing, uint32_t rotation,
                                  const ShardParams& params,
                                  std::span<const uint64_t> weights = {});
void plan_single_up(std::vector<Shard>& out, uint64_t length, const std::vector<bool>& up,
                    const Routing& routing, uint32_t rotation, const ShardParams& params,
                    std::span<const uint64_t> weights = {});
// split_even over the up NICs, runs carrying real NIC indices.
std::vector<Run> split_even_up(size_t count, const std::vector<bool>& up, uint32_t rotation,
                               std::span<const uint64_t> weights = {});
void split_even_up(std::vector<Run>& out, size_t count, const std::vector<bool>& up,
                   uint32_t rotation, std::span<const uint64_t> weights = {});
// The NIC that takes over the work of NIC `nic`: `nic` itself when it is up, else the
// `salt`-th up NIC after it (mod the up count), else `nic` (none is up).
uint32_t failover_nic(uint32_t nic, const std::vector<bool>& up, uint32_t salt);

// The peer NIC that local NIC `domain` writes to: the same rail, wrapped when the peer has
// fewer NICs. Keys and addresses always come from this rail of the descriptor.
inline uint32_t remote_rail(uint32_t domain, size_t remote_nics) {
  return static_cast<uint32_t>(domain % remote_nics);
}

// Whether [offset, offset + length) fits in `region` bytes (overflow-safe): a submission's
// common case, without a Status.
inline bool in_range(uint64_t offset, uint64_t length, uint64_t region) {
  return offset <= region && length <= region - offset;
}

// kOutOfRange when [offset, offset + length) does not fit in `region` bytes (overflow-safe).
Status check_range(std::string_view what, uint64_t offset, uint64_t length, uint64_t region);

// The offset of page `index` of a paged transfer, base + index * stride, into `out` when a page
// of `page_bytes` there fits in `region` bytes (overflow-safe); else kOutOfRange naming it as
// "<op>: <side>_pages[<i>] = <index>" (`op`: "paged write", "paged read").
Status page_offset(std::string_view op, std::string_view side, size_t i, uint32_t index,
                   uint64_t stride, uint64_t base, uint64_t region, uint64_t page_bytes,
                   uint64_t& out);

}  // namespace fabric::engine
