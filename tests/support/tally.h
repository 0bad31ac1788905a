// Tally: counts how many transfers ended each way, with which error codes, and whether any ended
// twice or after close() returned. Shared by the reliability and conformance tests.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "fabric/status.h"
#include "fabric/transfer.h"

namespace fabric::testing {

// Counts the callbacks of many transfers: how many finished each way, with which error codes,
// when the last one ran, and whether any ran twice or after `seal()` (close() returned).
class Tally {
  struct State {
    mutable std::mutex mu;
    std::condition_variable cv;
    int done = 0;
    int failed = 0;
    int twice = 0;
    int after_seal = 0;
    std::atomic<bool> sealed{false};
    std::map<ErrorCode, int> codes;
    std::map<ErrorCode, std::string> first_of;  // the first message seen for each code
    Status first_error;
    std::chrono::steady_clock::time_point last{};
    void add(std::atomic<int>& seen, const Status& s) {
      {
        std::lock_guard lock(mu);
        if (seen.fetch_add(1) > 0) ++twice;
        if (sealed.load()) ++after_seal;
        if (s.is_ok()) {
          ++done;
        } else {
          if (failed++ == 0) first_error = s;
          if (codes[s.code()]++ == 0) first_of[s.code()] = s.message();
        }
        last = std::chrono::steady_clock::now();
      }
      cv.notify_all();
    }
  };
  template <typename F>
  auto locked(F f) const {
    std::lock_guard lock(state_->mu);
    return f(*state_);
  }

 public:
  Callbacks callbacks() {
    auto st = state_;
    auto seen = std::make_shared<std::atomic<int>>(0);
    return Callbacks{[st, seen] { st->add(*seen, Status::ok()); },
                     [st, seen](const Status& s) { st->add(*seen, s); }};
  }
  bool wait_total(int n, std::chrono::milliseconds timeout) const {
    std::unique_lock lock(state_->mu);
    return state_->cv.wait_for(lock, timeout, [&] { return state_->done + state_->failed >= n; });
  }
  // From now on a callback is a violation (close() has returned).
  void seal() { state_->sealed.store(true); }

  int done() const {
    return locked([](const State& s) { return s.done; });
  }
  int failed() const {
    return locked([](const State& s) { return s.failed; });
  }
  int twice() const {
    return locked([](const State& s) { return s.twice; });
  }
  int after_seal() const {
    return locked([](const State& s) { return s.after_seal; });
  }
  std::chrono::steady_clock::time_point last() const {
    return locked([](const State& s) { return s.last; });
  }
  std::map<ErrorCode, int> codes() const {
    return locked([](const State& s) { return s.codes; });
  }
  Status first_error() const {
    return locked([](const State& s) { return s.first_error; });
  }
  // "3 done, 2 failed (PeerUnreachable x2: <its first message>)".
  std::string summary() const {
    std::lock_guard lock(state_->mu);
    std::string out =
        std::to_string(state_->done) + " done, " + std::to_string(state_->failed) + " failed";
    for (auto [code, n] : state_->codes) {
      out += " (" + std::string(to_string(code)) + " x" + std::to_string(n) + ": " +
             state_->first_of[code] + ")";
    }
    return out;
  }

 private:
  std::shared_ptr<State> state_ = std::make_shared<State>();
};

}  // namespace fabric::testing
