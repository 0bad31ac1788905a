// fabric-bench's shared harness: units, the data pattern and the checksum both sides of a
// verification compute, statistics, CPU time, child processes that speak a line protocol, and
// external programs run with a deadline. Nothing here knows the engine.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fabric/status.h"

namespace fabric::bench {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * kKiB;
constexpr uint64_t kGiB = 1024 * kMiB;

// "4 KiB", "64 MiB", "100 B".
std::string human_bytes(uint64_t n);
// "4KiB", "4 KiB", "4K", "4k", "1MiB", "1M", "2G", "512": bytes. Names what is wrong.
Result<uint64_t> parse_size(std::string_view text);
// Seconds as a double.
inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// --- data and checksums ----------------------------------------------------------------------

// What a destination holds before a pass writes it, so that a write that never landed shows.
constexpr std::byte kPoison{0xA5};

// A deterministic, position-dependent pattern, so that a misplaced range shows.
void fill_pattern(std::byte* p, uint64_t n, uint64_t seed);
// A 64-bit checksum of a byte range (four multiply-rotate lanes; several GB/s).
uint64_t hash_bytes(const std::byte* p, uint64_t n);
// Folds one range's checksum into a running one (order matters).
inline uint64_t hash_combine(uint64_t h, uint64_t v) {
  h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  return h * 0xD6E8FEB86659FD93ull;
}
constexpr uint64_t kHashSeed = 0x6A09E667F3BCC909ull;
// The checksum of `count` ranges of `len` bytes at base + first + k * step, k = 0..count-1:
// what a peer answers to `hash LEN FIRST STEP COUNT`.
uint64_t hash_ranges(const std::byte* base, uint64_t len, uint64_t first, uint64_t step,
                     uint64_t count);

// A page-aligned, zero-initialised buffer (memory is touched, so no first-write page faults
// land in a timed pass).
class PageBuffer {
 public:
  PageBuffer() = default;
  explicit PageBuffer(uint64_t bytes);
  std::byte* data() const { return data_.get(); }
  uint64_t size() const { return size_; }

 private:
  struct Free {
    void operator()(std::byte* p) const noexcept;
  };
  std::unique_ptr<std::byte, Free> data_;
  uint64_t size_ = 0;
};

// --- statistics ------------------------------------------------------------------------------

// NaN for an empty sample. p in [0, 100]; nearest-rank.
double median(std::vector<double> v);
double percentile(std::vector<double> v, double p);

// User + system CPU seconds of this process, all threads.
double cpu_seconds();

// --- child processes -------------------------------------------------------------------------

// A child process with its stdin and stdout as a line protocol. The destructor closes its
// stdin (the child reads EOF and exits), and kills it if it has not exited 5 s later.
class ChildProcess {
 public:
  // Runs `path` with `args` (args[0] is the name it sees). stderr is inherited.
  static Result<std::unique_ptr<ChildProcess>> spawn(const std::string& path,
                                                     const std::vector<std::string>& args);
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  Status send(const std::string& line);
  // The next line, without its newline; kTimeout at the deadline, kPeerUnreachable at EOF.
  Result<std::string> read_line(milliseconds timeout);
  // send + read_line; a reply "error ..." becomes a kInternal Status carrying it.
  Result<std::string> request(const std::string& line, milliseconds timeout);
  // Sends `quit` and checks that the child exits 0 within 10 s.
  Status quit();

 private:
  ChildProcess(pid_t pid, int to, int from) : pid_(pid), to_(to), from_(from) {}
  bool reap(milliseconds timeout);

  pid_t pid_;
  int to_;
  int from_;
  int status_ = 0;
  std::string buf_;
};

// What an external program did.
struct ProgramResult {
  bool started = false;
  bool timed_out = false;
  int exit_code = -1;           // -1 unless it exited normally
  std::string out;              // its stdout
  std::string err;              // its stderr (the last 4 KiB)
  std::string summary() const;  // "exit 0", "timed out after 30 s", "killed by signal 9", ...
};

// Runs argv[0] (a full path) with `env` added to this process's environment, in a process
// group of its own; collects stdout and stderr; kills the whole group at the deadline.
ProgramResult run_program(const std::vector<std::string>& argv, milliseconds timeout,
                          const std::vector<std::string>& env = {});

// The full path of `name` found in PATH, or "" when absent.
std::string find_program(std::string_view name);
// The full path of this executable ("" when unknown), and the directory holding it.
std::string self_path();
std::string self_dir();

// --- progress --------------------------------------------------------------------------------

// The progress line on stderr. On a terminal, update() rewrites one line in place; otherwise
// only note() lines are printed, one per line, so that logs stay short.
class Progress {
 public:
  Progress();
  void update(const std::string& line);
  void note(const std::string& line);
  void clear();

 private:
  bool tty_;
  bool dirty_ = false;
};

}  // namespace fabric::bench
