// The staged path's copies while kernels wait on the GPU for what the copies bring, as
// fabric::ep's receiving kernels do: a kernel occupying every SM polls a flag in pinned host
// memory, and two caller-driven engines of this process move GPU memory to GPU memory; the write
// must complete (and its immediate be counted) while the kernel still waits, and only then is
// the flag raised. Skipped without a CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "../support/test_support.h"
#include "fabric/engine.h"
#include "spin_kernel.h"

namespace fabric::testing {
namespace {

using namespace std::chrono_literals;

struct Param {
  Backend backend;
  bool legacy_stream;  // the kernel on the legacy default stream, else on a non-blocking one
};

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return info.param.backend.name + (info.param.legacy_stream ? "_legacy_stream" : "_own_stream");
}

class StagedWhileKernelsWait : public ::testing::TestWithParam<Param> {};

TEST_P(StagedWhileKernelsWait, CopiesCompleteWhileEverySmWaits) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    GTEST_SKIP() << "no CUDA device here";
  }
  Config config = make_caller_driven_config(GetParam().backend);
  config.cuda_ipc = Config::CudaIpc::kOff;
  EnginePair engines = make_engine_pair(config);
  ASSERT_TRUE(engines.a);
  TransferEngine& a = *engines.a;
  TransferEngine& b = *engines.b;

  constexpr uint64_t n = uint64_t{1} << 20;
  void* src = nullptr;
  void* dst = nullptr;
  ASSERT_EQ(cudaMalloc(&src, n), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dst, n), cudaSuccess);
  std::vector<std::byte> want(n);
  fill_pattern(want.data(), n, 5);
  ASSERT_EQ(cudaMemcpy(src, want.data(), n, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(dst, 0, n), cudaSuccess);
  auto rs = a.register_memory(src, n);
  ASSERT_TRUE(rs) << rs.status().to_string();
  auto rd = b.register_memory(dst, n);
  ASSERT_TRUE(rd) << rd.status().to_string();

  uint32_t* host = nullptr;  // [0] the flag, [1] timed out
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&host), 8, cudaHostAllocMapped), cudaSuccess);
  host[0] = host[1] = 0;
  uint32_t* dev = nullptr;
  ASSERT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev), host, 0), cudaSuccess);
  cudaStream_t stream = nullptr;
  if (!GetParam().legacy_stream) {
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  }
  ASSERT_EQ(launch_wait_for_flag(dev, 20'000'000'000ull, dev + 1, stream), cudaSuccess);
  std::this_thread::sleep_for(50ms);
  ASSERT_EQ(cudaStreamQuery(stream), cudaErrorNotReady) << "the kernel is not waiting";

  const DrivenWrite w =
      drive_write(a, b, SingleWrite{rs->handle, 0, rd->descriptor, 0, n, 3, {}}, 10s);
  __atomic_store_n(&host[0], 1u, __ATOMIC_RELEASE);  // the kernel may end now
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(host[1], 0u) << "the kernel gave up waiting";
  EXPECT_TRUE(w.submitted) << w.submitted.to_string();
  EXPECT_TRUE(w.failed.empty()) << w.failed;
  EXPECT_TRUE(w.done) << "the write did not complete within 10 s while every SM waited";
  EXPECT_EQ(w.imms, 1u) << "the immediate was not counted within 10 s while every SM waited";
  std::vector<std::byte> got(n);
  ASSERT_EQ(cudaMemcpy(got.data(), dst, n, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), n));

  if (stream != nullptr) cudaStreamDestroy(stream);
  cudaFreeHost(host);
  a.close();
  b.close();
  cudaFree(dst);
  cudaFree(src);
}

INSTANTIATE_TEST_SUITE_P(Providers, StagedWhileKernelsWait,
                         ::testing::Values(Param{{"tcp", "tcp", false}, false},
                                           Param{{"tcp", "tcp", false}, true},
                                           Param{{"shm", "shm", false}, false},
                                           Param{{"shm", "shm", false}, true}),
                         param_name);

}  // namespace
}  // namespace fabric::testing
