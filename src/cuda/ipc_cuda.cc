// CUDA IPC with CUDA: cudaIpcGetMemHandle / cudaIpcOpenMemHandle, the exported allocation's start
// from the driver (cuMemGetAddressRange, looked up through the runtime so that the library does
// not link libcuda), and GPU identities by UUID (ordinals differ between processes with
// different CUDA_VISIBLE_DEVICES).
#include <cuda.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <cstring>
#include <map>
#include <mutex>

#include "cuda/cuda_status.h"
#include "cuda/ipc.h"

namespace fabric::cuda {

namespace {

using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

GetAddressRange address_range_fn() {
  static const GetAddressRange fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return GetAddressRange{nullptr};
    }
    return reinterpret_cast<GetAddressRange>(p);
  }();
  return fn;
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
};
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
  cudaIpcMemHandle_t h{};
  if (cudaError_t err = cudaIpcGetMemHandle(&h, ptr); err != cudaSuccess) {
    cudaGetLastError();
    // cuMemCreate (VMM) and stream-ordered pool memory: not exportable this way.
    return Status(ErrorCode::kUnsupported,
                  fmt::format("cudaIpcGetMemHandle refused the memory: {} ({})",
                              cudaGetErrorString(err), cudaGetErrorName(err)));
  }
  auto uuid = uuid_of(device);
  if (!uuid) return uuid.status();
  IpcExport e;
  e.kind = IpcExport::Kind::kCuda;
  e.handle.resize(sizeof(h));
  std::memcpy(e.handle.data(), &h, sizeof(h));
  e.offset = offset;
  e.device = *uuid;
  return e;
}

bool cuda_ipc_reachable(int device, const DeviceUuid& peer) {
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

Result<std::byte*> cuda_ipc_open(const IpcExport& e, int device) {
  if (e.handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return Status(ErrorCode::kRemoteAccess, "malformed CUDA IPC handle");
  }
  std::lock_guard lock(mappings_mu());
  Mapping& m = mappings()[e.handle];
  if (m.users == 0) {
    if (cudaError_t err = cudaSetDevice(device); err != cudaSuccess) {
      mappings().erase(e.handle);
      return cuda_error("cudaSetDevice", err);
    }
    cudaIpcMemHandle_t h{};
    std::memcpy(&h, e.handle.data(), sizeof(h));
    void* p = nullptr;
    if (cudaError_t err = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
        err != cudaSuccess) {
      cudaGetLastError();
      mappings().erase(e.handle);
      return Status(ErrorCode::kRemoteAccess,
                    fmt::format("cudaIpcOpenMemHandle failed: {} ({})", cudaGetErrorString(err),
                                cudaGetErrorName(err)));
    }
    m.base = static_cast<std::byte*>(p);
  }
  ++m.users;
  return m.base;
}

void cuda_ipc_close(const IpcExport& e) {
  std::lock_guard lock(mappings_mu());
  auto it = mappings().find(e.handle);
  if (it == mappings().end()) return;
  if (--it->second.users == 0) {
    cudaIpcCloseMemHandle(it->second.base);
    cudaGetLastError();
    mappings().erase(it);
  }
}

}  // namespace fabric::cuda
