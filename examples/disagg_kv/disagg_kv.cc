// fabric-kv-demo: disaggregated prefill/decode on one machine with fabric::kv.
//
// The router (this process) starts a private etcd (or, with --registry file, makes a private
// FileRegistry directory in /dev/shm), then P prefiller and D decoder processes
// (this binary again, with --role). Each worker opens its own TransferEngine, joins etcd with
// its address, and obeys the router over a pipe. For each request the router picks a live
// decoder and prefiller from its etcd watch: the decoder reserves pages and pulls; the
// prefiller "computes" each layer (a sleep of --compute-ms) and hands it to KvPrefiller, which
// writes it into the decoder's pages while the next layer computes. The decoder checks every
// byte when its request is ready. In the middle of the run one decoder joins and one
// prefiller drains and leaves. A table at the end compares transfer and compute.
//
// Each worker process stands for rank 0 of a TP group (--tp) of a Qwen3-235B-like model
// (94 layers, 4 KV heads of 128 x bf16, 128-token pages: 32 KiB of K and 32 KiB of V per
// page per rank at TP4); the other ranks of a group would move their own heads in parallel.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <iostream>
#include <map>
#include <mutex>
#include <numeric>
#include <set>
#include <sstream>
#include <thread>

#include "etcd_server.h"
#include "fabric/fabric.h"
#include "fabric/kv/flow.h"
#include "fabric/kv/registry.h"

extern char** environ;

using namespace fabric;
using namespace fabric::kv;
using Clock = std::chrono::steady_clock;

namespace {

struct Args {
  std::string role = "router";
  std::string name;
  std::string etcd;
  std::string registry = "etcd";  // or "file"
  std::string registry_dir;       // the FileRegistry directory (workers)
  std::string provider = "tcp";
  int prefillers = 3;
  int decoders = 2;
  int requests = 24;
  uint32_t layers = 94;
  uint32_t tokens = 1024;  // prompt length
  uint32_t page_tokens = 128;
  uint32_t kv_heads = 4;
  uint32_t head_bytes = 256;  // head_dim 128 x bf16
  uint32_t tp = 4;
  double compute_ms = 10.0;    // simulated prefill compute per layer
  uint32_t prefill_slots = 2;  // requests a prefiller holds pages for
  uint32_t decode_slots = 3;   // requests a decoder holds pages for
};

// The membership registry the workers and the router share.
Result<std::unique_ptr<Registry>> open_registry(const Args& a, const std::string& etcd) {
  if (a.registry == "file") {
    FileOptions fo;
    fo.directory = a.registry_dir;
    auto r = FileRegistry::open(fo);
    if (!r) return r.status();
    return std::unique_ptr<Registry>(std::move(*r));
  }
  EtcdOptions eo;
  eo.endpoint = etcd;
  auto r = EtcdRegistry::connect(eo);
  if (!r) return r.status();
  return std::unique_ptr<Registry>(std::move(*r));
}

uint32_t pages_per_request(const Args& a) {
  return (a.tokens + a.page_tokens - 1) / a.page_tokens;
}

KvLayout layout(const Args& a, uint32_t slots) {
  KvLayout l;
  l.num_layers = a.layers;
  l.num_pages = slots * pages_per_request(a);
  l.tokens_per_page = a.page_tokens;
  l.num_kv_heads = a.kv_heads;
  l.head_bytes = a.head_bytes;
  l.tp_size = a.tp;
  l.tp_rank = 0;
  return l;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

// Word w of logical page k of layer l of request id: what prefill writes and decode checks.
inline uint64_t word(uint64_t id, uint32_t l, uint32_t k, uint64_t w) {
  uint64_t x = (id * 0x9E3779B97F4A7C15ull) ^ (uint64_t{l} << 40) ^ (uint64_t{k} << 24) ^ w;
  x ^= x >> 31;
  x *= 0xD6E8FEB86659FD93ull;
  return x ^ (x >> 29);
}

void fill_pages(const KvLayout& L, std::byte* base, const std::vector<uint32_t>& pages,
                uint64_t id) {
  const uint64_t words = L.page_bytes() / 8;
  for (uint32_t l = 0; l < L.num_layers; ++l)
    for (uint32_t k = 0; k < pages.size(); ++k) {
      auto* p = reinterpret_cast<uint64_t*>(base + L.page_offset(l, pages[k]));
      for (uint64_t w = 0; w < words; ++w) p[w] = word(id, l, k, w);
    }
}

bool check_pages(const KvLayout& L, const std::byte* base, std::span<const uint32_t> pages,
                 uint64_t id) {
  const uint64_t words = L.page_bytes() / 8;
  for (uint32_t l = 0; l < L.num_layers; ++l)
    for (uint32_t k = 0; k < pages.size(); ++k) {
      auto* p = reinterpret_cast<const uint64_t*>(base + L.page_offset(l, pages[k]));
      for (uint64_t w = 0; w < words; ++w)
        if (p[w] != word(id, l, k, w)) return false;
    }
  return true;
}

std::mutex out_mu;
void say(const std::string& line) {
  std::lock_guard lock(out_mu);
  std::cout << line << std::endl;
}

Config engine_config(const Args& a) {
  Config c;
  c.provider = a.provider;
  c.groups = {GroupConfig{}};
  c.groups[0].nics = {a.provider == "shm" ? "shm" : "lo"};
  c.groups[0].cpu = GroupConfig::kCpuNone;
  c.spin_time = std::chrono::microseconds(50);
  c.idle_sleep = std::chrono::microseconds(50);
  c.peer_timeout = std::chrono::milliseconds(3000);
  return c;
}

// --- a worker: one prefill or decode rank ----------------------------------------------------

int worker(const Args& a) {
  const bool prefill = a.role == "prefill";
  const KvLayout L = layout(a, prefill ? a.prefill_slots : a.decode_slots);
  auto engine = TransferEngine::create(engine_config(a));
  if (!engine) {
    say("fatal " + engine.status().to_string());
    return 1;
  }
  std::vector<std::byte> cache(L.region_bytes());
  auto reg = (*engine)->register_memory(cache.data(), cache.size());
  if (!reg) {
    say("fatal " + reg.status().to_string());
    return 1;
  }
  Options options;
  std::unique_ptr<KvPrefiller> prefiller;
  std::unique_ptr<KvDecoder> decoder;
  if (prefill) {
    auto p = KvPrefiller::create(**engine, L, *reg, options);
    if (!p) return say("fatal " + p.status().to_string()), 1;
    prefiller = std::move(*p);
  } else {
    auto d = KvDecoder::create(**engine, L, *reg, options);
    if (!d) return say("fatal " + d.status().to_string()), 1;
    decoder = std::move(*d);
  }
  auto registry = open_registry(a, a.etcd);
  if (!registry) return say("fatal " + registry.status().to_string()), 1;
  if (decoder) {
    // A prefiller that leaves etcd (or whose lease runs out) fails only its own requests.
    (*registry)
        ->watch([&decoder](bool joined, const Member& m) {
          if (joined || m.role != "prefill") return;
          if (auto addr = Address::from_hex(m.address)) decoder->fail_peer(*addr);
        })
        .ignore();
  }
  Member me;
  me.name = a.name;
  me.role = a.role;
  me.instance = a.name;
  me.tp_size = a.tp;
  me.address = (*engine)->address().to_hex();
  if (Status st = (*registry)->join(me); !st) return say("fatal " + st.to_string()), 1;

  // Prefill: a FIFO of requests computed one at a time (one GPU), page slots from a free list.
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::pair<RequestId, std::vector<uint32_t>>> queue;
  std::vector<uint32_t> free_slots;
  for (uint32_t s = 0; s < a.prefill_slots; ++s) free_slots.push_back(s);
  std::map<RequestId, uint32_t> slot_of;
  struct Timing {
    int64_t start = 0, last_layer = 0;
    std::vector<int64_t> layer_done, layer_written;
    // Time during which some layer was in flight: the union of [done, written] per layer.
    int64_t busy() const {
      int64_t sum = 0, covered = 0;
      for (size_t l = 0; l < layer_done.size(); ++l) {
        const int64_t from = std::max(layer_done[l], covered), to = layer_written[l];
        if (to > from) sum += to - from;
        covered = std::max(covered, to);
      }
      return sum;
    }
    int64_t latency_sum() const {
      int64_t sum = 0;
      for (size_t l = 0; l < layer_done.size(); ++l) sum += layer_written[l] - layer_done[l];
      return sum;
    }
  };
  std::map<RequestId, Timing> timing;
  bool stop = false;
  int live = 0;
  std::thread compute;
  if (prefill) {
    compute = std::thread([&] {
      std::unique_lock lock(mu);
      for (;;) {
        cv.wait(lock, [&] { return stop || !queue.empty(); });
        if (queue.empty()) return;
        auto [id, pages] = queue.front();
        queue.pop_front();
        timing[id].start = now_ns();
        timing[id].layer_done.assign(a.layers, 0);
        timing[id].layer_written.assign(a.layers, 0);
        lock.unlock();
        const auto step = std::chrono::duration<double, std::milli>(a.compute_ms);
        auto next = Clock::now();
        for (uint32_t l = 0; l < a.layers; ++l) {
          next += std::chrono::duration_cast<Clock::duration>(step);
          std::this_thread::sleep_until(next);
          {
            std::lock_guard g(mu);
            timing[id].layer_done[l] = now_ns();
            timing[id].last_layer = timing[id].layer_done[l];
          }
          prefiller->layer_done(id, l).ignore();
        }
        lock.lock();
      }
    });
  }
  say("up");
  const uint32_t n = pages_per_request(a);
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "run" && prefiller) {  // run ID DECODE_TP
      RequestId id = 0;
      uint32_t dtp = 0;
      in >> id >> dtp;
      std::vector<uint32_t> pages;
      {
        std::lock_guard lock(mu);
        if (free_slots.empty()) {
          say(fmt::format("busy {}", id));
          continue;
        }
        uint32_t slot = free_slots.back();
        free_slots.pop_back();
        slot_of[id] = slot;
        for (uint32_t k = 0; k < n; ++k) pages.push_back(slot * n + k);
        ++live;
      }
      fill_pages(L, cache.data(), pages, id);  // the prompt's KV, before compute starts
      Status st = prefiller->start(
          id, pages, dtp,
          [&](RequestId id, const Status& s) {
            Timing t;
            {
              std::lock_guard lock(mu);
              free_slots.push_back(slot_of[id]);
              slot_of.erase(id);
              t = timing[id];
              timing.erase(id);
              --live;
            }
            cv.notify_all();
            say(fmt::format("done {} {} {} {} {} {}", id, to_string(s.code()), t.start,
                            t.last_layer, t.latency_sum(), t.busy()));
          },
          [&](RequestId id, uint32_t, uint32_t layer) {
            std::lock_guard lock(mu);
            auto& t = timing[id];
            if (layer < t.layer_written.size()) t.layer_written[layer] = now_ns();
          });
      if (!st) {
        say(fmt::format("error {} {}", id, st.to_string()));
        continue;
      }
      {
        std::lock_guard lock(mu);
        queue.emplace_back(id, pages);
      }
      cv.notify_all();
    } else if (cmd == "pull" && decoder) {  // pull ID ADDR_HEX
      DecodeRequest rq;
      std::string hex;
      in >> rq.id >> hex;
      rq.num_pages = n;
      auto addr = Address::from_hex(hex);
      if (!addr) {
        say(fmt::format("error {} bad address", rq.id));
        continue;
      }
      // The prefill instance's TP ranks: rank 0 is the process the router named; the others
      // (not simulated here) hold the other heads and would be asked by the other decode
      // ranks, so only rank 0's address is ever used by this decode rank 0.
      rq.prefill_ranks.assign(a.tp, *addr);
      rq.on_ready = [&](RequestId id, std::span<const uint32_t> pages) {
        const int64_t t = now_ns();
        bool ok = check_pages(L, cache.data(), pages, id);
        decoder->release(id).ignore();
        say(fmt::format("ready {} {} {}", id, t, ok ? "ok" : "corrupt"));
      };
      rq.on_error = [](RequestId id, const Status& s) {
        say(fmt::format("failed {} {}", id, s.to_string()));
      };
      auto r = decoder->submit(std::move(rq));
      if (!r) say(fmt::format("busy {} {}", rq.id, r.status().to_string()));
    } else if (cmd == "leave") {
      // Drain: finish what was accepted, then leave the membership.
      std::unique_lock lock(mu);
      cv.wait(lock, [&] { return live == 0; });
      lock.unlock();
      (*registry)->leave(a.name).ignore();
      say("left");
    } else if (cmd == "quit") {
      break;
    }
  }
  {
    std::lock_guard lock(mu);
    stop = true;
  }
  cv.notify_all();
  if (compute.joinable()) compute.join();
  registry->reset();  // its watch calls into the decoder: stop it first
  prefiller.reset();
  decoder.reset();
  return 0;
}

// --- the router -------------------------------------------------------------------------------

class Child {
 public:
  Child(const std::string& name, std::vector<std::string> args) : name_(name) {
    int to[2], from[2];
    if (pipe2(to, O_CLOEXEC) != 0 || pipe2(from, O_CLOEXEC) != 0) return;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, to[0], 0);
    posix_spawn_file_actions_adddup2(&fa, from[1], 1);
    std::vector<char*> argv;
    for (auto& s : args) argv.push_back(s.data());
    argv.push_back(nullptr);
    if (posix_spawn(&pid_, "/proc/self/exe", &fa, nullptr, argv.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&fa);
    close(to[0]);
    close(from[1]);
    in_ = to[1];
    out_ = from[0];
  }
  ~Child() {
    if (pid_ > 0) {
      send("quit");
      int st = 0;
      for (int i = 0; i < 100 && waitpid(pid_, &st, WNOHANG) == 0; ++i) usleep(50000);
      if (waitpid(pid_, &st, WNOHANG) == 0) {
        kill(pid_, SIGKILL);
        waitpid(pid_, &st, 0);
      }
    }
    if (reader_.joinable()) reader_.join();
    close(in_);
    close(out_);
  }
  void send(const std::string& line) {
    std::string l = line + "\n";
    [[maybe_unused]] ssize_t n = write(in_, l.data(), l.size());
  }
  template <typename Fn>
  void read_lines(Fn on_line) {
    reader_ = std::thread([this, on_line] {
      std::string pending;
      char buf[4096];
      for (;;) {
        ssize_t n = read(out_, buf, sizeof(buf));
        if (n <= 0) return;
        pending.append(buf, static_cast<size_t>(n));
        for (size_t nl; (nl = pending.find('\n')) != std::string::npos;) {
          on_line(name_, pending.substr(0, nl));
          pending.erase(0, nl + 1);
        }
      }
    });
  }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  pid_t pid_ = -1;
  int in_ = -1, out_ = -1;
  std::thread reader_;
};

struct RequestStats {
  std::string prefiller, decoder;
  int64_t start = 0, last_layer = 0, xfer_sum = 0, busy = 0, ready = 0;
  bool prefilled = false, decoded = false, ok = false;
};

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5))];
}

int router(Args a) {
  if (a.registry != "etcd" && a.registry != "file") {
    std::cerr << "--registry: etcd or file, not '" << a.registry << "'\n";
    return 2;
  }
  const bool use_etcd = a.registry == "etcd";
  if (use_etcd && !fabric::kv::testing::etcd_binary()) {
    std::cerr << "etcd-server is not installed (make deps installs it)\n";
    return 1;
  }
  fabric::kv::testing::EtcdServer etcd;
  if (use_etcd && !etcd.start()) {
    std::cerr << "etcd did not start\n";
    return 1;
  }
  struct RemoveDir {
    std::string path;
    ~RemoveDir() {
      if (!path.empty()) std::filesystem::remove_all(path);
    }
  } private_dir;
  if (!use_etcd) {
    std::string tmpl = (std::filesystem::is_directory("/dev/shm") ? "/dev/shm" : "/tmp") +
                       std::string("/fabric-kv-demo-XXXXXX");
    if (mkdtemp(tmpl.data()) == nullptr) {
      std::cerr << "cannot make a registry directory: " << std::strerror(errno) << "\n";
      return 1;
    }
    private_dir.path = a.registry_dir = tmpl;
  }
  const std::string etcd_endpoint = use_etcd ? etcd.endpoint() : "";
  // Events from the children, in arrival order.
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::pair<std::string, std::string>> events;
  auto on_line = [&](const std::string& who, const std::string& line) {
    std::lock_guard lock(mu);
    events.emplace_back(who, line);
    cv.notify_all();
  };
  // Membership as the registry tells it.
  std::map<std::string, Member> members;
  auto registry = open_registry(a, etcd_endpoint);
  if (!registry) return std::cerr << registry.status().to_string() << "\n", 1;
  std::vector<std::string> log;
  const auto t_begin = Clock::now();
  auto stamp = [&] {
    return fmt::format("{:6.2f} s", std::chrono::duration<double>(Clock::now() - t_begin).count());
  };
  (void)(*registry)->watch([&](bool joined, const Member& m) {
    std::lock_guard lock(mu);
    if (joined) {
      if (!members.count(m.name))
        log.push_back(fmt::format("{}  {} {} joined", stamp(), m.role, m.name));
      members[m.name] = m;
    } else {
      members.erase(m.name);
      log.push_back(fmt::format("{}  {} {} left", stamp(), m.role, m.name));
    }
    cv.notify_all();
  });

  std::map<std::string, std::unique_ptr<Child>> children;
  auto spawn = [&](const std::string& role, const std::string& name) {
    std::vector<std::string> args = {"fabric-kv-demo",
                                     "--role",
                                     role,
                                     "--name",
                                     name,
                                     "--registry",
                                     a.registry,
                                     "--registry-dir",
                                     a.registry_dir,
                                     "--etcd",
                                     etcd_endpoint,
                                     "--provider",
                                     a.provider,
                                     "--layers",
                                     std::to_string(a.layers),
                                     "--tokens",
                                     std::to_string(a.tokens),
                                     "--page-tokens",
                                     std::to_string(a.page_tokens),
                                     "--kv-heads",
                                     std::to_string(a.kv_heads),
                                     "--head-bytes",
                                     std::to_string(a.head_bytes),
                                     "--tp",
                                     std::to_string(a.tp),
                                     "--compute-ms",
                                     std::to_string(a.compute_ms)};
    auto c = std::make_unique<Child>(name, args);
    c->read_lines(on_line);
    children[name] = std::move(c);
  };
  for (int i = 0; i < a.prefillers; ++i) spawn("prefill", fmt::format("p{}", i));
  for (int i = 0; i < a.decoders; ++i) spawn("decode", fmt::format("d{}", i));

  std::map<RequestId, RequestStats> stats;
  std::map<std::string, int> load;  // requests in flight per worker
  std::set<std::string> draining, left_workers;
  std::deque<RequestId> pending;
  for (int i = 1; i <= a.requests; ++i) pending.push_back(static_cast<RequestId>(i));
  int assigned = 0, finished = 0, lost = 0;
  bool decoder_joined = false, prefiller_left = false, leave_sent = false;
  int64_t first_start = 0, last_ready = 0;
  const auto deadline = Clock::now() + std::chrono::seconds(90);
  std::unique_lock lock(mu);
  auto finish = [&](RequestId id) {
    auto& s = stats[id];
    if (s.prefilled && s.decoded) {
      ++finished;
      --load[s.prefiller];
      --load[s.decoder];
    }
  };
  while (finished + lost < a.requests && Clock::now() < deadline) {
    // Membership changes mid-run: a decoder joins at a third, a prefiller leaves at half.
    if (!decoder_joined && assigned >= a.requests / 3) {
      decoder_joined = true;
      lock.unlock();
      spawn("decode", fmt::format("d{}", a.decoders));
      lock.lock();
    }
    if (!prefiller_left && assigned >= a.requests / 2 && a.prefillers > 1) {
      prefiller_left = true;
      draining.insert("p0");  // no new requests
    }
    // It leaves once every request it took is ready at its decoder too: a decoder fails the
    // requests of a prefiller that left (a crash looks the same), even one whose last writes
    // landed but were not counted yet.
    if (prefiller_left && !leave_sent && load["p0"] == 0) {
      leave_sent = true;
      children["p0"]->send("leave");
    }
    // Assign what the live members can take; the last third waits (30 s at most) for the
    // joining decoder, so that it visibly takes traffic.
    const std::string joiner = fmt::format("d{}", a.decoders);
    const bool hold = assigned >= 2 * a.requests / 3 && !members.count(joiner) &&
                      Clock::now() - t_begin < std::chrono::seconds(30);
    while (!pending.empty() && !hold) {
      std::string p, d;
      for (auto& [name, m] : members) {
        if (draining.count(name) || !children.count(name)) continue;
        if (m.role == "prefill" && load[name] < static_cast<int>(a.prefill_slots) &&
            (p.empty() || load[name] < load[p]))
          p = name;
        if (m.role == "decode" && load[name] < static_cast<int>(a.decode_slots) &&
            (d.empty() || load[name] < load[d]))
          d = name;
      }
      if (p.empty() || d.empty()) break;
      RequestId id = pending.front();
      pending.pop_front();
      ++load[p];
      ++load[d];
      ++assigned;
      stats[id].prefiller = p;
      stats[id].decoder = d;
      children[d]->send(fmt::format("pull {} {}", id, members[p].address));
      children[p]->send(fmt::format("run {} {}", id, a.tp));
    }
    cv.wait_for(lock, std::chrono::milliseconds(50), [&] { return !events.empty(); });
    while (!events.empty()) {
      auto [who, line] = events.front();
      events.pop_front();
      std::istringstream in(line);
      std::string what;
      RequestId id = 0;
      in >> what >> id;
      if (what == "done") {
        std::string code;
        auto& s = stats[id];
        in >> code >> s.start >> s.last_layer >> s.xfer_sum >> s.busy;
        s.prefilled = true;
        if (code != "Ok") s.ok = false;
        if (first_start == 0 || s.start < first_start) first_start = s.start;
        finish(id);
      } else if (what == "ready") {
        std::string verdict;
        auto& s = stats[id];
        in >> s.ready >> verdict;
        s.decoded = true;
        s.ok = verdict == "ok";
        last_ready = std::max(last_ready, s.ready);
        finish(id);
      } else if (what == "failed" || what == "error" || what == "busy") {
        log.push_back(fmt::format("{}  {}: {}", stamp(), who, line));
        ++lost;
      } else if (what == "left") {
        left_workers.insert(who);
      } else if (what == "fatal") {
        std::cerr << who << ": " << line << "\n";
        return 1;
      }
    }
  }
  lock.unlock();
  children.clear();

  // --- the table ---
  const KvLayout L = layout(a, 1);
  const uint32_t n = pages_per_request(a);
  std::vector<double> ttft, exposed, xfer_layer, compute_total;
  int ok = 0, corrupt = 0;
  double hidden_num = 0, hidden_den = 0;
  for (auto& [id, s] : stats) {
    if (!(s.prefilled && s.decoded)) continue;
    s.ok ? ++ok : ++corrupt;
    ttft.push_back((s.ready - s.start) / 1e6);
    compute_total.push_back((s.last_layer - s.start) / 1e6);
    const double exp_ms = std::max<int64_t>(0, s.ready - s.last_layer) / 1e6;
    exposed.push_back(exp_ms);
    xfer_layer.push_back(s.xfer_sum / 1e6 / a.layers);
    // Of the time the request's transfer was busy, what overlapped compute (before the last
    // layer was done) rather than adding to TTFT after it.
    const double busy_ms = s.busy / 1e6;
    hidden_num += std::max(0.0, busy_ms - exp_ms);
    hidden_den += busy_ms;
  }
  const double wall_s = (last_ready - first_start) / 1e9;
  const double layer_bytes = double(n) * L.page_bytes();
  const double bytes = double(ok + corrupt) * a.layers * layer_bytes;
  const double pages = double(ok + corrupt) * a.layers * n;
  auto mean = [](const std::vector<double>& v) {
    return v.empty() ? 0 : std::accumulate(v.begin(), v.end(), 0.0) / v.size();
  };
  fmt::print("\nfabric-kv-demo: {} prefillers, {} decoders (+1 joining), {} requests over {}\n",
             a.prefillers, a.decoders, a.requests, a.provider);
  fmt::print(
      "model: {} layers, {} KV heads x {} B, TP{} rank shard, {}-token pages of {} KiB "
      "({} KiB K + {} KiB V), {}-token prompts ({} pages, {:.1f} MiB per request)\n\n",
      a.layers, a.kv_heads, a.head_bytes, a.tp, a.page_tokens, L.page_bytes() / 1024,
      L.part_bytes() / 1024, L.part_bytes() / 1024, a.tokens, n,
      a.layers * layer_bytes / (1 << 20));
  fmt::print("| metric | value |\n| --- | --- |\n");
  fmt::print("| per-layer compute (simulated) | {:.2f} ms |\n", a.compute_ms);
  const double xfer_p50 = percentile(xfer_layer, 0.5);
  fmt::print(
      "| per-layer transfer (layer done -> its writes complete; request means), p50 / "
      "mean / p99 | {:.2f} / {:.2f} / {:.2f} ms |\n",
      xfer_p50, mean(xfer_layer), percentile(xfer_layer, 0.99));
  fmt::print("| per-layer transfer rate at p50 | {:.2f} Gbps ({:.0f} KiB a layer) |\n",
             xfer_p50 > 0 ? layer_bytes * 8 / (xfer_p50 * 1e6) : 0, layer_bytes / 1024);
  fmt::print("| transfer hidden under compute | {:.1f} % |\n",
             hidden_den > 0 ? 100 * hidden_num / hidden_den : 0);
  fmt::print("| exposed transfer after the last layer, mean / p99 | {:.2f} / {:.2f} ms |\n",
             mean(exposed), percentile(exposed, 0.99));
  fmt::print("| TTFT colocated (compute alone), mean | {:.1f} ms |\n", mean(compute_total));
  fmt::print(
      "| TTFT disaggregated (compute start -> pages ready), mean / p50 / p99 | {:.1f} / "
      "{:.1f} / {:.1f} ms |\n",
      mean(ttft), percentile(ttft, 0.5), percentile(ttft, 0.99));
  fmt::print("| pages/s (page writes, all layers) | {:.0f} |\n", wall_s > 0 ? pages / wall_s : 0);
  fmt::print("| aggregate throughput | {:.2f} Gbps over {:.2f} s |\n",
             wall_s > 0 ? bytes * 8 / wall_s / 1e9 : 0, wall_s);
  fmt::print("| requests ok / corrupt / lost | {} / {} / {} |\n", ok, corrupt,
             a.requests - ok - corrupt);
  fmt::print("\nmembership (from the {} registry's watch):\n", a.registry);
  for (auto& l : log) fmt::print("  {}\n", l);
  std::map<std::string, int> per_worker;
  for (auto& [id, s] : stats) {
    ++per_worker[s.prefiller];
    ++per_worker[s.decoder];
  }
  fmt::print("requests per worker:");
  for (auto& [w, c] : per_worker) fmt::print(" {}={}", w, c);
  fmt::print("\n");
  return ok == a.requests ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  Args a;
  CLI::App app{"fabric-kv-demo: disaggregated prefill/decode with fabric::kv on one machine"};
  app.add_option("--role", a.role, "router (default), prefill or decode (internal)");
  app.add_option("--name", a.name, "member name (workers)");
  app.add_option("--etcd", a.etcd, "etcd endpoint (workers)");
  app.add_option("--registry", a.registry,
                 "membership: etcd (a private etcd-server) or file (a FileRegistry directory in "
                 "/dev/shm, no server)");
  app.add_option("--registry-dir", a.registry_dir, "FileRegistry directory (workers)");
  app.add_option("--provider", a.provider, "tcp or shm");
  app.add_option("--prefillers", a.prefillers, "prefill processes at the start");
  app.add_option("--decoders", a.decoders, "decode processes at the start (one more joins)");
  app.add_option("--requests", a.requests, "requests in the run");
  app.add_option("--layers", a.layers, "model layers");
  app.add_option("--tokens", a.tokens, "prompt tokens");
  app.add_option("--page-tokens", a.page_tokens, "tokens per page");
  app.add_option("--kv-heads", a.kv_heads, "KV heads of the model");
  app.add_option("--head-bytes", a.head_bytes, "bytes per head per token");
  app.add_option("--tp", a.tp, "tensor-parallel size of each instance (one rank is simulated)");
  app.add_option("--compute-ms", a.compute_ms, "simulated prefill compute per layer");
  CLI11_PARSE(app, argc, argv);
  if (a.role == "router") return router(a);
  return worker(a);
}
