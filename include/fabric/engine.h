// TransferEngine: the public facade of fabric-lib.
//
// Threads. Each device group has one worker thread that owns its NICs: it posts work requests
// and polls completions. Each engine has one callback thread that runs every user callback
// (transfer done/error, immediate counts reached, messages received), so a slow or throwing
// callback never stalls the fabric. Callbacks may call any engine method except close() and
// the destructor.
//
// Every method may be called from any thread, and from several threads at once (submissions
// included: each submit call is independent), except close() and the destructor, which must not
// run from a callback.
//
// Blocking. Submissions return at once. Registration, peer-group creation and receive-pool
// set-up block until the worker has done them (microseconds to milliseconds). wait_imm blocks
// up to its timeout. close() blocks until every callback has run.
//
// Bad input. Every call checks its arguments before it does anything and returns a Status
// naming what is wrong; nothing is posted for a rejected submission.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "fabric/address.h"
#include "fabric/config.h"
#include "fabric/stats.h"
#include "fabric/status.h"
#include "fabric/transfer.h"

namespace fabric {

class EngineImpl;

// A registration: the local handle for submissions and the descriptor to hand to peers.
struct Registration {
  MemoryHandle handle;
  RemoteMemory descriptor;
};

// How register_memory registers a range.
struct RegisterOptions {
  uint32_t group = 0;  // the device group whose NICs register it
  // GPU memory on a group whose NICs cannot reach it is staged through a pinned host mirror of
  // the same size (docs/gpu.md). false: no mirror is allocated and the fabric does not register
  // the memory; only the CUDA IPC path (same-host peers, docs/cuda-ipc.md) reaches it, from and
  // into it. Registering then fails with kUnsupported where CUDA IPC is off or CUDA cannot
  // export the memory, and a write that would need the fabric fails at submit with
  // kUnsupported, saying why. No effect on host memory or on a group that reaches GPU memory
  // itself (GroupInfo::gpu_memory "direct").
  bool host_mirror = true;
  // Host memory only: same-host writers whose source is GPU memory write into it through this
  // process's GPU copy engines over the CUDA IPC path (the owner maps the writer's GPU memory and
  // copies it down in one cudaMemcpyAsync or kernel, instead of the writer staging it into
  // pinned host memory and the fabric copying it again; docs/cuda-ipc.md). The memory is
  // page-locked (cudaHostRegister: about 42 ms per GiB on the H200 machine's host) until it is
  // unregistered, and the calling thread's current CUDA device does the copies. Registering
  // fails with kUnsupported where Config::cuda_ipc is off or no CUDA device is in the process,
  // and with kInvalidArgument for GPU memory and for a range that overlaps, without being
  // equal to, one another gpu_copies registration of the process page-locked (the same range
  // registered again shares its page-lock). Memory CUDA already holds page-locked (cudaHostAlloc,
  // torch's pin_memory) is used as it is: its owner must keep it locked while it is registered.
  // Writes from host memory into it, and from it, take the fabric as before.
  bool gpu_copies = false;
  // Peers may read the memory (SingleRead, PagedRead), besides writing into it. Off by default:
  // a read of memory registered without it fails at the reader (kRemoteAccess), and the owner's
  // fabric (or, for GPU memory on the staged and CUDA IPC paths, the owner's worker) refuses one
  // from a forged descriptor. GPU memory is read on the path a write into it takes
  // (docs/reads.md, "GPU memory").
  bool remote_read = false;
};

// What a device group turned out to be, once opened.
struct GroupInfo {
  std::string provider;            // e.g. "tcp;ofi_rxm"
  std::vector<std::string> nics;   // domain names, in rail order
  int cpu = -1;                    // the worker's CPU, or -1 when unpinned
  bool delivery_complete = false;  // writes complete only once visible at the target
  // How CUDA memory registered on this group moves: "direct (FI_HMEM)" when every NIC of the
  // group can read and write it itself, else "staged" (pinned host mirrors and
  // cudaMemcpyAsync on the worker).
  std::string gpu_memory = "staged";
  bool cuda = false;  // CUDA device memory can exist here (built with CUDA, a device present)
  // The CUDA IPC path for same-host GPU peers (Config::cuda_ipc, docs/cuda-ipc.md): "auto",
  // "on" or "off".
  std::string cuda_ipc = "auto";
};

class TransferEngine {
 public:
  // Opens the provider's domains for every group and starts the threads. Fails with a Status
  // naming the provider or NIC that could not be opened. Blocking.
  static Result<std::unique_ptr<TransferEngine>> create(const Config& config);

  // Closes the engine (see close()).
  ~TransferEngine();
  TransferEngine(const TransferEngine&) = delete;
  TransferEngine& operator=(const TransferEngine&) = delete;

  // Stops accepting submissions (from the moment it is called, every new call that needs the
  // engine open returns kClosed at once, however many threads keep submitting); lets posted work
  // requests finish for up to Config::close_timeout, then cancels the rest (their on_error gets
  // kCancelled); runs every pending callback; joins the threads. No callback runs after close()
  // returns. Idempotent. Must not be called from a callback.
  void close();

  size_t num_groups() const;
  // What a group turned out to be; an empty GroupInfo for a group that does not exist.
  const GroupInfo& group_info(uint32_t group = 0) const;
  // Failover (docs/failover.md): for each NIC of `group` in rail order, whether it is up (a NIC
  // is marked down when it stalls for Config::nic_timeout while another NIC progresses, and up
  // again when a probe over it completes). Empty for a group that does not exist. Non-blocking.
  std::vector<bool> nics_up(uint32_t group = 0) const;
  // The address peers use to reach a group; an empty Address for a group that does not exist.
  // Non-blocking.
  const Address& address(uint32_t group = 0) const;

  // --- memory -------------------------------------------------------------------------------

  // Registers [ptr, ptr + length) on every NIC of `group` for local reads and remote writes.
  // Every call makes a new registration, also for a pointer registered before (with the same
  // or another length). Blocking. Errors: kInvalidArgument (null pointer, zero length),
  // kNotFound (no such group), kFabric (the provider refused), kClosed; with
  // RegisterOptions::host_mirror false, kUnsupported (the memory cannot take the CUDA IPC path).
  Result<Registration> register_memory(void* ptr, uint64_t length, uint32_t group = 0);
  Result<Registration> register_memory(void* ptr, uint64_t length, const RegisterOptions& options);

  // Forgets a registration, as a barrier. New submissions naming the handle fail with
  // kNotFound at once; transfers already accepted that read from the region still complete
  // (each within its own bounds: Config::peer_timeout for a dead peer); then the provider
  // registration is closed on every NIC; where the provider checks a write's key only when the
  // write begins (libfabric tcp), every engine that has written here confirms that its writes
  // already under way have arrived (one round trip); and only then does this return. From that
  // moment no write of a peer can land in the memory or count its immediate: a peer still
  // writing with the old descriptor gets kRemoteAccess for that write alone (docs/bad-input.md).
  // The memory may then be freed. Also after close() (it releases the registration). Blocking;
  // must not be called from a callback while a transfer reading the region waits for its own
  // callback.
  // Errors: kNotFound (unknown handle, or unregistered already); kTimeout: the registration is
  // closed, but a writer did not confirm within min(peer_timeout / 4, 2 s) (a stopped or dead
  // process), and the rest of a write it had started may still land if it runs again
  // (docs/hardening.md, "Unregister is a barrier").
  Status unregister_memory(MemoryHandle handle);

  // --- peers --------------------------------------------------------------------------------

  // A group of peer addresses for scatter and barrier. Errors: kInvalidArgument (empty, or
  // an address of another provider, or a duplicate).
  Result<PeerGroup> add_peer_group(std::vector<Address> peers);
  Status remove_peer_group(PeerGroup group);

  // --- one-sided writes ---------------------------------------------------------------------
  // Each returns at once with the transfer's id, or an error and no callback.

  Result<TransferId> submit(const SingleWrite& write, Callbacks callbacks);
  Result<TransferId> submit(const PagedWrite& write, Callbacks callbacks);
  Result<TransferId> submit(const Scatter& scatter, Callbacks callbacks);
  Result<TransferId> submit(const Barrier& barrier, Callbacks callbacks);
  Result<TransferId> submit(const ImmWrite& imm, Callbacks callbacks);

  // --- one-sided reads ----------------------------------------------------------------------
  // Each returns at once with the transfer's id, or an error and no callback: kRemoteAccess
  // when the descriptor is not readable, kOutOfRange outside either region, kInvalidArgument
  // for malformed pages, kUnsupported where a side registered without a host mirror needs the
  // CUDA IPC path and cannot take it. The owner refuses a read of memory it did not register
  // readable, or no longer holds (kRemoteAccess in on_error); unregister_memory() is a barrier:
  // no byte is read from a region once it returns. GPU memory: docs/reads.md.
  Result<TransferId> submit(const SingleRead& read, Callbacks callbacks);
  Result<TransferId> submit(const PagedRead& read, Callbacks callbacks);

  // --- two-sided messages -------------------------------------------------------------------

  // Sends `message` (copied before return; at most Config::max_message_bytes) to the peer,
  // which must have receive buffers (set_receive_handler). It goes over the group's first NIC
  // that is up; when that NIC stops making progress it is sent again over another one, and
  // the receiver drops a second copy: delivered at most once, and exactly once when `on_done`
  // runs (docs/failover.md). Errors: kOutOfRange.
  Result<TransferId> submit_send(const Address& peer, std::span<const std::byte> message,
                                 Callbacks callbacks, uint32_t group = 0);

  // Posts `count` receive buffers of `buffer_bytes` on every NIC of the group and keeps them
  // posted: each message is copied out, the buffer reposted, and `on_message` runs on the
  // callback thread with the bytes (valid during the call). Once per group:
  // kAlreadyExists on a second call. Blocking.
  Status set_receive_handler(std::function<void(std::span<const std::byte>)> on_message,
                             uint64_t buffer_bytes = 64 * 1024, uint32_t count = 64,
                             uint32_t group = 0);

  // --- immediates ---------------------------------------------------------------------------
  // The engine tallies every immediate that arrives, on any group and NIC, per value.

  // Runs `on_reached` once, on the callback thread, when `count` arrivals of `imm` not yet
  // claimed by an earlier expectation have been seen (arrivals before this call count). The
  // `count` arrivals are then claimed and the expectation is removed. Errors:
  // kInvalidArgument (count 0, or an empty on_reached: wait_imm blocks instead),
  // kAlreadyExists (an expectation for imm is pending), kClosed.
  Status expect_imm(uint32_t imm, uint64_t count, std::function<void()> on_reached);
  // Withdraws a pending expectation; its callback will not run. Errors: kNotFound.
  Status cancel_expect_imm(uint32_t imm);
  // Runs for each arrival of an immediate that has no pending expectation when it arrives
  // (it is still counted). Replaces any previous handler; null removes it.
  void set_unexpected_imm_handler(std::function<void(uint32_t imm)> handler);
  // Total arrivals of imm since the engine started (or since reset_imm). Non-blocking.
  uint64_t imm_count(uint32_t imm) const;
  // Blocks until imm_count(imm) >= total or the timeout passes; returns whether it reached.
  bool wait_imm(uint32_t imm, uint64_t total, std::chrono::milliseconds timeout) const;
  // Forgets the tally and any expectation of imm.
  void reset_imm(uint32_t imm);

  // --- caller-driven progress ---------------------------------------------------------------

  // For a group created with GroupConfig::caller_progress (it has no worker thread): one pass
  // of its loop on this thread, which posts what was submitted, polls the NICs, counts
  // arrivals and runs the callbacks that are due, here. Returns whether the pass did
  // anything. One thread at a time per group: a call while another thread is in a pass of the
  // same group returns false at once. Returns false for a group that is not caller-driven,
  // that does not exist, or once close() has begun. Callbacks it runs are under the rules of
  // Config::callbacks_on_worker.
  bool progress(uint32_t group = 0);

  // --- statistics ---------------------------------------------------------------------------

  // What the engine has done since it was created, per device group (fabric/stats.h): relaxed
  // counters, so a snapshot taken while transfers run may be mid-way between two of them.
  // Non-blocking.
  EngineStats stats() const;

 private:
  explicit TransferEngine(std::unique_ptr<EngineImpl> impl);
  std::unique_ptr<EngineImpl> impl_;
};

}  // namespace fabric
