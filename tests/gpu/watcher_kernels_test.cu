// The watcher's memory ordering: data a kernel wrote before watcher_store is visible to the
// host callback that sees the new value.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "fabric/uvm_watcher.cuh"
#include "fabric/uvm_watcher.h"

namespace fabric {
namespace {

constexpr int kWords = 1 << 16;

__global__ void fill_then_publish(uint64_t* data, uint64_t round, uint64_t* word) {
  for (int i = threadIdx.x; i < kWords; i += blockDim.x) data[i] = round * kWords + i;
  __syncthreads();
  if (threadIdx.x == 0) watcher_store(word, round);
}

TEST(UvmWatcherOrdering, DataWrittenBeforeTheStoreIsVisibleInTheCallback) {
  auto made = UvmWatchers::create();
  if (!made && made.status().code() == ErrorCode::kUnsupported) {
    GTEST_SKIP() << "no CUDA device here: " << made.status().to_string();
  }
  ASSERT_TRUE(made) << made.status().to_string();
  uint64_t* data = nullptr;
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&data), kWords * sizeof(uint64_t),
                          cudaHostAllocMapped | cudaHostAllocPortable),
            cudaSuccess);
  uint64_t* dev_data = nullptr;
  ASSERT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev_data), data, 0), cudaSuccess);
  std::atomic<int> bad{0};
  std::atomic<uint64_t> rounds{0};
  auto w = (*made)->watch([&](uint64_t, uint64_t round) {
    for (int i = 0; i < kWords; ++i) {
      if (__atomic_load_n(&data[i], __ATOMIC_RELAXED) != round * kWords + i) {
        ++bad;
        break;
      }
    }
    rounds = round;
    return true;
  });
  ASSERT_TRUE(w);
  for (uint64_t round = 1; round <= 50; ++round) {
    fill_then_publish<<<1, 256>>>(dev_data, round, w->device_word);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (rounds.load() != round && std::chrono::steady_clock::now() < end) {
      std::this_thread::yield();
    }
    ASSERT_EQ(rounds.load(), round);
  }
  EXPECT_EQ(bad.load(), 0) << "the callback saw the new value before the data";
  (*made).reset();
  cudaFreeHost(data);
}

}  // namespace
}  // namespace fabric
