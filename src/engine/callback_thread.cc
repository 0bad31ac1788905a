#include "engine/callback_thread.h"

#include <pthread.h>
#include "common/log.h"

#include <exception>

namespace fabric::engine {

CallbackThread::CallbackThread() : thread_([this] { run(); }) {}

CallbackThread::~CallbackThread() {
  drain_and_stop();
}

void CallbackThread::push(Job job) {
  {
    std::lock_guard lock(mu_);
    queue_.push_back(std::move(job));
  }
  cv_.notify_one();
}

void CallbackThread::push(std::vector<Job>& jobs) {
  if (jobs.empty()) return;
  {
    std::lock_guard lock(mu_);
    for (Job& j : jobs) queue_.push_back(std::move(j));
  }
  jobs.clear();
  cv_.notify_one();
}

void CallbackThread::drain_and_stop() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
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
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ and nothing left
    Job job = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    run_one(job);
    job = nullptr;  // destroy captured state outside the lock
    lock.lock();
  }
}

}  // namespace fabric::engine
