// The staged path with real CUDA memory: cudaMalloc and cuMemCreate (VMM) buffers moved between
// two engines over tcp and shm, data checked on the device. Skipped without a CUDA device.
#include <cuda.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <random>

#include "../support/test_support.h"

namespace fabric::testing {
namespace {

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define GPU_OR_SKIP()                                                                           \
  if (!have_gpu()) {                                                                            \
    cudaGetLastError();                                                                         \
    GTEST_SKIP() << "no CUDA device here (the staged path is tested with the FakeDeviceBuffer " \
                    "double in the conformance suite)";                                         \
  }

struct Gpu {
  void* ptr = nullptr;
  uint64_t size = 0;
  Registration reg;
  ~Gpu() {
    if (ptr) cudaFree(ptr);
  }
  std::vector<std::byte> read() const {
    std::vector<std::byte> out(size);
    EXPECT_EQ(cudaMemcpy(out.data(), ptr, size, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
};

std::unique_ptr<Gpu> make_gpu(TransferEngine& e, uint64_t n, uint64_t seed,
                              RegisterOptions options = {}) {
  auto g = std::make_unique<Gpu>();
  g->size = n;
  EXPECT_EQ(cudaMalloc(&g->ptr, n), cudaSuccess);
  std::vector<std::byte> init(n, std::byte{0});
  if (seed != 0) fill_pattern(init.data(), n, seed);
  EXPECT_EQ(cudaMemcpy(g->ptr, init.data(), n, cudaMemcpyHostToDevice), cudaSuccess);
  auto r = e.register_memory(g->ptr, n, options);
  EXPECT_TRUE(r) << r.status().to_string();
  if (r) g->reg = *r;
  return g;
}

class StagedCuda : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    GPU_OR_SKIP();
    Config config = make_config(GetParam());
    // shm_staged: shm with the direct path turned off, so both paths run where shm has FI_HMEM.
    config.gpu_direct = GetParam().name != "shm_staged";
    auto ea = TransferEngine::create(config);
    if (!ea) GTEST_SKIP() << ea.status().to_string();
    auto eb = TransferEngine::create(config);
    ASSERT_TRUE(eb) << eb.status().to_string();
    a_ = std::move(*ea);
    b_ = std::move(*eb);
  }
  std::unique_ptr<TransferEngine> a_, b_;
};

// CUDA memory is staged unless every NIC of the group reaches it itself (FI_HMEM: the group
// says "direct"); host, pinned and managed memory never are.
TEST_P(StagedCuda, DeviceMemoryTakesTheGroupsGpuPath) {
  auto dev = make_gpu(*a_, 1 << 20, 1);
  const bool staged = a_->group_info().gpu_memory == "staged";
  std::printf("%s: GPU memory path %s\n", GetParam().provider.c_str(),
              a_->group_info().gpu_memory.c_str());
  EXPECT_EQ(dev->reg.descriptor.staged_region() != 0, staged);
  void* pinned = nullptr;
  ASSERT_EQ(cudaHostAlloc(&pinned, 1 << 20, cudaHostAllocDefault), cudaSuccess);
  auto r = a_->register_memory(pinned, 1 << 20);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->descriptor.staged_region(), 0u) << "pinned host memory is reachable directly";
  void* managed = nullptr;
  ASSERT_EQ(cudaMallocManaged(&managed, 1 << 20), cudaSuccess);
  auto m = a_->register_memory(managed, 1 << 20);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->descriptor.staged_region(), 0u) << "managed memory is CPU-reachable";
  ASSERT_TRUE(a_->unregister_memory(r->handle));
  ASSERT_TRUE(a_->unregister_memory(m->handle));
  a_->close();
  cudaFreeHost(pinned);
  cudaFree(managed);
  auto past = b_->register_memory(dev->ptr, (1 << 20) + 4096);
  EXPECT_FALSE(past) << "a range running past the allocation was accepted";
}

TEST_P(StagedCuda, SingleWritesDeviceToDevice) {
  uint32_t imm = 10;
  for (uint64_t n : {uint64_t{1}, uint64_t{65536}, (uint64_t{1} << 20) + 3, uint64_t{32} << 20}) {
    SCOPED_TRACE(n);
    auto src = make_gpu(*a_, n + 8, n);
    auto dst = make_gpu(*b_, n + 8, 0);
    Probe done;
    ASSERT_TRUE(a_->submit(SingleWrite{src->reg.handle, 8, dst->reg.descriptor, 0, n, imm, {}},
                           done.callbacks()));
    ASSERT_TRUE(done.wait(60s)) << done.wait().to_string();
    ASSERT_TRUE(b_->wait_imm(imm, 1, 10s));
    auto want = src->read();
    auto got = dst->read();
    EXPECT_EQ(0, std::memcmp(want.data() + 8, got.data(), n));
    ++imm;
  }
}

// Both engines in caller-driven progress (GroupConfig::caller_progress, as fabric::ep's proxy
// runs its engine), driven by one thread of the test: device memory still moves, on both sides,
// and the immediate is counted after it.
TEST_P(StagedCuda, CallerDrivenEnginesMoveDeviceMemory) {
  Config config = make_caller_driven_config(GetParam());
  config.gpu_direct = GetParam().name != "shm_staged";
  EnginePair engines = make_engine_pair(config);
  ASSERT_TRUE(engines.a);
  TransferEngine& a = *engines.a;
  TransferEngine& b = *engines.b;
  std::printf("%s: GPU memory path %s (caller-driven)\n", GetParam().provider.c_str(),
              a.group_info().gpu_memory.c_str());
  constexpr uint64_t n = (uint64_t{1} << 20) + 3;
  auto src = make_gpu(a, n, 9);
  auto dst = make_gpu(b, n, 0);
  const DrivenWrite w =
      drive_write(a, b, SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, n, 7, {}}, 20s);
  ASSERT_TRUE(w.submitted) << w.submitted.to_string();
  ASSERT_TRUE(w.failed.empty()) << w.failed;
  ASSERT_TRUE(w.done) << "the write did not complete within 20 s";
  ASSERT_EQ(w.imms, 1u) << "the immediate was not counted within 20 s";
  EXPECT_EQ(0, std::memcmp(src->read().data(), dst->read().data(), n));
}

TEST_P(StagedCuda, HostToDeviceAndBack) {
  constexpr uint64_t n = (uint64_t{3} << 20) + 5;
  auto host = make_buffer(*a_, n);
  fill_pattern(host->bytes.data(), n, 77);
  auto gpu = make_gpu(*b_, n, 0);
  Probe there;
  ASSERT_TRUE(a_->submit(SingleWrite{host->reg.handle, 0, gpu->reg.descriptor, 0, n, 1, {}},
                         there.callbacks()));
  ASSERT_TRUE(there.wait()) << there.wait().to_string();
  EXPECT_EQ(0, std::memcmp(gpu->read().data(), host->bytes.data(), n));
  auto back = make_buffer(*a_, n);
  Probe home;
  ASSERT_TRUE(b_->submit(SingleWrite{gpu->reg.handle, 0, back->reg.descriptor, 0, n, 2, {}},
                         home.callbacks()));
  ASSERT_TRUE(home.wait()) << home.wait().to_string();
  ASSERT_TRUE(a_->wait_imm(2, 1, 10s));
  EXPECT_EQ(0, std::memcmp(back->bytes.data(), host->bytes.data(), n));
}

TEST_P(StagedCuda, PagedWritesDeviceToDevice) {
  constexpr uint64_t kPage = 65536, kStride = kPage + 128;
  constexpr uint32_t kPages = 200;
  auto src = make_gpu(*a_, kPages * kStride, 5);
  auto dst = make_gpu(*b_, kPages * kStride, 0);
  std::vector<uint32_t> sp(kPages), dp(kPages);
  std::iota(sp.begin(), sp.end(), 0);
  std::iota(dp.begin(), dp.end(), 0);
  std::shuffle(sp.begin(), sp.end(), std::mt19937(1));
  std::shuffle(dp.begin(), dp.end(), std::mt19937(2));
  Probe done;
  ASSERT_TRUE(a_->submit(
      PagedWrite{src->reg.handle, dst->reg.descriptor, kPage, sp, kStride, 0, dp, kStride, 0, 9},
      done.callbacks()));
  ASSERT_TRUE(done.wait(60s)) << done.wait().to_string();
  ASSERT_TRUE(b_->wait_imm(9, kPages, 10s));
  EXPECT_EQ(b_->imm_count(9), kPages);
  auto want = src->read();
  auto got = dst->read();
  for (uint32_t i = 0; i < kPages; ++i) {
    ASSERT_EQ(0, std::memcmp(want.data() + sp[i] * kStride, got.data() + dp[i] * kStride, kPage))
        << "page " << i;
  }
}

// CUDA virtual memory management (cuMemCreate + cuMemMap), as PyTorch's expandable segments
// and some KV-cache allocators use: device memory too, on the same path as cudaMalloc memory.
TEST_P(StagedCuda, VmmAllocationsMoveLikeCudaMalloc) {
  using CreateFn = decltype(&cuMemCreate);
  using ReserveFn = decltype(&cuMemAddressReserve);
  using MapFn = decltype(&cuMemMap);
  using AccessFn = decltype(&cuMemSetAccess);
  using GranFn = decltype(&cuMemGetAllocationGranularity);
  using UnmapFn = decltype(&cuMemUnmap);
  using ReleaseFn = decltype(&cuMemRelease);
  using FreeFn = decltype(&cuMemAddressFree);
  auto get = [](const char* name) -> void* {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      return nullptr;
    }
    return fn;
  };
  auto create = reinterpret_cast<CreateFn>(get("cuMemCreate"));
  auto reserve = reinterpret_cast<ReserveFn>(get("cuMemAddressReserve"));
  auto map = reinterpret_cast<MapFn>(get("cuMemMap"));
  auto access = reinterpret_cast<AccessFn>(get("cuMemSetAccess"));
  auto gran = reinterpret_cast<GranFn>(get("cuMemGetAllocationGranularity"));
  auto unmap = reinterpret_cast<UnmapFn>(get("cuMemUnmap"));
  auto release = reinterpret_cast<ReleaseFn>(get("cuMemRelease"));
  auto afree = reinterpret_cast<FreeFn>(get("cuMemAddressFree"));
  if (!create || !reserve || !map || !access || !gran || !unmap || !release || !afree) {
    GTEST_SKIP() << "the driver does not expose the VMM entry points";
  }
  cudaFree(nullptr);  // the runtime's primary context is current from here on
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  size_t g = 0;
  ASSERT_EQ(gran(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), CUDA_SUCCESS);
  const size_t n = ((size_t{4} << 20) + g - 1) / g * g;
  CUmemGenericAllocationHandle h{};
  ASSERT_EQ(create(&h, n, &prop, 0), CUDA_SUCCESS);
  CUdeviceptr va = 0;
  ASSERT_EQ(reserve(&va, n, 0, 0, 0), CUDA_SUCCESS);
  ASSERT_EQ(map(va, n, 0, h, 0), CUDA_SUCCESS);
  CUmemAccessDesc desc{};
  desc.location = prop.location;
  desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  ASSERT_EQ(access(va, n, &desc, 1), CUDA_SUCCESS);
  void* ptr = reinterpret_cast<void*>(va);
  {
    auto reg = b_->register_memory(ptr, n);
    ASSERT_TRUE(reg) << reg.status().to_string();
    EXPECT_EQ(reg->descriptor.staged_region() != 0, b_->group_info().gpu_memory == "staged");
    auto src = make_buffer(*a_, n);
    fill_pattern(src->bytes.data(), n, 3);
    Probe done;
    ASSERT_TRUE(a_->submit(SingleWrite{src->reg.handle, 0, reg->descriptor, 0, n, 4, {}},
                           done.callbacks()));
    ASSERT_TRUE(done.wait()) << done.wait().to_string();
    std::vector<std::byte> got(n);
    ASSERT_EQ(cudaMemcpy(got.data(), ptr, n, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(0, std::memcmp(got.data(), src->bytes.data(), n));
    b_->close();
  }
  unmap(va, n);
  release(h);
  afree(va, n);
}

// Reads of CUDA memory between two engines of one process (the CUDA IPC path maps only another
// process's memory, so these take the staged path, or the direct one where the NICs reach GPU
// memory): device to device, device into host, host into device, single and paged; every byte
// checked on the device.
TEST_P(StagedCuda, ReadsOfDeviceMemory) {
  constexpr uint64_t kBytes = (64 << 20) + 4096;
  RegisterOptions readable;
  readable.remote_read = true;
  auto src = make_gpu(*b_, kBytes, 31, readable);
  ASSERT_TRUE(src->reg.descriptor.readable());
  auto dst = make_gpu(*a_, kBytes, 0);
  std::vector<std::byte> want(kBytes);
  fill_pattern(want.data(), kBytes, 31);
  for (uint64_t n : {uint64_t{1}, uint64_t{4097}, (uint64_t{1} << 20) + 13, uint64_t{64} << 20}) {
    SCOPED_TRACE(::testing::Message() << n << " bytes");
    const uint64_t src_off = n % 13, dst_off = n % 7;
    Probe done;
    ASSERT_TRUE(
        a_->submit(SingleRead{dst->reg.handle, dst_off, src->reg.descriptor, src_off, n, Routing{}},
                   done.callbacks()));
    ASSERT_TRUE(done.wait(std::chrono::seconds(60))) << done.wait().to_string();
    const std::vector<std::byte> got = dst->read();
    ASSERT_EQ(0, std::memcmp(got.data() + dst_off, want.data() + src_off, n));
  }
  // Device into host memory, and host memory into the device.
  auto host = make_buffer(*a_, 1 << 20);
  Probe into_host;
  ASSERT_TRUE(a_->submit(SingleRead{host->reg.handle, 0, src->reg.descriptor, 5, 1 << 20, {}},
                         into_host.callbacks()));
  ASSERT_TRUE(into_host.wait()) << into_host.wait().to_string();
  EXPECT_EQ(0, std::memcmp(host->bytes.data(), want.data() + 5, 1 << 20));
  std::vector<std::byte> host_src(1 << 20);
  fill_pattern(host_src.data(), host_src.size(), 32);
  auto host_reg = b_->register_memory(host_src.data(), host_src.size(), readable);
  ASSERT_TRUE(host_reg) << host_reg.status().to_string();
  Probe into_device;
  ASSERT_TRUE(a_->submit(SingleRead{dst->reg.handle, 3, host_reg->descriptor, 0, 1 << 20, {}},
                         into_device.callbacks()));
  ASSERT_TRUE(into_device.wait()) << into_device.wait().to_string();
  EXPECT_EQ(0, std::memcmp(dst->read().data() + 3, host_src.data(), 1 << 20));
  // 256 pages of 64 KiB, shuffled at both ends.
  constexpr uint64_t kPage = 64 << 10;
  std::vector<uint32_t> src_pages(256), dst_pages(256);
  std::iota(src_pages.begin(), src_pages.end(), 0);
  std::iota(dst_pages.begin(), dst_pages.end(), 0);
  std::shuffle(src_pages.begin(), src_pages.end(), std::mt19937(1));
  std::shuffle(dst_pages.begin(), dst_pages.end(), std::mt19937(2));
  Probe paged;
  ASSERT_TRUE(a_->submit(PagedRead{dst->reg.handle, src->reg.descriptor, kPage, src_pages, kPage, 0,
                                   dst_pages, kPage, 0},
                         paged.callbacks()));
  ASSERT_TRUE(paged.wait(std::chrono::seconds(60))) << paged.wait().to_string();
  const std::vector<std::byte> got = dst->read();
  for (size_t i = 0; i < src_pages.size(); ++i) {
    ASSERT_EQ(0, std::memcmp(got.data() + dst_pages[i] * kPage, want.data() + src_pages[i] * kPage,
                             kPage))
        << "page " << i;
  }
  ASSERT_TRUE(b_->unregister_memory(host_reg->handle));
}

INSTANTIATE_TEST_SUITE_P(Providers, StagedCuda,
                         ::testing::Values(Backend{"tcp", "tcp", false},
                                           Backend{"shm", "shm", false},
                                           Backend{"shm_staged", "shm", false}),
                         backend_name);

}  // namespace
}  // namespace fabric::testing
