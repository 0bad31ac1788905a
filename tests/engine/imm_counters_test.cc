#include "engine/imm_counters.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

namespace fabric::engine {
namespace {

using Jobs = std::vector<ImmCounters::Callback>;

TEST(ImmCounters, FiresOnceWhenCountReachedInAnyOrder) {
  ImmCounters c;
  Jobs due;
  std::vector<uint32_t> unexpected;
  int fired = 0;
  ASSERT_TRUE(c.expect(
      7, 3, [&] { ++fired; }, due));
  EXPECT_TRUE(due.empty());
  std::vector<uint32_t> arrivals = {7, 8, 7, 9};
  c.arrive(arrivals, due, unexpected);
  EXPECT_TRUE(due.empty());
  EXPECT_EQ(unexpected, (std::vector<uint32_t>{8, 9}));
  std::vector<uint32_t> more = {7, 7};
  c.arrive(more, due, unexpected);
  ASSERT_EQ(due.size(), 1u);
  due[0]();
  EXPECT_EQ(fired, 1);
  EXPECT_EQ(c.count(7), 4u);
  // The fourth arrival is unclaimed: an expectation of 1 is met at once.
  Jobs now;
  ASSERT_TRUE(c.expect(
      7, 1, [&] { ++fired; }, now));
  ASSERT_EQ(now.size(), 1u);
}

TEST(ImmCounters, ArrivalsBeforeTheExpectationCount) {
  ImmCounters c;
  Jobs due;
  std::vector<uint32_t> unexpected;
  std::vector<uint32_t> a = {1, 1};
  c.arrive(a, due, unexpected);
  ASSERT_TRUE(c.expect(
      1, 2, [] {}, due));
  EXPECT_EQ(due.size(), 1u);
}

TEST(ImmCounters, ErrorsNameTheProblem) {
  ImmCounters c;
  Jobs due;
  EXPECT_EQ(c.expect(
                 1, 0, [] {}, due)
                .code(),
            ErrorCode::kInvalidArgument);
  ASSERT_TRUE(c.expect(
      1, 5, [] {}, due));
  EXPECT_EQ(c.expect(
                 1, 5, [] {}, due)
                .code(),
            ErrorCode::kAlreadyExists);
  EXPECT_TRUE(c.cancel(1));
  EXPECT_EQ(c.cancel(1).code(), ErrorCode::kNotFound);
  Status empty = c.expect(2, 1, nullptr, due);
  EXPECT_EQ(empty.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(empty.message().find("callback is empty"), std::string::npos);
}

TEST(ImmCounters, CancelledExpectationNeverFires) {
  ImmCounters c;
  Jobs due;
  std::vector<uint32_t> unexpected;
  ASSERT_TRUE(c.expect(
      4, 1, [] { FAIL() << "cancelled callback ran"; }, due));
  ASSERT_TRUE(c.cancel(4));
  std::vector<uint32_t> a = {4};
  c.arrive(a, due, unexpected);
  EXPECT_TRUE(due.empty());
  EXPECT_EQ(unexpected.size(), 1u);
}

TEST(ImmCounters, WaitWakesOnArrivalAndTimesOut) {
  ImmCounters c;
  EXPECT_FALSE(c.wait(3, 1, std::chrono::milliseconds(20)));
  std::thread t([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    Jobs due;
    std::vector<uint32_t> unexpected, a = {3, 3};
    c.arrive(a, due, unexpected);
  });
  EXPECT_TRUE(c.wait(3, 2, std::chrono::seconds(10)));
  t.join();
  c.reset(3);
  EXPECT_EQ(c.count(3), 0u);
}

// Arrivals on two threads while a user thread re-arms an expectation round after round: every
// expectation fires exactly once, and the arrivals claimed equal the rounds times the count.
TEST(ImmCounters, ExpectationsFireExactlyOnceUnderConcurrentArrivals) {
  ImmCounters c;
  constexpr int kRounds = 3000;
  constexpr uint64_t kCount = 4;
  std::atomic<int> fired{0};
  std::vector<std::thread> arrivers;
  for (int k = 0; k < 2; ++k) {
    arrivers.emplace_back([&] {
      Jobs due;
      std::vector<uint32_t> unexpected;
      const uint32_t one[] = {11};
      for (uint64_t i = 0; i < kRounds * kCount / 2; ++i) {
        c.arrive(one, due, unexpected);
        for (auto& job : due) job();
        due.clear();
      }
    });
  }
  for (int round = 0; round < kRounds; ++round) {
    Jobs due;
    ASSERT_TRUE(c.expect(
        11, kCount, [&] { fired.fetch_add(1); }, due));
    for (auto& job : due) job();
    while (fired.load() < round + 1) std::this_thread::yield();
  }
  for (auto& t : arrivers) t.join();
  EXPECT_EQ(fired.load(), kRounds);
  EXPECT_EQ(c.count(11), kRounds * kCount);
  EXPECT_EQ(c.total(), kRounds * kCount);
  Jobs due;
  ASSERT_TRUE(c.expect(
      11, 1, [] {}, due));
  EXPECT_TRUE(due.empty()) << "an arrival was claimed twice or not at all";
}

// More distinct immediates than the table holds: the rest go to the overflow map, and counts,
// expectations and waits work the same there.
TEST(ImmCounters, MoreImmediatesThanSlotsOverflowCorrectly) {
  ImmCounters c(64);
  Jobs due;
  std::vector<uint32_t> unexpected;
  std::vector<uint32_t> imms;
  for (uint32_t i = 0; i < 1000; ++i) imms.push_back(i * 7919u);
  int fired = 0;
  for (uint32_t imm : imms)
    ASSERT_TRUE(c.expect(
        imm, 2, [&] { ++fired; }, due));
  c.arrive(imms, due, unexpected);
  EXPECT_TRUE(due.empty());
  EXPECT_TRUE(unexpected.empty());
  c.arrive(imms, due, unexpected);
  EXPECT_EQ(due.size(), imms.size());
  for (auto& job : due) job();
  EXPECT_EQ(fired, 1000);
  for (uint32_t imm : imms) ASSERT_EQ(c.count(imm), 2u) << imm;
  EXPECT_TRUE(c.wait(imms.back(), 2, std::chrono::milliseconds(0)));
  EXPECT_FALSE(c.wait(imms.back(), 3, std::chrono::milliseconds(1)));
  c.reset(imms.back());
  EXPECT_EQ(c.count(imms.back()), 0u);
  EXPECT_EQ(c.count(123456789), 0u) << "an immediate never seen";
}

}  // namespace
}  // namespace fabric::engine
