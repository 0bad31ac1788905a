// Internal state of accepted transfers and registrations, shared by the engine (which plans
// transfers on the submitting thread) and the worker (which posts and completes them).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cuda/device_memory.h"
#include "cuda/ipc.h"
#include "engine/messages.h"
#include "fabric/address.h"
#include "fabric/transfer.h"
#include "transport/domain.h"

namespace fabric::engine {

class Worker;

// One registration of one device group: a provider registration per NIC of the group.
// The provider registrations are released on the group's worker when the last holder (the
// engine's table, or a transfer using it) lets go.
//
// Device memory the NICs cannot reach is staged: `host` is then a pinned mirror of the same
// length (registered in its place), and data moves between `ptr` and `host` by copies on the
// worker. For host memory, host == ptr.
// Transfer ids with this bit set are the engine's own (probes, checks, Commits, Acks).
inline constexpr uint64_t kInternalTransfer = uint64_t{1} << 63;

struct LocalRegion {
  uint64_t id = 0;
  std::byte* ptr = nullptr;
  std::byte* host = nullptr;  // what the NICs read and write: ptr, or the mirror (null: ipc_only)
  uint64_t length = 0;
  uint32_t group = 0;
  cuda::PointerInfo memory;
  Worker* worker = nullptr;
  std::vector<std::unique_ptr<transport::MemoryRegistration>> regs;  // one per NIC, of `host`
  std::unique_ptr<cuda::HostBuffer> mirror;                          // staged only
  // The CUDA IPC path (docs/cuda-ipc.md): the region's export, for device memory CUDA could
  // export (else empty, and ipc_why says why), made at registration unless Config::cuda_ipc is
  // off.
  std::optional<cuda::IpcExport> ipc;
  std::string ipc_why;
  // Set by unregister_memory: runs once the provider registrations are closed (after the last
  // holder let go), so that unregister returns only when no remote write can land any more.
  std::function<void(const Status&)> on_released;
  // Set by unregister_memory once the region is out of the table: a submitting thread's cache
  // of regions (EngineImpl::lookup_region) may still reach it while transfers hold it, and must
  // not hand it to a new submission.
  std::atomic<bool> unregistered{false};

  // Registered with RegisterOptions::host_mirror false on a group that stages GPU memory: no
  // mirror, no provider registrations (regs empty, host null); only CUDA IPC moves it.
  bool ipc_only = false;
  // Registered with RegisterOptions::remote_read: peers may read it (owners check read Commits
  // against it; the fabric's keys carry it where the provider enforces access).
  bool remote_read = false;
  // Host memory registered with RegisterOptions::gpu_copies: the GPU whose copy engines fill it
  // from same-host writers' GPU memory (the CUDA IPC path); page-locked until the region goes.
  std::optional<cuda::PointerInfo> copy_engines;

  // The device that maps a writer's export and copies into the region over the CUDA IPC path.
  const cuda::PointerInfo& ipc_device() const { return copy_engines ? *copy_engines : memory; }
  // Whether the CUDA IPC path may copy into the region.
  bool ipc_destination() const { return ipc.has_value() || copy_engines.has_value(); }

  bool staged() const { return mirror != nullptr; }
  ~LocalRegion();
};

struct Transfer;
struct PeerQueue;

// A Commit (staged path, or a reliable immediate) until its Ack arrives. Failover may send it
// again (its bytes, hence its sequence number, unchanged): the owner counts it once and
// acknowledges every copy, and the writer takes the first Ack for its sequence number.
struct CommitSend {
  Transfer* transfer = nullptr;
  uint64_t seq = 0;
  const Bytes* message = nullptr;
  const Address* owner = nullptr;
  bool acked = false;                          // or given up on
  uint32_t domain = 0;                         // NIC of the latest copy
  uint32_t live = 0;                           // copies queued or posted
  std::chrono::steady_clock::time_point sent;  // when the latest copy was queued
};

// One work request. Its address is the wr_id the domain hands back on completion, so an Op
// never moves once the transfer is accepted.
struct Op {
  // kRead: `local` is where the bytes go, dst_mem the peer's region they come from.
  enum class Kind : uint8_t { kWrite, kSend, kRead };
  static constexpr uint32_t kNoDst = UINT32_MAX;
  Transfer* transfer = nullptr;
  Kind kind = Kind::kWrite;
  bool has_imm = false;
  uint32_t domain = 0;
  uint32_t imm = 0;
  bool abandoned = false;  // its peer was declared dead while the provider still held it
  // Isolation (docs/hardening.md, "One bad write"): posted alone after a failure that another
  // work request may have caused; how often; whether it carried an immediate before (a retry
  // goes without: the first may have been counted).
  bool lone = false;
  bool had_imm = false;
  uint8_t lone_tries = 0;
  bool urgent = false;     // queued ahead of the peer's other work (a Hello its writes wait for)
  int32_t send_slot = -1;  // kSend: the registered send buffer in use while posted
  const Bytes* peer = nullptr;     // the peer NIC's endpoint name (kept alive by the transfer)
  const Bytes* message = nullptr;  // kSend: the bytes to send (kept alive by the transfer)
  CommitSend* commit = nullptr;    // kSend: a Commit whose Ack the transfer awaits
  // kWrite into a staged destination: which of the transfer's dsts, and the offset in it.
  uint32_t dst_index = kNoDst;
  uint64_t dst_offset = 0;
  // What failover needs to move the op to another NIC (docs/failover.md): the peer it goes to,
  // and for writes into a registered region, that region (rails' addresses and keys). Writes
  // with neither a region nor a length target the peer NIC's scratch buffer. Kept alive by
  // the transfer.
  const Address* owner = nullptr;
  const RemoteMemory* dst_mem = nullptr;
  const void* local = nullptr;
  uint64_t length = 0;
  void* local_desc = nullptr;
  uint64_t remote_addr = 0;
  uint64_t remote_key = 0;
  // While posted: the peer queue it went through, and its links in that queue's in-flight list.
  PeerQueue* queue = nullptr;
  Op* prev = nullptr;
  Op* next = nullptr;
};

// "write", "read" or "message", for the messages that name an op.
inline const char* kind_name(const Op& op) {
  return op.kind == Op::Kind::kSend ? "message" : op.kind == Op::Kind::kRead ? "read" : "write";
}

// The staged-path state of one destination of a transfer whose region is staged at its owner:
// ranges written and not yet committed, and the immediate to count once all are copied.
struct StagedDst {
  std::vector<Range> unflushed;
  uint64_t unflushed_bytes = 0;
  bool has_imm = false;
  uint32_t imm = 0;
  uint64_t imm_times = 0;
};

// One destination of a transfer that goes over the CUDA IPC path: its owner copies each range
// GPU to GPU from this engine's exported source, then counts the immediate (docs/cuda-ipc.md).
struct IpcDst {
  uint32_t dst_index = 0;
  std::vector<Range> ranges;          // in the destination region
  std::vector<uint64_t> src_offsets;  // per range: where its bytes start in the source region
  bool has_imm = false;
  uint32_t imm = 0;
  uint64_t imm_times = 0;
};

// A group of ops whose source is staged, released for posting once their device-to-host
// copies have completed. Its address is the copier's token.
struct Gate {
  Transfer* transfer;
  size_t first;  // index into transfer->ops
  size_t count;
};

struct Transfer {
  TransferId id = 0;
  Callbacks callbacks;
  std::vector<Op> ops;
  // Immediates that follow the data of a write split into several pieces: posted once every
  // op has completed, so that the receiver counts one arrival after all the data is visible.
  std::vector<Op> deferred;
  bool deferred_started = false;
  size_t pending = 0;           // ops queued or posted and not yet completed
  size_t abandoned = 0;         // ops given up on (dead peer) that the provider still holds
  bool finished = false;        // the user callback has been queued
  bool while_stopping = false;  // may start while the engine stops (a write-fence Goodbye)
  // When submit() handed it over (engine transfers; the epoch for the worker's own): the start
  // of its completion time in TransferEngine::stats().
  std::chrono::steady_clock::time_point submitted_at{};
  Status error;  // the first failure
  // Staged path: per destination (indexed like dsts; empty when no destination is staged),
  // Commits sent and not yet acknowledged, and when their acknowledgment is overdue.
  std::vector<StagedDst> staged;
  size_t acks = 0;
  std::chrono::steady_clock::time_point ack_deadline;
  // Lists, not deques: elements never move, and an empty list allocates nothing (a deque
  // allocates on construction, on every submission's path).
  std::list<Op> control;          // Commit sends
  std::list<Bytes> control_msgs;  // their bytes
  std::list<CommitSend> commits;  // their state until acknowledged
  std::list<Gate> gates;
  // The CUDA IPC path: destinations filled by their owners' copies (no ops); their Commits are
  // sent when the transfer starts.
  std::vector<IpcDst> ipc;
  // A read (docs/reads.md): its CUDA IPC Commits ask the owner to copy out of its region
  // (`reading`); from a staged region, the ranges its owner first copies out of the device into
  // its mirror (read Commits) while the ops are `held`, queued once every Ack has come.
  bool reading = false;
  std::vector<Range> read_prep;
  bool held = false;
  // Failover: copies of ops given up on a NIC marked down, re-posted on a surviving NIC.
  std::list<Op> retries;
  // An engine-internal probe of a NIC marked down (its index), else -1.
  int probe_nic = -1;
  // An engine-internal check of a peer in isolation: its NIC, else -1, and its peer handle.
  int check_nic = -1;
  uint64_t check_peer = 0;
  // Keep-alives for what the ops point into.
  std::shared_ptr<LocalRegion> src;
  std::vector<RemoteMemory> dsts;
  std::vector<Address> peers;
  Bytes message;  // kSend: the copied message, behind its kind byte

  // Back to the default state, keeping the buffers of the vectors a submission fills (ops,
  // deferred, dsts, peers, message): a recycled transfer is planned without allocating
  // (engine/transfer_pool.h).
  void reset();
};

}  // namespace fabric::engine
