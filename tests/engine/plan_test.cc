// Sharding plans, including regressions for the reference's multi-NIC defects.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "engine/plan.h"
#include "engine/rate_meter.h"

namespace fabric::engine {
namespace {

constexpr ShardParams kParams{1024, 256, UINT64_MAX};

// The shards cover [0, length) exactly once, in order.
void expect_exact_cover(const std::vector<Shard>& shards, uint64_t length) {
  uint64_t next = 0;
  for (const Shard& s : shards) {
    EXPECT_EQ(s.offset, next);
    next += s.length;
  }
  EXPECT_EQ(next, length);
}

TEST(Plan, SmallWriteIsOneShardOnTheRotatedNic) {
  auto s = plan_single(100, 4, Routing::sharded(), 6, kParams);
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0], (Shard{2, 0, 100}));
}

TEST(Plan, ZeroLengthWriteIsOneEmptyShard) {
  auto s = plan_single(0, 4, Routing::sharded(), 1, kParams);
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0], (Shard{1, 0, 0}));
}

TEST(Plan, ShardedAcrossAllNicsAlignedWithRemainderLast) {
  auto s = plan_single(10000, 4, Routing::sharded(), 0, kParams);
  ASSERT_EQ(s.size(), 4u);
  for (uint32_t i = 0; i < 3; ++i) {
    EXPECT_EQ(s[i].domain, i);
    EXPECT_EQ(s[i].length, 2560u);  // ceil(10000 / 4) rounded up to 256
  }
  EXPECT_EQ(s[3].length, 10000u - 3 * 2560u);
  expect_exact_cover(s, 10000);
}

TEST(Plan, ShardedOntoFewerNicsThanTheGroupHas) {
  // Reference defect: sharding onto k < N NICs posted with the wrong NIC's keys. Here each
  // shard names its NIC, and keys come from remote_rail(shard.domain).
  auto s = plan_single(1 << 20, 4, Routing::sharded(2), 3, kParams);
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0].domain, 3u);
  EXPECT_EQ(s[1].domain, 0u);
  expect_exact_cover(s, 1 << 20);
  EXPECT_EQ(remote_rail(s[0].domain, 4), 3u);
  EXPECT_EQ(remote_rail(s[1].domain, 4), 0u);
}

TEST(Plan, ShardCountAboveTheNicCountIsClamped) {
  auto s = plan_single(1 << 20, 4, Routing::sharded(9), 0, kParams);
  ASSERT_EQ(s.size(), 4u);
  for (uint32_t i = 0; i < 4; ++i) EXPECT_EQ(s[i].domain, i);
  expect_exact_cover(s, 1 << 20);
}

TEST(Plan, ShardedOntoFewerNicsRotatesOverEveryNic) {
  // Successive writes sharded onto k = 2 of 4 NICs start one NIC later each time, so that
  // every NIC (and its rail's keys) is used.
  for (uint32_t rotation = 0; rotation < 8; ++rotation) {
    auto s = plan_single(100000, 4, Routing::sharded(2), rotation, kParams);
    ASSERT_EQ(s.size(), 2u);
    EXPECT_EQ(s[0].domain, rotation % 4);
    EXPECT_EQ(s[1].domain, (rotation + 1) % 4);
    expect_exact_cover(s, 100000);
  }
}

TEST(Plan, ShardBoundariesAreAlignedAndOnlyTheLastIsShort) {
  for (uint64_t len : {uint64_t{1024}, uint64_t{4097}, uint64_t{100001}, uint64_t{3} << 20}) {
    for (uint32_t nics : {2u, 3u, 4u}) {
      auto s = plan_single(len, nics, Routing::sharded(), 1, kParams);
      expect_exact_cover(s, len);
      for (size_t i = 0; i < s.size(); ++i) {
        EXPECT_EQ(s[i].offset % kParams.alignment, 0u) << len << " on " << nics;
        if (i + 1 < s.size()) {
          EXPECT_EQ(s[i].length, s[0].length) << len << " on " << nics;
        }
        EXPECT_LE(s[i].length, s[0].length);
      }
    }
  }
}

TEST(Plan, PinnedToANicOtherThanTheFirst) {
  auto s = plan_single(1 << 20, 4, Routing::pinned(2), 0, kParams);
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].domain, 2u);
  EXPECT_EQ(remote_rail(2, 4), 2u) << "the write must use rail 2's address and key";
}

TEST(Plan, PiecesAboveTheLargestWorkRequestAreSplit) {
  ShardParams p{1024, 256, 1000};
  auto s = plan_single(2500, 1, Routing::sharded(), 0, p);
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[2], (Shard{0, 2000, 500}));
  expect_exact_cover(s, 2500);
}

TEST(Plan, LengthsAbove4GiBKeepEveryByte) {
  // Reference defect: byte sharding dropped remainder bytes and truncated lengths > 4 GiB.
  const uint64_t len = (uint64_t{9} << 30) + 12345;
  for (uint32_t nics : {1u, 2u, 3u, 4u, 8u}) {
    auto s = plan_single(len, nics, Routing::sharded(), 5, kParams);
    expect_exact_cover(s, len);
    EXPECT_LE(s.size(), nics);
  }
}

TEST(Plan, SplitEvenCoversEveryPageOnce) {
  auto runs = split_even(10, 4, 1);
  ASSERT_EQ(runs.size(), 4u);
  EXPECT_EQ(runs[0], (engine::Run{1, 0, 3}));
  EXPECT_EQ(runs[1], (engine::Run{2, 3, 6}));
  EXPECT_EQ(runs[2], (engine::Run{3, 6, 8}));
  EXPECT_EQ(runs[3], (engine::Run{0, 8, 10}));
  EXPECT_EQ(split_even(2, 4, 0).size(), 2u) << "no empty runs";
}

TEST(Plan, SplitEvenWithFewerItemsThanNicsUsesDistinctNics) {
  auto runs = split_even(3, 4, 2);
  ASSERT_EQ(runs.size(), 3u);
  EXPECT_EQ(runs[0], (engine::Run{2, 0, 1}));
  EXPECT_EQ(runs[1], (engine::Run{3, 1, 2}));
  EXPECT_EQ(runs[2], (engine::Run{0, 2, 3}));
}

TEST(Plan, RemoteRailWrapsForPeersWithFewerNics) {
  EXPECT_EQ(remote_rail(3, 2), 1u);
  EXPECT_EQ(remote_rail(1, 1), 0u);
}

TEST(Plan, CheckRangeIsOverflowSafe) {
  EXPECT_TRUE(check_range("x", 0, 10, 10));
  EXPECT_TRUE(check_range("x", 10, 0, 10));
  EXPECT_EQ(check_range("x", 11, 0, 10).code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(check_range("x", 1, 10, 10).code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(check_range("x", UINT64_MAX, 2, 10).code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(check_range("x", 2, UINT64_MAX, 10).code(), ErrorCode::kOutOfRange);
  EXPECT_NE(check_range("src", 1, 10, 10).message().find("src"), std::string::npos);
}

// --- failover: planning over the NICs that are up -------------------------------------------

TEST(PlanUp, ShardedWritesAvoidTheNicsThatAreDown) {
  const std::vector<bool> up{true, false, true, false};
  for (uint32_t rotation = 0; rotation < 8; ++rotation) {
    auto s = plan_single_up(1 << 20, up, Routing::sharded(), rotation, kParams);
    expect_exact_cover(s, 1 << 20);
    ASSERT_EQ(s.size(), 2u);  // two NICs up: two shards, one on each
    EXPECT_NE(s[0].domain, s[1].domain);
    for (const Shard& sh : s) EXPECT_TRUE(up[sh.domain]) << "shard on NIC " << sh.domain;
  }
}

TEST(PlanUp, KOfNShardingTakesKOfTheUpNics) {
  const std::vector<bool> up{false, true, true, true};
  std::vector<int> used(4, 0);
  for (uint32_t rotation = 0; rotation < 6; ++rotation) {
    auto s = plan_single_up(1 << 20, up, Routing::sharded(2), rotation, kParams);
    expect_exact_cover(s, 1 << 20);
    ASSERT_EQ(s.size(), 2u);
    for (const Shard& sh : s) ++used[sh.domain];
  }
  EXPECT_EQ(used[0], 0);
  EXPECT_GT(used[1], 0);  // the rotation still reaches every NIC that is up
  EXPECT_GT(used[2], 0);
  EXPECT_GT(used[3], 0);
}

TEST(PlanUp, PinnedToADownNicMovesToAnUpOne) {
  const std::vector<bool> up{true, false, true, true};
  auto s = plan_single_up(5000, up, Routing::pinned(1), 0, kParams);
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].domain, 2u);  // the next up NIC after 1
  // Pinned to an up NIC: unchanged.
  EXPECT_EQ(plan_single_up(5000, up, Routing::pinned(3), 0, kParams)[0].domain, 3u);
}

// The one-step path for a pinned write to an up NIC gives what the general one does, at the
// edges of the largest work request too (0 bytes, exactly max, one over, no limit).
TEST(PlanUp, PinnedToAnUpNicPlansAsTheGeneralPathDoes) {
  const std::vector<bool> up{true, false, true};
  for (uint64_t max_wr : {uint64_t{0}, uint64_t{4096}, UINT64_MAX}) {
    const ShardParams params{1024, 256, max_wr};
    for (uint64_t length : {uint64_t{0}, uint64_t{1}, uint64_t{4095}, uint64_t{4096},
                            uint64_t{4097}, uint64_t{3} * 4096 + 5}) {
      for (uint32_t nic : {0u, 2u}) {
        std::vector<Shard> fast;
        plan_single_up(fast, length, up, Routing::pinned(nic), 7, params);
        std::vector<Shard> general;
        plan_single(general, length, 3, Routing::pinned(nic), 7, params);
        ASSERT_EQ(fast.size(), general.size()) << length << " max " << max_wr;
        for (size_t i = 0; i < fast.size(); ++i) {
          EXPECT_EQ(fast[i].domain, general[i].domain);
          EXPECT_EQ(fast[i].offset, general[i].offset);
          EXPECT_EQ(fast[i].length, general[i].length);
        }
      }
    }
  }
}

TEST(PlanUp, NoNicUpPlansOverAllOfThem) {
  // The transfer then fails by peer_timeout rather than at submission.
  const std::vector<bool> up(3, false);
  auto s = plan_single_up(1 << 20, up, Routing::sharded(), 0, kParams);
  ASSERT_EQ(s.size(), 3u);
  expect_exact_cover(s, 1 << 20);
  EXPECT_EQ(failover_nic(1, up, 5), 1u);
}

TEST(PlanUp, PagesSplitOverTheUpNicsOnly) {
  const std::vector<bool> up{true, true, false, true};
  auto runs = split_even_up(10, up, 0);
  ASSERT_EQ(runs.size(), 3u);
  size_t next = 0;
  for (const engine::Run& r : runs) {
    EXPECT_TRUE(up[r.domain]);
    EXPECT_EQ(r.begin, next);
    EXPECT_GE(r.end - r.begin, 3u);
    next = r.end;
  }
  EXPECT_EQ(next, 10u);
}

TEST(PlanUp, FailoverNicSpreadsOverTheSurvivors) {
  const std::vector<bool> up{true, false, true, true};
  EXPECT_EQ(failover_nic(0, up, 7), 0u);  // up: itself
  std::vector<int> hits(4, 0);
  for (uint32_t salt = 0; salt < 9; ++salt) ++hits[failover_nic(1, up, salt)];
  EXPECT_EQ(hits[1], 0);
  EXPECT_EQ(hits[0], 3);
  EXPECT_EQ(hits[2], 3);
  EXPECT_EQ(hits[3], 3);
}

// --- weighted sharding (Config::weighted_sharding) --------------------------------------------

// Bytes per NIC of a plan.
std::vector<uint64_t> bytes_per_nic(const std::vector<Shard>& shards, uint32_t nics) {
  std::vector<uint64_t> out(nics, 0);
  for (const Shard& s : shards) out[s.domain] += s.length;
  return out;
}

TEST(PlanWeighted, EqualOrAbsentWeightsGiveTheUnweightedPlan) {
  const std::vector<uint64_t> equal(4, 5'000'000), unknown(4, 0);
  for (uint64_t len : {uint64_t{100}, uint64_t{1} << 20, uint64_t{10000}, uint64_t{3000007},
                       (uint64_t{9} << 30) + 12345}) {
    for (uint32_t rotation : {0u, 1u, 6u}) {
      for (uint32_t k : {0u, 2u, 3u}) {
        const auto plain = plan_single(len, 4, Routing::sharded(k), rotation, kParams);
        EXPECT_EQ(plan_single(len, 4, Routing::sharded(k), rotation, kParams, equal), plain);
        EXPECT_EQ(plan_single(len, 4, Routing::sharded(k), rotation, kParams, unknown), plain);
      }
    }
  }
  // Weights within 1/8 of the largest count as equal to it (equal links, measured).
  const std::vector<uint64_t> near{1000, 950, 880, 1000};
  EXPECT_EQ(plan_single(1 << 20, 4, Routing::sharded(), 1, kParams, near),
            plan_single(1 << 20, 4, Routing::sharded(), 1, kParams));
  EXPECT_EQ(split_even(401, 4, 2, near), split_even(401, 4, 2));
  EXPECT_NE(plan_single(1 << 20, 4, Routing::sharded(), 1, kParams, {{1000, 950, 870, 1000}}),
            plan_single(1 << 20, 4, Routing::sharded(), 1, kParams));
  // Only the weights of the NICs a plan uses matter: 2-of-4 on NICs 1 and 2, equal there.
  const std::vector<uint64_t> w{9, 4, 4, 1};
  EXPECT_EQ(plan_single(1 << 20, 4, Routing::sharded(2), 1, kParams, w),
            plan_single(1 << 20, 4, Routing::sharded(2), 1, kParams));
  for (size_t count : {size_t{1}, size_t{3}, size_t{10}, size_t{401}}) {
    for (uint32_t rotation : {0u, 3u}) {
      EXPECT_EQ(split_even(count, 4, rotation, equal), split_even(count, 4, rotation));
    }
  }
}

TEST(PlanWeighted, ShardsFollowTheWeightsAlignedWithAnExactCover) {
  // NIC 3 at half the rate of the others: 2:2:2:1.
  const std::vector<uint64_t> w{400, 400, 400, 200};
  for (uint64_t len :
       {uint64_t{1} << 20, uint64_t{32} << 20, (uint64_t{32} << 20) + 12345, uint64_t{1000003}}) {
    for (uint32_t rotation = 0; rotation < 4; ++rotation) {
      auto s = plan_single(len, 4, Routing::sharded(), rotation, kParams, w);
      expect_exact_cover(s, len);
      ASSERT_EQ(s.size(), 4u);
      for (size_t i = 0; i < s.size(); ++i) {
        EXPECT_EQ(s[i].domain, (rotation + i) % 4) << "the rotation is kept";
        EXPECT_EQ(s[i].offset % kParams.alignment, 0u) << "aligned boundaries";
      }
      const auto per = bytes_per_nic(s, 4);
      const double unit = static_cast<double>(len) / 7;
      for (uint32_t n = 0; n < 4; ++n) {
        const double want = unit * (n == 3 ? 1 : 2);
        // Within one alignment unit, plus the sub-unit remainder on the last shard.
        EXPECT_NEAR(static_cast<double>(per[n]), want, 2.0 * kParams.alignment) << "NIC " << n;
      }
    }
  }
}

TEST(PlanWeighted, RemainderAndLengthsAbove4GiBKeepEveryByte) {
  const std::vector<uint64_t> w{3, 1, 7};
  const uint64_t len = (uint64_t{9} << 30) + 12345;
  auto s = plan_single(len, 3, Routing::sharded(), 2, kParams, w);
  expect_exact_cover(s, len);
  const auto per = bytes_per_nic(s, 3);
  EXPECT_GT(per[2], uint64_t{4} << 30) << "a shard above 4 GiB keeps its 64-bit length";
  EXPECT_NEAR(static_cast<double>(per[1]), static_cast<double>(len) / 11, 2.0 * kParams.alignment);
  // Pieces above the largest work request are still split on their NIC.
  ShardParams p = kParams;
  p.max_wr_bytes = uint64_t{1} << 30;
  auto split = plan_single(len, 3, Routing::sharded(), 2, p, w);
  expect_exact_cover(split, len);
  for (const Shard& sh : split) EXPECT_LE(sh.length, p.max_wr_bytes);
  EXPECT_EQ(bytes_per_nic(split, 3), per);
  // Less than one alignment unit in all: everything on the last shard's NIC.
  ShardParams big = kParams;
  big.min_bytes = 0;
  big.alignment = 1 << 20;
  auto tiny = plan_single(5000, 3, Routing::sharded(), 0, big, w);
  expect_exact_cover(tiny, 5000);
  ASSERT_EQ(tiny.size(), 1u);
  EXPECT_EQ(tiny[0].domain, 2u);
}

TEST(PlanWeighted, UnmeasuredNicsCountAsTheFastestAndAFloorKeepsEveryNicSampled) {
  // NIC 1 not measured yet (0): weighted like the fastest measured one.
  auto s = plan_single(1 << 20, 3, Routing::sharded(), 0, kParams, std::vector<uint64_t>{8, 0, 4});
  expect_exact_cover(s, 1 << 20);
  auto per = bytes_per_nic(s, 3);
  EXPECT_NEAR(static_cast<double>(per[0]), static_cast<double>(per[1]), kParams.alignment);
  EXPECT_NEAR(static_cast<double>(per[2]), (1 << 20) / 5.0, kParams.alignment);
  // A NIC measured at a thousandth of the others still gets 1/16 of the fastest's weight.
  s = plan_single(uint64_t{1} << 30, 2, Routing::sharded(), 0, kParams,
                  std::vector<uint64_t>{1'000'000, 1'000});
  per = bytes_per_nic(s, 2);
  EXPECT_NEAR(static_cast<double>(per[1]), (uint64_t{1} << 30) / 17.0, kParams.alignment);
  auto runs = split_even(170, 2, 0, std::vector<uint64_t>{1'000'000, 1});
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[1], (engine::Run{1, 160, 170}));
}

TEST(PlanWeighted, PagesSplitByWeightEveryPageOnce) {
  const std::vector<uint64_t> w{400, 400, 400, 200};
  for (size_t count : {size_t{1}, size_t{3}, size_t{7}, size_t{100}, size_t{401}}) {
    for (uint32_t rotation = 0; rotation < 4; ++rotation) {
      auto runs = split_even(count, 4, rotation, w);
      size_t next = 0;
      std::vector<size_t> per(4, 0);
      for (const engine::Run& r : runs) {
        EXPECT_EQ(r.begin, next);
        EXPECT_GT(r.end, r.begin) << "no empty runs";
        per[r.domain] += r.end - r.begin;
        next = r.end;
      }
      EXPECT_EQ(next, count);
      for (uint32_t n = 0; n < 4; ++n) {
        EXPECT_NEAR(static_cast<double>(per[n]), count * (n == 3 ? 1.0 : 2.0) / 7, 1.0);
      }
    }
  }
  EXPECT_EQ(split_even(100, 4, 0, w),
            (std::vector<engine::Run>{{0, 0, 29}, {1, 29, 58}, {2, 58, 86}, {3, 86, 100}}));
}

TEST(PlanWeighted, NicsThatAreDownGetNothingWhateverTheirWeight) {
  const std::vector<bool> up{true, false, true, true};
  const std::vector<uint64_t> w{100, 1'000'000, 300, 0};
  auto s = plan_single_up(1 << 20, up, Routing::sharded(), 0, kParams, w);
  expect_exact_cover(s, 1 << 20);
  auto per = bytes_per_nic(s, 4);
  EXPECT_EQ(per[1], 0u);
  EXPECT_NEAR(static_cast<double>(per[0] * 3), static_cast<double>(per[2]), 3.0 * kParams.alignment)
      << "100 : 300";
  EXPECT_NEAR(static_cast<double>(per[3]), static_cast<double>(per[2]), kParams.alignment)
      << "unmeasured counts as the fastest that is up";
  auto runs = split_even_up(70, up, 0, w);
  size_t pages = 0;
  for (const engine::Run& r : runs) {
    EXPECT_NE(r.domain, 1u);
    pages += r.end - r.begin;
  }
  EXPECT_EQ(pages, 70u);
  // Pinned writes ignore the weights.
  EXPECT_EQ(plan_single_up(1 << 20, up, Routing::pinned(0), 0, kParams, w),
            plan_single_up(1 << 20, up, Routing::pinned(0), 0, kParams));
}

TEST(RateMeter, MeasuresOnlyWhileWritesArePosted) {
  using namespace std::chrono_literals;
  RateMeter m;
  const auto t0 = RateMeter::Clock::time_point{} + 1h;
  EXPECT_EQ(m.bytes_per_second(), 0u);
  m.posted(t0);
  EXPECT_FALSE(m.completed(1'000'000, t0 + 5ms, false)) << "a window spans at least kPeriod";
  EXPECT_TRUE(m.completed(1'000'000, t0 + 20ms, true));
  EXPECT_NEAR(static_cast<double>(m.bytes_per_second()), 100e6, 1.0)
      << "2 MB in 20 ms; the first sample is taken";
  // Ten idle seconds, then 1 MB in 20 ms (50 MB/s): the idle time does not count, and the
  // estimate moves towards the new sample by 1 - exp(-20 ms / kTau).
  m.posted(t0 + 10s);
  EXPECT_TRUE(m.completed(1'000'000, t0 + 10s + 20ms, true));
  const double alpha = 1 - std::exp(-0.02 / std::chrono::duration<double>(RateMeter::kTau).count());
  EXPECT_NEAR(static_cast<double>(m.bytes_per_second()), 100e6 - alpha * 50e6, 1e3);
  // A slower link, continuously busy for 2 s: the estimate converges on it.
  m.posted(t0 + 20s);
  for (int i = 1; i <= 100; ++i) m.completed(500'000, t0 + 20s + i * 20ms, i == 100);
  EXPECT_NEAR(static_cast<double>(m.bytes_per_second()), 25e6, 0.01 * 25e6);
  m.reset();
  EXPECT_EQ(m.bytes_per_second(), 0u);
}

}  // namespace
}  // namespace fabric::engine
