// The verbs backend's own behaviour, on a real verbs device (Soft-RoCE in the rxe lab):
// connection set-up under lost and late handshakes, a peer that never answers, a queue pair
// error reported on the transfer that caused it, immediates far beyond the receive queue's
// depth, and rail-aligned sharding over several devices. Skipped where no verbs device exists.
#include <fstream>
#include <thread>

#include "test_support.h"
#include "transport/verbs/verbs_domain.h"

namespace fabric::testing {
namespace {

// The devices the lab makes: rxe0, rxe1, ... on dummy0, dummy1, ... (198.18.I.1).
std::vector<std::string> verbs_devices() {
  std::vector<std::string> out;
  for (const auto& p : transport::list_verbs_ports()) {
    if (p.active && p.gid_index >= 0) out.push_back(p.device);
  }
  return out;
}

Config verbs_config(std::vector<std::string> nics = {}) {
  Config c = make_config(Backend{"verbs", "verbs", false});
  if (!nics.empty()) c.groups[0].nics = std::move(nics);
  return c;
}

uint64_t port_counter(const std::string& device, const char* name) {
  std::ifstream f("/sys/class/infiniband/" + device + "/ports/1/hw_counters/" + name);
  uint64_t v = 0;
  f >> v;
  return v;
}

class Verbs : public ::testing::Test {
 protected:
  void SetUp() override {
    devices_ = verbs_devices();
    if (devices_.empty()) GTEST_SKIP() << "no verbs device with an active port and a usable GID";
  }
  std::vector<std::string> devices_;
};

// One 64 KiB write with an immediate from a to b; checks the bytes and the count.
void write_and_check(TransferEngine& a, TransferEngine& b, uint32_t imm, uint64_t seed) {
  constexpr uint64_t kSize = 64 * 1024;
  auto src = make_buffer(a, kSize);
  auto dst = make_buffer(b, kSize);
  fill_pattern(src->bytes.data(), kSize, seed);
  Probe done;
  ASSERT_TRUE(a.submit(SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, kSize, imm, {}},
                       done.callbacks()));
  Status s = done.wait();
  ASSERT_TRUE(s) << s.to_string();
  ASSERT_TRUE(b.wait_imm(imm, 1, 10s));
  EXPECT_EQ(b.imm_count(imm), 1u);
  EXPECT_EQ(0, std::memcmp(src->bytes.data(), dst->bytes.data(), kSize));
}

TEST_F(Verbs, PortListingHasTheIpv4RoceGidAndMtu) {
  bool found = false;
  for (const auto& p : transport::list_verbs_ports()) {
    if (p.device != devices_[0]) continue;
    found = true;
    EXPECT_TRUE(p.active) << p.state;
    EXPECT_GE(p.active_mtu, 256u);
    // An IPv4-mapped GID: ::ffff:a.b.c.d.
    EXPECT_EQ(p.gid.rfind("0000:0000:0000:0000:0000:ffff:", 0), 0u) << p.gid;
  }
  EXPECT_TRUE(found);
}

TEST_F(Verbs, UnknownDeviceAndBadPortAreNamed) {
  auto e = TransferEngine::create(verbs_config({"no-such-rdma-device"}));
  ASSERT_FALSE(e);
  EXPECT_EQ(e.status().code(), ErrorCode::kNotFound);
  EXPECT_NE(e.status().message().find("no-such-rdma-device"), std::string::npos)
      << e.status().to_string();
  auto p = TransferEngine::create(verbs_config({devices_[0] + ":x"}));
  ASSERT_FALSE(p);
  EXPECT_EQ(p.status().code(), ErrorCode::kInvalidArgument) << p.status().to_string();
}

TEST_F(Verbs, ConnectsAfterTheFirstHandshakesAreLost) {
  Config ca = verbs_config();
  ca.verbs.drop_handshakes = 2;  // a's first two requests vanish
  Config cb = verbs_config();
  cb.verbs.drop_handshakes = 1;  // and b's first reply
  FABRIC_ENGINE_OR_SKIP(a, ca);
  FABRIC_ENGINE_OR_SKIP(b, cb);
  write_and_check(*a, *b, 11, 1);
  write_and_check(*b, *a, 12, 2);  // the other direction uses the same connection
}

TEST_F(Verbs, LateHandshakesAreAnsweredOnce) {
  // Every handshake datagram of a and b arrives after the sender already retried: duplicate
  // requests and replies, none of which may reconnect or count an immediate twice.
  Config ca = verbs_config();
  ca.verbs.delay_handshakes = 3;
  ca.verbs.handshake_delay = 250ms;
  Config cb = ca;
  FABRIC_ENGINE_OR_SKIP(a, ca);
  FABRIC_ENGINE_OR_SKIP(b, cb);
  Counter c;
  for (int i = 0; i < 20; ++i)
    ASSERT_TRUE(a->submit(ImmWrite{b->address(), 21, 0, 0}, c.callbacks()));
  ASSERT_TRUE(c.wait_total(20));
  EXPECT_EQ(c.done(), 20) << c.first_error().to_string();
  ASSERT_TRUE(b->wait_imm(21, 20, 10s));
  std::this_thread::sleep_for(600ms);  // every late datagram has arrived by now
  write_and_check(*a, *b, 22, 3);
  EXPECT_EQ(b->imm_count(21), 20u);
}

TEST_F(Verbs, PeerThatNeverAnswersFailsOnlyItsOwnTransfers) {
  Config ca = verbs_config();
  ca.verbs.connect_retry = 50ms;
  ca.verbs.connect_attempts = 3;
  FABRIC_ENGINE_OR_SKIP(a, ca);
  FABRIC_ENGINE_OR_SKIP(b, verbs_config());
  Address gone;
  {
    FABRIC_ENGINE_OR_SKIP(dead, verbs_config());
    gone = dead->address();
  }  // closed: its handshake queue pair no longer exists
  Probe to_dead;
  ASSERT_TRUE(a->submit(ImmWrite{gone, 31, 0, 0}, to_dead.callbacks()));
  write_and_check(*a, *b, 32, 4);  // another peer goes on meanwhile
  Status s = to_dead.wait(20s);
  EXPECT_EQ(s.code(), ErrorCode::kPeerUnreachable) << s.to_string();
  EXPECT_NE(s.message().find("never answered"), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("3 requests"), std::string::npos) << s.to_string();
}

TEST_F(Verbs, QueuePairErrorFailsTheRightTransferAndThePeerReconnects) {
  FABRIC_ENGINE_OR_SKIP(a, verbs_config());
  FABRIC_ENGINE_OR_SKIP(b, verbs_config());
  write_and_check(*a, *b, 41, 5);  // connected
  auto src = make_buffer(*a, 4096);
  auto dst = make_buffer(*b, 4096);
  RemoteMemory stale = dst->reg.descriptor;
  ASSERT_TRUE(b->unregister_memory(dst->reg.handle));
  std::this_thread::sleep_for(50ms);  // the release happens on b's worker
  Probe bad;
  ASSERT_TRUE(a->submit(SingleWrite{src->reg.handle, 0, stale, 0, 64, 42, {}}, bad.callbacks()));
  Status s = bad.wait();
  EXPECT_EQ(s.code(), ErrorCode::kRemoteAccess) << s.to_string();
  EXPECT_NE(s.message().find("remote access error"), std::string::npos) << s.to_string();
  EXPECT_EQ(b->imm_count(42), 0u);
  // The queue pair is in the error state; the next transfer connects afresh, both ways.
  write_and_check(*a, *b, 43, 6);
  write_and_check(*b, *a, 44, 7);
}

TEST_F(Verbs, ThousandsOfImmediatesReplenishTheReceiveQueue) {
  FABRIC_ENGINE_OR_SKIP(a, verbs_config());
  FABRIC_ENGINE_OR_SKIP(b, verbs_config());
  constexpr int kCount = 5000;  // almost five times the receive queue for immediates
  Counter c;
  for (int i = 0; i < kCount; ++i) {
    ASSERT_TRUE(a->submit(ImmWrite{b->address(), 51, 0, 0}, c.callbacks()));
  }
  ASSERT_TRUE(c.wait_total(kCount, 60s));
  EXPECT_EQ(c.done(), kCount) << c.first_error().to_string();
  ASSERT_TRUE(b->wait_imm(51, kCount, 30s)) << b->imm_count(51);
  // Messages still flow on their own queue pair and receive queue afterwards.
  write_and_check(*a, *b, 52, 8);
  EXPECT_EQ(b->imm_count(51), uint64_t{kCount});
}

TEST_F(Verbs, TwoEnginesShardRailAlignedOverSeveralDevices) {
  if (devices_.size() < 2) GTEST_SKIP() << "needs two verbs devices (the rxe lab makes them)";
  std::vector<std::string> rails(devices_.begin(), devices_.begin() + 2);
  Config c = verbs_config(rails);
  c.shard_min_bytes = 4096;
  FABRIC_ENGINE_OR_SKIP(a, c);
  FABRIC_ENGINE_OR_SKIP(b, c);
  std::vector<uint64_t> before;
  for (const auto& d : rails) before.push_back(port_counter(d, "sent_pkts"));
  constexpr uint64_t kSize = 1 << 20;
  auto src = make_buffer(*a, kSize);
  auto dst = make_buffer(*b, kSize);
  fill_pattern(src->bytes.data(), kSize, 9);
  Probe arrived;
  ASSERT_TRUE(b->expect_imm(61, 1, [cb = arrived.callbacks()] { cb.on_done(); }));
  Probe done;
  ASSERT_TRUE(a->submit(
      SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, kSize, 61, Routing::sharded()},
      done.callbacks()));
  ASSERT_TRUE(done.wait()) << done.wait().to_string();
  ASSERT_TRUE(arrived.wait());
  EXPECT_EQ(0, std::memcmp(src->bytes.data(), dst->bytes.data(), kSize));
  // Both rails carried data. (A cross-rail write would not arrive at all: Soft-RoCE delivers
  // only between queue pairs of the same device here.)
  for (size_t i = 0; i < rails.size(); ++i) {
    EXPECT_GT(port_counter(rails[i], "sent_pkts"), before[i] + 100) << rails[i];
  }
  // Pinned to the second rail: the peer's second NIC receives.
  write_and_check(*a, *b, 62, 10);
  Probe pinned;
  ASSERT_TRUE(a->submit(
      SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, 4096, 63, Routing::pinned(1)},
      pinned.callbacks()));
  ASSERT_TRUE(pinned.wait()) << pinned.wait().to_string();
  ASSERT_TRUE(b->wait_imm(63, 1, 10s));
}

// Pages small enough to go inline (64 B) and larger ones (4 KiB), hundreds per transfer: each
// is a work request, chained up to 32 to a doorbell (verbs_datapath.cc, VerbsDomain::flush).
// Every page lands where it should, counted once, in both directions.
TEST_F(Verbs, ChainedAndInlineWorkRequestsLandEveryPage) {
  FABRIC_ENGINE_OR_SKIP(a, verbs_config());
  FABRIC_ENGINE_OR_SKIP(b, verbs_config());
  for (const uint64_t page : {uint64_t{64}, uint64_t{4096}}) {
    constexpr uint32_t kPages = 300;
    const uint64_t bytes = page * kPages;
    auto src = make_buffer(*a, bytes);
    auto dst = make_buffer(*b, bytes);
    fill_pattern(src->bytes.data(), bytes, page);
    PagedWrite w;
    w.src = src->reg.handle;
    w.dst = dst->reg.descriptor;
    w.page_bytes = page;
    w.src_stride = page;
    w.dst_stride = page;
    for (uint32_t i = 0; i < kPages; ++i) {
      w.src_pages.push_back(i);
      w.dst_pages.push_back(kPages - 1 - i);  // reversed: each page has a place of its own
    }
    const uint32_t imm = 70 + static_cast<uint32_t>(page % 1000);
    w.imm = imm;
    Probe done;
    ASSERT_TRUE(a->submit(w, done.callbacks()));
    Status s = done.wait();
    ASSERT_TRUE(s) << s.to_string();
    ASSERT_TRUE(b->wait_imm(imm, kPages, 10s)) << b->imm_count(imm);
    EXPECT_EQ(b->imm_count(imm), uint64_t{kPages});
    for (uint32_t i = 0; i < kPages; ++i) {
      ASSERT_EQ(0, std::memcmp(src->bytes.data() + i * page,
                               dst->bytes.data() + (kPages - 1 - i) * page, page))
          << "page " << i << " of " << page << " bytes";
    }
  }
  // Messages (sends, chained on their own queue pair) and writes back still flow.
  write_and_check(*b, *a, 79, 11);
}

}  // namespace
}  // namespace fabric::testing
