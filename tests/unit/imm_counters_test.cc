#include "engine/imm_counters.h"

#include <gtest/gtest.h>

#include <thread>

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

}  // namespace
}  // namespace fabric::engine
