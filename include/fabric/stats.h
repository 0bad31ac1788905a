// EngineStats: what an engine has done since it was created, per device group. Cheap to keep
// (relaxed atomic counters bumped where a submission is handed to its worker and where its
// callback runs, no lock) and cheap to read (TransferEngine::stats() copies them).
//
// Counted at the API: a transfer counts once however many work requests and NICs it took; a
// rejected submission (an error returned by submit) counts nothing. Counted by each group's
// worker, on cache lines no submitter writes: work requests per NIC, errors by code, passes,
// sleeps and wake-ups, completion times. Python exports these to Prometheus
// (fabric_lib.metrics; docs/metrics.md).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <vector>

#include "fabric/status.h"

namespace fabric {

// What one NIC of a device group has done, counted by the group's worker (work requests of the
// engine's own messages included: acknowledgments, write-fence notes, probes).
struct NicStats {
  uint64_t work_requests_posted = 0;     // accepted by the provider
  uint64_t work_requests_completed = 0;  // completed without error
  uint64_t work_requests_failed = 0;     // completed with an error
  uint64_t post_retries = 0;             // posts the provider answered "try again" (EAGAIN)
};

// Completion times from submit() to the transfer's end (its callback queued), in buckets by
// powers of two of microseconds: bucket 0 is under 2 us, bucket i (0 < i < kBuckets - 1) is
// [2^i, 2^(i+1)) us, the last bucket everything from 2^(kBuckets-1) us (about 1 s) on.
struct LatencyHistogram {
  static constexpr size_t kBuckets = 21;
  std::array<uint64_t, kBuckets> counts{};
};

struct GroupStats {
  // One-sided transfers (single, paged, scatter, barrier, imm-only) accepted by submit().
  uint64_t transfers_submitted = 0;
  // Of those, completed (on_done ran or is about to) and failed (on_error).
  uint64_t transfers_completed = 0;
  uint64_t transfers_failed = 0;
  // Payload bytes of the accepted transfers (the sum of their writes' lengths).
  uint64_t bytes_submitted = 0;
  // Messages accepted by submit_send(), and of those completed and failed.
  uint64_t messages_sent = 0;
  uint64_t messages_completed = 0;
  uint64_t messages_failed = 0;
  // Messages delivered to the group's receive handler.
  uint64_t messages_received = 0;
  // Of the accepted transfers, those with a destination written over the CUDA IPC path
  // (docs/cuda-ipc.md), and the payload bytes that path moved for them (also counted in
  // bytes_submitted).
  uint64_t cuda_ipc_transfers = 0;
  uint64_t cuda_ipc_bytes = 0;
  // Pinned host memory now held by the staging mirrors of the group's registrations of GPU
  // memory (a gauge: up at register_memory, down at unregister_memory; docs/gpu.md). Memory
  // registered with RegisterOptions::host_mirror false has none.
  uint64_t host_mirror_bytes = 0;

  // Counted by the group's worker (relaxed, on its own cache lines; a snapshot is not atomic
  // across fields).
  std::vector<NicStats> nics;  // indexed like the group's NICs
  // Work requests of the engine's own messages among those posted (acknowledgments, Commits of
  // the staged path, write-fence notes, probes and checks): posted minus these are the user's.
  uint64_t internal_work_requests_posted = 0;
  // Transfers and messages that ended with an error, by its code (indexed by ErrorCode).
  std::array<uint64_t, static_cast<size_t>(ErrorCode::kInternal) + 1> errors_by_code{};
  // Worker passes (one loop iteration: inbox, posts, polls, watchdogs); times it blocked in
  // the kernel with nothing to do (a sleep); times a submitter woke it from one (an eventfd
  // write: one system call).
  uint64_t worker_passes = 0;
  uint64_t worker_sleeps = 0;
  uint64_t worker_wakeups = 0;
  // Submissions that took the locked overflow list behind the group's submission ring
  // (Config::submission_ring) instead of the ring: those that found it full, and those that
  // queued behind them there (a thread's order is kept). Nothing is refused or lost, but each
  // takes a mutex. Often non-zero: a larger ring pays.
  uint64_t submissions_ring_full = 0;
  // Transfers and messages accepted and not yet ended (submitted + sent - completed - failed).
  uint64_t in_flight = 0;
  // The accepted transfers' and messages' completion times, submit() to end.
  LatencyHistogram completion_latency;
};

struct EngineStats {
  std::vector<GroupStats> groups;  // indexed by device group
  // Immediates counted by the engine's counters (every group and NIC; one per arrival, so a
  // paged write with an immediate counts one per page).
  uint64_t immediates_received = 0;
  // Config::callback_spin and Config::wait_spin in effect: as configured, or what an unset one
  // resolved to on this host (Config::auto_spin).
  std::chrono::microseconds callback_spin{0};
  std::chrono::microseconds wait_spin{0};
};

}  // namespace fabric
