// EngineStats: what an engine has done since it was created, per device group. Cheap to keep
// (relaxed atomic counters bumped where a submission is handed to its worker and where its
// callback runs, no lock) and cheap to read (TransferEngine::stats() copies them).
//
// Counted at the API: a transfer counts once however many work requests and NICs it took; a
// rejected submission (an error returned by submit) counts nothing. Python exports these to
// Prometheus (fabric_lib.metrics; docs/metrics.md).
#pragma once

#include <cstdint>
#include <vector>

namespace fabric {

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
};

struct EngineStats {
  std::vector<GroupStats> groups;  // indexed by device group
  // Immediates counted by the engine's counters (every group and NIC; one per arrival, so a
  // paged write with an immediate counts one per page).
  uint64_t immediates_received = 0;
};

}  // namespace fabric
