// Device side of the UvmWatcher: the store kernel behind launch_watcher_store.
#include "fabric/uvm_watcher.cuh"

namespace fabric {

namespace {

__global__ void watcher_store_kernel(uint64_t* word, uint64_t value) {
  watcher_store(word, value);
}

}  // namespace

cudaError_t launch_watcher_store(uint64_t* device_word, uint64_t value, cudaStream_t stream) {
  watcher_store_kernel<<<1, 1, 0, stream>>>(device_word, value);
  return cudaGetLastError();
}

}  // namespace fabric
