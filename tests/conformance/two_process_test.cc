// Conformance across processes: this process and a fabric_test_peer process exchange
// addresses and descriptors through a pipe, then write into each other's memory.
#include <numeric>
#include <random>
#include <sstream>

#include "peer_process.h"
#include "test_support.h"

namespace fabric::testing {
namespace {

class TwoProcess : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    auto e = TransferEngine::create(make_config(GetParam()));
    if (!e && e.status().code() == ErrorCode::kUnsupported) {
      GTEST_SKIP() << "provider not available: " << e.status().to_string();
    }
    ASSERT_TRUE(e) << e.status().to_string();
    engine_ = std::move(*e);
    ASSERT_TRUE(peer_.start(GetParam(), kPeerBytes));
    auto addr = Address::from_hex(peer_.read_value("address"));
    ASSERT_TRUE(addr) << addr.status().to_string();
    peer_address_ = *addr;
    auto mem_bytes = from_hex(peer_.read_value("memory"));
    ASSERT_TRUE(mem_bytes);
    auto mem = RemoteMemory::decode(*mem_bytes);
    ASSERT_TRUE(mem) << mem.status().to_string();
    peer_memory_ = *mem;
    ASSERT_EQ(peer_.read_line(), "ready");
  }

  static constexpr uint64_t kPeerBytes = 64 << 20;
  std::unique_ptr<TransferEngine> engine_;
  PeerProcess peer_;
  Address peer_address_;
  RemoteMemory peer_memory_;
};

TEST_P(TwoProcess, SingleAndPagedWritesLandInThePeer) {
  auto src = make_buffer(*engine_, kPeerBytes);
  fill_pattern(src->bytes.data(), kPeerBytes, 21);
  // One 40 MiB single write, sharded as the engine likes.
  const uint64_t big = 40 << 20;
  Probe done;
  ASSERT_TRUE(engine_->submit(SingleWrite{src->reg.handle, 0, peer_memory_, 0, big, 1, {}},
                              done.callbacks()));
  ASSERT_TRUE(done.wait());
  peer_.send("expect 1 1");
  EXPECT_EQ(peer_.read_line(), "got 1 1");
  peer_.send("checksum 0 " + std::to_string(big));
  EXPECT_EQ(peer_.read_value("checksum"), std::to_string(fnv1a(src->bytes.data(), big)));

  // 512 pages of 16 KiB in a random order into the region above it.
  constexpr uint64_t kPage = 16384;
  constexpr uint32_t kPages = 512;
  std::vector<uint32_t> pages(kPages);
  std::iota(pages.begin(), pages.end(), 0);
  std::shuffle(pages.begin(), pages.end(), std::mt19937(3));
  Probe paged;
  ASSERT_TRUE(engine_->submit(
      PagedWrite{src->reg.handle, peer_memory_, kPage, pages, kPage, 0, pages, kPage, big, 2},
      paged.callbacks()));
  ASSERT_TRUE(paged.wait());
  peer_.send("expect 2 " + std::to_string(kPages));
  EXPECT_EQ(peer_.read_line(), "got 2 " + std::to_string(kPages));
  peer_.send("checksum " + std::to_string(big) + " " + std::to_string(kPages * kPage));
  EXPECT_EQ(peer_.read_value("checksum"), std::to_string(fnv1a(src->bytes.data(), kPages * kPage)));
}

TEST_P(TwoProcess, PeerWritesIntoThisProcess) {
  auto dst = make_buffer(*engine_, 8 << 20);
  peer_.send("fill 77");
  ASSERT_EQ(peer_.read_line(), "filled");
  peer_.send("write " + to_hex(dst->reg.descriptor.encode()) + " 100 200 " +
             std::to_string(5 << 20) + " 31");
  ASSERT_EQ(peer_.read_line(), "done");
  ASSERT_TRUE(engine_->wait_imm(31, 1, 20s));
  std::vector<std::byte> expected(kPeerBytes);
  fill_pattern(expected.data(), kPeerBytes, 77);
  EXPECT_EQ(0, std::memcmp(dst->bytes.data() + 200, expected.data() + 100, 5 << 20));
}

TEST_P(TwoProcess, ImmediatesAndBarrierAcrossProcesses) {
  auto group = engine_->add_peer_group({peer_address_});
  ASSERT_TRUE(group);
  Counter c;
  for (int i = 0; i < 50; ++i) {
    ASSERT_TRUE(engine_->submit(ImmWrite{peer_address_, 60, 0, 0}, c.callbacks()));
  }
  ASSERT_TRUE(engine_->submit(Barrier{*group, 61, 0, 0}, c.callbacks()));
  ASSERT_TRUE(c.wait_total(51));
  EXPECT_EQ(c.done(), 51);
  peer_.send("expect 60 50");
  EXPECT_EQ(peer_.read_line(), "got 60 50");
  peer_.send("expect 61 1");
  EXPECT_EQ(peer_.read_line(), "got 61 1");
}

TEST_P(TwoProcess, PeerKilledMidTransferFailsItsTransfersOnly) {
  auto src = make_buffer(*engine_, 4 << 20);
  Counter c;
  constexpr int kWrites = 200;
  for (int i = 0; i < kWrites; ++i) {
    ASSERT_TRUE(engine_->submit(SingleWrite{src->reg.handle, 0, peer_memory_, 0, 4 << 20, 1, {}},
                                c.callbacks()));
  }
  peer_.kill_now();
  // Every transfer completes exactly once, done or failed, within a bound; none hangs.
  ASSERT_TRUE(c.wait_total(kWrites, 60s)) << c.done() << " done, " << c.failed() << " failed";
  // A write issued after the death fails rather than hangs.
  Probe after;
  ASSERT_TRUE(engine_->submit(SingleWrite{src->reg.handle, 0, peer_memory_, 0, 4096, 1, {}},
                              after.callbacks()));
  Status s = after.wait(60s);
  EXPECT_NE(s.code(), ErrorCode::kTimeout) << "a write to a dead peer hung";
  EXPECT_EQ(s.code(), ErrorCode::kPeerUnreachable) << s.to_string();
  // The engine keeps serving a live peer.
  auto other = TransferEngine::create(make_config(GetParam()));
  ASSERT_TRUE(other);
  auto dst = make_buffer(**other, 4096);
  Probe ok;
  ASSERT_TRUE(engine_->submit(SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, 4096, 2, {}},
                              ok.callbacks()));
  EXPECT_TRUE(ok.wait());
  EXPECT_TRUE((*other)->wait_imm(2, 1, 20s));
}

INSTANTIATE_TEST_SUITE_P(AllBackends, TwoProcess, ::testing::ValuesIn(all_backends()),
                         backend_name);

}  // namespace
}  // namespace fabric::testing
