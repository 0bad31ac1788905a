// Device side of the UvmWatcher: how a kernel tells the host that work is done.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fabric {

// Publishes `value` to a watcher word in mapped host memory. Every write the calling thread
// made before (to GPU memory or to host memory) is visible system-wide before the host can
// observe the new value: a release store at system scope.
__device__ __forceinline__ void watcher_store(uint64_t* word, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(word), "l"(value) : "memory");
}

// Reads a word the host writes (acquire at system scope), e.g. an acknowledgement.
__device__ __forceinline__ uint64_t watcher_load(const uint64_t* word) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(word) : "memory");
  return v;
}

// Host launcher: a one-thread kernel that stores `value` after the stream's earlier work, so a
// CUDA graph can bump a watcher between layers. Returns the launch's error.
cudaError_t launch_watcher_store(uint64_t* device_word, uint64_t value, cudaStream_t stream);

}  // namespace fabric
