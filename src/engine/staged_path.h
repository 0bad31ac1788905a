// StagedPath: the owner's side of Commits (the staged path's, reliable immediates', and the
// bookkeeping of the CUDA IPC path's), as a component (docs/engine.md, "Files").
//
// It owns the Commits being carried out (CommitJob), the records of the Commits it has counted
// (so that a copy sent again is acknowledged with the first one's result, not counted twice),
// and the copiers that copy staged ranges from the host mirror into device memory. It calls
// nothing above it: what the worker is to do comes back as Events, in order (start a CUDA IPC
// Commit's copies, count a Commit's immediates, send an Ack), which the worker drains after
// each call (Worker::run_staged_events). The writer's side of the staged path (gates, sending
// Commits, Acks awaited) is the StagedWriter (staged_writer.h), the CUDA IPC path's copies are
// IpcCopies' (ipc_copies.h).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "cuda/device_memory.h"
#include "engine/copier_set.h"
#include "engine/ipc_imports.h"
#include "engine/messages.h"
#include "engine/regions.h"
#include "engine/transfer_state.h"
#include "fabric/address.h"
#include "fabric/status.h"

namespace fabric::engine {

class Worker;

// A Commit being carried out: copied into device memory (the staged path) or GPU to GPU (the
// CUDA IPC path, ipc_copies.h); its address is the copier's token.
struct CommitJob {
  Commit commit;
  uint64_t sender = 0;
  uint64_t seq = 0;
  uint32_t reply_domain = 0;  // the NIC its latest copy arrived on: the Ack goes back there
  std::shared_ptr<LocalRegion> region;
  Status status;
  IpcImports::Lease lease;  // the CUDA IPC path: the writer's mapped source, while copying
};

class StagedPath {
 public:
  // What the worker is to do, in the order the events came.
  struct Event {
    enum class Kind : uint8_t {
      kStartIpc,  // a Commit with a CUDA IPC source: copy it (`job`; it ends in commit_done)
      kCountImm,  // a Commit carried out: count its immediate `imm`, `times` times
      kSendAck,   // send `ack` to `to` from NIC `domain`
    };
    Kind kind = Kind::kSendAck;
    CommitJob* job = nullptr;
    uint32_t imm = 0;
    uint32_t times = 0;
    Address to;
    uint32_t domain = 0;
    Ack ack;
  };

  // `regions`: the engine's registrations, which Commits name (may be null); `self`: the worker
  // whose regions a Commit may name (compared with LocalRegion::worker, never called).
  StagedPath(uint32_t group, const RegionTable* regions, const Worker* self)
      : group_(group), regions_(regions), self_(self) {}

  // A Commit that arrived on NIC `domain` (not seen before): recorded, and copied or counted.
  void on_commit(const MessageHeader& header, std::span<const std::byte> body, uint32_t domain);
  // A Commit seen before arrived on NIC `domain`: its Ack goes again with the first one's
  // result, or, while it is still being copied, back over this NIC.
  void on_duplicate(const MessageHeader& header, uint32_t domain);
  // The job's copies are done (or it failed, job.status): count, record, acknowledge, forget.
  void commit_done(CommitJob& job);
  // Completed copies into device memory: true when there were any.
  bool poll();
  bool has_copiers() const { return !copiers_.empty(); }
  bool copying() const;
  // The engine stops: waits for every copy in flight, then forgets the jobs.
  void drain();

  // The events since the last take, in order; the worker handles them and clears the vector.
  std::vector<Event>& events() { return events_; }

 private:
  // Commits counted, by (sender, sequence). Bounded (kMaxCommitRecords, oldest forgotten).
  struct CommitKey {
    uint64_t sender;
    uint64_t seq;
    friend bool operator==(const CommitKey&, const CommitKey&) = default;
  };
  struct CommitKeyHash {
    size_t operator()(const CommitKey& k) const noexcept {
      return std::hash<uint64_t>{}(k.sender * 0x9e3779b97f4a7c15ull ^ k.seq);
    }
  };
  struct CommitRecord {
    CommitJob* job = nullptr;  // still being copied; null once acknowledged
    ErrorCode code = ErrorCode::kOk;
    std::string message;
    uint64_t transfer = 0;  // the writer's, for the Ack
    Bytes reply;            // the writer's Address, encoded
  };
  static constexpr size_t kMaxCommitRecords = size_t{1} << 14;

  void send_ack(Address to, uint32_t domain, Ack ack);

  const uint32_t group_;
  const RegionTable* const regions_;
  const Worker* const self_;
  // The copiers before the jobs whose copies they run: destroyed after them.
  CopierSet copiers_;
  std::unordered_map<CommitJob*, std::unique_ptr<CommitJob>> jobs_;
  std::unordered_map<CommitKey, CommitRecord, CommitKeyHash> records_;
  std::deque<CommitKey> order_;
  std::vector<cuda::Copier::Done> done_;
  std::vector<Event> events_;
};

}  // namespace fabric::engine
