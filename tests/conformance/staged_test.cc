// Conformance of the staged path: device memory that the NICs cannot reach, moved through
// pinned host mirrors. On machines without a GPU the device memory is the test double
// FakeDeviceBuffer (fabric/testing.h), whose device address faults on any direct access, so a
// byte that bypassed the staging copies would crash the test rather than pass it. The same
// cases run against CUDA memory in tests/gpu on a GPU machine.
#include <numeric>
#include <random>

#include "fabric/testing.h"
#include "test_support.h"

namespace fabric::testing {
namespace {

// The staged path itself: CUDA IPC off, or same-host device-to-device writes would take that
// path instead (tests/conformance/cuda_ipc_test.cc runs them with it on).
Config staged_config(const Backend& b, int nics = 1) {
  Config c = make_config(b, nics);
  c.cuda_ipc = Config::CudaIpc::kOff;
  return c;
}

class Staged : public ::testing::TestWithParam<Backend> {
 protected:
  void open(int nics) {
    auto ea = TransferEngine::create(staged_config(GetParam(), nics));
    if (!ea && ea.status().code() == ErrorCode::kUnsupported) {
      skip_reason_ = ea.status().to_string();
      return;
    }
    ASSERT_TRUE(ea) << ea.status().to_string();
    auto eb = TransferEngine::create(staged_config(GetParam(), nics));
    ASSERT_TRUE(eb) << eb.status().to_string();
    a_ = std::move(*ea);
    b_ = std::move(*eb);
  }
  void SetUp() override {
    open(1);
    if (!skip_reason_.empty()) GTEST_SKIP() << "provider not available: " << skip_reason_;
  }

  // Expects `imm` once at b, checking at that moment that `want` is already in `got`.
  Probe expect_data(uint32_t imm, std::span<const std::byte> want, std::span<const std::byte> got,
                    uint64_t count = 1) {
    Probe arrived;
    Status s = b_->expect_imm(imm, count, [cb = arrived.callbacks(), want, got] {
      if (std::memcmp(want.data(), got.data(), want.size()) == 0) {
        cb.on_done();
      } else {
        cb.on_error(Status(ErrorCode::kInternal, "immediate counted before the data landed"));
      }
    });
    EXPECT_TRUE(s) << s.to_string();
    return arrived;
  }

  std::string skip_reason_;
  std::unique_ptr<TransferEngine> a_;
  std::unique_ptr<TransferEngine> b_;
};

TEST_P(Staged, DescriptorsSayWhichRegionsAreStaged) {
  auto host = make_buffer(*a_, 4096);
  auto dev = make_device_buffer(*a_, 4096);
  EXPECT_EQ(host->reg.descriptor.staged_region(), 0u);
  EXPECT_NE(dev->reg.descriptor.staged_region(), 0u);
  auto decoded = RemoteMemory::decode(dev->reg.descriptor.encode());
  ASSERT_TRUE(decoded) << decoded.status().to_string();
  EXPECT_EQ(*decoded, dev->reg.descriptor);
  EXPECT_EQ(decoded->staged_region(), dev->reg.descriptor.staged_region());
}

TEST_P(Staged, RegisteringPastTheEndOfDeviceMemoryIsRejected) {
  auto m = FakeDeviceBuffer::create(8192);
  ASSERT_TRUE(m);
  auto r = a_->register_memory((*m)->device_ptr(), 8193);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.status().code(), ErrorCode::kOutOfRange) << r.status().to_string();
}

// Host to device, device to host, device to device: sizes around the staging chunk (1 MiB).
TEST_P(Staged, SingleWritesInEveryDirection) {
  const std::vector<uint64_t> sizes = {1, 4097, (uint64_t{1} << 20) + 13, (uint64_t{5} << 20) + 7};
  uint32_t imm = 300;
  for (int dir = 0; dir < 3; ++dir) {
    for (uint64_t n : sizes) {
      SCOPED_TRACE(::testing::Message() << "direction " << dir << ", " << n << " bytes");
      const bool src_dev = dir != 0, dst_dev = dir != 1;
      auto src_h = make_buffer(*a_, n + 3);
      auto dst_h = make_buffer(*b_, n + 5);
      auto src_d = make_device_buffer(*a_, n + 3);
      auto dst_d = make_device_buffer(*b_, n + 5);
      std::span<std::byte> src = src_dev ? src_d->bytes() : std::span<std::byte>(src_h->bytes);
      std::span<std::byte> dst = dst_dev ? dst_d->bytes() : std::span<std::byte>(dst_h->bytes);
      fill_pattern(src.data(), src.size(), n + static_cast<uint64_t>(dir));
      Probe arrived = expect_data(imm, src.subspan(3, n), dst.subspan(5, n));
      Probe done;
      const Registration& s = src_dev ? src_d->reg : src_h->reg;
      const Registration& d = dst_dev ? dst_d->reg : dst_h->reg;
      auto id = a_->submit(SingleWrite{s.handle, 3, d.descriptor, 5, n, imm, Routing::sharded()},
                           done.callbacks());
      ASSERT_TRUE(id) << id.status().to_string();
      ASSERT_TRUE(done.wait()) << done.wait().to_string();
      // Into device memory, the sender's completion already means the bytes are there (the
      // owner acknowledged its copy); into host memory, the immediate says so.
      if (dst_dev) {
        EXPECT_EQ(0, std::memcmp(src.data() + 3, dst.data() + 5, n));
      }
      Status landed = arrived.wait();
      ASSERT_TRUE(landed) << landed.to_string();
      EXPECT_EQ(0, std::memcmp(src.data() + 3, dst.data() + 5, n));
      EXPECT_EQ(b_->imm_count(imm), 1u);
      for (int i = 0; i < 5; ++i) EXPECT_EQ(dst[static_cast<size_t>(i)], std::byte{0});
      ++imm;
    }
  }
}

TEST_P(Staged, WriteWithoutImmediateIsInDeviceMemoryWhenDone) {
  constexpr uint64_t n = (uint64_t{3} << 20) + 1;
  auto src = make_buffer(*a_, n);
  auto dst = make_device_buffer(*b_, n);
  fill_pattern(src->bytes.data(), n, 42);
  Probe done;
  ASSERT_TRUE(a_->submit(SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, n, {}, {}},
                         done.callbacks()));
  ASSERT_TRUE(done.wait()) << done.wait().to_string();
  EXPECT_EQ(0, std::memcmp(src->bytes.data(), dst->bytes().data(), n));
}

// The KV-cache pattern between two GPUs: random pages with a stride, one immediate per page.
TEST_P(Staged, PagedWritesDeviceToDevice) {
  constexpr uint64_t kPage = 16384, kStride = kPage + 128;
  constexpr uint32_t kPages = 300;
  auto src = make_device_buffer(*a_, 64 + kPages * kStride);
  auto dst = make_device_buffer(*b_, 256 + kPages * kStride);
  fill_pattern(src->bytes().data(), src->bytes().size(), 7);
  std::vector<uint32_t> sp(kPages), dp(kPages);
  std::iota(sp.begin(), sp.end(), 0);
  std::iota(dp.begin(), dp.end(), 0);
  std::mt19937 rng(3);
  std::shuffle(sp.begin(), sp.end(), rng);
  std::shuffle(dp.begin(), dp.end(), rng);
  Probe arrived;
  ASSERT_TRUE(b_->expect_imm(77, kPages, [cb = arrived.callbacks()] { cb.on_done(); }));
  Probe done;
  PagedWrite pw{src->reg.handle, dst->reg.descriptor, kPage, sp, kStride, 64, dp, kStride, 256, 77};
  ASSERT_TRUE(a_->submit(pw, done.callbacks()));
  ASSERT_TRUE(done.wait()) << done.wait().to_string();
  ASSERT_TRUE(arrived.wait());
  EXPECT_EQ(b_->imm_count(77), kPages);
  for (uint32_t i = 0; i < kPages; ++i) {
    ASSERT_EQ(0, std::memcmp(src->bytes().data() + 64 + sp[i] * kStride,
                             dst->bytes().data() + 256 + dp[i] * kStride, kPage))
        << "page " << i;
  }
}

// Enough pages that the commit of their ranges needs several messages.
TEST_P(Staged, PagedWritesWithManyCommitMessages) {
  constexpr uint64_t kPage = 64, kStride = 128;
  constexpr uint32_t kPages = 10000;
  auto src = make_buffer(*a_, kPages * kStride);
  auto dst = make_device_buffer(*b_, kPages * kStride);
  fill_pattern(src->bytes.data(), src->bytes.size(), 9);
  std::vector<uint32_t> pages(kPages);
  std::iota(pages.begin(), pages.end(), 0);
  std::shuffle(pages.begin(), pages.end(), std::mt19937(5));
  Probe done;
  ASSERT_TRUE(a_->submit(PagedWrite{src->reg.handle, dst->reg.descriptor, kPage, pages, kStride, 0,
                                    pages, kStride, 0, 78},
                         done.callbacks()));
  ASSERT_TRUE(done.wait(60s)) << done.wait().to_string();
  ASSERT_TRUE(b_->wait_imm(78, kPages, 20s));
  EXPECT_EQ(b_->imm_count(78), kPages);
  for (uint32_t p = 0; p < kPages; ++p) {
    ASSERT_EQ(
        0, std::memcmp(src->bytes.data() + p * kStride, dst->bytes().data() + p * kStride, kPage))
        << "page " << p;
  }
}

TEST_P(Staged, ScatterFromDeviceToStagedAndHostPeers) {
  auto ec = TransferEngine::create(staged_config(GetParam()));
  ASSERT_TRUE(ec) << ec.status().to_string();
  std::unique_ptr<TransferEngine> c = std::move(*ec);
  constexpr uint64_t n = (uint64_t{2} << 20) + 999;
  auto src = make_device_buffer(*a_, 2 * n);
  fill_pattern(src->bytes().data(), 2 * n, 11);
  auto dst_b = make_device_buffer(*b_, n);
  auto dst_c = make_buffer(*c, n);
  auto group = a_->add_peer_group({b_->address(), c->address()});
  ASSERT_TRUE(group);
  for (auto sharding : {Scatter::Sharding::kByPeer, Scatter::Sharding::kByBytes}) {
    const uint32_t imm = sharding == Scatter::Sharding::kByPeer ? 501 : 502;
    Probe done;
    Scatter sc{src->reg.handle,
               *group,
               {ScatterTarget{dst_b->reg.descriptor, n, 0, 0},
                ScatterTarget{dst_c->reg.descriptor, n, n, 0}},
               imm,
               sharding};
    ASSERT_TRUE(a_->submit(sc, done.callbacks()));
    ASSERT_TRUE(done.wait()) << done.wait().to_string();
    EXPECT_TRUE(b_->wait_imm(imm, 1, 10s));
    EXPECT_TRUE(c->wait_imm(imm, 1, 10s));
    EXPECT_EQ(0, std::memcmp(src->bytes().data(), dst_b->bytes().data(), n));
    EXPECT_EQ(0, std::memcmp(src->bytes().data() + n, dst_c->bytes.data(), n));
    std::memset(dst_b->bytes().data(), 0, n);
    std::memset(dst_c->bytes.data(), 0, n);
  }
}

TEST_P(Staged, ShardedOverTwoNicsDeviceToDevice) {
  a_.reset();
  b_.reset();
  open(2);
  constexpr uint64_t n = (uint64_t{6} << 20) + 77;
  auto src = make_device_buffer(*a_, n);
  auto dst = make_device_buffer(*b_, n);
  fill_pattern(src->bytes().data(), n, 5);
  Probe arrived = expect_data(9, src->bytes(), dst->bytes());
  Probe done;
  ASSERT_TRUE(
      a_->submit(SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, n, 9, Routing::sharded()},
                 done.callbacks()));
  ASSERT_TRUE(done.wait()) << done.wait().to_string();
  ASSERT_TRUE(arrived.wait());
  EXPECT_EQ(b_->imm_count(9), 1u);
}

TEST_P(Staged, ManyConcurrentTransfersCountExactly) {
  constexpr uint64_t n = 200 * 1024;
  constexpr int kTransfers = 64;
  auto src = make_device_buffer(*a_, n * kTransfers);
  auto dst = make_device_buffer(*b_, n * kTransfers);
  fill_pattern(src->bytes().data(), n * kTransfers, 13);
  Counter counter;
  for (int i = 0; i < kTransfers; ++i) {
    const uint64_t off = n * static_cast<uint64_t>(i);
    ASSERT_TRUE(a_->submit(
        SingleWrite{src->reg.handle, off, dst->reg.descriptor, off, n, 60, Routing::sharded()},
        counter.callbacks()));
  }
  ASSERT_TRUE(counter.wait_total(kTransfers));
  EXPECT_EQ(counter.failed(), 0) << counter.first_error().to_string();
  ASSERT_TRUE(b_->wait_imm(60, kTransfers, 10s));
  EXPECT_EQ(b_->imm_count(60), static_cast<uint64_t>(kTransfers));
  EXPECT_EQ(0, std::memcmp(src->bytes().data(), dst->bytes().data(), n * kTransfers));
}

// A staged destination unregistered by its owner: the writer gets an error, and nothing is
// counted.
TEST_P(Staged, UnregisteredStagedDestinationFails) {
  auto src = make_buffer(*a_, 65536);
  auto dst = make_device_buffer(*b_, 65536);
  ASSERT_TRUE(b_->unregister_memory(dst->reg.handle));
  std::this_thread::sleep_for(50ms);  // the release happens on b's worker
  Probe done;
  ASSERT_TRUE(a_->submit(
      SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, 64, 31, Routing::sharded()},
      done.callbacks()));
  Status s = done.wait();
  EXPECT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), ErrorCode::kRemoteAccess) << s.to_string();
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(b_->imm_count(31), 0u);
}

// The reference leaves GPU memory registered on any worker but the main one when it is
// unregistered. Here device memory registered on a second group is released like any other:
// writes to it work until unregister_memory, and are refused after.
TEST_P(Staged, DeviceMemoryOnASecondGroupIsReleasedOnUnregister) {
  Config two = staged_config(GetParam());
  two.groups.push_back(two.groups[0]);
  auto made = TransferEngine::create(two);
  ASSERT_TRUE(made) << made.status().to_string();
  std::unique_ptr<TransferEngine> c = std::move(*made);
  auto m = FakeDeviceBuffer::create(65536);
  ASSERT_TRUE(m);
  auto reg = c->register_memory((*m)->device_ptr(), 65536, /*group=*/1);
  ASSERT_TRUE(reg) << reg.status().to_string();
  EXPECT_EQ(reg->descriptor.owner(), c->address(1));
  EXPECT_NE(reg->descriptor.staged_region(), 0u);
  auto src = make_buffer(*a_, 64);
  fill_pattern(src->bytes.data(), 64, 3);
  Probe before;
  ASSERT_TRUE(a_->submit(SingleWrite{src->reg.handle, 0, reg->descriptor, 0, 64, 41, {}},
                         before.callbacks()));
  ASSERT_TRUE(before.wait()) << before.wait().to_string();
  EXPECT_EQ(0, std::memcmp((*m)->contents().data(), src->bytes.data(), 64));
  ASSERT_TRUE(c->unregister_memory(reg->handle));
  std::this_thread::sleep_for(50ms);  // the release happens on group 1's worker
  Probe after;
  ASSERT_TRUE(a_->submit(SingleWrite{src->reg.handle, 0, reg->descriptor, 0, 64, 42, {}},
                         after.callbacks()));
  Status s = after.wait();
  EXPECT_EQ(s.code(), ErrorCode::kRemoteAccess) << s.to_string();
  EXPECT_EQ(c->imm_count(42), 0u);
}

INSTANTIATE_TEST_SUITE_P(AllBackends, Staged, ::testing::ValuesIn(all_backends()), backend_name);

}  // namespace
}  // namespace fabric::testing
