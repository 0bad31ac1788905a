// Kernels of fabric-bench-gpu.
#include "gpu_kernels.h"

#include "fabric/uvm_watcher.cuh"

namespace {

__global__ void spin(uint64_t ns) {
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

__global__ void fill(uint8_t* p, uint64_t n, uint64_t seed) {
  for (uint64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    p[i] = static_cast<uint8_t>((i * 2654435761u + seed) >> 7);
  }
}

}  // namespace

cudaError_t launch_spin(uint64_t ns, cudaStream_t stream) {
  spin<<<1, 1, 0, stream>>>(ns);
  return cudaGetLastError();
}

cudaError_t launch_fill(uint8_t* p, uint64_t n, uint64_t seed, cudaStream_t stream) {
  fill<<<256, 256, 0, stream>>>(p, n, seed);
  return cudaGetLastError();
}

cudaError_t launch_bump(uint64_t* device_word, uint64_t value, cudaStream_t stream) {
  return fabric::launch_watcher_store(device_word, value, stream);
}
