// fabric-bench: writes between two processes over one provider, timed and verified.
//
//   fabric-bench [--provider tcp|shm|...] [--nic N[,N...]] [--quick] [--total-mib N]
//
// The client (this process) starts a server: itself again (/proc/self/exe --server), talking
// over its stdin/stdout. The server opens an engine, registers a receive buffer, prints
//   address HEX      its engine address (Address::to_hex)
//   memory HEX       the buffer's descriptor (to_hex(RemoteMemory::encode()))
//   ready
// and then answers one line per command:
//   expect IMM COUNT [TIMEOUT_MS]  -> got IMM N | timeout IMM N     (TransferEngine::wait_imm)
//   checksum OFFSET LENGTH         -> checksum OFFSET LENGTH HASH   (FNV-1a 64, hex)
//   quit                           -> the server closes its engine and exits 0
// Anything it cannot do is answered `error MESSAGE`.
//
// The client runs one operation after the other (single writes of several sizes, paged writes
// of several page sizes). Each is timed from its first submission until every transfer's
// done callback has run and the server has counted every immediate; then, untimed, the data
// is verified by comparing the server's checksums of the written ranges with the source.
// Exit status: 0 when every operation completed and verified, 1 otherwise, 2 on bad usage.
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <poll.h>
#include <signal.h>
#include <spdlog/cfg/env.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fabric/fabric.h"

namespace {

using namespace fabric;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * kKiB;

// Default traffic, all operations together.
constexpr uint64_t kDefaultTotalMiB = 512;
constexpr uint64_t kQuickTotalMiB = 160;
// The client's registered source buffer.
constexpr uint64_t kSourceBytes = 64 * kMiB;
constexpr uint64_t kSourceAlign = 4096;
// Single writes: at most this many in flight, and at most this many bytes in flight.
constexpr uint64_t kMaxWindow = 8;
constexpr uint64_t kMaxInFlightBytes = 64 * kMiB;
// Single writes cycle through destination slots covering about this many bytes (at least one
// window's worth, so a slot is reused only after the write before it has completed).
constexpr uint64_t kSingleSpanBytes = 32 * kMiB;
// Paged writes: the gap between pages (stride = page + gap), bytes per transfer, transfers in
// flight, and how much larger than one transfer the destination pool of a window slot is.
constexpr uint64_t kPageGap = 128;
constexpr uint64_t kPagedTransferBytes = 16 * kMiB;
constexpr uint64_t kMinPagesPerTransfer = 64;
constexpr uint64_t kMaxPagesPerTransfer = 512;
constexpr uint64_t kPagedWindow = 2;
constexpr uint64_t kPagePoolFactor = 2;
// Immediates: one for the warm-up, then one value per operation.
constexpr uint32_t kWarmupImm = 1;
constexpr uint32_t kFirstOpImm = 100;
// Bounds on waiting, so that a broken fabric fails the run instead of hanging it.
constexpr milliseconds kTransferTimeout{60'000};
constexpr milliseconds kReplyTimeout{90'000};

struct Options {
  std::string provider = "tcp";
  std::vector<std::string> nics;  // empty: lo for tcp, shm for shm, else the first NIC
  bool provider_given = false;    // on the command line (else FABRIC_PROVIDER may set it)
  bool nics_given = false;
  bool quick = false;
  uint64_t total_mib = 0;  // 0: kDefaultTotalMiB, or kQuickTotalMiB with --quick
  uint64_t seed = 1;
  // Server mode (internal: set by the client when it starts the server).
  bool server = false;
  uint64_t buffer_bytes = 0;
};

std::string human_bytes(uint64_t n) {
  if (n >= kMiB && n % kMiB == 0) return fmt::format("{} MiB", n / kMiB);
  if (n >= kKiB && n % kKiB == 0) return fmt::format("{} KiB", n / kKiB);
  return fmt::format("{} B", n);
}

// FNV-1a 64 of a byte range: what the server answers to `checksum`.
uint64_t fnv1a(const std::byte* p, uint64_t n) {
  uint64_t h = 14695981039346656037ull;
  for (uint64_t i = 0; i < n; ++i) h = (h ^ static_cast<uint64_t>(p[i])) * 1099511628211ull;
  return h;
}

// A deterministic, position-dependent pattern, so that a misplaced page shows.
void fill_pattern(std::byte* p, uint64_t n, uint64_t seed) {
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed * 0xD1B54A32D192ED03ull;
    w ^= w >> 29;
    std::memcpy(p + i, &w, 8);
  }
  for (; i < n; ++i) p[i] = static_cast<std::byte>(i * 131 + seed);
}

// The engine configuration both processes use: the environment (apply_env_overrides) first,
// then what the command line names; an unpinned worker, as the two processes share the cores.
Result<Config> engine_config(const Options& o) {
  Config c;
  c.provider = o.provider;
  c.groups = {GroupConfig{}};
  c.groups[0].cpu = GroupConfig::kCpuNone;
  if (Status s = c.apply_env_overrides(); !s) return s;
  if (o.provider_given) c.provider = o.provider;
  if (o.nics_given) {
    c.groups[0].nics = o.nics;
  } else if (std::getenv("FABRIC_NICS") == nullptr) {
    if (c.provider == "tcp") c.groups[0].nics = {"lo"};
    if (c.provider == "shm") c.groups[0].nics = {"shm"};
  }
  return c;
}

void log_to_stderr() {
  // The server's stdout is the protocol; every log line goes to stderr, in both processes.
  spdlog::set_default_logger(spdlog::stderr_color_mt("fabric-bench"));
  spdlog::cfg::load_env_levels();
}

// --- the server -----------------------------------------------------------------------------

void reply(const std::string& line) {
  std::fputs(line.c_str(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

int run_server(const Options& o) {
  auto config = engine_config(o);
  if (!config) {
    reply("error " + config.status().to_string());
    return 1;
  }
  std::vector<std::byte> buf(std::max<uint64_t>(o.buffer_bytes, 1));  // outlives the engine
  auto created = TransferEngine::create(*config);
  if (!created) {
    reply("error " + created.status().to_string());
    return 1;
  }
  TransferEngine& engine = **created;
  auto reg = engine.register_memory(buf.data(), buf.size());
  if (!reg) {
    reply("error " + reg.status().to_string());
    return 1;
  }
  reply("address " + engine.address().to_hex());
  reply("memory " + to_hex(reg->descriptor.encode()));
  reply("ready");

  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "expect") {
      uint32_t imm = 0;
      uint64_t count = 0;
      uint64_t timeout_ms = kTransferTimeout.count();
      in >> imm >> count;
      if (!in) {
        reply("error usage: expect IMM COUNT [TIMEOUT_MS]");
        continue;
      }
      in >> timeout_ms;
      bool reached = engine.wait_imm(imm, count, milliseconds(timeout_ms));
      reply(fmt::format("{} {} {}", reached ? "got" : "timeout", imm, engine.imm_count(imm)));
    } else if (cmd == "checksum") {
      uint64_t off = 0, len = 0;
      in >> off >> len;
      if (!in || off > buf.size() || len > buf.size() - off) {
        reply(fmt::format("error checksum range outside the {}-byte buffer", buf.size()));
        continue;
      }
      reply(fmt::format("checksum {} {} {:016x}", off, len, fnv1a(buf.data() + off, len)));
    } else if (cmd == "quit") {
      break;
    } else if (!cmd.empty()) {
      reply(fmt::format("error unknown command '{}'", cmd));
    }
  }
  engine.close();
  return 0;
}

// --- the server, seen from the client ----------------------------------------------------------

// The server child process and the pipes to it. The destructor makes sure it is gone.
class ServerProcess {
 public:
  static Result<std::unique_ptr<ServerProcess>> spawn(const std::vector<std::string>& args) {
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
      execv("/proc/self/exe", argv.data());
      _exit(127);
    }
    close(to_child[0]);
    close(from_child[1]);
    if (pid < 0) {
      close(to_child[1]);
      close(from_child[0]);
      return sys_error("fork");
    }
    return std::unique_ptr<ServerProcess>(new ServerProcess(pid, to_child[1], from_child[0]));
  }

  ~ServerProcess() {
    if (to_ >= 0) close(to_);  // the server reads EOF and exits
    if (from_ >= 0) close(from_);
    if (pid_ > 0 && !reap(milliseconds(5000))) {
      kill(pid_, SIGKILL);
      reap(milliseconds(5000));
    }
  }
  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;

  pid_t pid() const { return pid_; }

  Status send(const std::string& line) {
    std::string data = line + "\n";
    size_t done = 0;
    while (done < data.size()) {
      ssize_t n = write(to_, data.data() + done, data.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return Status(ErrorCode::kPeerUnreachable, "the server stopped reading");
      done += static_cast<size_t>(n);
    }
    return Status::ok();
  }

  // The next line from the server, without its newline.
  Result<std::string> read_line(milliseconds timeout = kReplyTimeout) {
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      if (auto nl = buf_.find('\n'); nl != std::string::npos) {
        std::string line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        return line;
      }
      auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) {
        return Status(ErrorCode::kTimeout, "the server did not answer in time");
      }
      pollfd p{from_, POLLIN, 0};
      int rc = poll(&p, 1, static_cast<int>(left.count()));
      if (rc < 0 && errno != EINTR) return sys_error("poll");
      if (rc <= 0) continue;
      char chunk[4096];
      ssize_t n = read(from_, chunk, sizeof chunk);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return sys_error("read");
      if (n == 0) return Status(ErrorCode::kPeerUnreachable, "the server exited");
      buf_.append(chunk, static_cast<size_t>(n));
    }
  }

  // Sends one command and reads its reply; a reply `error ...` becomes a Status.
  Result<std::string> request(const std::string& line) {
    if (Status s = send(line); !s) return s;
    auto r = read_line();
    if (r && r->rfind("error", 0) == 0) {
      return Status(ErrorCode::kInternal, fmt::format("server: '{}' -> {}", line, *r));
    }
    return r;
  }

  // Asks the server to quit and checks that it exits 0.
  Status quit() {
    if (Status s = send("quit"); !s) return s;
    if (!reap(milliseconds(10'000))) {
      return Status(ErrorCode::kTimeout, "the server did not exit after quit");
    }
    if (!WIFEXITED(status_) || WEXITSTATUS(status_) != 0) {
      return Status(ErrorCode::kInternal, fmt::format("the server ended with status {:#x}",
                                                      static_cast<unsigned>(status_)));
    }
    return Status::ok();
  }

 private:
  ServerProcess(pid_t pid, int to, int from) : pid_(pid), to_(to), from_(from) {}

  static Status sys_error(const char* what) {
    return Status(ErrorCode::kInternal, fmt::format("{}: {}", what, std::strerror(errno)));
  }

  // Waits up to `timeout` for the child to exit; true once it has been reaped.
  bool reap(milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    while (pid_ > 0) {
      pid_t r = waitpid(pid_, &status_, WNOHANG);
      if (r == pid_ || (r < 0 && errno != EINTR)) {
        pid_ = -1;
        break;
      }
      if (Clock::now() >= deadline) return false;
      std::this_thread::sleep_for(milliseconds(5));
    }
    return true;
  }

  pid_t pid_;
  int to_;
  int from_;
  int status_ = 0;
  std::string buf_;
};

// --- completion tracking ----------------------------------------------------------------------

// Completion of a numbered sequence of transfers. The window rule of the operations is "submit
// transfer i only once every transfer below i - window has finished": it bounds the transfers
// in flight and orders two writes to the same destination range, since a range is reused only
// a window or more later. Shared with the callbacks, which may outlive an abandoned operation.
class Completions {
 public:
  explicit Completions(size_t total) : state_(std::make_shared<State>(total)) {}

  Callbacks callbacks(size_t index) {
    return Callbacks{[st = state_, index] { st->finish(index, Status::ok()); },
                     [st = state_, index](const Status& s) { st->finish(index, s); }};
  }

  // Blocks until transfers [0, n) have all finished (done or failed); false at the deadline.
  bool wait_prefix(size_t n, Clock::time_point deadline) const {
    std::unique_lock lock(state_->mu);
    return state_->cv.wait_until(lock, deadline, [&] { return state_->prefix >= n; });
  }

  size_t failed() const {
    std::lock_guard lock(state_->mu);
    return state_->failed;
  }
  Status first_error() const {
    std::lock_guard lock(state_->mu);
    return state_->first_error;
  }

 private:
  struct State {
    explicit State(size_t total) : finished(total, 0) {}
    void finish(size_t index, const Status& s) {
      {
        std::lock_guard lock(mu);
        finished[index] = 1;
        while (prefix < finished.size() && finished[prefix]) ++prefix;
        if (!s && failed++ == 0) first_error = s;
      }
      cv.notify_all();
    }
    std::mutex mu;
    std::condition_variable cv;
    std::vector<uint8_t> finished;
    size_t prefix = 0;  // transfers [0, prefix) have all finished
    size_t failed = 0;
    Status first_error;
  };
  std::shared_ptr<State> state_;
};

// --- the operations ---------------------------------------------------------------------------

// Single writes of `size` bytes, each with the operation's immediate. Write i reads from a
// source offset that moves around the source buffer and lands in destination slot i % slots.
struct SinglePlan {
  uint64_t size = 0;
  uint64_t count = 0;
  uint64_t window = 0;
  uint64_t slots = 0;

  static SinglePlan make(uint64_t size, uint64_t budget) {
    SinglePlan p;
    p.size = size;
    p.count = std::max<uint64_t>(1, budget / size);
    p.window = std::clamp<uint64_t>(kMaxInFlightBytes / size, 1, kMaxWindow);
    p.slots = std::min(p.count, std::max(p.window, kSingleSpanBytes / size));
    return p;
  }
  uint64_t span() const { return slots * size; }
  uint64_t src_offset(uint64_t i) const {
    const uint64_t positions = (kSourceBytes - size) / kSourceAlign + 1;
    return (i * 7919 + 13) % positions * kSourceAlign;
  }
  uint64_t dst_offset(uint64_t i) const { return i % slots * size; }
};

// Paged writes: `transfers` transfers of `pages` pages each, one immediate per page. Source
// pages are random; destination pages are distinct random pages of the pool of window slot
// j % window, so that no two transfers in flight write the same page.
struct PagedPlan {
  uint64_t page = 0;
  uint64_t stride = 0;
  uint64_t pages = 0;  // per transfer
  uint64_t transfers = 0;
  uint64_t window = 0;
  uint64_t pool_pages = 0;  // destination pages per window slot

  static PagedPlan make(uint64_t page, uint64_t budget) {
    PagedPlan p;
    p.page = page;
    p.stride = page + kPageGap;
    p.pages = std::clamp<uint64_t>(kPagedTransferBytes / page, kMinPagesPerTransfer,
                                   kMaxPagesPerTransfer);
    p.transfers = std::max<uint64_t>(1, budget / (p.pages * page));
    p.window = std::min(kPagedWindow, p.transfers);
    p.pool_pages = p.pages * kPagePoolFactor;
    return p;
  }
  uint64_t span() const { return window * pool_pages * stride; }
  uint64_t source_pages() const { return kSourceBytes / stride; }
};

struct OpResult {
  std::string op;
  uint64_t size = 0;  // bytes per write (single) or per page (paged)
  uint64_t transfers = 0;
  uint64_t writes = 0;  // writes (single) or pages (paged) that carried an immediate each
  double seconds = 0;
  bool completed = false;  // every transfer completed and every immediate arrived
  bool verified = false;
  std::string error;

  uint64_t bytes() const { return writes * size; }
};

// What every operation works with.
struct Session {
  TransferEngine& engine;
  ServerProcess& server;
  Registration src;
  const std::vector<std::byte>& src_bytes;
  RemoteMemory dst;
};

// Waits for transfers [0, submitted) and then for `imms` arrivals of `imm` at the server.
// Returns the first error, if any.
Status finish_transfers(Session& s, const Completions& done, size_t submitted, uint32_t imm,
                        uint64_t imms, Clock::time_point deadline) {
  if (!done.wait_prefix(submitted, deadline)) {
    return Status(ErrorCode::kTimeout, "transfers did not complete within the timeout");
  }
  if (done.failed() > 0) {
    Status e = done.first_error();
    return Status(e.code(),
                  fmt::format("{} transfer(s) failed, first: {}", done.failed(), e.message()));
  }
  auto r = s.server.request(fmt::format("expect {} {} {}", imm, imms, kTransferTimeout.count()));
  if (!r) return r.status();
  uint32_t got_imm = 0;
  unsigned long long got = 0;
  char word[16] = {};
  if (std::sscanf(r->c_str(), "%15s %u %llu", word, &got_imm, &got) != 3 || got_imm != imm) {
    return Status(ErrorCode::kInternal, fmt::format("unexpected server reply '{}'", *r));
  }
  if (std::string_view(word) != "got" || got != imms) {
    return Status(ErrorCode::kTimeout,
                  fmt::format("the server counted {} of {} immediates {}", got, imms, imm));
  }
  return Status::ok();
}

// Compares the server's checksum of [dst_off, dst_off + len) with the source's.
Result<bool> same_at_server(Session& s, uint64_t dst_off, uint64_t src_off, uint64_t len) {
  auto r = s.server.request(fmt::format("checksum {} {}", dst_off, len));
  if (!r) return r.status();
  unsigned long long off = 0, n = 0, remote = 0;
  if (std::sscanf(r->c_str(), "checksum %llu %llu %llx", &off, &n, &remote) != 3 ||
      off != dst_off || n != len) {
    return Status(ErrorCode::kInternal, fmt::format("unexpected server reply '{}'", *r));
  }
  return remote == fnv1a(s.src_bytes.data() + src_off, len);
}

// same_at_server, with what went wrong recorded in `res.error`.
bool verify_range(Session& s, uint64_t dst_off, uint64_t src_off, uint64_t len, OpResult& res) {
  auto same = same_at_server(s, dst_off, src_off, len);
  if (!same) {
    res.error = same.status().to_string();
  } else if (!*same) {
    res.error = fmt::format("the server's bytes [{}, {}) differ from the source's [{}, {})",
                            dst_off, dst_off + len, src_off, src_off + len);
  }
  return same && *same;
}

// The timed phase of an operation: transfers [0, count) submitted through `submit(i,
// callbacks)`, transfer i only once every transfer below i - window has finished, until all
// have finished and the server has counted `imms_per_transfer` arrivals of `imm` for each.
struct TimedPhase {
  uint64_t submitted = 0;
  double seconds = 0;
  Status error;
};

template <typename Submit>
TimedPhase run_transfers(Session& s, uint64_t count, uint64_t window, uint32_t imm,
                         uint64_t imms_per_transfer, Submit&& submit) {
  TimedPhase phase;
  Completions done(count);
  const auto start = Clock::now();
  const auto deadline = start + kTransferTimeout;
  for (uint64_t i = 0; i < count; ++i) {
    if (i >= window && !done.wait_prefix(i - window + 1, deadline)) break;
    if (done.failed() > 0) break;
    Result<TransferId> id = submit(i, done.callbacks(i));
    if (!id) {
      phase.error = id.status();
      break;
    }
    ++phase.submitted;
  }
  Status finished = finish_transfers(s, done, phase.submitted, imm,
                                     phase.submitted * imms_per_transfer, deadline);
  phase.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (phase.error.is_ok()) phase.error = finished;
  if (phase.error.is_ok() && phase.submitted != count) {
    phase.error = Status(ErrorCode::kTimeout, "transfers did not complete within the timeout");
  }
  return phase;
}

OpResult run_single(Session& s, const SinglePlan& plan, uint32_t imm) {
  TimedPhase phase =
      run_transfers(s, plan.count, plan.window, imm, 1, [&](uint64_t i, Callbacks cb) {
        SingleWrite w;
        w.src = s.src.handle;
        w.src_offset = plan.src_offset(i);
        w.dst = s.dst;
        w.dst_offset = plan.dst_offset(i);
        w.length = plan.size;
        w.imm = imm;
        return s.engine.submit(w, std::move(cb));
      });
  OpResult res;
  res.op = "single write";
  res.size = plan.size;
  res.transfers = phase.submitted;
  res.writes = phase.submitted;
  res.seconds = phase.seconds;
  res.completed = phase.error.is_ok();
  if (!res.completed) {
    res.error = phase.error.to_string();
    return res;
  }

  // Each slot holds what the last write to it carried.
  res.verified = true;
  for (uint64_t slot = 0; slot < plan.slots && res.verified; ++slot) {
    const uint64_t last = slot + (plan.count - 1 - slot) / plan.slots * plan.slots;
    res.verified = verify_range(s, plan.dst_offset(last), plan.src_offset(last), plan.size, res);
  }
  return res;
}

OpResult run_paged(Session& s, const PagedPlan& plan, uint32_t imm, uint64_t seed) {
  // Page lists, drawn before the clock starts; last_src[d]: the source page that ends up in
  // destination page d (or -1).
  std::mt19937_64 rng(seed * 1000003 + imm);
  std::vector<std::vector<uint32_t>> src_pages(plan.transfers), dst_pages(plan.transfers);
  std::vector<int64_t> last_src(plan.window * plan.pool_pages, -1);
  std::vector<uint32_t> pool(plan.pool_pages);
  std::uniform_int_distribution<uint32_t> any_src(0,
                                                  static_cast<uint32_t>(plan.source_pages() - 1));
  for (uint64_t j = 0; j < plan.transfers; ++j) {
    const uint32_t base = static_cast<uint32_t>(j % plan.window * plan.pool_pages);
    std::iota(pool.begin(), pool.end(), base);
    for (uint64_t i = 0; i < plan.pages; ++i) {  // a partial Fisher-Yates shuffle
      std::uniform_int_distribution<size_t> pick(i, pool.size() - 1);
      std::swap(pool[i], pool[pick(rng)]);
      dst_pages[j].push_back(pool[i]);
      src_pages[j].push_back(any_src(rng));
      last_src[pool[i]] = src_pages[j].back();
    }
  }

  TimedPhase phase =
      run_transfers(s, plan.transfers, plan.window, imm, plan.pages, [&](uint64_t j, Callbacks cb) {
        PagedWrite w;
        w.src = s.src.handle;
        w.dst = s.dst;
        w.page_bytes = plan.page;
        w.src_pages = src_pages[j];
        w.src_stride = plan.stride;
        w.dst_pages = dst_pages[j];
        w.dst_stride = plan.stride;
        w.imm = imm;
        return s.engine.submit(w, std::move(cb));
      });
  OpResult res;
  res.op = "paged write";
  res.size = plan.page;
  res.transfers = phase.submitted;
  res.writes = phase.submitted * plan.pages;
  res.seconds = phase.seconds;
  res.completed = phase.error.is_ok();
  if (!res.completed) {
    res.error = phase.error.to_string();
    return res;
  }

  res.verified = true;
  for (uint64_t d = 0; d < last_src.size() && res.verified; ++d) {
    if (last_src[d] < 0) continue;
    res.verified = verify_range(s, d * plan.stride,
                                static_cast<uint64_t>(last_src[d]) * plan.stride, plan.page, res);
  }
  return res;
}

// One untimed immediate, so that connection set-up is not charged to the first operation.
Status warm_up(Session& s) {
  Completions done(1);
  ImmWrite w;
  w.peer = s.dst.owner();
  w.imm = kWarmupImm;
  auto id = s.engine.submit(w, done.callbacks(0));
  if (!id) return id.status();
  return finish_transfers(s, done, 1, kWarmupImm, 1, Clock::now() + kTransferTimeout);
}

struct Greeting {
  Address address;
  RemoteMemory memory;
};

// The server's first lines: "address HEX", "memory HEX", "ready"; or "error ..." when it
// could not set up.
Result<Greeting> read_greeting(ServerProcess& server) {
  auto field = [&](const std::string& key) -> Result<std::string> {
    auto line = server.read_line();
    if (!line) return line.status();
    if (line->rfind(key + " ", 0) != 0) {
      return Status(ErrorCode::kInternal,
                    fmt::format("expected '{} ...', the server said '{}'", key, *line));
    }
    return line->substr(key.size() + 1);
  };
  auto address_hex = field("address");
  if (!address_hex) return address_hex.status();
  auto memory_hex = field("memory");
  if (!memory_hex) return memory_hex.status();
  auto ready = server.read_line();
  if (!ready) return ready.status();
  if (*ready != "ready") {
    return Status(ErrorCode::kInternal, fmt::format("expected 'ready', got '{}'", *ready));
  }
  auto address = Address::from_hex(*address_hex);
  if (!address) return address.status();
  auto memory_bytes = from_hex(*memory_hex);
  if (!memory_bytes) return memory_bytes.status();
  auto memory = RemoteMemory::decode(*memory_bytes);
  if (!memory) return memory.status();
  return Greeting{*address, *memory};
}

void print_table(const std::vector<OpResult>& results) {
  fmt::print("{:<13} {:>7} {:>9} {:>7} {:>9} {:>9} {:>8}  {}\n", "op", "size", "transfers",
             "writes", "MiB", "seconds", "Gbit/s", "verified");
  for (const OpResult& r : results) {
    const double mib = static_cast<double>(r.bytes()) / kMiB;
    std::string seconds = "-", gbits = "-";  // no rate unless every transfer completed
    if (r.completed && r.seconds > 0) {
      seconds = fmt::format("{:.4f}", r.seconds);
      gbits = fmt::format("{:.2f}", static_cast<double>(r.bytes()) * 8 / r.seconds / 1e9);
    }
    fmt::print("{:<13} {:>7} {:>9} {:>7} {:>9.1f} {:>9} {:>8}  {}\n", r.op, human_bytes(r.size),
               r.transfers, r.writes, mib, seconds, gbits, r.verified ? "yes" : "no");
  }
  for (const OpResult& r : results) {
    if (!r.error.empty()) {
      fmt::print("{} {}: {}\n", r.op, human_bytes(r.size), r.error);
    } else if (!r.verified) {
      fmt::print("{} {}: the data at the server differs from the source\n", r.op,
                 human_bytes(r.size));
    }
  }
}

int run_client(const Options& o) {
  const uint64_t total =
      (o.total_mib != 0 ? o.total_mib : (o.quick ? kQuickTotalMiB : kDefaultTotalMiB)) * kMiB;
  const std::vector<SinglePlan> singles = {
      SinglePlan::make(64 * kKiB, total / 5),
      SinglePlan::make(1 * kMiB, total / 5),
      SinglePlan::make(16 * kMiB, total / 5),
  };
  const std::vector<PagedPlan> pageds = {
      PagedPlan::make(64 * kKiB, total / 5),
      PagedPlan::make(16 * kKiB, total / 5),
  };
  uint64_t buffer_bytes = 0;
  for (const auto& p : singles) buffer_bytes = std::max(buffer_bytes, p.span());
  for (const auto& p : pageds) buffer_bytes = std::max(buffer_bytes, p.span());

  auto config = engine_config(o);
  if (!config) {
    fmt::print(stderr, "fabric-bench: {}\n", config.status().to_string());
    return 1;
  }
  // The server first: it sets up while this process does.
  std::vector<std::string> args = {"fabric-bench",   "--server",
                                   "--provider",     config->provider,
                                   "--buffer-bytes", std::to_string(buffer_bytes)};
  if (!config->groups[0].nics.empty()) {
    args.push_back("--nic");
    args.push_back(fmt::format("{}", fmt::join(config->groups[0].nics, ",")));
  }
  auto spawned = ServerProcess::spawn(args);
  if (!spawned) {
    fmt::print(stderr, "fabric-bench: cannot start the server: {}\n", spawned.status().to_string());
    return 1;
  }
  ServerProcess& server = **spawned;

  // The source outlives the engine that registers it.
  std::vector<std::byte> src_bytes(kSourceBytes);
  fill_pattern(src_bytes.data(), src_bytes.size(), o.seed);
  auto created = TransferEngine::create(*config);
  if (!created) {
    fmt::print(stderr, "fabric-bench: cannot create a TransferEngine on provider '{}': {}\n",
               config->provider, created.status().to_string());
    return 1;
  }
  TransferEngine& engine = **created;
  auto src = engine.register_memory(src_bytes.data(), src_bytes.size());
  if (!src) {
    fmt::print(stderr, "fabric-bench: registering the source: {}\n", src.status().to_string());
    return 1;
  }

  auto greeting = read_greeting(server);
  if (!greeting) {
    fmt::print(stderr, "fabric-bench: the server did not start: {}\n",
               greeting.status().to_string());
    return 1;
  }
  const RemoteMemory& dst = greeting->memory;

  const GroupInfo& info = engine.group_info();
  fmt::print("fabric-bench: provider {}, NIC(s) {}, delivery_complete {}\n", info.provider,
             fmt::join(info.nics, ","), info.delivery_complete ? "yes" : "no");
  fmt::print("  client  pid {:<7} address {}\n", getpid(), engine.address().short_name());
  fmt::print("  server  pid {:<7} address {}, receive buffer {:.1f} MiB\n", server.pid(),
             greeting->address.short_name(), static_cast<double>(buffer_bytes) / kMiB);
  fmt::print("  traffic {} MiB in all{}\n\n", total / kMiB, o.quick ? " (--quick)" : "");
  std::fflush(stdout);

  Session session{engine, server, *src, src_bytes, dst};
  if (Status s = warm_up(session); !s) {
    fmt::print(stderr, "fabric-bench: warm-up immediate failed: {}\n", s.to_string());
    return 1;
  }
  // One immediate value per operation, so that each counts only its own arrivals.
  std::vector<std::function<OpResult()>> ops;
  uint32_t imm = kFirstOpImm;
  for (const auto& p : singles) {
    ops.push_back([&, p, i = imm++] { return run_single(session, p, i); });
  }
  for (const auto& p : pageds) {
    ops.push_back([&, p, i = imm++] { return run_paged(session, p, i, o.seed); });
  }
  std::vector<OpResult> results;
  for (const auto& op : ops) {
    results.push_back(op());
    if (!results.back().completed) break;  // the fabric or the server is broken: stop here
  }
  print_table(results);
  if (results.size() < ops.size()) {
    fmt::print("{} operation(s) skipped after the failure\n", ops.size() - results.size());
  }

  bool ok = std::all_of(results.begin(), results.end(),
                        [](const OpResult& r) { return r.verified && r.error.empty(); });
  if (Status s = server.quit(); !s) {
    fmt::print(stderr, "fabric-bench: {}\n", s.to_string());
    ok = false;
  }
  engine.close();
  fmt::print("\n{}\n", ok ? "all operations completed and verified"
                          : "FAILED: some operation did not complete or verify");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"fabric-bench: timed, verified writes between two processes"};
  app.add_option("--provider", o.provider, "libfabric provider: tcp, shm, efa, verbs, auto")
      ->capture_default_str();
  app.add_option("--nic", o.nics,
                 "NIC(s) of the device group, comma-separated (default: lo for tcp, shm for "
                 "shm, else the provider's first)")
      ->delimiter(',');
  app.add_flag("--quick", o.quick, "about 160 MiB of traffic instead of 512");
  app.add_option("--total-mib", o.total_mib, "traffic of all operations together, in MiB")
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 20));
  app.add_option("--seed", o.seed, "seed of the data pattern and the page choice")
      ->capture_default_str();
  app.add_flag("--server", o.server, "internal: run as the server of a client")->group("");
  app.add_option("--buffer-bytes", o.buffer_bytes, "internal: the server's buffer")->group("");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;  // --help is not an error
  }
  o.provider_given = app.count("--provider") > 0;
  o.nics_given = app.count("--nic") > 0;

  log_to_stderr();
  if (o.server) return run_server(o);
  // A server that dies makes writes to its pipe fail with EPIPE instead of killing us.
  signal(SIGPIPE, SIG_IGN);
  return run_client(o);
}
