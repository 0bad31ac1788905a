// The GPU-memory test double (fabric/testing.h) and its copier.
#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>

#include "cuda/device_memory.h"
#include "cuda/ipc.h"
#include "fabric/testing.h"

namespace fabric {

namespace {

struct FakeRange {
  std::byte* backing;
  uint64_t size;
};

// Live fake allocations, by device address.
std::mutex& registry_mu() {
  static std::mutex mu;
  return mu;
}
std::map<const std::byte*, FakeRange>& registry() {
  static std::map<const std::byte*, FakeRange> r;
  return r;
}

Status sys_error(const char* what) {
  return Status(ErrorCode::kInternal, fmt::format("{} failed: {}", what, std::strerror(errno)));
}

// The backing address of a device address, or null when it is not fake device memory.
std::byte* backing_of(const void* ptr, uint64_t bytes) {
  const auto* p = static_cast<const std::byte*>(ptr);
  std::lock_guard lock(registry_mu());
  auto& r = registry();
  auto it = r.upper_bound(p);
  if (it == r.begin()) return nullptr;
  --it;
  const uint64_t off = static_cast<uint64_t>(p - it->first);
  if (off >= it->second.size || bytes > it->second.size - off) return nullptr;
  return it->second.backing + off;
}

}  // namespace

namespace testing {

Result<std::unique_ptr<FakeDeviceBuffer>> FakeDeviceBuffer::create(uint64_t bytes) {
  if (bytes == 0) return Status(ErrorCode::kInvalidArgument, "FakeDeviceBuffer of 0 bytes");
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t mapped = (bytes + page - 1) / page * page;
  int fd = memfd_create("fabric-fake-device", MFD_CLOEXEC);
  if (fd < 0) return sys_error("memfd_create");
  if (ftruncate(fd, static_cast<off_t>(mapped)) != 0) {
    Status s = sys_error("ftruncate");
    ::close(fd);
    return s;
  }
  void* device = mmap(nullptr, mapped, PROT_NONE, MAP_SHARED, fd, 0);
  void* backing = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (device == MAP_FAILED || backing == MAP_FAILED) {
    Status s = sys_error("mmap");
    if (device != MAP_FAILED) munmap(device, mapped);
    if (backing != MAP_FAILED) munmap(backing, mapped);
    return s;
  }
  auto* d = static_cast<std::byte*>(device);
  auto* b = static_cast<std::byte*>(backing);
  {
    std::lock_guard lock(registry_mu());
    registry().emplace(d, FakeRange{b, bytes});
  }
  return std::unique_ptr<FakeDeviceBuffer>(new FakeDeviceBuffer(d, b, bytes));
}

FakeDeviceBuffer::~FakeDeviceBuffer() {
  {
    std::lock_guard lock(registry_mu());
    registry().erase(device_);
  }
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t mapped = (size_ + page - 1) / page * page;
  munmap(device_, mapped);
  munmap(backing_, mapped);
}

}  // namespace testing

namespace cuda {

bool fake_lookup(const void* ptr, uint64_t length, bool& fits) {
  fits = false;
  if (backing_of(ptr, 1) == nullptr) return false;
  fits = backing_of(ptr, length) != nullptr;
  return true;
}

namespace {

// Copies between device and host at once with memcpy through the backing mapping, and reports
// each fence on the poll after the one that follows it, so the engine sees copies pending as it
// would with a GPU. Device-to-device copies (the CUDA IPC path) happen only when their fence
// completes, so an engine that counted an immediate before its copies' fence would be caught
// with the bytes still missing.
class FakeCopier final : public Copier {
 public:
  Status copy(void* device_ptr, std::byte* host_ptr, uint64_t bytes, Direction dir) override {
    std::byte* backing = backing_of(device_ptr, bytes);
    if (backing == nullptr) {
      return Status(ErrorCode::kInvalidArgument,
                    fmt::format("fake device copy of {} bytes at {}: not fake device memory", bytes,
                                device_ptr));
    }
    if (dir == Direction::kToHost) {
      std::memcpy(host_ptr, backing, bytes);
    } else {
      std::memcpy(backing, host_ptr, bytes);
    }
    return Status::ok();
  }
  Status copy_device(std::byte* dst, const std::byte* src, uint64_t bytes) override {
    // Under testing::FakeCopyEngines the destination may be host memory registered for GPU
    // copies; otherwise both ends must be the double's.
    std::byte* to = backing_of(dst, bytes);
    if (to == nullptr && fake_copy_engines() && backing_of(dst, 1) == nullptr) to = dst;
    std::byte* from = backing_of(src, bytes);
    if (to == nullptr || from == nullptr) {
      return Status(ErrorCode::kInvalidArgument,
                    fmt::format("fake device copy of {} bytes from {} to {}: not fake device "
                                "memory",
                                bytes, static_cast<const void*>(src), static_cast<void*>(dst)));
    }
    pending_.push_back({to, from, bytes});
    return Status::ok();
  }
  Status fence(uint64_t token) override {
    fences_.push_back({token, false, std::move(pending_)});
    pending_.clear();
    return Status::ok();
  }
  size_t poll(std::vector<Done>& done) override {
    size_t n = 0;
    while (!fences_.empty() && fences_.front().seen) {
      run(fences_.front().copies);
      done.push_back({fences_.front().token, Status::ok()});
      fences_.pop_front();
      ++n;
    }
    for (auto& f : fences_) f.seen = true;
    return n;
  }
  size_t outstanding() const override { return fences_.size(); }
  void drain() override {
    for (auto& f : fences_) run(f.copies);
    run(pending_);
    fences_.clear();
    pending_.clear();
  }

 private:
  struct DeviceCopy {
    std::byte* to;
    const std::byte* from;
    uint64_t bytes;
  };
  static void run(const std::vector<DeviceCopy>& copies) {
    for (const DeviceCopy& c : copies) std::memmove(c.to, c.from, c.bytes);
  }
  struct Fence {
    uint64_t token;
    bool seen;
    std::vector<DeviceCopy> copies;  // device-to-device copies that complete with it
  };
  std::deque<Fence> fences_;
  std::vector<DeviceCopy> pending_;
};

}  // namespace

// The double's CUDA IPC export: the address of its allocation, mappable only in this process
// (where it is the same address).
Result<IpcExport> fake_ipc_export(void* ptr, uint64_t length) {
  const auto* p = static_cast<const std::byte*>(ptr);
  std::lock_guard lock(registry_mu());
  auto& r = registry();
  auto it = r.upper_bound(p);
  if (it == r.begin()) {
    return Status(ErrorCode::kUnsupported, "not fake device memory");
  }
  --it;
  const uint64_t off = static_cast<uint64_t>(p - it->first);
  if (off >= it->second.size || length > it->second.size - off) {
    return Status(ErrorCode::kUnsupported, "not fake device memory");
  }
  IpcExport e;
  e.kind = IpcExport::Kind::kFake;
  const auto base = reinterpret_cast<uint64_t>(it->first);
  e.handle.resize(sizeof(base));
  std::memcpy(e.handle.data(), &base, sizeof(base));
  e.offset = off;
  return e;
}

Result<std::byte*> fake_ipc_open(const IpcExport& e) {
  uint64_t base = 0;
  if (e.handle.size() != sizeof(base)) {
    return Status(ErrorCode::kRemoteAccess, "malformed fake CUDA IPC handle");
  }
  std::memcpy(&base, e.handle.data(), sizeof(base));
  auto* p = reinterpret_cast<std::byte*>(base);
  std::lock_guard lock(registry_mu());
  if (registry().count(p) == 0) {
    return Status(ErrorCode::kRemoteAccess,
                  fmt::format("fake device allocation {:#x} is not mapped in this process (freed, "
                              "or exported by another process)",
                              base));
  }
  return p;
}

Result<IpcExport> ipc_export(const PointerInfo& memory, void* ptr, uint64_t length) {
  switch (memory.kind) {
    case MemoryKind::kFake:
      return fake_ipc_export(ptr, length);
    case MemoryKind::kCuda:
      return cuda_ipc_export(memory.device, ptr, length);
    case MemoryKind::kHost:
      break;
  }
  return Status(ErrorCode::kUnsupported, "host memory has no CUDA IPC export");
}

bool ipc_reachable(const PointerInfo& local, const DeviceUuid& peer) {
  switch (local.kind) {
    case MemoryKind::kFake:
      return peer == DeviceUuid{};
    case MemoryKind::kCuda:
      return cuda_ipc_reachable(local.device, peer);
    case MemoryKind::kHost:
      break;
  }
  return false;
}

Result<std::byte*> ipc_open(const IpcExport& e, const PointerInfo& into, const Origin& writer) {
  if (e.kind == IpcExport::Kind::kFake && into.kind == MemoryKind::kFake) return fake_ipc_open(e);
  if ((e.kind == IpcExport::Kind::kCuda || e.kind == IpcExport::Kind::kCudaVmm) &&
      into.kind == MemoryKind::kCuda) {
    return cuda_ipc_open(e, into.device, writer);
  }
  return Status(ErrorCode::kUnsupported,
                fmt::format("a CUDA IPC export of kind {} cannot be mapped for memory of kind {}",
                            static_cast<int>(e.kind), static_cast<int>(into.kind)));
}

void ipc_close(const IpcExport& e, const Origin& writer) {
  if (e.kind == IpcExport::Kind::kCuda || e.kind == IpcExport::Kind::kCudaVmm) {
    cuda_ipc_close(e, writer);
  }
}

namespace {
std::atomic<int> g_fake_copy_engines{0};
}  // namespace

bool fake_copy_engines() {
  return g_fake_copy_engines.load() > 0;
}

Result<PointerInfo> pin_for_copies(void* ptr, uint64_t length) {
  if (!cuda_available() && fake_copy_engines()) return PointerInfo{MemoryKind::kFake, 0};
  return cuda_pin_for_copies(ptr, length);
}

void unpin_for_copies(const PointerInfo& device, void* ptr) {
  if (device.kind == MemoryKind::kCuda) cuda_unpin_for_copies(ptr);
}

Result<DeviceUuid> device_uuid(const PointerInfo& device) {
  if (device.kind == MemoryKind::kFake) return DeviceUuid{};
  if (device.kind == MemoryKind::kCuda) return cuda_device_uuid(device.device);
  return Status(ErrorCode::kInternal, "host memory has no GPU");
}

Result<std::unique_ptr<Copier>> make_fake_copier() {
  return std::unique_ptr<Copier>(new FakeCopier());
}

// --- dispatch -----------------------------------------------------------------------------

Result<PointerInfo> classify(const void* ptr, uint64_t length) {
  bool fits = false;
  if (fake_lookup(ptr, length, fits)) {
    if (!fits) {
      return Status(
          ErrorCode::kOutOfRange,
          fmt::format("{} bytes at {} run past the end of their fake device buffer", length, ptr));
    }
    return PointerInfo{MemoryKind::kFake, 0};
  }
  return classify_cuda(ptr, length);
}

Result<std::unique_ptr<HostBuffer>> HostBuffer::allocate(const PointerInfo& for_device,
                                                         uint64_t bytes) {
  if (for_device.kind == MemoryKind::kCuda) {
    auto p = cuda_host_alloc(bytes);
    if (!p) return p.status();
    return std::unique_ptr<HostBuffer>(new HostBuffer(*p, bytes, true));
  }
  const uint64_t rounded = (bytes + 4095) / 4096 * 4096;
  auto* p = static_cast<std::byte*>(std::aligned_alloc(4096, rounded));
  if (p == nullptr) {
    return Status(ErrorCode::kInternal,
                  fmt::format("cannot allocate {} bytes of staging memory", bytes));
  }
  return std::unique_ptr<HostBuffer>(new HostBuffer(p, bytes, false));
}

HostBuffer::~HostBuffer() {
  if (cuda_) {
    cuda_host_free(data_);
  } else {
    std::free(data_);
  }
}

Result<std::unique_ptr<Copier>> Copier::create(const PointerInfo& device) {
  switch (device.kind) {
    case MemoryKind::kFake:
      return make_fake_copier();
    case MemoryKind::kCuda:
      return make_cuda_copier(device.device);
    case MemoryKind::kHost:
      break;
  }
  return Status(ErrorCode::kInternal, "no copier for host memory");
}

}  // namespace cuda

namespace testing {

FakeCopyEngines::FakeCopyEngines() {
  cuda::g_fake_copy_engines.fetch_add(1);
}

FakeCopyEngines::~FakeCopyEngines() {
  cuda::g_fake_copy_engines.fetch_sub(1);
}

}  // namespace testing
}  // namespace fabric
