// The same-host transport, control side: opening an endpoint, regions and their process-wide
// mappings, registrations, connecting to peers and noticing their death (docs/shm.md). The
// data side (posting, the rings, acknowledgements, poll) is shm_datapath.cc.
#include "transport/shm/shm_domain.h"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <functional>
#include <mutex>
#include <random>

#include "common/log.h"
#include "transport/shm/shm_domain_internal.h"

namespace fabric::transport {

namespace {
constexpr uint64_t kHeaderPage = 4096;
std::atomic<uint32_t> g_next_index{0};

uint64_t random64() {
  std::random_device rd;
  return (uint64_t{rd()} << 32) ^ rd();
}

uint32_t random_token() {
  std::random_device rd;
  uint32_t t = 0;
  while (t == 0) t = rd();
  return t;
}

int pidfd_open(uint32_t pid) {
#ifdef SYS_pidfd_open
  return static_cast<int>(::syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0));
#else
  (void)pid;
  return -1;
#endif
}

// The doorbell of the endpoint whose region is `name` ("/fabric-shm..."): a datagram socket in
// the abstract namespace (it vanishes with its process; nothing to clean up).
socklen_t doorbell_address(const std::string& name, sockaddr_un& out) {
  out = {};
  out.sun_family = AF_UNIX;
  const std::string abstract = "fabric-shm-doorbell" + name;
  const size_t n = std::min(abstract.size(), sizeof(out.sun_path) - 1);
  std::memcpy(out.sun_path + 1, abstract.data(), n);
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
}

}  // namespace

// One mapping of a region per process, shared by every endpoint of the process that uses it:
// the atomics of a ring are then touched at one address in this process (ThreadSanitizer
// tracks synchronisation by address and would miss it across two mappings of one file), and
// the pages are mapped once.
struct ShmMapping {
  std::string name;
  void* base = MAP_FAILED;
  uint64_t size = 0;
  ~ShmMapping();
};

namespace {

struct MappingTable {
  std::mutex mu;
  std::unordered_map<std::string, std::weak_ptr<ShmMapping>> by_name;
};

// Never destroyed: mappings may outlive static destruction order.
MappingTable& mappings() {
  static auto* table = new MappingTable();
  return *table;
}

std::shared_ptr<ShmMapping> find_mapping(const std::string& name) {
  MappingTable& t = mappings();
  std::lock_guard lock(t.mu);
  auto it = t.by_name.find(name);
  return it == t.by_name.end() ? nullptr : it->second.lock();
}

// Maps `fd` (the region `name`) and shares the mapping; nullptr when it cannot be mapped.
std::shared_ptr<ShmMapping> map_region(const std::string& name, int fd, uint64_t size) {
  void* base = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) return nullptr;
  auto m = std::make_shared<ShmMapping>();
  m->name = name;
  m->base = base;
  m->size = size;
  MappingTable& t = mappings();
  std::lock_guard lock(t.mu);
  t.by_name[name] = m;
  return m;
}

}  // namespace

ShmMapping::~ShmMapping() {
  if (base != MAP_FAILED) ::munmap(base, size);
  MappingTable& t = mappings();
  std::lock_guard lock(t.mu);
  if (auto it = t.by_name.find(name); it != t.by_name.end() && it->second.expired()) {
    t.by_name.erase(it);
  }
}

struct ShmDomain::Registry {
  struct Range {
    uint64_t addr;
    uint64_t length;
    bool readable;  // peers may read it (RegisterOptions::remote_read)
  };
  std::unordered_map<uint64_t, Range> by_key;
};

// A registration: its key is valid for exactly as long as this object lives (destroyed on the
// domain's thread), so a write carrying it after unregister is refused.
class ShmMemoryRegistration final : public MemoryRegistration {
 public:
  using Erase = std::function<void(uint64_t)>;
  ShmMemoryRegistration(uint64_t addr, uint64_t key, Erase erase) : erase_(std::move(erase)) {
    remote_addr_ = addr;
    remote_key_ = key;
  }
  ~ShmMemoryRegistration() override { erase_(remote_key_); }

 private:
  Erase erase_;
};

Result<std::unique_ptr<ShmDomain>> ShmDomain::open(const std::string& nic, uint64_t ring_bytes,
                                                   uint32_t copy_threads) {
  if (!nic.empty() && nic != "shm") {
    return Status(ErrorCode::kNotFound,
                  fmt::format("the shm transport has one NIC, 'shm' (asked for '{}')", nic));
  }
  if (ring_bytes < 4096 || (ring_bytes & (ring_bytes - 1)) != 0) {
    return Status(ErrorCode::kInvalidArgument, "shm ring size must be a power of two >= 4096");
  }
  remove_dead_regions();
  std::unique_ptr<ShmDomain> d(new ShmDomain());
  const Origin self = Origin::of_this_process(0);
  d->pid_ = self.pid;
  d->start_time_ = self.start_time;
  d->ring_bytes_ = ring_bytes;
  d->copier_ = std::make_unique<shm::ParallelCopier>(copy_threads);
  d->name_ =
      fmt::format("{}{}.{:016x}.{}", kNamePrefix, d->pid_, random64(), g_next_index.fetch_add(1));
  const std::string path = "/" + d->name_;
  const int fd = ::shm_open(path.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {
    return Status(ErrorCode::kFabric,
                  fmt::format("shm_open('{}') failed: {}", path, std::strerror(errno)));
  }
  d->size_ = shm::region_bytes(ring_bytes);
  if (::ftruncate(fd, static_cast<off_t>(d->size_)) != 0) {
    const int err = errno;
    ::close(fd);
    ::shm_unlink(path.c_str());
    return Status(ErrorCode::kFabric, fmt::format("sizing '{}' to {} bytes failed: {}", path,
                                                  d->size_, std::strerror(err)));
  }
  d->mapping_ = map_region(path, fd, d->size_);
  const int err = errno;
  ::close(fd);
  if (d->mapping_ == nullptr) {
    ::shm_unlink(path.c_str());
    return Status(ErrorCode::kFabric,
                  fmt::format("mapping '{}' failed: {}", path, std::strerror(err)));
  }
  void* base = d->mapping_->base;
  d->base_ = base;
  d->header_ = static_cast<shm::RegionHeader*>(base);
  d->header_->version = shm::kVersion;
  d->header_->slots = shm::kSlots;
  d->header_->ring_bytes = ring_bytes;
  d->header_->owner_pid = d->pid_;
  d->header_->owner_start = d->start_time_;
  d->header_->owner_pidns = shm::this_pid_namespace();
  const int sock = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (sock >= 0) {
    sockaddr_un addr{};
    const socklen_t len = doorbell_address(path, addr);
    if (::bind(sock, reinterpret_cast<const sockaddr*>(&addr), len) == 0) {
      d->doorbell_ = sock;
      d->header_->doorbell = 1;
    } else {
      detail::log().debug("shm endpoint '{}': no doorbell ({}); the worker naps instead", path,
                          std::strerror(errno));
      ::close(sock);
    }
  }
  store(d->header_->magic, shm::kMagic);  // last: the header is complete
  for (uint32_t i = 0; i < shm::kSlots; ++i) {
    auto in = std::make_unique<Inbound>();
    in->reader = shm::RingReader(shm::slot_at(base, ring_bytes, i), ring_bytes);
    d->inbound_.push_back(std::move(in));
  }
  d->name_bytes_.resize(path.size());
  std::memcpy(d->name_bytes_.data(), path.data(), path.size());
  d->info_ = DomainInfo{kShmProviderInfo, "shm", uint64_t{1} << 30,
                        /*delivery_complete=*/true, /*hmem=*/false};
  d->registry_ = std::make_shared<Registry>();
  d->next_key_ = random64() | 1;
  d->probe_value_ = random64();
  detail::log().debug("shm endpoint '{}' open: {} slots of {} KiB", path, shm::kSlots,
                      ring_bytes >> 10);
  return d;
}

ShmDomain::~ShmDomain() {
  close();
  remotes_.clear();
  mapping_.reset();  // unmapped once no other endpoint of this process maps it
  if (doorbell_ >= 0) ::close(doorbell_);
}

void ShmDomain::close() {
  if (closed_) return;
  closed_ = true;
  if (header_ != nullptr) store(header_->closed, uint32_t{1});
  if (!unlinked_ && !name_.empty()) {
    ::shm_unlink(("/" + name_).c_str());
    unlinked_ = true;
  }
  for (auto& [h, r] : remotes_) release(*r);
}

int ShmDomain::remove_dead_regions() {
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return 0;
  const std::string prefix = kNamePrefix;
  const uint32_t self = static_cast<uint32_t>(::getpid());
  std::vector<std::string> dead;
  while (dirent* e = ::readdir(dir)) {
    const std::string name = e->d_name;
    if (name.rfind(prefix, 0) != 0) continue;
    const unsigned long pid = std::strtoul(name.c_str() + prefix.size(), nullptr, 10);
    if (pid == 0 || pid == self) continue;
    const int fd = ::shm_open(("/" + name).c_str(), O_RDONLY | O_CLOEXEC, 0);
    if (fd < 0) continue;
    struct stat st {};
    void* p = MAP_FAILED;
    if (::fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_size) >= kHeaderPage) {
      p = ::mmap(nullptr, kHeaderPage, PROT_READ, MAP_SHARED, fd, 0);
    }
    ::close(fd);
    if (p == MAP_FAILED) continue;
    const auto* h = static_cast<const shm::RegionHeader*>(p);
    if (load(h->magic) == shm::kMagic) {
      Origin o;
      o.pid = static_cast<uint32_t>(h->owner_pid);
      o.start_time = h->owner_start;
      // Only regions of this PID namespace: elsewhere the pid names another process.
      if (o.pid == pid && h->owner_pidns == shm::this_pid_namespace() && !o.process_alive()) {
        dead.push_back(name);
      }
    }
    ::munmap(p, kHeaderPage);
  }
  ::closedir(dir);
  for (const std::string& name : dead) ::shm_unlink(("/" + name).c_str());
  if (!dead.empty()) {
    detail::log().info("shm: removed {} region(s) that dead processes left in /dev/shm",
                       dead.size());
  }
  return static_cast<int>(dead.size());
}

Result<std::unique_ptr<MemoryRegistration>> ShmDomain::register_memory(void* ptr, uint64_t length,
                                                                       bool remote_read) {
  const uint64_t addr = reinterpret_cast<uint64_t>(ptr);
  if (ptr == nullptr || length == 0 || addr + length < addr) {
    return Status(ErrorCode::kInvalidArgument, "shm: registering an empty or wrapping range");
  }
  uint64_t key = next_key_++;
  if (key == 0) key = next_key_++;
  registry_->by_key[key] = {addr, length, remote_read};
  std::weak_ptr<Registry> registry = registry_;
  return std::unique_ptr<MemoryRegistration>(
      std::make_unique<ShmMemoryRegistration>(addr, key, [registry](uint64_t k) {
        if (auto r = registry.lock()) r->by_key.erase(k);
      }));
}

ErrorCode ShmDomain::check_access(uint64_t addr, uint64_t length, uint64_t key, bool read) const {
  auto it = registry_->by_key.find(key);
  if (it == registry_->by_key.end()) return ErrorCode::kRemoteAccess;
  const Registry::Range& r = it->second;
  if (read && !r.readable) return ErrorCode::kRemoteAccess;
  if (addr < r.addr || length > r.length || addr - r.addr > r.length - length) {
    return ErrorCode::kRemoteAccess;
  }
  return ErrorCode::kOk;
}

Result<ShmDomain::Remote*> ShmDomain::connect(const std::string& name) {
  if (auto it = by_name_.find(name); it != by_name_.end()) return remotes_[it->second].get();
  auto unreachable = [&](const std::string& why) {
    return Status(ErrorCode::kPeerUnreachable, fmt::format("shm peer '{}': {}", name, why));
  };
  auto r = std::make_unique<Remote>();
  r->mapping = find_mapping(name);  // an endpoint of this process, or a peer mapped already
  if (r->mapping == nullptr) {
    const int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
    if (fd < 0) {
      return unreachable(errno == ENOENT
                             ? "no such endpoint (the peer closed or exited)"
                             : fmt::format("shm_open failed: {}", std::strerror(errno)));
    }
    struct stat st {};
    if (::fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_size) >= kHeaderPage) {
      r->mapping = map_region(name, fd, static_cast<uint64_t>(st.st_size));
    }
    ::close(fd);
    if (r->mapping == nullptr) return unreachable("its region cannot be mapped");
  }
  void* const base = r->mapping->base;
  r->header = static_cast<shm::RegionHeader*>(base);
  const uint64_t ring = r->header->ring_bytes;
  if (load(r->header->magic) != shm::kMagic || r->header->version != shm::kVersion ||
      r->header->slots != shm::kSlots || ring < 4096 || (ring & (ring - 1)) != 0 ||
      shm::region_bytes(ring) > r->mapping->size) {
    return unreachable("its region is not a fabric shm region of this version");
  }
  if (load(r->header->closed) != 0) return unreachable("the peer closed its endpoint");
  r->pid = static_cast<uint32_t>(r->header->owner_pid);
  r->start_time = r->header->owner_start;
  // In another PID namespace the pid means nothing here: only the closed flag and the slot
  // tell that peer's end (docs/shm.md, limits).
  r->same_pidns = r->header->owner_pidns == shm::this_pid_namespace();
  if (r->same_pidns) {
    r->pidfd = pidfd_open(r->pid);
    Origin owner;
    owner.pid = r->pid;
    owner.start_time = r->start_time;
    // After pidfd_open: the descriptor is known to name the region's owner, not a later
    // process that got its PID.
    if (!owner.process_alive()) return unreachable("the peer process is gone");
  }
  const uint32_t token = random_token();
  // The slot names this endpoint as its sender: where the peer sends acknowledgements.
  const std::string self = "/" + name_;
  const int slot =
      shm::claim_slot(base, ring, pid_, start_time_, token, self.c_str(), &probe_value_);
  if (slot < 0) {
    return Status(ErrorCode::kFabric,
                  fmt::format("shm peer '{}': all {} of its slots are held by live senders", name,
                              shm::kSlots));
  }
  if (r->header->doorbell != 0) r->doorbell_len = doorbell_address(name, r->doorbell);
  r->slot = shm::slot_at(base, ring, static_cast<uint32_t>(slot));
  r->word = uint64_t{pid_} << 32 | token;
  r->writer = shm::RingWriter(r->slot, ring);
  r->name = name;
  r->handle = next_handle_++;
  Remote* raw = r.get();
  by_name_[name] = r->handle;
  remotes_[r->handle] = std::move(r);
  return raw;
}

Result<PeerHandle> ShmDomain::resolve_peer(std::span<const std::byte> name) {
  if (closed_) return Status(ErrorCode::kClosed, "shm endpoint closed");
  const std::string_view view(reinterpret_cast<const char*>(name.data()), name.size());
  // A peer connected already (every post after the first): no string built.
  if (auto it = by_name_.find(view); it != by_name_.end()) return it->second;
  const std::string s(view);
  if (!valid_name(s)) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("not an shm endpoint name ({} bytes)", name.size()));
  }
  auto r = connect(s);
  if (!r) return r.status();
  return (*r)->handle;
}

ShmDomain::Remote* ShmDomain::find_remote(PeerHandle peer) {
  auto it = remotes_.find(peer);
  return it == remotes_.end() ? nullptr : it->second.get();
}

void ShmDomain::release(Remote& r) {
  if (r.slot != nullptr) shm::release_slot(r.slot, r.word);
}

void ShmDomain::forget_peer(PeerHandle peer) {
  Remote* r = find_remote(peer);
  if (r == nullptr) return;
  fail_remote(*r, "the peer was dropped");  // also lets go of its slot and mapping
  if (auto it = by_name_.find(r->name); it != by_name_.end() && it->second == peer) {
    by_name_.erase(it);
  }
  remotes_.erase(peer);
}

void ShmDomain::fail_remote(Remote& r, const std::string& why) {
  if (!r.dead) {
    r.dead = true;
    r.why = why;
    detail::log().debug("shm peer '{}': {}", r.name, why);
  }
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (it->second.peer == r.handle) {
      ready_.push_back(Completion{Completion::Kind::kLocal, it->second.wr_id, 0, 0,
                                  ErrorCode::kPeerUnreachable,
                                  fmt::format("shm peer '{}': {}", r.name, why)});
      it = pending_.erase(it);
    } else {
      ++it;
    }
  }
  r.tx.clear();
  r.ops_queued = 0;
  r.outstanding = 0;
  r.outstanding_bytes = 0;
  // Nothing is sent there again: let go of the slot and of the mapping (which would otherwise
  // keep a dead peer's pages alive). The entry stays, so that posts to it fail at once.
  release(r);
  r.slot = nullptr;
  r.header = nullptr;
  r.writer = shm::RingWriter();
  r.mapping.reset();
  if (r.pidfd >= 0) ::close(r.pidfd);
  r.pidfd = -1;
}

bool ShmDomain::remote_gone(Remote& r, std::string& why) {
  if (load(r.header->closed) != 0) {
    why = "the peer closed its endpoint";
    return true;
  }
  if (load(r.slot->owner) != r.word) {
    why = "the peer's region no longer holds this sender's slot";
    return true;
  }
  if (r.pidfd >= 0) {
    pollfd p{r.pidfd, POLLIN, 0};
    if (::poll(&p, 1, 0) > 0) {
      why = "the peer process exited";
      return true;
    }
    return false;
  }
  if (!r.same_pidns) return false;
  Origin o;
  o.pid = r.pid;
  o.start_time = r.start_time;
  if (!o.process_alive()) {
    why = "the peer process exited";
    return true;
  }
  return false;
}

}  // namespace fabric::transport
