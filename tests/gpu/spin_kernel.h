// A kernel for the GPU tests that occupies every SM of the current device, each block polling a
// flag in pinned host memory (ld.acquire.sys, as fabric::ep's receiving kernels do) until it is
// non-zero or limit_ns have passed (it then sets *timed_out). Compiled by nvcc as C++17.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fabric::testing {

// `flag` and `timed_out`: device pointers of mapped pinned host memory.
cudaError_t launch_wait_for_flag(const uint32_t* flag, uint64_t limit_ns, uint32_t* timed_out,
                                 cudaStream_t stream);

}  // namespace fabric::testing
