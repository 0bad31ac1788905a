// Large copies of the same-host transport spread over a few threads (docs/shm.md): the kernel's
// cross-process copy (process_vm_readv) moves about 3.6 GB/s on one thread of the H200 machine's
// host and 19 to 24 GB/s on eight (bench/probes/cma_threads.c), so one receiving worker copying
// a large write alone bounds the transport. A copy is cut into parts; the calling thread takes
// parts too, and returns once every part is done, so the caller's order of events (bytes in,
// then the immediate, then the acknowledgement) is unchanged.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace fabric::transport::shm {

class ParallelCopier {
 public:
  // Parts smaller than this are not worth a thread's wake-up: on the H200 machine's host, 1 MiB
  // writes cut into four parts of 256 KiB moved no faster than on one thread, and cost four
  // times the CPU, where 16 MiB writes moved 1.4 to 4.1 times faster (docs/shm.md).
  static constexpr uint64_t kMinPartBytes = 1 << 20;

  // `threads`: copiers in all, the caller included (1: the caller alone, no helper is started;
  // 0: the default, half the CPUs this process may run on, 1 to 8). Helpers start on the first
  // copy that needs them.
  explicit ParallelCopier(uint32_t threads);
  ~ParallelCopier();  // stops and joins the helpers
  ParallelCopier(const ParallelCopier&) = delete;
  ParallelCopier& operator=(const ParallelCopier&) = delete;

  uint32_t threads() const { return threads_; }
  static uint32_t default_threads();

  // How many parts a copy of `length` bytes is cut into (1 below 2 * kMinPartBytes).
  uint32_t parts_for(uint64_t length) const;

  // Runs part(i) for every i in [0, parts), spread over the helpers and this thread; true when
  // every part returned true. One call at a time per copier (callers are serialized here).
  template <typename Part>
  bool run(uint32_t parts, Part&& part) {
    using P = std::remove_reference_t<Part>;
    return run_erased(
        parts, [](void* ctx, uint32_t i) { return static_cast<bool>((*static_cast<P*>(ctx))(i)); },
        const_cast<void*>(static_cast<const void*>(&part)));
  }

 private:
  struct Job {
    bool (*fn)(void*, uint32_t) = nullptr;
    void* ctx = nullptr;
    uint32_t parts = 0;
    std::atomic<uint32_t> next{0};
    std::atomic<uint32_t> done{0};
    std::atomic<bool> ok{true};
  };
  bool run_erased(uint32_t parts, bool (*fn)(void*, uint32_t), void* ctx);
  static void work(Job& job);
  void helper();

  const uint32_t threads_;
  std::mutex run_mu_;             // one run() at a time
  std::mutex mu_;                 // the fields below
  std::condition_variable wake_;  // helpers: a new job, or stop
  std::condition_variable idle_;  // run(): the job's parts are done and no helper holds it
  Job* job_ = nullptr;
  uint64_t generation_ = 0;  // bumped for each job
  bool stop_ = false;
  uint32_t active_ = 0;  // helpers working on job_
  std::vector<std::thread> helpers_;
};

}  // namespace fabric::transport::shm
