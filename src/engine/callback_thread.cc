#include "engine/callback_thread.h"

#include <pthread.h>
#include <sched.h>
#include "common/log.h"

#include <exception>

namespace fabric::engine {

CallbackThread::CallbackThread(std::chrono::microseconds spin)
    : spin_(spin), thread_([this] { run(); }) {}

CallbackThread::~CallbackThread() {
  drain_and_stop();
}

void CallbackThread::push(Job job) {
  bool wake = false;
  {
    std::lock_guard lock(mu_);
    queue_.push_back(std::move(job));
    pending_.store(true);
    wake = waiting_.load();
  }
  if (wake) cv_.notify_one();
}

void CallbackThread::push(std::vector<Job>& jobs) {
  if (jobs.empty()) return;
  bool wake = false;
  {
    std::lock_guard lock(mu_);
    for (Job& j : jobs) queue_.push_back(std::move(j));
    pending_.store(true);
    wake = waiting_.load();
  }
  jobs.clear();
  if (wake) cv_.notify_one();
}

void CallbackThread::drain_and_stop() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
    pending_.store(true);
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void CallbackThread::run_one(Job& job) {
  try {
    if (job) job();
  } catch (const std::exception& e) {
    detail::log().error("a user callback threw and was isolated: {}", e.what());
  } catch (...) {
    detail::log().error("a user callback threw a non-standard exception and was isolated");
  }
}

void CallbackThread::run() {
  pthread_setname_np(pthread_self(), "fabric-cb");
  std::deque<Job> batch;
  std::unique_lock lock(mu_);
  for (;;) {
    if (queue_.empty() && !stop_ && spin_.count() > 0) {
      // Poll for a while before sleeping; the lock is free meanwhile.
      lock.unlock();
      const auto until = std::chrono::steady_clock::now() + spin_;
      while (!pending_.load() && std::chrono::steady_clock::now() < until) sched_yield();
      lock.lock();
    }
    waiting_.store(true);
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    waiting_.store(false);
    if (queue_.empty()) return;  // stop_ and nothing left
    batch.swap(queue_);
    pending_.store(stop_);
    lock.unlock();
    for (Job& job : batch) {
      run_one(job);
      job = nullptr;  // destroy captured state outside the lock
    }
    batch.clear();
    lock.lock();
  }
}

}  // namespace fabric::engine
