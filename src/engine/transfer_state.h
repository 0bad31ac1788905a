// Internal state of accepted transfers and registrations, shared by the engine (which plans
// transfers on the submitting thread) and the worker (which posts and completes them).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "fabric/address.h"
#include "fabric/transfer.h"
#include "transport/domain.h"

namespace fabric::engine {

class Worker;

// One registration of one device group: a provider registration per NIC of the group.
// The provider registrations are released on the group's worker when the last holder (the
// engine's table, or a transfer using it) lets go.
struct LocalRegion {
  uint64_t id = 0;
  std::byte* ptr = nullptr;
  uint64_t length = 0;
  uint32_t group = 0;
  Worker* worker = nullptr;
  std::vector<std::unique_ptr<transport::MemoryRegistration>> regs;  // one per NIC

  ~LocalRegion();
};

struct Transfer;
struct PeerQueue;

// One work request. Its address is the wr_id the domain hands back on completion, so an Op
// never moves once the transfer is accepted.
struct Op {
  enum class Kind : uint8_t { kWrite, kSend };
  Transfer* transfer = nullptr;
  Kind kind = Kind::kWrite;
  bool has_imm = false;
  uint32_t domain = 0;
  uint32_t imm = 0;
  bool abandoned = false;       // its peer was declared dead while the provider still held it
  int32_t send_slot = -1;       // kSend: the registered send buffer in use while posted
  const Bytes* peer = nullptr;  // the peer NIC's endpoint name (kept alive by the transfer)
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

struct Transfer {
  TransferId id = 0;
  Callbacks callbacks;
  std::vector<Op> ops;
  // Immediates that follow the data of a write split into several pieces: posted once every
  // op has completed, so that the receiver counts one arrival after all the data is visible.
  std::vector<Op> deferred;
  bool deferred_started = false;
  size_t pending = 0;     // ops queued or posted and not yet completed
  size_t abandoned = 0;   // ops given up on (dead peer) that the provider still holds
  bool finished = false;  // the user callback has been queued
  Status error;           // the first failure
  // Keep-alives for what the ops point into.
  std::shared_ptr<LocalRegion> src;
  std::vector<RemoteMemory> dsts;
  std::vector<Address> peers;
  Bytes message;  // kSend: the copied message
};

}  // namespace fabric::engine
