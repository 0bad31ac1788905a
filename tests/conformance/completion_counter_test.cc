// CompletionCounter (Callbacks::counter): transfers given a counter are counted by the worker as
// they end — done, failed with the first error kept, before on_done runs when both are set —
// and in a caller-driven group on the thread calling progress(), with no callback thread
// involved.
#include <atomic>
#include <thread>

#include "test_support.h"

namespace fabric::testing {
namespace {

class Counters : public ::testing::TestWithParam<Backend> {};

TEST_P(Counters, CountsDoneAndFailedWithTheFirstError) {
  FABRIC_ENGINE_OR_SKIP(a, make_config(GetParam()));
  FABRIC_ENGINE_OR_SKIP(b, make_config(GetParam()));
  constexpr uint64_t kBytes = 4096;
  constexpr int kWrites = 200;
  auto src = make_buffer(*a, kBytes);
  auto dst = make_buffer(*b, kBytes * kWrites);
  fill_pattern(src->bytes.data(), kBytes, 3);
  CompletionCounter counter;
  for (int i = 0; i < kWrites; ++i) {
    ASSERT_TRUE(
        a->submit(SingleWrite{src->reg.handle, 0, dst->reg.descriptor, kBytes * i, kBytes, 9, {}},
                  counter.callbacks()));
  }
  ASSERT_TRUE(counter.wait(kWrites, std::chrono::seconds(20))) << counter.ended();
  EXPECT_EQ(counter.done(), uint64_t{kWrites});
  EXPECT_EQ(counter.failed(), 0u);
  EXPECT_TRUE(counter.first_error().is_ok());
  EXPECT_TRUE(b->wait_imm(9, kWrites, std::chrono::seconds(5)));
  for (int i = 0; i < kWrites; ++i) {
    ASSERT_EQ(fnv1a(dst->bytes.data() + kBytes * i, kBytes), fnv1a(src->bytes.data(), kBytes));
  }

  // A write to a region unregistered since: failed, its error kept; on_done and the counter
  // together: the count is there before on_done runs.
  std::vector<std::byte> gone(kBytes);
  auto reg = b->register_memory(gone.data(), gone.size());
  ASSERT_TRUE(reg);
  ASSERT_TRUE(b->unregister_memory(reg->handle));
  ASSERT_TRUE(a->submit(SingleWrite{src->reg.handle, 0, reg->descriptor, 0, kBytes, {}, {}},
                        counter.callbacks()));
  ASSERT_TRUE(counter.wait(kWrites + 1, std::chrono::seconds(20)));
  EXPECT_EQ(counter.failed(), 1u);
  EXPECT_EQ(counter.first_error().code(), ErrorCode::kRemoteAccess);
  std::atomic<uint64_t> seen_in_on_done{0};
  Callbacks both;
  both.counter = &counter;
  both.on_done = [&] { seen_in_on_done.store(counter.done()); };
  ASSERT_TRUE(a->submit(SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, kBytes, {}, {}},
                        std::move(both)));
  ASSERT_TRUE(counter.wait(kWrites + 2, std::chrono::seconds(20)));
  for (int i = 0; i < 2000 && seen_in_on_done.load() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(seen_in_on_done.load(), uint64_t{kWrites + 1}) << "on_done ran before the count";
  EXPECT_FALSE(counter.wait(kWrites + 3, std::chrono::milliseconds(5))) << "a count too many";
  a->close();
  b->close();
}

TEST_P(Counters, CallerDrivenGroupCountsOnTheProgressThread) {
  Config ca = make_config(GetParam());
  ca.groups[0].caller_progress = true;
  FABRIC_ENGINE_OR_SKIP(a, ca);
  FABRIC_ENGINE_OR_SKIP(b, make_config(GetParam()));
  constexpr uint64_t kBytes = 1024;
  constexpr int kWrites = 100;
  auto src = make_buffer(*a, kBytes);
  auto dst = make_buffer(*b, kBytes);
  CompletionCounter counter;
  for (int i = 0; i < kWrites; ++i) {
    ASSERT_TRUE(a->submit(SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, kBytes, {}, {}},
                          counter.callbacks()));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(counter.ended(), 0u) << "counted with nobody driving the group";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (counter.ended() < kWrites && std::chrono::steady_clock::now() < deadline) a->progress();
  EXPECT_EQ(counter.done(), uint64_t{kWrites});
  a->close();
  b->close();
}

INSTANTIATE_TEST_SUITE_P(AllBackends, Counters, ::testing::ValuesIn(all_backends()), backend_name);

}  // namespace
}  // namespace fabric::testing
