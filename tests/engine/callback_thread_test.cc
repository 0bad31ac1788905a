// CallbackThread: order, exactly-once, draining on stop, with and without polling between
// batches.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "engine/callback_thread.h"

namespace fabric::engine {
namespace {

class CallbackThreadTest : public ::testing::TestWithParam<int> {};

TEST_P(CallbackThreadTest, RunsEveryJobOnceInOrderAcrossBatchesAndPauses) {
  static constexpr int kJobs = 3000;
  std::vector<int> seen;  // touched only on the callback thread until drain_and_stop returns
  {
    CallbackThread cb{std::chrono::microseconds(GetParam())};
    std::thread producer([&] {
      std::vector<CallbackThread::Job> batch;
      for (int i = 0; i < kJobs; ++i) {
        batch.push_back([&seen, i] { seen.push_back(i); });
        if (i % 7 == 0) cb.push(batch);  // a batch, as the worker pushes them
        if (i % 500 == 0) {              // a pause longer than the polling
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
      }
      cb.push(batch);
    });
    producer.join();
    cb.push([&seen] { seen.push_back(kJobs); });  // a single job, after the thread slept
    cb.drain_and_stop();
    EXPECT_FALSE(cb.on_this_thread());
  }
  ASSERT_EQ(seen.size(), static_cast<size_t>(kJobs + 1));
  for (int i = 0; i <= kJobs; ++i) ASSERT_EQ(seen[static_cast<size_t>(i)], i) << "job " << i;
}

TEST_P(CallbackThreadTest, AJobQueuedByAJobRunsBeforeStop) {
  std::atomic<int> ran{0};
  CallbackThread cb{std::chrono::microseconds(GetParam())};
  cb.push([&] {
    ran.fetch_add(1);
    cb.push([&] { ran.fetch_add(10); });
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  cb.drain_and_stop();
  EXPECT_EQ(ran.load(), 11);
}

INSTANTIATE_TEST_SUITE_P(Spin, CallbackThreadTest, ::testing::Values(0, 50, 5000),
                         [](const auto& info) { return "spin_us_" + std::to_string(info.param); });

}  // namespace
}  // namespace fabric::engine
