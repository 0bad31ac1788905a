// The verbs backend: one NIC (an RDMA device port) through libibverbs, with Reliable Connection
// queue pairs. The same code serves ConnectX, any other RC NIC, and Soft-RoCE (rxe).
//
// Per NIC: one protection domain, one completion queue, two shared receive queues (one for
// messages, one for the zero-length receives that write-with-immediate consumes) and one UD
// queue pair that carries the connection handshake. Per peer: two RC queue pairs, one for
// send/recv and one for RDMA writes, so that a message never consumes a receive meant for an
// immediate or the other way round.
//
// Control path (opening, registration, peers, the handshake) in verbs_domain.cc; hot path
// (post, poll) in verbs_datapath.cc. docs/verbs.md has the design and its reasons.
#pragma once

#include <infiniband/verbs.h>

#include <chrono>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "fabric/config.h"
#include "transport/domain.h"

namespace fabric::transport {

// A port of a verbs device, for fabric-info.
struct VerbsPortListing {
  std::string device;  // "rxe0", "mlx5_0"
  uint8_t port = 0;
  std::string state;  // ibv_port_state_str: "active", "down", ...
  bool active = false;
  std::string link_layer;   // "Ethernet" (RoCE) or "InfiniBand"
  uint32_t active_mtu = 0;  // bytes
  int gid_index = -1;       // the GID the backend would pick (-1: none usable)
  std::string gid;          // that GID, in the usual colon form
  std::string netdev;       // the network interface of a RoCE port
};
// Every port of every verbs device; empty when there is none (or libibverbs finds no driver).
std::vector<VerbsPortListing> list_verbs_ports();

// The fast paths an opened verbs domain runs with (VerbsDomain::fast_paths(); docs/verbs.md).
struct VerbsFastPaths {
  uint32_t signal_every = 1;        // a send work request in that many asks for a completion
  bool thread_domain = false;       // RC queue pairs in a parent domain with a thread domain
  bool single_threaded_cq = false;  // the completion queue made IBV_CREATE_CQ_ATTR_SINGLE_THREADED
  std::string note;                 // why one asked for is off ("" when none is)
};

namespace verbs_detail {
struct Device;  // context and protection domain, shared with registrations
struct Peer;
struct QueuePair;
struct Hello;
}  // namespace verbs_detail

class VerbsDomain final : public Domain {
 public:
  // Opens `nic`: "DEVICE" (its first active port), "DEVICE:PORT", or empty (the first device
  // with an active port). kUnsupported when the machine has no verbs device.
  static Result<std::unique_ptr<VerbsDomain>> open(const std::string& nic,
                                                   const VerbsConfig& config, bool gpu_direct);
  ~VerbsDomain() override;

  const DomainInfo& info() const override { return info_; }
  const Bytes& endpoint_name() const override { return name_; }
  const VerbsFastPaths& fast_paths() const { return fast_paths_; }
  // Send completions read from the completion queue so far (signalled requests, and whatever
  // the device reports after an error): for tests of selective signalling.
  uint64_t send_completions_read() const { return send_cqes_; }

  Result<std::unique_ptr<MemoryRegistration>> register_memory(void* ptr, uint64_t length,
                                                              bool remote_read) override;
  Result<PeerHandle> resolve_peer(std::span<const std::byte> name) override;
  void forget_peer(PeerHandle peer) override;

  PostResult post_write(const WriteRequest& req) override;
  PostResult post_read(const ReadRequest& req) override;
  PostResult post_send(const SendRequest& req) override;
  PostResult post_recv(const RecvRequest& req) override;
  void flush() override;
  size_t poll(std::span<Completion> out) override;
  int wait_fd() const override;
  bool ready_to_wait() override;
  // Destroys every queue pair (posted work is flushed, never sent): nothing posted reads or
  // writes memory once it returns.
  void close() override;

 private:
  using Clock = std::chrono::steady_clock;
  VerbsDomain() = default;

  // --- control path (verbs_domain.cc) ---
  Status open_port(const std::string& nic, bool gpu_direct);
  // The thread domain and its parent domain, where the device offers them (fast_paths_).
  void open_thread_domain();
  Status create_queues();
  // Moves every queue pair to the error state and destroys it, with the address handles; the
  // domain serves no peer afterwards (close() and the destructor).
  void destroy_queue_pairs();
  verbs_detail::Peer* peer_of(PeerHandle h);
  verbs_detail::Peer& peer_by_instance(uint64_t instance, const ibv_gid& gid, uint32_t ud_qpn,
                                       uint16_t lid, uint8_t mtu);
  Status create_qps(verbs_detail::Peer& p);
  Status connect_qps(verbs_detail::Peer& p, const verbs_detail::Hello& h);
  // Moves a peer's queue pairs to the error state (their posted work flushes) and keeps them
  // until every flushed completion was read; the peer connects afresh on its next use.
  void retire_qps(verbs_detail::Peer& p, ErrorCode code, const std::string& why);
  // Posts a signalled marker on a queue pair in the error state whose newest posted request is
  // not signalled (a chained post was refused part way), so that a completion finishes it.
  void post_marker(verbs_detail::QueuePair& qp);
  // Retires the pairs of the peers whose chained post was refused (post_failed_).
  void retire_failed_posts();
  // A post towards a peer that is not connected: starts or continues connecting. kAgain while
  // connecting; kFailed when the peer never answered.
  PostResult not_connected(verbs_detail::Peer& p);
  // A write (with or without an immediate) or a read on the peer's write queue pair.
  PostResult post_rdma(ibv_wr_opcode opcode, uint64_t wr_id, const void* local, uint64_t length,
                       void* local_desc, PeerHandle peer, uint64_t remote_addr, uint64_t remote_key,
                       uint32_t imm);
  void send_hello(verbs_detail::Peer& p, uint8_t type, uint32_t echo_gen);
  void transmit_hello(const verbs_detail::Hello& h, verbs_detail::Peer& p);
  void on_hello(const verbs_detail::Hello& h);
  // Handshake datagrams, retries, delayed datagrams, async events, retired queue pairs.
  void progress();
  bool progress_handshakes();
  void read_async_events();
  void reap_retired();

  // --- hot path (verbs_datapath.cc) ---
  // Accepts `wr` (its one scatter entry `sge`, if any) into qp's chain; a full chain is posted.
  PostResult post_on(verbs_detail::QueuePair& qp, const ibv_send_wr& wr, const ibv_sge* sge);
  // Posts qp's chain, its last request signalled; work requests the provider refuses complete
  // with its error (ready_).
  void flush(verbs_detail::QueuePair& qp);
  // Turns a work completion into Completions in ready_: none, one, or (a signalled send) one
  // for every request of its queue pair that it finishes.
  void translate(const ibv_wc& wc);
  void on_send_completion(const ibv_wc& wc);
  // Hands out ready_ into out[j...]; clears ready_ once all of it went.
  void hand_out(std::span<Completion> out, size_t& j);
  void repost_imm_receives();

  std::shared_ptr<verbs_detail::Device> dev_;
  // Members in creation order, so that destruction runs in reverse: queue pairs before the
  // shared receive queues and completion queues they use, those before the channel.
  struct ChannelCloser {
    void operator()(ibv_comp_channel* c) const noexcept;
  };
  struct CqCloser {
    void operator()(ibv_cq* c) const noexcept;
  };
  struct SrqCloser {
    void operator()(ibv_srq* s) const noexcept;
  };
  struct MrCloser {
    void operator()(ibv_mr* m) const noexcept;
  };
  std::unique_ptr<ibv_comp_channel, ChannelCloser> channel_;
  std::unique_ptr<ibv_cq, CqCloser> cq_;     // every RC queue pair, both directions
  std::unique_ptr<ibv_cq, CqCloser> ud_cq_;  // the handshake queue pair
  std::unique_ptr<ibv_srq, SrqCloser> msg_srq_;
  std::unique_ptr<ibv_srq, SrqCloser> imm_srq_;
  std::vector<std::byte> ud_buf_;
  std::unique_ptr<ibv_mr, MrCloser> ud_mr_;
  std::unique_ptr<verbs_detail::QueuePair> ud_qp_;
  std::unordered_map<PeerHandle, std::unique_ptr<verbs_detail::Peer>> peers_;
  std::vector<std::unique_ptr<verbs_detail::QueuePair>> retired_;
  std::vector<ibv_ah*> retired_ahs_;  // of forgotten peers

  VerbsConfig config_;
  DomainInfo info_;
  Bytes name_;
  uint8_t port_ = 0;
  int gid_index_ = 0;
  ibv_gid gid_{};
  uint16_t lid_ = 0;
  uint8_t active_mtu_ = IBV_MTU_1024;  // enum ibv_mtu
  // RDMA reads a queue pair keeps outstanding as initiator, and serves as responder: the
  // device's limits, at most kMaxRdAtomic (both ends of a pair use the same kind of device).
  uint8_t rd_atomic_ = 1;
  uint64_t instance_ = 0;  // random: tells this domain from an earlier one
  bool gpu_direct_ = false;
  bool software_device_ = false;  // rxe, siw: the "NIC" runs on the host's CPUs

  std::unordered_map<uint64_t, PeerHandle> by_instance_;
  std::unordered_map<uint32_t, verbs_detail::QueuePair*> by_qpn_;  // errors and async events
  // RC queue pairs by the slot their send wr_ids carry (no lookup by number per completion).
  std::vector<verbs_detail::QueuePair*> qp_slots_;
  std::vector<uint32_t> free_slots_;
  PeerHandle next_handle_ = 1;
  VerbsFastPaths fast_paths_;
  uint64_t send_cqes_ = 0;

  // Capacity: the CQ holds every completion that can be outstanding at once. A send work
  // request holds its entry until retired from its window, signalled or not: a device may
  // report each flushed request, signalled or not, after an error.
  uint32_t cq_depth_ = 0;
  uint32_t cq_outstanding_ = 0;  // sends in windows + receives posted on both SRQs
  uint32_t qp_send_depth_ = 0;
  uint32_t msg_srq_depth_ = 0;
  uint32_t msg_srq_posted_ = 0;
  uint32_t imm_srq_depth_ = 0;
  uint32_t imm_consumed_ = 0;  // zero-length receives to repost

  // Handshake datagrams: receive slots then send slots in ud_buf_.
  uint32_t ud_recv_slots_ = 0;
  uint32_t ud_send_slots_ = 0;
  std::vector<uint32_t> ud_free_send_;
  uint32_t hellos_sent_ = 0;  // for the fault injection
  struct DelayedHello;
  std::deque<std::unique_ptr<DelayedHello>> delayed_;  // fault injection: datagrams sent late
  uint32_t connecting_ = 0;                            // peers in the connecting state
  uint32_t poll_calls_ = 0;

  std::vector<ibv_wc> wc_;
  std::vector<ibv_wc> stash_;  // completions read by ready_to_wait, handed out by poll first
  std::vector<verbs_detail::QueuePair*> chained_;      // queue pairs with a chain to post
  std::vector<verbs_detail::QueuePair*> post_failed_;  // whose chained post was refused
  // Completions made and not yet handed out by poll (from ready_head_ on): the requests a
  // signalled completion finished, the ones a chained post refused.
  std::vector<Completion> ready_;
  size_t ready_head_ = 0;
};

}  // namespace fabric::transport
