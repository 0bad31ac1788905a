// A fabric_test_peer child process seen from a test: spawned with its stdin and stdout as the
// line protocol of tests/support/test_peer.cc.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "test_support.h"

extern char** environ;

namespace fabric::testing {

// How to start a peer besides its backend and buffer size.
struct PeerOptions {
  // Run through this command first (e.g. {"ip", "netns", "exec", "lab-b"}), looked up in PATH.
  std::vector<std::string> prefix;
  // The peer's NICs, comma-separated; empty: make_config's default for the backend.
  std::string nics;
  // Extra environment entries ("NAME=VALUE"), e.g. FI_TCP_PORT_LOW_RANGE to pin its port.
  std::vector<std::string> env;
};

class PeerProcess {
 public:
  bool start(const Backend& b, uint64_t buffer_bytes, const PeerOptions& options = {}) {
    int to_child[2], from_child[2];
    if (pipe2(to_child, O_CLOEXEC) != 0 || pipe2(from_child, O_CLOEXEC) != 0) return false;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, to_child[0], 0);
    posix_spawn_file_actions_adddup2(&fa, from_child[1], 1);
    std::vector<std::string> args = options.prefix;
    // FABRIC_TEST_PEER_BIN: the peer binary where it is not at its build path (a test bundle
    // copied to a GPU machine, tools/gpu/bundle.sh).
    const char* bin = std::getenv("FABRIC_TEST_PEER_BIN");
    args.insert(args.end(), {bin != nullptr && *bin != 0 ? bin : FABRIC_TEST_PEER, b.provider,
                             b.reorder ? "1" : "0", std::to_string(buffer_bytes)});
    if (!options.nics.empty()) args.push_back(options.nics);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::string> env_entries = options.env;
    std::vector<char*> envp;
    for (char** e = environ; *e != nullptr; ++e) envp.push_back(*e);
    for (auto& e : env_entries) envp.push_back(e.data());
    envp.push_back(nullptr);
    int rc = posix_spawnp(&pid_, argv[0], &fa, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&fa);
    close(to_child[0]);
    close(from_child[1]);
    in_ = to_child[1];
    out_ = from_child[0];
    if (rc != 0) pid_ = -1;
    return rc == 0;
  }
  ~PeerProcess() {
    if (pid_ > 0) {
      send("quit");
      close(in_);
      int status = 0;
      for (int i = 0; i < 100 && waitpid(pid_, &status, WNOHANG) == 0; ++i) usleep(50000);
      if (waitpid(pid_, &status, WNOHANG) == 0) {
        kill(pid_, SIGKILL);
        waitpid(pid_, &status, 0);
      }
    }
    if (out_ >= 0) close(out_);
  }
  pid_t pid() const { return pid_; }
  // Kills the child with SIGKILL and reaps it.
  void kill_now() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
  }
  void send(const std::string& line) {
    std::string l = line + "\n";
    [[maybe_unused]] ssize_t n = write(in_, l.data(), l.size());
  }
  // The next line, or "" after 60 s or at end of output.
  std::string read_line() {
    for (;;) {
      auto nl = pending_.find('\n');
      if (nl != std::string::npos) {
        std::string line = pending_.substr(0, nl);
        pending_.erase(0, nl + 1);
        return line;
      }
      pollfd p{out_, POLLIN, 0};
      if (poll(&p, 1, 60000) <= 0) return "";
      char buf[4096];
      ssize_t n = read(out_, buf, sizeof(buf));
      if (n <= 0) return "";
      pending_.append(buf, static_cast<size_t>(n));
    }
  }
  // Reads "KEY VALUE" and returns VALUE, or "" when the line starts otherwise.
  std::string read_value(const std::string& key) {
    std::string line = read_line();
    if (line.rfind(key + " ", 0) != 0) {
      ADD_FAILURE() << "peer said '" << line << "', expected '" << key << " ...'";
      return "";
    }
    return line.substr(key.size() + 1);
  }

 private:
  pid_t pid_ = -1;
  int in_ = -1;
  int out_ = -1;
  std::string pending_;
};

}  // namespace fabric::testing
