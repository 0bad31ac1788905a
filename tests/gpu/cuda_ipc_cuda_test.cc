// The CUDA IPC path with CUDA memory between two processes (docs/cuda-ipc.md): this process and
// a fabric_test_peer whose buffer is cudaMalloc memory (FABRIC_TEST_PEER_MEMORY=cuda), on the
// same host; on a one-GPU machine both use the same GPU (FABRIC_TEST_IPC_PEER_DEVICES puts the
// peer on another). Data is checked on the device. Skipped without a CUDA device (the path's logic
// runs in CI on the FakeDeviceBuffer double: tests/conformance/cuda_ipc_test.cc).
#include <cuda.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <numeric>
#include <random>

#include "peer_process.h"
#include "test_support.h"

namespace fabric::testing {
namespace {

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

struct Gpu {
  void* ptr = nullptr;
  uint64_t size = 0;
  Registration reg;
  ~Gpu() {
    if (ptr) cudaFree(ptr);
  }
  std::vector<std::byte> read(uint64_t off, uint64_t len) const {
    std::vector<std::byte> out(len);
    EXPECT_EQ(
        cudaMemcpy(out.data(), static_cast<std::byte*>(ptr) + off, len, cudaMemcpyDeviceToHost),
        cudaSuccess);
    return out;
  }
};

std::unique_ptr<Gpu> make_gpu(TransferEngine& e, uint64_t n, uint64_t seed) {
  auto g = std::make_unique<Gpu>();
  g->size = n;
  EXPECT_EQ(cudaMalloc(&g->ptr, n), cudaSuccess);
  std::vector<std::byte> init(n, std::byte{0});
  if (seed != 0) fill_pattern(init.data(), n, seed);
  EXPECT_EQ(cudaMemcpy(g->ptr, init.data(), n, cudaMemcpyHostToDevice), cudaSuccess);
  auto r = e.register_memory(g->ptr, n);
  EXPECT_TRUE(r) << r.status().to_string();
  if (r) g->reg = *r;
  return g;
}

uint64_t device_fnv(const Gpu& g, uint64_t off, uint64_t len) {
  auto bytes = g.read(off, len);
  return fnv1a(bytes.data(), len);
}

const std::vector<Backend>& ipc_backends() {
  static const std::vector<Backend> b = {{"shm", "shm", false}, {"tcp", "tcp", false}};
  return b;
}

class CudaIpcCuda : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    if (!have_gpu()) {
      cudaGetLastError();
      GTEST_SKIP() << "no CUDA device here (the CUDA IPC path runs in CI on the FakeDeviceBuffer "
                      "double: tests/conformance/cuda_ipc_test.cc)";
    }
    auto e = TransferEngine::create(make_config(GetParam()));
    ASSERT_TRUE(e) << e.status().to_string();
    engine_ = std::move(*e);
    start_peer(peer_, peer_memory_);
  }
  void start_peer(PeerProcess& p, RemoteMemory& memory) {
    PeerOptions o;
    o.env = {"FABRIC_TEST_PEER_MEMORY=cuda"};
    // FABRIC_TEST_IPC_PEER_DEVICES=1,0 on a two-GPU machine: the peer's CUDA_VISIBLE_DEVICES, so
    // that its memory is on the second GPU while this process's is on the first and the copies
    // cross NVLink (or PCIe). The peer must still see this process's GPU to map its memory.
    if (const char* d = std::getenv("FABRIC_TEST_IPC_PEER_DEVICES"); d != nullptr && *d != 0) {
      o.env.push_back(std::string("CUDA_VISIBLE_DEVICES=") + d);
    }
    ASSERT_TRUE(p.start(GetParam(), kPeerBytes, o));
    auto addr = Address::from_hex(p.read_value("address"));
    ASSERT_TRUE(addr) << addr.status().to_string();
    auto mem = RemoteMemory::from_hex(p.read_value("memory"));
    ASSERT_TRUE(mem) << mem.status().to_string();
    memory = *mem;
    ASSERT_EQ(p.read_line(), "ready");
  }
  uint64_t ipc_transfers() const { return engine_->stats().groups[0].cuda_ipc_transfers; }

  static constexpr uint64_t kPeerBytes = 64 << 20;
  std::unique_ptr<TransferEngine> engine_;
  PeerProcess peer_;
  RemoteMemory peer_memory_;
};

TEST_P(CudaIpcCuda, SingleAndPagedWritesLandInThePeersGpu) {
  ASSERT_TRUE(peer_memory_.cuda_ipc()) << "the peer's CUDA memory has no CUDA IPC section";
  auto src = make_gpu(*engine_, kPeerBytes, 21);
  uint32_t imm = 1;
  for (uint64_t n : {uint64_t{4096}, uint64_t{1} << 20, uint64_t{40} << 20}) {
    SCOPED_TRACE(::testing::Message() << n << " bytes");
    Probe done;
    ASSERT_TRUE(engine_->submit(SingleWrite{src->reg.handle, 0, peer_memory_, 0, n, imm, {}},
                                done.callbacks()));
    ASSERT_TRUE(done.wait()) << done.wait().to_string();
    peer_.send("expect " + std::to_string(imm) + " 1");
    EXPECT_EQ(peer_.read_line(), "got " + std::to_string(imm) + " 1");
    peer_.send("checksum 0 " + std::to_string(n));
    EXPECT_EQ(peer_.read_value("checksum"), std::to_string(device_fnv(*src, 0, n)));
    ++imm;
  }
  EXPECT_EQ(ipc_transfers(), 3u);
  // 512 pages of 16 KiB in a random order, one arrival each.
  constexpr uint64_t kPage = 16384;
  constexpr uint32_t kPages = 512;
  std::vector<uint32_t> pages(kPages);
  std::iota(pages.begin(), pages.end(), 0);
  std::shuffle(pages.begin(), pages.end(), std::mt19937(3));
  const uint64_t base = 40 << 20;
  Probe paged;
  ASSERT_TRUE(engine_->submit(
      PagedWrite{src->reg.handle, peer_memory_, kPage, pages, kPage, 0, pages, kPage, base, 50},
      paged.callbacks()));
  ASSERT_TRUE(paged.wait()) << paged.wait().to_string();
  peer_.send("expect 50 " + std::to_string(kPages));
  EXPECT_EQ(peer_.read_line(), "got 50 " + std::to_string(kPages));
  peer_.send("checksum " + std::to_string(base) + " " + std::to_string(kPages * kPage));
  EXPECT_EQ(peer_.read_value("checksum"), std::to_string(device_fnv(*src, 0, kPages * kPage)));
  EXPECT_EQ(ipc_transfers(), 4u);
  // Pages of 1000 bytes at odd offsets: the batch kernel's byte-wise copies.
  constexpr uint64_t kOdd = 1000;
  constexpr uint32_t kOddPages = 300;
  std::vector<uint32_t> odd(kOddPages);
  std::iota(odd.begin(), odd.end(), 0);
  std::shuffle(odd.begin(), odd.end(), std::mt19937(5));
  const uint64_t odd_base = (48 << 20) + 3;
  Probe odd_paged;
  ASSERT_TRUE(engine_->submit(
      PagedWrite{src->reg.handle, peer_memory_, kOdd, odd, kOdd, 1, odd, kOdd, odd_base, 51},
      odd_paged.callbacks()));
  ASSERT_TRUE(odd_paged.wait()) << odd_paged.wait().to_string();
  peer_.send("expect 51 " + std::to_string(kOddPages));
  EXPECT_EQ(peer_.read_line(), "got 51 " + std::to_string(kOddPages));
  peer_.send("checksum " + std::to_string(odd_base) + " " + std::to_string(kOddPages * kOdd));
  EXPECT_EQ(peer_.read_value("checksum"), std::to_string(device_fnv(*src, 1, kOddPages * kOdd)));
}

// Reads of the peer's GPU memory, every byte checked on this process's device: over the CUDA
// IPC path (the peer copies its memory into this process's exported destination), and with the
// path off here over the staged path (the peer copies the ranges into its mirror first; the
// reads land in this engine's mirror and are copied into its GPU), and into host memory.
TEST_P(CudaIpcCuda, ReadsOfThePeersGpuMemory) {
  ASSERT_TRUE(peer_memory_.readable()) << "the peer registers its memory readable";
  peer_.send("fill 77");
  ASSERT_EQ(peer_.read_line(), "filled");
  std::vector<std::byte> want(kPeerBytes);
  fill_pattern(want.data(), kPeerBytes, 77);
  for (bool ipc : {true, false}) {
    SCOPED_TRACE(ipc ? "CUDA IPC" : "staged");
    Config c = make_config(GetParam());
    if (!ipc) c.cuda_ipc = Config::CudaIpc::kOff;
    auto e = TransferEngine::create(c);
    ASSERT_TRUE(e) << e.status().to_string();
    TransferEngine& reader = **e;
    auto dst = make_gpu(reader, kPeerBytes, 0);
    for (uint64_t n : {uint64_t{1}, uint64_t{4097}, (uint64_t{1} << 20) + 5, uint64_t{40} << 20}) {
      SCOPED_TRACE(::testing::Message() << n << " bytes");
      const uint64_t src_off = n % 13, dst_off = n % 7;
      Probe done;
      ASSERT_TRUE(
          reader.submit(SingleRead{dst->reg.handle, dst_off, peer_memory_, src_off, n, Routing{}},
                        done.callbacks()));
      ASSERT_TRUE(done.wait(std::chrono::seconds(60))) << done.wait().to_string();
      const std::vector<std::byte> got = dst->read(dst_off, n);
      ASSERT_EQ(0, std::memcmp(got.data(), want.data() + src_off, n));
    }
    EXPECT_EQ(reader.stats().groups[0].cuda_ipc_transfers, ipc ? 4u : 0u);
    // 512 pages of 16 KiB, shuffled at both ends.
    constexpr uint64_t kPage = 16384;
    std::vector<uint32_t> src_pages(512), dst_pages(512);
    std::iota(src_pages.begin(), src_pages.end(), 0);
    std::iota(dst_pages.begin(), dst_pages.end(), 0);
    std::shuffle(src_pages.begin(), src_pages.end(), std::mt19937(8));
    std::shuffle(dst_pages.begin(), dst_pages.end(), std::mt19937(9));
    Probe paged;
    ASSERT_TRUE(reader.submit(
        PagedRead{dst->reg.handle, peer_memory_, kPage, src_pages, kPage, 0, dst_pages, kPage, 0},
        paged.callbacks()));
    ASSERT_TRUE(paged.wait(std::chrono::seconds(60))) << paged.wait().to_string();
    const std::vector<std::byte> got = dst->read(0, 512 * kPage);
    for (size_t i = 0; i < src_pages.size(); ++i) {
      ASSERT_EQ(0, std::memcmp(got.data() + dst_pages[i] * kPage,
                               want.data() + src_pages[i] * kPage, kPage))
          << "page " << i;
    }
    // Into host memory: the staged path at the peer's end whatever the mode.
    auto host = make_buffer(reader, 3 << 20);
    Probe into_host;
    ASSERT_TRUE(reader.submit(SingleRead{host->reg.handle, 0, peer_memory_, 11, 3 << 20, {}},
                              into_host.callbacks()));
    ASSERT_TRUE(into_host.wait(std::chrono::seconds(60))) << into_host.wait().to_string();
    EXPECT_EQ(0, std::memcmp(host->bytes.data(), want.data() + 11, 3 << 20));
    reader.close();
  }
}

TEST_P(CudaIpcCuda, ScatterImmOnlyAndBarrier) {
  auto src = make_gpu(*engine_, 1 << 20, 5);
  auto group = engine_->add_peer_group({peer_memory_.owner()});
  ASSERT_TRUE(group);
  Counter c;
  ASSERT_TRUE(engine_->submit(
      Scatter{src->reg.handle, *group, {{peer_memory_, 1 << 20, 0, 4096}}, 60, {}}, c.callbacks()));
  ASSERT_TRUE(engine_->submit(ImmWrite{peer_memory_.owner(), 61, 0, 0}, c.callbacks()));
  ASSERT_TRUE(engine_->submit(Barrier{*group, 62, 0, 0}, c.callbacks()));
  ASSERT_TRUE(c.wait_total(3));
  EXPECT_EQ(c.done(), 3) << c.first_error().to_string();
  for (int imm : {60, 61, 62}) {
    peer_.send("expect " + std::to_string(imm) + " 1");
    EXPECT_EQ(peer_.read_line(), "got " + std::to_string(imm) + " 1");
  }
  peer_.send("checksum 4096 " + std::to_string(1 << 20));
  EXPECT_EQ(peer_.read_value("checksum"), std::to_string(device_fnv(*src, 0, 1 << 20)));
}

// The peer writes from its GPU into this process's GPU: this engine maps the peer's export and
// copies. Then the peer unregisters its buffer while this process has it mapped, and this
// process keeps working.
TEST_P(CudaIpcCuda, PeerWritesIntoThisGpuThenUnregistersWhileMapped) {
  auto dst = make_gpu(*engine_, 8 << 20, 0);
  peer_.send("fill 77");
  ASSERT_EQ(peer_.read_line(), "filled");
  peer_.send("write " + to_hex(dst->reg.descriptor.encode()) + " 100 200 " +
             std::to_string(5 << 20) + " 31");
  ASSERT_EQ(peer_.read_line(), "done");
  ASSERT_TRUE(engine_->wait_imm(31, 1, 20s));
  std::vector<std::byte> expected(kPeerBytes);
  fill_pattern(expected.data(), kPeerBytes, 77);
  auto got = dst->read(200, 5 << 20);
  EXPECT_EQ(0, std::memcmp(got.data(), expected.data() + 100, 5 << 20));
  peer_.send("unregister");
  ASSERT_EQ(peer_.read_line(), "unregistered");
  // A write into the peer's unregistered buffer fails alone, clearly; nothing is counted.
  auto src = make_gpu(*engine_, 4096, 3);
  Probe stale;
  ASSERT_TRUE(engine_->submit(SingleWrite{src->reg.handle, 0, peer_memory_, 0, 4096, 32, {}},
                              stale.callbacks()));
  Status s = stale.wait();
  EXPECT_EQ(s.code(), ErrorCode::kRemoteAccess) << s.to_string();
  EXPECT_NE(s.message().find("unregistered"), std::string::npos) << s.to_string();
  // This process's GPU is healthy, and the engine serves a new peer.
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  PeerProcess other;
  RemoteMemory other_memory;
  start_peer(other, other_memory);
  Probe ok;
  ASSERT_TRUE(engine_->submit(SingleWrite{src->reg.handle, 0, other_memory, 0, 4096, 33, {}},
                              ok.callbacks()));
  EXPECT_TRUE(ok.wait()) << ok.wait().to_string();
}

// The destination's owner killed while writes stream to it: every transfer ends (done or
// failed) within a bound, and the engine then writes to a live peer over the path.
TEST_P(CudaIpcCuda, OwnerKilledMidTransfer) {
  auto src = make_gpu(*engine_, 4 << 20, 9);
  Counter c;
  constexpr int kWrites = 200;
  for (int i = 0; i < kWrites; ++i) {
    ASSERT_TRUE(engine_->submit(SingleWrite{src->reg.handle, 0, peer_memory_, 0, 4 << 20, 1, {}},
                                c.callbacks()));
  }
  peer_.kill_now();
  ASSERT_TRUE(c.wait_total(kWrites, 60s)) << c.done() << " done, " << c.failed() << " failed";
  PeerProcess other;
  RemoteMemory other_memory;
  start_peer(other, other_memory);
  const uint64_t before = ipc_transfers();
  Probe ok;
  ASSERT_TRUE(engine_->submit(SingleWrite{src->reg.handle, 0, other_memory, 0, 4096, 2, {}},
                              ok.callbacks()));
  EXPECT_TRUE(ok.wait()) << ok.wait().to_string();
  EXPECT_EQ(ipc_transfers(), before + 1);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// The writer killed while this process copies from its GPU memory: this process (the owner,
// holding the writer's mapping) survives, its GPU stays usable, and it takes new writes.
TEST_P(CudaIpcCuda, WriterKilledWhileTheOwnerCopies) {
  auto dst = make_gpu(*engine_, 64 << 20, 0);
  peer_.send("fill 5");
  ASSERT_EQ(peer_.read_line(), "filled");
  peer_.send("spam 300 " + to_hex(dst->reg.descriptor.encode()) + " 0 0 " +
             std::to_string(32 << 20) + " 40");
  ASSERT_EQ(peer_.read_line(), "submitted");
  std::this_thread::sleep_for(20ms);
  peer_.kill_now();
  std::this_thread::sleep_for(2s);  // copies in flight finish or fail; the sweep runs
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  PeerProcess other;
  RemoteMemory other_memory;
  start_peer(other, other_memory);
  other.send("fill 6");
  ASSERT_EQ(other.read_line(), "filled");
  other.send("write " + to_hex(dst->reg.descriptor.encode()) + " 0 0 4096 41");
  ASSERT_EQ(other.read_line(), "done");
  EXPECT_TRUE(engine_->wait_imm(41, 1, 20s));
  std::vector<std::byte> whole(kPeerBytes);
  fill_pattern(whole.data(), kPeerBytes, 6);
  auto got = dst->read(0, 4096);
  EXPECT_EQ(0, std::memcmp(got.data(), whole.data(), 4096));
}

// A cuMemCreate (VMM) allocation, as PyTorch's expandable segments make: with
// CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR it is exported as a descriptor that the owner fetches
// over this process's fd socket (SCM_RIGHTS) and maps; without, it keeps the fabric.
class Vmm {
 public:
  static void* get(const char* name) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      return nullptr;
    }
    return fn;
  }
  bool allocate(size_t bytes, bool fd_export) {
    auto create = reinterpret_cast<decltype(&cuMemCreate)>(get("cuMemCreate"));
    auto reserve = reinterpret_cast<decltype(&cuMemAddressReserve)>(get("cuMemAddressReserve"));
    auto map = reinterpret_cast<decltype(&cuMemMap)>(get("cuMemMap"));
    auto access = reinterpret_cast<decltype(&cuMemSetAccess)>(get("cuMemSetAccess"));
    auto gran = reinterpret_cast<decltype(&cuMemGetAllocationGranularity)>(
        get("cuMemGetAllocationGranularity"));
    if (!create || !reserve || !map || !access || !gran) return false;
    cudaFree(nullptr);
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    if (fd_export) prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    size_t g = 0;
    if (gran(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS) return false;
    size_ = (bytes + g - 1) / g * g;
    if (create(&handle_, size_, &prop, 0) != CUDA_SUCCESS) return false;
    if (reserve(&va_, size_, 0, 0, 0) != CUDA_SUCCESS) return false;
    if (map(va_, size_, 0, handle_, 0) != CUDA_SUCCESS) return false;
    CUmemAccessDesc desc{};
    desc.location = prop.location;
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    return access(va_, size_, &desc, 1) == CUDA_SUCCESS;
  }
  ~Vmm() {
    auto unmap = reinterpret_cast<decltype(&cuMemUnmap)>(get("cuMemUnmap"));
    auto release = reinterpret_cast<decltype(&cuMemRelease)>(get("cuMemRelease"));
    auto afree = reinterpret_cast<decltype(&cuMemAddressFree)>(get("cuMemAddressFree"));
    if (va_ != 0 && unmap) unmap(va_, size_);
    if (va_ != 0 && afree) afree(va_, size_);
    if (handle_ != 0 && release) release(handle_);
  }
  void* ptr() const { return reinterpret_cast<void*>(va_); }
  size_t size() const { return size_; }

 private:
  CUmemGenericAllocationHandle handle_{};
  CUdeviceptr va_ = 0;
  size_t size_ = 0;
};

TEST_P(CudaIpcCuda, VmmAllocationsTravelAsFileDescriptors) {
  for (bool fd_export : {true, false}) {
    SCOPED_TRACE(fd_export ? "with POSIX_FD" : "without POSIX_FD");
    Vmm vmm;
    if (!vmm.allocate(4 << 20, fd_export)) GTEST_SKIP() << "no VMM support in this driver";
    std::vector<std::byte> init(vmm.size());
    fill_pattern(init.data(), init.size(), fd_export ? 31 : 32);
    ASSERT_EQ(cudaMemcpy(vmm.ptr(), init.data(), init.size(), cudaMemcpyHostToDevice), cudaSuccess);
    {
      auto reg = engine_->register_memory(vmm.ptr(), vmm.size());
      ASSERT_TRUE(reg) << reg.status().to_string();
      const uint64_t before = ipc_transfers();
      const uint32_t imm = fd_export ? 70 : 71;
      Probe done;
      ASSERT_TRUE(engine_->submit(
          SingleWrite{reg->handle, 4096, peer_memory_, 0, vmm.size() - 4096, imm, {}},
          done.callbacks()));
      ASSERT_TRUE(done.wait()) << done.wait().to_string();
      EXPECT_EQ(ipc_transfers(), before + (fd_export ? 1 : 0));
      peer_.send("expect " + std::to_string(imm) + " 1");
      EXPECT_EQ(peer_.read_line(), "got " + std::to_string(imm) + " 1");
      peer_.send("checksum 0 " + std::to_string(vmm.size() - 4096));
      EXPECT_EQ(peer_.read_value("checksum"),
                std::to_string(fnv1a(init.data() + 4096, vmm.size() - 4096)));
      ASSERT_TRUE(engine_->unregister_memory(reg->handle));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(SameHost, CudaIpcCuda, ::testing::ValuesIn(ipc_backends()), backend_name);

}  // namespace
}  // namespace fabric::testing
