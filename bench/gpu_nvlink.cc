// fabric-bench-gpu --op nvlink: GPU to GPU through the engine's CUDA IPC path (docs/cuda-ipc.md),
// against cudaMemcpyPeerAsync between the same two GPUs in this process, in one run:
//
//   single writes   4 KiB to 1 GiB; a window of writes in flight (up to 64, 256 MiB at most)
//                   against the same copies queued on one stream of GPU 0 (pushed) and, for
//                   reference, of the peer GPU (pulled, as the engine's owner copies are); and
//                   one write alone, submit to on_done, against one copy and its
//                   synchronisation;
//   paged writes    4 KiB x 4096, 64 KiB x 512 and 64 KiB x 4096 pages in a shuffled order
//                   against one copy of the same bytes;
//   ping-pong       a 4 KiB write with an immediate; the serving process answers each from the
//                   callback that sees it (on its worker, and on its callback thread) with a
//                   4 KiB write and an immediate back. One-way time to the peer's callback
//                   (the steady clock is one clock for every process of a machine), round trip,
//                   and the same with imm-only writes (the fabric messages alone).
//
// Every row's bytes are checked once after its timed runs.
#include "gpu_nvlink.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <random>
#include <sstream>
#include <vector>

#include "cuda_check.h"
#include "gpu_kernels.h"

namespace {

using namespace bench_gpu;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct Bench {
  const NvlinkSetup& setup;
  fabric::TransferEngine& engine;
  fabric::MemoryHandle src_handle;
  uint8_t* src = nullptr;        // GPU 0, registered
  uint8_t* peer_copy = nullptr;  // on the peer GPU, the baselines' destination
  cudaStream_t stream{};         // GPU 0's: the copy pushed by the source's GPU
  cudaStream_t pull_stream{};    // the peer GPU's: pulled, as the engine's owner copies are
  Waiter w;

  void copy_peer(uint64_t off, uint64_t n, cudaStream_t s) {
    CUDA_OK(cudaMemcpyPeerAsync(peer_copy + off, setup.peer_gpu, src + off, 0, n, s));
  }
  void copy_peer(uint64_t off, uint64_t n) { copy_peer(off, n, stream); }

  void verify(Peer& peer, uint64_t off, uint64_t n, const char* what) {
    if (peer.checksum(off, n) != host_checksum(src + off, n)) {
      std::fprintf(stderr, "verification failed: %s: the destination differs\n", what);
      std::exit(1);
    }
  }

  void single_rows(Peer& peer, const fabric::RemoteMemory& dst, uint64_t buf) {
    constexpr uint64_t kWindowBytes = 256ull << 20;
    std::printf("\n%-14s %6s %12s %12s %7s %12s %12s %10s\n", "single write", "window", "ours GB/s",
                "peer GB/s", "ratio", "one: ours us", "one: peer us", "pull GB/s");
    for (uint64_t n :
         {4ull << 10, 64ull << 10, 1ull << 20, 16ull << 20, 256ull << 20, 1ull << 30}) {
      if (n > buf) continue;
      const int window = static_cast<int>(std::clamp<uint64_t>(kWindowBytes / n, 1, 64));
      auto offset = [&](int i) { return uint64_t(i) * n + n <= buf ? uint64_t(i) * n : 0; };
      std::vector<double> ours, base, one_ours, one_base, pull;
      for (int it = 0; it <= setup.iters; ++it) {  // the first round warms up
        w.reset();
        auto t0 = Clock::now();
        for (int i = 0; i < window; ++i) {
          must(engine.submit(
                   fabric::SingleWrite{src_handle, offset(i), dst, offset(i), n, std::nullopt, {}},
                   w.callbacks()),
               "submit");
        }
        w.wait(window);
        const double t_ours = seconds_since(t0);
        t0 = Clock::now();
        for (int i = 0; i < window; ++i) copy_peer(offset(i), n);
        CUDA_OK(cudaStreamSynchronize(stream));
        const double t_base = seconds_since(t0);
        w.reset();
        t0 = Clock::now();
        must(engine.submit(fabric::SingleWrite{src_handle, 0, dst, 0, n, std::nullopt, {}},
                           w.callbacks()),
             "submit");
        w.wait(1);
        const double t_one = seconds_since(t0);
        t0 = Clock::now();
        copy_peer(0, n);
        CUDA_OK(cudaStreamSynchronize(stream));
        const double t_one_base = seconds_since(t0);
        t0 = Clock::now();
        for (int i = 0; i < window; ++i) copy_peer(offset(i), n, pull_stream);
        CUDA_OK(cudaStreamSynchronize(pull_stream));
        const double t_pull = seconds_since(t0);
        if (it == 0) continue;
        pull.push_back(t_pull);
        ours.push_back(t_ours);
        base.push_back(t_base);
        one_ours.push_back(t_one);
        one_base.push_back(t_one_base);
      }
      verify(peer, offset(window - 1), n, "single write");
      const double bytes = double(n) * window;
      const double o = bytes / median(ours) / 1e9, b = bytes / median(base) / 1e9;
      std::printf("%-14s %6d %12.2f %12.2f %7.2f %12.1f %12.1f %10.2f\n", fmt_bytes(n).c_str(),
                  window, o, b, o / b, median(one_ours) * 1e6, median(one_base) * 1e6,
                  bytes / median(pull) / 1e9);
    }
  }

  void paged_rows(Peer& peer, const fabric::RemoteMemory& dst, uint64_t buf) {
    std::printf("\n%-22s %12s %12s %14s %7s\n", "paged write", "bytes", "ours GB/s",
                "one copy GB/s", "ratio");
    struct Shape {
      uint64_t page;
      uint32_t pages;
    };
    for (Shape s : {Shape{4096, 4096}, Shape{65536, 512}, Shape{65536, 4096}}) {
      const uint64_t total = s.page * s.pages;
      if (total > buf) continue;
      std::vector<uint32_t> src_pages(s.pages), dst_pages(s.pages);
      std::iota(src_pages.begin(), src_pages.end(), 0);
      std::iota(dst_pages.begin(), dst_pages.end(), 0);
      std::shuffle(dst_pages.begin(), dst_pages.end(), std::mt19937(7));
      std::vector<double> ours, base;
      for (int it = 0; it <= setup.iters; ++it) {
        w.reset();
        auto t0 = Clock::now();
        must(engine.submit(fabric::PagedWrite{src_handle, dst, s.page, src_pages, s.page, 0,
                                              dst_pages, s.page, 0, std::nullopt},
                           w.callbacks()),
             "submit");
        w.wait(1);
        const double t_ours = seconds_since(t0);
        t0 = Clock::now();
        copy_peer(0, total);
        CUDA_OK(cudaStreamSynchronize(stream));
        if (it == 0) continue;
        ours.push_back(t_ours);
        base.push_back(seconds_since(t0));
      }
      const uint32_t k = s.pages / 3;  // a page somewhere in the middle
      if (peer.checksum(uint64_t(dst_pages[k]) * s.page, s.page) !=
          host_checksum(src + uint64_t(src_pages[k]) * s.page, s.page)) {
        std::fprintf(stderr, "verification failed: a page differs\n");
        std::exit(1);
      }
      const double o = total / median(ours) / 1e9, b = total / median(base) / 1e9;
      std::printf("%-22s %12llu %12.2f %14.2f %7.2f\n",
                  fmt::format("{} x {}", fmt_bytes(s.page), s.pages).c_str(),
                  static_cast<unsigned long long>(total), o, b, o / b);
    }
  }

  // Ping-pong against a serving process answering from its worker or its callback thread.
  void ping_pong_rows(const fabric::Registration& pong_reg) {
    constexpr int kWarm = 200, kRounds = 2000;
    std::printf("\n%-44s %10s %10s %10s %10s\n", "ping-pong, 4 KiB GPU to GPU", "1-way p50",
                "1-way p99", "RTT p50", "done p50");
    for (bool on_worker : {true, false}) {
      Peer peer = setup.spawn(1 << 20, on_worker);
      const auto dst = must(fabric::RemoteMemory::from_hex(peer.line()), "descriptor");
      for (uint64_t bytes : {uint64_t{4096}, uint64_t{0}}) {
        if (peer.ask(fmt::format("pong {} {}", pong_reg.descriptor.to_hex(), bytes)) != "ok") {
          std::fprintf(stderr, "the serving process refused the ping-pong\n");
          std::exit(1);
        }
        engine.reset_imm(kPong);
        w.reset();
        std::vector<int64_t> sent;
        std::vector<double> rtt, done;
        for (int i = 0; i < kWarm + kRounds; ++i) {
          const auto t0 = Clock::now();
          sent.push_back(t0.time_since_epoch().count());
          if (bytes) {
            must(engine.submit(fabric::SingleWrite{src_handle, 0, dst, 0, bytes, kPing, {}},
                               w.callbacks()),
                 "submit");
          } else {
            must(engine.submit(fabric::ImmWrite{dst.owner(), kPing}, w.callbacks()), "submit");
          }
          if (!engine.wait_imm(kPong, uint64_t(i) + 1, std::chrono::seconds(10))) {
            std::fprintf(stderr, "ping-pong: no answer to ping %d within 10 s\n", i);
            std::exit(1);
          }
          const double t_rtt = seconds_since(t0);
          w.wait(i + 1);
          if (i >= kWarm) {
            rtt.push_back(t_rtt);
            done.push_back(seconds_since(t0));
          }
        }
        std::istringstream times(peer.ask("times"));
        std::vector<double> one_way;
        int64_t t = 0;
        for (size_t i = 0; times >> t; ++i) {
          if (i >= sent.size()) break;
          if (i >= size_t(kWarm)) one_way.push_back(double(t - sent[i]) / 1e9);
        }
        if (one_way.size() != size_t(kRounds)) {
          std::fprintf(stderr, "ping-pong: %zu arrival times for %d pings\n", one_way.size(),
                       kRounds);
          std::exit(1);
        }
        std::printf("%-44s %10.1f %10.1f %10.1f %10.1f\n",
                    fmt::format("{}, peer answers on its {}", bytes ? "write + imm" : "imm only",
                                on_worker ? "worker" : "callback thread")
                        .c_str(),
                    median(one_way) * 1e6, percentile(one_way, 0.99) * 1e6, median(rtt) * 1e6,
                    median(done) * 1e6);
      }
      peer.quit();
    }
  }

  static std::string fmt_bytes(uint64_t n) {
    if (n >= (1ull << 30)) return fmt::format("{} GiB", n >> 30);
    if (n >= (1ull << 20)) return fmt::format("{} MiB", n >> 20);
    return fmt::format("{} KiB", n >> 10);
  }
};

}  // namespace

int run_nvlink(const NvlinkSetup& setup) {
  constexpr uint64_t kBuf = 1ull << 30;
  CUDA_OK(cudaSetDevice(0));
  int access = 1;
  if (setup.peer_gpu != 0) {
    CUDA_OK(cudaDeviceCanAccessPeer(&access, 0, setup.peer_gpu));
    if (!access) {
      std::fprintf(stderr, "GPU 0 cannot reach GPU %d by peer access\n", setup.peer_gpu);
      return 1;
    }
    CUDA_OK(cudaDeviceEnablePeerAccess(setup.peer_gpu, 0));
  }
  Peer peer = setup.spawn(kBuf, false);
  const auto dst = must(fabric::RemoteMemory::from_hex(peer.line()), "descriptor");
  fabric::Config config = setup.config();
  // The ping-pong waits with wait_imm: poll a while before sleeping (cores are to spare here).
  config.wait_spin = std::chrono::microseconds(200);
  auto engine = must(fabric::TransferEngine::create(config), "engine");
  uint8_t* src = nullptr;
  CUDA_OK(cudaMalloc(&src, kBuf));
  CUDA_OK(launch_fill(src, kBuf, 4242, nullptr));
  uint8_t* peer_copy = nullptr;
  CUDA_OK(cudaSetDevice(setup.peer_gpu));
  CUDA_OK(cudaMalloc(&peer_copy, kBuf));
  CUDA_OK(cudaSetDevice(0));
  void* pong = nullptr;  // where the serving process's answers land
  CUDA_OK(cudaMalloc(&pong, 1 << 20));
  CUDA_OK(cudaDeviceSynchronize());
  auto reg = must(engine->register_memory(src, kBuf), "register");
  auto pong_reg = must(engine->register_memory(pong, 1 << 20), "register");
  Bench b{setup, *engine, reg.handle, src, peer_copy, {}, {}, {}};
  CUDA_OK(cudaStreamCreateWithFlags(&b.stream, cudaStreamNonBlocking));
  CUDA_OK(cudaSetDevice(setup.peer_gpu));
  CUDA_OK(cudaStreamCreateWithFlags(&b.pull_stream, cudaStreamNonBlocking));
  CUDA_OK(cudaSetDevice(0));
  cudaDeviceProp prop{};
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  std::printf(
      "fabric-bench-gpu --op nvlink: %s, GPU 0 -> GPU %d (%s), messages over %s, CUDA IPC %s\n",
      prop.name, setup.peer_gpu, setup.peer_gpu ? "peer access" : "the same GPU",
      engine->group_info().provider.c_str(), engine->group_info().cuda_ipc.c_str());
  std::printf("medians of %d interleaved runs; peer: cudaMemcpyPeerAsync on one stream\n",
              setup.iters);
  b.single_rows(peer, dst, kBuf);
  b.paged_rows(peer, dst, kBuf);
  peer.quit();
  b.ping_pong_rows(pong_reg);
  const fabric::GroupStats st = engine->stats().groups[0];
  std::printf("\ntransfers over CUDA IPC: %llu of %llu\n",
              static_cast<unsigned long long>(st.cuda_ipc_transfers),
              static_cast<unsigned long long>(st.transfers_submitted));
  engine->close();
  return 0;
}
