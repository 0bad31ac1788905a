#include "sys_counters.h"

#include <dirent.h>
#include <linux/perf_event.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <vector>

namespace fabric::bench {

namespace {

int open_counter(uint32_t type, uint64_t config, int tid) {
  perf_event_attr a{};
  a.size = sizeof(a);
  a.type = type;
  a.config = config;
  return static_cast<int>(syscall(SYS_perf_event_open, &a, tid, -1, -1, PERF_FLAG_FD_CLOEXEC));
}

int sys_enter_id() {
  for (const char* root : {"/sys/kernel/tracing", "/sys/kernel/debug/tracing"}) {
    std::ifstream in(std::string(root) + "/events/raw_syscalls/sys_enter/id");
    int id = -1;
    if (in >> id) return id;
  }
  return -1;
}

double value(int fd) {
  uint64_t v = 0;
  if (fd < 0 || ::read(fd, &v, sizeof(v)) != static_cast<ssize_t>(sizeof(v))) return std::nan("");
  return static_cast<double>(v);
}

}  // namespace

SysCounters::SysCounters() : tracepoint_(sys_enter_id()) {
  if (tracepoint_ < 0) {
    why_ =
        "system calls: no raw_syscalls tracepoint (tracefs not mounted: mount -t tracefs nodev "
        "/sys/kernel/tracing)";
  }
  const int probe = open_counter(PERF_TYPE_SOFTWARE, PERF_COUNT_SW_CONTEXT_SWITCHES, 0);
  if (probe < 0) {
    switches_ok_ = false;
    tracepoint_ = -1;
    why_ = std::string("perf_event_open: ") + std::strerror(errno) +
           " (kernel.perf_event_paranoid, or not root)";
  } else {
    ::close(probe);
  }
  track_threads();
}

SysCounters::~SysCounters() {
  for (auto& [tid, fds] : threads_) {
    if (fds.syscalls >= 0) ::close(fds.syscalls);
    if (fds.switches >= 0) ::close(fds.switches);
  }
}

void SysCounters::track_threads() {
  if (!switches_ok_) return;
  DIR* dir = ::opendir("/proc/self/task");
  if (dir == nullptr) return;
  while (dirent* e = ::readdir(dir)) {
    const int tid = std::atoi(e->d_name);
    if (tid <= 0 || threads_.count(tid) != 0) continue;
    Fds fds;
    fds.switches = open_counter(PERF_TYPE_SOFTWARE, PERF_COUNT_SW_CONTEXT_SWITCHES, tid);
    if (tracepoint_ >= 0) {
      fds.syscalls = open_counter(PERF_TYPE_TRACEPOINT, static_cast<uint64_t>(tracepoint_), tid);
    }
    threads_.emplace(tid, fds);
  }
  ::closedir(dir);
}

SysCounters::Totals SysCounters::read() {
  track_threads();
  Totals t;
  if (!switches_ok_) return t;
  t.context_switches = 0;
  if (tracepoint_ >= 0) t.syscalls = 0;
  // A thread that has exited keeps its final counts in its descriptors.
  for (const auto& [tid, fds] : threads_) {
    const double sw = value(fds.switches);
    if (!std::isnan(sw)) t.context_switches += sw;
    if (tracepoint_ >= 0) {
      const double sc = value(fds.syscalls);
      if (!std::isnan(sc)) t.syscalls += sc;
    }
  }
  return t;
}

}  // namespace fabric::bench
