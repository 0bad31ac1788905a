// Holes an outside acceptance run found (docs/hardening.md, "Acceptance findings"), one test
// each, over every provider of this machine where the finding applies:
//   - unregister_memory() is a barrier: once it returns, no write of a peer lands in the memory,
//     counts its immediate or reports on_done;
//   - a write to a stale key fails alone, as kRemoteAccess, and takes no other write to the same
//     live peer down with it;
//   - close() is not starved by threads that keep submitting, and refuses them at once;
//   - GroupConfig::cpu below -2 is rejected.
#include <algorithm>
#include <cstring>
#include <limits>
#include <thread>

#include "reliability_support.h"

namespace fabric::testing {
namespace {

class Acceptance : public ::testing::TestWithParam<Backend> {};

constexpr std::byte kPoison{0x5A};

// Two engines of the parameter's provider: `a` writes, `b` owns the memory.
struct Pair {
  std::unique_ptr<TransferEngine> a, b;
};

Result<Pair> make_pair(const Backend& backend) {
  Config config = make_config(backend);
  config.peer_timeout = std::chrono::milliseconds(kSanitized ? 8000 : 3000);
  auto a = TransferEngine::create(config);
  if (!a) return a.status();
  auto b = TransferEngine::create(config);
  if (!b) return b.status();
  return Pair{std::move(*a), std::move(*b)};
}

#define PAIR_OR_SKIP(var)                                                          \
  auto var##_made = make_pair(GetParam());                                         \
  if (!var##_made && var##_made.status().code() == ErrorCode::kUnsupported) {      \
    GTEST_SKIP() << "provider not available: " << var##_made.status().to_string(); \
  }                                                                                \
  ASSERT_TRUE(var##_made) << var##_made.status().to_string();                      \
  Pair& var = *var##_made

bool check_pattern(const std::byte* p, uint64_t n, uint64_t seed) {
  std::vector<std::byte> want(n);
  fill_pattern(want.data(), n, seed);
  return std::memcmp(p, want.data(), n) == 0;
}

bool all_poison(const std::vector<std::byte>& v) {
  return std::all_of(v.begin(), v.end(), [](std::byte x) { return x == kPoison; });
}

// Register, unregister, then write to the stale descriptor at once, many times over and at
// several sizes: never on_done, never a byte in the memory, never a counted immediate.
TEST_P(Acceptance, WriteAfterUnregisterReturnsNeverLands) {
  PAIR_OR_SKIP(p);
  auto src = make_buffer(*p.a, 1 << 20);
  fill_pattern(src->bytes.data(), src->bytes.size(), 3);
  constexpr uint32_t kImm = 7001;
  int rounds = 0;
  for (uint64_t size : {uint64_t{16} << 10, uint64_t{64} << 10, uint64_t{1} << 20}) {
    for (int i = 0; i < 8; ++i, ++rounds) {
      std::vector<std::byte> memory(size, kPoison);
      auto reg = p.b->register_memory(memory.data(), memory.size());
      ASSERT_TRUE(reg) << reg.status().to_string();
      ASSERT_TRUE(p.b->unregister_memory(reg->handle));
      Probe probe;
      auto id = p.a->submit(SingleWrite{src->reg.handle, 0, reg->descriptor, 0, size, kImm},
                            probe.callbacks());
      ASSERT_TRUE(id) << id.status().to_string();
      Status s = probe.wait(30s);
      ASSERT_NE(s.code(), ErrorCode::kTimeout) << "size " << size;
      EXPECT_FALSE(s.is_ok()) << "a write to an unregistered region reported on_done (size " << size
                              << ", round " << i << ")";
      EXPECT_EQ(s.code(), ErrorCode::kRemoteAccess) << s.to_string();
      EXPECT_TRUE(all_poison(memory)) << "a write landed after unregister returned";
    }
  }
  EXPECT_EQ(p.b->imm_count(kImm), 0u) << "an immediate of a refused write was counted";
  // The pair still works.
  auto dst = make_buffer(*p.b, 4096);
  Probe ok;
  ASSERT_TRUE(p.a->submit(SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, 4096, kImm + 1},
                          ok.callbacks()));
  EXPECT_TRUE(ok.wait(30s)) << rounds << " stale writes before";
  EXPECT_TRUE(check_pattern(dst->bytes.data(), 4096, 3));
}

// A peer streams writes into a region while its owner unregisters it: once unregister_memory()
// returns, the memory does not change any more, whatever the writer still sends.
TEST_P(Acceptance, UnregisterUnderAStreamOfWritesIsABarrier) {
  PAIR_OR_SKIP(p);
  constexpr uint64_t kSize = 64 << 10;
  auto src = make_buffer(*p.a, kSize);
  fill_pattern(src->bytes.data(), kSize, 11);
  std::vector<std::byte> memory(kSize, kPoison);
  auto reg = p.b->register_memory(memory.data(), memory.size());
  ASSERT_TRUE(reg);
  std::atomic<bool> stop{false};
  Tally tally;
  std::thread writer([&] {
    for (int i = 0; i < 20000 && !stop.load(); ++i) {
      auto id = p.a->submit(SingleWrite{src->reg.handle, 0, reg->descriptor, 0, kSize, 0},
                            tally.callbacks());
      if (!id) break;
      if (i % 16 == 15) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_TRUE(p.b->unregister_memory(reg->handle));
  // Whatever landed before is the writer's pattern; from here on, nothing changes.
  std::vector<std::byte> snapshot = memory;
  std::fill(memory.begin(), memory.end(), kPoison);
  std::this_thread::sleep_for(std::chrono::milliseconds(300 * kSlowdown));
  stop.store(true);
  writer.join();
  EXPECT_TRUE(all_poison(memory)) << "memory changed after unregister_memory() returned";
  EXPECT_TRUE(all_poison(snapshot) || check_pattern(snapshot.data(), kSize, 11));
  ASSERT_TRUE(tally.wait_total(tally.done() + tally.failed(), 1s));
  p.a->close();
  tally.seal();
  EXPECT_EQ(tally.twice(), 0);
  EXPECT_GT(tally.done(), 0) << tally.summary();
  for (auto [code, n] : tally.codes()) {
    EXPECT_TRUE(code == ErrorCode::kRemoteAccess || code == ErrorCode::kCancelled)
        << n << " x " << to_string(code) << ": " << tally.summary();
  }
}

// One stale write among many valid ones to the same live peer: the valid ones all complete with
// their data, and the stale one alone fails, as kRemoteAccess, every time.
TEST_P(Acceptance, StaleWriteFailsAloneAndSparesTheOthers) {
  PAIR_OR_SKIP(p);
  constexpr int kValid = 64;
  for (uint64_t size : {uint64_t{16} << 10, uint64_t{64} << 10, uint64_t{512} << 10}) {
    auto src = make_buffer(*p.a, size);
    fill_pattern(src->bytes.data(), size, static_cast<uint32_t>(size));
    auto live = make_buffer(*p.b, size * kValid);
    std::vector<std::byte> stale_memory(size, kPoison);
    auto stale = p.b->register_memory(stale_memory.data(), size);
    ASSERT_TRUE(stale);
    ASSERT_TRUE(p.b->unregister_memory(stale->handle));
    const uint32_t imm = 7100 + static_cast<uint32_t>(size >> 10);
    Tally valid;
    Probe bad;
    for (int i = 0; i < kValid; ++i) {
      ASSERT_TRUE(p.a->submit(SingleWrite{src->reg.handle, 0, live->reg.descriptor,
                                          static_cast<uint64_t>(i) * size, size, imm},
                              valid.callbacks()));
      if (i == kValid / 4) {
        ASSERT_TRUE(p.a->submit(SingleWrite{src->reg.handle, 0, stale->descriptor, 0, size, imm},
                                bad.callbacks()));
      }
    }
    ASSERT_TRUE(valid.wait_total(kValid, 60s)) << valid.summary();
    Status s = bad.wait(30s);
    EXPECT_EQ(valid.done(), kValid) << "size " << size << ": " << valid.summary();
    EXPECT_EQ(s.code(), ErrorCode::kRemoteAccess) << "size " << size << ": " << s.to_string();
    EXPECT_TRUE(all_poison(stale_memory));
    for (int i = 0; i < kValid; ++i) {
      ASSERT_TRUE(check_pattern(live->bytes.data() + static_cast<uint64_t>(i) * size, size,
                                static_cast<uint32_t>(size)))
          << "write " << i << " of size " << size;
    }
    EXPECT_TRUE(p.b->wait_imm(imm, kValid, 10s));
    EXPECT_EQ(p.b->imm_count(imm), static_cast<uint64_t>(kValid));
    // And the next write goes through.
    Probe next;
    ASSERT_TRUE(p.a->submit(SingleWrite{src->reg.handle, 0, live->reg.descriptor, 0, size, 0},
                            next.callbacks()));
    EXPECT_TRUE(next.wait(30s)) << "size " << size;
  }
}

// Four threads submit without pause; close() still returns within its bound, every submission
// that starts once close() has begun returns kClosed, and no callback runs twice or after it.
TEST_P(Acceptance, CloseIsNotStarvedBySubmittingThreads) {
  PAIR_OR_SKIP(p);
  auto src = make_buffer(*p.a, 4096);
  auto dst = make_buffer(*p.b, 4096);
  Tally tally;
  std::atomic<bool> closing{false};
  std::atomic<int64_t> accepted_after{0}, closed_refusals{0}, other_refusals{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 2'000'000; ++i) {
        const bool after = closing.load();
        auto id = p.a->submit(SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, 64, 0},
                              tally.callbacks());
        if (id) {
          if (after) ++accepted_after;
        } else if (id.status().code() == ErrorCode::kClosed) {
          ++closed_refusals;
          if (closed_refusals.load() > 1000) return;
        } else {
          ++other_refusals;
          return;
        }
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  closing.store(true);
  const auto t0 = Clock::now();
  p.a->close();
  const auto took = Clock::now() - t0;
  tally.seal();
  for (auto& t : threads) t.join();
  const auto bound = Config{}.close_timeout + std::chrono::seconds(2 * kSlowdown);
  EXPECT_LT(took, bound) << "close() took "
                         << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
                         << " ms";
  // A submission that read `closing` false may still race close()'s start; one per thread at
  // most can have been accepted after the flag.
  EXPECT_LE(accepted_after.load(), 4);
  EXPECT_GT(closed_refusals.load(), 0);
  EXPECT_EQ(other_refusals.load(), 0);
  EXPECT_EQ(tally.twice(), 0);
  EXPECT_EQ(tally.after_seal(), 0);
}

INSTANTIATE_TEST_SUITE_P(Providers, Acceptance,
                         ::testing::Values(Backend{"tcp", "tcp", false},
                                           Backend{"shm", "shm", false}),
                         backend_name);

TEST(AcceptanceConfig, NegativeCpuOtherThanAutoOrNoneIsRejected) {
  for (int cpu : {-7, -3, std::numeric_limits<int>::min()}) {
    Config config = make_config(Backend{"tcp", "tcp", false});
    config.groups[0].cpu = cpu;
    auto e = TransferEngine::create(config);
    ASSERT_FALSE(e) << "cpu " << cpu << " was accepted";
    EXPECT_EQ(e.status().code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(e.status().message().find("cpu is " + std::to_string(cpu)), std::string::npos)
        << e.status().message();
  }
  for (int cpu : {GroupConfig::kCpuAuto, GroupConfig::kCpuNone}) {
    Config config = make_config(Backend{"tcp", "tcp", false});
    config.groups[0].cpu = cpu;
    auto e = TransferEngine::create(config);
    EXPECT_TRUE(e) << e.status().to_string();
  }
}

}  // namespace
}  // namespace fabric::testing
