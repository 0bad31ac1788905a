// Config::callbacks_on_worker: completion, expectation and unexpected-imm callbacks run on the
// worker thread; what they may call works, what would wait for the worker refuses at once; a
// throwing callback does not stop the worker. And Config::wait_spin: wait_imm still counts.
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <string>
#include <thread>

#include "test_support.h"

namespace fabric::testing {
namespace {

std::string thread_name() {
  char name[32] = {};
  pthread_getname_np(pthread_self(), name, sizeof(name));
  return name;
}

class WorkerCallbacks : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    Config c = make_config(GetParam());
    c.callbacks_on_worker = true;
    c.wait_spin = std::chrono::microseconds(200);
    auto ea = TransferEngine::create(c);
    if (!ea && ea.status().code() == ErrorCode::kUnsupported) {
      GTEST_SKIP() << "provider not available: " << ea.status().to_string();
    }
    ASSERT_TRUE(ea) << ea.status().to_string();
    auto eb = TransferEngine::create(c);
    ASSERT_TRUE(eb) << eb.status().to_string();
    a_ = std::move(*ea);
    b_ = std::move(*eb);
  }
  std::unique_ptr<TransferEngine> a_;
  std::unique_ptr<TransferEngine> b_;
};

TEST_P(WorkerCallbacks, CompletionAndExpectationRunOnTheWorker) {
  constexpr uint64_t kBytes = 64 << 10;
  auto src = make_buffer(*a_, kBytes);
  auto dst = make_buffer(*b_, kBytes);
  fill_pattern(src->bytes.data(), kBytes, 3);
  std::string done_on, expect_on;
  Probe done, arrived;
  auto arrived_cb = arrived.callbacks();
  ASSERT_TRUE(b_->expect_imm(41, 1, [&expect_on, arrived_cb] {
    expect_on = thread_name();
    arrived_cb.on_done();
  }));
  auto done_cb = done.callbacks();
  ASSERT_TRUE(a_->submit(SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, kBytes, 41, {}},
                         Callbacks{[&done_on, done_cb] {
                                     done_on = thread_name();
                                     done_cb.on_done();
                                   },
                                   done_cb.on_error}));
  ASSERT_TRUE(done.wait());
  ASSERT_TRUE(arrived.wait());
  EXPECT_EQ(done_on, "fabric-w0");
  EXPECT_EQ(expect_on, "fabric-w0");
  EXPECT_EQ(fnv1a(dst->bytes.data(), kBytes), fnv1a(src->bytes.data(), kBytes));
}

// An imm round trip with the answer sent from the unexpected-imm handler, on b's worker.
TEST_P(WorkerCallbacks, UnexpectedHandlerAnswersFromTheWorker) {
  std::atomic<int> answered{0};
  std::string handler_on;
  const Address back = a_->address();
  TransferEngine* b = b_.get();
  b_->set_unexpected_imm_handler([&, b, back](uint32_t imm) {
    if (imm != 7) return;
    handler_on = thread_name();
    if (b->submit(ImmWrite{back, 8, 0, 0}, {})) answered.fetch_add(1);
  });
  constexpr int kRounds = 200;
  for (int k = 0; k < kRounds; ++k) {
    ASSERT_TRUE(a_->submit(ImmWrite{b_->address(), 7, 0, 0}, {}));
    ASSERT_TRUE(a_->wait_imm(8, static_cast<uint64_t>(k) + 1, std::chrono::seconds(20)))
        << "round " << k << ": " << a_->imm_count(8) << " answers";
  }
  EXPECT_EQ(answered.load(), kRounds);
  EXPECT_EQ(a_->imm_count(8), static_cast<uint64_t>(kRounds));
  EXPECT_EQ(handler_on, "fabric-w0");
}

// From a callback on the worker: calls that would wait for it refuse at once, with a reason;
// the engine keeps working afterwards.
TEST_P(WorkerCallbacks, CallsThatWouldWaitForTheWorkerRefuse) {
  auto src = make_buffer(*a_, 4096);
  auto dst = make_buffer(*b_, 4096);
  std::vector<std::byte> other(4096);
  Status reg, unreg;
  bool waited = true;
  Probe done;
  auto done_cb = done.callbacks();
  TransferEngine* a = a_.get();
  const MemoryHandle handle = src->reg.handle;
  ASSERT_TRUE(a_->submit(SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, 4096, 42, {}},
                         Callbacks{[&, a, handle, done_cb] {
                                     auto r = a->register_memory(other.data(), other.size());
                                     reg = r.status();
                                     unreg = a->unregister_memory(handle);
                                     waited = a->wait_imm(999, 1, std::chrono::seconds(5));
                                     a->close();  // logged and ignored
                                     done_cb.on_done();
                                   },
                                   done_cb.on_error}));
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(done.wait());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4))
      << "wait_imm waited on the worker";
  EXPECT_EQ(reg.code(), ErrorCode::kInvalidArgument) << reg.to_string();
  EXPECT_NE(reg.message().find("callbacks_on_worker"), std::string::npos) << reg.to_string();
  EXPECT_EQ(unreg.code(), ErrorCode::kInvalidArgument) << unreg.to_string();
  EXPECT_FALSE(waited);
  // Still open and serving: the region was not unregistered, and writes go on.
  Probe again;
  ASSERT_TRUE(a_->submit(SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, 4096, 43, {}},
                         again.callbacks()));
  EXPECT_TRUE(again.wait());
  EXPECT_TRUE(a_->unregister_memory(src->reg.handle));
}

TEST_P(WorkerCallbacks, ThrowingCallbackDoesNotStopTheWorker) {
  auto src = make_buffer(*a_, 4096);
  auto dst = make_buffer(*b_, 4096);
  ASSERT_TRUE(a_->submit(
      SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, 4096, 44, {}},
      Callbacks{[] { throw std::runtime_error("from a test callback"); }, [](const Status&) {}}));
  for (int i = 0; i < 10; ++i) {
    Probe p;
    ASSERT_TRUE(a_->submit(SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, 4096, 45, {}},
                           p.callbacks()));
    ASSERT_TRUE(p.wait());
  }
  EXPECT_TRUE(b_->wait_imm(45, 10, std::chrono::seconds(20)));
}

// The spins in effect: a set one as set, an unset one resolved from the CPUs this process may
// use (Config::auto_spin), and a negative one refused at creation, naming the fields.
TEST_P(WorkerCallbacks, SpinsInEffectAreReportedAndNegativeOnesRefused) {
  EXPECT_EQ(a_->stats().wait_spin.count(), 200);  // set by SetUp
  Config c = make_config(GetParam());
  auto e = TransferEngine::create(c);
  ASSERT_TRUE(e) << e.status().to_string();
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  const auto expected = Config::auto_spin(static_cast<size_t>(CPU_COUNT(&set)));
  const EngineStats st = (*e)->stats();
  EXPECT_EQ(st.callback_spin, expected);
  EXPECT_EQ(st.wait_spin, expected);
  c.callback_spin = std::chrono::microseconds(-5);
  auto bad = TransferEngine::create(c);
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("callback_spin"), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(AllBackends, WorkerCallbacks, ::testing::ValuesIn(all_backends()),
                         backend_name);

}  // namespace
}  // namespace fabric::testing
