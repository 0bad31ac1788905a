// fabric-bench-uvm: how fast a kernel's store reaches a UvmWatcher callback (GPU machines).
//
// A one-thread kernel plays ping-pong with the host through mapped, pinned host memory: it
// stores i into a watched word, then spins until the host acknowledges i in a second word, and
// times each round trip with %globaltimer. Two hosts answer in turn:
//   raw      a host thread spinning on the word itself (the hardware floor)
//   watcher  a UvmWatchers callback (the library's path)
// The callback's latency is estimated as watcher RTT - raw RTT / 2: the acknowledgement's way
// back costs what the raw one-way trip costs.
#include <cuda_runtime.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <thread>
#include <vector>

#include "fabric/uvm_watcher.cuh"
#include "fabric/uvm_watcher.h"

#include "cuda_check.h"

namespace {

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void pingpong(uint64_t* word, const uint64_t* ack, uint64_t base, int n,
                         uint64_t* rtt_ns) {
  for (int i = 1; i <= n; ++i) {
    const uint64_t v = base + static_cast<uint64_t>(i);
    const uint64_t t0 = global_ns();
    fabric::watcher_store(word, v);
    while (fabric::watcher_load(ack) != v) {
    }
    rtt_ns[i - 1] = global_ns() - t0;
  }
}

struct Stats {
  double p50, p99, mean;
};

Stats stats(std::vector<uint64_t> v) {
  std::sort(v.begin(), v.end());
  double sum = 0;
  for (auto x : v) sum += static_cast<double>(x);
  return {v[v.size() / 2] / 1e3, v[v.size() * 99 / 100] / 1e3, sum / v.size() / 1e3};
}

}  // namespace

int main(int argc, char** argv) {
  int n = 20000;
  int cpu = 2;
  int device = 0;
  CLI::App app{"fabric-bench-uvm: UvmWatcher callback latency"};
  app.add_option("--events", n, "round trips per mode")->check(CLI::PositiveNumber);
  app.add_option("--cpu", cpu, "CPU for the host poller (-1: unpinned)");
  app.add_option("--device", device, "CUDA device");
  CLI11_PARSE(app, argc, argv);

  CUDA_OK(cudaSetDevice(device));
  uint64_t* ack = nullptr;
  CUDA_OK(cudaHostAlloc(reinterpret_cast<void**>(&ack), 64,
                        cudaHostAllocMapped | cudaHostAllocPortable));
  uint64_t* ack_dev = nullptr;
  CUDA_OK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&ack_dev), ack, 0));
  uint64_t* rtt_dev = nullptr;
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&rtt_dev), n * sizeof(uint64_t)));
  std::vector<uint64_t> rtt(n);

  fabric::WatcherOptions o;
  o.cuda_device = device;
  o.cpu = cpu;
  auto pool = fabric::UvmWatchers::create(o);
  if (!pool) {
    std::fprintf(stderr, "%s\n", pool.status().to_string().c_str());
    return 1;
  }
  // Raw: a host thread spins on a watcher word directly (the watcher pool is idle meanwhile).
  uint64_t* raw_word = nullptr;
  CUDA_OK(cudaHostAlloc(reinterpret_cast<void**>(&raw_word), 64,
                        cudaHostAllocMapped | cudaHostAllocPortable));
  uint64_t* raw_word_dev = nullptr;
  CUDA_OK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&raw_word_dev), raw_word, 0));
  *raw_word = 0;
  *ack = 0;
  std::atomic<bool> stop{false};
  std::thread host([&] {
    if (cpu >= 0) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cpu, &set);
      pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
    }
    uint64_t last = 0;
    while (!stop.load(std::memory_order_relaxed)) {
      uint64_t v = __atomic_load_n(raw_word, __ATOMIC_ACQUIRE);
      if (v != last) {
        last = v;
        __atomic_store_n(ack, v, __ATOMIC_RELEASE);
      }
    }
  });
  pingpong<<<1, 1>>>(raw_word_dev, ack_dev, 0, n, rtt_dev);
  CUDA_OK(cudaDeviceSynchronize());
  stop = true;
  host.join();
  CUDA_OK(cudaMemcpy(rtt.data(), rtt_dev, n * sizeof(uint64_t), cudaMemcpyDeviceToHost));
  Stats raw = stats(rtt);

  // Watcher: the library's polling thread runs the callback, which acknowledges.
  const uint64_t base = 1000000;
  *ack = 0;
  auto w = (*pool)->watch(
      [&](uint64_t, uint64_t v) {
        __atomic_store_n(ack, v, __ATOMIC_RELEASE);
        return true;
      },
      base);
  if (!w) {
    std::fprintf(stderr, "%s\n", w.status().to_string().c_str());
    return 1;
  }
  pingpong<<<1, 1>>>(w->device_word, ack_dev, base, n, rtt_dev);
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaMemcpy(rtt.data(), rtt_dev, n * sizeof(uint64_t), cudaMemcpyDeviceToHost));
  Stats watched = stats(rtt);

  std::printf("UvmWatcher latency, %d round trips each, poller on CPU %d\n", n, cpu);
  std::printf("%-28s %9s %9s %9s\n", "", "p50 us", "p99 us", "mean us");
  std::printf("%-28s %9.2f %9.2f %9.2f\n", "raw round trip (floor)", raw.p50, raw.p99, raw.mean);
  std::printf("%-28s %9.2f %9.2f %9.2f\n", "watcher round trip", watched.p50, watched.p99,
              watched.mean);
  std::printf("%-28s %9.2f %9.2f %9.2f\n", "store -> callback (est.)", watched.p50 - raw.p50 / 2,
              watched.p99 - raw.p50 / 2, watched.mean - raw.mean / 2);
  return 0;
}
