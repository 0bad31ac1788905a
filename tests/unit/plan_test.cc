// Sharding plans, including regressions for the reference's multi-NIC defects.
#include <gtest/gtest.h>

#include <numeric>

#include "engine/plan.h"

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

}  // namespace
}  // namespace fabric::engine
