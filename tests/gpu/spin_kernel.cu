// The waiting kernel of spin_kernel.h.
#include "spin_kernel.h"

namespace fabric::testing {
namespace {

__device__ uint64_t global_ns() {
  uint64_t t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void wait_for_flag(const uint32_t* flag, uint64_t limit_ns, uint32_t* timed_out) {
  const uint64_t start = global_ns();
  for (;;) {
    uint32_t v = 0;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
    if (v != 0) return;
    if (global_ns() - start > limit_ns) {
      if (threadIdx.x == 0) atomicExch(timed_out, 1u);
      return;
    }
  }
}

}  // namespace

cudaError_t launch_wait_for_flag(const uint32_t* flag, uint64_t limit_ns, uint32_t* timed_out,
                                 cudaStream_t stream) {
  int device = 0, sms = 0, per_sm = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  if (cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
      err != cudaSuccess) {
    return err;
  }
  if (cudaError_t err =
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, wait_for_flag, 1024, 0);
      err != cudaSuccess) {
    return err;
  }
  wait_for_flag<<<sms * per_sm, 1024, 0, stream>>>(flag, limit_ns, timed_out);
  return cudaGetLastError();
}

}  // namespace fabric::testing
