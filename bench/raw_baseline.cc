// fabric-bench-raw: the ceiling fabric-bench measures the engine against. A minimal libfabric
// program, two processes (it forks before anything else runs), each with one endpoint, one CQ
// and one registered buffer. Same provider, same endpoint (FI_EP_RDM, FI_THREAD_DOMAIN, manual
// progress: no provider thread), same completion semantics as the engine (delivery-complete
// where the engine asks for it), no engine in between.
//
//   fabric-bench-raw --provider tcp --nic lo --size 65536 --count 4096 --window 8
//   fabric-bench-raw --provider tcp --nic lo --size 0 --count 2000 --mode lat
//
// --mode bw (default): the client posts fi_writedata with remote CQ data, `window` writes in
// flight, into the server's buffer; the server reads its CQ until it has counted every
// immediate. Write i goes from slot i % slots of the client's buffer to the same slot of the
// server's, with enough slots to cover --span bytes (at least `window`): a span as large as
// the engine's pass keeps the memory footprint (and so the cache misses) alike. Prints
//   raw PROVIDER SIZE COUNT SECONDS GBPS POST_US CPU_S
// SECONDS: from the first post to the last local completion (after which, with delivery
// complete, the server has every immediate); POST_US: mean time inside one successful
// fi_writedata; CPU_S: CPU time of both processes during the timed writes.
//
// --batch N (bw): the writes go out in bursts of up to N through fi_writemsg, each but the last
// of a burst with FI_MORE (the provider may hold them and send the burst at once): to measure
// whether batching pays on a provider before the engine does it.
//
// --mode lat: ping-pong. The client writes `size` bytes with an immediate; the server answers
// each arrival with the same write back; the client waits for the answer before the next.
// Prints
//   rawlat PROVIDER SIZE COUNT P50_US P99_US
// the round-trip times. Untimed warm-up writes (--warmup) come first.
//
// --mode read: as bw, with fi_read: the client reads slot i % slots of the server's buffer into
// the same slot of its own, `window` reads in flight. The server's code takes no part but
// progress (manual progress: its CQ is read, so that the provider answers); it learns where
// the warm-up ends and the timed reads end from a write of no bytes with an immediate that the
// client sends after each (its only remote CQ data). Prints
//   rawread PROVIDER SIZE COUNT SECONDS GBPS POST_US CPU_S
// as bw, POST_US being the time inside one successful fi_read.
// --mode readlat: one read of `size` bytes at a time, each waited for before the next: the
// read's completion is its round trip (the request to the server, the data back). Prints
//   rawreadlat PROVIDER SIZE COUNT P50_US P99_US
// Both sides' domains ask for FI_READ and FI_REMOTE_READ, and every buffer is registered for
// remote reads as well as writes, as the engine does for memory registered remote_read.
//
// --commands: the two processes stay up and measure once per line of stdin, printing one line
// each (or `error ...`): `bw SIZE COUNT WINDOW WARMUP [SPAN]`, `lat SIZE COUNT WARMUP`, `rd SIZE
// COUNT WINDOW WARMUP [SPAN]` or `rdlat SIZE COUNT WARMUP`; `quit` or EOF ends. fabric-bench
// runs it so, as libfabric's start-up takes most of a second here.
//
// Waiting (--wait): like the engine's worker with its default Config, each side busy-polls its
// CQ while it has writes outstanding, and otherwise sleeps on the CQ's wait fd once --spin-us
// have passed without a completion (fd, the default). With --wait spin both sides always
// busy-poll: the lowest latency when every process has a core of its own, and a loss when they
// share the cores (a spinning target takes CPU time from the sender).
#include <poll.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

// Every loop ends by this deadline, whatever the peer does.
constexpr auto kDeadline = std::chrono::seconds(120);
constexpr size_t kCqBatch = 64;
// Ping-pong: operation contexts in the ring (local completions may lag the answers).
constexpr uint64_t kLatContexts = 64;
// --span is capped here (each process allocates the span).
constexpr uint64_t kMaxSpan = 256ull << 20;

struct Options {
  std::string provider = "tcp";
  std::string nic = "lo";
  std::string mode = "bw";
  uint64_t size = 65536;
  uint64_t count = 1024;
  uint64_t window = 8;
  uint64_t span = 0;
  uint64_t warmup = 16;
  std::string wait = "fd";
  uint64_t spin_us = 200;
  bool commands = false;
  uint64_t batch = 1;  // bw, read: operations posted per burst, all but the last with FI_MORE
};

[[noreturn]] void die(const char* what, int rc) {
  std::fprintf(stderr, "fabric-bench-raw: %s: %s\n", what, fi_strerror(-rc));
  std::exit(1);
}

#define CHECK(call)                   \
  do {                                \
    int rc_ = static_cast<int>(call); \
    if (rc_ != 0) die(#call, rc_);    \
  } while (0)

double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec / 1e6; };
  return s(u.ru_utime) + s(u.ru_stime);
}

// One side: endpoint, CQ, and a buffer registered for local and remote writes and reads.
struct Side {
  fi_info* info = nullptr;
  fid_fabric* fabric = nullptr;
  fid_domain* domain = nullptr;
  fid_cq* cq = nullptr;
  fid_av* av = nullptr;
  fid_ep* ep = nullptr;
  fid_mr* mr = nullptr;
  int wait_fd = -1;  // the CQ's, when it has one and --wait fd
  std::chrono::microseconds spin{200};
  Clock::time_point last_activity = Clock::now();
  std::vector<char> name;
  std::vector<char> buf;
  fi_addr_t peer = FI_ADDR_UNSPEC;
  uint64_t peer_addr = 0;  // the peer's buffer, as its writes target it
  uint64_t peer_key = 0;
  std::vector<fi_context2> ctx;
  uint64_t batch = 1;     // --batch
  uint64_t op_flags = 0;  // the endpoint's default transmit flags, for fi_writemsg
  bool read = false;      // the current run reads from the peer instead of writing to it

  void* desc() const { return fi_mr_desc(mr); }
  ~Side() {  // the endpoint before what it is bound to
    if (ep) fi_close(&ep->fid);
    if (mr) fi_close(&mr->fid);
    if (av) fi_close(&av->fid);
    if (cq) fi_close(&cq->fid);
    if (domain) fi_close(&domain->fid);
    if (fabric) fi_close(&fabric->fid);
    if (info) fi_freeinfo(info);
  }
};

void open_side(Side& s, const Options& o) {
  fi_info* hints = fi_allocinfo();
  hints->caps =
      FI_MSG | FI_RMA | FI_WRITE | FI_REMOTE_WRITE | FI_READ | FI_REMOTE_READ | FI_SEND | FI_RECV;
  hints->ep_attr->type = FI_EP_RDM;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
  hints->domain_attr->threading = FI_THREAD_DOMAIN;
  hints->domain_attr->data_progress = FI_PROGRESS_MANUAL;  // as the engine: no progress thread
  if (o.provider != "shm") hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE;  // as the engine
  hints->fabric_attr->prov_name = strdup(o.provider.c_str());
  fi_info* list = nullptr;
  CHECK(fi_getinfo(FI_VERSION(1, 17), nullptr, nullptr, 0, hints, &list));
  fi_freeinfo(hints);
  for (fi_info* i = list; i != nullptr && s.info == nullptr; i = i->next) {
    if (o.nic == i->domain_attr->name &&
        (i->addr_format == FI_SOCKADDR_IN || o.provider != "tcp")) {
      s.info = fi_dupinfo(i);
    }
  }
  fi_freeinfo(list);
  if (s.info == nullptr) {
    std::fprintf(stderr, "fabric-bench-raw: provider %s has no NIC %s\n", o.provider.c_str(),
                 o.nic.c_str());
    std::exit(1);
  }
  s.batch = o.batch;
  s.op_flags = s.info->tx_attr->op_flags;
  CHECK(fi_fabric(s.info->fabric_attr, &s.fabric, nullptr));
  CHECK(fi_domain(s.fabric, s.info, &s.domain, nullptr));
  fi_cq_attr cq_attr{};
  cq_attr.format = FI_CQ_FORMAT_DATA;
  cq_attr.size = 8192;
  cq_attr.wait_obj = o.wait == "fd" ? FI_WAIT_FD : FI_WAIT_NONE;  // as the engine opens it
  if (fi_cq_open(s.domain, &cq_attr, &s.cq, nullptr) != 0) {
    cq_attr.wait_obj = FI_WAIT_NONE;
    CHECK(fi_cq_open(s.domain, &cq_attr, &s.cq, nullptr));
  }
  if (cq_attr.wait_obj == FI_WAIT_FD && fi_control(&s.cq->fid, FI_GETWAIT, &s.wait_fd) != 0) {
    s.wait_fd = -1;
  }
  s.spin = std::chrono::microseconds(o.spin_us);
  fi_av_attr av_attr{};
  av_attr.type = FI_AV_TABLE;
  CHECK(fi_av_open(s.domain, &av_attr, &s.av, nullptr));
  CHECK(fi_endpoint(s.domain, s.info, &s.ep, nullptr));
  CHECK(fi_ep_bind(s.ep, &s.cq->fid, FI_TRANSMIT | FI_RECV));
  CHECK(fi_ep_bind(s.ep, &s.av->fid, 0));
  CHECK(fi_enable(s.ep));
  size_t len = 256;
  s.name.resize(len);
  CHECK(fi_getname(&s.ep->fid, s.name.data(), &len));
  s.name.resize(len);
}

void write_all(int fd, const void* p, size_t n) {
  if (::write(fd, p, n) != static_cast<ssize_t>(n)) std::exit(1);
}
// Reads n bytes; false at EOF before the first byte.
bool read_some(int fd, void* p, size_t n) {
  auto* c = static_cast<char*>(p);
  const size_t want = n;
  while (n > 0) {
    ssize_t r = ::read(fd, c, n);
    if (r == 0 && n == want) return false;
    if (r <= 0) std::exit(1);
    c += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}
void read_all(int fd, void* p, size_t n) {
  if (!read_some(fd, p, n)) std::exit(1);
}

// Each side tells the other its endpoint name; then each inserts the other into its address
// vector.
void exchange(Side& s, int out, int in) {
  const uint64_t len = s.name.size();
  write_all(out, &len, sizeof len);
  write_all(out, s.name.data(), len);
  uint64_t peer_len = 0;
  read_all(in, &peer_len, sizeof peer_len);
  if (peer_len > 4096) std::exit(1);
  std::vector<char> peer_name(peer_len);
  read_all(in, peer_name.data(), peer_len);
  if (fi_av_insert(s.av, peer_name.data(), 1, &s.peer, 0, nullptr) != 1) {
    die("fi_av_insert", -FI_EINVAL);
  }
}

// What one fi_cq_read found: local completions and arrivals of remote CQ data.
struct Polled {
  uint64_t local = 0;
  uint64_t remote = 0;
};

Polled poll_cq(Side& s) {
  fi_cq_data_entry entries[kCqBatch];
  Polled p;
  ssize_t n = fi_cq_read(s.cq, entries, kCqBatch);
  if (n == -FI_EAVAIL) {
    fi_cq_err_entry err{};
    fi_cq_readerr(s.cq, &err, 0);
    std::fprintf(stderr, "fabric-bench-raw: completion error: %s\n", fi_strerror(err.err));
    std::exit(1);
  }
  for (ssize_t i = 0; i < n; ++i) {
    if (entries[i].flags & FI_REMOTE_CQ_DATA) {
      ++p.remote;
    } else {
      ++p.local;
    }
  }
  return p;
}

// poll_cq, and for a side with nothing outstanding: after `spin` without a completion, a
// sleep on the CQ's wait fd (100 ms at most) until the fabric has something.
Polled next(Side& s, bool outstanding) {
  Polled p = poll_cq(s);
  const auto now = Clock::now();
  if (p.local + p.remote > 0 || outstanding || s.wait_fd < 0) {
    s.last_activity = now;
    return p;
  }
  if (now - s.last_activity < s.spin) return p;
  fid* fids[] = {&s.cq->fid};
  if (fi_trywait(s.fabric, fids, 1) == 0) {
    pollfd pfd{s.wait_fd, POLLIN, 0};
    ::poll(&pfd, 1, 100);
  }
  return p;
}

// Posts one write of `size` bytes from slot `slot` of the buffer to the peer's slot (s.read:
// one read of the peer's slot into ours), with context `ctx` (which must not be in use); true
// once posted, false on EAGAIN. `more`: through fi_writemsg (fi_readmsg) with FI_MORE (the
// provider may hold it until an operation without the flag).
bool post(Side& s, uint64_t size, uint64_t slot, uint64_t ctx, double* post_seconds,
          bool more = false) {
  const auto t0 = Clock::now();
  ssize_t rc = 0;
  if (s.read && s.batch > 1) {
    iovec iov{s.buf.data() + slot * size, size};
    void* desc = s.desc();
    fi_rma_iov rma{s.peer_addr + slot * size, size, s.peer_key};
    fi_msg_rma msg{};
    msg.msg_iov = &iov;
    msg.desc = &desc;
    msg.iov_count = 1;
    msg.addr = s.peer;
    msg.rma_iov = &rma;
    msg.rma_iov_count = 1;
    msg.context = &s.ctx[ctx % s.ctx.size()];
    rc = fi_readmsg(s.ep, &msg, s.op_flags | FI_COMPLETION | (more ? FI_MORE : 0));
  } else if (s.read) {
    rc = fi_read(s.ep, s.buf.data() + slot * size, size, s.desc(), s.peer,
                 s.peer_addr + slot * size, s.peer_key, &s.ctx[ctx % s.ctx.size()]);
  } else if (s.batch > 1) {
    iovec iov{s.buf.data() + slot * size, size};
    void* desc = s.desc();
    fi_rma_iov rma{s.peer_addr + slot * size, size, s.peer_key};
    fi_msg_rma msg{};
    msg.msg_iov = &iov;
    msg.desc = &desc;
    msg.iov_count = 1;
    msg.addr = s.peer;
    msg.rma_iov = &rma;
    msg.rma_iov_count = 1;
    msg.context = &s.ctx[ctx % s.ctx.size()];
    msg.data = 1;
    rc = fi_writemsg(s.ep, &msg,
                     s.op_flags | FI_REMOTE_CQ_DATA | FI_COMPLETION | (more ? FI_MORE : 0));
  } else {
    rc = fi_writedata(s.ep, s.buf.data() + slot * size, size, s.desc(), 1, s.peer,
                      s.peer_addr + slot * size, s.peer_key, &s.ctx[ctx % s.ctx.size()]);
  }
  if (rc == -FI_EAGAIN) return false;
  if (rc != 0) die(s.read ? "fi_read" : "fi_writedata", static_cast<int>(rc));
  if (post_seconds) *post_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  return true;
}

struct Blast {
  double seconds = 0;
  double post_seconds = 0;
};

// Posts `count` writes (s.read: reads), `window` in flight, cycling through `slots` slots, until
// every local completion has come.
Blast blast(Side& s, uint64_t size, uint64_t window, uint64_t slots, uint64_t count) {
  Blast b;
  uint64_t posted = 0, done = 0;
  const auto start = Clock::now();
  const auto deadline = start + kDeadline;
  while (done < count) {
    // Bursts of up to --batch writes, each but the last of a burst with FI_MORE.
    for (uint64_t in_burst = 0; posted < count && posted - done < window; ++in_burst) {
      const bool last =
          in_burst + 1 == s.batch || posted + 1 == count || posted + 1 - done == window;
      if (!post(s, size, posted % slots, posted % window, &b.post_seconds, !last)) break;
      ++posted;
      if (last) in_burst = UINT64_MAX;  // the next write starts a burst
    }
    done += next(s, posted > done).local;
    if (Clock::now() > deadline) die("operations did not complete in time", -FI_ETIMEDOUT);
  }
  b.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return b;
}

// One measurement, as the client tells the server over their pipe.
struct Run {
  uint64_t mode = 0;  // kBw, kLat, kRead, kReadLat or kQuit
  uint64_t size = 0;
  uint64_t count = 0;
  uint64_t window = 1;
  uint64_t warmup = 0;
  uint64_t span = 0;  // bw, read: bytes the slots cover, at least window * size
  bool reads() const { return mode == kRead || mode == kReadLat; }
  bool round_trips() const { return mode == kLat || mode == kReadLat; }
  uint64_t slots() const {
    if (round_trips() || size == 0) return 1;
    return std::max(window, std::min(span, kMaxSpan) / size);
  }
  uint64_t buffer_bytes() const { return slots() * size; }
  // Reads: the immediates the server counts, the client's marks (after the warm-up reads of a
  // kRead run, and after its timed reads).
  uint64_t marks() const { return mode == kRead && warmup > 0 ? 2 : 1; }
  static constexpr uint64_t kBw = 0, kLat = 1, kQuit = 2, kRead = 3, kReadLat = 4;
};

// Makes the side's buffer hold `bytes` (registering it afresh when it grows), then tells the
// peer where it is and learns where the peer's is.
void prepare(Side& s, const Run& r, int out, int in) {
  const uint64_t bytes = std::max<uint64_t>(r.buffer_bytes(), 64);
  if (s.buf.size() < bytes) {
    if (s.mr) fi_close(&s.mr->fid);
    s.mr = nullptr;
    s.buf.assign(bytes, 'x');
    CHECK(fi_mr_reg(s.domain, s.buf.data(), s.buf.size(),
                    FI_WRITE | FI_REMOTE_WRITE | FI_READ | FI_REMOTE_READ, 0, 7, 0, &s.mr,
                    nullptr));
  }
  s.ctx.resize(r.mode == Run::kLat ? kLatContexts : r.window);
  s.read = r.reads();
  const uint64_t mine[2] = {(s.info->domain_attr->mr_mode & FI_MR_VIRT_ADDR)
                                ? reinterpret_cast<uint64_t>(s.buf.data())
                                : 0,
                            fi_mr_key(s.mr)};
  write_all(out, mine, sizeof mine);
  uint64_t theirs[2] = {0, 0};
  read_all(in, theirs, sizeof theirs);
  s.peer_addr = theirs[0];
  s.peer_key = theirs[1];
}

// The target: for each run, counts immediates (bw, measuring its CPU time once the warm-up
// has arrived), answers every arrival with a write back (lat), or only progresses until the
// client's marks have come (read, readlat: measuring its CPU time from the first mark of a
// read run with a warm-up); then reports what it saw.
int serve(const Options& o, int out, int in) {
  Side s;
  open_side(s, o);
  exchange(s, out, in);
  for (;;) {
    Run r;
    if (!read_some(in, &r, sizeof r) || r.mode == Run::kQuit) return 0;
    prepare(s, r, out, in);
    const uint64_t total = r.warmup + r.count;
    const auto deadline = Clock::now() + kDeadline;
    uint64_t seen = 0;
    double cpu0 = r.warmup == 0 ? cpu_seconds() : 0;
    if (r.reads()) {
      while (seen < r.marks() && Clock::now() < deadline) {
        const uint64_t before = seen;
        seen += next(s, false).remote;
        if (r.marks() == 2 && before == 0 && seen >= 1) cpu0 = cpu_seconds();
      }
    } else if (r.mode == Run::kLat) {
      uint64_t owed = 0, posted = 0, completed = 0;
      while ((seen < total || owed > 0 || completed < posted) && Clock::now() < deadline) {
        Polled p = next(s, owed > 0 || completed < posted);
        seen += p.remote;
        owed += p.remote;
        completed += p.local;
        while (owed > 0 && posted - completed < kLatContexts &&
               post(s, r.size, 0, posted, nullptr)) {
          --owed;
          ++posted;
        }
      }
    } else {
      while (seen < total && Clock::now() < deadline) {
        const uint64_t before = seen;
        seen += next(s, false).remote;
        if (before < r.warmup && seen >= r.warmup) cpu0 = cpu_seconds();
      }
    }
    const double cpu = cpu_seconds() - cpu0;
    write_all(out, &seen, sizeof seen);
    write_all(out, &cpu, sizeof cpu);
  }
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const auto rank = static_cast<size_t>(std::ceil(p / 100 * static_cast<double>(v.size())));
  return v[std::max<size_t>(rank, 1) - 1];
}

// Ping-pong round trips; the times of the last `timed` of `total`.
std::vector<double> ping_pong(Side& s, uint64_t size, uint64_t total, uint64_t timed) {
  std::vector<double> rtt_us;
  uint64_t answers = 0, completed = 0;
  const auto deadline = Clock::now() + kDeadline;
  for (uint64_t k = 0; k < total; ++k) {
    const auto t0 = Clock::now();
    while (k - completed >= kLatContexts || !post(s, size, 0, k, nullptr)) {
      completed += next(s, true).local;
      if (Clock::now() > deadline) die("writes did not complete in time", -FI_ETIMEDOUT);
    }
    while (answers <= k) {
      Polled p = next(s, completed <= k);
      answers += p.remote;
      completed += p.local;
      if (Clock::now() > deadline) die("no answer in time", -FI_ETIMEDOUT);
    }
    if (k >= total - timed) {
      rtt_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
  }
  while (completed < total && Clock::now() < deadline) completed += next(s, true).local;
  return rtt_us;
}

// Reads one at a time, each waited for before the next; the times of the last `timed` of
// `total`.
std::vector<double> read_round_trips(Side& s, uint64_t size, uint64_t total, uint64_t timed) {
  std::vector<double> rtt_us;
  const auto deadline = Clock::now() + kDeadline;
  for (uint64_t k = 0; k < total; ++k) {
    const auto t0 = Clock::now();
    while (!post(s, size, 0, 0, nullptr)) {
      next(s, true);
      if (Clock::now() > deadline) die("reads did not complete in time", -FI_ETIMEDOUT);
    }
    while (next(s, true).local == 0) {
      if (Clock::now() > deadline) die("reads did not complete in time", -FI_ETIMEDOUT);
    }
    if (k >= total - timed) {
      rtt_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
  }
  return rtt_us;
}

// Tells the server that a phase of reads is over: a write of no bytes with an immediate, the
// only thing of a read run it counts. Returns once it has completed (nothing else is
// outstanding then, so context 0 is free).
void mark(Side& s) {
  const auto deadline = Clock::now() + kDeadline;
  for (;;) {
    const ssize_t rc = fi_writedata(s.ep, s.buf.data(), 0, s.desc(), 1, s.peer, s.peer_addr,
                                    s.peer_key, &s.ctx[0]);
    if (rc == 0) break;
    if (rc != -FI_EAGAIN) die("fi_writedata", static_cast<int>(rc));
    next(s, true);
    if (Clock::now() > deadline) die("the mark was not posted in time", -FI_ETIMEDOUT);
  }
  while (next(s, true).local == 0) {
    if (Clock::now() > deadline) die("the mark did not complete in time", -FI_ETIMEDOUT);
  }
}

// Runs one measurement with the server; prints its line. False when the server did not see
// every immediate (reads: every mark).
bool measure(Side& s, const Options& o, const Run& r, int out, int in) {
  write_all(out, &r, sizeof r);
  prepare(s, r, out, in);
  uint64_t seen = 0;
  double server_cpu = 0;
  const uint64_t expected = r.reads() ? r.marks() : r.warmup + r.count;
  if (r.mode == Run::kReadLat) {
    std::vector<double> rtt = read_round_trips(s, r.size, r.warmup + r.count, r.count);
    mark(s);
    read_all(in, &seen, sizeof seen);
    read_all(in, &server_cpu, sizeof server_cpu);
    if (seen == expected) {
      std::printf("rawreadlat %s %lu %lu %.3f %.3f\n", o.provider.c_str(),
                  static_cast<unsigned long>(r.size), static_cast<unsigned long>(r.count),
                  percentile(rtt, 50), percentile(rtt, 99));
    }
  } else if (r.mode == Run::kLat) {
    std::vector<double> rtt = ping_pong(s, r.size, r.warmup + r.count, r.count);
    read_all(in, &seen, sizeof seen);
    read_all(in, &server_cpu, sizeof server_cpu);
    if (seen == expected) {
      std::printf("rawlat %s %lu %lu %.3f %.3f\n", o.provider.c_str(),
                  static_cast<unsigned long>(r.size), static_cast<unsigned long>(r.count),
                  percentile(rtt, 50), percentile(rtt, 99));
    }
  } else {
    if (r.warmup > 0) blast(s, r.size, r.window, r.slots(), r.warmup);
    if (r.warmup > 0 && r.reads()) mark(s);
    const double cpu0 = cpu_seconds();
    const Blast b = blast(s, r.size, r.window, r.slots(), r.count);
    const double cpu = cpu_seconds() - cpu0;
    if (r.reads()) mark(s);
    read_all(in, &seen, sizeof seen);
    read_all(in, &server_cpu, sizeof server_cpu);
    if (seen == expected) {
      std::printf("%s %s %lu %lu %.6f %.3f %.3f %.4f\n", r.reads() ? "rawread" : "raw",
                  o.provider.c_str(), static_cast<unsigned long>(r.size),
                  static_cast<unsigned long>(r.count), b.seconds,
                  static_cast<double>(r.size * r.count) * 8 / b.seconds / 1e9,
                  b.post_seconds * 1e6 / static_cast<double>(r.count), cpu + server_cpu);
    }
  }
  if (seen != expected) {
    std::printf("error the server counted %lu of %lu immediates\n",
                static_cast<unsigned long>(seen), static_cast<unsigned long>(expected));
  }
  std::fflush(stdout);
  return seen == expected;
}

// --commands: one measurement per line of stdin, until EOF or `quit`:
//   bw SIZE COUNT WINDOW WARMUP [SPAN] | lat SIZE COUNT WARMUP
//   rd SIZE COUNT WINDOW WARMUP [SPAN] | rdlat SIZE COUNT WARMUP   (SIZE at least 1)
// Each prints its line (or `error ...`); bad lines print `error usage ...`.
bool parse_run(const std::string& line, Run& r) {
  char word[8] = {};
  unsigned long long v[5] = {};
  const int n = std::sscanf(line.c_str(), "%7s %llu %llu %llu %llu %llu", word, &v[0], &v[1], &v[2],
                            &v[3], &v[4]);
  const std::string mode = word;
  if (mode == "bw" && (n == 5 || n == 6) && v[1] > 0 && v[2] > 0 && v[2] <= 4096 &&
      v[0] <= (1ull << 30)) {
    r = Run{Run::kBw, v[0], v[1], v[2], v[3], v[4]};
    return true;
  }
  if (mode == "lat" && n == 4 && v[1] > 0 && v[0] <= (1ull << 30)) {
    r = Run{Run::kLat, v[0], v[1], 1, v[2], 0};
    return true;
  }
  if (mode == "rd" && (n == 5 || n == 6) && v[0] > 0 && v[1] > 0 && v[2] > 0 && v[2] <= 4096 &&
      v[0] <= (1ull << 30)) {
    r = Run{Run::kRead, v[0], v[1], v[2], v[3], v[4]};
    return true;
  }
  if (mode == "rdlat" && n == 4 && v[0] > 0 && v[1] > 0 && v[0] <= (1ull << 30)) {
    r = Run{Run::kReadLat, v[0], v[1], 1, v[2], 0};
    return true;
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"fabric-bench-raw: the raw libfabric ceiling for fabric-bench"};
  app.add_option("--provider", o.provider, "libfabric provider")->capture_default_str();
  app.add_option("--nic", o.nic, "domain name")->capture_default_str();
  app.add_option("--mode", o.mode,
                 "bw: windowed writes; lat: ping-pong round trips; read: windowed fi_read; "
                 "readlat: one fi_read at a time (its round trip)")
      ->check(CLI::IsMember({"bw", "lat", "read", "readlat"}))
      ->capture_default_str();
  app.add_option("--size", o.size, "bytes per write or read (0: immediate only; reads: >= 1)")
      ->check(CLI::Range(uint64_t{0}, uint64_t{1} << 30))
      ->capture_default_str();
  app.add_option("--count", o.count,
                 "writes or reads (bw, read) or round trips (lat, readlat) timed")
      ->check(CLI::Range(uint64_t{1}, uint64_t{10'000'000}))
      ->capture_default_str();
  app.add_option("--span", o.span, "bw: bytes the write slots cover (at most 256 MiB)")
      ->capture_default_str();
  app.add_option("--window", o.window, "writes or reads in flight (bw, read)")
      ->check(CLI::Range(uint64_t{1}, uint64_t{4096}))
      ->capture_default_str();
  app.add_option("--warmup", o.warmup, "untimed writes or round trips first")
      ->check(CLI::Range(uint64_t{0}, uint64_t{100'000}))
      ->capture_default_str();
  app.add_option("--wait", o.wait, "fd: sleep on the CQ when idle, as the engine; spin: never")
      ->check(CLI::IsMember({"fd", "spin"}))
      ->capture_default_str();
  app.add_option("--spin-us", o.spin_us, "--wait fd: busy-poll this long before sleeping")
      ->capture_default_str();
  app.add_option("--batch", o.batch,
                 "bw, read: operations per burst through fi_writemsg or fi_readmsg, all but the "
                 "last with FI_MORE (1: fi_writedata or fi_read, no FI_MORE)")
      ->check(CLI::Range(uint64_t{1}, uint64_t{4096}))
      ->capture_default_str();
  app.add_flag("--commands", o.commands,
               "measure once per line of stdin: bw SIZE COUNT WINDOW WARMUP [SPAN] | lat SIZE "
               "COUNT WARMUP | rd SIZE COUNT WINDOW WARMUP [SPAN] | rdlat SIZE COUNT WARMUP; quit "
               "or EOF ends");
  CLI11_PARSE(app, argc, argv);
  const bool reads = o.mode == "read" || o.mode == "readlat";
  if (reads && o.size == 0 && !o.commands) {
    std::fprintf(stderr, "fabric-bench-raw: --mode %s needs --size of at least 1\n",
                 o.mode.c_str());
    return 2;
  }

  int down[2], up[2];
  if (pipe(down) != 0 || pipe(up) != 0) return 1;
  pid_t child = fork();  // before any thread or libfabric call exists
  if (child == 0) {
    close(down[1]);
    close(up[0]);
    return serve(o, up[1], down[0]);
  }
  close(down[0]);
  close(up[1]);
  bool ok = true;
  {
    Side s;
    open_side(s, o);
    exchange(s, down[1], up[0]);
    if (o.commands) {
      std::string line;
      while (std::getline(std::cin, line) && line != "quit") {
        Run r;
        if (!parse_run(line, r)) {
          std::printf(
              "error usage: bw SIZE COUNT WINDOW WARMUP [SPAN] | lat SIZE COUNT WARMUP | rd SIZE "
              "COUNT WINDOW WARMUP [SPAN] | rdlat SIZE COUNT WARMUP\n");
          std::fflush(stdout);
          continue;
        }
        ok = measure(s, o, r, down[1], up[0]) && ok;
      }
    } else {
      const uint64_t mode = o.mode == "lat"       ? Run::kLat
                            : o.mode == "read"    ? Run::kRead
                            : o.mode == "readlat" ? Run::kReadLat
                                                  : Run::kBw;
      const bool one_at_a_time = mode == Run::kLat || mode == Run::kReadLat;
      const Run r{mode, o.size, o.count, one_at_a_time ? 1 : o.window, o.warmup, o.span};
      ok = measure(s, o, r, down[1], up[0]);
    }
    const Run quit{Run::kQuit, 0, 0, 1, 0, 0};
    write_all(down[1], &quit, sizeof quit);
  }
  int status = 0;
  waitpid(child, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ok = false;
  return ok ? 0 : 1;
}
