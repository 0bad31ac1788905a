// libfabric backend, control path: choosing and opening a domain, registering memory,
// inserting peers.
#include "transport/libfabric/lf_domain.h"

#include "transport/libfabric/lf_api.h"

#include "cuda/device_memory.h"

#include <fmt/format.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include "common/log.h"

#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>

namespace fabric::transport {

template <typename T>
void FidCloser<T>::operator()(T* p) const noexcept {
  if (p == nullptr) return;
  int rc = fi_close(&p->fid);
  if (rc != 0) detail::log().warn("fi_close failed: {}", lf::strerror(-rc));
}
template struct FidCloser<fid_fabric>;
template struct FidCloser<fid_domain>;
template struct FidCloser<fid_cq>;
template struct FidCloser<fid_av>;
template struct FidCloser<fid_ep>;
template struct FidCloser<fid_mr>;

void LfDomain::InfoFree::operator()(fi_info* p) const noexcept {
  if (p != nullptr) lf::api()->freeinfo(p);  // made by a loaded libfabric
}

namespace {

constexpr uint32_t kApiVersion = FI_VERSION(1, 17);
constexpr size_t kCqDepth = 8192;
constexpr int kEnableAttempts = 5;

// Provider facts the engine must know, kept in one place.
struct ProviderQuirks {
  // Request FI_DELIVERY_COMPLETE. Without it tcp (ofi_rxm) reports a write to a bad remote key
  // as a success; shm in libfabric 1.17 never completes delivery-complete RMA (tested here),
  // and its transmit completion already follows the copy into the target.
  bool delivery_complete = true;
  // EFA: always ask for FI_HMEM (and FI_MR_HMEM registration): it is how EFA reaches GPU
  // memory. Other providers are asked for it when CUDA is present and the config allows it
  // (Config::gpu_direct); those built without CUDA support (Debian's) refuse, and the engine
  // stages GPU memory instead.
  bool hmem = false;
  // EFA: keep same-host peers on the EFA device instead of its built-in shm transport, so that
  // every peer sees the same memory keys and completion semantics (the reference does the
  // same). Newer libfabric has FI_OPT_SHARED_MEMORY_PERMITTED; 1.17 reads this variable.
  bool disable_efa_shm = false;
  // The provider checks a write's key once per write, not per packet (DomainInfo). Providers
  // not known to check per packet count as such: the fence costs an unregister one round trip
  // to each writer, the lack of it a write into freed memory.
  bool key_checked_once = true;
};

ProviderQuirks quirks_for(const std::string& provider) {
  ProviderQuirks q;
  if (provider == "shm") q.delivery_complete = false;
  // The NIC checks every packet of an RDMA write against the key (verbs, EFA devices).
  if (provider == "efa" || provider.find("verbs") != std::string::npos) {
    q.key_checked_once = false;
  }
  if (provider == "efa") {
    q.hmem = true;
    q.disable_efa_shm = true;
  }
  return q;
}

struct InfoList {
  fi_info* head = nullptr;
  ~InfoList() {
    if (head) lf::api()->freeinfo(head);  // set only by a loaded libfabric
  }
};

fi_info* make_hints(const lf::Api& api, const std::string& provider, bool delivery_complete,
                    bool hmem) {
  fi_info* hints = api.dupinfo(nullptr);  // fi_allocinfo()
  if (hints == nullptr) return nullptr;
  hints->caps =
      FI_MSG | FI_RMA | FI_WRITE | FI_REMOTE_WRITE | FI_READ | FI_REMOTE_READ | FI_SEND | FI_RECV;
  hints->ep_attr->type = FI_EP_RDM;
  // We can hand the provider context storage with every operation.
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  // Modes we handle: local descriptors, virtual or offset addressing, provider-chosen keys.
  // (EFA needs FI_MR_LOCAL, FI_MR_PROV_KEY, FI_MR_VIRT_ADDR and FI_MR_ALLOCATED; FI_MR_HMEM
  // joins them with the GPU memory paths.)
  hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
  hints->domain_attr->threading = FI_THREAD_DOMAIN;
  hints->domain_attr->data_progress = FI_PROGRESS_MANUAL;
  if (hmem) {
    hints->caps |= FI_HMEM;
    hints->domain_attr->mr_mode |= FI_MR_HMEM;
  }
  if (delivery_complete) hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
  if (!provider.empty()) hints->fabric_attr->prov_name = strdup(provider.c_str());
  return hints;
}

// The provider name as the user would type it: "tcp;ofi_rxm" -> "tcp".
std::string core_provider(const char* prov_name) {
  std::string s = prov_name ? prov_name : "";
  auto semi = s.find(';');
  return semi == std::string::npos ? s : s.substr(0, semi);
}

int get_info(const std::string& provider, bool delivery_complete, InfoList& out,
             bool hmem = false) {
  const lf::Api* api = lf::api();
  if (api == nullptr) return -FI_ENOSYS;
  fi_info* hints = make_hints(*api, provider, delivery_complete, hmem);
  if (hints == nullptr) return -FI_ENOMEM;
  int rc = api->getinfo(kApiVersion, nullptr, nullptr, 0, hints, &out.head);
  api->freeinfo(hints);
  return rc;
}

bool provider_present(const std::string& provider) {
  InfoList list;
  return get_info(provider, false, list) == 0 && list.head != nullptr;
}

}  // namespace

std::string resolve_provider(const std::string& provider) {
  if (provider != "auto" && !provider.empty()) return provider;
  return provider_present("efa") ? "efa" : "tcp";
}

std::vector<DomainListing> list_domains(const std::string& provider) {
  std::vector<DomainListing> out;
  InfoList list;
  if (get_info(resolve_provider(provider), false, list) != 0) return out;
  for (fi_info* i = list.head; i != nullptr; i = i->next) {
    DomainListing d{i->fabric_attr->prov_name ? i->fabric_attr->prov_name : "",
                    i->fabric_attr->name ? i->fabric_attr->name : "",
                    i->domain_attr->name ? i->domain_attr->name : "",
                    i->addr_format == FI_SOCKADDR_IN};
    bool dup = false;
    for (const auto& e : out) {
      dup = dup || (e.provider == d.provider && e.fabric == d.fabric && e.domain == d.domain);
    }
    if (!dup) out.push_back(std::move(d));
  }
  return out;
}

Result<std::unique_ptr<LfDomain>> LfDomain::open(const std::string& requested_provider,
                                                 const std::string& nic, bool gpu_direct) {
  const lf::Api* api = lf::api();
  if (api == nullptr) return Status(ErrorCode::kUnsupported, lf::load_error());
  const std::string provider = resolve_provider(requested_provider);
  const ProviderQuirks quirks = quirks_for(provider);

  if (quirks.disable_efa_shm) {
    // Process-wide, but only for EFA and only when the user has not chosen otherwise.
    setenv("FI_EFA_ENABLE_SHM_TRANSFER", "0", /*overwrite=*/0);
  }
  InfoList list;
  // Preferred first: delivery-complete where the provider wants it, FI_HMEM where GPU memory
  // can exist; each dropped in turn when the provider refuses it.
  bool delivery_complete = quirks.delivery_complete;
  bool hmem = quirks.hmem || (gpu_direct && cuda::cuda_available());
  int rc = get_info(provider, delivery_complete, list, hmem);
  if (rc == -FI_ENODATA && hmem && !quirks.hmem) {
    hmem = false;
    rc = get_info(provider, delivery_complete, list, false);
  }
  if (rc == -FI_ENODATA && delivery_complete) {
    delivery_complete = false;
    rc = get_info(provider, false, list, hmem);
  }
  if (rc != 0 || list.head == nullptr) {
    return Status(ErrorCode::kUnsupported,
                  fmt::format("libfabric provider '{}' offers no reliable-datagram endpoint with "
                              "RMA and remote CQ data on this machine ({})",
                              provider, lf::strerror(-rc)));
  }
  // Pick the requested domain, preferring IPv4 addressing where a NIC has several.
  fi_info* chosen = nullptr;
  std::vector<std::string> seen;
  for (fi_info* i = list.head; i != nullptr; i = i->next) {
    if (core_provider(i->fabric_attr->prov_name) != provider) continue;
    std::string dom = i->domain_attr->name ? i->domain_attr->name : "";
    seen.push_back(dom);
    if (!nic.empty() && dom != nic) continue;
    if (chosen == nullptr) {
      chosen = i;
    } else if (dom == chosen->domain_attr->name && chosen->addr_format != FI_SOCKADDR_IN &&
               i->addr_format == FI_SOCKADDR_IN) {
      chosen = i;  // the same NIC, addressed over IPv4
    }
  }
  if (chosen == nullptr) {
    std::string names;
    for (const auto& s : seen) {
      if (names.find(s) == std::string::npos) names += (names.empty() ? "" : ", ") + s;
    }
    return Status(ErrorCode::kNotFound,
                  fmt::format("provider '{}' has no NIC named '{}' (it offers: {})", provider, nic,
                              names.empty() ? "none" : names));
  }

  std::unique_ptr<LfDomain> d(new LfDomain());
  d->hmem_ = hmem && (chosen->caps & FI_HMEM) != 0;
  d->fi_.reset(api->dupinfo(chosen));
  fi_info* fi = d->fi_.get();
  auto fail = [&](const char* what, int err) {
    return Status(ErrorCode::kFabric, fmt::format("{} on {} '{}' failed: {}", what, provider,
                                                  fi->domain_attr->name, lf::strerror(-err)));
  };

  fid_fabric* fab = nullptr;
  if ((rc = api->fabric(fi->fabric_attr, &fab, nullptr)) != 0) return fail("fi_fabric", rc);
  d->fabric_.reset(fab);
  fid_domain* dom = nullptr;
  if ((rc = fi_domain(fab, fi, &dom, nullptr)) != 0) return fail("fi_domain", rc);
  d->domain_.reset(dom);

  fi_cq_attr cq_attr{};
  cq_attr.format = FI_CQ_FORMAT_DATA;
  cq_attr.size = kCqDepth;
  // A CQ with a wait fd lets an idle worker sleep until the fabric has work; providers without
  // one (efa) get a CQ without, and the worker naps instead.
  cq_attr.wait_obj = FI_WAIT_FD;
  fid_cq* cq = nullptr;
  if (fi_cq_open(dom, &cq_attr, &cq, nullptr) != 0) {
    cq_attr.wait_obj = FI_WAIT_NONE;
    if ((rc = fi_cq_open(dom, &cq_attr, &cq, nullptr)) != 0) return fail("fi_cq_open", rc);
  }
  d->cq_.reset(cq);
  if (cq_attr.wait_obj == FI_WAIT_FD) {
    int fd = -1;
    if (fi_control(&cq->fid, FI_GETWAIT, &fd) == 0) d->wait_fd_ = fd;
  }

  fi_av_attr av_attr{};
  av_attr.type = FI_AV_TABLE;
  fid_av* av = nullptr;
  if ((rc = fi_av_open(dom, &av_attr, &av, nullptr)) != 0) return fail("fi_av_open", rc);
  d->av_.reset(av);

  // shm's fi_enable can fail with -FI_EBUSY for a moment after another endpoint of this
  // process closed (seen under TSan); a new endpoint, a little later, succeeds.
  fid_ep* ep = nullptr;
  for (int attempt = 0;; ++attempt) {
    d->ep_.reset();
    if ((rc = fi_endpoint(dom, fi, &ep, nullptr)) != 0) return fail("fi_endpoint", rc);
    d->ep_.reset(ep);
    if ((rc = fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV)) != 0) {
      return fail("fi_ep_bind(cq)", rc);
    }
    if ((rc = fi_ep_bind(ep, &av->fid, 0)) != 0) return fail("fi_ep_bind(av)", rc);
    rc = fi_enable(ep);
    if (rc == 0) break;
    if (rc != -FI_EBUSY || attempt == kEnableAttempts - 1) return fail("fi_enable", rc);
    std::this_thread::sleep_for(std::chrono::milliseconds(20 << attempt));
  }

  size_t name_len = 0;
  rc = fi_getname(&ep->fid, nullptr, &name_len);
  if (rc != -FI_ETOOSMALL && rc != 0) return fail("fi_getname", rc);
  d->name_.resize(name_len);
  if ((rc = fi_getname(&ep->fid, d->name_.data(), &name_len)) != 0) return fail("fi_getname", rc);
  d->name_.resize(name_len);

  d->mr_mode_ = static_cast<uint64_t>(fi->domain_attr->mr_mode);
  d->addr_format_ = fi->addr_format;
  // Keys we choose start at a random base, so that a key meant for another domain (a
  // cross-rail bug) is rejected rather than accepted by coincidence.
  d->next_key_ = (std::random_device{}() & 0xfffff) << 20 | 1;
  d->needs_context_ = (fi->mode & (FI_CONTEXT | FI_CONTEXT2)) != 0;
  d->info_ = DomainInfo{fi->fabric_attr->prov_name,
                        fi->domain_attr->name,
                        fi->ep_attr->max_msg_size,
                        delivery_complete,
                        d->hmem_,
                        quirks.key_checked_once};
  d->cq_buf_.resize(64);
  detail::log().debug(
      "opened {} domain '{}' (mr_mode {:#x}, max message {}, delivery complete {}, FI_HMEM {})",
      d->info_.provider, d->info_.name, d->mr_mode_, d->info_.max_write_bytes, delivery_complete,
      d->hmem_);
  return d;
}

LfDomain::~LfDomain() = default;

void LfDomain::close() {
  // The endpoint now, while the buffers of what is still posted on it are alive: ofi_rxm copies
  // from a send still queued (towards a peer it cannot reach, say) when its endpoint closes, and
  // the engine frees its registered send buffers before the domain. Seen: three tcp engines in
  // one process crashed in fi_close at destruction, each with a write-fence Goodbye queued
  // towards an engine closed before it.
  ep_.reset();
}

bool LfDomain::ready_to_wait() {
  if (wait_fd_ < 0) return false;
  fid* fids[] = {&cq_->fid};
  return fi_trywait(fabric_.get(), fids, 1) == 0;
}

namespace {

class LfRegistration final : public MemoryRegistration {
 public:
  LfRegistration(fid_mr* mr, void* desc, uint64_t addr, uint64_t key) : mr_(mr) {
    local_desc_ = desc;
    remote_addr_ = addr;
    remote_key_ = key;
  }

 private:
  FidPtr<fid_mr> mr_;
};

}  // namespace

Result<std::unique_ptr<MemoryRegistration>> LfDomain::register_memory(void* ptr, uint64_t length,
                                                                      bool remote_read) {
  // With FI_MR_PROV_KEY the provider picks the key; otherwise keys must be unique per domain.
  const uint64_t requested_key = (mr_mode_ & FI_MR_PROV_KEY) ? 0 : next_key_++;
  // A peer's read of memory registered without FI_REMOTE_READ is refused by the provider.
  const uint64_t access =
      FI_WRITE | FI_READ | FI_SEND | FI_RECV | FI_REMOTE_WRITE | (remote_read ? FI_REMOTE_READ : 0);
  fid_mr* mr = nullptr;
  int rc = 0;
  // CUDA memory on a provider that reaches it: registered as what it is.
  auto memory =
      hmem_ ? cuda::classify(ptr, length) : Result<cuda::PointerInfo>(cuda::PointerInfo{});
  if (memory && memory->kind == cuda::MemoryKind::kCuda) {
    iovec iov{ptr, length};
    fi_mr_attr attr{};
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = access;
    attr.requested_key = requested_key;
    attr.iface = FI_HMEM_CUDA;
    attr.device.cuda = memory->device;
    rc = fi_mr_regattr(domain_.get(), &attr, 0, &mr);
  } else {
    rc = fi_mr_reg(domain_.get(), ptr, length, access, 0, requested_key, 0, &mr, nullptr);
  }
  if (rc != 0) {
    return Status(ErrorCode::kFabric, fmt::format("fi_mr_reg of {} bytes at {} on '{}' failed: {}",
                                                  length, ptr, info_.name, lf::strerror(-rc)));
  }
  // Remote addressing: virtual addresses (FI_MR_VIRT_ADDR) or offsets from the region start.
  const uint64_t addr = (mr_mode_ & FI_MR_VIRT_ADDR) ? reinterpret_cast<uint64_t>(ptr) : 0;
  return std::unique_ptr<MemoryRegistration>(
      new LfRegistration(mr, fi_mr_desc(mr), addr, fi_mr_key(mr)));
}

Result<Bytes> LfDomain::checked_peer_name(std::span<const std::byte> name) const {
  auto invalid = [&](std::string_view why) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("a peer endpoint name of {} bytes is not an address of '{}': {}",
                              name.size(), info_.name, why));
  };
  Bytes out(name.begin(), name.end());
  auto family = [&]() -> unsigned {
    sa_family_t f = 0;
    std::memcpy(&f, out.data(), sizeof(f));
    return f;
  };
  switch (addr_format_) {
    case FI_SOCKADDR:
    case FI_SOCKADDR_IN:
    case FI_SOCKADDR_IN6: {
      const bool v4_ok = addr_format_ != FI_SOCKADDR_IN6;
      const bool v6_ok = addr_format_ != FI_SOCKADDR_IN;
      if (out.size() == sizeof(sockaddr_in) && v4_ok && family() == AF_INET) {
        // The padding is not part of the address: zeroed, so that a descriptor differing there
        // names the same peer rather than a second connection to it.
        std::memset(out.data() + offsetof(sockaddr_in, sin_zero), 0, sizeof(sockaddr_in::sin_zero));
        return out;
      }
      if (out.size() == sizeof(sockaddr_in6) && v6_ok && family() == AF_INET6) return out;
      if (out.size() < sizeof(sa_family_t)) return invalid("too short for a socket address");
      return invalid(fmt::format("socket address family {} with {} bytes (expected {})", family(),
                                 out.size(),
                                 v4_ok && v6_ok ? "IPv4 or IPv6"
                                 : v4_ok        ? "IPv4, 16 bytes"
                                                : "IPv6, 28 bytes"));
    }
    case FI_ADDR_STR: {
      const auto nul = std::find(out.begin(), out.end(), std::byte{0});
      if (out.empty() || nul != out.end() - 1) return invalid("not a NUL-terminated string");
      for (auto it = out.begin(); it != nul; ++it) {
        const auto c = static_cast<unsigned char>(*it);
        if (c < 0x20 || c > 0x7e) return invalid("not printable ASCII");
      }
      return out;
    }
    default:  // provider-specific formats (efa, psm, ...) have one fixed size
      if (out.size() != name_.size()) {
        return invalid(fmt::format("this provider's endpoint names have {} bytes", name_.size()));
      }
      return out;
  }
}

Result<PeerHandle> LfDomain::resolve_peer(std::span<const std::byte> name) {
  const std::string_view raw(reinterpret_cast<const char*>(name.data()), name.size());
  if (auto it = peers_.find(raw); it != peers_.end()) {
    if (addrs_[it->second] == FI_ADDR_UNSPEC) {  // its reconnection failed: try again
      fi_addr_t fresh = FI_ADDR_UNSPEC;
      if (fi_av_insert(av_.get(), it->first.data(), 1, &fresh, 0, nullptr) != 1) {
        return Status(ErrorCode::kPeerUnreachable,
                      fmt::format("'{}' cannot insert a peer address into its address vector "
                                  "again to reconnect it",
                                  info_.name));
      }
      addrs_[it->second] = fresh;
    }
    return it->second;
  }
  auto checked = checked_peer_name(name);
  if (!checked) return checked.status();
  const std::string key(reinterpret_cast<const char*>(checked->data()), checked->size());
  if (auto it = peers_.find(key); it != peers_.end()) return it->second;
  fi_addr_t addr = FI_ADDR_UNSPEC;
  int n = fi_av_insert(av_.get(), checked->data(), 1, &addr, 0, nullptr);
  if (n != 1) {
    return Status(ErrorCode::kPeerUnreachable,
                  fmt::format("'{}' cannot insert a peer address of {} bytes into its address "
                              "vector",
                              info_.name, name.size()));
  }
  const PeerHandle handle = addrs_.size();
  addrs_.push_back(addr);
  peers_.emplace(key, handle);
  return handle;
}

void LfDomain::reset_peer(PeerHandle peer) {
  for (auto& [name, handle] : peers_) {
    if (handle != peer) continue;
    fi_addr_t addr = fi_address(peer);
    if (addr == FI_ADDR_UNSPEC) return;  // removed by an earlier failed reconnection
    // From here the old entry is gone, whatever happens: a post to a removed entry is a use
    // after free inside the provider, so the handle points nowhere until the insert succeeds.
    addrs_[peer] = FI_ADDR_UNSPEC;
    if (int rc = fi_av_remove(av_.get(), &addr, 1, 0); rc != 0) {
      detail::log().warn("'{}': fi_av_remove to reconnect a peer failed: {}", info_.name,
                         lf::strerror(-rc));
      return;
    }
    fi_addr_t fresh = FI_ADDR_UNSPEC;
    if (fi_av_insert(av_.get(), name.data(), 1, &fresh, 0, nullptr) != 1) {
      detail::log().warn("'{}': re-inserting a peer to reconnect it failed", info_.name);
      return;  // posts towards it fail, and its transfers with them
    }
    addrs_[peer] = fresh;
    return;
  }
}

void LfDomain::forget_peer(PeerHandle peer) {
  for (auto it = peers_.begin(); it != peers_.end(); ++it) {
    if (it->second != peer) continue;
    fi_addr_t addr = fi_address(peer);
    addrs_[peer] = FI_ADDR_UNSPEC;
    int rc = fi_av_remove(av_.get(), &addr, 1, 0);
    if (rc != 0) {
      detail::log().warn("'{}': fi_av_remove of a dead peer failed: {}", info_.name,
                         lf::strerror(-rc));
    }
    peers_.erase(it);
    return;
  }
}

}  // namespace fabric::transport
