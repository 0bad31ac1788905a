// GroupConfig::caller_progress: no worker thread; the caller's threads drive each group with
// TransferEngine::progress(), callbacks run on them, and the blocking calls drive the group
// themselves while they wait.
#include <dirent.h>
#include <pthread.h>

#include <atomic>
#include <fstream>
#include <string>
#include <thread>

#include "test_support.h"

namespace fabric::testing {
namespace {

// Threads of this process whose name starts with "fabric-w" (the engine's worker threads).
int worker_threads() {
  int n = 0;
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return -1;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream comm(std::string("/proc/self/task/") + e->d_name + "/comm");
    std::string name;
    std::getline(comm, name);
    n += name.rfind("fabric-w", 0) == 0;
  }
  closedir(dir);
  return n;
}

// Drives `e` on a thread of its own until stopped; remembers that thread's id.
class Driver {
 public:
  explicit Driver(TransferEngine& e)
      : thread_([this, &e] {
          id_.store(std::hash<std::thread::id>{}(std::this_thread::get_id()));
          while (!stop_.load()) {
            if (e.progress()) passes_.fetch_add(1);
          }
        }) {}
  ~Driver() { stop(); }
  void stop() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
  }
  size_t id() const { return id_.load(); }
  uint64_t passes() const { return passes_.load(); }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<size_t> id_{0};
  std::atomic<uint64_t> passes_{0};
  std::thread thread_;
};

size_t this_thread_hash() {
  return std::hash<std::thread::id>{}(std::this_thread::get_id());
}

class Progress : public ::testing::TestWithParam<Backend> {
 protected:
  std::unique_ptr<TransferEngine> open(bool caller) {
    Config c = make_config(GetParam());
    c.groups[0].caller_progress = caller;
    auto e = TransferEngine::create(c);
    if (!e && e.status().code() == ErrorCode::kUnsupported) {
      skip_ = e.status().to_string();
      return nullptr;
    }
    EXPECT_TRUE(e) << e.status().to_string();
    return e ? std::move(*e) : nullptr;
  }
  std::string skip_;
};

#define OPEN_OR_SKIP(name, caller)                                         \
  auto name = open(caller);                                                \
  if (!skip_.empty()) GTEST_SKIP() << "provider not available: " << skip_; \
  ASSERT_TRUE(name)

TEST_P(Progress, NoWorkerThreadIsStarted) {
  const int before = worker_threads();
  OPEN_OR_SKIP(a, true);
  EXPECT_EQ(worker_threads(), before);
  OPEN_OR_SKIP(b, false);
  // The control: a worker-thread engine starts one (it names itself once running).
  for (int i = 0; i < 200 && worker_threads() == before; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(worker_threads(), before + 1);
  EXPECT_FALSE(b->progress()) << "progress() on a group with a worker thread does nothing";
  EXPECT_FALSE(a->progress(7)) << "no group 7";
}

// Two engines, each driven by a thread of its own: writes with immediates from a to b, data
// and counts exact; the callbacks ran on the driving threads.
TEST_P(Progress, TwoThreadsDriveTwoEngines) {
  OPEN_OR_SKIP(a, true);
  OPEN_OR_SKIP(b, true);
  constexpr uint64_t kBytes = 256 << 10;
  constexpr int kWrites = 64;
  auto src = make_buffer(*a, kBytes);  // register_memory drives the group itself
  auto dst = make_buffer(*b, kBytes);
  fill_pattern(src->bytes.data(), kBytes, 21);
  Driver da(*a), db(*b);
  std::atomic<size_t> expect_on{0}, done_on{0};
  std::atomic<int> done{0}, failed{0};
  Probe all;
  auto all_cb = all.callbacks();
  ASSERT_TRUE(b->expect_imm(77, kWrites, [&expect_on, all_cb] {
    expect_on.store(this_thread_hash());
    all_cb.on_done();
  }));
  const uint64_t piece = kBytes / kWrites;
  for (int i = 0; i < kWrites; ++i) {
    ASSERT_TRUE(a->submit(
        SingleWrite{src->reg.handle, i * piece, dst->reg.descriptor, i * piece, piece, 77, {}},
        Callbacks{[&] {
                    done_on.store(this_thread_hash());
                    done.fetch_add(1);
                  },
                  [&](const Status&) { failed.fetch_add(1); }}));
  }
  ASSERT_TRUE(all.wait(std::chrono::seconds(30)));
  for (int i = 0; i < 3000 && done.load() + failed.load() < kWrites; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(done.load(), kWrites);
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(b->imm_count(77), static_cast<uint64_t>(kWrites));
  EXPECT_EQ(fnv1a(dst->bytes.data(), kBytes), fnv1a(src->bytes.data(), kBytes));
  EXPECT_EQ(done_on.load(), da.id()) << "a's completions ran off its driving thread";
  EXPECT_EQ(expect_on.load(), db.id()) << "b's expectation ran off its driving thread";
  EXPECT_GT(da.passes(), 0u);
  // Unregister and close with no driving thread: they drive the group themselves. The writer
  // `a` is still driven while `b` unregisters: where the provider checks a key once per write
  // (tcp), b's unregistration waits for its writers to answer a write fence, and a caller-driven
  // writer answers only while some thread drives it (docs/engine.md, "Caller-driven progress").
  db.stop();
  EXPECT_TRUE(b->unregister_memory(dst->reg.handle));
  da.stop();
  EXPECT_TRUE(a->unregister_memory(src->reg.handle));
  a->close();
  b->close();
  EXPECT_FALSE(a->progress()) << "progress() after close";
}

// No thread drives the receiver: its wait_imm does, and the writer (a worker-thread engine)
// completes because the receiver's wait made it progress.
TEST_P(Progress, WaitImmDrivesTheGroup) {
  OPEN_OR_SKIP(a, false);
  OPEN_OR_SKIP(b, true);
  auto src = make_buffer(*a, 4096);
  auto dst = make_buffer(*b, 4096);
  fill_pattern(src->bytes.data(), 4096, 5);
  Probe done;
  ASSERT_TRUE(a->submit(SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, 4096, 12, {}},
                        done.callbacks()));
  ASSERT_TRUE(b->wait_imm(12, 1, std::chrono::seconds(20)));
  EXPECT_EQ(fnv1a(dst->bytes.data(), 4096), fnv1a(src->bytes.data(), 4096));
  // The writer's completion may need the receiver's provider to answer (tcp): keep driving.
  for (int i = 0; i < 2000 && done.calls() == 0; ++i) b->progress();
  EXPECT_TRUE(done.wait(std::chrono::seconds(20)));
}

// An immediate nobody expects reaches the unexpected-immediate handler on the thread that
// drives the group (no hop to the callback thread, which a peer answering pings would pay on
// every round trip), and the handler may submit from there.
TEST_P(Progress, UnexpectedImmediatesReachTheHandlerOnTheDrivingThread) {
  OPEN_OR_SKIP(a, false);
  OPEN_OR_SKIP(b, true);
  std::atomic<size_t> handler_thread{0};
  std::atomic<int> seen{0};
  TransferEngine& rb = *b;
  const Address back = a->address();
  b->set_unexpected_imm_handler([&](uint32_t imm) {
    handler_thread.store(this_thread_hash());
    if (imm != 41) return;
    ImmWrite answer;
    answer.peer = back;
    answer.imm = 42;
    EXPECT_TRUE(rb.submit(answer, {}));
    seen.fetch_add(1);
  });
  Driver driver(*b);
  constexpr int kPings = 20;
  for (int i = 0; i < kPings; ++i) {
    ImmWrite ping;
    ping.peer = b->address();
    ping.imm = 41;
    ASSERT_TRUE(a->submit(ping, {}));
    ASSERT_TRUE(a->wait_imm(42, static_cast<uint64_t>(i + 1), std::chrono::seconds(20)))
        << "no answer to ping " << i;
  }
  driver.stop();
  EXPECT_EQ(seen.load(), kPings);
  EXPECT_EQ(handler_thread.load(), driver.id()) << "the handler ran on another thread";
}

// Two threads call progress() on the same group at once while traffic flows: one pass at a
// time (the other call returns false), nothing is lost or counted twice.
TEST_P(Progress, ConcurrentCallsOnOneGroupAreSafe) {
  OPEN_OR_SKIP(a, true);
  OPEN_OR_SKIP(b, false);
  auto src = make_buffer(*a, 64 << 10);
  auto dst = make_buffer(*b, 64 << 10);
  Driver d1(*a), d2(*a);
  constexpr int kWrites = 500;
  std::atomic<int> ended{0};
  for (int i = 0; i < kWrites; ++i) {
    ASSERT_TRUE(a->submit(
        SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, 1024, 31, {}},
        Callbacks{[&] { ended.fetch_add(1); }, [&](const Status&) { ended.fetch_add(1); }}));
  }
  EXPECT_TRUE(b->wait_imm(31, kWrites, std::chrono::seconds(30)));
  for (int i = 0; i < 3000 && ended.load() < kWrites; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(ended.load(), kWrites);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(ended.load(), kWrites) << "a callback ran twice";
  EXPECT_EQ(b->imm_count(31), static_cast<uint64_t>(kWrites));
}

// close() with work submitted and nobody driving: every callback exactly once.
TEST_P(Progress, CloseWithUndrivenWorkEndsEveryTransferOnce) {
  OPEN_OR_SKIP(a, true);
  OPEN_OR_SKIP(b, false);
  auto src = make_buffer(*a, 4096);
  auto dst = make_buffer(*b, 4096);
  constexpr int kWrites = 200;
  std::atomic<int> calls{0};
  for (int i = 0; i < kWrites; ++i) {
    ASSERT_TRUE(a->submit(
        SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, 4096, 3, {}},
        Callbacks{[&] { calls.fetch_add(1); }, [&](const Status&) { calls.fetch_add(1); }}));
  }
  a->close();
  for (int i = 0; i < 500 && calls.load() < kWrites; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(calls.load(), kWrites);
}

INSTANTIATE_TEST_SUITE_P(AllBackends, Progress, ::testing::ValuesIn(all_backends()), backend_name);

}  // namespace
}  // namespace fabric::testing
