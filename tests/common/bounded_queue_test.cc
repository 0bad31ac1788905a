// BoundedQueue (src/common/bounded_queue.h): order, full and empty answers, wrap-around, and
// many threads pushing and popping at once with every value delivered exactly once.
#include "common/bounded_queue.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace fabric {
namespace {

TEST(BoundedQueue, CapacityIsAPowerOfTwoOfAtLeastTwo) {
  EXPECT_EQ(BoundedQueue<int>(0).capacity(), 2u);
  EXPECT_EQ(BoundedQueue<int>(1).capacity(), 2u);
  EXPECT_EQ(BoundedQueue<int>(3).capacity(), 4u);
  EXPECT_EQ(BoundedQueue<int>(1024).capacity(), 1024u);
  EXPECT_EQ(BoundedQueue<int>(1025).capacity(), 2048u);
}

TEST(BoundedQueue, FullAndEmptyAreAnswersAndOrderIsKept) {
  BoundedQueue<int> q(4);
  int out = -1;
  EXPECT_TRUE(q.empty_hint());
  EXPECT_FALSE(q.try_pop(out));
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(q.try_push(i));
  EXPECT_FALSE(q.try_push(99)) << "a full queue refuses, and keeps what it holds";
  EXPECT_FALSE(q.empty_hint());
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(q.try_pop(out));
    EXPECT_EQ(out, i);
  }
  EXPECT_FALSE(q.try_pop(out));
  EXPECT_TRUE(q.empty_hint());
}

TEST(BoundedQueue, WrapsAroundForManyLaps) {
  BoundedQueue<uint64_t> q(8);
  uint64_t next_in = 0;
  uint64_t next_out = 0;
  for (int round = 0; round < 10000; ++round) {
    const int n = 1 + round % 8;
    for (int i = 0; i < n; ++i) ASSERT_TRUE(q.try_push(next_in++));
    for (int i = 0; i < n; ++i) {
      uint64_t v = 0;
      ASSERT_TRUE(q.try_pop(v));
      ASSERT_EQ(v, next_out++);
    }
  }
  EXPECT_TRUE(q.empty_hint());
}

// Values are (producer << 32) | sequence, so the consumer can check each producer's order.
constexpr uint64_t value_of(uint64_t producer, uint64_t seq) {
  return producer << 32 | seq;
}

void many_producers_one_consumer(size_t capacity, int producers, uint64_t per_producer) {
  BoundedQueue<uint64_t> q(capacity);
  std::atomic<uint64_t> full_answers{0};
  std::vector<std::thread> threads;
  for (int p = 0; p < producers; ++p) {
    threads.emplace_back([&, p] {
      for (uint64_t i = 0; i < per_producer; ++i) {
        while (!q.try_push(value_of(p, i))) {
          full_answers.fetch_add(1, std::memory_order_relaxed);
          std::this_thread::yield();
        }
      }
    });
  }
  std::vector<uint64_t> next(producers, 0);
  uint64_t received = 0;
  const uint64_t total = per_producer * producers;
  while (received < total) {
    uint64_t v = 0;
    if (!q.try_pop(v)) {
      std::this_thread::yield();
      continue;
    }
    const uint64_t p = v >> 32;
    ASSERT_LT(p, static_cast<uint64_t>(producers));
    ASSERT_EQ(v & 0xffffffffu, next[p]) << "producer " << p << "'s values out of order";
    ++next[p];
    ++received;
  }
  for (auto& t : threads) t.join();
  uint64_t extra = 0;
  EXPECT_FALSE(q.try_pop(extra)) << "a value beyond what was pushed";
  for (int p = 0; p < producers; ++p) EXPECT_EQ(next[p], per_producer);
  if (capacity <= 2) {
    EXPECT_GT(full_answers.load(), 0u) << "the tiny queue was never full";
  }
}

TEST(BoundedQueue, ManyProducersOneConsumerKeepEachProducersOrder) {
  many_producers_one_consumer(1024, 4, 200000);
}

TEST(BoundedQueue, AFullQueueLosesNothing) {
  many_producers_one_consumer(2, 4, 50000);
}

TEST(BoundedQueue, ManyProducersManyConsumersDeliverEachValueOnce) {
  constexpr int kProducers = 3;
  constexpr int kConsumers = 3;
  constexpr uint64_t kPer = 100000;
  BoundedQueue<uint64_t> q(64);
  std::vector<std::atomic<uint8_t>> seen(kProducers * kPer);
  std::atomic<uint64_t> taken{0};
  std::vector<std::thread> threads;
  for (int p = 0; p < kProducers; ++p) {
    threads.emplace_back([&, p] {
      for (uint64_t i = 0; i < kPer; ++i) {
        while (!q.try_push(p * kPer + i)) std::this_thread::yield();
      }
    });
  }
  for (int c = 0; c < kConsumers; ++c) {
    threads.emplace_back([&] {
      while (taken.load() < kProducers * kPer) {
        uint64_t v = 0;
        if (!q.try_pop(v)) {
          std::this_thread::yield();
          continue;
        }
        seen[v].fetch_add(1);
        taken.fetch_add(1);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(taken.load(), kProducers * kPer);
  uint64_t wrong = 0;
  for (auto& s : seen) wrong += s.load() != 1;
  EXPECT_EQ(wrong, 0u) << "values delivered other than exactly once";
}

}  // namespace
}  // namespace fabric
