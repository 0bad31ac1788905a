// CUDA_OK(call): a benchmark's CUDA call that must succeed; prints the call and CUDA's message
// and exits otherwise. For the GPU benchmarks only (the library maps CUDA errors to Status).
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CUDA_OK(call)                                                  \
  do {                                                                 \
    cudaError_t e_ = (call);                                           \
    if (e_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                    \
    }                                                                  \
  } while (0)
