// fabric-kv-gpu: the disaggregated KV flow with GPU-resident pages. One process, two engines
// (a prefill rank and a decode rank) over tcp or shm, both caches in cudaMalloc memory (moved
// through the engine's staged path where the NIC cannot reach the GPU). A CUDA stream plays
// prefill: for each layer a kernel writes the layer's KV pages, a spin kernel stands for the
// rest of the layer's compute, and a UvmWatcher bump tells the host the layer is done;
// KvPrefiller::watch_layers turns each bump into that layer's paged writes. The decoder checks
// every byte (copied back from the GPU) when a request is ready; a table compares per-layer
// transfer and compute.
#include <cuda_runtime.h>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>
#include <numeric>

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
  CLI11_PARSE(app, argc, argv);

  KvLayout L;
  L.num_layers = layers;
  L.tokens_per_page = 128;
  L.num_kv_heads = 4;
  L.head_bytes = 256;
  L.tp_size = tp;
  const uint32_t n = (tokens + 127) / 128;
  L.num_pages = n * requests;

  auto watchers = UvmWatchers::create();
  if (!watchers) {
    fmt::print("no CUDA here: {}\n", watchers.status().to_string());
    return 0;
  }
  Config c;
  c.provider = provider;
  c.groups = {GroupConfig{}};
  c.groups[0].nics = {provider == "shm" ? "shm" : "lo"};
  auto pe = TransferEngine::create(c);
  auto de = TransferEngine::create(c);
  if (!pe || !de) {
    fmt::print("engine: {}\n", (!pe ? pe.status() : de.status()).to_string());
    return 1;
  }
  void *psrc = nullptr, *ddst = nullptr;
  CUDA_OK(cudaMalloc(&psrc, L.region_bytes()));
  CUDA_OK(cudaMalloc(&ddst, L.region_bytes()));
  CUDA_OK(cudaMemset(ddst, 0, L.region_bytes()));
  auto preg = (*pe)->register_memory(psrc, L.region_bytes());
  auto dreg = (*de)->register_memory(ddst, L.region_bytes());
  if (!preg || !dreg) {
    fmt::print("register: {}\n", (!preg ? preg.status() : dreg.status()).to_string());
    return 1;
  }
  auto prefiller = KvPrefiller::create(**pe, L, *preg);
  auto decoder = KvDecoder::create(**de, L, *dreg);
  if (!prefiller || !decoder) return 1;
  fmt::print("{} ({}), KV pages in GPU memory: {}\n", provider, (*pe)->group_info().provider,
             (*pe)->group_info().gpu_memory);

  struct Stats {
    std::vector<int64_t> done, written;
    int64_t ready = 0;
    bool ok = false;
    std::vector<uint32_t> got;  // the pages, verified after the run
  };
  std::mutex mu;
  std::condition_variable cv;
  std::map<RequestId, Stats> stats;
  int ended = 0;
  std::vector<std::byte> host(L.page_bytes());
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
    DecodeRequest rq;
    rq.id = id;
    rq.pages = pages;
    rq.prefill_ranks.assign(tp, (*pe)->address());
    rq.on_ready = [&](RequestId id, std::span<const uint32_t> got) {
      // Verified after the run: a synchronous copy here would queue behind all the compute
      // still enqueued on the GPU and stall this callback thread.
      const int64_t t = now_ns();
      std::lock_guard lock(mu);
      stats[id].ready = t;
      stats[id].got.assign(got.begin(), got.end());
      ++ended;
      cv.notify_all();
    };
    rq.on_error = [&](RequestId id, const Status& s) {
      fmt::print("request {} failed: {}\n", id, s.to_string());
      std::lock_guard lock(mu);
      ++ended;
      cv.notify_all();
    };
    auto r = (*decoder)->submit(std::move(rq));
    if (!r) return fmt::print("submit: {}\n", r.status().to_string()), 1;
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
  {
    std::unique_lock lock(mu);
    cv.wait_for(lock, std::chrono::seconds(120), [&] { return ended == int(requests); });
  }
  CUDA_OK(cudaStreamSynchronize(stream));
  for (auto& [id, s] : stats) {
    if (s.ready == 0) continue;
    s.ok = true;
    for (uint32_t l = 0; l < layers && s.ok; ++l)
      for (uint32_t k = 0; k < s.got.size() && s.ok; ++k) {
        CUDA_OK(cudaMemcpy(host.data(), static_cast<char*>(ddst) + L.page_offset(l, s.got[k]),
                           L.page_bytes(), cudaMemcpyDeviceToHost));
        for (uint64_t i = 0; i < L.page_bytes(); ++i)
          if (static_cast<uint8_t>(host[i]) != fill_byte(i, seed_of(id, l, k))) {
            s.ok = false;
            break;
          }
      }
  }
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
  for (auto& w : watches) (*watchers)->unwatch(w).ignore();
  decoder->reset();
  prefiller->reset();
  (*pe)->close();
  (*de)->close();
  CUDA_OK(cudaFree(psrc));
  CUDA_OK(cudaFree(ddst));
  return ok == int(requests) ? 0 : 1;
}
