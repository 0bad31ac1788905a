#include "transport/shm/shm_copy.h"

#include <algorithm>

#include "topology/topology.h"

namespace fabric::transport::shm {

uint32_t ParallelCopier::default_threads() {
  const int cpus = static_cast<int>(topology::allowed_cpus().size());
  return static_cast<uint32_t>(std::clamp(cpus / 2, 1, 8));
}

ParallelCopier::ParallelCopier(uint32_t threads)
    : threads_(threads == 0 ? default_threads() : threads) {}

ParallelCopier::~ParallelCopier() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
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
  std::unique_lock lock(mu_);
  uint64_t seen = generation_;
  for (;;) {
    wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    Job* job = job_;
    if (job == nullptr) continue;  // that job ended before this helper woke
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
  Job job;
  job.fn = fn;
  job.ctx = ctx;
  job.parts = parts;
  {
    std::lock_guard lock(mu_);
    while (helpers_.size() + 1 < threads_) helpers_.emplace_back([this] { helper(); });
    job_ = &job;
    ++generation_;
  }
  wake_.notify_all();
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
