// CUDA IPC with CUDA: cudaIpcGetMemHandle / cudaIpcOpenMemHandle for cudaMalloc memory;
// cuMemCreate (VMM) allocations exported as POSIX file descriptors, handed over by this
// process's fd socket (cuda/ipc_fd_channel.h) and mapped with cuMemImportFromShareableHandle +
// cuMemMap; the exported allocation's start from the driver (cuMemGetAddressRange). Driver
// calls are looked up through the runtime, so that the library does not link libcuda. GPUs are
// named by UUID (ordinals differ between processes with different CUDA_VISIBLE_DEVICES).
#include <cuda.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <unistd.h>

#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "cuda/cuda_status.h"
#include "cuda/ipc.h"
#include "cuda/ipc_fd_channel.h"

namespace fabric::cuda {

namespace {

using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

void* driver_fn(const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q{};
  if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return p;
}

GetAddressRange address_range_fn() {
  static const auto fn = reinterpret_cast<GetAddressRange>(driver_fn("cuMemGetAddressRange"));
  return fn;
}

// The driver's VMM calls, looked up once; `ok` when every one was found.
struct Vmm {
  decltype(&cuMemRetainAllocationHandle) retain = nullptr;
  decltype(&cuMemGetAllocationPropertiesFromHandle) properties = nullptr;
  decltype(&cuMemExportToShareableHandle) export_fd = nullptr;
  decltype(&cuMemImportFromShareableHandle) import_fd = nullptr;
  decltype(&cuMemAddressReserve) reserve = nullptr;
  decltype(&cuMemAddressFree) address_free = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemSetAccess) access = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  bool ok = false;
};

const Vmm& vmm() {
  static const Vmm v = [] {
    Vmm m;
    m.retain = reinterpret_cast<decltype(m.retain)>(driver_fn("cuMemRetainAllocationHandle"));
    m.properties = reinterpret_cast<decltype(m.properties)>(
        driver_fn("cuMemGetAllocationPropertiesFromHandle"));
    m.export_fd =
        reinterpret_cast<decltype(m.export_fd)>(driver_fn("cuMemExportToShareableHandle"));
    m.import_fd =
        reinterpret_cast<decltype(m.import_fd)>(driver_fn("cuMemImportFromShareableHandle"));
    m.reserve = reinterpret_cast<decltype(m.reserve)>(driver_fn("cuMemAddressReserve"));
    m.address_free = reinterpret_cast<decltype(m.address_free)>(driver_fn("cuMemAddressFree"));
    m.map = reinterpret_cast<decltype(m.map)>(driver_fn("cuMemMap"));
    m.unmap = reinterpret_cast<decltype(m.unmap)>(driver_fn("cuMemUnmap"));
    m.access = reinterpret_cast<decltype(m.access)>(driver_fn("cuMemSetAccess"));
    m.release = reinterpret_cast<decltype(m.release)>(driver_fn("cuMemRelease"));
    m.ok = m.retain && m.properties && m.export_fd && m.import_fd && m.reserve && m.address_free &&
           m.map && m.unmap && m.access && m.release;
    return m;
  }();
  return v;
}

Status driver_error(ErrorCode code, std::string_view what, CUresult r) {
  return Status(code, fmt::format("{} failed (CUresult {})", what, static_cast<int>(r)));
}

// This process's fd socket, started with the first VMM export: it hands a peer the POSIX
// descriptor of an allocation this process exported (its address is the id asked for).
std::mutex& server_mu() {
  static std::mutex mu;
  return mu;
}
std::map<uint64_t, uint64_t>& exported_vmm() {  // allocation address -> size; under server_mu
  static std::map<uint64_t, uint64_t> m;
  return m;
}

Result<int> vmm_descriptor(uint64_t base) {
  {
    std::lock_guard lock(server_mu());
    if (exported_vmm().count(base) == 0) {
      return Status(ErrorCode::kNotFound,
                    fmt::format("allocation {:#x} was not exported by this process", base));
    }
  }
  const Vmm& v = vmm();
  CUmemGenericAllocationHandle h{};
  if (CUresult r = v.retain(&h, reinterpret_cast<void*>(base)); r != CUDA_SUCCESS) {
    return driver_error(ErrorCode::kNotFound, "cuMemRetainAllocationHandle (freed?)", r);
  }
  int fd = -1;
  CUresult r = v.export_fd(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  v.release(h);
  if (r != CUDA_SUCCESS) return driver_error(ErrorCode::kFabric, "cuMemExportToShareableHandle", r);
  return fd;
}

Status ensure_fd_server() {
  static std::unique_ptr<FdServer> server;  // lives as long as the process
  std::lock_guard lock(server_mu());
  if (server) return Status::ok();
  auto s = FdServer::start(fd_socket_name(Origin::of_this_process(0)), vmm_descriptor);
  if (!s) return s.status();
  server = std::move(*s);
  return Status::ok();
}

// A cuMemCreate allocation holding `ptr`, exportable as a descriptor: its export, or why not.
Result<IpcExport> vmm_export(void* ptr, uint64_t base, uint64_t size) {
  const Vmm& v = vmm();
  if (!v.ok) return Status(ErrorCode::kUnsupported, "the CUDA driver lacks the VMM entry points");
  CUmemGenericAllocationHandle h{};
  if (v.retain(&h, ptr) != CUDA_SUCCESS) {
    return Status(ErrorCode::kUnsupported, "not a cuMemCreate (VMM) allocation either");
  }
  CUmemAllocationProp prop{};
  CUresult r = v.properties(&prop, h);
  v.release(h);
  if (r != CUDA_SUCCESS) {
    return driver_error(ErrorCode::kUnsupported, "cuMemGetAllocationPropertiesFromHandle", r);
  }
  if ((prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == 0) {
    return Status(ErrorCode::kUnsupported,
                  "a cuMemCreate (VMM) allocation made without "
                  "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR cannot be exported");
  }
  if (Status s = ensure_fd_server(); !s) return s;
  {
    std::lock_guard lock(server_mu());
    exported_vmm()[base] = size;
  }
  IpcExport e;
  e.kind = IpcExport::Kind::kCudaVmm;
  e.handle.resize(16);
  std::memcpy(e.handle.data(), &base, 8);
  std::memcpy(e.handle.data() + 8, &size, 8);
  return e;
}

Result<DeviceUuid> uuid_of(int device) {
  static std::mutex mu;
  static std::map<int, DeviceUuid> known;
  std::lock_guard lock(mu);
  if (auto it = known.find(device); it != known.end()) return it->second;
  cudaDeviceProp prop{};
  if (cudaError_t err = cudaGetDeviceProperties(&prop, device); err != cudaSuccess) {
    return cuda_error("cudaGetDeviceProperties", err);
  }
  DeviceUuid out;
  std::memcpy(out.data(), prop.uuid.bytes, out.size());
  known.emplace(device, out);
  return out;
}

// Mappings of peers' handles in this process, by handle: CUDA maps a handle once per process.
struct Mapping {
  std::byte* base = nullptr;
  uint64_t users = 0;
  bool vmm = false;  // cuMemMap'ed from an imported descriptor (else cudaIpcOpenMemHandle)
  uint64_t size = 0;
};

// A handle names an allocation system-wide for cudaIpc; a VMM export's address and size only
// within its process.
Bytes mapping_key(const IpcExport& e, const Origin& writer) {
  Bytes k = e.handle;
  if (e.kind == IpcExport::Kind::kCudaVmm) {
    for (uint64_t v : {writer.pidns, uint64_t{writer.pid}, writer.start_time}) {
      const auto* b = reinterpret_cast<const std::byte*>(&v);
      k.insert(k.end(), b, b + sizeof(v));
    }
  }
  return k;
}

// Maps a VMM export of `writer`: its descriptor from the writer's fd socket, imported, mapped at
// a fresh address range, made readable and writable by `device`.
Result<std::byte*> vmm_open(const IpcExport& e, int device, const Origin& writer, uint64_t& size) {
  const Vmm& v = vmm();
  if (!v.ok) return Status(ErrorCode::kUnsupported, "the CUDA driver lacks the VMM entry points");
  if (e.handle.size() != 16) return Status(ErrorCode::kRemoteAccess, "malformed VMM export");
  uint64_t base = 0;
  std::memcpy(&base, e.handle.data(), 8);
  std::memcpy(&size, e.handle.data() + 8, 8);
  auto fd = fetch_fd(fd_socket_name(writer), base, std::chrono::milliseconds(2000));
  if (!fd) return fd.status();
  CUmemGenericAllocationHandle h{};
  CUresult r = v.import_fd(&h, reinterpret_cast<void*>(static_cast<intptr_t>(*fd)),
                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  ::close(*fd);
  if (r != CUDA_SUCCESS) {
    return driver_error(ErrorCode::kRemoteAccess, "cuMemImportFromShareableHandle", r);
  }
  CUdeviceptr va = 0;
  if (r = v.reserve(&va, size, 0, 0, 0); r != CUDA_SUCCESS) {
    v.release(h);
    return driver_error(ErrorCode::kRemoteAccess, "cuMemAddressReserve", r);
  }
  if (r = v.map(va, size, 0, h, 0); r != CUDA_SUCCESS) {
    v.address_free(va, size);
    v.release(h);
    return driver_error(ErrorCode::kRemoteAccess, "cuMemMap", r);
  }
  v.release(h);  // the mapping holds the allocation from here on
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (r = v.access(va, size, &access, 1); r != CUDA_SUCCESS) {
    v.unmap(va, size);
    v.address_free(va, size);
    return driver_error(ErrorCode::kRemoteAccess, "cuMemSetAccess", r);
  }
  return reinterpret_cast<std::byte*>(va);
}
std::mutex& mappings_mu() {
  static std::mutex mu;
  return mu;
}
std::map<Bytes, Mapping>& mappings() {
  static std::map<Bytes, Mapping> m;
  return m;
}

}  // namespace

Result<IpcExport> cuda_ipc_export(int device, void* ptr, uint64_t length) {
  if (cudaError_t err = cudaSetDevice(device); err != cudaSuccess) {
    return cuda_error("cudaSetDevice", err);
  }
  GetAddressRange range = address_range_fn();
  if (range == nullptr) {
    return Status(ErrorCode::kUnsupported, "the CUDA driver offers no cuMemGetAddressRange");
  }
  CUdeviceptr base = 0;
  size_t size = 0;
  if (CUresult r = range(&base, &size, reinterpret_cast<CUdeviceptr>(ptr)); r != CUDA_SUCCESS) {
    return Status(
        ErrorCode::kUnsupported,
        fmt::format("cuMemGetAddressRange refused the pointer (CUresult {})", static_cast<int>(r)));
  }
  const auto offset = reinterpret_cast<uint64_t>(ptr) - base;
  if (offset + length > size) {
    return Status(ErrorCode::kUnsupported, "the range runs past its CUDA allocation");
  }
  auto uuid = uuid_of(device);
  if (!uuid) return uuid.status();
  IpcExport e;
  cudaIpcMemHandle_t h{};
  if (cudaError_t err = cudaIpcGetMemHandle(&h, ptr); err != cudaSuccess) {
    cudaGetLastError();
    // cuMemCreate (VMM) memory: exported as a file descriptor, when it allows that.
    auto vmm_e = vmm_export(ptr, base, size);
    if (!vmm_e) {
      return Status(ErrorCode::kUnsupported,
                    fmt::format("cudaIpcGetMemHandle refused the memory ({}), and {}",
                                cudaGetErrorName(err), vmm_e.status().message()));
    }
    e = std::move(*vmm_e);
  } else {
    e.kind = IpcExport::Kind::kCuda;
    e.handle.resize(sizeof(h));
    std::memcpy(e.handle.data(), &h, sizeof(h));
  }
  e.offset = offset;
  e.device = *uuid;
  return e;
}

Result<DeviceUuid> cuda_device_uuid(int device) {
  return uuid_of(device);
}

namespace {

bool find_reachable(int device, const DeviceUuid& peer) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  for (int d = 0; d < count; ++d) {
    auto u = uuid_of(d);
    if (!u || *u != peer) continue;
    if (d == device) return true;
    int can = 0;
    if (cudaDeviceCanAccessPeer(&can, device, d) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return can != 0;
  }
  return false;  // a GPU this process does not see
}

}  // namespace

bool cuda_ipc_reachable(int device, const DeviceUuid& peer) {
  // Asked for every destination of every submission on the path; a process's devices and
  // their peer access do not change while it runs, so each pair is looked up once.
  static std::mutex mu;
  static std::map<std::pair<int, DeviceUuid>, bool> known;
  std::lock_guard lock(mu);
  const auto key = std::make_pair(device, peer);
  if (auto it = known.find(key); it != known.end()) return it->second;
  const bool reachable = find_reachable(device, peer);
  known.emplace(key, reachable);
  return reachable;
}

Result<std::byte*> cuda_ipc_open(const IpcExport& e, int device, const Origin& writer) {
  const bool is_vmm = e.kind == IpcExport::Kind::kCudaVmm;
  if (!is_vmm && e.handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return Status(ErrorCode::kRemoteAccess, "malformed CUDA IPC handle");
  }
  const Bytes key = mapping_key(e, writer);
  std::lock_guard lock(mappings_mu());
  Mapping& m = mappings()[key];
  if (m.users == 0) {
    if (cudaError_t err = cudaSetDevice(device); err != cudaSuccess) {
      mappings().erase(key);
      return cuda_error("cudaSetDevice", err);
    }
    if (is_vmm) {
      auto p = vmm_open(e, device, writer, m.size);
      if (!p) {
        mappings().erase(key);
        return p.status();
      }
      m.base = *p;
      m.vmm = true;
      ++m.users;
      return m.base;
    }
    cudaIpcMemHandle_t h{};
    std::memcpy(&h, e.handle.data(), sizeof(h));
    void* p = nullptr;
    if (cudaError_t err = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
        err != cudaSuccess) {
      cudaGetLastError();
      mappings().erase(key);
      return Status(ErrorCode::kRemoteAccess,
                    fmt::format("cudaIpcOpenMemHandle failed: {} ({})", cudaGetErrorString(err),
                                cudaGetErrorName(err)));
    }
    m.base = static_cast<std::byte*>(p);
  }
  ++m.users;
  return m.base;
}

void cuda_ipc_close(const IpcExport& e, const Origin& writer) {
  std::lock_guard lock(mappings_mu());
  auto it = mappings().find(mapping_key(e, writer));
  if (it == mappings().end()) return;
  if (--it->second.users == 0) {
    const Mapping& m = it->second;
    if (m.vmm) {
      const auto va = reinterpret_cast<CUdeviceptr>(m.base);
      vmm().unmap(va, m.size);
      vmm().address_free(va, m.size);
    } else {
      cudaIpcCloseMemHandle(m.base);
      cudaGetLastError();
    }
    mappings().erase(it);
  }
}

}  // namespace fabric::cuda
