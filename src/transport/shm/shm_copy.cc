#include "transport/shm/shm_copy.h"

#include <sched.h>

#include <algorithm>

namespace fabric::transport::shm {

uint32_t ParallelCopier::default_threads() {
  cpu_set_t set;
  CPU_ZERO(&set);
  const int cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
  return static_cast<uint32_t>(std::clamp(cpus / 2, 1, 8));
}

ParallelCopier::ParallelCopier(uint32_t threads)
    : threads_(threads == 0 ? default_threads() : threads) {}

ParallelCopier::~ParallelCopier() {
  {
    std::lock_guard lock(mu_);
    stop_.store(true);
  }
  wake_.notify_all();
  for (std::thread& t : helpers_) t.join();
}

uint32_t ParallelCopier::parts_for(uint64_t length) const {
  const uint64_t by_size = length / kMinPartBytes;
  return static_cast<uint32_t>(std::clamp<uint64_t>(by_size, 1, threads_));
}

void ParallelCopier::work(Job& job) {
  for (uint32_t i = job.next.fetch_add(1); i < job.parts; i = job.next.fetch_add(1)) {
    if (!job.fn(job.ctx, i)) job.ok.store(false);
    job.done.fetch_add(1, std::memory_order_acq_rel);
  }
}

void ParallelCopier::helper() {
  uint64_t seen = generation_.load();
  for (;;) {
    // The next job of a burst usually comes within microseconds: wait for it spinning first.
    const auto until = std::chrono::steady_clock::now() + kSpin;
    while (generation_.load(std::memory_order_acquire) == seen && !stop_.load() &&
           std::chrono::steady_clock::now() < until) {
    }
    std::unique_lock lock(mu_);
    if (generation_.load() == seen && !stop_.load()) {
      ++sleepers_;
      wake_.wait(lock, [&] { return stop_.load() || generation_.load() != seen; });
      --sleepers_;
    }
    if (stop_.load()) return;
    seen = generation_.load();
    Job* job = job_;
    if (job == nullptr) continue;  // that job ended before this helper looked
    ++active_;
    lock.unlock();
    work(*job);
    lock.lock();
    --active_;
    if (active_ == 0) idle_.notify_all();
  }
}

bool ParallelCopier::run_erased(uint32_t parts, bool (*fn)(void*, uint32_t), void* ctx) {
  std::lock_guard one(run_mu_);
  if (parts <= 1 || threads_ <= 1) {
    bool ok = true;
    for (uint32_t i = 0; i < parts; ++i) ok = fn(ctx, i) && ok;
    return ok;
  }
  bool notify = false;
  Job job;
  job.fn = fn;
  job.ctx = ctx;
  job.parts = parts;
  {
    std::lock_guard lock(mu_);
    while (helpers_.size() + 1 < threads_) helpers_.emplace_back([this] { helper(); });
    job_ = &job;
    generation_.fetch_add(1);
    notify = sleepers_ > 0;
  }
  if (notify) wake_.notify_all();
  work(job);
  // Every part taken: wait for the helpers still copying one, then retire the job so that no
  // helper can pick it up after it is gone.
  std::unique_lock lock(mu_);
  idle_.wait(lock,
             [&] { return job.done.load(std::memory_order_acquire) == parts && active_ == 0; });
  job_ = nullptr;
  return job.ok.load();
}

}  // namespace fabric::transport::shm
