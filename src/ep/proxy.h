// fabric::ep's inter-node proxy (docs/moe.md, "Between nodes"): a host thread that carries the
// kernels' rounds to and from the ranks of other nodes through a TransferEngine group of its own
// in caller-driven progress, following the schedule (ep/schedule.h: which bytes go to which peer,
// with which immediates, and where things are in the proxy's two regions). Implemented in
// proxy.cc.
//
// Host-only (no CUDA): built and unit-tested everywhere (tests/ep/ep_proxy_test.cc, where a
// test double named FakeGpu plays the kernels' part on host memory).
#pragma once

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

#include "ep/schedule.h"
#include "fabric/address.h"
#include "fabric/ep.h"
#include "fabric/status.h"
#include "fabric/transfer.h"

namespace fabric {
class TransferEngine;
}

namespace fabric::ep {

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
