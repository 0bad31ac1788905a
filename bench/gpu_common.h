// What the GPU benchmarks (fabric-bench-gpu's ops) share: a Result that must hold, a waiter for
// transfer completions, medians and percentiles, the serving child process and a checksum of
// device bytes. For the benchmarks only: errors end the process.
#pragma once

#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "cuda_check.h"
#include "fabric/fabric.h"

namespace bench_gpu {

template <typename T>
T must(fabric::Result<T> r, const char* what) {
  if (!r) {
    std::fprintf(stderr, "%s: %s\n", what, r.status().to_string().c_str());
    std::exit(1);
  }
  return std::move(*r);
}

// Transfer completions, waited on by the benchmark thread.
struct Waiter {
  std::mutex mu;
  std::condition_variable cv;
  int done = 0;
  int failed = 0;
  fabric::Callbacks callbacks() {
    return {[this] { add(false); },
            [this](const fabric::Status& s) {
              std::fprintf(stderr, "transfer failed: %s\n", s.to_string().c_str());
              add(true);
            }};
  }
  void add(bool bad) {
    std::lock_guard l(mu);
    ++done;
    failed += bad ? 1 : 0;
    cv.notify_all();
  }
  void wait(int n) {
    std::unique_lock l(mu);
    cv.wait(l, [&] { return done >= n; });
    if (failed) std::exit(1);
  }
  void reset() {
    std::lock_guard l(mu);
    done = failed = 0;
  }
};

inline double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size() - 1)))];
}
inline double median(std::vector<double> v) {
  return percentile(std::move(v), 0.5);
}

// The serving process: this binary with --serve, talking over its stdin and stdout.
struct Peer {
  FILE* to = nullptr;
  FILE* from = nullptr;
  pid_t pid = -1;
  std::string line() {
    std::string s;
    char buf[1 << 16];
    for (;;) {  // a line may be longer than the buffer (a list of timestamps)
      if (!std::fgets(buf, sizeof(buf), from)) {
        std::fprintf(stderr, "the serving process ended early\n");
        std::exit(1);
      }
      s += buf;
      if (!s.empty() && s.back() == '\n') break;
    }
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
    return s;
  }
  void send(const std::string& command) {
    std::fprintf(to, "%s\n", command.c_str());
    std::fflush(to);
  }
  std::string ask(const std::string& command) {
    send(command);
    return line();
  }
  uint64_t checksum(uint64_t off, uint64_t len) {
    return std::stoull(ask("sum " + std::to_string(off) + " " + std::to_string(len)));
  }
  void quit() { send("quit"); }
};

// Starts this binary with `args` (after argv[0]) as the serving process.
inline Peer spawn(const std::vector<std::string>& args) {
  int in[2], out[2];
  if (pipe(in) != 0 || pipe(out) != 0) std::exit(1);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(in[0], 0);
    dup2(out[1], 1);
    close(in[1]);
    close(out[0]);
    std::vector<const char*> argv = {"fabric-bench-gpu"};
    for (const auto& a : args) argv.push_back(a.c_str());
    argv.push_back(nullptr);
    execv("/proc/self/exe", const_cast<char* const*>(argv.data()));
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  return {fdopen(in[1], "w"), fdopen(out[0], "r"), pid};
}

inline uint64_t host_checksum(const void* dev, uint64_t len) {
  std::vector<uint8_t> host(len);
  CUDA_OK(cudaMemcpy(host.data(), dev, len, cudaMemcpyDefault));  // device or host memory
  uint64_t sum = 1469598103934665603ull;
  for (uint8_t b : host) sum = (sum ^ b) * 1099511628211ull;
  return sum;
}

}  // namespace bench_gpu
