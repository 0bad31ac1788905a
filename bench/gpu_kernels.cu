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

__global__ void page_copy(uint8_t* dst, const uint8_t* src, const uint32_t* dst_pages,
                          const uint32_t* src_pages, uint32_t n, uint64_t page_bytes) {
  const uint64_t vecs = page_bytes / 16;
  for (uint32_t p = blockIdx.x; p < n; p += gridDim.x) {
    auto* d = reinterpret_cast<uint4*>(dst + dst_pages[p] * page_bytes);
    const auto* s = reinterpret_cast<const uint4*>(src + src_pages[p] * page_bytes);
    for (uint64_t i = threadIdx.x; i < vecs; i += blockDim.x) d[i] = s[i];
  }
}

}  // namespace

cudaError_t launch_page_copy(uint8_t* dst, const uint8_t* src, const uint32_t* dst_pages,
                             const uint32_t* src_pages, uint32_t n, uint64_t page_bytes,
                             cudaStream_t stream) {
  const uint32_t blocks = n < 1024 ? n : 1024;
  page_copy<<<blocks, 256, 0, stream>>>(dst, src, dst_pages, src_pages, n, page_bytes);
  return cudaGetLastError();
}

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
