// Conformance: every operation between two engines in one process, on every provider present,
// plain and through the reordering fault domain. Data is checked byte for byte; immediates are
// counted by the receiver.
#include <algorithm>
#include <atomic>
#include <numeric>
#include <random>
#include <thread>

#include "test_support.h"

namespace fabric::testing {
namespace {

// An expectation callback that checks the contract: when the immediate is counted, the whole
// payload is already visible at the receiver.
std::function<void()> expect_landed(Probe& probe, const std::byte* want, const std::byte* got,
                                    uint64_t n) {
  return [cb = probe.callbacks(), want, got, n] {
    if (std::memcmp(want, got, n) == 0) {
      cb.on_done();
    } else {
      cb.on_error(Status(ErrorCode::kInternal, "immediate counted before its data landed"));
    }
  };
}

class Ops : public ::testing::TestWithParam<Backend> {
 protected:
  void open(int nics_a = 1, int nics_b = 1) {
    auto ca = make_config(GetParam(), nics_a);
    auto cb = make_config(GetParam(), nics_b);
    auto ea = TransferEngine::create(ca);
    if (!ea && ea.status().code() == ErrorCode::kUnsupported) {
      skip_reason_ = ea.status().to_string();
      return;
    }
    ASSERT_TRUE(ea) << ea.status().to_string();
    auto eb = TransferEngine::create(cb);
    ASSERT_TRUE(eb) << eb.status().to_string();
    a_ = std::move(*ea);
    b_ = std::move(*eb);
  }
  void SetUp() override {
    open();
    if (!skip_reason_.empty()) GTEST_SKIP() << "provider not available: " << skip_reason_;
  }

  // Single write of n bytes from a to b at the given offsets, with an immediate.
  void single_write_roundtrip(uint64_t n, uint64_t src_off, uint64_t dst_off, Routing routing,
                              uint32_t imm) {
    auto src = make_buffer(*a_, n + src_off);
    auto dst = make_buffer(*b_, n + dst_off);
    fill_pattern(src->bytes.data(), src->bytes.size(), n);
    Probe arrived;
    ASSERT_TRUE(b_->expect_imm(
        imm, 1,
        expect_landed(arrived, src->bytes.data() + src_off, dst->bytes.data() + dst_off, n)));
    Probe done;
    auto id = a_->submit(
        SingleWrite{src->reg.handle, src_off, dst->reg.descriptor, dst_off, n, imm, routing},
        done.callbacks());
    ASSERT_TRUE(id) << id.status().to_string();
    ASSERT_TRUE(done.wait()) << done.wait().to_string();
    Status landed = arrived.wait();
    ASSERT_TRUE(landed) << "immediate " << imm << ": " << landed.to_string();
    ASSERT_EQ(0, std::memcmp(src->bytes.data() + src_off, dst->bytes.data() + dst_off, n))
        << "data mismatch for a " << n << "-byte write";
    // Bytes around the destination range are untouched.
    for (uint64_t i = 0; i < dst_off; ++i) ASSERT_EQ(dst->bytes[i], std::byte{0});
    EXPECT_EQ(b_->imm_count(imm), 1u);
  }

  std::string skip_reason_;
  std::unique_ptr<TransferEngine> a_;
  std::unique_ptr<TransferEngine> b_;
};

TEST_P(Ops, SingleWriteSizes) {
  uint32_t imm = 100;
  for (uint64_t n : {uint64_t{0}, uint64_t{1}, uint64_t{7}, uint64_t{4097}, uint64_t{65536},
                     uint64_t{1} << 20, (uint64_t{5} << 20) + 13}) {
    SCOPED_TRACE(n);
    single_write_roundtrip(n, 3, 5, Routing::sharded(), imm++);
  }
}

TEST_P(Ops, SingleWriteSeveralHundredMiB) {
  single_write_roundtrip(uint64_t{300} << 20, 0, 0, Routing::sharded(), 7);
}

TEST_P(Ops, SingleWriteWithoutImmediate) {
  auto src = make_buffer(*a_, 10000);
  auto dst = make_buffer(*b_, 10000);
  fill_pattern(src->bytes.data(), 10000, 1);
  Probe done;
  ASSERT_TRUE(a_->submit(SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, 10000, {}, {}},
                         done.callbacks()));
  ASSERT_TRUE(done.wait());
  EXPECT_EQ(0, std::memcmp(src->bytes.data(), dst->bytes.data(), 10000));
}

TEST_P(Ops, PagedWritesRandomPages) {
  constexpr uint64_t kPage = 4096;
  constexpr uint64_t kStride = kPage + 128;  // the reference benchmark's layout
  constexpr uint32_t kPages = 1000;
  constexpr uint64_t kSrcOff = 64, kDstOff = 256;
  auto src = make_buffer(*a_, kSrcOff + kPages * kStride);
  auto dst = make_buffer(*b_, kDstOff + kPages * kStride);
  fill_pattern(src->bytes.data(), src->bytes.size(), 99);
  std::vector<uint32_t> sp(kPages), dp(kPages);
  std::iota(sp.begin(), sp.end(), 0);
  std::iota(dp.begin(), dp.end(), 0);
  std::mt19937 rng(7);
  std::shuffle(sp.begin(), sp.end(), rng);
  std::shuffle(dp.begin(), dp.end(), rng);
  Probe arrived;
  ASSERT_TRUE(b_->expect_imm(55, kPages, [cb = arrived.callbacks()] { cb.on_done(); }));
  Probe done;
  PagedWrite pw{
      src->reg.handle, dst->reg.descriptor, kPage, sp, kStride, kSrcOff, dp, kStride, kDstOff, 55};
  ASSERT_TRUE(a_->submit(pw, done.callbacks()));
  ASSERT_TRUE(done.wait());
  ASSERT_TRUE(arrived.wait()) << "only " << b_->imm_count(55) << " of " << kPages << " pages";
  for (uint32_t i = 0; i < kPages; ++i) {
    ASSERT_EQ(0, std::memcmp(src->bytes.data() + kSrcOff + sp[i] * kStride,
                             dst->bytes.data() + kDstOff + dp[i] * kStride, kPage))
        << "page " << i;
  }
  // The 128-byte gaps between destination pages stay untouched.
  for (uint32_t p = 0; p < kPages; ++p) {
    for (uint64_t g = kPage; g < kStride; ++g) {
      ASSERT_EQ(dst->bytes[kDstOff + p * kStride + g], std::byte{0}) << "gap of page " << p;
    }
  }
  EXPECT_EQ(b_->imm_count(55), kPages);
}

TEST_P(Ops, ImmOnlyWrites) {
  constexpr int kCount = 200;
  Counter c;
  for (int i = 0; i < kCount; ++i) {
    ASSERT_TRUE(a_->submit(ImmWrite{b_->address(), 9, 0, 0}, c.callbacks()));
  }
  ASSERT_TRUE(c.wait_total(kCount));
  EXPECT_EQ(c.done(), kCount);
  EXPECT_TRUE(b_->wait_imm(9, kCount, 20s)) << b_->imm_count(9);
  EXPECT_EQ(b_->imm_count(9), uint64_t{kCount});
}

TEST_P(Ops, ScatterToPeerGroupByPeerAndByBytes) {
  auto cfg = make_config(GetParam());
  FABRIC_ENGINE_OR_SKIP(c_, cfg);
  auto src = make_buffer(*a_, 3 << 20);
  fill_pattern(src->bytes.data(), src->bytes.size(), 5);
  auto db = make_buffer(*b_, 2 << 20);
  auto dc = make_buffer(*c_, 2 << 20);
  auto group = a_->add_peer_group({b_->address(), c_->address()});
  ASSERT_TRUE(group) << group.status().to_string();
  for (auto sharding : {Scatter::Sharding::kByPeer, Scatter::Sharding::kByBytes}) {
    const uint32_t imm = sharding == Scatter::Sharding::kByPeer ? 70 : 71;
    std::vector<ScatterTarget> targets = {
        {db->reg.descriptor, 1000, 0, 10},
        {dc->reg.descriptor, (1 << 20) + 7, 4096, 1},
        {db->reg.descriptor, 300, 2 << 20, 1 << 20},
    };
    Probe done;
    ASSERT_TRUE(
        a_->submit(Scatter{src->reg.handle, *group, targets, imm, sharding}, done.callbacks()));
    ASSERT_TRUE(done.wait());
    ASSERT_TRUE(b_->wait_imm(imm, 2, 20s));
    ASSERT_TRUE(c_->wait_imm(imm, 1, 20s));
    for (const auto& t : targets) {
      const auto& dst = t.dst == db->reg.descriptor ? db : dc;
      ASSERT_EQ(0, std::memcmp(src->bytes.data() + t.src_offset, dst->bytes.data() + t.dst_offset,
                               t.length));
    }
    EXPECT_EQ(b_->imm_count(imm), 2u);
    EXPECT_EQ(c_->imm_count(imm), 1u);
  }
}

TEST_P(Ops, BarrierReachesEveryMember) {
  auto cfg = make_config(GetParam());
  FABRIC_ENGINE_OR_SKIP(c_, cfg);
  auto group = a_->add_peer_group({b_->address(), c_->address()});
  ASSERT_TRUE(group);
  for (int round = 1; round <= 5; ++round) {
    Probe done;
    ASSERT_TRUE(a_->submit(Barrier{*group, 33, 0, 0}, done.callbacks()));
    ASSERT_TRUE(done.wait());
    ASSERT_TRUE(b_->wait_imm(33, round, 20s));
    ASSERT_TRUE(c_->wait_imm(33, round, 20s));
  }
  EXPECT_EQ(b_->imm_count(33), 5u);
  EXPECT_EQ(c_->imm_count(33), 5u);
}

TEST_P(Ops, SendReceiveRepostsBuffers) {
  constexpr int kMessages = 300;  // many more than the 4 receive buffers
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::string> got;
  ASSERT_TRUE(b_->set_receive_handler(
      [&](std::span<const std::byte> m) {
        std::lock_guard lock(mu);
        got.emplace_back(reinterpret_cast<const char*>(m.data()), m.size());
        cv.notify_all();
      },
      1024, 4));
  EXPECT_EQ(b_->set_receive_handler([](std::span<const std::byte>) {}, 1024, 4).code(),
            ErrorCode::kAlreadyExists);
  Counter sent;
  int submitted = 0;
  for (int i = 0; i < kMessages; ++i) {
    std::string m = "message " + std::to_string(i) + std::string(static_cast<size_t>(i), 'x');
    auto id = a_->submit_send(b_->address(), std::as_bytes(std::span(m)), sent.callbacks());
    ASSERT_TRUE(id) << id.status().to_string();
    ++submitted;
    if (i % 4 == 3) {  // stay within the receiver's buffers: sends are not flow-controlled
      std::unique_lock lock(mu);
      ASSERT_TRUE(cv.wait_for(lock, 20s, [&] { return got.size() >= size_t(i + 1); }));
    }
  }
  ASSERT_TRUE(sent.wait_total(submitted));
  EXPECT_EQ(sent.done(), kMessages) << sent.first_error().to_string();
  std::unique_lock lock(mu);
  ASSERT_TRUE(cv.wait_for(lock, 20s, [&] { return got.size() == kMessages; }));
  std::sort(got.begin(), got.end());
  std::vector<std::string> want;
  for (int i = 0; i < kMessages; ++i) {
    want.push_back("message " + std::to_string(i) + std::string(static_cast<size_t>(i), 'x'));
  }
  std::sort(want.begin(), want.end());
  EXPECT_EQ(got, want);
}

TEST_P(Ops, ThousandsInFlight) {
  constexpr int kWrites = 3000;
  constexpr uint64_t kSize = 2048;
  auto src = make_buffer(*a_, kWrites * kSize);
  auto dst = make_buffer(*b_, kWrites * kSize);
  fill_pattern(src->bytes.data(), src->bytes.size(), 3);
  Probe all_arrived;
  ASSERT_TRUE(b_->expect_imm(444, kWrites, [cb = all_arrived.callbacks()] { cb.on_done(); }));
  Counter c;
  for (int i = 0; i < kWrites; ++i) {
    ASSERT_TRUE(a_->submit(
        SingleWrite{src->reg.handle, i * kSize, dst->reg.descriptor, i * kSize, kSize, 444, {}},
        c.callbacks()));
  }
  ASSERT_TRUE(c.wait_total(kWrites, 60s));
  EXPECT_EQ(c.done(), kWrites) << c.first_error().to_string();
  ASSERT_TRUE(all_arrived.wait(30s));
  EXPECT_EQ(0, std::memcmp(src->bytes.data(), dst->bytes.data(), src->bytes.size()));
}

TEST_P(Ops, ExpectationsClaimArrivalsInRounds) {
  // Arrivals before the expectation count; each expectation claims its own arrivals.
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(a_->submit(ImmWrite{b_->address(), 5, 0, 0}, {}));
  ASSERT_TRUE(b_->wait_imm(5, 3, 20s));
  Probe first;
  ASSERT_TRUE(b_->expect_imm(5, 2, [cb = first.callbacks()] { cb.on_done(); }));
  ASSERT_TRUE(first.wait(5s));
  Probe second;
  ASSERT_TRUE(b_->expect_imm(5, 2, [cb = second.callbacks()] { cb.on_done(); }));
  EXPECT_EQ(second.wait(300ms).code(), ErrorCode::kTimeout) << "only one unclaimed arrival";
  ASSERT_TRUE(a_->submit(ImmWrite{b_->address(), 5, 0, 0}, {}));
  ASSERT_TRUE(second.wait());
  EXPECT_EQ(b_->imm_count(5), 4u);
}

TEST_P(Ops, UnexpectedImmediatesAreReported) {
  std::mutex mu;
  std::vector<uint32_t> seen;
  b_->set_unexpected_imm_handler([&](uint32_t imm) {
    std::lock_guard lock(mu);
    seen.push_back(imm);
  });
  ASSERT_TRUE(a_->submit(ImmWrite{b_->address(), 77, 0, 0}, {}));
  ASSERT_TRUE(b_->wait_imm(77, 1, 20s));
  for (int i = 0; i < 200; ++i) {
    {
      std::lock_guard lock(mu);
      if (!seen.empty()) break;
    }
    std::this_thread::sleep_for(10ms);
  }
  std::lock_guard lock(mu);
  EXPECT_EQ(seen, std::vector<uint32_t>{77});
}

TEST_P(Ops, ThrowingCallbackDoesNotStopTheEngine) {
  ASSERT_TRUE(a_->submit(ImmWrite{b_->address(), 1, 0, 0},
                         Callbacks{[] { throw std::runtime_error("user bug"); }, {}}));
  Probe after;
  ASSERT_TRUE(a_->submit(ImmWrite{b_->address(), 1, 0, 0}, after.callbacks()));
  EXPECT_TRUE(after.wait());
  EXPECT_TRUE(b_->wait_imm(1, 2, 20s));
}

TEST_P(Ops, MultiNicShardingKeepsRailsAligned) {
  // Two NICs per side: sharded writes, writes pinned to NIC 1, sharded onto fewer NICs than
  // the group has, and imm-only writes on NIC 1 all use the keys of the rail they post on
  // (keys differ per NIC, so a cross-rail key fails the write).
  a_.reset();
  b_.reset();
  open(2, 2);
  constexpr uint64_t kSize = 3 << 20;
  auto src = make_buffer(*a_, kSize);
  auto dst = make_buffer(*b_, kSize);
  fill_pattern(src->bytes.data(), kSize, 11);
  ASSERT_EQ(dst->reg.descriptor.rails().size(), 2u);
  uint32_t imm = 1;
  for (Routing r : {Routing::sharded(), Routing::sharded(1), Routing::pinned(1), Routing::pinned(0),
                    Routing::sharded(2)}) {
    std::memset(dst->bytes.data(), 0, kSize);
    Probe arrived;  // one immediate, after the data of every shard
    ASSERT_TRUE(b_->expect_imm(
        imm, 1, expect_landed(arrived, src->bytes.data(), dst->bytes.data(), kSize)));
    Probe done;
    ASSERT_TRUE(a_->submit(SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, kSize, imm, r},
                           done.callbacks()));
    Status s = done.wait();
    ASSERT_TRUE(s) << s.to_string();
    s = arrived.wait();
    ASSERT_TRUE(s) << s.to_string();
    EXPECT_EQ(b_->imm_count(imm), 1u) << "one arrival per write, however it was sharded";
    ++imm;
  }
  // Imm-only writes and barriers from NIC 1 land on the peer's NIC 1 (the reference picked
  // the remote NIC by chunk index instead).
  Probe done;
  ASSERT_TRUE(a_->submit(ImmWrite{b_->address(), 900, 1, 0}, done.callbacks()));
  Status s = done.wait();
  ASSERT_TRUE(s) << s.to_string();
  ASSERT_TRUE(b_->wait_imm(900, 1, 20s));
  auto group = a_->add_peer_group({b_->address()});
  ASSERT_TRUE(group);
  Probe barrier;
  ASSERT_TRUE(a_->submit(Barrier{*group, 901, 1, 0}, barrier.callbacks()));
  s = barrier.wait();
  ASSERT_TRUE(s) << s.to_string();
  ASSERT_TRUE(b_->wait_imm(901, 1, 20s));
  // Paged writes split across both NICs.
  std::vector<uint32_t> pages(64);
  std::iota(pages.begin(), pages.end(), 0);
  std::memset(dst->bytes.data(), 0, kSize);
  Probe paged;
  ASSERT_TRUE(a_->submit(
      PagedWrite{src->reg.handle, dst->reg.descriptor, 4096, pages, 4096, 0, pages, 4096, 0, 902},
      paged.callbacks()));
  s = paged.wait();
  ASSERT_TRUE(s) << s.to_string();
  ASSERT_TRUE(b_->wait_imm(902, 64, 20s));
  EXPECT_EQ(0, std::memcmp(src->bytes.data(), dst->bytes.data(), 64 * 4096));
}

TEST_P(Ops, SecondDeviceGroupRegistersWritesAndUnregisters) {
  // Reference defect: unregistering memory registered on a non-main worker was a no-op.
  a_.reset();
  auto cfg = make_config(GetParam());
  cfg.groups.push_back(cfg.groups[0]);
  FABRIC_ENGINE_OR_SKIP(two, cfg);
  ASSERT_EQ(two->num_groups(), 2u);
  EXPECT_NE(two->address(0), two->address(1));
  auto src = make_buffer(*two, 1 << 20, /*group=*/1);
  fill_pattern(src->bytes.data(), 1 << 20, 4);
  auto dst = make_buffer(*b_, 1 << 20);
  Probe done;
  ASSERT_TRUE(two->submit(SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, 1 << 20, 17, {}},
                          done.callbacks()));
  ASSERT_TRUE(done.wait());
  ASSERT_TRUE(b_->wait_imm(17, 1, 20s));
  EXPECT_EQ(0, std::memcmp(src->bytes.data(), dst->bytes.data(), 1 << 20));
  // b writes into memory registered on two's group 1, then two unregisters it: a later
  // write to the stale descriptor must fail (where the provider checks keys).
  auto landing = make_buffer(*two, 4096, /*group=*/1);
  auto b_src = make_buffer(*b_, 4096);
  Probe first;
  ASSERT_TRUE(
      b_->submit(SingleWrite{b_src->reg.handle, 0, landing->reg.descriptor, 0, 4096, 18, {}},
                 first.callbacks()));
  ASSERT_TRUE(first.wait());
  ASSERT_TRUE(two->wait_imm(18, 1, 20s));
  ASSERT_TRUE(two->unregister_memory(landing->reg.handle));
  if (!b_->group_info().delivery_complete) return;  // shm does not check keys (see README)
  std::this_thread::sleep_for(50ms);
  Probe stale;
  ASSERT_TRUE(
      b_->submit(SingleWrite{b_src->reg.handle, 0, landing->reg.descriptor, 0, 4096, 19, {}},
                 stale.callbacks()));
  EXPECT_FALSE(stale.wait()) << "the group-1 registration was not released";
}

TEST_P(Ops, RejectedSubmissionsPostNothing) {
  auto src = make_buffer(*a_, 4096);
  auto dst = make_buffer(*b_, 4096);
  Probe never;
  auto expect_code = [&](auto request, ErrorCode code) {
    auto r = a_->submit(request, never.callbacks());
    ASSERT_FALSE(r) << "accepted";
    EXPECT_EQ(r.status().code(), code) << r.status().to_string();
    EXPECT_FALSE(r.status().message().empty());
  };
  const auto& d = dst->reg.descriptor;
  expect_code(SingleWrite{src->reg.handle, 0, d, 1, 4096, {}, {}}, ErrorCode::kOutOfRange);
  expect_code(SingleWrite{src->reg.handle, 1, d, 0, 4096, {}, {}}, ErrorCode::kOutOfRange);
  expect_code(SingleWrite{src->reg.handle, UINT64_MAX, d, 0, 2, {}, {}}, ErrorCode::kOutOfRange);
  expect_code(SingleWrite{src->reg.handle, 0, d, UINT64_MAX - 1, 4, {}, {}},
              ErrorCode::kOutOfRange);
  expect_code(SingleWrite{MemoryHandle{12345}, 0, d, 0, 1, {}, {}}, ErrorCode::kNotFound);
  expect_code(SingleWrite{src->reg.handle, 0, RemoteMemory{}, 0, 1, {}, {}},
              ErrorCode::kInvalidArgument);
  expect_code(SingleWrite{src->reg.handle, 0, d, 0, 1, {}, Routing::pinned(5)},
              ErrorCode::kInvalidArgument);
  expect_code(PagedWrite{src->reg.handle, d, 1024, {0, 3}, 1024, 0, {0, 4}, 1024, 0, {}},
              ErrorCode::kOutOfRange);
  expect_code(PagedWrite{src->reg.handle, d, 1024, {0}, 1024, 0, {0, 1}, 1024, 0, {}},
              ErrorCode::kInvalidArgument);
  expect_code(PagedWrite{src->reg.handle, d, 8, {0xffffffff}, UINT64_MAX / 2, 0, {0}, 8, 0, {}},
              ErrorCode::kOutOfRange);
  expect_code(Scatter{src->reg.handle, PeerGroup{999}, {{d, 1, 0, 0}}, {}, {}},
              ErrorCode::kNotFound);
  auto other = a_->add_peer_group({a_->address()});
  ASSERT_TRUE(other);
  expect_code(Scatter{src->reg.handle, *other, {{d, 1, 0, 0}}, {}, {}}, ErrorCode::kNotFound);
  expect_code(Barrier{PeerGroup{999}, 1, 0, 0}, ErrorCode::kNotFound);
  expect_code(ImmWrite{Address{}, 1, 0, 0}, ErrorCode::kInvalidArgument);
  expect_code(ImmWrite{b_->address(), 1, 3, 0}, ErrorCode::kInvalidArgument);
  std::vector<std::byte> big(70000);
  auto r = a_->submit_send(b_->address(), big, never.callbacks());
  EXPECT_EQ(r.status().code(), ErrorCode::kOutOfRange);

  // A handle kept after unregistering is unknown, even if the pointer is registered again.
  ASSERT_TRUE(a_->unregister_memory(src->reg.handle));
  EXPECT_EQ(a_->unregister_memory(src->reg.handle).code(), ErrorCode::kNotFound);
  auto again = a_->register_memory(src->bytes.data(), 100);
  ASSERT_TRUE(again);
  expect_code(SingleWrite{src->reg.handle, 0, d, 0, 1, {}, {}}, ErrorCode::kNotFound);
  expect_code(SingleWrite{again->handle, 0, d, 0, 101, {}, {}},
              ErrorCode::kOutOfRange);  // the new, shorter length applies: no stale entry
  EXPECT_EQ(again->descriptor.length(), 100u);

  // A closed engine rejects everything.
  a_->close();
  expect_code(SingleWrite{again->handle, 0, d, 0, 1, {}, {}}, ErrorCode::kClosed);
  EXPECT_EQ(a_->register_memory(src->bytes.data(), 10).status().code(), ErrorCode::kClosed);
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(never.calls(), 0) << "a rejected submission ran a callback";
}

// A source unregistered while another thread keeps submitting from it: a submitting thread finds
// its source in a cache of its own, without the region table's lock (EngineImpl::lookup_region),
// where the region may still be alive (held by the transfers in flight) after it left the table.
// unregister_memory still returns once those transfers have ended, every submission begun after
// it returned is refused with kNotFound, and every accepted one ends once.
TEST_P(Ops, UnregisterWhileAnotherThreadSubmitsFromTheRegion) {
  auto src = make_buffer(*a_, 4096);
  auto dst = make_buffer(*b_, 4096);
  CompletionCounter ended;
  std::atomic<bool> returned{false};
  std::thread unregistering([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    EXPECT_TRUE(a_->unregister_memory(src->reg.handle));
    returned.store(true);
  });
  uint64_t accepted = 0;
  for (;;) {
    const bool after = returned.load();
    auto id = a_->submit(SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, 64, {}, {}},
                         ended.callbacks());
    if (id) {
      ++accepted;
      EXPECT_FALSE(after) << "a submission begun after unregister_memory returned was accepted";
      if (after) break;
    } else {
      EXPECT_EQ(id.status().code(), ErrorCode::kNotFound) << id.status().to_string();
      if (after) break;
    }
  }
  unregistering.join();
  EXPECT_GT(accepted, 0u);
  EXPECT_TRUE(ended.wait(accepted, std::chrono::seconds(30)));
  EXPECT_EQ(ended.ended(), accepted);
}

TEST_P(Ops, WriteToUnregisteredRemoteMemoryFails) {
  if (!a_->group_info().delivery_complete) {
    GTEST_SKIP() << GetParam().provider
                 << " completes writes before the target checks the key (no delivery-complete)";
  }
  auto src = make_buffer(*a_, 4096);
  auto dst = make_buffer(*b_, 4096);
  RemoteMemory stale = dst->reg.descriptor;
  ASSERT_TRUE(b_->unregister_memory(dst->reg.handle));
  std::this_thread::sleep_for(50ms);  // the release happens on b's worker
  Probe done;
  ASSERT_TRUE(a_->submit(SingleWrite{src->reg.handle, 0, stale, 0, 64, 3, {}}, done.callbacks()));
  Status s = done.wait();
  EXPECT_EQ(s.code(), ErrorCode::kRemoteAccess) << s.to_string();
  EXPECT_EQ(b_->imm_count(3), 0u);
}

TEST_P(Ops, InjectedFailuresReportEachTransferOnce) {
  if (!GetParam().reorder) GTEST_SKIP() << "fault injection runs on the reorder variants";
  a_.reset();
  auto cfg = make_config(GetParam());
  cfg.faults.fail_write = [](uint64_t seq) { return seq % 5 == 2; };
  FABRIC_ENGINE_OR_SKIP(faulty, cfg);
  auto src = make_buffer(*faulty, 1 << 16);
  auto dst = make_buffer(*b_, 1 << 16);
  Counter c;
  constexpr int kWrites = 100;
  for (int i = 0; i < kWrites; ++i) {
    ASSERT_TRUE(faulty->submit(
        SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, 1 << 16, 8, {}}, c.callbacks()));
  }
  ASSERT_TRUE(c.wait_total(kWrites));
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(c.done() + c.failed(), kWrites) << "every transfer completes exactly once";
  EXPECT_EQ(c.failed(), kWrites / 5) << c.first_error().to_string();
  EXPECT_EQ(c.first_error().code(), ErrorCode::kFabric);
  EXPECT_TRUE(b_->wait_imm(8, c.done(), 20s));
}

// A provider that hands over a message with bytes after it, or cut short (FaultConfig::
// receive_length_delta on the receiver): the receive handler gets exactly the bytes the sender
// sent for the first kind, and nothing for the second: never stale bytes, never a cut message.
TEST_P(Ops, MessagesReportedLongerOrShorterThanSentAreNeverDeliveredWrong) {
  if (!GetParam().reorder) GTEST_SKIP() << "fault injection runs on the reorder variants";
  b_.reset();
  auto cfg = make_config(GetParam());
  std::atomic<int> longer{0}, shorter{0};
  cfg.faults.receive_length_delta = [&](uint64_t seq) -> int64_t {
    if (seq % 2 == 0) {
      ++longer;
      return 21;
    }
    ++shorter;
    return -3;
  };
  FABRIC_ENGINE_OR_SKIP(faulty, cfg);
  std::mutex mu;
  std::vector<std::string> got;
  ASSERT_TRUE(faulty->set_receive_handler(
      [&](std::span<const std::byte> m) {
        std::lock_guard lock(mu);
        got.emplace_back(reinterpret_cast<const char*>(m.data()), m.size());
      },
      1024, 64));
  constexpr int kMessages = 40;
  std::vector<std::string> sent;
  Counter c;
  for (int i = 0; i < kMessages; ++i) {
    sent.push_back("message " + std::to_string(i) + std::string(static_cast<size_t>(i), 'y'));
    ASSERT_TRUE(
        a_->submit_send(faulty->address(), std::as_bytes(std::span(sent.back())), c.callbacks()));
  }
  ASSERT_TRUE(c.wait_total(kMessages));
  EXPECT_EQ(c.done(), kMessages) << c.first_error().to_string();
  const auto until = std::chrono::steady_clock::now() + 20s;
  while (longer + shorter < kMessages && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_EQ(longer + shorter, kMessages) << "not every message reached the receiver";
  std::this_thread::sleep_for(200ms);  // the handler runs on the callback thread
  std::lock_guard lock(mu);
  EXPECT_EQ(got.size(), static_cast<size_t>(longer.load()))
      << "the longer ones are delivered (cut to what was sent), the shorter ones dropped";
  for (const std::string& m : got) {
    EXPECT_NE(std::find(sent.begin(), sent.end(), m), sent.end())
        << "delivered bytes no sender sent: " << m.size() << " bytes";
  }
  std::sort(got.begin(), got.end());
  EXPECT_EQ(std::adjacent_find(got.begin(), got.end()), got.end()) << "a message came twice";
}

TEST_P(Ops, CloseWithTransfersInFlightCompletesEachOnce) {
  auto src = make_buffer(*a_, 1 << 20);
  auto dst = make_buffer(*b_, 1 << 20);
  Counter c;
  constexpr int kWrites = 2000;
  for (int i = 0; i < kWrites; ++i) {
    ASSERT_TRUE(a_->submit(SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, 1 << 20, {}, {}},
                           c.callbacks()));
  }
  a_->close();
  // close() returns after every callback ran.
  EXPECT_EQ(c.done() + c.failed(), kWrites);
  if (c.failed() > 0) {
    EXPECT_EQ(c.first_error().code(), ErrorCode::kCancelled);
  }
  // Writes already on the wire when a_ closed may still land: the destination is unregistered
  // (a barrier) before its memory goes back to the heap.
  EXPECT_TRUE(b_->unregister_memory(dst->reg.handle));
}

INSTANTIATE_TEST_SUITE_P(AllBackends, Ops, ::testing::ValuesIn(all_backends()), backend_name);

}  // namespace
}  // namespace fabric::testing
