// A thread that runs a function every period until stopped: the KV objects' heartbeats and
// deadlines.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

namespace fabric::kv::detail {

class Ticker {
 public:
  Ticker() = default;
  ~Ticker() { stop(); }
  Ticker(const Ticker&) = delete;
  Ticker& operator=(const Ticker&) = delete;

  void start(std::chrono::milliseconds period, std::function<void()> fn) {
    thread_ = std::thread([this, period, fn = std::move(fn)] {
      std::unique_lock lock(mu_);
      while (!stop_) {
        cv_.wait_for(lock, period, [&] { return stop_; });
        if (stop_) break;
        lock.unlock();
        fn();
        lock.lock();
      }
    });
  }
  // Joins the thread; fn does not run after this returns. Must not be called from fn.
  void stop() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace fabric::kv::detail
