// dma-buf export of CUDA memory (cuMemGetHandleForAddressRange, reached through the runtime's
// driver entry point, so that fabric-lib needs no link against libcuda). Compiled on machines
// with CUDA; exercised only where a GPU and an RDMA NIC share a host.
#include "transport/verbs/verbs_dmabuf.h"

#include <fmt/format.h>
#include <unistd.h>

#ifdef FABRIC_WITH_CUDA
#include <cuda.h>
#include <cuda_runtime_api.h>
#endif

namespace fabric::transport {

#ifdef FABRIC_WITH_CUDA
namespace {

using GetHandleFn = CUresult (*)(void* handle, CUdeviceptr dptr, size_t size,
                                 CUmemRangeHandleType type, unsigned long long flags);

GetHandleFn get_handle_fn() {
  static GetHandleFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetHandleForAddressRange", &p, 12000,
                                         cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      return GetHandleFn{nullptr};
    }
    return reinterpret_cast<GetHandleFn>(p);
  }();
  return fn;
}

}  // namespace

bool dmabuf_supported() {
  return get_handle_fn() != nullptr;
}

Result<DmabufRange> dmabuf_for(void* ptr, uint64_t length) {
  GetHandleFn fn = get_handle_fn();
  if (fn == nullptr) {
    return Status(ErrorCode::kUnsupported,
                  "the CUDA driver offers no cuMemGetHandleForAddressRange (dma-buf export)");
  }
  // The exported range must start and end on host page boundaries.
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t addr = reinterpret_cast<uint64_t>(ptr);
  const uint64_t base = addr & ~(page - 1);
  const uint64_t end = (addr + length + page - 1) & ~(page - 1);
  int fd = -1;
  CUresult rc =
      fn(&fd, static_cast<CUdeviceptr>(base), end - base, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
  if (rc != CUDA_SUCCESS) {
    return Status(ErrorCode::kFabric,
                  fmt::format("cuMemGetHandleForAddressRange (dma-buf) of {} bytes at {:#x} "
                              "failed: CUresult {}",
                              end - base, base, static_cast<int>(rc)));
  }
  return DmabufRange{fd, addr - base};
}

void dmabuf_close(const DmabufRange& r) {
  if (r.fd >= 0) close(r.fd);
}

#else

bool dmabuf_supported() {
  return false;
}
Result<DmabufRange> dmabuf_for(void*, uint64_t) {
  return Status(ErrorCode::kUnsupported, "fabric-lib was built without CUDA");
}
void dmabuf_close(const DmabufRange&) {}

#endif

}  // namespace fabric::transport
