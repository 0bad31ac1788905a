// verbs backend, control path: choosing the device, port and GID; opening the queues;
// registering memory; peers. Their queue pairs and the connection handshake: verbs_connect.cc.
#include "transport/verbs/verbs_domain.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>

#include "common/log.h"
#include "cuda/device_memory.h"
#include "transport/verbs/verbs_dmabuf.h"
#include "transport/verbs/verbs_objects.h"

namespace fabric::transport {

using namespace verbs_detail;

void VerbsDomain::ChannelCloser::operator()(ibv_comp_channel* c) const noexcept {
  if (c != nullptr && ibv_destroy_comp_channel(c) != 0) {
    detail::log().warn("ibv_destroy_comp_channel failed: {}", strerror(errno));
  }
}
void VerbsDomain::CqCloser::operator()(ibv_cq* c) const noexcept {
  if (c != nullptr && ibv_destroy_cq(c) != 0) {
    detail::log().warn("ibv_destroy_cq failed: {}", strerror(errno));
  }
}
void VerbsDomain::SrqCloser::operator()(ibv_srq* s) const noexcept {
  if (s != nullptr && ibv_destroy_srq(s) != 0) {
    detail::log().warn("ibv_destroy_srq failed: {}", strerror(errno));
  }
}
void VerbsDomain::MrCloser::operator()(ibv_mr* m) const noexcept {
  if (m != nullptr && ibv_dereg_mr(m) != 0) {
    detail::log().warn("ibv_dereg_mr failed: {}", strerror(errno));
  }
}

namespace {

constexpr uint32_t kCqDepth = 16384;
constexpr uint32_t kQpSendDepth = 512;
constexpr uint32_t kMsgSrqDepth = 1024;
constexpr uint32_t kImmSrqDepth = 1024;
constexpr uint8_t kMaxRdAtomic = 16;  // RDMA reads outstanding per queue pair, at most
constexpr uint32_t kUdRecvSlots = 64;
constexpr uint32_t kUdSendSlots = 64;

bool ipv4_mapped(const ibv_gid& g) {
  static constexpr uint8_t kPrefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return std::memcmp(g.raw, kPrefix, sizeof(kPrefix)) == 0;
}

// Whether the IPv4 address in a mapped GID is an address of the interface `ifindex`.
bool ipv4_on_interface(const ibv_gid& g, uint32_t ifindex) {
  char name[IF_NAMESIZE] = {};
  if (ifindex == 0 || if_indextoname(ifindex, name) == nullptr) return false;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return false;
  bool found = false;
  for (ifaddrs* a = list; a != nullptr && !found; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    if (std::strcmp(a->ifa_name, name) != 0) continue;
    const auto* sin = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
    found = std::memcmp(&sin->sin_addr, g.raw + 12, 4) == 0;
  }
  freeifaddrs(list);
  return found;
}

// The GID the backend uses on a port: on RoCE, the RoCE v2 GID carrying an IPv4 address of the
// port's interface (routable, and what rxe and ConnectX both offer); on InfiniBand, GID 0.
// Returns -1 when none fits. `netdev` gets the interface name of a RoCE port.
int pick_gid(ibv_context* ctx, uint8_t port, const ibv_port_attr& pa, std::string& netdev) {
  if (pa.link_layer == IBV_LINK_LAYER_INFINIBAND) return 0;
  int fallback = -1;
  for (int i = 0; i < pa.gid_tbl_len; ++i) {
    ibv_gid_entry e{};
    if (ibv_query_gid_ex(ctx, port, static_cast<uint32_t>(i), &e, 0) != 0) continue;
    if (e.gid_type != IBV_GID_TYPE_ROCE_V2 || !ipv4_mapped(e.gid)) continue;
    char name[IF_NAMESIZE] = {};
    if (e.ndev_ifindex != 0 && if_indextoname(e.ndev_ifindex, name) != nullptr) netdev = name;
    if (ipv4_on_interface(e.gid, e.ndev_ifindex)) return i;
    if (fallback < 0) fallback = i;
  }
  return fallback;
}

const char* port_state_name(ibv_port_state s) {
  return ibv_port_state_str(s);
}

struct DeviceList {
  ibv_device** list = nullptr;
  int count = 0;
  DeviceList() { list = ibv_get_device_list(&count); }
  ~DeviceList() {
    if (list != nullptr) ibv_free_device_list(list);
  }
};

class VerbsRegistration final : public MemoryRegistration {
 public:
  VerbsRegistration(std::shared_ptr<Device> dev, ibv_mr* mr, uint64_t addr)
      : dev_(std::move(dev)), mr_(mr) {
    // The local key travels in the descriptor pointer, tagged so that it is never null.
    local_desc_ = reinterpret_cast<void*>(uintptr_t{mr->lkey} | (uintptr_t{1} << 32));
    remote_addr_ = addr;
    remote_key_ = mr->rkey;
  }
  ~VerbsRegistration() override {
    if (ibv_dereg_mr(mr_) != 0) detail::log().warn("ibv_dereg_mr failed: {}", strerror(errno));
  }

 private:
  std::shared_ptr<Device> dev_;  // the protection domain outlives the region
  ibv_mr* mr_;
};

}  // namespace

std::vector<VerbsPortListing> list_verbs_ports() {
  std::vector<VerbsPortListing> out;
  DeviceList devs;
  for (int d = 0; d < devs.count; ++d) {
    ibv_context* ctx = ibv_open_device(devs.list[d]);
    if (ctx == nullptr) continue;
    ibv_device_attr da{};
    if (ibv_query_device(ctx, &da) == 0) {
      for (uint8_t p = 1; p <= da.phys_port_cnt; ++p) {
        ibv_port_attr pa{};
        if (ibv_query_port(ctx, p, &pa) != 0) continue;
        VerbsPortListing l;
        l.device = ibv_get_device_name(devs.list[d]);
        l.port = p;
        l.state = port_state_name(pa.state);
        l.active = pa.state == IBV_PORT_ACTIVE;
        l.link_layer = pa.link_layer == IBV_LINK_LAYER_INFINIBAND ? "InfiniBand" : "Ethernet";
        l.active_mtu = mtu_bytes(pa.active_mtu);
        l.gid_index = pick_gid(ctx, p, pa, l.netdev);
        ibv_gid g{};
        if (l.gid_index >= 0 && ibv_query_gid(ctx, p, l.gid_index, &g) == 0) l.gid = gid_text(g);
        out.push_back(std::move(l));
      }
    }
    ibv_close_device(ctx);
  }
  return out;
}

Result<std::unique_ptr<VerbsDomain>> VerbsDomain::open(const std::string& nic,
                                                       const VerbsConfig& config, bool gpu_direct) {
  if (config.connect_attempts == 0 || config.connect_retry.count() <= 0) {
    return Status(ErrorCode::kInvalidArgument,
                  "config.verbs.connect_attempts and config.verbs.connect_retry must be positive");
  }
  if (config.signal_every == 0) {
    return Status(ErrorCode::kInvalidArgument,
                  "config.verbs.signal_every must be at least 1 (1: every work request signalled)");
  }
  std::unique_ptr<VerbsDomain> d(new VerbsDomain());
  d->config_ = config;
  if (Status s = d->open_port(nic, gpu_direct); !s) return s;
  d->open_thread_domain();
  if (Status s = d->create_queues(); !s) return s;
  return d;
}

void VerbsDomain::open_thread_domain() {
  fast_paths_.signal_every = config_.signal_every;
  if (!config_.thread_domain) return;
  // The domain is driven by one thread at a time (domain.h): its queue pairs and completion
  // queue need none of the provider's locks. Devices without thread domains (Soft-RoCE, for
  // one) refuse with EOPNOTSUPP: then the protection domain, as without the option.
  ibv_td_init_attr ta{};
  ibv_td* td = ibv_alloc_td(dev_->ctx, &ta);
  if (td == nullptr) {
    fast_paths_.note = fmt::format("no thread domain (ibv_alloc_td: {})", strerror(errno));
    detail::log().info("verbs '{}': {}: queue pairs in the protection domain", info_.name,
                       fast_paths_.note);
    return;
  }
  ibv_parent_domain_init_attr pa{};
  pa.pd = dev_->pd;
  pa.td = td;
  ibv_pd* parent = ibv_alloc_parent_domain(dev_->ctx, &pa);
  if (parent == nullptr) {
    fast_paths_.note =
        fmt::format("no thread domain (ibv_alloc_parent_domain: {})", strerror(errno));
    detail::log().info("verbs '{}': {}: queue pairs in the protection domain", info_.name,
                       fast_paths_.note);
    ibv_dealloc_td(td);
    return;
  }
  dev_->td = td;
  dev_->parent = parent;
  fast_paths_.thread_domain = true;
  detail::log().debug("verbs '{}': queue pairs in a thread domain", info_.name);
}

Status VerbsDomain::open_port(const std::string& nic, bool gpu_direct) {
  std::string want_dev = nic;
  int want_port = 0;
  if (auto colon = nic.rfind(':'); colon != std::string::npos) {
    want_dev = nic.substr(0, colon);
    const std::string p = nic.substr(colon + 1);
    if (p.empty() || p.size() > 3 || !std::all_of(p.begin(), p.end(), ::isdigit) ||
        std::stoi(p) < 1 || std::stoi(p) > 255) {
      return Status(ErrorCode::kInvalidArgument,
                    fmt::format("verbs NIC '{}': the port after ':' must be 1 to 255", nic));
    }
    want_port = std::stoi(p);
  }
  DeviceList devs;
  if (devs.count == 0) {
    return Status(ErrorCode::kUnsupported,
                  "no RDMA (verbs) device on this machine (ibv_get_device_list found none)");
  }
  std::string seen;
  for (int i = 0; i < devs.count; ++i) {
    const char* name = ibv_get_device_name(devs.list[i]);
    seen += fmt::format("{}{}", seen.empty() ? "" : ", ", name);
    if (!want_dev.empty() && want_dev != name) continue;
    auto dev = std::make_shared<Device>();
    dev->ctx = ibv_open_device(devs.list[i]);
    if (dev->ctx == nullptr) {
      return Status(ErrorCode::kFabric,
                    fmt::format("ibv_open_device({}) failed: {}", name, strerror(errno)));
    }
    ibv_device_attr da{};
    if (ibv_query_device(dev->ctx, &da) != 0) {
      return Status(ErrorCode::kFabric,
                    fmt::format("ibv_query_device({}) failed: {}", name, strerror(errno)));
    }
    for (uint8_t p = 1; p <= da.phys_port_cnt; ++p) {
      if (want_port != 0 && p != want_port) continue;
      ibv_port_attr pa{};
      if (ibv_query_port(dev->ctx, p, &pa) != 0 || pa.state != IBV_PORT_ACTIVE) continue;
      std::string netdev;
      int gid = config_.gid_index >= 0 ? config_.gid_index : pick_gid(dev->ctx, p, pa, netdev);
      if (gid < 0 || gid >= pa.gid_tbl_len) {
        if (!want_dev.empty()) {
          return Status(ErrorCode::kNotFound,
                        fmt::format("verbs NIC '{}' port {}: {}", name, p,
                                    config_.gid_index >= 0
                                        ? fmt::format("GID index {} is outside its table of {}",
                                                      gid, pa.gid_tbl_len)
                                        : std::string("no RoCE v2 GID with an IPv4 address (give "
                                                      "the interface an IPv4 address, or set "
                                                      "config.verbs.gid_index)")));
        }
        continue;
      }
      if (ibv_query_gid(dev->ctx, p, gid, &gid_) != 0) {
        return Status(ErrorCode::kFabric,
                      fmt::format("ibv_query_gid({} port {} index {}) failed", name, p, gid));
      }
      dev->pd = ibv_alloc_pd(dev->ctx);
      if (dev->pd == nullptr) {
        return Status(ErrorCode::kFabric,
                      fmt::format("ibv_alloc_pd({}) failed: {}", name, strerror(errno)));
      }
      dev_ = std::move(dev);
      port_ = p;
      gid_index_ = gid;
      lid_ = pa.lid;
      active_mtu_ = static_cast<uint8_t>(pa.active_mtu);
      // Soft-RoCE and soft-iWARP do the NIC's work on the host's CPUs, in kernel threads that a
      // busy-polling worker would starve: an empty poll yields the CPU there.
      software_device_ = std::string_view(name).rfind("rxe", 0) == 0 ||
                         std::string_view(name).rfind("siw", 0) == 0;
      gpu_direct_ = gpu_direct && cuda::cuda_available() && dmabuf_supported();
      info_ = DomainInfo{"verbs", fmt::format("{}:{}", name, p), pa.max_msg_sz,
                         /*delivery_complete=*/true, gpu_direct_};
      cq_depth_ = std::min<uint32_t>(kCqDepth, static_cast<uint32_t>(da.max_cqe));
      // One send work request of each queue pair's is kept for the marker that drains it.
      qp_send_depth_ = std::min<uint32_t>(kQpSendDepth, static_cast<uint32_t>(da.max_qp_wr) - 1);
      msg_srq_depth_ = std::min<uint32_t>(kMsgSrqDepth, static_cast<uint32_t>(da.max_srq_wr));
      imm_srq_depth_ = std::min<uint32_t>(kImmSrqDepth, static_cast<uint32_t>(da.max_srq_wr));
      rd_atomic_ = static_cast<uint8_t>(
          std::clamp(std::min(da.max_qp_rd_atom, da.max_qp_init_rd_atom), 1, int{kMaxRdAtomic}));
      detail::log().debug("verbs: opened {} port {} GID {} ({}{}), active MTU {}", name, p, gid,
                          gid_text(gid_), netdev.empty() ? "" : " on " + netdev,
                          mtu_bytes(active_mtu_));
      return Status::ok();
    }
    if (!want_dev.empty()) {
      return Status(ErrorCode::kNotFound,
                    want_port ? fmt::format("verbs NIC '{}' has no active port {}", nic, want_port)
                              : fmt::format("verbs NIC '{}' has no active port", nic));
    }
  }
  if (want_dev.empty()) {
    return Status(ErrorCode::kUnsupported,
                  fmt::format("no verbs device with an active port (devices: {})", seen));
  }
  return Status(ErrorCode::kNotFound,
                fmt::format("no verbs device named '{}' (devices: {})", want_dev, seen));
}

Status VerbsDomain::create_queues() {
  ibv_context* ctx = dev_->ctx;
  auto fail = [&](const char* what) {
    return Status(ErrorCode::kFabric,
                  fmt::format("{} on '{}' failed: {}", what, info_.name, strerror(errno)));
  };
  channel_.reset(ibv_create_comp_channel(ctx));
  if (!channel_) return fail("ibv_create_comp_channel");
  for (int fd : {channel_->fd, ctx->async_fd}) {
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) return fail("fcntl(O_NONBLOCK)");
  }
  if (config_.thread_domain) {
    // Polled by one thread at a time: created single-threaded (the provider may leave out its
    // lock), in the parent domain where there is one; a provider refusing either gets the
    // plain completion queue.
    ibv_cq_init_attr_ex ca{};
    ca.cqe = cq_depth_;
    ca.channel = channel_.get();
    ca.wc_flags = IBV_WC_STANDARD_FLAGS;
    ca.comp_mask = IBV_CQ_INIT_ATTR_MASK_FLAGS;
    ca.flags = IBV_CREATE_CQ_ATTR_SINGLE_THREADED;
    if (dev_->parent != nullptr) {
      ca.comp_mask |= IBV_CQ_INIT_ATTR_MASK_PD;
      ca.parent_domain = dev_->parent;
    }
    ibv_cq_ex* cq = ibv_create_cq_ex(ctx, &ca);
    if (cq == nullptr && dev_->parent != nullptr) {
      ca.comp_mask = IBV_CQ_INIT_ATTR_MASK_FLAGS;
      ca.parent_domain = nullptr;
      cq = ibv_create_cq_ex(ctx, &ca);
    }
    if (cq != nullptr) {
      cq_.reset(ibv_cq_ex_to_cq(cq));
      fast_paths_.single_threaded_cq = true;
    } else {
      const std::string why = fmt::format(
          "no single-threaded completion queue (ibv_create_cq_ex: {})", strerror(errno));
      fast_paths_.note += fmt::format("{}{}", fast_paths_.note.empty() ? "" : "; ", why);
      detail::log().info("verbs '{}': {}", info_.name, why);
    }
  }
  if (!cq_) cq_.reset(ibv_create_cq(ctx, static_cast<int>(cq_depth_), nullptr, channel_.get(), 0));
  if (!cq_) return fail("ibv_create_cq");
  // A few entries are kept for the markers that drain queue pairs after a refused post.
  if (cq_->cqe <= static_cast<int>(kMarkerReserve)) {
    return Status(ErrorCode::kUnsupported,
                  fmt::format("'{}': its completion queue holds {} entries", info_.name, cq_->cqe));
  }
  cq_depth_ = static_cast<uint32_t>(cq_->cqe) - kMarkerReserve;
  ud_cq_.reset(ibv_create_cq(ctx, kUdRecvSlots + kUdSendSlots, nullptr, channel_.get(), 0));
  if (!ud_cq_) return fail("ibv_create_cq (handshake)");

  ibv_srq_init_attr sa{};
  sa.attr.max_wr = msg_srq_depth_;
  sa.attr.max_sge = 1;
  msg_srq_.reset(ibv_create_srq(dev_->pd, &sa));
  if (!msg_srq_) return fail("ibv_create_srq (messages)");
  sa.attr.max_wr = imm_srq_depth_;
  imm_srq_.reset(ibv_create_srq(dev_->pd, &sa));
  if (!imm_srq_) return fail("ibv_create_srq (immediates)");
  // Zero-length receives for write-with-immediate, all posted now and reposted as consumed.
  imm_consumed_ = imm_srq_depth_;
  if (cq_depth_ < imm_srq_depth_ + msg_srq_depth_ + 2 * qp_send_depth_) {
    return Status(ErrorCode::kUnsupported,
                  fmt::format("'{}': its completion queue holds {} entries, fewer than the "
                              "backend's receive queues need",
                              info_.name, cq_depth_));
  }

  // The handshake: one UD queue pair and its buffers.
  ud_recv_slots_ = kUdRecvSlots;
  ud_send_slots_ = kUdSendSlots;
  ud_buf_.assign(static_cast<size_t>(kUdSlotBytes) * (ud_recv_slots_ + ud_send_slots_),
                 std::byte{0});
  ud_mr_.reset(ibv_reg_mr(dev_->pd, ud_buf_.data(), ud_buf_.size(), IBV_ACCESS_LOCAL_WRITE));
  if (!ud_mr_) return fail("ibv_reg_mr (handshake buffers)");
  ibv_qp_init_attr qa{};
  qa.send_cq = ud_cq_.get();
  qa.recv_cq = ud_cq_.get();
  qa.qp_type = IBV_QPT_UD;
  qa.cap.max_send_wr = ud_send_slots_;
  qa.cap.max_recv_wr = ud_recv_slots_;
  qa.cap.max_send_sge = 1;
  qa.cap.max_recv_sge = 1;
  ud_qp_ = std::make_unique<QueuePair>();
  ud_qp_->role = QueuePair::Role::kHandshake;
  ud_qp_->qp = ibv_create_qp(dev_->pd, &qa);
  if (ud_qp_->qp == nullptr) return fail("ibv_create_qp (UD handshake)");
  ibv_qp_attr at{};
  at.qp_state = IBV_QPS_INIT;
  at.pkey_index = 0;
  at.port_num = port_;
  at.qkey = kQkey;
  if (ibv_modify_qp(ud_qp_->qp, &at,
                    IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY) != 0) {
    return fail("ibv_modify_qp (UD to INIT)");
  }
  at = {};
  at.qp_state = IBV_QPS_RTR;
  if (ibv_modify_qp(ud_qp_->qp, &at, IBV_QP_STATE) != 0) return fail("ibv_modify_qp (UD to RTR)");
  at.qp_state = IBV_QPS_RTS;
  at.sq_psn = 0;
  if (ibv_modify_qp(ud_qp_->qp, &at, IBV_QP_STATE | IBV_QP_SQ_PSN) != 0) {
    return fail("ibv_modify_qp (UD to RTS)");
  }
  for (uint32_t i = 0; i < ud_recv_slots_; ++i) {
    ibv_sge sge{reinterpret_cast<uint64_t>(ud_buf_.data() + i * kUdSlotBytes), kUdSlotBytes,
                ud_mr_->lkey};
    ibv_recv_wr wr{};
    wr.wr_id = i;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    if (ibv_post_recv(ud_qp_->qp, &wr, &bad) != 0) return fail("ibv_post_recv (handshake)");
  }
  for (uint32_t i = 0; i < ud_send_slots_; ++i) ud_free_send_.push_back(ud_recv_slots_ + i);

  std::random_device rd;
  instance_ = (uint64_t{rd()} << 32) | rd();
  Name n{kNameMagic, ud_qp_->qp->qp_num, instance_, {}, lid_, active_mtu_, port_, 0};
  std::memcpy(n.gid, gid_.raw, 16);
  name_.resize(sizeof(n));
  std::memcpy(name_.data(), &n, sizeof(n));
  wc_.resize(64);
  ready_.reserve(2 * qp_send_depth_);  // a signalled completion may finish a whole window
  repost_imm_receives();
  if (imm_consumed_ != 0) return fail("ibv_post_srq_recv (immediates)");
  return Status::ok();
}

VerbsDomain::~VerbsDomain() {
  destroy_queue_pairs();
}

void VerbsDomain::close() {
  // A queue pair outlives close() only as long as the domain object, which the engine frees
  // after its buffers: work still posted on one (a close that timed out) would go on reading
  // the writer's buffers and writing into the peer's, and the peer's sends would land in
  // receive buffers about to be freed. Destroyed here, nothing of it touches memory any more.
  destroy_queue_pairs();
}

void VerbsDomain::destroy_queue_pairs() {
  // Queue pairs before the queues and channel they use (members the destructor frees after),
  // address handles before the protection domain.
  // Work still queued is flushed rather than sent: a queue pair destroyed in the ready-to-send
  // state may first transmit everything posted on it (Soft-RoCE does).
  std::vector<ibv_ah*> ahs;
  for (auto& [h, p] : peers_) {
    if (p->ah != nullptr) ahs.push_back(p->ah);
    for (auto* q : {p->msg.get(), p->wr.get()}) {
      if (q == nullptr) continue;
      ibv_qp_attr at{};
      at.qp_state = IBV_QPS_ERR;
      (void)ibv_modify_qp(q->qp, &at, IBV_QP_STATE);
    }
  }
  const auto t0 = Clock::now();
  const size_t qps = 2 * peers_.size() + retired_.size();
  peers_.clear();
  retired_.clear();
  ud_qp_.reset();
  by_instance_.clear();
  by_qpn_.clear();
  qp_slots_.clear();
  free_slots_.clear();
  chained_.clear();
  post_failed_.clear();
  connecting_ = 0;
  if (qps > 0) {
    detail::log().debug(
        "verbs '{}': destroyed {} queue pairs in {} ms", info_.name, qps,
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count());
  }
  for (ibv_ah* ah : ahs) ibv_destroy_ah(ah);
  for (ibv_ah* ah : retired_ahs_) ibv_destroy_ah(ah);
  retired_ahs_.clear();
}

int VerbsDomain::wait_fd() const {
  return channel_ ? channel_->fd : -1;
}

// --- memory ---------------------------------------------------------------------------------

Result<std::unique_ptr<MemoryRegistration>> VerbsDomain::register_memory(void* ptr, uint64_t length,
                                                                         bool remote_read) {
  // Relaxed ordering lets the NIC reorder its PCIe writes (faster through some root complexes);
  // the contract never depended on their order. Devices without it ignore the flag (it is one
  // of the optional access flags), and a kernel that rejects it gets a second try without.
  // Remote reads only where the owner allowed them: the NIC refuses the others.
  const int kBase =
      IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | (remote_read ? IBV_ACCESS_REMOTE_READ : 0);
  const uint64_t addr = reinterpret_cast<uint64_t>(ptr);
  ibv_mr* mr = nullptr;
  auto memory =
      gpu_direct_ ? cuda::classify(ptr, length) : Result<cuda::PointerInfo>(cuda::PointerInfo{});
  if (!memory) return memory.status();
  if (memory->kind == cuda::MemoryKind::kCuda) {
    // GPU memory: through a dma-buf of its pages, registered at its virtual address.
    auto buf = dmabuf_for(ptr, length);
    if (!buf) return buf.status();
    mr = ibv_reg_dmabuf_mr(dev_->pd, buf->offset, length, addr, buf->fd,
                           kBase | IBV_ACCESS_RELAXED_ORDERING);
    int err = errno;
    dmabuf_close(*buf);
    if (mr == nullptr) {
      return Status(ErrorCode::kFabric,
                    fmt::format("ibv_reg_dmabuf_mr of {} bytes of GPU memory at {} on '{}' "
                                "failed: {}",
                                length, ptr, info_.name, strerror(err)));
    }
  } else {
    mr = ibv_reg_mr(dev_->pd, ptr, length, kBase | IBV_ACCESS_RELAXED_ORDERING);
    if (mr == nullptr && errno == EINVAL) mr = ibv_reg_mr(dev_->pd, ptr, length, kBase);
    if (mr == nullptr) {
      return Status(ErrorCode::kFabric,
                    fmt::format("ibv_reg_mr of {} bytes at {} on '{}' failed: {}", length, ptr,
                                info_.name, strerror(errno)));
    }
  }
  return std::unique_ptr<MemoryRegistration>(new VerbsRegistration(dev_, mr, addr));
}

// --- peers ----------------------------------------------------------------------------------

Peer* VerbsDomain::peer_of(PeerHandle h) {
  auto it = peers_.find(h);
  return it == peers_.end() ? nullptr : it->second.get();
}

Peer& VerbsDomain::peer_by_instance(uint64_t instance, const ibv_gid& gid, uint32_t ud_qpn,
                                    uint16_t lid, uint8_t mtu) {
  if (auto it = by_instance_.find(instance); it != by_instance_.end()) {
    return *peers_.at(it->second);
  }
  auto p = std::make_unique<Peer>();
  p->handle = next_handle_++;
  p->instance = instance;
  p->gid = gid;
  p->ud_qpn = ud_qpn;
  p->lid = lid;
  p->mtu = mtu;
  ibv_ah_attr ah{};
  ah.is_global = 1;
  ah.grh.dgid = gid;
  ah.grh.sgid_index = static_cast<uint8_t>(gid_index_);
  ah.grh.hop_limit = kHopLimit;
  ah.dlid = lid;
  ah.port_num = port_;
  p->ah = ibv_create_ah(dev_->pd, &ah);
  if (p->ah == nullptr) {
    p->state = Peer::State::kFailed;
    p->failed_at = Clock::now();
    p->error =
        fmt::format("ibv_create_ah towards GID {} failed: {}", gid_text(gid), strerror(errno));
  }
  Peer& ref = *p;
  by_instance_[instance] = p->handle;
  peers_.emplace(p->handle, std::move(p));
  return ref;
}

Result<PeerHandle> VerbsDomain::resolve_peer(std::span<const std::byte> name) {
  Name n{};
  if (name.size() != sizeof(Name)) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("'{}': a verbs peer address has {} bytes, not {} (is the peer using "
                              "the verbs backend?)",
                              info_.name, sizeof(Name), name.size()));
  }
  std::memcpy(&n, name.data(), sizeof(n));
  if (n.magic != kNameMagic) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("'{}': not a verbs peer address (magic {:#x})", info_.name, n.magic));
  }
  if (auto it = by_instance_.find(n.instance); it != by_instance_.end()) return it->second;
  ibv_gid gid{};
  std::memcpy(gid.raw, n.gid, 16);
  return peer_by_instance(n.instance, gid, n.ud_qpn, n.lid, n.mtu).handle;
}

void VerbsDomain::forget_peer(PeerHandle h) {
  Peer* p = peer_of(h);
  if (p == nullptr) return;
  retire_qps(*p, ErrorCode::kPeerUnreachable, "the engine declared the peer unreachable");
  if (p->state == Peer::State::kConnecting) --connecting_;
  if (p->ah != nullptr) retired_ahs_.push_back(p->ah);  // a handshake may still be in flight
  by_instance_.erase(p->instance);
  peers_.erase(h);
}

}  // namespace fabric::transport
