// Conformance: TransferEngine::stats() counts what was posted. The worker's counts (work
// requests per NIC, errors by code, passes, sleeps and wake-ups, the completion-time histogram)
// equal what the test submitted, on every provider present, plain and reordered.
#include <numeric>
#include <thread>

#include "test_support.h"

namespace fabric::testing {
namespace {

class Stats : public ::testing::TestWithParam<Backend> {};

uint64_t user_work_requests(const GroupStats& g) {
  uint64_t posted = 0;
  for (const NicStats& n : g.nics) posted += n.work_requests_posted;
  return posted - g.internal_work_requests_posted;
}

TEST_P(Stats, CountsEqualWhatWasPosted) {
  FABRIC_ENGINE_OR_SKIP(ea, make_config(GetParam()));
  FABRIC_ENGINE_OR_SKIP(eb, make_config(GetParam()));
  TransferEngine& a = *ea;
  TransferEngine& b = *eb;
  constexpr uint64_t kPage = 4096;
  constexpr uint32_t kPages = 16;
  constexpr int kSingles = 10;
  auto src = make_buffer(a, kPage * kPages);
  auto dst = make_buffer(b, kPage * kPages);
  fill_pattern(src->bytes.data(), src->bytes.size(), 9);
  const GroupStats before = a.stats().groups[0];
  ASSERT_EQ(before.nics.size(), 1u);
  EXPECT_EQ(user_work_requests(before), 0u);
  EXPECT_GT(before.worker_passes, 0u);

  // Let the worker fall asleep (spin_time 50 us), so that the next submission wakes it.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::vector<std::unique_ptr<Probe>> probes;
  auto submit = [&](auto&& request) {
    probes.push_back(std::make_unique<Probe>());
    ASSERT_TRUE(a.submit(request, probes.back()->callbacks()));
  };
  for (int i = 0; i < kSingles; ++i) {
    submit(SingleWrite{
        src->reg.handle, kPage * i, dst->reg.descriptor, kPage * i, kPage, std::nullopt, {}});
  }
  std::vector<uint32_t> pages(kPages);
  std::iota(pages.begin(), pages.end(), 0);
  submit(PagedWrite{src->reg.handle, dst->reg.descriptor, kPage, pages, kPage, 0, pages, kPage, 0,
                    std::nullopt});
  submit(ImmWrite{b.address(), 41});
  for (auto& p : probes) ASSERT_TRUE(p->wait());
  EXPECT_EQ(fnv1a(dst->bytes.data(), dst->bytes.size()),
            fnv1a(src->bytes.data(), src->bytes.size()));

  const GroupStats g = a.stats().groups[0];
  EXPECT_EQ(user_work_requests(g), kSingles + kPages + 1u)
      << "one work request per single write, per page, and the imm-only write";
  const NicStats& nic = g.nics[0];
  EXPECT_EQ(nic.work_requests_failed, 0u);
  EXPECT_GE(nic.work_requests_completed, user_work_requests(g));
  EXPECT_LE(nic.work_requests_completed, nic.work_requests_posted);
  EXPECT_EQ(g.transfers_completed - before.transfers_completed, kSingles + 2u);
  EXPECT_EQ(g.in_flight, 0u);
  const uint64_t timed = std::accumulate(g.completion_latency.counts.begin(),
                                         g.completion_latency.counts.end(), uint64_t{0});
  EXPECT_EQ(timed, kSingles + 2u) << "one completion time per transfer";
  EXPECT_GT(g.worker_passes, before.worker_passes);
  EXPECT_GT(g.worker_sleeps, 0u) << "the worker never slept, though idle for 50 ms";
  EXPECT_GT(g.worker_wakeups, 0u) << "no submission woke the sleeping worker";
  EXPECT_LE(g.worker_wakeups, g.worker_sleeps) << "at most one wake-up per sleep";
  for (uint64_t n : g.errors_by_code) EXPECT_EQ(n, 0u);

  // A write to an unregistered region fails as kRemoteAccess, and is counted so.
  std::vector<std::byte> gone(kPage);
  auto reg = b.register_memory(gone.data(), gone.size());
  ASSERT_TRUE(reg) << reg.status().to_string();
  ASSERT_TRUE(b.unregister_memory(reg->handle));
  Probe stale;
  ASSERT_TRUE(a.submit(SingleWrite{src->reg.handle, 0, reg->descriptor, 0, kPage, 42, {}},
                       stale.callbacks()));
  EXPECT_EQ(stale.wait().code(), ErrorCode::kRemoteAccess);
  const GroupStats after = a.stats().groups[0];
  EXPECT_EQ(after.errors_by_code[static_cast<size_t>(ErrorCode::kRemoteAccess)], 1u);
  EXPECT_EQ(after.transfers_failed, 1u);
  EXPECT_GE(after.nics[0].work_requests_failed, 1u);
  EXPECT_EQ(after.in_flight, 0u);
  a.close();
  b.close();
}

INSTANTIATE_TEST_SUITE_P(AllBackends, Stats, ::testing::ValuesIn(all_backends()), backend_name);

}  // namespace
}  // namespace fabric::testing
