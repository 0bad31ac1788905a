// An application's signal handlers are its own: opening a libfabric engine loads libfabric, whose
// psm provider's library (Debian 12's libinfinipath) installs handlers for SIGINT, SIGILL,
// SIGABRT, SIGBUS, SIGSEGV and SIGTERM that print a backtrace and exit. The engine puts back
// whatever changed. The test needs a process where libfabric is not loaded yet: it runs itself
// again in a fresh child process.
#include <signal.h>

#include <atomic>
#include <fstream>
#include <string>

#include "rerun.h"
#include "test_support.h"

namespace fabric::testing {
namespace {

constexpr const char* kFresh = "FABRIC_TEST_FRESH_PROCESS";
constexpr int kSignals[] = {SIGINT, SIGILL, SIGABRT, SIGBUS, SIGSEGV, SIGTERM, SIGUSR1};

std::atomic<int> g_interrupts{0};
void on_interrupt(int) {
  g_interrupts.fetch_add(1);
}
void on_info(int, siginfo_t*, void*) {}

bool libfabric_loaded() {
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    if (line.find("libfabric.so") != std::string::npos) return true;
  }
  return false;
}

TEST(Signals, AnApplicationsHandlersSurviveLoadingLibfabric) {
  if (std::getenv(kFresh) == nullptr) {
    const int rc = rerun_this_test(kFresh, false, std::chrono::seconds(60));
    ASSERT_EQ(rc, 0) << "the test in a fresh process failed (its output is above)";
    return;
  }
  ASSERT_FALSE(libfabric_loaded()) << "libfabric was loaded before any engine existed";
  // SIGINT with a plain handler (as Python installs), SIGTERM ignored, the rest with
  // SA_SIGINFO handlers (as crash reporters install).
  struct sigaction plain {
  }, ignored{}, info{};
  plain.sa_handler = on_interrupt;
  ignored.sa_handler = SIG_IGN;
  info.sa_sigaction = on_info;
  info.sa_flags = SA_SIGINFO | SA_ONSTACK;
  for (int s : kSignals) {
    ASSERT_EQ(sigaction(s, s == SIGINT ? &plain : s == SIGTERM ? &ignored : &info, nullptr), 0);
  }

  Config config = make_config(Backend{"tcp", "tcp", false});
  FABRIC_ENGINE_OR_SKIP(engine, config);
  ASSERT_TRUE(libfabric_loaded()) << "a tcp engine opened without loading libfabric";

  for (int s : kSignals) {
    struct sigaction now {};
    ASSERT_EQ(sigaction(s, nullptr, &now), 0);
    if (s == SIGINT) {
      EXPECT_EQ(now.sa_handler, &on_interrupt) << "SIGINT's handler was replaced";
    } else if (s == SIGTERM) {
      EXPECT_EQ(now.sa_handler, SIG_IGN) << "SIGTERM is no longer ignored";
    } else {
      EXPECT_TRUE((now.sa_flags & SA_SIGINFO) != 0 && now.sa_sigaction == &on_info)
          << "the handler of signal " << s << " was replaced";
    }
  }
  // And the application's handler is the one that runs.
  ASSERT_EQ(raise(SIGINT), 0);
  EXPECT_EQ(g_interrupts.load(), 1);
}

}  // namespace
}  // namespace fabric::testing
