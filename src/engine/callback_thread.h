// CallbackThread: runs user callbacks in order, off the workers, so that a slow or throwing
// callback never stalls the fabric.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace fabric::engine {

class CallbackThread {
 public:
  using Job = std::function<void()>;

  // After running what was queued, the thread polls for this long for more (yielding its CPU
  // each time round) before it sleeps: a callback that follows soon after starts at once
  // instead of after a wake-up. Zero: sleep at once.
  explicit CallbackThread(std::chrono::microseconds spin = std::chrono::microseconds(0));
  // Runs what is queued, then joins.
  ~CallbackThread();
  CallbackThread(const CallbackThread&) = delete;
  CallbackThread& operator=(const CallbackThread&) = delete;

  void push(Job job);
  void push(std::vector<Job>& jobs);  // moves the jobs out; leaves `jobs` empty
  // Runs every job queued so far and every job they queue, then stops the thread. After it
  // returns no job runs. Must not be called from a job.
  void drain_and_stop();
  bool on_this_thread() const { return std::this_thread::get_id() == thread_.get_id(); }
  // Runs one job here, catching and logging what it throws (Config::callbacks_on_worker).
  static void run_one(Job& job);

 private:
  void run();

  const std::chrono::microseconds spin_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  bool stop_ = false;
  std::atomic<bool> pending_{false};  // queue_ not empty, or stop_: read without the lock
  std::atomic<bool> waiting_{false};  // the thread sleeps on cv_: pushers must notify
  std::thread thread_;                // last: starts after the members it uses exist
};

}  // namespace fabric::engine
