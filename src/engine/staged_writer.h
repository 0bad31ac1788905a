// StagedWriter: the writer's side of the staged path, and of the Commits it shares with reliable
// immediates and the CUDA IPC path, as a component (docs/engine.md, "Files").
//
// It owns the device-to-host copiers of staged sources and their gates' fences, the Commits
// sent and awaiting their Acks (by sequence number), and when an Ack is overdue. It calls
// nothing above it (only the copiers): what the worker is to do comes back as return values
// and lists it drains after each call: ops whose gate opened (or failed), Commits to send, Commit
// copies to send again, transfers whose Commits are all acknowledged or given up on. Sending a
// message, queueing and settling ops stay the worker's (worker_staged.cc).
//
// The per-transfer state it works on is the transfer's (transfer_state.h: Gate, StagedDst,
// IpcDst, CommitSend, Transfer::acks and ack_deadline); a Gate's address is its fence's token.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "cuda/device_memory.h"
#include "engine/copier_set.h"
#include "engine/messages.h"
#include "engine/transfer_state.h"
#include "fabric/address.h"
#include "fabric/status.h"

namespace fabric::engine {

class StagedWriter {
 public:
  using Clock = std::chrono::steady_clock;

  struct Options {
    uint64_t chunk_bytes = 0;                   // Config::staging_chunk_bytes
    uint64_t message_room = 0;                  // max_message_bytes + kMessageHeaderBytes
    std::chrono::milliseconds peer_timeout{0};  // an Ack later than this fails its transfer
  };
  // Ops [first, first + count) of `transfer` may be queued (status ok), or fail with `status`
  // (their device-to-host copies failed).
  struct Release {
    Transfer* transfer = nullptr;
    size_t first = 0;
    size_t count = 0;
    Status status;
  };
  // A Commit to send to `owner` for `transfer`: the worker encodes and stamps it, then track()s.
  struct Outgoing {
    Transfer* transfer = nullptr;
    Commit commit;
    const Address* owner = nullptr;
  };
  // What watch() found: Commit copies to send again (each over another NIC than its last one),
  // and transfers given up on (kPeerUnreachable, their Commits forgotten; ready once nothing
  // else is pending).
  struct Overdue {
    std::vector<CommitSend*> resend;
    std::vector<Transfer*> failed;
  };

  explicit StagedWriter(Options options, cuda::CopierFactory make = &cuda::Copier::create)
      : options_(options), copiers_(std::move(make)) {}
  StagedWriter(const StagedWriter&) = delete;
  StagedWriter& operator=(const StagedWriter&) = delete;

  // --- gates: ops reading a staged source wait for their device-to-host copies -------------
  // Groups t's ops into gates of about chunk_bytes and enqueues their copies, each gate closed
  // by a fence. Zero-byte ops (they read the scratch buffer) and gates whose copies could not
  // be enqueued are released at once.
  void stage(Transfer& t);
  // Gates whose fences completed are released, in order; true when any were.
  bool poll();
  // What stage() and poll() released since the last take, in order: the worker clears it.
  std::vector<Release>& released() { return released_; }
  // A read into a staged region completed into its mirror: its bytes are copied on into the
  // device, and the op is done once they are there (landed()). Fails when the copy could not
  // be enqueued (the op is then not landing).
  Status land(Op& op);
  struct Landed {
    Op* op = nullptr;
    Status status;
  };
  // Reads whose host-to-device copies completed since the last take (poll()), in order.
  std::vector<Landed>& landed() { return landed_; }
  bool has_copiers() const { return !copiers_.empty(); }
  bool copying() const { return copiers_.copying(); }
  // The engine stops: waits for every copy in flight and forgets their fences.
  void drain() { copiers_.drain(); }

  // --- Commits -------------------------------------------------------------------------------
  // A write into a staged destination completed: its range joins the unflushed ones (merged
  // with the last when adjacent). True when the destination has chunk_bytes unflushed: time to
  // commit_staged() (not while the engine stops).
  bool record(const Op& op);
  // The Commits of staged destination `dst_index`'s unflushed ranges (`final`: and its
  // immediate, riding on the last when the ranges fit one message) go to outgoing().
  // `reply_to`: this group's Address, encoded. A message too small for a range fails `t`.
  void commit_staged(Transfer& t, uint32_t dst_index, bool final, const Bytes& reply_to);
  // The same for t's CUDA IPC destinations (docs/cuda-ipc.md): their ranges, with the source's
  // export; the immediate alone once every range Commit is acknowledged (`final`) when the
  // ranges need several messages.
  void commit_ipc(Transfer& t, bool final, const Bytes& reply_to);
  // A read from a staged region: the read Commits that have its owner copy t.read_prep out of
  // the device into its mirror, before the reads go.
  void commit_read_prep(Transfer& t, const Bytes& reply_to);
  static bool staged_left(const Transfer& t);  // ranges or an immediate not yet committed
  static bool ipc_left(const Transfer& t);
  std::vector<Outgoing>& outgoing() { return outgoing_; }

  // The Commit in `message` (stamped with `seq`) of `t` was sent to `owner`: its Ack is
  // awaited, the transfer's deadline moved to now + peer_timeout.
  CommitSend& track(Transfer& t, const Bytes& message, uint64_t seq, const Address& owner,
                    Clock::time_point now);
  // A copy of cs was queued on NIC `nic`.
  static void queued(CommitSend& cs, uint32_t nic, Clock::time_point now);
  // A copy of cs failed to send and no copy is left in flight: its Ack will never come. The
  // transfer stops waiting for it.
  void give_up(CommitSend& cs);
  // An Ack arrived: the transfer whose Commits are now all acknowledged, else null (late,
  // unknown, a second Ack of a Commit sent twice, or more Acks awaited). An error Ack sets the
  // transfer's error (the first) with the owner's message.
  Transfer* on_ack(const Ack& ack);
  bool awaiting() const { return !awaiting_.empty(); }
  // Commits without an Ack for resend_after go again; transfers past their deadline fail.
  Overdue& watch(Clock::time_point now, Clock::duration resend_after);
  // `t` finishes (or the engine stops): nothing of it is awaited any more.
  void forget(Transfer& t);
  void forget_all() { awaiting_.clear(); }
  size_t unacked() const { return unacked_.size(); }

 private:
  // Appends a Commit of `ranges` of `dst` (`region`: the owner's id) to outgoing_.
  Commit& add_commit(Transfer& t, const RemoteMemory& dst, uint64_t region,
                     std::span<const Range> ranges, const Bytes& reply_to);
  void release(Gate& gate, Status status);

  const Options options_;
  CopierSet copiers_;
  std::vector<cuda::Copier::Done> done_;
  std::vector<Release> released_;
  std::vector<Landed> landed_;
  std::vector<Outgoing> outgoing_;
  std::vector<Transfer*> awaiting_;  // transfers with Commits not yet acknowledged
  std::unordered_map<uint64_t, CommitSend*> unacked_;  // by sequence number
  Overdue overdue_;
};

}  // namespace fabric::engine
