// Origin: where an engine runs, read from /proc, and whether a process seen there is alive.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "fabric/address.h"

namespace fabric {
namespace {

uint64_t namespace_inode(const char* path) {
  struct stat st {};
  return ::stat(path, &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

// The boot id is a UUID in text ("6d1c...-..."): its 32 hex digits as 16 bytes.
std::array<std::byte, 16> read_boot_id() {
  std::array<std::byte, 16> id{};
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string text;
  if (!(in >> text)) return id;
  size_t n = 0;
  auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (size_t i = 0; i + 1 < text.size() && n < id.size();) {
    int hi = digit(text[i]);
    if (hi < 0) {
      ++i;
      continue;
    }
    int lo = digit(text[i + 1]);
    if (lo < 0) return {};
    id[n++] = static_cast<std::byte>(hi << 4 | lo);
    i += 2;
  }
  return n == id.size() ? id : std::array<std::byte, 16>{};
}

struct ProcStat {
  char state = '?';
  uint64_t start_time = 0;
};

// Fields 3 (state) and 22 (start time) of /proc/<pid>/stat. The command name (field 2) is in
// parentheses and may hold spaces or parentheses itself, so parsing starts after the last ')'.
bool read_stat(uint32_t pid, ProcStat& out) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(in, line)) return false;
  size_t close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return false;
  const char* p = line.c_str() + close + 2;
  out.state = *p;
  // After the state come fields 4..21 (18 of them), then the start time.
  unsigned long long start = 0;
  int field = 3;
  for (const char* q = p; *q != '\0'; ++q) {
    if (*q == ' ') {
      ++field;
      if (field == 22) {
        if (std::sscanf(q + 1, "%llu", &start) != 1) return false;
        out.start_time = start;
        return true;
      }
    }
  }
  return false;
}

}  // namespace

Origin Origin::of_this_process(uint64_t instance) {
  Origin o;
  o.boot_id = read_boot_id();
  o.netns = namespace_inode("/proc/self/ns/net");
  o.pidns = namespace_inode("/proc/self/ns/pid");
  o.pid = static_cast<uint32_t>(::getpid());
  ProcStat st;
  if (read_stat(o.pid, st)) o.start_time = st.start_time;
  o.instance = instance;
  return o;
}

// Origin's operator== (address.h) lists the fields by hand: a field added here must join it.
static_assert(sizeof(Origin) == 56, "a new Origin field: add it to operator== in address.h");

bool Origin::same_host(const Origin& o) const {
  static constexpr std::array<std::byte, 16> kNone{};
  return known() && o.known() && boot_id != kNone && boot_id == o.boot_id && netns == o.netns;
}

bool Origin::same_process(const Origin& o) const {
  return same_host(o) && pidns == o.pidns && pid == o.pid && start_time == o.start_time;
}

bool Origin::process_alive() const {
  if (!known()) return true;
  ProcStat st;
  if (!read_stat(pid, st)) return false;  // no such process
  if (st.state == 'Z' || st.state == 'X') return false;
  return start_time == 0 || st.start_time == start_time;
}

}  // namespace fabric
