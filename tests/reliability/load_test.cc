// Shutdown under load and back-pressure, between two engines in this process, on every
// provider present, plain and through the reordering fault domain.
//
// Shutdown: thousands of transfers of every kind in flight when the engine closes (or is
// destroyed): each callback runs exactly once (done, or kCancelled), none after close()
// returns, and the process has as many open file descriptors afterwards as before.
//
// Back-pressure: 24 000 work requests submitted at once, three times the completion queue's depth
// (8192) and far more than the provider's transmit queue holds: the engine queues them, nothing is
// dropped or failed, every immediate is counted exactly, the data is intact, and the memory the
// queued transfers take stays within a stated bound per work request.
#include <numeric>
#include <random>
#include <thread>

#include "reliability_support.h"

namespace fabric::testing {
namespace {

class Load : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    // libfabric opens some descriptors once per process (provider set-up); a first engine
    // pair, made and closed here, takes them before the count that the tests compare.
    auto warm = TransferEngine::create(make_config(GetParam()));
    if (!warm && warm.status().code() == ErrorCode::kUnsupported) {
      GTEST_SKIP() << "provider not available: " << warm.status().to_string();
    }
    ASSERT_TRUE(warm) << warm.status().to_string();
    auto peer = TransferEngine::create(make_config(GetParam()));
    ASSERT_TRUE(peer);
    auto buf = make_buffer(**peer, 4096);
    auto src = make_buffer(**warm, 4096);
    Probe p;
    ASSERT_TRUE((*warm)->submit(SingleWrite{src->reg.handle, 0, buf->reg.descriptor, 0, 64, 1, {}},
                                p.callbacks()));
    ASSERT_TRUE(p.wait());
    peer->reset();  // before the buffers they registered
    warm->reset();
  }
};

// Submits `n` transfers from a to b, cycling through every kind; returns how many were accepted.
int submit_mix(TransferEngine& a, TransferEngine& b, const Buffer& src, const Buffer& dst,
               PeerGroup group, int n, Tally& tally) {
  int accepted = 0;
  std::vector<uint32_t> pages(8);
  std::iota(pages.begin(), pages.end(), 0);
  const std::vector<std::byte> message(512, std::byte{1});
  for (int i = 0; i < n; ++i) {
    Result<TransferId> r = Status(ErrorCode::kInternal, "unset");
    switch (i % 6) {
      case 0:
        r = a.submit(SingleWrite{src.reg.handle, 0, dst.reg.descriptor, 0, 64 << 10, 1, {}},
                     tally.callbacks());
        break;
      case 1:
        r = a.submit(
            PagedWrite{src.reg.handle, dst.reg.descriptor, 4096, pages, 4096, 0, pages, 4096, 0, 2},
            tally.callbacks());
        break;
      case 2:
        r = a.submit(Scatter{src.reg.handle, group, {{dst.reg.descriptor, 8192, 0, 0}}, 3, {}},
                     tally.callbacks());
        break;
      case 3:
        r = a.submit(Barrier{group, 4, 0, 0}, tally.callbacks());
        break;
      case 4:
        r = a.submit(ImmWrite{b.address(), 5, 0, 0}, tally.callbacks());
        break;
      case 5:
        r = a.submit_send(b.address(), message, tally.callbacks());
        break;
    }
    if (r) ++accepted;
  }
  return accepted;
}

void shutdown_under_load(const Backend& backend, bool destroy) {
  const int fds_before = open_fds();
  Tally tally;
  int accepted = 0;
  {
    auto a = TransferEngine::create(make_config(backend));
    auto b = TransferEngine::create(make_config(backend));
    ASSERT_TRUE(a && b);
    auto src = make_buffer(**a, 1 << 20);
    auto dst = make_buffer(**b, 1 << 20);
    auto group = (*a)->add_peer_group({(*b)->address()});
    ASSERT_TRUE(group);
    constexpr int kTransfers = 3000;
    accepted = submit_mix(**a, **b, *src, *dst, *group, kTransfers, tally);
    ASSERT_EQ(accepted, kTransfers);
    if (destroy) {
      a->reset();
    } else {
      (*a)->close();
    }
    tally.seal();
    // close() (or the destructor) returned: every callback has run.
    EXPECT_EQ(tally.done() + tally.failed(), accepted) << tally.summary();
    for (auto [code, n] : tally.codes()) {
      EXPECT_EQ(code, ErrorCode::kCancelled) << n << " transfers: " << tally.summary();
    }
    std::this_thread::sleep_for(100ms);
    EXPECT_EQ(tally.after_seal(), 0) << "callbacks ran after close() returned";
    EXPECT_EQ(tally.twice(), 0);
    std::cout << "[          ] " << (destroy ? "destroyed" : "closed") << " with " << accepted
              << " submitted: " << tally.summary() << "\n";
    // Registered memory must outlive its engine: b may still be receiving what a had sent.
    b->reset();
    a->reset();
  }
  EXPECT_EQ(open_fds(), fds_before) << "file descriptors leaked by the engines";
}

TEST_P(Load, CloseWithThousandsInFlightRunsEachCallbackOnceAndLeaksNoFd) {
  shutdown_under_load(GetParam(), false);
}

TEST_P(Load, DestroyWithThousandsInFlightRunsEachCallbackOnceAndLeaksNoFd) {
  shutdown_under_load(GetParam(), true);
}

TEST_P(Load, TensOfThousandsQueuedAreDrainedWithNothingDropped) {
  Config ca = make_config(GetParam());
  ca.close_timeout = 10s;
  auto a = TransferEngine::create(ca);
  auto b = TransferEngine::create(make_config(GetParam()));
  ASSERT_TRUE(a && b);
  constexpr uint64_t kWrites = 12000;  // single writes of 256 bytes, imm 11
  constexpr uint64_t kPages = 12000;   // one paged write of 128-byte pages, imm 12 per page
  constexpr uint64_t kSmall = 256;
  constexpr uint64_t kPage = 128;
  auto src = make_buffer(**a, kWrites * kSmall);
  auto dst = make_buffer(**b, kWrites * kSmall + kPages * kPage);
  fill_pattern(src->bytes.data(), src->bytes.size(), 5);
  std::vector<uint32_t> src_pages(kPages), dst_pages(kPages);
  std::mt19937 rng(9);
  for (auto& p : src_pages) p = static_cast<uint32_t>(rng() % (kWrites * kSmall / kPage));
  std::iota(dst_pages.begin(), dst_pages.end(), 0);
  std::shuffle(dst_pages.begin(), dst_pages.end(), rng);

  Tally tally;
  const uint64_t rss_before = rss_bytes();
  for (uint64_t i = 0; i < kWrites; ++i) {
    ASSERT_TRUE((*a)->submit(
        SingleWrite{src->reg.handle, i * kSmall, dst->reg.descriptor, i * kSmall, kSmall, 11, {}},
        tally.callbacks()));
  }
  ASSERT_TRUE((*a)->submit(PagedWrite{src->reg.handle, dst->reg.descriptor, kPage, src_pages, kPage,
                                      0, dst_pages, kPage, kWrites * kSmall, 12},
                           tally.callbacks()));
  // The peak of queued state: everything submitted, little of it completed yet.
  const uint64_t rss_queued = rss_bytes();
  ASSERT_TRUE(tally.wait_total(kWrites + 1, 120s)) << tally.summary();
  EXPECT_EQ(tally.done(), static_cast<int>(kWrites + 1)) << tally.summary();
  EXPECT_TRUE((*b)->wait_imm(11, kWrites, 30s)) << (*b)->imm_count(11);
  EXPECT_TRUE((*b)->wait_imm(12, kPages, 30s)) << (*b)->imm_count(12);
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ((*b)->imm_count(11), kWrites) << "immediates lost or duplicated";
  EXPECT_EQ((*b)->imm_count(12), kPages) << "immediates lost or duplicated";
  EXPECT_EQ(0, std::memcmp(dst->bytes.data(), src->bytes.data(), kWrites * kSmall));
  for (uint64_t i = 0; i < kPages; ++i) {
    ASSERT_EQ(0, std::memcmp(dst->bytes.data() + kWrites * kSmall + dst_pages[i] * kPage,
                             src->bytes.data() + src_pages[i] * kPage, kPage))
        << "page " << i;
  }
  // Memory of what was queued: a Transfer per submission and an Op per work request, freed as
  // they complete (docs/hardening.md states the bound).
  const uint64_t per_wr =
      (rss_queued > rss_before ? rss_queued - rss_before : 0) / (kWrites + kPages);
  std::cout << "[          ] " << kWrites + kPages << " work requests queued: resident memory +"
            << (rss_queued - std::min(rss_queued, rss_before)) / 1024 << " KiB (" << per_wr
            << " bytes per work request)\n";
  if (!kSanitized) {
    EXPECT_LE(per_wr, 8192u) << "queued work takes more memory than the stated bound";
  }
  b->reset();  // before the buffers it has registered
  a->reset();
}

INSTANTIATE_TEST_SUITE_P(AllBackends, Load, ::testing::ValuesIn(all_backends()), backend_name);

}  // namespace
}  // namespace fabric::testing
