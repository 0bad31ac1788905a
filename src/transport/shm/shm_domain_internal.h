// The same-host transport's state shared by its control side (shm_domain.cc) and its data side
// (shm_datapath.cc): a queued transmission, a connected peer, an inbound slot. Internal.
#pragma once

#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <string_view>

#include "common/fifo.h"
#include "transport/shm/shm_domain.h"
#include "transport/shm/shm_ring.h"

namespace fabric::transport {

namespace shm {

// A region name this transport makes: "/fabric-shm.<pid>.<hex>.<index>": after the prefix only
// digits, lowercase hex letters and dots. Anything else (a slash, a NUL, a byte that is not
// ASCII) came from a forged or corrupted descriptor, and is never opened nor quoted in a message.
inline bool valid_name(std::string_view name) {
  const std::string_view prefix = ShmDomain::kNamePrefix;
  if (name.size() <= prefix.size() + 1 || name.size() >= shm::kNameMax || name[0] != '/' ||
      name.substr(1, prefix.size()) != prefix) {
    return false;
  }
  for (char c : name.substr(1 + prefix.size())) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || c == '.')) return false;
  }
  return true;
}

}  // namespace shm

// The names both files of the transport use unqualified (this header is theirs alone).
using shm::load;
using shm::Record;
using shm::RecordKind;
using shm::store;
using shm::valid_name;

struct ShmDomain::TxItem {
  RecordKind kind;
  bool has_imm = false;
  bool started = false;
  bool cma = false;
  uint16_t status = 0;
  uint32_t imm = 0;
  uint64_t seq = 0;
  const std::byte* local = nullptr;
  uint64_t length = 0;
  uint64_t addr = 0;
  uint64_t key = 0;
  uint64_t offset = 0;  // bytes pushed so far
  Bytes data;           // kReadData: the bytes, copied out of the registration when served
  bool is_op() const { return kind != RecordKind::kAck && kind != RecordKind::kReadData; }
};

struct ShmDomain::Remote {
  PeerHandle handle = 0;
  std::string name;
  std::shared_ptr<ShmMapping> mapping;
  shm::RegionHeader* header = nullptr;
  shm::SlotHeader* slot = nullptr;
  uint64_t word = 0;  // our claim on `slot`
  shm::RingWriter writer;
  uint32_t pid = 0;
  uint64_t start_time = 0;
  int pidfd = -1;
  bool same_pidns = true;
  sockaddr_un doorbell{};
  socklen_t doorbell_len = 0;  // 0: the peer has no doorbell (it naps instead)
  bool dead = false;
  std::string why;
  Fifo<TxItem> tx;
  size_t ops_queued = 0;   // operations in tx
  size_t outstanding = 0;  // operations posted and not yet acknowledged or failed
  uint64_t outstanding_bytes = 0;
  std::chrono::steady_clock::time_point next_watch{};

  ~Remote() {
    if (pidfd >= 0) ::close(pidfd);
  }
};

// What the consumer knows of one slot of its own region.
struct ShmDomain::Inbound {
  shm::RingReader reader;
  uint32_t token = 0;  // the claim whose records are being read
  uint32_t pid = 0;
  std::string sender;
  bool cma = false;  // this process can reach the sender's memory (process_vm_readv/writev)
  // A write arriving in chunks.
  bool in_write = false;
  ErrorCode write_error = ErrorCode::kOk;
  // A message arriving in chunks.
  bool in_message = false;
  bool has_recv = false;
  RecvRequest recv{};
  Bytes buffer;  // when no receive was posted
  uint64_t total = 0;
  uint64_t got = 0;
  ErrorCode message_error = ErrorCode::kOk;
};

}  // namespace fabric::transport
