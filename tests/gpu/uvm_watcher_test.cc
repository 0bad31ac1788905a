// UvmWatcher: kernel stores reach the host callback, in order, exactly once per change.
// Without CUDA (or without a GPU) the watcher reports why it is unavailable.
#include "fabric/uvm_watcher.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#ifdef FABRIC_WITH_CUDA
#include <cuda_runtime.h>

#include "fabric/uvm_watcher.cuh"
#endif

namespace fabric {
namespace {

using namespace std::chrono_literals;

// Creates a pool or skips: no CUDA build, or no device on this machine.
#define WATCHERS_OR_SKIP(var, options)                                          \
  auto var##_made = UvmWatchers::create(options);                               \
  if (!var##_made && var##_made.status().code() == ErrorCode::kUnsupported) {   \
    GTEST_SKIP() << "no CUDA device here: " << var##_made.status().to_string(); \
  }                                                                             \
  ASSERT_TRUE(var##_made) << var##_made.status().to_string();                   \
  auto& var = *var##_made

template <typename F>
bool eventually(F f, std::chrono::milliseconds timeout = 10s) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    if (f()) return true;
    std::this_thread::sleep_for(100us);
  }
  return f();
}

TEST(UvmWatcher, WithoutCudaCreationSaysWhy) {
#ifdef FABRIC_WITH_CUDA
  GTEST_SKIP() << "this build has CUDA";
#else
  auto w = UvmWatchers::create();
  ASSERT_FALSE(w);
  EXPECT_EQ(w.status().code(), ErrorCode::kUnsupported);
  EXPECT_NE(w.status().message().find("without CUDA"), std::string::npos);
#endif
}

#ifdef FABRIC_WITH_CUDA

TEST(UvmWatcher, KernelStoresReachTheCallbackInOrder) {
  WATCHERS_OR_SKIP(pool, WatcherOptions{});
  std::mutex mu;
  std::vector<std::pair<uint64_t, uint64_t>> seen;
  std::atomic<uint64_t> latest{0};
  auto w = pool->watch([&](uint64_t old_value, uint64_t new_value) {
    std::lock_guard lock(mu);
    seen.emplace_back(old_value, new_value);
    latest = new_value;
    return true;
  });
  ASSERT_TRUE(w) << w.status().to_string();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  for (uint64_t v = 1; v <= 200; ++v) {
    ASSERT_EQ(launch_watcher_store(w->device_word, v, stream), cudaSuccess);
    ASSERT_TRUE(eventually([&] { return latest.load() == v; })) << "value " << v << " not seen";
  }
  cudaStreamDestroy(stream);
  std::lock_guard lock(mu);
  ASSERT_EQ(seen.size(), 200u);
  for (uint64_t v = 1; v <= 200; ++v) EXPECT_EQ(seen[v - 1], std::make_pair(v - 1, v));
}

TEST(UvmWatcher, UnwatchedAndFinishedWatchersStopFiring) {
  WATCHERS_OR_SKIP(pool, WatcherOptions{});
  std::atomic<int> a_calls{0}, b_calls{0};
  auto a = pool->watch([&](uint64_t, uint64_t) {
    ++a_calls;
    return true;
  });
  auto b = pool->watch([&](uint64_t, uint64_t) {
    ++b_calls;
    return false;  // one call, then the slot is freed
  });
  ASSERT_TRUE(a && b);
  EXPECT_EQ(pool->live(), 2u);
  ASSERT_TRUE(pool->unwatch(*a));
  EXPECT_EQ(pool->unwatch(*a).code(), ErrorCode::kNotFound);
  ASSERT_EQ(launch_watcher_store(a->device_word, 5, nullptr), cudaSuccess);
  ASSERT_EQ(launch_watcher_store(b->device_word, 5, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_TRUE(eventually([&] { return b_calls.load() == 1; }));
  ASSERT_TRUE(eventually([&] { return pool->live() == 0; }));
  ASSERT_EQ(launch_watcher_store(b->device_word, 6, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(a_calls.load(), 0) << "an unwatched word fired";
  EXPECT_EQ(b_calls.load(), 1) << "a finished watcher fired again";
}

TEST(UvmWatcher, FullPoolIsOutOfRange) {
  WatcherOptions o;
  o.capacity = 2;
  WATCHERS_OR_SKIP(pool, o);
  auto cb = [](uint64_t, uint64_t) { return true; };
  ASSERT_TRUE(pool->watch(cb));
  ASSERT_TRUE(pool->watch(cb));
  EXPECT_EQ(pool->watch(cb).status().code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(pool->watch(nullptr).status().code(), ErrorCode::kInvalidArgument);
}

#endif  // FABRIC_WITH_CUDA

}  // namespace
}  // namespace fabric
