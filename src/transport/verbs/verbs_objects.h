// The verbs backend's own objects, shared by its control path and hot path.
#pragma once

#include <fmt/format.h>
#include <infiniband/verbs.h>

#include <array>
#include <bit>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "fabric/status.h"
#include "transport/domain.h"
#include "transport/verbs/signal_window.h"
#include "transport/verbs/verbs_domain.h"

namespace fabric::transport::verbs_detail {

static_assert(std::endian::native == std::endian::little,
              "the endpoint name and the handshake datagram are laid out little-endian");

// The device context and protection domain. Registrations hold it too, so that a registration
// outliving its domain still deregisters before the protection domain goes.
struct Device {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  // Where the device offers them (VerbsConfig::thread_domain): a thread domain and the parent
  // domain (of pd and td) that the RC queue pairs are created in.
  ibv_td* td = nullptr;
  ibv_pd* parent = nullptr;
  Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;
  ~Device() {
    if (parent != nullptr) ibv_dealloc_pd(parent);  // after every QP and CQ of it
    if (td != nullptr) ibv_dealloc_td(td);
    if (pd != nullptr) ibv_dealloc_pd(pd);  // after every MR and QP of it
    if (ctx != nullptr) ibv_close_device(ctx);
  }
  // What RC queue pairs are created in.
  ibv_pd* qp_pd() const { return parent != nullptr ? parent : pd; }
};

// Send work requests accepted by post_write / post_send and not yet handed to the provider:
// posted together, as one chain (one doorbell), by VerbsDomain::flush.
inline constexpr uint32_t kChainLength = 32;
struct Chain {
  std::array<ibv_send_wr, kChainLength> wrs;
  std::array<ibv_sge, kChainLength> sges;
  uint32_t length = 0;
};

// One queue pair and the send work it has posted.
struct QueuePair {
  enum class Role : uint8_t { kMessages, kWrites, kHandshake };
  ibv_qp* qp = nullptr;
  Role role = Role::kMessages;
  PeerHandle peer = 0;
  uint32_t slot = 0;        // its index in VerbsDomain::qp_slots_ (carried in its wr_ids)
  uint32_t max_inline = 0;  // the largest payload it posts inline (IBV_SEND_INLINE)
  // Send work requests accepted (chained or posted) and not yet retired, in posting order:
  // their room in the send queue and the completion queue is held until then.
  SignalWindow window;
  bool post_failed = false;  // a chained post was refused: to be retired (VerbsDomain::poll)
  Chain chain;
  ErrorCode error = ErrorCode::kOk;
  std::string error_text;  // why it entered the error state (set when retired)
  QueuePair() = default;
  QueuePair(const QueuePair&) = delete;
  QueuePair& operator=(const QueuePair&) = delete;
  ~QueuePair() {
    if (qp != nullptr) ibv_destroy_qp(qp);
  }
  const char* role_name() const {
    return role == Role::kMessages ? "send/recv" : role == Role::kWrites ? "write" : "handshake";
  }
};

// A peer NIC: its handshake address, its connection state and its two RC queue pairs.
struct Peer {
  enum class State : uint8_t { kIdle, kConnecting, kConnected, kFailed };
  PeerHandle handle = 0;
  uint64_t instance = 0;
  ibv_gid gid{};
  uint16_t lid = 0;
  uint32_t ud_qpn = 0;
  uint8_t mtu = IBV_MTU_1024;  // its active MTU (enum ibv_mtu)
  ibv_ah* ah = nullptr;        // towards its handshake queue pair (destroyed with the domain)
  State state = State::kIdle;
  std::unique_ptr<QueuePair> msg;  // send/recv
  std::unique_ptr<QueuePair> wr;   // RDMA write (with and without immediate)
  uint32_t msg_psn = 0;
  uint32_t wr_psn = 0;
  uint32_t gen = 0;         // which of our queue-pair pairs towards it this is (counts up)
  uint32_t remote_gen = 0;  // which of its pairs ours are connected to
  uint32_t attempts = 0;
  std::chrono::steady_clock::time_point next_retry{};
  std::chrono::steady_clock::time_point failed_at{};
  std::chrono::milliseconds interval{0};
  std::chrono::steady_clock::time_point first_attempt{};
  std::string error;  // why connecting failed
};

// The endpoint name: what a peer needs to send this domain a handshake datagram.
struct Name {
  uint32_t magic;
  uint32_t ud_qpn;
  uint64_t instance;
  uint8_t gid[16];
  uint16_t lid;
  uint8_t mtu;
  uint8_t port;
  uint32_t reserved;
};
static_assert(sizeof(Name) == 40);
inline constexpr uint32_t kNameMagic = 0x31425646;  // "FVB1"

// The handshake datagram.
struct Hello {
  enum Type : uint8_t { kRequest = 1, kReply = 2 };
  uint32_t magic;
  uint8_t type;
  uint8_t mtu;  // the sender's active MTU (enum ibv_mtu)
  uint16_t lid;
  uint64_t src_instance;
  uint64_t dst_instance;
  uint32_t src_ud_qpn;
  uint32_t gen;       // the sender's queue-pair generation
  uint32_t echo_gen;  // in a reply: the generation of the request it answers
  uint32_t msg_qpn;
  uint32_t wr_qpn;
  uint32_t msg_psn;
  uint32_t wr_psn;
  uint32_t reserved;
  uint8_t gid[16];
};
static_assert(sizeof(Hello) == 72);
inline constexpr uint32_t kHelloMagic = 0x48425646;  // "FVBH"
inline constexpr uint32_t kQkey = 0x11d0fab1;
inline constexpr uint32_t kGrhBytes = 40;  // a UD receive starts with the global route header

// Work-request ids: the engine's are pointers (below 2^56); receives carry a tag on top. A send
// work request carries, instead of the engine's id (which its queue pair's SignalWindow keeps),
// the send tag, its queue pair's slot (24 bits) and its sequence number in that window.
inline constexpr uint64_t kTagMask = 0xffull << 56;
inline constexpr uint64_t kMsgRecvTag = 0x01ull << 56;
inline constexpr uint64_t kImmRecvTag = 0x02ull << 56;
inline constexpr uint64_t kSendTag = 0x03ull << 56;
inline constexpr uint32_t kMaxQpSlots = 1u << 24;
inline uint64_t send_wr_id(uint32_t slot, uint32_t seq) {
  return kSendTag | (uint64_t{slot} << 32) | seq;
}
inline uint32_t slot_of(uint64_t wr_id) {
  return static_cast<uint32_t>(wr_id >> 32) & (kMaxQpSlots - 1);
}
inline uint32_t seq_of(uint64_t wr_id) {
  return static_cast<uint32_t>(wr_id);
}
// The window entry of a drain marker (VerbsDomain::post_marker): never reported. Completion
// queue entries kept for markers, beyond what posts may take.
inline constexpr uint64_t kMarkerWrId = ~uint64_t{0};
inline constexpr uint32_t kMarkerReserve = 64;

// Shared by the control path and the connection handshake.
inline constexpr uint32_t kUdSlotBytes = 256;  // a GRH and a Hello, rounded up
static_assert(kGrhBytes + sizeof(Hello) <= kUdSlotBytes);
inline constexpr uint8_t kHopLimit = 64;

inline uint32_t mtu_bytes(uint8_t mtu) {
  return mtu >= IBV_MTU_256 && mtu <= IBV_MTU_4096 ? 128u << mtu : 0;
}

inline std::string gid_text(const ibv_gid& g) {
  std::string s;
  for (int i = 0; i < 16; i += 2) {
    s += fmt::format("{}{:02x}{:02x}", i ? ":" : "", g.raw[i], g.raw[i + 1]);
  }
  return s;
}

}  // namespace fabric::transport::verbs_detail

namespace fabric::transport {
struct VerbsDomain::DelayedHello {
  std::chrono::steady_clock::time_point due;
  verbs_detail::Hello hello;
  PeerHandle peer;
};
}  // namespace fabric::transport
