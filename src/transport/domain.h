// Domain: one NIC, as the engine sees it. Backends (libfabric; verbs) implement it; the fault
// wrapper decorates it. A Domain is used by one thread at a time (its group's worker), except
// for the const accessors.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "fabric/address.h"
#include "fabric/status.h"

namespace fabric::transport {

// A registration on one domain. Destroying it deregisters (on the domain's thread).
class MemoryRegistration {
 public:
  virtual ~MemoryRegistration() = default;
  void* local_desc() const { return local_desc_; }
  uint64_t remote_addr() const { return remote_addr_; }
  uint64_t remote_key() const { return remote_key_; }

 protected:
  void* local_desc_ = nullptr;  // provider descriptor for local buffers (FI_MR_LOCAL)
  uint64_t remote_addr_ = 0;    // what peers put as the target address of byte 0
  uint64_t remote_key_ = 0;
};

// A peer's NIC resolved on one domain (an address-vector entry).
using PeerHandle = uint64_t;

struct WriteRequest {
  uint64_t wr_id;  // returned in the completion
  const void* local;
  uint64_t length;
  void* local_desc;
  PeerHandle peer;
  uint64_t remote_addr;
  uint64_t remote_key;
  bool has_imm;
  uint32_t imm;
};

// A one-sided read: `length` bytes of the peer's registered memory at `remote_addr` (its key
// `remote_key`) into `local` (registered here, `local_desc`). Its completion (kLocal) means the
// bytes are in local memory.
struct ReadRequest {
  uint64_t wr_id;
  void* local;
  uint64_t length;
  void* local_desc;
  PeerHandle peer;
  uint64_t remote_addr;
  uint64_t remote_key;
};

struct SendRequest {
  uint64_t wr_id;
  const void* local;
  uint64_t length;
  void* local_desc;
  PeerHandle peer;
};

struct RecvRequest {
  uint64_t wr_id;
  void* local;
  uint64_t length;
  void* local_desc;
};

struct Completion {
  enum class Kind : uint8_t {
    kLocal,        // a posted write or send finished (successfully or not)
    kRecv,         // a posted receive got a message
    kImm,          // a remote write carrying an immediate arrived
    kRemoteError,  // the provider reported an error on the receive side with no posted op
  };
  Kind kind;
  uint64_t wr_id;   // kLocal, kRecv
  uint32_t imm;     // kImm
  uint64_t length;  // kRecv: message bytes
  ErrorCode error = ErrorCode::kOk;
  std::string error_message;  // set when error != kOk
};

struct DomainInfo {
  std::string provider;      // "tcp;ofi_rxm", "shm", "efa", ...
  std::string name;          // the domain (NIC) name
  uint64_t max_write_bytes;  // largest single work request
  bool delivery_complete;    // a write's completion means the data is visible at the target
  // The provider can read and write CUDA memory itself (FI_HMEM): GPU buffers are registered
  // as they are (FI_HMEM_CUDA) instead of through the engine's staged path.
  bool hmem = false;
  // The provider checks a write's remote key once, when its first bytes arrive, and then
  // streams the rest into the memory: closing a registration does not stop a write already
  // arriving. The engine then fences writers when it unregisters (docs/hardening.md).
  bool key_checked_once = false;
};

struct [[nodiscard]] PostResult {
  enum class Kind : uint8_t { kPosted, kAgain, kFailed };
  Kind kind = Kind::kPosted;
  Status error;

  static PostResult posted() { return {}; }
  static PostResult again() { return {Kind::kAgain, {}}; }
  static PostResult failed(Status s) { return {Kind::kFailed, std::move(s)}; }
};

class Domain {
 public:
  virtual ~Domain() = default;

  virtual const DomainInfo& info() const = 0;
  // This domain's endpoint address (fi_getname), for the group address.
  virtual const Bytes& endpoint_name() const = 0;

  // Peers may write into the registered memory; with `remote_read`, read it too (the fabric's
  // access flags where it has them, the transport's own check where it has not).
  virtual Result<std::unique_ptr<MemoryRegistration>> register_memory(void* ptr, uint64_t length,
                                                                      bool remote_read) = 0;
  // Resolves a peer's endpoint name into a handle for posting (cached by the domain).
  virtual Result<PeerHandle> resolve_peer(std::span<const std::byte> name) = 0;
  // Drops a peer (declared dead): the handle becomes invalid and the next resolve_peer of its
  // name connects afresh.
  virtual void forget_peer(PeerHandle peer) = 0;
  // Drops the provider's connection state for a live peer (after a failure that broke the
  // connection), so that the next post towards it connects afresh; the handle stays valid.
  // Called with nothing posted towards the peer. Transports with no connection state to drop
  // need not override it.
  virtual void reset_peer(PeerHandle /*peer*/) {}

  // Posting: kPosted (a completion will come for wr_id), kAgain (queue full: nothing posted,
  // retry after polling; not a failure), or kFailed (nothing posted, `error` says why).
  virtual PostResult post_write(const WriteRequest& req) = 0;
  virtual PostResult post_read(const ReadRequest& req) = 0;
  virtual PostResult post_send(const SendRequest& req) = 0;
  virtual PostResult post_recv(const RecvRequest& req) = 0;
  // Hands the provider what post_write and post_send accepted but held back to post together
  // (verbs: one chained post, one doorbell, per queue pair). The worker calls it when a posting
  // pass over the domain ends; poll() and ready_to_wait() flush too, so nothing accepted waits
  // longer than a pass. Posting that fails here completes the work requests with the error.
  virtual void flush() {}

  // Reads up to out.size() completions; returns how many. Drives the provider's progress.
  virtual size_t poll(std::span<Completion> out) = 0;

  // Blocking support. wait_fd(): a file descriptor that becomes readable when the domain has
  // something to progress, or -1 when the provider offers none (the worker then naps instead).
  // ready_to_wait(): whether it is safe to block on the fd now (fi_trywait); false means poll
  // again first.
  virtual int wait_fd() const = 0;
  virtual bool ready_to_wait() = 0;

  // Stops serving peers (the engine closed): a backend whose peers could otherwise keep
  // writing into this process until its destruction tells them now, and a backend whose
  // endpoint may still hold posted work closes it here, while the buffers that work names are
  // alive (the engine frees its registered pools before the domain). Called once, on the
  // domain's thread, after the last poll; no post follows; the object is destroyed later.
  // Default: nothing.
  virtual void close() {}
};

}  // namespace fabric::transport
