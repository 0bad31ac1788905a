// The RL weight push over one TransferEngine per rank: the training side's sender and the
// inference side's receiver of fabric/weights.h's schedule.
//
//   inference rank r                                   training rank t
//   WeightReceiver::prepare(N): imm = imm_base + k
//     (never reused), expect_imm(imm, writes_into(r)),
//     Ready(N, imm, r, copy) -> every training rank --> WeightSender::begin(N): waits for the
//                                                     Ready of every rank it writes into
//                                                     stage(param, sources) per parameter, in
//                                                     order(): projected into the staging
//                                                     ring; every ~ring/4 bytes a batch: one
//                                                     stream sync, then its writes posted (one
//                                                     scatter per inference rank, paged writes
//                                                     for strided entries, pinned writes with
//                                                     several NICs)
//                   <---- writes, each run carrying imm, into copy `copy` ----
//   writes_into(r) counted -> on_complete(N)          finish(): the last batch, every write done
//
// A training rank that leaves (fail_trainer, from a membership watch) fails the pending version
// with kPeerUnreachable; a version not complete within ReceiverOptions::timeout fails with
// kTimeout;
// close() fails it with kClosed. The failed version's expectation is withdrawn and its
// immediate never reused, so a late write of it can never complete a later version.
//
// Ownership of the engine. A WeightSender installs the engine's receive handler (group 0); a
// WeightReceiver uses expect_imm on [imm_base, imm_base + 2^24) and installs nothing. Give
// each sender its own engine.
//
// Threads. Every call may come from any thread. WeightSender's begin/stage/finish/push block
// (documented on each) and are one push at a time; WeightReceiver's calls never block but
// close(). Callbacks run on the engine's callback thread (completion), the receiver's timer
// thread (timeouts) or the thread that calls fail_trainer / close, never with a lock held.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "fabric/engine.h"
#include "fabric/weights.h"

namespace fabric::weights {

// --- bytes ------------------------------------------------------------------------------------

// "Version `version` may be written: count immediate `imm`, into copy `copy`", from inference
// rank `inference` to every training rank. 21 bytes: "FWRD", u64, u32, u32, u8.
struct Ready {
  uint64_t version = 0;
  uint32_t imm = 0;
  uint32_t inference = 0;
  uint8_t copy = 0;
  friend bool operator==(const Ready&, const Ready&) = default;
};
inline constexpr size_t kReadyBytes = 21;
Bytes encode(const Ready& ready);
// Another message (wrong length or tag) is kInvalidArgument: the sender ignores it.
Result<Ready> decode_ready(std::span<const std::byte> bytes);

// What an inference rank publishes: its layout, its registered regions' descriptors and, per
// parameter of the layout and per copy (two in flip mode), the region and the byte offset of
// that copy's tensor in it.
struct Place {
  uint32_t region = 0;
  uint64_t offset = 0;
  friend bool operator==(const Place&, const Place&) = default;
};
struct Endpoint {
  InferenceRank layout;
  std::vector<RemoteMemory> regions;
  std::vector<std::vector<Place>> places;  // [param][copy]
};
Bytes encode(const Endpoint& endpoint);
// kInvalidArgument naming the field: bad layout or descriptor bytes, a place naming a region
// that does not exist, copies that differ in number between parameters.
Result<Endpoint> decode_endpoint(std::span<const std::byte> bytes);

// --- the training side ------------------------------------------------------------------------

// The order every training rank walks the parameters in (the same everywhere, so that the
// gathers' sends meet): by sources, then by name, so that parameters made from the same
// training parameters (an FP8 weight and its scales, a fused gate/up and the up it holds)
// follow one another.
std::vector<uint32_t> push_order(const Schedule& schedule);

// One source of a projection: `bytes` bytes at `data`, row-major and contiguous, host memory
// or (on_gpu) CUDA device memory.
struct Source {
  const void* data = nullptr;
  uint64_t bytes = 0;
  bool on_gpu = false;
};

// The registered staging memory projected tensors are written into before they are sent.
struct StagingRing {
  Registration registration;
  void* data = nullptr;
  uint64_t bytes = 0;
  bool on_gpu = false;
};

// What one training rank does, in a push with gathers, for one source of one parameter: a rank
// that writes the parameter and holds a shard of the source receives the other shards of its
// replica from their holders (point to point), unless it holds the source whole from the
// parameter before in push order (an FP8 weight, then its scales).
struct GatherStep {
  bool reuse = false;  // this rank holds the source whole from the parameter before
  std::vector<std::pair<uint32_t, std::vector<Range>>> sends;  // (to rank, this rank's box)
  std::vector<std::pair<uint32_t, std::vector<Range>>> recvs;  // (from rank, its box)
};

struct SenderOptions {
  uint32_t rank = 0;      // this training rank
  uint32_t num_nics = 1;  // > 1: every entry is its own write, pinned to the schedule's NIC
  std::chrono::milliseconds timeout{30000};  // for Ready, for room in the ring, for the drain
  uint64_t batch_bytes = 0;                  // 0: a quarter of the ring
};

// Seconds per stage and counts of one push.
struct PushStats {
  double wait_ready = 0;  // begin() waiting for the Ready messages
  double project = 0;     // projections, their launch and the batches' stream syncs
  double post = 0;        // submitting the writes
  double wait_ring = 0;   // waiting for room in the ring (older writes to complete)
  double drain = 0;       // finish() waiting for the last writes
  uint64_t bytes = 0;     // bytes written
  uint64_t writes = 0;    // submissions (a scatter counts once)
  uint64_t temp_high_water = 0;
};

class WeightSender {
 public:
  // Installs the engine's receive handler (Ready messages are kept from then on, also for
  // versions begin() has not been called for). kAlreadyExists: the engine has a handler.
  static Result<std::unique_ptr<WeightSender>> create(TransferEngine& engine,
                                                      const SenderOptions& options);
  // Waits (up to the timeout) for writes of an interrupted push still in flight; calls nothing.
  ~WeightSender();
  WeightSender(const WeightSender&) = delete;
  WeightSender& operator=(const WeightSender&) = delete;

  // The schedule (computed by every rank), the inference ranks' endpoints and addresses by
  // rank, and the staging ring. Blocking (a peer group is made). kInvalidArgument: endpoints
  // that are not one per inference rank of the schedule, a parameter this rank writes that an
  // endpoint lacks, a malformed schedule, an empty ring. May be called again (a new schedule)
  // between pushes.
  Status connect(const Schedule& schedule, std::vector<Endpoint> endpoints,
                 std::vector<Address> addresses, const StagingRing& ring);

  const Schedule& schedule() const;
  // push_order(schedule()).
  const std::vector<uint32_t>& order() const;
  // Whether this rank writes any entry of parameter `param`.
  bool sends(uint32_t param) const;
  // The gathers of every push, from every training rank's description (after connect).
  // kInvalidArgument: ranks that are not the schedule's, a writer that holds no shard of a
  // source (descriptions other than the schedule's).
  Status plan_gathers(std::vector<TrainerRank> trainers);
  // This rank's step for source `source` of parameter `param` (empty where it does nothing).
  const GatherStep& gather(uint32_t param, uint32_t source) const;

  // Starts version `version`: waits for the Ready of every inference rank this rank writes
  // into (kTimeout naming the missing ranks). `stream`: the cudaStream_t projections into a
  // GPU ring are enqueued on (nullptr: the legacy default stream). Blocks.
  Status begin(uint64_t version, void* stream = nullptr);
  // Projects parameter `param` from its sources (one per projection source, in order) into the
  // ring and queues its writes; posts a batch once enough is queued; an FP8 weight stages its
  // scales too (and the other way round). Nothing to do for a parameter this rank does not
  // send or one staged already this push. `persistent`: the sources stay valid until finish()
  // (FP8 projections into a GPU ring are then launched 64 matrices at a time, or at the batch's
  // end; otherwise at once). Blocks while the ring has no room (kTimeout). kInvalidArgument naming
  // the parameter: wrong number or size of sources, FP8 sources not on the ring's side, a
  // projection larger than the ring. A write that failed is returned by this or a later call.
  Status stage(uint32_t param, std::span<const Source> sources, bool persistent = false);
  // Posts what is queued and waits for every write of the version. Blocks.
  Result<PushStats> finish();
  // begin, stage of every parameter this rank sends (sources looked up by training parameter
  // name in `sources`, which stay valid until it returns), finish. Without gathers the order is
  // free: parameters are staged in the order the inference ranks declared them (usually their
  // order in memory), so that consecutive writes are adjacent on both sides and the engine
  // joins them. Blocks.
  Result<PushStats> push(uint64_t version, const std::vector<std::string>& names,
                         std::span<const Source> sources, void* stream = nullptr);

  // Runs after each parameter's writes are posted (the thread that pushes): progress, tests.
  void set_on_posted(std::function<void(uint32_t param)> fn);

  class Impl;

 private:
  explicit WeightSender(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// --- the inference side -----------------------------------------------------------------------

// Immediates a receiver uses, one per prepare: [imm_base, imm_base + kReceiverImmediates).
inline constexpr uint32_t kReceiverImmediates = 1u << 24;

struct ReceiverOptions {
  uint32_t rank = 0;
  bool flip = true;  // two copies: a push writes the one not served
  uint32_t imm_base = 0xA0000000;
  std::chrono::milliseconds timeout{30000};  // prepare -> complete, else kTimeout
};

// A training rank as the receiver knows it: the Ready goes to `address`; `name` is its member.
struct TrainerPeer {
  uint32_t rank = 0;
  std::string name;
  Address address;
};

struct Progress {
  uint64_t version = 0;
  uint64_t landed = 0;
  uint64_t expected = 0;
};

class WeightReceiver {
 public:
  using CompleteFn = std::function<void(uint64_t version)>;
  using FailFn = std::function<void(uint64_t version, const Status& error)>;

  // Starts the timer thread. kInvalidArgument: an immediate range that wraps around 2^32.
  static Result<std::unique_ptr<WeightReceiver>> create(TransferEngine& engine,
                                                        const ReceiverOptions& options);
  // close().
  ~WeightReceiver();
  WeightReceiver(const WeightReceiver&) = delete;
  WeightReceiver& operator=(const WeightReceiver&) = delete;

  // Arms the next immediate for `expected` writes and sends Ready to every trainer; exactly
  // one of on_complete (engine callback thread, or this thread when expected is 0) and on_fail
  // runs. Returns the Ready sent. Errors, nothing armed: kInvalidArgument (a version pending,
  // no trainers), kOutOfRange (every immediate used), kClosed; a Ready that cannot be sent
  // fails the version (on_fail, kPeerUnreachable naming the rank).
  Result<Ready> prepare(uint64_t version, uint64_t expected, std::vector<TrainerPeer> trainers,
                        CompleteFn on_complete, FailFn on_fail);
  // A training rank left: fails the pending version with kPeerUnreachable naming it, when it
  // is one of that version's trainers. Non-blocking.
  void fail_trainer(const std::string& name);
  // Fails the pending version with kClosed; later prepares fail with kClosed. Joins the timer.
  void close();

  // The copy a reader serves (the last complete version's).
  uint8_t active_copy() const;
  std::optional<uint64_t> version() const;
  // In place, a version failed after writes may have landed and none completed since.
  bool half_written() const;
  std::optional<Progress> progress() const;

  class Impl;

 private:
  explicit WeightReceiver(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

}  // namespace fabric::weights
