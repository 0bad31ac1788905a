// CUDA IPC: exporting registered GPU memory so that another process on the same host can map
// it, mapping what a peer exported, and telling whether two GPUs can copy between each other.
//
// Three kinds of export exist: CUDA's IPC handles (cudaIpcGetMemHandle on memory from
// cudaMalloc, which is what torch's caching allocator hands out), cuMemCreate (VMM) allocations
// made with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (their descriptor travels over the
// exporting process's Unix socket, cuda/ipc_fd_channel.h), and the test double's
// (FakeDeviceBuffer of fabric/testing.h, mappable only inside the process that made it), so that
// the engine's CUDA IPC path runs in CI on the double and on GPU machines on CUDA. Memory CUDA
// cannot export (VMM without that handle type, stream-ordered pools, a range over several VMM
// allocations) is refused with kUnsupported and keeps going over the fabric.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "cuda/device_memory.h"
#include "fabric/address.h"
#include "fabric/status.h"

namespace fabric::cuda {

using DeviceUuid = std::array<std::byte, 16>;

struct IpcExport {
  enum class Kind : uint8_t { kNone = 0, kCuda = 1, kFake = 2, kCudaVmm = 3 };
  static constexpr size_t kMaxHandleBytes = 64;
  Kind kind = Kind::kNone;
  // cudaIpcMemHandle_t (64 bytes); for VMM the allocation's address and size in the exporting
  // process (16 bytes: what to ask its fd socket for); the double's allocation address.
  Bytes handle;
  uint64_t offset = 0;  // the region's first byte, counted from the exported allocation's first
  DeviceUuid device{};  // the GPU holding the memory (all zero for the double)
  friend bool operator==(const IpcExport&, const IpcExport&) = default;
};

// Exports [ptr, ptr + length), device memory as classify() found it. Errors: kUnsupported
// (host memory, or CUDA memory that cudaIpcGetMemHandle refuses, with CUDA's reason), kInternal.
Result<IpcExport> ipc_export(const PointerInfo& memory, void* ptr, uint64_t length);

// Whether memory on `local` can be copied to and from memory on the GPU `peer` by `local`'s
// copy engines: the same GPU, or CUDA peer access between the two. The double reaches only
// the double.
bool ipc_reachable(const PointerInfo& local, const DeviceUuid& peer);

// Maps an export of process `writer` into this one, for copies by `into`'s device; returns the
// address of the exported allocation's first byte here. CUDA maps a handle once per process:
// a handle opened again is the same mapping, counted, and unmapped when the last user closes
// it. A VMM export's descriptor is fetched from the writer's fd socket first (blocking, 2 s at
// most). Errors: kUnsupported (an export kind this build cannot map), kRemoteAccess (CUDA or
// the writer refused: the exporter is gone, or its GPU is not reachable), kTimeout.
Result<std::byte*> ipc_open(const IpcExport& e, const PointerInfo& into, const Origin& writer);
void ipc_close(const IpcExport& e, const Origin& writer);

// The UUID of the GPU `device` names (all zero for the double's).
Result<DeviceUuid> device_uuid(const PointerInfo& device);

// The CUDA implementation (ipc_cuda.cc, or ipc_stub.cc without CUDA) and the double's
// (fake_device.cc).
Result<IpcExport> cuda_ipc_export(int device, void* ptr, uint64_t length);
bool cuda_ipc_reachable(int device, const DeviceUuid& peer);
Result<DeviceUuid> cuda_device_uuid(int device);
Result<std::byte*> cuda_ipc_open(const IpcExport& e, int device, const Origin& writer);
void cuda_ipc_close(const IpcExport& e, const Origin& writer);
Result<IpcExport> fake_ipc_export(void* ptr, uint64_t length);
Result<std::byte*> fake_ipc_open(const IpcExport& e);

}  // namespace fabric::cuda
