// The same-host transport: regions, peers, posting and progress (docs/shm.md).
#include "transport/shm/shm_domain.h"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
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

namespace fabric::transport {

using shm::load;
using shm::Record;
using shm::RecordKind;
using shm::store;

namespace {

constexpr size_t kMaxOpsQueued = 1024;           // per peer, waiting for ring room; beyond: kAgain
constexpr uint64_t kPollBudgetBytes = 16 << 20;  // bytes copied in per poll(), at least one op
constexpr uint64_t kMaxBytesOutstanding = 64 << 20;  // per peer, posted and not acknowledged
constexpr uint64_t kMaxMessage = 64 << 20;
// Smaller writes travel through the ring even where process_vm_readv works: two memcpys of
// a few KiB cost less than the system call.
constexpr uint64_t kCmaMinBytes = 16 << 10;
constexpr auto kWatchEvery = std::chrono::microseconds(200);
constexpr auto kIdleWatchEvery = std::chrono::milliseconds(50);
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

bool valid_name(std::string_view name) {
  const std::string_view prefix = ShmDomain::kNamePrefix;
  return name.size() > prefix.size() + 1 && name.size() < shm::kNameMax && name[0] == '/' &&
         name.substr(1, prefix.size()) == prefix && name.find('/', 1) == std::string_view::npos &&
         name.find('\0') == std::string_view::npos;
}

// Reads `length` bytes at `src` in process `pid` into `dst` (one copy, by the kernel). False
// when the kernel refuses (no permission, no such process, an address not mapped there).
bool read_process(uint32_t pid, uint64_t src, void* dst, uint64_t length) {
  uint64_t done = 0;
  while (done < length) {
    iovec local{static_cast<std::byte*>(dst) + done, length - done};
    iovec remote{reinterpret_cast<void*>(src + done), length - done};
    const ssize_t n = ::process_vm_readv(static_cast<pid_t>(pid), &local, 1, &remote, 1, 0);
    if (n <= 0) return false;
    done += static_cast<uint64_t>(n);
  }
  return true;
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

std::string why_refused(ErrorCode code) {
  switch (code) {
    case ErrorCode::kRemoteAccess:
      return "the peer refused the access (unknown or stale key, or a range outside its "
             "registration)";
    case ErrorCode::kInvalidArgument:
      return "the peer's receive buffer is smaller than the message";
    default:
      return "the peer could not complete the operation";
  }
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
  bool is_op() const { return kind != RecordKind::kAck; }
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

Result<std::unique_ptr<ShmDomain>> ShmDomain::open(const std::string& nic, uint64_t ring_bytes) {
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

Result<std::unique_ptr<MemoryRegistration>> ShmDomain::register_memory(void* ptr, uint64_t length) {
  const uint64_t addr = reinterpret_cast<uint64_t>(ptr);
  if (ptr == nullptr || length == 0 || addr + length < addr) {
    return Status(ErrorCode::kInvalidArgument, "shm: registering an empty or wrapping range");
  }
  uint64_t key = next_key_++;
  if (key == 0) key = next_key_++;
  registry_->by_key[key] = {addr, length};
  std::weak_ptr<Registry> registry = registry_;
  return std::unique_ptr<MemoryRegistration>(
      std::make_unique<ShmMemoryRegistration>(addr, key, [registry](uint64_t k) {
        if (auto r = registry.lock()) r->by_key.erase(k);
      }));
}

ErrorCode ShmDomain::check_access(uint64_t addr, uint64_t length, uint64_t key) const {
  auto it = registry_->by_key.find(key);
  if (it == registry_->by_key.end()) return ErrorCode::kRemoteAccess;
  const Registry::Range& r = it->second;
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

PostResult ShmDomain::post(PeerHandle peer, uint64_t wr_id, TxItem item) {
  if (closed_) return PostResult::failed(Status(ErrorCode::kClosed, "shm endpoint closed"));
  Remote* r = find_remote(peer);
  if (r == nullptr) {
    return PostResult::failed(
        Status(ErrorCode::kPeerUnreachable, "shm: unknown peer handle (the peer was dropped)"));
  }
  if (!r->dead && load(r->header->closed) != 0) fail_remote(*r, "the peer closed its endpoint");
  if (r->dead) {
    return PostResult::failed(
        Status(ErrorCode::kPeerUnreachable, fmt::format("shm peer '{}': {}", r->name, r->why)));
  }
  // Bounded in operations and in bytes: what is posted to a peer drains in bounded time (a
  // closing engine waits for it, Config::close_timeout).
  if (r->ops_queued >= kMaxOpsQueued ||
      (r->outstanding > 0 && r->outstanding_bytes + item.length > kMaxBytesOutstanding)) {
    return PostResult::again();
  }
  if (r->outstanding == 0) r->next_watch = std::chrono::steady_clock::now() + kWatchEvery;
  pending_.put(item.seq, {peer, wr_id, item.length});
  ++r->outstanding;
  r->outstanding_bytes += item.length;
  ++r->ops_queued;
  r->tx.push_back(item);
  pump(*r);
  return PostResult::posted();
}

PostResult ShmDomain::post_write(const WriteRequest& req) {
  TxItem item;
  item.kind = RecordKind::kWrite;
  item.has_imm = req.has_imm;
  item.imm = req.imm;
  item.seq = next_seq_++;
  item.local = static_cast<const std::byte*>(req.local);
  item.length = req.length;
  item.addr = req.remote_addr;
  item.key = req.remote_key;
  return post(req.peer, req.wr_id, item);
}

PostResult ShmDomain::post_send(const SendRequest& req) {
  if (req.length > kMaxMessage) {
    return PostResult::failed(Status(
        ErrorCode::kInvalidArgument,
        fmt::format("shm: a message of {} bytes exceeds {} bytes", req.length, kMaxMessage)));
  }
  TxItem item;
  item.kind = RecordKind::kSend;
  item.seq = next_seq_++;
  item.local = static_cast<const std::byte*>(req.local);
  item.length = req.length;
  return post(req.peer, req.wr_id, item);
}

PostResult ShmDomain::post_recv(const RecvRequest& req) {
  if (closed_) return PostResult::failed(Status(ErrorCode::kClosed, "shm endpoint closed"));
  if (!unexpected_.empty()) {
    Bytes m = std::move(unexpected_.front());
    unexpected_.pop_front();
    Completion c{Completion::Kind::kRecv, req.wr_id, 0, m.size(), ErrorCode::kOk, {}};
    if (m.size() > req.length) {
      c.error = ErrorCode::kInvalidArgument;
      c.error_message = fmt::format("shm: a message of {} bytes arrived for a {}-byte receive",
                                    m.size(), req.length);
    } else if (!m.empty()) {
      std::memcpy(req.local, m.data(), m.size());
    }
    ready_.push_back(std::move(c));
    return PostResult::posted();
  }
  recvs_.push_back(req);
  return PostResult::posted();
}

bool ShmDomain::push_item(Remote& r, TxItem& item) {
  Record rec{};
  rec.kind = item.kind;
  rec.token = shm::owner_token(r.word);
  rec.seq = item.seq;
  rec.imm = item.imm;
  if (item.kind == RecordKind::kAck) {
    rec.status = item.status;
    return r.writer.push(rec, nullptr, 0);
  }
  const uint8_t imm_flag = item.has_imm ? shm::kHasImm : 0;
  if (!item.started) {
    item.started = true;
    const uint64_t cma = load(r.slot->cma);
    item.cma = item.kind == RecordKind::kWrite && item.length >= kCmaMinBytes &&
               (cma >> 32) == shm::owner_token(r.word) && (cma & 0xffffffff) == shm::kCmaYes;
  }
  if (item.cma) {
    rec.flags = shm::kCma | shm::kFirst | shm::kLast | imm_flag;
    rec.addr = item.addr;
    rec.key = item.key;
    rec.length = item.length;
    rec.src = reinterpret_cast<uint64_t>(item.local);
    return r.writer.push(rec, nullptr, 0);
  }
  const uint64_t max = r.writer.max_payload();
  do {
    const uint64_t chunk = std::min(item.length - item.offset, max);
    const bool last = item.offset + chunk == item.length;
    rec.flags = static_cast<uint8_t>((item.offset == 0 ? shm::kFirst : 0) |
                                     (last ? shm::kLast : 0) | imm_flag);
    rec.addr = item.addr + item.offset;
    rec.key = item.key;
    rec.length = chunk;
    rec.total = item.length;
    if (!r.writer.push(rec, item.local + item.offset, chunk)) return false;
    item.offset += chunk;
  } while (item.offset < item.length);
  return true;
}

void ShmDomain::pump(Remote& r) {
  bool pushed = false;
  while (!r.tx.empty() && !r.dead) {
    TxItem& item = r.tx.front();
    const uint64_t before = item.offset;
    if (!push_item(r, item)) {
      pushed |= item.offset != before;  // some chunks of it went
      break;
    }
    pushed = true;
    if (item.is_op()) --r.ops_queued;
    r.tx.pop_front();
  }
  if (pushed) ring(r);
}

void ShmDomain::ring(Remote& r) {
  if (r.doorbell_len == 0 || doorbell_ < 0) return;
  // The records were published with a seq_cst store of `tail` (RingWriter::push); this load
  // is seq_cst too, as are the owner's store to `sleeping` and its loads of the rings
  // (ready_to_wait): in their single total order one of the two sees the other's store.
  if (load(r.header->sleeping, std::memory_order_seq_cst) == 0) return;
  // One wake-up per sleep: the sender that clears the flag sends it.
  uint32_t expected = 1;
  if (!shm::compare_exchange(r.header->sleeping, expected, uint32_t{0})) return;
  const char byte = 1;
  // A full socket buffer already holds wake-ups; a gone peer is found by the watch.
  (void)::sendto(doorbell_, &byte, 1, MSG_DONTWAIT, reinterpret_cast<const sockaddr*>(&r.doorbell),
                 r.doorbell_len);
}

bool ShmDomain::work_pending() const {
  if (!ready_.empty()) return true;
  for (const auto& [h, r] : remotes_) {
    if (!r->dead && !r->tx.empty()) return true;
  }
  const uint64_t active = load(header_->active_mask);
  for (uint32_t i = 0; i < shm::kSlots; ++i) {
    if ((active >> i & 1) == 0) continue;
    const shm::SlotHeader* s = shm::slot_at(base_, ring_bytes_, i);
    if (load(s->tail, std::memory_order_seq_cst) != load(s->head)) return true;
    // A claim not looked at yet: its CMA check is due.
    const uint64_t word = load(s->owner);
    if (word != 0 && shm::owner_token(word) != inbound_[i]->token &&
        load(s->ready) == shm::owner_token(word)) {
      return true;
    }
  }
  return false;
}

bool ShmDomain::ready_to_wait() {
  if (doorbell_ < 0 || closed_) return true;
  char buf[64];
  while (::recv(doorbell_, buf, sizeof(buf), MSG_DONTWAIT) > 0) {
  }
  store(header_->sleeping, uint32_t{1}, std::memory_order_seq_cst);  // see ring()
  if (work_pending()) {
    store(header_->sleeping, uint32_t{0}, std::memory_order_relaxed);
    return false;
  }
  return true;
}

void ShmDomain::acknowledge(Inbound& in, uint64_t seq, ErrorCode code) {
  auto r = connect(in.sender);
  if (!r || (*r)->dead) return;  // the sender is gone: nobody waits for this
  TxItem ack;
  ack.kind = RecordKind::kAck;
  ack.seq = seq;
  ack.status = static_cast<uint16_t>(code);
  (*r)->tx.push_back(ack);
  pump(**r);
}

void ShmDomain::on_ack(const Record& rec) {
  auto it = pending_.find(rec.seq);
  if (it == pending_.end()) return;  // failed or dropped already
  const Pending p = it->second;
  pending_.erase(it);
  if (Remote* r = find_remote(p.peer); r != nullptr && r->outstanding > 0) {
    --r->outstanding;
    r->outstanding_bytes -= std::min(r->outstanding_bytes, p.bytes);
  }
  const auto code = static_cast<ErrorCode>(rec.status);
  Completion c{Completion::Kind::kLocal, p.wr_id, 0, 0, code, {}};
  if (code != ErrorCode::kOk) c.error_message = why_refused(code);
  ready_.push_back(std::move(c));
}

void ShmDomain::on_write(Inbound& in, const Record& rec, const std::byte* payload) {
  if ((rec.flags & shm::kFirst) != 0) {
    in.in_write = true;
    in.write_error = ErrorCode::kOk;
  } else if (!in.in_write) {
    return;  // the rest of a write whose start was dropped
  }
  if (in.write_error == ErrorCode::kOk)
    in.write_error = check_access(rec.addr, rec.length, rec.key);
  if (in.write_error == ErrorCode::kOk && rec.length > 0) {
    void* dst = reinterpret_cast<void*>(rec.addr);
    if ((rec.flags & shm::kCma) != 0) {
      if (!read_process(in.pid, rec.src, dst, rec.length)) in.write_error = ErrorCode::kFabric;
      ++stats_.cma_writes;
    } else {
      std::memcpy(dst, payload, rec.length);
      stats_.ring_write_bytes += rec.length;
    }
  }
  if ((rec.flags & shm::kLast) == 0) return;
  in.in_write = false;
  if (in.write_error == ErrorCode::kOk && (rec.flags & shm::kHasImm) != 0) {
    ready_.push_back(Completion{Completion::Kind::kImm, 0, rec.imm, 0, ErrorCode::kOk, {}});
  }
  acknowledge(in, rec.seq, in.write_error);
}

void ShmDomain::on_send(Inbound& in, const Record& rec, const std::byte* payload) {
  if ((rec.flags & shm::kFirst) != 0) {
    in.in_message = true;
    in.total = rec.total;
    in.got = 0;
    in.message_error = rec.total > kMaxMessage ? ErrorCode::kInvalidArgument : ErrorCode::kOk;
    in.has_recv = !recvs_.empty();
    if (in.has_recv) {
      in.recv = recvs_.front();
      recvs_.pop_front();
      if (in.total > in.recv.length) in.message_error = ErrorCode::kInvalidArgument;
    } else if (in.message_error == ErrorCode::kOk) {
      in.buffer.assign(in.total, std::byte{0});
    }
  } else if (!in.in_message) {
    return;
  }
  if (rec.length > in.total - in.got) in.message_error = ErrorCode::kInvalidArgument;
  if (in.message_error == ErrorCode::kOk && rec.length > 0) {
    std::byte* dst = in.has_recv ? static_cast<std::byte*>(in.recv.local) : in.buffer.data();
    std::memcpy(dst + in.got, payload, rec.length);
  }
  in.got += rec.length;
  if ((rec.flags & shm::kLast) == 0) return;
  in.in_message = false;
  if (in.has_recv) {
    Completion c{Completion::Kind::kRecv, in.recv.wr_id, 0, in.total, in.message_error, {}};
    if (in.message_error != ErrorCode::kOk) {
      c.error_message = fmt::format("shm: a message of {} bytes arrived for a {}-byte receive",
                                    in.total, in.recv.length);
    }
    ready_.push_back(std::move(c));
    in.has_recv = false;
  } else if (in.message_error == ErrorCode::kOk) {
    unexpected_.push_back(std::move(in.buffer));
    in.buffer.clear();
  }
  acknowledge(in, rec.seq, in.message_error);
}

void ShmDomain::start_claim(uint32_t slot, Inbound& in, uint64_t word) {
  // What the previous claim left half done is dropped; a receive it had taken goes back.
  if (in.in_message && in.has_recv) recvs_.push_front(in.recv);
  in.in_message = in.has_recv = in.in_write = false;
  in.buffer.clear();
  in.token = shm::owner_token(word);
  in.pid = shm::owner_pid(word);
  shm::SlotHeader* s = shm::slot_at(base_, ring_bytes_, slot);
  char sender[shm::kNameMax];
  std::memcpy(sender, s->sender, sizeof(sender));
  sender[sizeof(sender) - 1] = '\0';
  in.sender = sender;
  if (!valid_name(in.sender)) in.sender = "/";  // acknowledgements then go nowhere
  // Can this worker read the sender's memory? Its probe word says: then writes come as one
  // command each and are copied once; otherwise their bytes come through the ring.
  uint64_t value = 0;
  const bool readable =
      read_process(in.pid, s->probe_addr, &value, sizeof(value)) && value == s->probe_value;
  store(s->cma, uint64_t{in.token} << 32 | (readable ? shm::kCmaYes : shm::kCmaNo));
}

void ShmDomain::consume(uint32_t slot, Inbound& in, uint64_t& budget) {
  shm::SlotHeader* s = shm::slot_at(base_, ring_bytes_, slot);
  // A claim with nothing sent yet still gets its CMA check, so its first write can use it.
  const uint64_t word = load(s->owner);
  if (word != 0 && shm::owner_token(word) != in.token && load(s->ready) == shm::owner_token(word)) {
    start_claim(slot, in, word);
  }
  Record rec;
  const std::byte* payload = nullptr;
  for (int n = 0; n < 256 && budget > 0; ++n) {
    const auto next = in.reader.peek(rec, payload);
    if (next == shm::RingReader::Next::kEmpty) return;
    if (next == shm::RingReader::Next::kCorrupt) {
      detail::log().warn("shm endpoint '{}': slot {} holds malformed records; dropped", name_,
                         slot);
      in.reader.drop();
      if (in.in_message && in.has_recv) recvs_.push_front(in.recv);
      in.in_write = in.in_message = in.has_recv = false;
      return;
    }
    const uint64_t now_word = load(s->owner);
    if (rec.token != shm::owner_token(now_word)) {
      // An earlier claim's: its sender let go of the slot (closed, or dropped this peer) or
      // died; what it left is not executed.
      in.reader.pop(rec);
      continue;
    }
    if (rec.token != in.token) {
      if (load(s->ready) != rec.token) return;  // the claim's fields are not written yet
      start_claim(slot, in, now_word);
    }
    switch (rec.kind) {
      case RecordKind::kWrite:
        budget -= std::min(budget, rec.length + sizeof(Record));
        on_write(in, rec, payload);
        break;
      case RecordKind::kSend:
        budget -= std::min(budget, rec.length + sizeof(Record));
        on_send(in, rec, payload);
        break;
      case RecordKind::kAck:
        on_ack(rec);
        break;
      default:
        break;
    }
    in.reader.pop(rec);
  }
}

size_t ShmDomain::poll(std::span<Completion> out) {
  if (!closed_) {
    if (load(header_->sleeping, std::memory_order_relaxed) != 0) {
      store(header_->sleeping, uint32_t{0}, std::memory_order_relaxed);
    }
    now_ = std::chrono::steady_clock::now();
    uint64_t budget = kPollBudgetBytes;
    const uint64_t active = load(header_->active_mask);
    for (uint32_t i = 0; i < shm::kSlots; ++i) {
      if ((active >> i & 1) != 0) consume(i, *inbound_[i], budget);
    }
    for (auto& [h, r] : remotes_) {
      if (r->dead) continue;
      if (!r->tx.empty()) pump(*r);
      // Peers with work outstanding are watched closely; the others (say, writers this
      // endpoint only acknowledges) now and then, so that a dead one's mapping goes.
      const bool busy = r->outstanding > 0 || !r->tx.empty();
      if (now_ < r->next_watch) continue;
      r->next_watch = now_ + (busy ? kWatchEvery : kIdleWatchEvery);
      std::string why;
      if (remote_gone(*r, why)) fail_remote(*r, why);
    }
  }
  size_t n = 0;
  while (n < out.size() && !ready_.empty()) {
    out[n++] = std::move(ready_.front());
    ready_.pop_front();
  }
  return n;
}

}  // namespace fabric::transport
