// Runs the current test again in a child process of its own: a fresh process (nothing loaded
// yet), optionally in a new network namespace. The child finds `marker` set in its environment.
#pragma once

#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace fabric::testing {

// What rerun_this_test returns besides the child's exit status.
inline constexpr int kNoNamespace = 77;  // no network namespace could be made (not root)
inline constexpr int kRanTooLong = -1;   // killed after `limit`

inline int rerun_this_test(const char* marker, bool private_netns, std::chrono::seconds limit) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string filter =
      std::string("--gtest_filter=") + info->test_suite_name() + "." + info->name();
  std::string exe(4096, '\0');
  const ssize_t n = readlink("/proc/self/exe", exe.data(), exe.size() - 1);
  if (n <= 0) return 127;
  exe.resize(static_cast<size_t>(n));
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
  env.push_back(std::string(marker) + "=1");
  std::vector<char*> envp, argv{exe.data(), const_cast<char*>(filter.c_str()), nullptr};
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {  // system calls only from here to exec: the parent may have threads
    if (private_netns && unshare(CLONE_NEWNET) != 0) _exit(kNoNamespace);
    execve(exe.c_str(), argv.data(), envp.data());
    _exit(127);
  }
  if (pid < 0) return 127;
  const auto until = std::chrono::steady_clock::now() + limit;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > until) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return kRanTooLong;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace fabric::testing
