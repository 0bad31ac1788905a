// Conformance of the CUDA IPC path (docs/cuda-ipc.md) on the GPU-memory test double
// (FakeDeviceBuffer, fabric/testing.h): two engines of this process, over every backend, with
// Config::cuda_ipc at its default. The double's device addresses fault on any direct access, so a
// byte that did not move by the owner's device-to-device copy would crash the test. The same
// path with CUDA memory between two processes runs in tests/gpu/cuda_ipc_cuda_test.cc.
#include <numeric>
#include <random>

#include "fabric/testing.h"
#include "test_support.h"

namespace fabric::testing {
namespace {

class CudaIpcPath : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    auto ea = TransferEngine::create(make_config(GetParam()));
    if (!ea && ea.status().code() == ErrorCode::kUnsupported) {
      GTEST_SKIP() << "provider not available: " << ea.status().to_string();
    }
    ASSERT_TRUE(ea) << ea.status().to_string();
    auto eb = TransferEngine::create(make_config(GetParam()));
    ASSERT_TRUE(eb) << eb.status().to_string();
    a_ = std::move(*ea);
    b_ = std::move(*eb);
  }

  // Expects `imm` `count` times at b, checking at that moment that `want` is already in `got`.
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
  uint64_t ipc_transfers() const { return a_->stats().groups[0].cuda_ipc_transfers; }

  std::unique_ptr<TransferEngine> a_;
  std::unique_ptr<TransferEngine> b_;
};

TEST_P(CudaIpcPath, DeviceDescriptorsCarryTheSectionAndTheModeIsShown) {
  auto host = make_buffer(*b_, 4096);
  auto dev = make_device_buffer(*b_, 4096);
  EXPECT_FALSE(host->reg.descriptor.cuda_ipc());
  ASSERT_TRUE(dev->reg.descriptor.cuda_ipc());
  EXPECT_NE(dev->reg.descriptor.cuda_ipc()->region, 0u);
  auto back = RemoteMemory::decode(dev->reg.descriptor.encode());
  ASSERT_TRUE(back) << back.status().to_string();
  EXPECT_EQ(*back, dev->reg.descriptor);
  EXPECT_EQ(a_->group_info().cuda_ipc, "auto");
}

// Device to device: every size goes over the path (counted in stats), the immediate after the
// bytes; device to host and host to device keep the fabric.
TEST_P(CudaIpcPath, SingleWritesBetweenDevicesTakeThePath) {
  const std::vector<uint64_t> sizes = {1, 4097, (uint64_t{1} << 20) + 13, (uint64_t{5} << 20) + 7};
  uint32_t imm = 500;
  for (uint64_t n : sizes) {
    SCOPED_TRACE(::testing::Message() << n << " bytes");
    auto src = make_device_buffer(*a_, n + 3);
    auto dst = make_device_buffer(*b_, n + 5);
    fill_pattern(src->bytes().data(), n + 3, n);
    Probe arrived = expect_data(imm, src->bytes().subspan(3, n), dst->bytes().subspan(5, n));
    const uint64_t before = ipc_transfers();
    Probe done;
    ASSERT_TRUE(a_->submit(
        SingleWrite{src->reg.handle, 3, dst->reg.descriptor, 5, n, imm, Routing::sharded()},
        done.callbacks()));
    ASSERT_TRUE(done.wait()) << done.wait().to_string();
    EXPECT_EQ(0, std::memcmp(src->bytes().data() + 3, dst->bytes().data() + 5, n));
    Status landed = arrived.wait();
    ASSERT_TRUE(landed) << landed.to_string();
    EXPECT_EQ(ipc_transfers(), before + 1);
    ++imm;
  }
  EXPECT_EQ(a_->stats().groups[0].cuda_ipc_bytes,
            std::accumulate(sizes.begin(), sizes.end(), uint64_t{0}));
  // Host memory on either side: the fabric (staged at the device end).
  auto src_h = make_buffer(*a_, 8192);
  auto dst_d = make_device_buffer(*b_, 8192);
  fill_pattern(src_h->bytes.data(), 8192, 77);
  const uint64_t before = ipc_transfers();
  Probe host_to_dev;
  ASSERT_TRUE(a_->submit(SingleWrite{src_h->reg.handle, 0, dst_d->reg.descriptor, 0, 8192, {}, {}},
                         host_to_dev.callbacks()));
  ASSERT_TRUE(host_to_dev.wait());
  EXPECT_EQ(0, std::memcmp(src_h->bytes.data(), dst_d->bytes().data(), 8192));
  EXPECT_EQ(ipc_transfers(), before);
}

// Pages in a random order, one arrival per page, all counted only once every page is in place;
// 20 000 scattered pages need several Commits and an immediate that follows them.
TEST_P(CudaIpcPath, PagedWritesCountOnePerPage) {
  for (const auto& [page, pages] :
       std::vector<std::pair<uint64_t, uint32_t>>{{4096, 512}, {64, 20000}}) {
    SCOPED_TRACE(::testing::Message() << pages << " pages of " << page);
    const uint64_t n = page * pages;
    auto src = make_device_buffer(*a_, n);
    auto dst = make_device_buffer(*b_, n);
    fill_pattern(src->bytes().data(), n, page);
    std::vector<uint32_t> src_pages(pages), dst_pages(pages);
    std::iota(src_pages.begin(), src_pages.end(), 0);
    std::shuffle(src_pages.begin(), src_pages.end(), std::mt19937(7));
    std::iota(dst_pages.begin(), dst_pages.end(), 0);
    std::shuffle(dst_pages.begin(), dst_pages.end(), std::mt19937(8));
    std::vector<std::byte> want(n);
    for (uint32_t i = 0; i < pages; ++i) {
      std::memcpy(want.data() + dst_pages[i] * page, src->bytes().data() + src_pages[i] * page,
                  page);
    }
    const uint32_t imm = 600 + pages;
    Probe arrived = expect_data(imm, want, dst->bytes(), pages);
    Probe done;
    ASSERT_TRUE(a_->submit(PagedWrite{src->reg.handle, dst->reg.descriptor, page, src_pages, page,
                                      0, dst_pages, page, 0, imm},
                           done.callbacks()));
    ASSERT_TRUE(done.wait(60s)) << done.wait().to_string();
    Status landed = arrived.wait(60s);
    ASSERT_TRUE(landed) << landed.to_string();
    EXPECT_EQ(b_->imm_count(imm), pages);
  }
}

// One scatter to a device destination (the path) and a host destination (the fabric) of two
// peers: each gets its bytes and its immediate.
TEST_P(CudaIpcPath, ScatterMixesThePathAndTheFabric) {
  auto ec = TransferEngine::create(make_config(GetParam()));
  ASSERT_TRUE(ec) << ec.status().to_string();
  std::unique_ptr<TransferEngine> c = std::move(*ec);
  auto src = make_device_buffer(*a_, 1 << 20);
  fill_pattern(src->bytes().data(), 1 << 20, 5);
  auto dev = make_device_buffer(*b_, 1 << 20);
  auto host = make_buffer(*c, 1 << 20);
  auto group = a_->add_peer_group({b_->address(), c->address()});
  ASSERT_TRUE(group);
  Probe done;
  ASSERT_TRUE(a_->submit(
      Scatter{src->reg.handle,
              *group,
              {{dev->reg.descriptor, 300000, 0, 100}, {host->reg.descriptor, 400000, 300000, 7}},
              71,
              Scatter::Sharding::kByBytes},
      done.callbacks()));
  ASSERT_TRUE(done.wait()) << done.wait().to_string();
  EXPECT_TRUE(b_->wait_imm(71, 1, 20s));
  EXPECT_TRUE(c->wait_imm(71, 1, 20s));
  EXPECT_EQ(0, std::memcmp(dev->bytes().data() + 100, src->bytes().data(), 300000));
  EXPECT_EQ(0, std::memcmp(host->bytes.data() + 7, src->bytes().data() + 300000, 400000));
  EXPECT_EQ(ipc_transfers(), 1u);
}

// A scatter's targets in a row into one region (the parameters of a weight push, the pages of
// a layer) go as one Commit per run, whatever their count, and still count one immediate each;
// targets adjacent on both sides become one copy at the owner.
TEST_P(CudaIpcPath, ScatterTargetsInARowIntoOneRegionGoAsOneCommit) {
  constexpr uint64_t kPiece = 4096;
  auto src = make_device_buffer(*a_, 128 * kPiece);
  fill_pattern(src->bytes().data(), 128 * kPiece, 9);
  auto one = make_device_buffer(*b_, 256 * kPiece);
  auto other = make_device_buffer(*b_, 16 * kPiece);
  std::vector<ScatterTarget> targets;
  // 64 adjacent pieces into `one`, 8 into `other`, 16 into `one` again with gaps between them.
  for (uint64_t k = 0; k < 64; ++k) {
    targets.push_back({one->reg.descriptor, kPiece, k * kPiece, 100 + k * kPiece});
  }
  for (uint64_t k = 0; k < 8; ++k) {
    targets.push_back({other->reg.descriptor, kPiece, (64 + k) * kPiece, k * kPiece});
  }
  for (uint64_t k = 0; k < 16; ++k) {
    targets.push_back({one->reg.descriptor, kPiece, (72 + k) * kPiece, (100 + 2 * k) * kPiece});
  }
  auto group = a_->add_peer_group({b_->address()});
  ASSERT_TRUE(group);
  const uint64_t posted_before = a_->stats().groups[0].nics[0].work_requests_posted;
  Probe done;
  ASSERT_TRUE(a_->submit(Scatter{src->reg.handle, *group, targets, 73}, done.callbacks()));
  ASSERT_TRUE(done.wait()) << done.wait().to_string();
  EXPECT_TRUE(b_->wait_imm(73, targets.size(), 20s));
  for (const ScatterTarget& t : targets) {
    const auto& dst = t.dst == one->reg.descriptor ? one : other;
    EXPECT_EQ(0, std::memcmp(dst->bytes().data() + t.dst_offset, src->bytes().data() + t.src_offset,
                             kPiece))
        << "the piece from " << t.src_offset;
  }
  // Three runs: three Commits (one message each, the writer's only work requests), not one per
  // target (88).
  const uint64_t commits = a_->stats().groups[0].nics[0].work_requests_posted - posted_before;
  EXPECT_LE(commits, 3u);
  EXPECT_GE(commits, 1u);
  EXPECT_EQ(ipc_transfers(), 1u);
}

// Imm-only and barrier carry no GPU bytes: they keep the fabric, and work beside the path.
TEST_P(CudaIpcPath, ImmOnlyAndBarrierBesideThePath) {
  auto group = a_->add_peer_group({b_->address()});
  ASSERT_TRUE(group);
  Counter c;
  ASSERT_TRUE(a_->submit(ImmWrite{b_->address(), 81, 0, 0}, c.callbacks()));
  ASSERT_TRUE(a_->submit(Barrier{*group, 82, 0, 0}, c.callbacks()));
  ASSERT_TRUE(c.wait_total(2));
  EXPECT_EQ(c.done(), 2);
  EXPECT_TRUE(b_->wait_imm(81, 1, 20s));
  EXPECT_TRUE(b_->wait_imm(82, 1, 20s));
}

// Unregister on the owner's side: a later write fails alone with a clear error, nothing lands
// and nothing is counted; the writer's next write to a live region works.
TEST_P(CudaIpcPath, AWriteToAnUnregisteredRegionFailsClearly) {
  auto src = make_device_buffer(*a_, 65536);
  fill_pattern(src->bytes().data(), 65536, 9);
  auto dst = make_device_buffer(*b_, 65536);
  Probe first;
  ASSERT_TRUE(a_->submit(SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, 4096, 90, {}},
                         first.callbacks()));
  ASSERT_TRUE(first.wait());  // the owner has the writer's allocation mapped now
  ASSERT_TRUE(b_->unregister_memory(dst->reg.handle));
  std::fill(dst->bytes().begin(), dst->bytes().end(), std::byte{0});
  Probe after;
  ASSERT_TRUE(a_->submit(SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, 65536, 91, {}},
                         after.callbacks()));
  Status s = after.wait();
  EXPECT_EQ(s.code(), ErrorCode::kRemoteAccess) << s.to_string();
  EXPECT_NE(s.message().find("unregistered"), std::string::npos) << s.to_string();
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(b_->imm_count(91), 0u);
  EXPECT_TRUE(std::all_of(dst->bytes().begin(), dst->bytes().end(),
                          [](std::byte b) { return b == std::byte{0}; }));
  auto live = make_device_buffer(*b_, 4096);
  Probe ok;
  ASSERT_TRUE(a_->submit(SingleWrite{src->reg.handle, 0, live->reg.descriptor, 0, 4096, 92, {}},
                         ok.callbacks()));
  EXPECT_TRUE(ok.wait());
}

// unregister_memory is a barrier while writes stream in: once it returns, no byte of the region
// changes any more, however many writes were in flight.
TEST_P(CudaIpcPath, UnregisterIsABarrierUnderLoad) {
  constexpr uint64_t kBytes = 256 * 1024;
  auto src = make_device_buffer(*a_, kBytes);
  fill_pattern(src->bytes().data(), kBytes, 11);
  auto dst = make_device_buffer(*b_, kBytes);
  Counter c;
  constexpr int kWrites = 300;
  for (int i = 0; i < kWrites; ++i) {
    ASSERT_TRUE(a_->submit(SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, kBytes, 93, {}},
                           c.callbacks()));
    if (i == kWrites / 3) {
      ASSERT_TRUE(b_->unregister_memory(dst->reg.handle));
    }
  }
  // After unregister returned: wipe, then let every write finish; none may land.
  std::fill(dst->bytes().begin(), dst->bytes().end(), std::byte{0});
  ASSERT_TRUE(c.wait_total(kWrites, 60s));
  EXPECT_GT(c.failed(), 0);
  EXPECT_EQ(c.first_error().code(), ErrorCode::kRemoteAccess) << c.first_error().to_string();
  EXPECT_TRUE(std::all_of(dst->bytes().begin(), dst->bytes().end(),
                          [](std::byte b) { return b == std::byte{0}; }));
  EXPECT_EQ(b_->imm_count(93), static_cast<uint64_t>(c.done()));
}

// The Config override: off keeps device-to-device writes on the fabric (staged); on rejects a
// write that cannot take the path, naming why, and posts nothing.
TEST_P(CudaIpcPath, TheOverrideForcesEitherWay) {
  Config off = make_config(GetParam());
  off.cuda_ipc = Config::CudaIpc::kOff;
  auto eo = TransferEngine::create(off);
  ASSERT_TRUE(eo) << eo.status().to_string();
  auto src = make_device_buffer(**eo, 8192);
  fill_pattern(src->bytes().data(), 8192, 3);
  EXPECT_FALSE(src->reg.descriptor.cuda_ipc());  // nothing exported when off
  auto dst = make_device_buffer(*b_, 8192);
  Probe staged;
  ASSERT_TRUE((*eo)->submit(SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, 8192, 94, {}},
                            staged.callbacks()));
  ASSERT_TRUE(staged.wait()) << staged.wait().to_string();
  EXPECT_EQ(0, std::memcmp(src->bytes().data(), dst->bytes().data(), 8192));
  EXPECT_EQ((*eo)->stats().groups[0].cuda_ipc_transfers, 0u);
  EXPECT_EQ((*eo)->group_info().cuda_ipc, "off");

  Config on = make_config(GetParam());
  on.cuda_ipc = Config::CudaIpc::kOn;
  auto en = TransferEngine::create(on);
  ASSERT_TRUE(en) << en.status().to_string();
  auto host_src = make_buffer(**en, 8192);
  Probe never;
  auto rejected =
      (*en)->submit(SingleWrite{host_src->reg.handle, 0, dst->reg.descriptor, 0, 8192, 95, {}},
                    never.callbacks());
  ASSERT_FALSE(rejected);
  EXPECT_EQ(rejected.status().code(), ErrorCode::kUnsupported);
  EXPECT_NE(rejected.status().message().find("host memory"), std::string::npos)
      << rejected.status().to_string();
  EXPECT_EQ(never.calls(), 0);
}

// RegisterOptions::gpu_copies: host memory that the owner's GPU copy engines fill from a
// same-host writer's GPU memory (the double's copier here, under FakeCopyEngines, which copies
// only once the fence completes, so an immediate counted early would see the bytes missing).
// GPU sources take the path; host sources, and writes from that memory, keep the fabric.
TEST_P(CudaIpcPath, HostMemoryRegisteredForGpuCopiesIsFilledByTheOwnersGpu) {
  FakeCopyEngines copy_engines;
  constexpr uint64_t n = (uint64_t{1} << 20) + 4096 * 8;
  std::vector<std::byte> host(n);
  auto reg = b_->register_memory(host.data(), n, RegisterOptions{.gpu_copies = true});
  ASSERT_TRUE(reg) << reg.status().to_string();
  const RemoteMemory& dst = reg->descriptor;
  ASSERT_TRUE(dst.cuda_ipc());
  EXPECT_TRUE(dst.cuda_ipc()->host);
  EXPECT_FALSE(dst.rails().empty());
  auto back = RemoteMemory::decode(dst.encode());
  ASSERT_TRUE(back) << back.status().to_string();
  EXPECT_EQ(*back, dst);

  auto src = make_device_buffer(*a_, n);
  fill_pattern(src->bytes().data(), n, 31);
  uint32_t imm = 700;
  for (uint64_t len : {uint64_t{1}, uint64_t{4097}, (uint64_t{1} << 20) + 13}) {
    SCOPED_TRACE(::testing::Message() << len << " bytes");
    std::fill(host.begin(), host.end(), std::byte{0});
    Probe arrived = expect_data(imm, src->bytes().subspan(7, len), std::span(host).subspan(3, len));
    const uint64_t before = ipc_transfers();
    Probe done;
    ASSERT_TRUE(
        a_->submit(SingleWrite{src->reg.handle, 7, dst, 3, len, imm, {}}, done.callbacks()));
    ASSERT_TRUE(done.wait()) << done.wait().to_string();
    Status landed = arrived.wait();
    ASSERT_TRUE(landed) << landed.to_string();
    EXPECT_EQ(0, std::memcmp(host.data() + 3, src->bytes().data() + 7, len));
    EXPECT_EQ(host[2], std::byte{0});
    EXPECT_EQ(host[3 + len], std::byte{0}) << "written past the range";
    EXPECT_EQ(ipc_transfers(), before + 1);
    ++imm;
  }
  // Pages in a shuffled order, one arrival each.
  std::vector<uint32_t> src_pages(64), dst_pages(64);
  std::iota(src_pages.begin(), src_pages.end(), 0u);
  std::iota(dst_pages.begin(), dst_pages.end(), 0u);
  std::shuffle(dst_pages.begin(), dst_pages.end(), std::mt19937(5));
  Probe paged;
  ASSERT_TRUE(a_->submit(
      PagedWrite{src->reg.handle, dst, 4096, src_pages, 4096, 0, dst_pages, 4096, 0, imm},
      paged.callbacks()));
  ASSERT_TRUE(paged.wait()) << paged.wait().to_string();
  EXPECT_TRUE(b_->wait_imm(imm, 64, 20s));
  for (size_t i = 0; i < src_pages.size(); ++i) {
    ASSERT_EQ(0, std::memcmp(host.data() + dst_pages[i] * 4096,
                             src->bytes().data() + src_pages[i] * 4096, 4096))
        << "page " << i;
  }
  // Host memory into it, and from it: the fabric.
  auto host_src = make_buffer(*a_, 8192);
  fill_pattern(host_src->bytes.data(), 8192, 32);
  const uint64_t before = ipc_transfers();
  Probe from_host;
  ASSERT_TRUE(a_->submit(SingleWrite{host_src->reg.handle, 0, dst, 100, 8192, {}, {}},
                         from_host.callbacks()));
  ASSERT_TRUE(from_host.wait()) << from_host.wait().to_string();
  EXPECT_EQ(0, std::memcmp(host.data() + 100, host_src->bytes.data(), 8192));
  auto host_dst = make_buffer(*a_, 8192);
  Probe from_it;
  ASSERT_TRUE(b_->submit(SingleWrite{reg->handle, 100, host_dst->reg.descriptor, 0, 8192, {}, {}},
                         from_it.callbacks()));
  ASSERT_TRUE(from_it.wait()) << from_it.wait().to_string();
  EXPECT_EQ(0, std::memcmp(host_dst->bytes.data(), host_src->bytes.data(), 8192));
  EXPECT_EQ(ipc_transfers(), before);

  // Unregistered: a write over the path fails at the owner, and no byte lands.
  ASSERT_TRUE(b_->unregister_memory(reg->handle));
  std::fill(host.begin(), host.end(), std::byte{0});
  Probe late;
  ASSERT_TRUE(
      a_->submit(SingleWrite{src->reg.handle, 0, dst, 0, 65536, imm + 1, {}}, late.callbacks()));
  Status failed = late.wait();
  EXPECT_EQ(failed.code(), ErrorCode::kRemoteAccess) << failed.to_string();
  EXPECT_EQ(b_->imm_count(imm + 1), 0u);
  EXPECT_TRUE(std::all_of(host.begin(), host.end(), [](std::byte b) { return b == std::byte{0}; }));
}

// RegisterOptions::gpu_copies where it cannot work: each refusal names what is wrong, and
// leaves nothing registered.
TEST_P(CudaIpcPath, GpuCopiesIsRefusedWhereItCannotWork) {
  std::vector<std::byte> host(4096);
  auto dev = FakeDeviceBuffer::create(4096);
  ASSERT_TRUE(dev) << dev.status().to_string();
  {
    FakeCopyEngines copy_engines;
    auto on_device =
        b_->register_memory((*dev)->device_ptr(), 4096, RegisterOptions{.gpu_copies = true});
    ASSERT_FALSE(on_device);
    EXPECT_EQ(on_device.status().code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(on_device.status().message().find("gpu_copies is for host memory"), std::string::npos)
        << on_device.status().to_string();
    Config off = make_config(GetParam());
    off.cuda_ipc = Config::CudaIpc::kOff;
    auto eo = TransferEngine::create(off);
    ASSERT_TRUE(eo) << eo.status().to_string();
    auto path_off = (*eo)->register_memory(host.data(), 4096, RegisterOptions{.gpu_copies = true});
    ASSERT_FALSE(path_off);
    EXPECT_EQ(path_off.status().code(), ErrorCode::kUnsupported);
    EXPECT_NE(path_off.status().message().find("Config::cuda_ipc is off"), std::string::npos)
        << path_off.status().to_string();
  }
  if (!b_->group_info().cuda) {  // no GPU and no double: nothing could copy into it
    auto none = b_->register_memory(host.data(), 4096, RegisterOptions{.gpu_copies = true});
    ASSERT_FALSE(none);
    EXPECT_EQ(none.status().code(), ErrorCode::kUnsupported);
    // "no CUDA device in this process", or in a build without CUDA (the sanitizer builds) that.
    const std::string why = none.status().message();
    EXPECT_TRUE(why.find("no CUDA device") != std::string::npos ||
                why.find("built without CUDA") != std::string::npos)
        << none.status().to_string();
  }
  // The same memory registers plainly afterwards (nothing was left behind).
  auto plain = b_->register_memory(host.data(), 4096);
  ASSERT_TRUE(plain) << plain.status().to_string();
  EXPECT_FALSE(plain->descriptor.cuda_ipc());
}

// RegisterOptions::host_mirror false: no pinned mirror is allocated (the stats' gauge shows
// it), the descriptor has no rails, and the path is the only way in and out: writes it can
// carry arrive (single, paged, a scatter beside a fabric target), the others are refused at
// submit naming the side without a mirror and why, and nothing is posted for them.
TEST_P(CudaIpcPath, WithoutAHostMirrorOnlyThePathReachesTheMemory) {
  constexpr uint64_t n = 1 << 20;
  auto mirror_bytes = [](TransferEngine& e) { return e.stats().groups[0].host_mirror_bytes; };
  auto mirrored = make_device_buffer(*b_, n);
  EXPECT_EQ(mirror_bytes(*b_), n);
  auto dst = make_device_buffer(*b_, n, RegisterOptions{.host_mirror = false});
  EXPECT_EQ(mirror_bytes(*b_), n) << "a mirror was allocated all the same";
  EXPECT_TRUE(dst->reg.descriptor.ipc_only());
  EXPECT_TRUE(dst->reg.descriptor.rails().empty());
  auto decoded = RemoteMemory::decode(dst->reg.descriptor.encode());
  ASSERT_TRUE(decoded) << decoded.status().to_string();
  EXPECT_EQ(*decoded, dst->reg.descriptor);
  auto src = make_device_buffer(*a_, n, RegisterOptions{.host_mirror = false});
  EXPECT_EQ(mirror_bytes(*a_), 0u);
  fill_pattern(src->bytes().data(), n, 21);

  // Single and paged writes, mirror-less on both ends.
  Probe arrived = expect_data(100, src->bytes().subspan(0, 65536), dst->bytes().subspan(8, 65536));
  Probe single;
  ASSERT_TRUE(a_->submit(SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 8, 65536, 100, {}},
                         single.callbacks()));
  ASSERT_TRUE(single.wait()) << single.wait().to_string();
  ASSERT_TRUE(arrived.wait());
  const std::vector<uint32_t> src_pages = {3, 0, 7}, dst_pages = {10, 11, 2};
  Probe paged;
  ASSERT_TRUE(a_->submit(PagedWrite{src->reg.handle, dst->reg.descriptor, 4096, src_pages, 4096, 0,
                                    dst_pages, 4096, 0, 101},
                         paged.callbacks()));
  ASSERT_TRUE(paged.wait()) << paged.wait().to_string();
  EXPECT_TRUE(b_->wait_imm(101, 3, 20s));
  for (size_t i = 0; i < src_pages.size(); ++i) {
    EXPECT_EQ(0, std::memcmp(dst->bytes().data() + dst_pages[i] * 4096,
                             src->bytes().data() + src_pages[i] * 4096, 4096))
        << "page " << i;
  }

  // A scatter from a mirrored source to the mirror-less memory (the path) and to host memory
  // (the fabric).
  auto ec = TransferEngine::create(make_config(GetParam()));
  ASSERT_TRUE(ec) << ec.status().to_string();
  std::unique_ptr<TransferEngine> c = std::move(*ec);
  auto host = make_buffer(*c, n);
  auto msrc = make_device_buffer(*a_, n);
  fill_pattern(msrc->bytes().data(), n, 22);
  auto group = a_->add_peer_group({b_->address(), c->address()});
  ASSERT_TRUE(group);
  Probe scattered;
  ASSERT_TRUE(
      a_->submit(Scatter{msrc->reg.handle,
                         *group,
                         {{dst->reg.descriptor, 5000, 0, 0}, {host->reg.descriptor, 6000, 5000, 0}},
                         102,
                         Scatter::Sharding::kByBytes},
                 scattered.callbacks()));
  ASSERT_TRUE(scattered.wait()) << scattered.wait().to_string();
  EXPECT_TRUE(c->wait_imm(102, 1, 20s));
  EXPECT_TRUE(b_->wait_imm(102, 1, 20s));
  EXPECT_EQ(0, std::memcmp(dst->bytes().data(), msrc->bytes().data(), 5000));
  EXPECT_EQ(0, std::memcmp(host->bytes.data(), msrc->bytes().data() + 5000, 6000));

  // What needs the fabric is refused at submit: host memory into the mirror-less destination,
  // the mirror-less source into host memory (also in a scatter), and a peer with the path off.
  auto host_src = make_buffer(*a_, n);
  Config off = make_config(GetParam());
  off.cuda_ipc = Config::CudaIpc::kOff;
  auto eo = TransferEngine::create(off);
  ASSERT_TRUE(eo) << eo.status().to_string();
  auto off_src = make_device_buffer(**eo, n);
  Probe never;
  struct Refused {
    const char* name;
    Result<TransferId> got;
    const char* why;
  };
  const Refused refused[] = {
      {"host source",
       a_->submit(SingleWrite{host_src->reg.handle, 0, dst->reg.descriptor, 0, 4096, 103, {}},
                  never.callbacks()),
       "the destination was registered without a host mirror"},
      {"host destination",
       a_->submit(SingleWrite{src->reg.handle, 0, host->reg.descriptor, 0, 4096, 103, {}},
                  never.callbacks()),
       "the source was registered without a host mirror"},
      {"scatter",
       a_->submit(Scatter{src->reg.handle,
                          *group,
                          {{dst->reg.descriptor, 10, 0, 0}, {host->reg.descriptor, 10, 0, 0}},
                          103},
                  never.callbacks()),
       "scatter target 1: the source was registered without a host mirror"},
      {"path off at the writer",
       (*eo)->submit(SingleWrite{off_src->reg.handle, 0, dst->reg.descriptor, 0, 4096, 103, {}},
                     never.callbacks()),
       "CUDA IPC is off"},
  };
  for (const Refused& r : refused) {
    SCOPED_TRACE(r.name);
    ASSERT_FALSE(r.got);
    EXPECT_EQ(r.got.status().code(), ErrorCode::kUnsupported);
    EXPECT_NE(r.got.status().message().find(r.why), std::string::npos)
        << r.got.status().to_string();
  }
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(never.calls(), 0);
  EXPECT_EQ(b_->imm_count(103), 0u);
  EXPECT_EQ(c->imm_count(103), 0u);

  // Registering without a mirror where the path is off is refused, naming why; host memory
  // ignores the option.
  auto fake = FakeDeviceBuffer::create(4096);
  ASSERT_TRUE(fake);
  auto no_way =
      (*eo)->register_memory((*fake)->device_ptr(), 4096, RegisterOptions{.host_mirror = false});
  ASSERT_FALSE(no_way);
  EXPECT_EQ(no_way.status().code(), ErrorCode::kUnsupported);
  EXPECT_NE(no_way.status().message().find("Config::cuda_ipc is off"), std::string::npos)
      << no_way.status().to_string();
  std::vector<std::byte> plain(4096);
  auto host_reg =
      a_->register_memory(plain.data(), plain.size(), RegisterOptions{.host_mirror = false});
  ASSERT_TRUE(host_reg) << host_reg.status().to_string();
  EXPECT_FALSE(host_reg->descriptor.ipc_only());
  EXPECT_EQ(host_reg->descriptor.rails().size(), a_->address().num_nics());

  // Unregistering gives the mirror back; the mirror-less registration had none to give.
  ASSERT_TRUE(b_->unregister_memory(mirrored->reg.handle));
  EXPECT_EQ(mirror_bytes(*b_), 0u);
  ASSERT_TRUE(b_->unregister_memory(dst->reg.handle));
  EXPECT_EQ(mirror_bytes(*b_), 0u);
}

INSTANTIATE_TEST_SUITE_P(AllBackends, CudaIpcPath, ::testing::ValuesIn(all_backends()),
                         backend_name);

}  // namespace
}  // namespace fabric::testing
