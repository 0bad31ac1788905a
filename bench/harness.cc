#include "harness.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <thread>

extern char** environ;

namespace fabric::bench {

namespace {

Status sys_error(const char* what) {
  return Status(ErrorCode::kInternal, fmt::format("{}: {}", what, std::strerror(errno)));
}

inline uint64_t rotl(uint64_t x, int r) {
  return (x << r) | (x >> (64 - r));
}

}  // namespace

std::string human_bytes(uint64_t n) {
  if (n >= kGiB && n % kGiB == 0) return fmt::format("{} GiB", n / kGiB);
  if (n >= kMiB && n % kMiB == 0) return fmt::format("{} MiB", n / kMiB);
  if (n >= kKiB && n % kKiB == 0) return fmt::format("{} KiB", n / kKiB);
  return fmt::format("{} B", n);
}

Result<uint64_t> parse_size(std::string_view text) {
  auto bad = [&](const char* why) {
    return Status(ErrorCode::kInvalidArgument, fmt::format("size '{}': {}", text, why));
  };
  size_t i = 0;
  uint64_t value = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
    const uint64_t digit = static_cast<uint64_t>(text[i] - '0');
    if (value > (std::numeric_limits<uint64_t>::max() - digit) / 10) return bad("too large");
    value = value * 10 + digit;
    ++i;
  }
  if (i == 0) return bad("expected a number, e.g. 4KiB or 1MiB");
  while (i < text.size() && text[i] == ' ') ++i;
  std::string unit;
  for (; i < text.size(); ++i) unit += static_cast<char>(std::tolower(text[i]));
  uint64_t scale = 1;
  if (unit.empty() || unit == "b") {
    scale = 1;
  } else if (unit == "k" || unit == "kib" || unit == "kb") {
    scale = kKiB;
  } else if (unit == "m" || unit == "mib" || unit == "mb") {
    scale = kMiB;
  } else if (unit == "g" || unit == "gib" || unit == "gb") {
    scale = kGiB;
  } else {
    return bad("unknown unit (use B, KiB, MiB or GiB)");
  }
  if (value > std::numeric_limits<uint64_t>::max() / scale) return bad("too large");
  return value * scale;
}

void fill_pattern(std::byte* p, uint64_t n, uint64_t seed) {
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed * 0xD1B54A32D192ED03ull;
    w ^= w >> 29;
    std::memcpy(p + i, &w, 8);
  }
  for (; i < n; ++i) p[i] = static_cast<std::byte>(i * 131 + seed);
}

uint64_t hash_bytes(const std::byte* p, uint64_t n) {
  constexpr uint64_t k = 0x9E3779B97F4A7C15ull;
  uint64_t a = kHashSeed ^ n, b = 0x13198A2E03707344ull, c = 0xA4093822299F31D0ull,
           d = 0x082EFA98EC4E6C89ull;
  uint64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    uint64_t w[4];
    std::memcpy(w, p + i, sizeof w);
    a = rotl(a ^ w[0], 29) * k;
    b = rotl(b ^ w[1], 29) * k;
    c = rotl(c ^ w[2], 29) * k;
    d = rotl(d ^ w[3], 29) * k;
  }
  for (; i < n; ++i) a = rotl(a ^ static_cast<uint64_t>(p[i]), 29) * k;
  uint64_t h = a ^ rotl(b, 17) ^ rotl(c, 31) ^ rotl(d, 47);
  h ^= h >> 33;
  h *= 0xFF51AFD7ED558CCDull;
  h ^= h >> 33;
  return h;
}

uint64_t hash_ranges(const std::byte* base, uint64_t len, uint64_t first, uint64_t step,
                     uint64_t count) {
  uint64_t h = kHashSeed;
  for (uint64_t k = 0; k < count; ++k)
    h = hash_combine(h, hash_bytes(base + first + k * step, len));
  return h;
}

PageBuffer::PageBuffer(uint64_t bytes) : size_(bytes) {
  constexpr uint64_t kPage = 4096;
  const uint64_t rounded = std::max<uint64_t>((bytes + kPage - 1) / kPage * kPage, kPage);
  data_.reset(static_cast<std::byte*>(std::aligned_alloc(kPage, rounded)));
  if (data_) std::memset(data_.get(), 0, rounded);
}

void PageBuffer::Free::operator()(std::byte* p) const noexcept {
  std::free(p);
}

double median(std::vector<double> v) {
  return percentile(std::move(v), 50);
}

double percentile(std::vector<double> v, double p) {
  std::erase_if(v, [](double x) { return std::isnan(x); });
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  if (p >= 100) return v.back();
  // Nearest rank; for an even-sized median, the mean of the two middle values.
  if (p == 50 && v.size() % 2 == 0) return (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  const auto rank = static_cast<size_t>(std::ceil(p / 100 * static_cast<double>(v.size())));
  return v[std::max<size_t>(rank, 1) - 1];
}

double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec / 1e6; };
  return s(u.ru_utime) + s(u.ru_stime);
}

// --- ChildProcess ------------------------------------------------------------------------------

Result<std::unique_ptr<ChildProcess>> ChildProcess::spawn(const std::string& path,
                                                          const std::vector<std::string>& args) {
  int to_child[2], from_child[2];
  if (pipe2(to_child, O_CLOEXEC) != 0) return sys_error("pipe");
  if (pipe2(from_child, O_CLOEXEC) != 0) {
    close(to_child[0]);
    close(to_child[1]);
    return sys_error("pipe");
  }
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = fork();
  if (pid == 0) {  // the child: async-signal-safe calls only
    dup2(to_child[0], STDIN_FILENO);
    dup2(from_child[1], STDOUT_FILENO);
    execv(path.c_str(), argv.data());
    _exit(127);
  }
  close(to_child[0]);
  close(from_child[1]);
  if (pid < 0) {
    close(to_child[1]);
    close(from_child[0]);
    return sys_error("fork");
  }
  return std::unique_ptr<ChildProcess>(new ChildProcess(pid, to_child[1], from_child[0]));
}

ChildProcess::~ChildProcess() {
  if (to_ >= 0) close(to_);  // the child reads EOF and exits
  if (from_ >= 0) close(from_);
  if (pid_ > 0 && !reap(milliseconds(5000))) {
    kill(pid_, SIGKILL);
    reap(milliseconds(5000));
  }
}

Status ChildProcess::send(const std::string& line) {
  std::string data = line + "\n";
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = write(to_, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status(ErrorCode::kPeerUnreachable, "the peer process stopped reading");
    done += static_cast<size_t>(n);
  }
  return Status::ok();
}

Result<std::string> ChildProcess::read_line(milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    if (auto nl = buf_.find('\n'); nl != std::string::npos) {
      std::string line = buf_.substr(0, nl);
      buf_.erase(0, nl + 1);
      return line;
    }
    auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) {
      return Status(ErrorCode::kTimeout, "the peer process did not answer in time");
    }
    pollfd p{from_, POLLIN, 0};
    int rc = poll(&p, 1, static_cast<int>(left.count()));
    if (rc < 0 && errno != EINTR) return sys_error("poll");
    if (rc <= 0) continue;
    char chunk[4096];
    ssize_t n = read(from_, chunk, sizeof chunk);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return sys_error("read");
    if (n == 0) return Status(ErrorCode::kPeerUnreachable, "the peer process exited");
    buf_.append(chunk, static_cast<size_t>(n));
  }
}

Result<std::string> ChildProcess::request(const std::string& line, milliseconds timeout) {
  if (Status s = send(line); !s) return s;
  auto r = read_line(timeout);
  if (r && r->rfind("error", 0) == 0) {
    return Status(ErrorCode::kInternal, fmt::format("peer: '{}' -> {}", line.substr(0, 80), *r));
  }
  return r;
}

Status ChildProcess::quit() {
  if (Status s = send("quit"); !s) return s;
  if (!reap(milliseconds(10'000))) {
    return Status(ErrorCode::kTimeout, "the peer process did not exit after quit");
  }
  if (!WIFEXITED(status_) || WEXITSTATUS(status_) != 0) {
    return Status(ErrorCode::kInternal, fmt::format("the peer process ended with status {:#x}",
                                                    static_cast<unsigned>(status_)));
  }
  return Status::ok();
}

bool ChildProcess::reap(milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (pid_ > 0) {
    pid_t r = waitpid(pid_, &status_, WNOHANG);
    if (r == pid_ || (r < 0 && errno != EINTR)) {
      pid_ = -1;
      break;
    }
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(milliseconds(2));
  }
  return true;
}

// --- external programs -------------------------------------------------------------------------

std::string ProgramResult::summary() const {
  if (!started) return "could not start";
  if (timed_out) return "timed out";
  if (exit_code >= 0) return fmt::format("exit {}", exit_code);
  return "killed by a signal";
}

ProgramResult run_program(const std::vector<std::string>& args, milliseconds timeout,
                          const std::vector<std::string>& env) {
  ProgramResult res;
  if (args.empty()) return res;
  // Everything the child needs is built before fork: the engine's threads exist in this
  // process, so the child may only make async-signal-safe calls.
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<std::string> env_strings(env);
  for (char** e = environ; *e != nullptr; ++e) {
    std::string_view kv(*e);
    const std::string_view key = kv.substr(0, kv.find('='));
    const bool overridden = std::any_of(env.begin(), env.end(), [&](const std::string& x) {
      return std::string_view(x).substr(0, x.find('=')) == key;
    });
    if (!overridden) env_strings.emplace_back(kv);
  }
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);

  int out[2], err[2];
  if (pipe2(out, O_CLOEXEC) != 0) return res;
  if (pipe2(err, O_CLOEXEC) != 0) {
    close(out[0]);
    close(out[1]);
    return res;
  }
  int devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
  pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    if (devnull >= 0) dup2(devnull, STDIN_FILENO);
    dup2(out[1], STDOUT_FILENO);
    dup2(err[1], STDERR_FILENO);
    execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  if (devnull >= 0) close(devnull);
  close(out[1]);
  close(err[1]);
  if (pid < 0) {
    close(out[0]);
    close(err[0]);
    return res;
  }
  setpgid(pid, pid);  // as the child does: no race on who is first
  res.started = true;
  const auto deadline = Clock::now() + timeout;
  pollfd fds[2] = {{out[0], POLLIN, 0}, {err[0], POLLIN, 0}};
  int open_fds = 2;
  while (open_fds > 0) {
    auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) {
      res.timed_out = true;
      kill(-pid, SIGKILL);  // the group this call created: the program and its children
      break;
    }
    int rc = poll(fds, 2, static_cast<int>(left.count()));
    if (rc < 0 && errno != EINTR) break;
    if (rc <= 0) continue;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      char chunk[8192];
      ssize_t n = read(fds[i].fd, chunk, sizeof chunk);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
        continue;
      }
      (i == 0 ? res.out : res.err).append(chunk, static_cast<size_t>(n));
      if (res.err.size() > 8192) res.err.erase(0, res.err.size() - 4096);
    }
  }
  for (auto& f : fds) {
    if (f.fd >= 0) close(f.fd);
  }
  int status = 0;
  const auto reap_deadline = Clock::now() + milliseconds(5000);
  for (;;) {
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid || (r < 0 && errno != EINTR)) break;
    if (Clock::now() >= reap_deadline) {
      kill(-pid, SIGKILL);
      waitpid(pid, &status, 0);
      res.timed_out = true;
      break;
    }
    std::this_thread::sleep_for(milliseconds(2));
  }
  if (!res.timed_out && WIFEXITED(status)) res.exit_code = WEXITSTATUS(status);
  return res;
}

std::string find_program(std::string_view name) {
  const char* path = std::getenv("PATH");
  std::string_view dirs = path ? path : "/usr/bin:/bin";
  while (!dirs.empty()) {
    const size_t colon = dirs.find(':');
    std::string dir(dirs.substr(0, colon));
    dirs = colon == std::string_view::npos ? std::string_view() : dirs.substr(colon + 1);
    if (dir.empty()) continue;
    std::string full = dir + "/" + std::string(name);
    if (access(full.c_str(), X_OK) == 0) return full;
  }
  return "";
}

std::string self_path() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  return n <= 0 ? std::string() : std::string(buf, static_cast<size_t>(n));
}

std::string self_dir() {
  const std::string path = self_path();
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

// --- Progress ----------------------------------------------------------------------------------

Progress::Progress() : tty_(isatty(STDERR_FILENO) == 1) {}

void Progress::update(const std::string& line) {
  if (!tty_) return;
  std::fprintf(stderr, "\r\033[K%s", line.c_str());
  std::fflush(stderr);
  dirty_ = true;
}

void Progress::note(const std::string& line) {
  if (tty_) {
    update(line);
    return;
  }
  std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
}

void Progress::clear() {
  if (!tty_ || !dirty_) return;
  std::fprintf(stderr, "\r\033[K");
  std::fflush(stderr);
  dirty_ = false;
}

}  // namespace fabric::bench
