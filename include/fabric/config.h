// The one typed configuration of a TransferEngine.
//
// Every field has a working default. Environment overrides are declared in one place,
// apply_env_overrides(), and are applied only when the caller asks for them.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "fabric/status.h"

namespace fabric {

// One device group: the NICs (libfabric domains) that serve one GPU or one host buffer pool,
// polled by one worker thread. A transfer submitted on a group is sharded across its NICs.
struct GroupConfig {
  // Domain names as libfabric reports them (`fi_info -p tcp` lists "lo", "eth0", ...); for the
  // verbs provider, RDMA devices as fabric-info lists them ("rxe0", or "mlx5_0:2" for a port).
  // Empty: the first domain the provider offers. A NIC may be listed twice (two endpoints on
  // one NIC: no extra bandwidth, but real multi-rail behaviour for tests).
  std::vector<std::string> nics;
  // CPU to pin the worker thread to. kCpuAuto: a core of the first NIC's NUMA node, when the
  // NIC has one (a PCI device); no pinning otherwise. kCpuNone: never pin.
  static constexpr int kCpuAuto = -1;
  static constexpr int kCpuNone = -2;
  int cpu = kCpuAuto;
  // Caller-driven progress: the group starts no worker thread; a thread of the caller's (a GPU
  // proxy thread, an event loop) drives it with TransferEngine::progress(group), which posts,
  // polls and runs the group's callbacks on that thread (as with Config::callbacks_on_worker).
  // Nothing moves between calls, and peer and NIC timeouts are noticed only inside them: call
  // it often. Blocking calls (register_memory, unregister_memory, wait_imm, close) drive the
  // group themselves while they wait. `cpu` is ignored (the caller's thread is not pinned).
  bool caller_progress = false;
};

// What the fault-injection wrapper does to every domain of the engine (tests only; off by
// default). It exercises the reliable-but-unordered contract on providers that happen to
// deliver in order.
struct FaultConfig {
  bool enabled = false;
  uint64_t seed = 1;
  // Completions (local and remote: immediates, receives) are held back and released in a
  // shuffled order. A held completion is released after at most this many polls.
  uint32_t max_hold_polls = 8;
  // Called for each work request before it is posted; returning true fails that work request
  // with kFabric instead of posting it. Called on the worker thread. Null: never fail.
  // `sequence` numbers the writes the domain accepted, from 0, per NIC.
  std::function<bool(uint64_t sequence)> fail_write;
  // Called for each receive completion that carries a message, before it is held; the result
  // is added to the length the provider reported (at least 0 is kept): a provider that hands
  // over a message with bytes after it (> 0) or cut short (< 0). `sequence` numbers the
  // receive completions per NIC, from 0. Called on the worker thread. Null: lengths unchanged.
  std::function<int64_t(uint64_t sequence)> receive_length_delta;
};

// The verbs backend (Config::provider "verbs": RC queue pairs through libibverbs; docs/verbs.md).
struct VerbsConfig {
  // GID index used on every NIC of the engine. kGidAuto: the RoCE v2 GID that carries the
  // IPv4 address of the port's network interface (the IB GID 0 on InfiniBand ports).
  static constexpr int kGidAuto = -1;
  int gid_index = kGidAuto;
  // Connection set-up: a peer is connected on first use with a handshake datagram, resent
  // after connect_retry, doubling, up to connect_attempts datagrams; a peer that never answers
  // fails the work queued for it with kPeerUnreachable.
  std::chrono::milliseconds connect_retry{100};
  uint32_t connect_attempts = 6;
  // Fault injection for tests: the first drop_handshakes handshake datagrams each domain sends
  // are dropped, the next delay_handshakes are sent only after handshake_delay.
  uint32_t drop_handshakes = 0;
  uint32_t delay_handshakes = 0;
  std::chrono::milliseconds handshake_delay{0};
  // Selective signalling: a send work request asks for a completion (IBV_SEND_SIGNALED) once
  // in signal_every on its queue pair, and so does the last of every chained post; a
  // completion finishes the unsignalled requests before it. 1: every request signalled.
  uint32_t signal_every = 16;
  // Queue pairs in a thread domain (ibv_alloc_td, in a parent domain) and a single-threaded
  // completion queue, where the device offers them, so that the provider can leave out its
  // locks (each domain is driven by one thread at a time). A device without thread domains
  // (Soft-RoCE) gets the protection domain, with an info log saying why.
  bool thread_domain = true;
};

struct Config {
  // "auto" (efa when present, else tcp), "tcp", "shm", "efa", any libfabric provider offering
  // reliable datagram (FI_EP_RDM) endpoints with RMA and remote CQ data, or "verbs": the verbs
  // backend (RC queue pairs through libibverbs; NICs named "mlx5_0", "rxe0:1"; docs/verbs.md).
  std::string provider = "auto";
  // One entry per device group. The default: one group on the provider's first domain.
  std::vector<GroupConfig> groups = {GroupConfig{}};

  // Single writes and byte-sharded scatter targets below this size use one NIC.
  uint64_t shard_min_bytes = 256 * 1024;
  // Shard boundaries are aligned to this many bytes (the last shard takes the remainder).
  uint64_t shard_alignment = 8192;
  // Weighted sharding (docs/netlab.md, "Unequal links"): sharded single writes, byte-sharded
  // scatter targets and paged writes are split across NICs in proportion to each NIC's
  // measured write rate (every NIC that is up keeps at least 1/16 of the fastest one's
  // weight), so that a slower link does not hold the whole group to its pace. Off: equal
  // shares. The immediates the receiver counts do not depend on it.
  bool weighted_sharding = true;
  // Most completions read from a CQ in one call.
  uint32_t cq_batch = 32;
  // Most work requests posted per domain in one pass of the worker loop, so that completions
  // keep being polled while a large paged transfer is posted.
  uint32_t post_budget = 256;
  // Worker idling: after this long without work the worker sleeps in steps of idle_sleep
  // (woken at once by a submission). Zero spin_time with zero idle_sleep is a pure busy-poll.
  std::chrono::microseconds spin_time{200};
  std::chrono::microseconds idle_sleep{50};
  // Slots of each group's submission ring (rounded up to a power of two, 2 to 2^20): submit()
  // hands transfers to the worker through it without a lock. When it is full a submission goes
  // to a locked overflow list instead (never refused, never lost, order per thread kept), and
  // GroupStats::submissions_ring_full counts it.
  uint32_t submission_ring = 4096;
  // With work requests in flight and nothing else to do (no queued work, nothing completed),
  // the worker polls for this long, then blocks on the NICs' completion file descriptors until
  // a completion or a submission wakes it (at most 1 ms at a time), so that the CPU goes to the
  // peer processes and the callback thread meanwhile. Only on providers with such descriptors
  // (tcp); others keep polling. Negative: always poll while work is in flight; a zero
  // idle_sleep (pure busy-poll) never blocks either.
  std::chrono::microseconds inflight_spin{20};
  // After running user callbacks, the callback thread polls this long for more (yielding its
  // CPU between looks) before it sleeps, so that a callback soon after another one starts
  // without a wake-up. Unset (the default): auto_spin() of the CPUs the process may run on,
  // 50 us where there are at least kAutoSpinMinCpus and 0 (sleep at once) on fewer. Spinning
  // pays only where cores are to spare: on a 16-core host 50 us (with wait_spin's) took shm imm
  // round trips with the worker thread from 23.4 to 7.1 us p50 and tcp from 58.0 to 36.8; on
  // two cores it took them from 23 to 316 us (bench/results/2026-11-29_5a2701d_H200/README.md,
  // "Engine tuning"). Environment: FABRIC_CALLBACK_SPIN_US (microseconds, or "auto").
  std::optional<std::chrono::microseconds> callback_spin;
  // Run completion callbacks (on_done, on_error), expect_imm callbacks and the unexpected-imm
  // handler on the worker thread that saw them, as soon as it does, instead of handing them to
  // the callback thread: no thread hop and no wake-up between an arrival and its callback (an
  // imm round trip's answer goes out from the worker). Such a callback must be short and must
  // not block: it may submit, expect_imm, read counts, addresses and stats. Calls that would
  // wait for a worker refuse there: register_memory and unregister_memory return
  // InvalidArgument, close() logs an error and returns, wait_imm does not wait (it returns
  // whether the count is reached now). Destroying the engine from such a callback is not
  // allowed. A callback that throws is caught and logged. expect_imm callbacks already due when
  // expect_imm is called, and callbacks of transfers cancelled by close(), still run on the
  // callback thread.
  // Environment: FABRIC_CALLBACKS_ON_WORKER=0|1.
  bool callbacks_on_worker = false;
  // wait_imm polls for this long before it sleeps, so that an arrival soon after the call is
  // seen without a wake-up of the waiting thread. Unset (the default): auto_spin(), as for
  // callback_spin. Zero: sleep at once. Environment: FABRIC_WAIT_SPIN_US (microseconds, or
  // "auto").
  std::optional<std::chrono::microseconds> wait_spin;
  // What an unset callback_spin or wait_spin means for a process allowed to run on `cpus` CPUs.
  static constexpr unsigned kAutoSpinMinCpus = 8;
  static constexpr std::chrono::microseconds kAutoSpin{50};
  static constexpr std::chrono::microseconds auto_spin(size_t cpus) {
    return cpus >= kAutoSpinMinCpus ? kAutoSpin : std::chrono::microseconds(0);
  }

  // Two-sided messages: largest message submit_send accepts, and how many send buffers of
  // that size each group keeps registered (more sends than that wait for a free buffer).
  uint64_t max_message_bytes = 64 * 1024;
  uint32_t send_buffers = 64;
  // Receive buffers (of max_message_bytes) each group keeps posted from the start on each of
  // its NICs, for the engine's own messages (the staged path's commits and acknowledgments). User
  // messages that arrive before set_receive_handler land there too and are dropped with a
  // warning.
  uint32_t control_buffers = 32;

  // The staged path: GPU memory on NICs that cannot reach it goes through pinned host memory,
  // pipelined in chunks of this many bytes (the copy of one chunk overlaps the network write of
  // the one before, and the owner copies each chunk into the GPU as it lands).
  uint64_t staging_chunk_bytes = 1 << 20;
  // Let providers that can reach GPU memory themselves (FI_HMEM: EFA; shm in libfabric builds
  // with CUDA) register it directly. Off, or where no NIC of a group can, GPU memory is staged.
  bool gpu_direct = true;

  // Writes larger than this are split into several work requests (on the same NIC), so that
  // every work request completes in bounded time and peer_timeout stays meaningful.
  uint64_t max_wr_bytes = 64ull << 20;
  // A peer towards which work requests are outstanding and from which no completion came for
  // this long is declared unreachable: its transfers fail with kPeerUnreachable, its address is
  // dropped, and a later submission to the same address connects afresh.
  std::chrono::milliseconds peer_timeout{30000};

  // NIC failover (docs/failover.md). A NIC whose work towards a peer makes no progress for
  // nic_timeout while another NIC of the group completed work within that time is marked down:
  // it gets no new work, its queued work moves to the surviving NICs, and its posted writes
  // without an immediate and its messages are re-posted there (the receiver drops a message it
  // already has). Messages stalled for nic_timeout on a NIC that is not marked down, and
  // Commits unacknowledged for nic_timeout, are sent again over the next NIC that is up.
  // Failover is on only when nic_timeout is
  // non-zero and shorter than peer_timeout (otherwise only peer_timeout applies).
  std::chrono::milliseconds nic_timeout{5000};
  // How often a NIC marked down is probed (a zero-byte write to the peer it lost); the first
  // probe that completes brings it back into use.
  std::chrono::milliseconds nic_probe_interval{500};
  // Immediates of writes to host memory travel as one engine message (a Commit, which fails
  // over like any message) after all of the transfer's data has completed; the receiver counts them
  // when it arrives. Data writes then carry no immediate, so a NIC failure mid-write re-posts
  // them without any risk of double counting. Off (the default), an
  // immediate rides on its write (WriteImm): one work request less per write, but a write
  // carrying an immediate that was in flight on a NIC that failed cannot be re-sent (it may
  // have been counted), so its transfer fails. Imm-only writes and barriers always ride the
  // fabric.
  bool reliable_imm = false;

  // Same-host GPU to GPU over CUDA IPC (docs/cuda-ipc.md): a write from registered CUDA memory
  // into a peer's registered CUDA memory, where the peer engine runs on this host (another
  // process) and its GPU can reach this one (the same GPU, or peer access over NVLink or PCIe),
  // is copied GPU to GPU by the destination's owner instead of moving over the fabric. kAuto:
  // that path wherever it is possible, the fabric elsewhere. kOn: a write from or into CUDA
  // memory that cannot take the path is rejected with kUnsupported naming why. kOff: never.
  enum class CudaIpc : uint8_t { kAuto, kOn, kOff };
  CudaIpc cuda_ipc = CudaIpc::kAuto;
  // CUDA streams the owner of a destination copies on (jobs are spread over them in turn).
  uint32_t cuda_ipc_streams = 4;
  // The same-host transport (provider "shm", docs/shm.md): threads that copy one large incoming
  // write together (2 MiB or more, in parts of 1 MiB or more), the receiving worker included. 0:
  // half the CPUs the process may run on, 1 to 8; 1: the worker alone. At most 64. Environment:
  // FABRIC_SHM_COPY_THREADS.
  uint32_t shm_copy_threads = 0;

  // How long close() lets posted work requests finish before cancelling them.
  std::chrono::milliseconds close_timeout{2000};

  FaultConfig faults;
  VerbsConfig verbs;

  // Applies FABRIC_PROVIDER, FABRIC_NICS (comma-separated, group 0), FABRIC_CPU,
  // FABRIC_SPIN_US, FABRIC_IDLE_SLEEP_US, FABRIC_INFLIGHT_SPIN_US, FABRIC_CALLBACK_SPIN_US and
  // FABRIC_WEIGHTED_SHARDING (0 or 1), FABRIC_CUDA_IPC (auto, on or off) and
  // FABRIC_SHM_COPY_THREADS (0 to 64).
  // Returns an error naming a malformed variable.
  Status apply_env_overrides();
};

}  // namespace fabric
