// Helpers of the reliability tests (tests/reliability, CTest label `reliability`): a tally of
// callbacks that records when and how each transfer finished, open file descriptors, memory.
#pragma once

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <fstream>
#include <map>
#include <mutex>
#include <string>

#include "test_support.h"

namespace fabric::testing {

using Clock = std::chrono::steady_clock;

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
    Clock::time_point last{};
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
        last = Clock::now();
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
  Clock::time_point last() const {
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

// Open file descriptors of this process.
inline int open_fds() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (readdir(d) != nullptr) ++n;
    closedir(d);
  }
  return n - 3;  // ".", ".." and the directory's own descriptor
}

// Resident memory of this process in bytes (VmRSS).
inline uint64_t rss_bytes() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

// A TCP port on 127.0.0.1 that was free a moment ago (for a peer whose address must survive a
// restart: libfabric's tcp provider binds inside FI_TCP_PORT_LOW_RANGE..FI_TCP_PORT_HIGH_RANGE).
inline int free_loopback_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  int port = -1;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  close(fd);
  return port;
}

}  // namespace fabric::testing
