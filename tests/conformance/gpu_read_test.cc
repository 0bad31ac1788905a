// Conformance of reads of GPU memory on the GPU-memory test double (FakeDeviceBuffer, whose
// device address faults on any direct access, so a byte that did not move by the engine's
// copies would crash the test): two engines of this process, over every backend.
//
// - the staged path (Config::cuda_ipc off, or host memory on one side): a staged peer region is
//   copied out of its device into its mirror by its owner before the reader's fabric reads; a
//   staged local region receives into its mirror, and each read's bytes are copied into the
//   device before the read counts as done;
// - the CUDA IPC path (device to device, Config::cuda_ipc at its default): the owner copies its
//   region into the reader's exported destination.
//
// The same paths with CUDA memory, between two processes, run on a GPU machine
// (tests/gpu/cuda_ipc_cuda_test.cc, tests/gpu/staged_cuda_test.cc).
#include <algorithm>
#include <deque>
#include <numeric>
#include <random>
#include <thread>

#include "tally.h"
#include "test_support.h"

namespace fabric::testing {
namespace {

constexpr std::byte kPoison{0xA5};

// Where the bytes are on each side, and whether the CUDA IPC path may take device to device.
struct Shape {
  const char* name;
  bool peer_device;   // the region read is GPU memory
  bool local_device;  // the region read into is GPU memory
  bool cuda_ipc;      // Config::cuda_ipc at its default (else off)
};

const Shape kShapes[] = {
    {"staged_peer_into_host", true, false, true},
    {"host_into_staged_local", false, true, true},
    {"device_to_device_cuda_ipc", true, true, true},
    {"device_to_device_staged", true, true, false},
};

// Either kind of registered memory, seen through the bytes the test may touch.
struct Memory {
  std::unique_ptr<Buffer> host;
  std::unique_ptr<DeviceBuffer> device;
  const Registration& reg() const { return host ? host->reg : device->reg; }
  std::span<std::byte> bytes() const {
    return host ? std::span<std::byte>(host->bytes) : device->bytes();
  }
};

class GpuReads : public ::testing::TestWithParam<Backend> {
 protected:
  void open(bool cuda_ipc) {
    a_.reset();
    b_.reset();
    kept_.clear();
    Config c = make_config(GetParam());
    if (!cuda_ipc) c.cuda_ipc = Config::CudaIpc::kOff;
    skip_ = open_pair(c, c, a_, b_);
  }
  void SetUp() override {
    open(true);
    if (!skip_.empty()) GTEST_SKIP() << "provider not available: " << skip_;
  }
  void TearDown() override {
    a_.reset();  // engines before the memory they registered
    b_.reset();
    kept_.clear();
  }

  Memory& keep(Memory m) { return kept_.emplace_back(std::move(m)); }
  Memory& memory(TransferEngine& e, bool device, uint64_t n, RegisterOptions options) {
    Memory m;
    if (device) {
      m.device = make_device_buffer(e, n, options);
    } else {
      m.host = std::make_unique<Buffer>();
      m.host->bytes.assign(n, std::byte{0});
      auto r = e.register_memory(m.host->bytes.data(), n, options);
      EXPECT_TRUE(r) << r.status().to_string();
      if (r) m.host->reg = *r;
    }
    return keep(std::move(m));
  }
  // The owner's (b) region, filled with a pattern, registered readable.
  Memory& readable(const Shape& s, uint64_t n, uint64_t seed, RegisterOptions options = {}) {
    options.remote_read = true;
    Memory& m = memory(*b_, s.peer_device, n, options);
    fill_pattern(m.bytes().data(), n, seed);
    return m;
  }
  // The reader's (a) region, full of kPoison.
  Memory& landing(const Shape& s, uint64_t n) {
    Memory& m = memory(*a_, s.local_device, n, {});
    std::fill(m.bytes().begin(), m.bytes().end(), kPoison);
    return m;
  }
  uint64_t ipc_transfers() const { return a_->stats().groups[0].cuda_ipc_transfers; }

  std::string skip_;
  std::unique_ptr<TransferEngine> a_;
  std::unique_ptr<TransferEngine> b_;
  std::deque<Memory> kept_;  // references to its elements stay valid as it grows
};

// Every shape, sizes from 0 bytes to 24 MiB at odd offsets; the bytes around the read untouched;
// device to device goes over the CUDA IPC path exactly when it may.
TEST_P(GpuReads, SingleReadsOfEveryShapeAndSize) {
  for (const Shape& shape : kShapes) {
    SCOPED_TRACE(shape.name);
    open(shape.cuda_ipc);
    const bool over_ipc = shape.cuda_ipc && shape.peer_device && shape.local_device;
    for (uint64_t n : {uint64_t{0}, uint64_t{1}, uint64_t{4097}, (uint64_t{1} << 20) + 13,
                       (uint64_t{24} << 20) + 7}) {
      SCOPED_TRACE(::testing::Message() << n << " bytes");
      const uint64_t src_off = n % 13, dst_off = n % 7;
      Memory& src = readable(shape, n + src_off + 1, n + 3);
      Memory& dst = landing(shape, n + dst_off + 16);
      const uint64_t before = ipc_transfers();
      Probe done;
      auto id = a_->submit(
          SingleRead{dst.reg().handle, dst_off, src.reg().descriptor, src_off, n, Routing{}},
          done.callbacks());
      ASSERT_TRUE(id) << id.status().to_string();
      const Status s = done.wait(std::chrono::seconds(120));
      ASSERT_TRUE(s) << s.to_string();
      ASSERT_EQ(0, std::memcmp(src.bytes().data() + src_off, dst.bytes().data() + dst_off, n));
      const std::span<std::byte> got = dst.bytes();
      for (uint64_t i = 0; i < dst_off; ++i) ASSERT_EQ(got[i], kPoison) << "byte " << i;
      for (uint64_t i = dst_off + n; i < got.size(); ++i) ASSERT_EQ(got[i], kPoison) << i;
      EXPECT_EQ(ipc_transfers(), before + (over_ipc && n > 0 ? 1 : 0));
    }
  }
}

// 300 of 1000 pages, shuffled at both ends, for every shape; a few hundred reads in flight at
// once; the pages not read stay poisoned.
TEST_P(GpuReads, PagedReadsAndManyInFlight) {
  constexpr uint64_t kPage = 4096 + 64;
  constexpr uint32_t kPages = 1000;
  for (const Shape& shape : kShapes) {
    SCOPED_TRACE(shape.name);
    open(shape.cuda_ipc);
    Memory& src = readable(shape, kPage * kPages, 9);
    Memory& dst = landing(shape, kPage * kPages);
    std::mt19937 rng(7);
    std::vector<uint32_t> src_pages(kPages), dst_pages(kPages);
    std::iota(src_pages.begin(), src_pages.end(), 0);
    std::iota(dst_pages.begin(), dst_pages.end(), 0);
    std::shuffle(src_pages.begin(), src_pages.end(), rng);
    std::shuffle(dst_pages.begin(), dst_pages.end(), rng);
    src_pages.resize(300);
    dst_pages.resize(300);
    Probe paged;
    ASSERT_TRUE(a_->submit(PagedRead{dst.reg().handle, src.reg().descriptor, kPage, src_pages,
                                     kPage, 0, dst_pages, kPage, 0},
                           paged.callbacks()));
    ASSERT_TRUE(paged.wait(std::chrono::seconds(60))) << paged.wait().to_string();
    std::vector<bool> read(kPages, false);
    for (size_t i = 0; i < src_pages.size(); ++i) {
      read[dst_pages[i]] = true;
      ASSERT_EQ(0, std::memcmp(src.bytes().data() + src_pages[i] * kPage,
                               dst.bytes().data() + dst_pages[i] * kPage, kPage))
          << "page " << i;
    }
    for (uint32_t p = 0; p < kPages; ++p) {
      if (read[p]) continue;
      for (uint64_t i = 0; i < kPage; ++i) ASSERT_EQ(dst.bytes()[p * kPage + i], kPoison) << p;
    }
    // Every other page back, one single read each, all in flight together.
    std::fill(dst.bytes().begin(), dst.bytes().end(), kPoison);
    Tally tally;
    int submitted = 0;
    for (uint32_t p = 0; p < kPages; p += 2) {
      ASSERT_TRUE(a_->submit(
          SingleRead{dst.reg().handle, p * kPage, src.reg().descriptor, p * kPage, kPage, {}},
          tally.callbacks()));
      ++submitted;
    }
    ASSERT_TRUE(tally.wait_total(submitted, std::chrono::seconds(60))) << tally.summary();
    EXPECT_EQ(tally.done(), submitted) << tally.summary();
    EXPECT_EQ(tally.twice(), 0);
    for (uint32_t p = 0; p < kPages; ++p) {
      const std::byte* got = dst.bytes().data() + p * kPage;
      if (p % 2 == 0) {
        ASSERT_EQ(0, std::memcmp(src.bytes().data() + p * kPage, got, kPage)) << "page " << p;
      } else {
        ASSERT_EQ(got[0], kPoison) << "page " << p;
      }
    }
  }
}

// A descriptor forged to say that a GPU region is readable: its owner refuses the read Commit
// (kRemoteAccess) and nothing is read; so does a region unregistered since. The engines go on.
TEST_P(GpuReads, TheOwnerRefusesRegionsNotReadableOrGone) {
  for (const Shape& shape : kShapes) {
    if (!shape.peer_device) continue;  // host memory: the fabric's keys (read_test.cc)
    SCOPED_TRACE(shape.name);
    open(shape.cuda_ipc);
    Memory& plain = memory(*b_, true, 8192, {});
    fill_pattern(plain.bytes().data(), 8192, 5);
    Memory& dst = landing(shape, 8192);
    const RemoteMemory& d = plain.reg().descriptor;
    RemoteMemory forged(d.owner(), d.base(), d.length(), d.rails(), d.staged_region(), d.cuda_ipc(),
                        /*readable=*/true);
    Probe refused;
    ASSERT_TRUE(
        a_->submit(SingleRead{dst.reg().handle, 0, forged, 0, 8192, {}}, refused.callbacks()));
    Status s = refused.wait(std::chrono::seconds(30));
    EXPECT_EQ(s.code(), ErrorCode::kRemoteAccess) << s.to_string();
    EXPECT_NE(s.message().find("readable"), std::string::npos) << s.to_string();
    for (std::byte b : dst.bytes()) ASSERT_EQ(b, kPoison);

    Memory& gone = readable(shape, 8192, 6);
    const RemoteMemory stale = gone.reg().descriptor;
    ASSERT_TRUE(b_->unregister_memory(gone.reg().handle));
    Probe after;
    ASSERT_TRUE(a_->submit(SingleRead{dst.reg().handle, 0, stale, 0, 8192, {}}, after.callbacks()));
    s = after.wait(std::chrono::seconds(30));
    EXPECT_EQ(s.code(), ErrorCode::kRemoteAccess) << s.to_string();
    for (std::byte b : dst.bytes()) ASSERT_EQ(b, kPoison);

    Memory& fine = readable(shape, 8192, 7);
    Probe ok;
    ASSERT_TRUE(a_->submit(SingleRead{dst.reg().handle, 0, fine.reg().descriptor, 0, 8192, {}},
                           ok.callbacks()));
    ASSERT_TRUE(ok.wait(std::chrono::seconds(30))) << ok.wait().to_string();
    EXPECT_EQ(0, std::memcmp(fine.bytes().data(), dst.bytes().data(), 8192));
  }
}

// GPU memory registered without a host mirror is read only over the CUDA IPC path: into GPU
// memory it works; into host memory, or with the path off, the read is refused at submit with
// the reason, and nothing is posted.
TEST_P(GpuReads, WithoutAHostMirrorOnlyTheCudaIpcPathReads) {
  const Shape device_to_device = kShapes[2];
  Memory& src = readable(device_to_device, 65536, 11, RegisterOptions{.host_mirror = false});
  EXPECT_TRUE(src.reg().descriptor.ipc_only());
  EXPECT_TRUE(src.reg().descriptor.readable());
  Memory& dst = landing(device_to_device, 65536);
  Probe done;
  ASSERT_TRUE(a_->submit(SingleRead{dst.reg().handle, 0, src.reg().descriptor, 0, 65536, {}},
                         done.callbacks()));
  ASSERT_TRUE(done.wait(std::chrono::seconds(30))) << done.wait().to_string();
  EXPECT_EQ(0, std::memcmp(src.bytes().data(), dst.bytes().data(), 65536));

  Memory& host = landing(kShapes[0], 65536);
  Probe never;
  auto id = a_->submit(SingleRead{host.reg().handle, 0, src.reg().descriptor, 0, 65536, {}},
                       never.callbacks());
  ASSERT_FALSE(id);
  EXPECT_EQ(id.status().code(), ErrorCode::kUnsupported) << id.status().to_string();
  EXPECT_NE(id.status().message().find("host mirror"), std::string::npos)
      << id.status().to_string();
  EXPECT_NE(id.status().message().find("host memory"), std::string::npos)
      << id.status().to_string();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(never.calls(), 0);
  for (std::byte b : host.bytes()) ASSERT_EQ(b, kPoison);
}

INSTANTIATE_TEST_SUITE_P(AllBackends, GpuReads, ::testing::ValuesIn(all_backends()), backend_name);

}  // namespace
}  // namespace fabric::testing
