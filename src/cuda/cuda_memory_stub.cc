// Device memory in a build without CUDA: every pointer that is not the test double is host
// memory.
#include "cuda/device_memory.h"

namespace fabric::cuda {

bool cuda_available() {
  return false;
}

Result<PointerInfo> classify_cuda(const void*, uint64_t) {
  return PointerInfo{};
}

Result<std::byte*> cuda_host_alloc(uint64_t) {
  return Status(ErrorCode::kUnsupported, "fabric-lib was built without CUDA");
}

void cuda_host_free(std::byte*) {}

Result<PointerInfo> cuda_pin_for_copies(void*, uint64_t) {
  return Status(ErrorCode::kUnsupported, "fabric-lib was built without CUDA");
}

void cuda_unpin_for_copies(void*) {}

Result<void*> cuda_device_alloc(uint64_t) {
  return Status(ErrorCode::kUnsupported, "fabric-lib was built without CUDA");
}

void cuda_device_free(void*) {}

Result<std::unique_ptr<Copier>> make_cuda_copier(int) {
  return Status(ErrorCode::kUnsupported, "fabric-lib was built without CUDA");
}

}  // namespace fabric::cuda
