// The same-host transport (Config::provider "shm"; docs/shm.md): processes of one host, through
// shared-memory rings that no process ever locks, robust to a peer's death by construction.
//
// Writes are receiver-driven: the writer posts a command; the receiver's worker checks the key
// against its live registrations, copies the bytes (process_vm_readv from the writer, or
// chunks carried in the ring), only then counts the immediate, and acknowledges. A write's
// completion therefore means the bytes are in the receiver's memory.
#pragma once

#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/fifo.h"
#include "common/recycling_map.h"
#include "transport/domain.h"
#include "transport/shm/shm_copy.h"
#include "transport/shm/shm_ring.h"

namespace fabric::transport {

// One process-wide mapping of a region (shm_domain.cc).
struct ShmMapping;

// DomainInfo::provider of this transport (and so the provider its addresses carry).
inline constexpr const char* kShmProviderInfo = "shm (fabric)";

class ShmDomain final : public Domain {
 public:
  // The region's name prefix in /dev/shm (the full name adds pid, a random instance, an index).
  static constexpr const char* kNamePrefix = "fabric-shm.";
  // nic: "shm" or empty (the transport has one NIC per host; each open makes a new endpoint).
  // ring_bytes: per inbound slot, a power of two (tests use small rings). copy_threads: threads
  // that copy large incoming writes, or a window of them, together, this endpoint's polling thread
  // included (Config::shm_copy_threads; 0: the default of shm::ParallelCopier).
  static Result<std::unique_ptr<ShmDomain>> open(const std::string& nic,
                                                 uint64_t ring_bytes = kDefaultRingBytes,
                                                 uint32_t copy_threads = 0);
  ~ShmDomain() override;

  static constexpr uint64_t kDefaultRingBytes = 512 << 10;

  const DomainInfo& info() const override { return info_; }
  const Bytes& endpoint_name() const override { return name_bytes_; }

  Result<std::unique_ptr<MemoryRegistration>> register_memory(void* ptr, uint64_t length,
                                                              bool remote_read) override;
  Result<PeerHandle> resolve_peer(std::span<const std::byte> name) override;
  void forget_peer(PeerHandle peer) override;

  PostResult post_write(const WriteRequest& req) override;
  PostResult post_read(const ReadRequest& req) override;
  PostResult post_send(const SendRequest& req) override;
  PostResult post_recv(const RecvRequest& req) override;
  size_t poll(std::span<Completion> out) override;
  // A datagram socket in the abstract namespace (no file): senders that published records
  // while this endpoint was about to block send it a byte. -1 where it could not be bound.
  int wait_fd() const override { return doorbell_; }
  bool ready_to_wait() override;
  void close() override;

  // What came in so far: writes copied from the writer's memory (process_vm_readv) and write
  // bytes that came through the ring instead.
  struct Stats {
    uint64_t cma_writes = 0;           // with bytes, into a range their registration holds
    uint64_t cma_parallel_writes = 0;  // of those, copied by several threads
    uint64_t ring_write_bytes = 0;
    uint64_t cma_reads = 0;        // reads served by process_vm_writev into the reader
    uint64_t ring_read_bytes = 0;  // read bytes served through the ring instead
  };
  uint32_t copy_threads() const { return copier_->threads(); }
  const Stats& stats() const { return stats_; }
  // The region's name (without the leading '/').
  const std::string& region_name() const { return name_; }
  // Removes regions in /dev/shm that processes now dead left behind (SIGKILL skips close());
  // returns how many. Run by open().
  static int remove_dead_regions();

 private:
  struct Registry;
  struct Remote;
  struct Inbound;
  struct TxItem;
  struct Pending {
    PeerHandle peer = 0;
    uint64_t wr_id = 0;
    uint64_t bytes = 0;
    std::byte* read_into = nullptr;  // a read: where its `bytes` go
  };
  static constexpr size_t kMaxPendingKept = 4096;  // pending_'s nodes kept for reuse

  ShmDomain() = default;
  Result<Remote*> connect(const std::string& name);
  Remote* find_remote(PeerHandle peer);
  void fail_remote(Remote& r, const std::string& why);
  bool remote_gone(Remote& r, std::string& why);
  void pump(Remote& r);
  bool push_item(Remote& r, TxItem& item);
  void consume(uint32_t slot, Inbound& in, uint64_t& budget);
  void start_claim(uint32_t slot, Inbound& in, uint64_t word);
  // Writes through the ring, in chunks (on_write); writes by process_vm_readv, a record each,
  // taken in runs and copied side by side (on_cma_writes, copy_cma_batch).
  void on_write(Inbound& in, const shm::Record& rec, const std::byte* payload);
  static bool whole_cma_write(const shm::Record& rec);
  void on_cma_writes(uint32_t slot, Inbound& in, shm::Record rec, uint64_t& budget);
  void copy_cma_batch(uint32_t pid);
  void on_send(Inbound& in, const shm::Record& rec, const std::byte* payload);
  void on_ack(const shm::Record& rec);
  // The owner's side of a read (checked, then copied into the reader or queued as kReadData),
  // and the reader's side of kReadData.
  void serve_read(Inbound& in, const shm::Record& rec);
  void on_read_data(const Inbound& in, const shm::Record& rec, const std::byte* payload);
  void acknowledge(Inbound& in, uint64_t seq, ErrorCode code);
  void release(Remote& r);
  void ring(Remote& r);
  bool work_pending() const;
  ErrorCode check_access(uint64_t addr, uint64_t length, uint64_t key, bool read = false) const;
  PostResult post(PeerHandle peer, uint64_t wr_id, TxItem item);

  DomainInfo info_;
  std::string name_;  // region name, no leading '/'
  Bytes name_bytes_;  // endpoint name: "/" + name_
  uint64_t ring_bytes_ = 0;
  std::shared_ptr<ShmMapping> mapping_;  // our region (shared with this process's peers)
  void* base_ = nullptr;
  uint64_t size_ = 0;
  shm::RegionHeader* header_ = nullptr;
  int doorbell_ = -1;
  bool closed_ = false;
  bool unlinked_ = false;
  uint32_t pid_ = 0;
  uint64_t start_time_ = 0;
  uint64_t probe_value_ = 0;  // read by peers through process_vm_readv to test CMA

  std::shared_ptr<Registry> registry_;
  uint64_t next_key_ = 0;
  uint64_t next_seq_ = 1;
  PeerHandle next_handle_ = 1;

  std::map<PeerHandle, std::unique_ptr<Remote>> remotes_;
  // Looked up by the string_view of a peer's name on every post (no string built).
  struct NameHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  std::unordered_map<std::string, PeerHandle, NameHash, std::equal_to<>> by_name_;
  RecyclingMap<uint64_t, Pending> pending_{kMaxPendingKept};  // by sequence number
  std::vector<std::unique_ptr<Inbound>> inbound_;             // one per slot of our region
  std::deque<RecvRequest> recvs_;                             // posted receives, in order
  std::deque<Bytes> unexpected_;                              // messages that came before a receive
  Fifo<Completion> ready_;  // completions poll() has yet to hand out
  std::unique_ptr<shm::ParallelCopier> copier_;
  struct CmaWrite {
    shm::Record rec;
    ErrorCode error;
    bool tried;  // bytes to copy, and a range its registration holds
  };
  static constexpr size_t kMaxCmaBatch = 64;  // writes taken in one run
  std::vector<CmaWrite> cma_batch_;           // the run being copied (reused)
  struct CmaPiece {                           // a page-aligned part of one write of the run
    uint64_t src;
    std::byte* dst;
    uint64_t length;
    uint32_t write;  // its index in cma_batch_
  };
  std::vector<CmaPiece> cma_pieces_;
  std::vector<uint8_t> cma_piece_ok_;  // one byte per piece, each set by the thread copying it
  std::chrono::steady_clock::time_point now_{};
  Stats stats_;
};

}  // namespace fabric::transport
