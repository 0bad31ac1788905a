// CUDA IPC in a build without CUDA: nothing to export, map or reach.
#include "cuda/ipc.h"

namespace fabric::cuda {

Result<IpcExport> cuda_ipc_export(int, void*, uint64_t) {
  return Status(ErrorCode::kUnsupported, "fabric-lib was built without CUDA");
}

bool cuda_ipc_reachable(int, const DeviceUuid&) {
  return false;
}

Result<DeviceUuid> cuda_device_uuid(int) {
  return Status(ErrorCode::kUnsupported, "fabric-lib was built without CUDA");
}

Result<std::byte*> cuda_ipc_open(const IpcExport&, int, const Origin&) {
  return Status(ErrorCode::kUnsupported, "fabric-lib was built without CUDA");
}

void cuda_ipc_close(const IpcExport&, const Origin&) {}

}  // namespace fabric::cuda
