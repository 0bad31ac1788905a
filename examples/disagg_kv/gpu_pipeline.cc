// fabric-kv-gpu: the disaggregated KV flow with GPU-resident pages. One process, two engines
// (a prefill rank and a decode rank) over tcp or shm, both caches in cudaMalloc memory (moved
// through the engine's staged path where the NIC cannot reach the GPU). A CUDA stream plays
// prefill: for each layer a kernel writes the layer's KV pages, a spin kernel stands for the
// rest of the layer's compute, and a UvmWatcher bump tells the host the layer is done;
// KvPrefiller::watch_layers turns each bump into that layer's paged writes. The decoder checks
// every byte (copied back from the GPU) when a request is ready; a table compares per-layer
// transfer and compute.
//
// --decode-gpu N runs the decode rank in a second process on GPU N (0 or another GPU of the
// machine): GPU pages then move between two processes of one host, over the engine's CUDA IPC
// path (docs/cuda-ipc.md; NVLink between two GPUs). The decode process reports each request's
// ready time (the steady clock is one clock for every process of a machine) and whether its
// bytes were exact. Both processes take the engine's environment overrides (FABRIC_CUDA_IPC=off:
// the staged path between them, for comparison). With --no-host-mirror both caches are
// registered without a pinned host mirror (RegisterOptions::host_mirror): only the CUDA IPC
// path reaches them, and the table shows the pinned host memory the mirrors would have taken.
#include <cuda_runtime.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>
#include <csignal>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>

#include "cuda_check.h"
#include "fabric/fabric.h"
#include "fabric/kv/flow.h"
#include "gpu_kernels.h"

using namespace fabric;
using namespace fabric::kv;
using Clock = std::chrono::steady_clock;

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

// launch_fill's pattern: byte i of a fill with `seed`.
uint8_t fill_byte(uint64_t i, uint64_t seed) {
  return static_cast<uint8_t>((i * 2654435761u + seed) >> 7);
}

uint64_t seed_of(uint64_t id, uint32_t layer, uint32_t k) {
  return id * 1000003u + layer * 131u + k;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5))];
}

// Both ranks' engines: one group on loopback (tcp) or shm, with the environment's overrides.
Result<std::unique_ptr<TransferEngine>> create_engine(const std::string& provider) {
  Config c;
  c.provider = provider;
  c.groups = {GroupConfig{}};
  c.groups[0].nics = {provider == "shm" ? "shm" : "lo"};
  if (Status st = c.apply_env_overrides(); !st) return st;
  return TransferEngine::create(c);
}

// Reads one line from fd (no stdio buffering: the fd is a pipe shared across fork).
bool read_line(int fd, std::string& line) {
  line.clear();
  char c;
  while (read(fd, &c, 1) == 1) {
    if (c == '\n') return true;
    line += c;
  }
  return false;
}

void write_line(int fd, const std::string& line) {
  const std::string out = line + "\n";
  if (write(fd, out.data(), out.size()) != static_cast<ssize_t>(out.size())) std::exit(1);
}

// The decode rank in a process of its own (--decode-gpu): reads the prefill rank's address on
// `in`, pulls every request, checks each one's bytes, and writes "id ready_ns ok" per request on
// `out`, then "end".
int decode_process(const KvLayout& L, const std::string& provider, int gpu, uint32_t requests,
                   uint32_t n, uint32_t tp, bool host_mirror, int in, int out) {
  CUDA_OK(cudaSetDevice(gpu));
  auto de = create_engine(provider);
  if (!de) return fmt::print(stderr, "decode engine: {}\n", de.status().to_string()), 1;
  void* ddst = nullptr;
  CUDA_OK(cudaMalloc(&ddst, L.region_bytes()));
  CUDA_OK(cudaMemset(ddst, 0, L.region_bytes()));
  auto dreg =
      (*de)->register_memory(ddst, L.region_bytes(), RegisterOptions{.host_mirror = host_mirror});
  if (!dreg) return fmt::print(stderr, "register: {}\n", dreg.status().to_string()), 1;
  auto decoder = KvDecoder::create(**de, L, *dreg);
  if (!decoder) return 1;
  std::string line;
  if (!read_line(in, line)) return 1;
  auto prefill = Address::from_hex(line);
  if (!prefill) return fmt::print(stderr, "prefill address: {}\n", prefill.status().to_string()), 1;
  std::mutex mu;
  std::condition_variable cv;
  std::map<RequestId, std::pair<int64_t, std::vector<uint32_t>>> ready;
  uint32_t ended = 0;
  for (RequestId id = 1; id <= requests; ++id) {
    DecodeRequest rq;
    rq.id = id;
    for (uint32_t k = 0; k < n; ++k) rq.pages.push_back(static_cast<uint32_t>((id - 1) * n + k));
    rq.prefill_ranks.assign(tp, *prefill);
    rq.on_ready = [&](RequestId id, std::span<const uint32_t> got) {
      const int64_t t = now_ns();
      std::lock_guard lock(mu);
      ready[id] = {t, std::vector<uint32_t>(got.begin(), got.end())};
      ++ended;
      cv.notify_all();
    };
    rq.on_error = [&](RequestId id, const Status& s) {
      fmt::print(stderr, "request {} failed: {}\n", id, s.to_string());
      std::lock_guard lock(mu);
      ++ended;
      cv.notify_all();
    };
    auto r = (*decoder)->submit(std::move(rq));
    if (!r) return fmt::print(stderr, "submit: {}\n", r.status().to_string()), 1;
  }
  {
    std::unique_lock lock(mu);
    cv.wait_for(lock, std::chrono::seconds(120), [&] { return ended == requests; });
  }
  std::vector<std::byte> host(L.page_bytes());
  std::lock_guard lock(mu);
  for (auto& [id, r] : ready) {
    bool ok = true;
    for (uint32_t l = 0; l < L.num_layers && ok; ++l)
      for (uint32_t k = 0; k < r.second.size() && ok; ++k) {
        CUDA_OK(cudaMemcpy(host.data(), static_cast<char*>(ddst) + L.page_offset(l, r.second[k]),
                           L.page_bytes(), cudaMemcpyDeviceToHost));
        for (uint64_t i = 0; i < L.page_bytes(); ++i)
          if (static_cast<uint8_t>(host[i]) != fill_byte(i, seed_of(id, l, k))) {
            ok = false;
            break;
          }
      }
    write_line(out, fmt::format("{} {} {}", id, r.first, ok ? 1 : 0));
  }
  write_line(out, "end");
  decoder->reset();
  (*de)->close();
  CUDA_OK(cudaFree(ddst));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string provider = "shm";
  uint32_t layers = 94, tokens = 1024, requests = 8, tp = 4;
  double compute_ms = 10.0;
  CLI::App app{"fabric-kv-gpu: KV pages in GPU memory, layers triggered by a UvmWatcher"};
  app.add_option("--provider", provider, "tcp or shm");
  app.add_option("--layers", layers, "model layers");
  app.add_option("--tokens", tokens, "prompt tokens");
  app.add_option("--requests", requests, "requests (computed one after the other)");
  app.add_option("--tp", tp, "TP size of both instances (rank 0 is simulated)");
  app.add_option("--compute-ms", compute_ms, "GPU compute per layer (a spin kernel)");
  int decode_gpu = -1;
  app.add_option("--decode-gpu", decode_gpu,
                 "run the decode rank in a second process on this GPU (default: one process, "
                 "both ranks on GPU 0)");
  bool no_host_mirror = false;
  app.add_flag("--no-host-mirror", no_host_mirror,
               "register both caches without a pinned host mirror (needs --decode-gpu: only the "
               "CUDA IPC path reaches them)");
  CLI11_PARSE(app, argc, argv);
  if (no_host_mirror && decode_gpu < 0) {
    fmt::print(stderr,
               "--no-host-mirror needs --decode-gpu: memory without a host mirror is "
               "reached only by the CUDA IPC path, between two processes\n");
    return 2;
  }

  KvLayout L;
  L.num_layers = layers;
  L.tokens_per_page = 128;
  L.num_kv_heads = 4;
  L.head_bytes = 256;
  L.tp_size = tp;
  const uint32_t n = (tokens + 127) / 128;
  L.num_pages = n * requests;

  // The decode rank's side: a process forked before this one touches CUDA, or a thread. Leaving
  // early closes the pipe to it, so it stops waiting for the prefill rank's address.
  struct DecodeSide {
    int to = -1, from = -1;
    pid_t pid = -1;
    std::thread thread;
    ~DecodeSide() {
      if (to >= 0) close(to);
      if (thread.joinable()) thread.join();
      if (from >= 0) close(from);
    }
  } side;
  int& to_decode = side.to;
  int& from_decode = side.from;
  pid_t& decode_pid = side.pid;
  if (decode_gpu >= 0) {
    int down[2], up[2];
    if (pipe(down) != 0 || pipe(up) != 0) return 1;
    decode_pid = fork();
    if (decode_pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // not left behind if this process dies
      close(down[1]);
      close(up[0]);
      _exit(decode_process(L, provider, decode_gpu, requests, n, tp, !no_host_mirror, down[0],
                           up[1]));
    }
    close(down[0]);
    close(up[1]);
    to_decode = down[1];
    from_decode = up[0];
  }

  auto watchers = UvmWatchers::create();
  if (!watchers) {
    fmt::print("no CUDA here: {}\n", watchers.status().to_string());
    return 0;
  }
  // Without --decode-gpu the decode rank is a thread of this process, on GPU 0.
  if (decode_gpu < 0) {
    int down[2], up[2];
    if (pipe(down) != 0 || pipe(up) != 0) return 1;
    to_decode = down[1];
    from_decode = up[0];
    side.thread = std::thread([&, in = down[0], out = up[1]] {
      if (decode_process(L, provider, 0, requests, n, tp, true, in, out) != 0)
        write_line(out, "end");
      close(in);
      close(out);
    });
  }
  auto pe = create_engine(provider);
  if (!pe) {
    fmt::print("engine: {}\n", pe.status().to_string());
    return 1;
  }
  void* psrc = nullptr;
  CUDA_OK(cudaMalloc(&psrc, L.region_bytes()));
  auto preg = (*pe)->register_memory(psrc, L.region_bytes(),
                                     RegisterOptions{.host_mirror = !no_host_mirror});
  if (!preg) {
    fmt::print("register: {}\n", preg.status().to_string());
    return 1;
  }
  auto prefiller = KvPrefiller::create(**pe, L, *preg);
  if (!prefiller) return 1;
  write_line(to_decode, (*pe)->address().to_hex());
  fmt::print("{} ({}), KV pages in GPU memory: {}; decode rank {}\n", provider,
             (*pe)->group_info().provider, (*pe)->group_info().gpu_memory,
             decode_gpu < 0 ? std::string("in this process, GPU 0")
                            : fmt::format("in another process, GPU {} (CUDA IPC {})", decode_gpu,
                                          (*pe)->group_info().cuda_ipc));

  struct Stats {
    std::vector<int64_t> done, written;
    int64_t ready = 0;
    bool ok = false;
  };
  std::mutex mu;
  std::map<RequestId, Stats> stats;
  cudaStream_t stream;
  // Non-blocking: a copy on the legacy default stream must not wait for the queued compute.
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<Watcher> watches;
  for (RequestId id = 1; id <= requests; ++id) {
    std::vector<uint32_t> pages(n);
    for (uint32_t k = 0; k < n; ++k) pages[k] = static_cast<uint32_t>((id - 1) * n + k);
    {
      std::lock_guard lock(mu);
      stats[id].done.assign(layers, 0);
      stats[id].written.assign(layers, 0);
    }
    Status st = (*prefiller)
                    ->start(
                        id, pages, tp, [](RequestId, const Status&) {},
                        [&](RequestId id, uint32_t, uint32_t layer) {
                          std::lock_guard lock(mu);
                          stats[id].written[layer] = now_ns();
                        });
    if (!st) return fmt::print("start: {}\n", st.to_string()), 1;
    auto w = (*prefiller)->watch_layers(**watchers, id, [&, id](uint32_t layer) {
      std::lock_guard lock(mu);
      stats[id].done[layer] = now_ns();
    });
    if (!w) return fmt::print("watch: {}\n", w.status().to_string()), 1;
    watches.push_back(*w);
    // The GPU "computes" the request: per layer, its KV pages, the rest of the layer, a bump.
    for (uint32_t l = 0; l < layers; ++l) {
      for (uint32_t k = 0; k < n; ++k) {
        CUDA_OK(launch_fill(static_cast<uint8_t*>(psrc) + L.page_offset(l, pages[k]),
                            L.page_bytes(), seed_of(id, l, k), stream));
      }
      CUDA_OK(launch_spin(static_cast<uint64_t>(compute_ms * 1e6), stream));
      CUDA_OK(launch_bump(watches.back().device_word, l + 1, stream));
    }
  }
  // The decode rank's report: "id ready_ns ok" per request that became ready, then "end" (it
  // gives up after 120 s).
  for (std::string line; read_line(from_decode, line) && line != "end";) {
    std::istringstream in(line);
    RequestId id = 0;
    int64_t ready = 0;
    int ok = 0;
    in >> id >> ready >> ok;
    std::lock_guard lock(mu);
    if (stats.count(id)) {
      stats[id].ready = ready;
      stats[id].ok = ok == 1;
    }
  }
  close(to_decode);
  to_decode = -1;
  if (side.thread.joinable()) side.thread.join();
  if (decode_pid > 0) {
    int status = 0;
    waitpid(decode_pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) fmt::print("the decode process failed\n");
  }
  CUDA_OK(cudaStreamSynchronize(stream));
  // The table.
  std::vector<double> xfer, exposed, ttft, colo;
  double hidden = 0, busy_total = 0;
  int ok = 0;
  int64_t first = 0, last = 0;
  {
    std::lock_guard lock(mu);
    for (auto& [id, s] : stats) {
      if (s.ready == 0) continue;
      ok += s.ok;
      const int64_t start = s.done[0] - static_cast<int64_t>(compute_ms * 1e6);
      first = first ? std::min(first, start) : start;
      last = std::max(last, s.ready);
      int64_t sum = 0, busy = 0, covered = 0;
      for (uint32_t l = 0; l < layers; ++l) {
        sum += s.written[l] - s.done[l];
        const int64_t from = std::max(s.done[l], covered);
        if (s.written[l] > from) busy += s.written[l] - from;
        covered = std::max(covered, s.written[l]);
      }
      xfer.push_back(sum / 1e6 / layers);
      const double exp = std::max<int64_t>(0, s.ready - s.done[layers - 1]) / 1e6;
      exposed.push_back(exp);
      hidden += std::max(0.0, busy / 1e6 - exp);
      busy_total += busy / 1e6;
      ttft.push_back((s.ready - start) / 1e6);
      colo.push_back((s.done[layers - 1] - start) / 1e6);
    }
  }
  auto mean = [](const std::vector<double>& v) {
    return v.empty() ? 0 : std::accumulate(v.begin(), v.end(), 0.0) / v.size();
  };
  const double layer_bytes = double(n) * L.page_bytes();
  const double wall = (last - first) / 1e9;
  fmt::print(
      "{} layers, {} pages of {} KiB per layer per request ({:.1f} MiB a request), TP{} "
      "rank 0, {} requests\n\n",
      layers, n, L.page_bytes() / 1024, layers * layer_bytes / (1 << 20), tp, requests);
  fmt::print("| metric | value |\n| --- | --- |\n");
  fmt::print("| per-layer compute (GPU spin kernel + page writes) | {:.2f} ms |\n", compute_ms);
  fmt::print(
      "| per-layer transfer (watcher saw the layer -> its writes complete), p50 / mean / "
      "p99 | {:.2f} / {:.2f} / {:.2f} ms |\n",
      percentile(xfer, 0.5), mean(xfer), percentile(xfer, 0.99));
  fmt::print("| per-layer transfer rate at p50 | {:.2f} Gbps |\n",
             percentile(xfer, 0.5) > 0 ? layer_bytes * 8 / (percentile(xfer, 0.5) * 1e6) : 0);
  fmt::print("| transfer hidden under compute | {:.1f} % |\n",
             busy_total > 0 ? 100 * hidden / busy_total : 0);
  fmt::print("| exposed transfer after the last layer, mean | {:.2f} ms |\n", mean(exposed));
  fmt::print("| TTFT colocated (compute alone), mean | {:.1f} ms |\n", mean(colo));
  fmt::print("| TTFT disaggregated, mean / p99 | {:.1f} / {:.1f} ms |\n", mean(ttft),
             percentile(ttft, 0.99));
  fmt::print("| pages/s (page writes) | {:.0f} |\n",
             wall > 0 ? double(ttft.size()) * layers * n / wall : 0);
  fmt::print("| throughput | {:.2f} Gbps over {:.2f} s |\n",
             wall > 0 ? double(ttft.size()) * layers * layer_bytes * 8 / wall / 1e9 : 0, wall);
  fmt::print("| requests byte-exact / ended / submitted | {} / {} / {} |\n", ok, ttft.size(),
             requests);
  fmt::print("| pinned host memory of mirrors, prefill rank | {:.1f} MiB (cache {:.1f} MiB) |\n",
             double((*pe)->stats().groups[0].host_mirror_bytes) / (1 << 20),
             double(L.region_bytes()) / (1 << 20));
  for (auto& w : watches) (*watchers)->unwatch(w).ignore();
  prefiller->reset();
  (*pe)->close();
  CUDA_OK(cudaFree(psrc));
  return ok == int(requests) ? 0 : 1;
}
