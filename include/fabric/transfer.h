// Transfer requests: what a sender can submit to a TransferEngine.
//
// Every request is validated in full before anything is posted; a request that fails
// validation is rejected at once with a Status naming the field at fault, and no callback
// runs for it.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <vector>

#include "fabric/address.h"
#include "fabric/status.h"

namespace fabric {

using TransferId = uint64_t;

class CompletionCounter;

// Exactly one of the two runs, once per accepted transfer, on the engine's callback thread,
// after every work request of every NIC the transfer used has completed. Either may be empty.
// A callback that throws is logged and otherwise ignored: it never stops the engine.
struct Callbacks {
  std::function<void()> on_done;
  std::function<void(const Status&)> on_error;
  // Counter-style completion: counted here by the worker thread itself the moment the transfer
  // ends (before on_done or on_error is queued, if set): no thread hop, no wake-up, no user code
  // on the worker. Null: none. It must outlive the transfer.
  CompletionCounter* counter = nullptr;
};

// Completions as counts, for callers that poll (a GPU proxy loop, an event loop) instead of
// taking callbacks: submit with counter.callbacks() (or set Callbacks::counter), then read
// done() / failed(), which are plain atomic loads. Thread-safe; one counter may serve any number
// of transfers on any engines, and must outlive them all.
class CompletionCounter {
 public:
  CompletionCounter() = default;
  CompletionCounter(const CompletionCounter&) = delete;
  CompletionCounter& operator=(const CompletionCounter&) = delete;

  // Callbacks that count into this counter and run nothing else.
  Callbacks callbacks() {
    Callbacks c;
    c.counter = this;
    return c;
  }
  uint64_t done() const { return done_.load(std::memory_order_acquire); }
  uint64_t failed() const { return failed_.load(std::memory_order_acquire); }
  uint64_t ended() const { return done() + failed(); }
  // The first failure counted, or ok.
  Status first_error() const {
    std::lock_guard lock(mu_);
    return first_error_;
  }
  // Polls until ended() >= n (yielding, then napping 50 us between looks) or the timeout;
  // returns whether it got there. Blocks.
  bool wait(uint64_t n, std::chrono::milliseconds timeout) const;
  // Counts one ended transfer (the engine calls this; so may a caller's own code).
  void record(const Status& outcome) {
    if (outcome.is_ok()) {
      done_.fetch_add(1, std::memory_order_acq_rel);
      return;
    }
    {
      std::lock_guard lock(mu_);
      if (first_error_.is_ok()) first_error_ = outcome;
    }
    failed_.fetch_add(1, std::memory_order_acq_rel);
  }

 private:
  std::atomic<uint64_t> done_{0};
  std::atomic<uint64_t> failed_{0};
  mutable std::mutex mu_;
  Status first_error_;
};

// How a single write is spread over the NICs of the group.
struct Routing {
  enum class Kind { kSharded, kPinned };
  Kind kind = Kind::kSharded;
  // kSharded: split into at most this many shards, rotated across NICs (0: one per NIC).
  // Writes below Config::shard_min_bytes are never split.
  uint32_t shards = 0;
  // kPinned: the local NIC (rail) to use; the peer's NIC of the same rail receives.
  uint32_t nic = 0;

  static Routing sharded(uint32_t shards = 0) { return {Kind::kSharded, shards, 0}; }
  static Routing pinned(uint32_t nic) { return {Kind::kPinned, 0, nic}; }
};

// One contiguous range into one remote range. With an immediate, the receiver counts exactly
// one arrival of it, however many shards the write was split into: the data shards are
// written first and the immediate follows once all of them are complete.
struct SingleWrite {
  MemoryHandle src;
  uint64_t src_offset = 0;
  RemoteMemory dst;
  uint64_t dst_offset = 0;
  uint64_t length = 0;
  std::optional<uint32_t> imm;
  Routing routing;
};

// The KV-cache pattern: page i of the transfer copies page_bytes from
// src_offset + src_pages[i] * src_stride to dst_offset + dst_pages[i] * dst_stride.
// One work request per page; with an immediate, the receiver counts one arrival per page.
// Pages are split evenly across the group's NICs in contiguous runs. Strides may be smaller
// than a page (source pages that overlap are read as they are). Destination pages that
// overlap are accepted, but writes land in no set order: which page's bytes the overlap ends up
// holding is unspecified, as for any two writes to the same bytes.
struct PagedWrite {
  MemoryHandle src;
  RemoteMemory dst;
  uint64_t page_bytes = 0;
  std::vector<uint32_t> src_pages;
  uint64_t src_stride = 0;
  uint64_t src_offset = 0;
  std::vector<uint32_t> dst_pages;
  uint64_t dst_stride = 0;
  uint64_t dst_offset = 0;
  std::optional<uint32_t> imm;
};

// A one-sided read: `length` bytes of a peer's region `src` (its descriptor, registered
// readable: RegisterOptions::remote_read), `src_offset` bytes from its start, into the local
// region `dst` at `dst_offset`. Sharded over the group's NICs like a write, and moved to another
// NIC when one fails (a read is idempotent). on_done runs once every byte is in local memory.
// The owner is told nothing: a caller that wants it to know sends a message.
struct SingleRead {
  MemoryHandle dst;
  uint64_t dst_offset = 0;
  RemoteMemory src;
  uint64_t src_offset = 0;
  uint64_t length = 0;
  Routing routing;
};

// Pages of a peer's region into pages of a local one: page src_pages[i] of `src` (at
// src_offset + src_pages[i] * src_stride) into page dst_pages[i] of `dst`. One read per page,
// spread over the group's NICs.
struct PagedRead {
  MemoryHandle dst;
  RemoteMemory src;
  uint64_t page_bytes = 0;
  std::vector<uint32_t> src_pages;
  uint64_t src_stride = 0;
  uint64_t src_offset = 0;
  std::vector<uint32_t> dst_pages;
  uint64_t dst_stride = 0;
  uint64_t dst_offset = 0;
};

// A set of peer group addresses that scatter and barrier address together. Made by
// TransferEngine::add_peer_group.
struct PeerGroup {
  uint64_t id = 0;
  friend bool operator==(const PeerGroup&, const PeerGroup&) = default;
};

struct ScatterTarget {
  RemoteMemory dst;  // its owner must be a member of the scatter's peer group
  uint64_t length = 0;
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
};

// The MoE pattern: one source region to many peers. With an immediate, each target's receiver
// counts exactly one arrival per target addressed to it.
struct Scatter {
  enum class Sharding {
    kByPeer,   // each target goes whole to one NIC, targets rotated across NICs
    kByBytes,  // each target large enough is split across all NICs (64-bit exact lengths)
  };
  MemoryHandle src;
  PeerGroup group;
  std::vector<ScatterTarget> targets;
  std::optional<uint32_t> imm;
  Sharding sharding = Sharding::kByPeer;
};

// A zero-byte write with an immediate to every member of a group: each member counts one
// arrival. Written from local NIC `nic` to each member's NIC on the same rail.
struct Barrier {
  PeerGroup group;
  uint32_t imm = 0;
  uint32_t nic = 0;
  uint32_t local_group = 0;  // the local device group that sends
};

// One zero-byte write with an immediate, from local NIC `nic` to the peer's NIC on that rail.
struct ImmWrite {
  Address peer;
  uint32_t imm = 0;
  uint32_t nic = 0;
  uint32_t local_group = 0;  // the local device group that sends
};

}  // namespace fabric
