// The operations fabric-bench measures on the engine. Each run is one pass: a fixed number
// of transfers with a window of them in flight, timed from the first submission until every
// transfer's done callback has run and every peer has counted every immediate; then, with
// the clock stopped, the pass is verified: every destination range written in the pass
// against the source range it came from (and, for paged writes, the gaps between pages
// against the poison they must still hold), every immediate counted exactly.
//
// Reads go the other way: the client reads from peer 0's source buffer (registered readable,
// RegisterOptions::remote_read, and filled with the client's own data pattern, so that it
// holds the same bytes as the client's source buffer) into a destination buffer of its own,
// poisoned before each pass; a read pass ends when every done callback has run (a read carries
// no immediate) and is verified at the client, against its own source buffer.
#pragma once

#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "fabric/fabric.h"
#include "harness.h"
#include "peer.h"
#include "sys_counters.h"

namespace fabric::bench {

enum class Op { kSingle, kPaged, kImm, kScatter, kBarrier, kRead, kPagedRead, kReadRtt };
std::string_view op_name(Op op);
bool is_read(Op op);

// The size of the read round trips (Op::kReadRtt).
constexpr uint64_t kReadRttBytes = 4 * kKiB;

// The gap between pages of a paged write: stride = page + kPageGap (the reference's layout).
constexpr uint64_t kPageGap = 128;

// What one row of the table measures.
struct Row {
  Op op = Op::kSingle;
  uint64_t bytes = 0;       // single, read: bytes per transfer; scatter: bytes per target
  uint64_t page_bytes = 0;  // paged, paged read
  uint64_t pages = 0;       // paged, paged read: pages per transfer
  uint32_t peers = 1;       // scatter, barrier
  std::string label() const;
};

// How much one pass does.
struct Budget {
  uint64_t pass_bytes = 256 * kMiB;  // payload per pass (at least two transfers' worth)
  uint64_t max_transfers = 5'000;    // transfers per pass (single, scatter)
  uint64_t max_pages = 20'000;       // pages per pass (paged; at least one transfer's)
  uint64_t window = 32;              // transfers in flight
  uint64_t rounds = 1'000;           // round trips (imm latency, barrier, read round trips)
  uint64_t messages = 20'000;        // imm-only writes (message rate)
};

// The shape of a pass of a row, as the budget makes it.
struct Plan {
  uint64_t transfers = 0;  // per pass
  uint64_t window = 0;
  uint64_t wrs = 0;  // work requests per pass: writes, reads, pages, targets or messages
  uint64_t bytes = 0;
};
Plan plan_for(const Row& row, const Budget& budget);

// One pass, measured.
struct PassResult {
  double seconds = 0;  // the timed phase (imm: the message-rate phase)
  uint64_t bytes = 0;
  uint64_t ops = 0;    // writes, reads, pages, messages or barrier rounds
  double post_us = 0;  // client thread time inside submit(), per work request
  // The client engine's worker per op, from TransferEngine::stats(): times a submission woke
  // it (an eventfd write) and times it slept (NaN where not measured).
  double wakeups_per_op = std::nan("");
  double sleeps_per_op = std::nan("");
  // The client process per op (every thread of it), counted by the kernel (SysCounters):
  // system calls and context switches (NaN where the kernel does not count them).
  double syscalls_per_op = std::nan("");
  double switches_per_op = std::nan("");
  double cpu_seconds = 0;      // client and peers, during the timed phase
  std::vector<double> lat_us;  // per transfer (submit to done); imm, barrier: round trips
};

// The client's side of every pass: its engine, its source buffer, and the peer processes.
class Session {
 public:
  using StartPeer = std::function<Result<std::unique_ptr<PeerClient>>()>;

  Session(TransferEngine& engine, Registration src, const PageBuffer& src_bytes,
          StartPeer start_peer, uint64_t seed);
  ~Session();

  // Makes sure `n` peers run (peer 0 is the one single, paged and imm writes go to).
  Status ensure_peers(uint32_t n);
  // One untimed immediate to each peer, so that connection set-up is charged to no pass.
  Status warm_up();
  // Runs one pass of `row`. `iteration` varies the data and the page choice.
  Result<PassResult> run(const Row& row, const Budget& budget, uint32_t iteration);
  // Asks every peer to quit; the first error.
  Status quit_peers();

  // The client's group is caller-driven (GroupConfig::caller_progress): every wait of a timed
  // phase runs progress() on the waiting thread; between phases a thread of the session's does.
  void set_caller_driven(bool on);
  size_t num_peers() const { return peers_.size(); }
  PeerClient& peer(size_t i) { return *peers_[i]; }

 private:
  struct Expectation {
    size_t peer;
    uint32_t imm;
    uint64_t count;
  };
  struct Window {
    uint64_t submitted = 0;
    double seconds = 0;
    double submit_seconds = 0;
    uint64_t wakeups = 0;  // the client worker's, over the window (TransferEngine::stats())
    uint64_t sleeps = 0;
    SysCounters::Totals sys;  // the client process's, over the window
    std::vector<double> lat_us;
    Status error;
  };
  using SubmitFn = std::function<Result<TransferId>(uint64_t i, Callbacks cb)>;

  Window run_window(uint64_t count, uint64_t window, const SubmitFn& submit,
                    const std::vector<Expectation>& expects);
  // The window's counts per op of `r` (r.ops set): wake-ups, sleeps, system calls, switches.
  static void count_per_op(PassResult& r, const Window& w);
  Result<double> cpu_of(size_t peers);
  uint64_t src_offset(uint32_t iteration, uint64_t i, uint64_t size) const;
  // Compares a peer's hash of `count` ranges at first + k * step with the expected one;
  // narrows a mismatch down to its first range, named by describe(k).
  Status verify(PeerClient& peer, uint64_t len, uint64_t first, uint64_t step, uint64_t count,
                const std::function<uint64_t(uint64_t k)>& expected,
                const std::function<std::string(uint64_t k)>& describe);
  // The same for the client's read destination: range k at first + k * step, the first bad
  // one named by describe(k).
  Status verify_local(uint64_t len, uint64_t first, uint64_t step, uint64_t count,
                      const std::function<uint64_t(uint64_t k)>& expected,
                      const std::function<std::string(uint64_t k)>& describe) const;
  // What reads need: peer 0's readable source (the client's pattern, as large as the client's
  // source buffer) and a registered destination of at least `dst_bytes` here, poisoned up to
  // `dst_bytes`; then serve_reads(true).
  Status prepare_reads(uint64_t dst_bytes);
  // A caller-driven peer 0 keeps driving its group without naps while `on` (PeerClient::
  // serving): reads make no completion at their owner. Nothing to do with a worker thread.
  Status serve_reads(bool on);
  Result<PeerGroup> group_of(uint32_t n);
  uint32_t fresh_imm() { return next_imm_++; }
  std::function<bool()> driver();
  // Held while a phase's waits drive the group: the between-phases thread stands aside.
  std::shared_ptr<void> foreground();

  Result<PassResult> single(const Row& row, const Budget& b, uint32_t iteration);
  Result<PassResult> paged(const Row& row, const Budget& b, uint32_t iteration);
  Result<PassResult> imm(const Row& row, const Budget& b, uint32_t iteration);
  Result<PassResult> scatter(const Row& row, const Budget& b, uint32_t iteration);
  Result<PassResult> barrier(const Row& row, const Budget& b, uint32_t iteration);
  Result<PassResult> read(const Row& row, const Budget& b, uint32_t iteration);
  Result<PassResult> paged_read(const Row& row, const Budget& b, uint32_t iteration);
  Result<PassResult> read_rtt(const Row& row, const Budget& b, uint32_t iteration);

  TransferEngine& engine_;
  Registration src_;
  const PageBuffer& src_bytes_;
  StartPeer start_peer_;
  uint64_t seed_;
  std::vector<std::unique_ptr<PeerClient>> peers_;
  std::map<uint32_t, PeerGroup> groups_;
  uint32_t next_imm_ = 1000;
  SysCounters sys_;
  // The destination of reads (allocated at the first read row, grown as rows need) and its
  // registration with the client's engine.
  PageBuffer read_dst_;
  std::optional<Registration> read_dst_reg_;
  std::optional<uint64_t> src_hash_;  // hash_bytes of the whole source buffer, once
  bool caller_driven_ = false;
  std::mutex between_mu_;
  std::condition_variable between_cv_;
  int foreground_ = 0;  // phases whose waits drive the group now
  bool stop_between_ = false;
  std::thread between_;
};

}  // namespace fabric::bench
