// FABRIC: a NIXL backend engine (nixlBackendEngine) over one fabric::TransferEngine.
//
// What NIXL calls map to (docs/nixl.md has the whole table):
//   registerMem      TransferEngine::register_memory (DRAM and VRAM; readable by peers)
//   getPublicData    the registration's RemoteMemory descriptor, encoded
//   getConnInfo      the engine's group 0 Address, encoded
//   postXfer         one SingleWrite or SingleRead per descriptor pair, sharded over the group's
//                    NICs by the engine; completions counted by the worker into the request's
//                    CompletionCounter, which checkXfer reads without a lock or a thread hop
//   notifications    an engine message, sent once every transfer of the request completed (a
//                    completed write is in the peer's memory, a completed read in ours)
//   local transfers  the same engine writing to and reading from its own address
//
// Threads. NIXL may call every method from several threads at once (its sync modes are not
// relied upon): the maps below are guarded by mu_, requests are owned by one caller at a time.
// The engine's callbacks (transfer ends, arriving messages) run on its callback thread, or
// inside checkXfer/getNotifs with the caller-driven progress mode.
//
// Bad input never crashes the agent: every descriptor is checked against its registration and
// every metadata blob is decoded with checks; errors are logged here (NIXL_ERROR) and returned
// as NIXL status codes (status_map.h).
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backend/backend_engine.h"
#include "fabric/engine.h"

namespace fabric::nixl_backend {

class MetricsServer;

// How the engine is driven: its own worker threads (the default), or the threads that call
// checkXfer and getNotifs (GroupConfig::caller_progress: no worker thread, no thread hop).
enum class Progress { kWorker, kCaller };

// What a backend is created with: NIXL's custom parameters (get_options() lists them with
// their defaults), over the engine's defaults and its FABRIC_* environment.
struct BackendOptions {
  Config config;
  Progress progress = Progress::kWorker;
  int metrics_port = -1;  // < 0: no Prometheus endpoint

  static nixl_b_params_t defaults();
  // Errors name the parameter at fault.
  static Result<BackendOptions> parse(const nixl_b_params_t& params);
};

// A local registration (registerMem).
struct LocalRegion : nixlBackendMD {
  LocalRegion() : nixlBackendMD(true) {}
  MemoryHandle handle;
  uintptr_t base = 0;
  uint64_t length = 0;
  nixl_mem_t mem = DRAM_SEG;
  RemoteMemory descriptor;  // what getPublicData hands out
};

// A peer's registration (loadRemoteMD), or one of ours seen as a target (loadLocalMD).
struct RemoteRegion : nixlBackendMD {
  RemoteRegion() : nixlBackendMD(false) {}
  std::string agent;
  RemoteMemory memory;
  uintptr_t base = 0;  // the owner's virtual address of byte 0 (descriptor addresses are theirs)
};

// One posting of a request: what checkXfer reads. Owned by its request; shared with the
// callbacks of its transfers when it carries a notification; retired (FabricBackend::retire)
// when its request lets go of it mid-flight.
struct Posting {
  CompletionCounter counter;  // counted by the engine's worker, before any callback
  uint64_t submitted = 0;     // transfers accepted by the engine
  Status submit_error;        // the submission that failed, if one did (no later ones were made)
  // Notification: sent once every transfer ended well, by the first to see it: checkXfer (no
  // thread hop) or the callback of the last transfer to end (when nobody polls). With worker
  // threads its delivery is not waited for (a failed delivery is logged); caller-driven, the
  // request ends once it is delivered.
  bool has_notif = false;
  std::string notif;
  std::atomic<uint64_t> unfinished{0};     // transfers not ended, + 1 while postXfer runs
  std::atomic<bool> notif_claimed{false};  // someone sends it, or decided not to
  std::atomic<bool> notif_ended{false};    // delivered, failed, or not to be sent
  std::atomic<bool> released{false};       // releaseReqH ran: do not send the notification
  std::mutex error_mu;
  Status notif_error;  // the notification could not be submitted, or not delivered
};

// A request (prepXfer), reposted by postXfer: its descriptor pairs, checked and grouped into
// the engine transfers that carry them. Pairs that share a local registration, a remote one and
// a length become one paged transfer (one work request per pair, one completion for all: a
// batch of KV blocks); the others are single transfers, sharded over the NICs when large.
struct Request : nixlBackendReqH {
  struct Op {
    MemoryHandle local;
    RemoteMemory remote;
    uint64_t length = 0;  // of each page
    // Single: one range each side. Paged: page i at base + pages[i] * stride.
    uint64_t local_offset = 0;
    uint64_t remote_offset = 0;
    std::vector<uint32_t> local_pages;  // empty: single
    std::vector<uint32_t> remote_pages;
    uint64_t local_stride = 0;
    uint64_t remote_stride = 0;
  };
  nixl_xfer_op_t op = NIXL_WRITE;
  std::string agent;
  Address peer;  // where the notification goes
  std::vector<Op> ops;
  std::shared_ptr<Posting> posting;  // the latest postXfer's
};

class FabricBackend : public nixlBackendEngine {
 public:
  explicit FabricBackend(const nixlBackendInitParams* init_params);
  ~FabricBackend() override;

  bool supportsRemote() const override { return true; }
  bool supportsLocal() const override { return true; }
  bool supportsNotif() const override { return true; }
  nixl_mem_list_t getSupportedMems() const override { return {DRAM_SEG, VRAM_SEG}; }

  nixl_status_t registerMem(const nixlBlobDesc& mem, const nixl_mem_t& nixl_mem,
                            nixlBackendMD*& out) override;
  nixl_status_t deregisterMem(nixlBackendMD* meta) override;

  nixl_status_t connect(const std::string& remote_agent) override;
  nixl_status_t disconnect(const std::string& remote_agent) override;
  nixl_status_t unloadMD(nixlBackendMD* input) override;

  nixl_status_t getPublicData(const nixlBackendMD* meta, std::string& str) const override;
  nixl_status_t getConnInfo(std::string& str) const override;
  nixl_status_t loadRemoteConnInfo(const std::string& remote_agent,
                                   const std::string& remote_conn_info) override;
  nixl_status_t loadRemoteMD(const nixlBlobDesc& input, const nixl_mem_t& nixl_mem,
                             const std::string& remote_agent, nixlBackendMD*& output) override;
  nixl_status_t loadLocalMD(nixlBackendMD* input, nixlBackendMD*& output) override;

  nixl_status_t prepXfer(const nixl_xfer_op_t& operation, const nixl_meta_dlist_t& local,
                         const nixl_meta_dlist_t& remote, const std::string& remote_agent,
                         nixlBackendReqH*& handle,
                         const nixl_opt_b_args_t* opt_args = nullptr) const override;
  nixl_status_t postXfer(const nixl_xfer_op_t& operation, const nixl_meta_dlist_t& local,
                         const nixl_meta_dlist_t& remote, const std::string& remote_agent,
                         nixlBackendReqH*& handle,
                         const nixl_opt_b_args_t* opt_args = nullptr) const override;
  nixl_status_t checkXfer(nixlBackendReqH* handle) const override;
  nixl_status_t releaseReqH(nixlBackendReqH* handle) const override;

  nixl_status_t getNotifs(notif_list_t& notif_list) override;
  nixl_status_t genNotif(const std::string& remote_agent, const std::string& msg) const override;

 private:
  // The peer's address: ours for the local agent, else what loadRemoteConnInfo stored.
  Result<Address> peer_address(const std::string& agent) const;
  Result<Request*> make_request(const nixl_xfer_op_t& operation, const nixl_meta_dlist_t& local,
                                const nixl_meta_dlist_t& remote,
                                const std::string& remote_agent) const;
  // Sends `msg` to `agent` at `peer`; on_sent gets the outcome on the engine's callback thread.
  Status send_notif(const Address& peer, const std::string& msg,
                    std::function<void(const Status&)> on_sent) const;
  Result<TransferId> submit_op(nixl_xfer_op_t operation, const Request::Op& op, Callbacks cb) const;
  // Sends the posting's notification unless another caller did, or a transfer failed.
  void claim_notif(const std::shared_ptr<Posting>& posting, const Address& peer) const;
  void on_message(std::span<const std::byte> message);
  void drive() const;  // one pass of the engine's loop, in the caller-driven mode
  // Keeps a posting dropped by its request (released, or reposted after a failed post) until
  // every transfer it submitted has ended: the worker counts into its counter until then.
  void retire(std::shared_ptr<Posting> posting) const;

  BackendOptions options_;
  std::unique_ptr<TransferEngine> engine_;
  std::unique_ptr<MetricsServer> metrics_;

  mutable std::shared_mutex mu_;
  std::unordered_map<std::string, Address> peers_;  // by agent name

  std::mutex notifs_mu_;
  notif_list_t notifs_;  // arrived, not yet taken by getNotifs

  mutable std::mutex retired_mu_;
  mutable std::vector<std::shared_ptr<Posting>> retired_;  // see retire()
};

}  // namespace fabric::nixl_backend
