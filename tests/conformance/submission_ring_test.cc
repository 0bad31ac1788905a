// The submission ring (Worker::submit, Config::submission_ring): many threads submitting at once
// each get every transfer completed exactly once with the bytes and the immediates all there; a
// ring too small for them overflows into the locked list without losing or repeating anything;
// and close() while threads keep pushing ends every accepted transfer exactly once, refuses the
// rest, and returns.
#include <atomic>
#include <thread>
#include <vector>

#include "test_support.h"

namespace fabric::testing {
namespace {

class SubmissionRing : public ::testing::TestWithParam<Backend> {};

constexpr int kThreads = 4;
constexpr uint64_t kSlot = 1024;  // bytes each write carries, at its own offset

// kThreads threads each submit `per_thread` single writes with immediate 7 into their own slots
// of the destination; returns the submitting engine's stats afterwards.
GroupStats push_from_many_threads(TransferEngine& a, TransferEngine& b, int per_thread) {
  const uint64_t bytes = kSlot * kThreads * per_thread;
  auto src = make_buffer(a, bytes);
  auto dst = make_buffer(b, bytes);
  fill_pattern(src->bytes.data(), bytes, 5);
  Counter c;
  std::vector<std::thread> threads;
  std::atomic<int> refused{0};
  for (int k = 0; k < kThreads; ++k) {
    threads.emplace_back([&, k] {
      for (int i = 0; i < per_thread; ++i) {
        const uint64_t off = (static_cast<uint64_t>(k) * per_thread + i) * kSlot;
        if (!a.submit(SingleWrite{src->reg.handle, off, dst->reg.descriptor, off, kSlot, 7, {}},
                      c.callbacks())) {
          refused.fetch_add(1);
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  const int total = kThreads * per_thread;
  EXPECT_EQ(refused.load(), 0);
  EXPECT_TRUE(c.wait_total(total)) << c.done() << " done, " << c.failed() << " failed";
  EXPECT_EQ(c.done(), total);
  EXPECT_EQ(c.failed(), 0) << c.first_error().to_string();
  EXPECT_TRUE(b.wait_imm(7, static_cast<uint64_t>(total), std::chrono::seconds(20)));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // a surplus would arrive by now
  EXPECT_FALSE(b.wait_imm(7, static_cast<uint64_t>(total) + 1, std::chrono::milliseconds(0)))
      << "more immediates than transfers";
  EXPECT_EQ(fnv1a(dst->bytes.data(), bytes), fnv1a(src->bytes.data(), bytes));
  return a.stats().groups[0];
}

TEST_P(SubmissionRing, ManyProducersEachTransferCompletesOnce) {
  FABRIC_ENGINE_OR_SKIP(a, make_config(GetParam()));
  FABRIC_ENGINE_OR_SKIP(b, make_config(GetParam()));
  const GroupStats g = push_from_many_threads(*a, *b, 1500);
  EXPECT_EQ(g.transfers_completed, kThreads * 1500u);
  EXPECT_EQ(g.in_flight, 0u);
}

TEST_P(SubmissionRing, AFullRingOverflowsWithoutLoss) {
  Config config = make_config(GetParam());
  config.submission_ring = 2;  // full at once under four producers
  FABRIC_ENGINE_OR_SKIP(a, config);
  FABRIC_ENGINE_OR_SKIP(b, make_config(GetParam()));
  const GroupStats g = push_from_many_threads(*a, *b, 1500);
  EXPECT_GT(g.submissions_ring_full, 0u) << "the two-slot ring never overflowed";
  EXPECT_EQ(g.transfers_completed, kThreads * 1500u);
}

TEST_P(SubmissionRing, CloseWhileProducersPushEndsEveryAcceptedTransferOnce) {
  Config config = make_config(GetParam());
  config.submission_ring = 64;
  FABRIC_ENGINE_OR_SKIP(a, config);
  FABRIC_ENGINE_OR_SKIP(b, make_config(GetParam()));
  auto src = make_buffer(*a, kSlot);
  auto dst = make_buffer(*b, kSlot);
  Counter c;
  std::atomic<int> accepted{0};
  std::atomic<int> closed{0};
  std::atomic<int> other{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int k = 0; k < kThreads; ++k) {
    threads.emplace_back([&] {
      while (!go.load()) std::this_thread::yield();
      // Bounded: close() ends it, and so does the count.
      for (int i = 0; i < 200000; ++i) {
        auto r = a->submit(SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, kSlot, {}, {}},
                           c.callbacks());
        if (r) {
          accepted.fetch_add(1);
        } else if (r.status().code() == ErrorCode::kClosed) {
          closed.fetch_add(1);
          return;
        } else {
          other.fetch_add(1);
          return;
        }
      }
    });
  }
  go.store(true);
  while (accepted.load() < 2000) std::this_thread::yield();
  a->close();
  for (auto& t : threads) t.join();
  EXPECT_EQ(other.load(), 0) << "a submission failed other than with kClosed";
  EXPECT_EQ(closed.load(), kThreads) << "a producer never saw the engine closed";
  // close() returns after every accepted transfer's callback ran.
  EXPECT_EQ(c.done() + c.failed(), accepted.load());
  if (c.failed() > 0) {
    EXPECT_EQ(c.first_error().code(), ErrorCode::kCancelled);
  }
}

INSTANTIATE_TEST_SUITE_P(AllBackends, SubmissionRing, ::testing::ValuesIn(all_backends()),
                         backend_name);

}  // namespace
}  // namespace fabric::testing
