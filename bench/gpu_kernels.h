// Kernels of fabric-bench-gpu, behind host launchers (the host code is C++20, nvcc's is not).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

// A one-thread kernel that spins for `ns` nanoseconds of GPU time: a layer's "compute".
cudaError_t launch_spin(uint64_t ns, cudaStream_t stream);
// Fills n bytes with a pattern derived from seed.
cudaError_t launch_fill(uint8_t* p, uint64_t n, uint64_t seed, cudaStream_t stream);
// Bumps a UvmWatcher word after the stream's earlier work (fabric::launch_watcher_store).
cudaError_t launch_bump(uint64_t* device_word, uint64_t value, cudaStream_t stream);
// Copies n pages of page_bytes (a multiple of 16, 16-byte aligned) from src + src_pages[i] *
// page_bytes to dst + dst_pages[i] * page_bytes; the page tables are device memory. One kernel
// for a whole paged write: the alternative to one cudaMemcpyAsync per page.
cudaError_t launch_page_copy(uint8_t* dst, const uint8_t* src, const uint32_t* dst_pages,
                             const uint32_t* src_pages, uint32_t n, uint64_t page_bytes,
                             cudaStream_t stream);
