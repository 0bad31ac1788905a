// fabric-bench-gpu: the engine's GPU paths on a GPU machine, two processes on one GPU.
//
//   --op staged    GPU-to-GPU writes through the group's GPU memory path (direct FI_HMEM where
//                  the provider has it, else staged: device -> pinned mirror -> fabric -> peer's
//                  mirror -> device; --staged forces the latter), 64 KiB pages and 32 MiB single
//                  writes, against a plain cudaMemcpy D2H + H2D of the same bytes, same run.
//   --op pipeline  a kernel "computes" L layers (a timed spin), bumping a UvmWatcher after each;
//                  the watcher callback ships that layer's pages to the peer. Reports how much of
//                  the transfer time hides under compute.
//   --op host-dst  GPU memory into host memory of the other process, three ways in one run:
//                  into memory registered with RegisterOptions::gpu_copies (the owner's GPU
//                  copies it down over CUDA IPC), into plain host memory (the staged path:
//                  a pinned mirror, then the fabric), and a cudaMemcpyAsync into pinned memory
//                  of this process (one copy's bound).
//   --op nvlink    GPU to GPU over the CUDA IPC path (gpu_nvlink.cc): single writes of 4 KiB
//                  to 1 GiB and paged writes against cudaMemcpyPeerAsync, and the latency of a
//                  write with an immediate to the peer's callback (ping-pong).
//
// With the CUDA IPC path (docs/cuda-ipc.md, on unless --staged) the same rows measure it, and
// single writes by size plus three ways of copying pages are measured against device-to-device
// copies. --peer-gpu N puts the destination on GPU N (two GPUs joined by NVLink): the
// device-to-device baselines then copy from GPU 0 into GPU N by peer access.
//
// The parent writes; a child process (this binary with --serve) owns the destination GPU buffer
// and prints its descriptor. Every transfer's bytes are checked once, outside the timed runs.
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <mutex>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_check.h"
#include "fabric/fabric.h"
#include "fabric/uvm_watcher.h"
#include "gpu_common.h"
#include "gpu_kernels.h"
#include "gpu_nvlink.h"

namespace {

using namespace bench_gpu;
using Clock = std::chrono::steady_clock;

// --staged turns the direct (FI_HMEM) path off, so both paths can be measured where a provider
// offers it; it travels to the serving process through this variable.
bool g_staged = false;
// --peer-gpu: the destination's GPU (the serving process's); the writer uses GPU 0.
int g_peer_gpu = 0;
// --serve-on-worker: the serving process runs its callbacks on its worker
// (Config::callbacks_on_worker), so a ping is answered without a thread hop.
bool g_serve_on_worker = false;
// --serve-host: the serving process's destination is host memory (pageable, as a user's
// buffer is), registered with RegisterOptions::gpu_copies when --gpu-copies is given too.
bool g_serve_host = false;
bool g_gpu_copies = false;

fabric::Config config_for(const std::string& provider) {
  fabric::Config c;
  c.gpu_direct = !g_staged;
  // --staged measures the staged path: the CUDA IPC path (same-host GPU peers) off too.
  c.cuda_ipc = g_staged ? fabric::Config::CudaIpc::kOff : fabric::Config::CudaIpc::kAuto;
  c.provider = provider;
  c.groups[0].nics = {provider == "tcp" ? "lo" : provider};
  c.groups[0].cpu = fabric::GroupConfig::kCpuNone;
  return c;
}

// The serving process: owns a destination buffer on --peer-gpu, prints its descriptor, then
// takes requests on stdin, one a line:
//   sum OFFSET LENGTH   answers a checksum of that many device bytes
//   pong HEX BYTES      from now on answers each arrival of the immediate kPing, from the
//                       callback that sees it, with a write of BYTES from its buffer to the
//                       descriptor HEX with the immediate kPong (an imm-only write to HEX's
//                       owner when BYTES is 0), and notes the arrival's time; answers "ok"
//   times               answers the noted arrival times (steady clock, ns) and forgets them
//   quit                ends
int serve(const std::string& provider, uint64_t bytes) {
  CUDA_OK(cudaSetDevice(g_peer_gpu));
  fabric::Config config = config_for(provider);
  config.callbacks_on_worker = g_serve_on_worker;
  auto engine = must(fabric::TransferEngine::create(config), "engine");
  void* dst = nullptr;
  if (g_serve_host) {
    dst = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
    std::memset(dst, 0, bytes);
  } else {
    CUDA_OK(cudaMalloc(&dst, bytes));
    CUDA_OK(cudaMemset(dst, 0, bytes));
  }
  auto reg =
      must(engine->register_memory(dst, bytes, fabric::RegisterOptions{.gpu_copies = g_gpu_copies}),
           "register");
  std::printf("%s\n", reg.descriptor.to_hex().c_str());
  std::fflush(stdout);
  std::mutex mu;  // arrivals
  std::vector<int64_t> arrivals;
  fabric::RemoteMemory back;
  uint64_t back_bytes = 0;
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "quit") break;
    if (cmd == "sum") {
      uint64_t off = 0, len = 0;
      in >> off >> len;
      std::printf("%llu\n", static_cast<unsigned long long>(
                                host_checksum(static_cast<uint8_t*>(dst) + off, len)));
    } else if (cmd == "pong") {
      std::string hex;
      in >> hex >> back_bytes;
      back = must(fabric::RemoteMemory::from_hex(hex), "pong descriptor");
      engine->set_unexpected_imm_handler([&, handle = reg.handle](uint32_t imm) {
        if (imm != kPing) return;
        const int64_t t = Clock::now().time_since_epoch().count();
        {
          std::lock_guard l(mu);
          arrivals.push_back(t);
        }
        auto r = back_bytes ? engine->submit(
                                  fabric::SingleWrite{handle, 0, back, 0, back_bytes, kPong, {}},
                                  fabric::Callbacks{})
                            : engine->submit(fabric::ImmWrite{back.owner(), kPong}, {});
        if (!r) std::fprintf(stderr, "pong: %s\n", r.status().to_string().c_str());
      });
      std::printf("ok\n");
    } else if (cmd == "times") {
      std::lock_guard l(mu);
      std::string out;
      for (int64_t t : arrivals) out += std::to_string(t) + " ";
      arrivals.clear();
      std::printf("%s\n", out.c_str());
    }
    std::fflush(stdout);
  }
  engine->set_unexpected_imm_handler(nullptr);
  engine->close();
  if (g_serve_host) {
    std::free(dst);
  } else {
    cudaFree(dst);
  }
  return 0;
}

// The serving process's command line.
std::vector<std::string> serve_args(const std::string& provider, uint64_t bytes, bool on_worker) {
  std::vector<std::string> args = {"--serve",
                                   "--provider",
                                   provider,
                                   "--bytes",
                                   std::to_string(bytes),
                                   "--peer-gpu",
                                   std::to_string(g_peer_gpu)};
  if (g_staged) args.push_back("--staged");
  if (on_worker) args.push_back("--serve-on-worker");
  return args;
}

// --op host-dst: GPU 0 of this process into host memory of a serving process, registered for
// the owner's GPU copies and plainly, against one cudaMemcpyAsync into pinned memory here.
int run_host_dst(const std::string& provider, int iters) {
  constexpr uint64_t kBuf = 64ull << 20;
  auto engine = must(fabric::TransferEngine::create(config_for(provider)), "engine");
  uint8_t* src = nullptr;
  CUDA_OK(cudaMalloc(&src, kBuf));
  CUDA_OK(launch_fill(src, kBuf, 4242, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  auto reg = must(engine->register_memory(src, kBuf), "register");
  void* pinned = nullptr;
  CUDA_OK(cudaHostAlloc(&pinned, kBuf, cudaHostAllocDefault));
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<std::string> args = serve_args(provider, kBuf, false);
  args.push_back("--serve-host");
  Peer plain = spawn(args);
  args.push_back("--gpu-copies");
  Peer copies = spawn(args);
  auto plain_dst = must(fabric::RemoteMemory::from_hex(plain.line()), "descriptor");
  auto copies_dst = must(fabric::RemoteMemory::from_hex(copies.line()), "descriptor");
  Waiter w;
  std::printf(
      "fabric-bench-gpu --op host-dst: provider %s, GPU 0 -> host memory of another "
      "process; CUDA IPC %s; the destination's descriptor: gpu_copies %s\n",
      engine->group_info().provider.c_str(), engine->group_info().cuda_ipc.c_str(),
      copies_dst.cuda_ipc() && copies_dst.cuda_ipc()->host ? "yes" : "NO");
  struct Row {
    const char* name;
    uint64_t size;   // per write
    uint32_t count;  // writes in flight (a window), or pages of one paged write
    bool paged;
  };
  const Row rows[] = {{"paged 4 KiB x 4096", 4096, 4096, true},
                      {"paged 64 KiB x 512", 65536, 512, true},
                      {"single 64 KiB x 64", 65536, 64, false},
                      {"single 1 MiB x 32", 1 << 20, 32, false},
                      {"single 32 MiB x 2", 32 << 20, 2, false}};
  std::printf("\n%-22s %10s %14s %14s %14s %10s\n", "GPU -> host", "MiB", "gpu_copies GB/s",
              "staged GB/s", "D2H pinned GB/s", "ratio");
  for (const Row& row : rows) {
    const uint64_t total = row.size * row.count;
    std::vector<uint32_t> pages(row.paged ? row.count : 0);
    std::iota(pages.begin(), pages.end(), 0);
    std::shuffle(pages.begin(), pages.end(), std::mt19937(7));
    auto run = [&](const fabric::RemoteMemory& dst) {
      w.reset();
      const auto t0 = Clock::now();
      if (row.paged) {
        must(engine->submit(fabric::PagedWrite{reg.handle, dst, row.size, pages, row.size, 0, pages,
                                               row.size, 0, 3},
                            w.callbacks()),
             "submit");
        w.wait(1);
      } else {
        for (uint32_t i = 0; i < row.count; ++i) {
          must(
              engine->submit(
                  fabric::SingleWrite{reg.handle, i * row.size, dst, i * row.size, row.size, 3, {}},
                  w.callbacks()),
              "submit");
        }
        w.wait(row.count);
      }
      return std::chrono::duration<double>(Clock::now() - t0).count();
    };
    auto run_base = [&] {
      const auto t0 = Clock::now();
      for (uint32_t i = 0; i < row.count; ++i) {
        const uint64_t at = (row.paged ? pages[i] : i) * row.size;
        CUDA_OK(cudaMemcpyAsync(static_cast<uint8_t*>(pinned) + at, src + at, row.size,
                                cudaMemcpyDeviceToHost, stream));
      }
      CUDA_OK(cudaStreamSynchronize(stream));
      return std::chrono::duration<double>(Clock::now() - t0).count();
    };
    run(copies_dst);
    run(plain_dst);
    const uint64_t want = host_checksum(src, total);
    if (copies.checksum(0, total) != want || plain.checksum(0, total) != want) {
      std::fprintf(stderr, "verification failed: %s: a destination differs\n", row.name);
      return 1;
    }
    std::vector<double> a, b, c;
    for (int i = 0; i < iters; ++i) {  // interleaved
      a.push_back(run(copies_dst));
      b.push_back(run(plain_dst));
      c.push_back(run_base());
    }
    const double ga = total / median(a) / 1e9, gb = total / median(b) / 1e9;
    std::printf("%-22s %10.1f %14.2f %14.2f %14.2f %10.2f\n", row.name, total / 1048576.0, ga, gb,
                total / median(c) / 1e9, ga / gb);
  }
  std::printf(
      "(medians of %d interleaved runs; ratio: gpu_copies / staged; every row's bytes "
      "checked in both destinations)\n",
      iters);
  const auto before = engine->stats().groups[0].cuda_ipc_transfers;
  std::vector<uint32_t> pages(512);
  std::iota(pages.begin(), pages.end(), 0);
  w.reset();
  must(engine->submit(
           fabric::PagedWrite{reg.handle, copies_dst, 65536, pages, 65536, 0, pages, 65536, 0, 3},
           w.callbacks()),
       "submit");
  w.wait(1);
  std::printf(
      "CUDA IPC transfers for one more paged write: %llu\n",
      static_cast<unsigned long long>(engine->stats().groups[0].cuda_ipc_transfers - before));
  plain.quit();
  copies.quit();
  engine->close();
  cudaFree(src);
  cudaFreeHost(pinned);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"fabric-bench-gpu: staged GPU transfers and the layer pipeline (GPU machines)"};
  std::string op = "all", provider = "shm";
  bool serve_mode = false;
  uint64_t bytes = 64ull << 20;
  int iters = 20, layers = 32;
  uint64_t layer_pages = 32;
  app.add_option("--op", op, "staged, pipeline, all (both), nvlink, or host-dst");
  app.add_option("--provider", provider, "libfabric provider (shm or tcp)");
  app.add_option("--iters", iters, "timed repetitions per row (median reported)");
  app.add_option("--layers", layers, "pipeline: layers");
  app.add_option("--layer-pages", layer_pages, "pipeline: 64 KiB pages per layer");
  app.add_flag("--serve", serve_mode, "internal: the destination process");
  app.add_flag("--staged", g_staged,
               "force the staged path (no FI_HMEM registration, no CUDA IPC)");
  app.add_option("--peer-gpu", g_peer_gpu,
                 "the destination's GPU (default 0: both processes on one GPU)");
  app.add_option("--bytes", bytes, "internal: destination buffer size");
  app.add_flag("--serve-host", g_serve_host, "internal: the destination is host memory");
  app.add_flag("--gpu-copies", g_gpu_copies,
               "internal: the host destination is registered with gpu_copies");
  app.add_flag("--serve-on-worker", g_serve_on_worker,
               "internal: the destination process runs callbacks on its worker");
  CLI11_PARSE(app, argc, argv);
  if (serve_mode) return serve(provider, bytes);

  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "no CUDA device: fabric-bench-gpu runs on GPU machines only\n");
    return 2;
  }
  if (op == "host-dst") return run_host_dst(provider, iters);
  if (op == "nvlink") {
    NvlinkSetup setup;
    setup.provider = provider;
    setup.peer_gpu = g_peer_gpu;
    setup.iters = iters;
    setup.config = [&] { return config_for(provider); };
    setup.spawn = [&](uint64_t n, bool on_worker) {
      return spawn(serve_args(provider, n, on_worker));
    };
    return run_nvlink(setup);
  }
  constexpr uint64_t kBuf = 64ull << 20;
  Peer peer = spawn(serve_args(provider, kBuf, false));
  auto dst = must(fabric::RemoteMemory::from_hex(peer.line()), "descriptor");
  auto engine = must(fabric::TransferEngine::create(config_for(provider)), "engine");
  uint8_t* src = nullptr;
  CUDA_OK(cudaMalloc(&src, kBuf));
  CUDA_OK(launch_fill(src, kBuf, 12345, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  auto reg = must(engine->register_memory(src, kBuf), "register");
  void* pinned = nullptr;  // the baseline's bounce buffer
  CUDA_OK(cudaHostAlloc(&pinned, kBuf, cudaHostAllocDefault));
  // The baselines' destination: on the destination process's GPU, reached by peer access.
  uint8_t* base_dst = nullptr;
  if (g_peer_gpu != 0) {
    CUDA_OK(cudaDeviceEnablePeerAccess(g_peer_gpu, 0));
    CUDA_OK(cudaSetDevice(g_peer_gpu));
    CUDA_OK(cudaMalloc(&base_dst, kBuf));
    CUDA_OK(cudaSetDevice(0));
  } else {
    CUDA_OK(cudaMalloc(&base_dst, kBuf));
  }
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Waiter w;

  std::printf(
      "fabric-bench-gpu: provider %s, %s\n", engine->group_info().provider.c_str(),
      fmt::format("two processes, GPU 0 -> GPU {}, GPU memory path: {}, CUDA IPC: {}", g_peer_gpu,
                  engine->group_info().gpu_memory, engine->group_info().cuda_ipc)
          .c_str());
  if (op == "staged" || op == "all") {
    constexpr uint64_t kPage = 64 * 1024, kStride = kPage;
    constexpr uint32_t kPages = 512;  // 32 MiB of pages per transfer
    constexpr uint64_t kSingle = 32ull << 20;
    std::vector<uint32_t> pages(kPages);
    std::iota(pages.begin(), pages.end(), 0);
    std::shuffle(pages.begin(), pages.end(), std::mt19937(1));
    auto run_ours = [&](bool paged) {
      w.reset();
      const auto t0 = Clock::now();
      fabric::Result<fabric::TransferId> id =
          paged ? engine->submit(fabric::PagedWrite{reg.handle, dst, kPage, pages, kStride, 0,
                                                    pages, kStride, 0, 1},
                                 w.callbacks())
                : engine->submit(fabric::SingleWrite{reg.handle, 0, dst, 0, kSingle, 1, {}},
                                 w.callbacks());
      must(std::move(id), "submit");
      w.wait(1);
      return std::chrono::duration<double>(Clock::now() - t0).count();
    };
    auto run_base = [&](bool paged) {
      const auto t0 = Clock::now();
      if (paged) {
        for (uint32_t p : pages) {
          CUDA_OK(cudaMemcpyAsync(static_cast<uint8_t*>(pinned) + p * kStride, src + p * kStride,
                                  kPage, cudaMemcpyDeviceToHost, stream));
        }
        for (uint32_t p : pages) {
          CUDA_OK(cudaMemcpyAsync(base_dst + p * kStride,
                                  static_cast<uint8_t*>(pinned) + p * kStride, kPage,
                                  cudaMemcpyHostToDevice, stream));
        }
        CUDA_OK(cudaStreamSynchronize(stream));
      } else {
        CUDA_OK(cudaMemcpy(pinned, src, kSingle, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(base_dst, pinned, kSingle, cudaMemcpyHostToDevice));
      }
      return std::chrono::duration<double>(Clock::now() - t0).count();
    };
    // The same bytes copied device to device in this process (one cudaMemcpyAsync per page):
    // what the CUDA IPC path can reach on one GPU.
    auto run_d2d = [&](bool paged) {
      const auto t0 = Clock::now();
      if (paged) {
        for (uint32_t p : pages) {
          CUDA_OK(cudaMemcpyAsync(base_dst + p * kStride, src + p * kStride, kPage,
                                  cudaMemcpyDeviceToDevice, stream));
        }
      } else {
        CUDA_OK(cudaMemcpyAsync(base_dst, src, kSingle, cudaMemcpyDeviceToDevice, stream));
      }
      CUDA_OK(cudaStreamSynchronize(stream));
      return std::chrono::duration<double>(Clock::now() - t0).count();
    };
    std::printf("\n%-28s %12s %12s %12s %8s %10s\n", "GPU->GPU", "bytes", "ours GB/s",
                "memcpy GB/s", "ratio", "d2d GB/s");
    for (bool paged : {true, false}) {
      const uint64_t total = paged ? kPages * kPage : kSingle;
      run_ours(paged);  // warm-up, then verify once
      run_base(paged);
      const uint64_t want = paged ? 0 : host_checksum(src, kSingle);
      if (!paged && peer.checksum(0, kSingle) != want) {
        std::fprintf(stderr, "verification failed: destination differs from source\n");
        return 1;
      }
      if (paged && peer.checksum(static_cast<uint64_t>(pages[7]) * kStride, kPage) !=
                       host_checksum(src + static_cast<uint64_t>(pages[7]) * kStride, kPage)) {
        std::fprintf(stderr, "verification failed: a page differs\n");
        return 1;
      }
      std::vector<double> ours, base, d2d;
      for (int i = 0; i < iters; ++i) {  // interleaved
        ours.push_back(run_ours(paged));
        base.push_back(run_base(paged));
        d2d.push_back(run_d2d(paged));
      }
      const double o = total / median(ours) / 1e9, b = total / median(base) / 1e9;
      std::printf("%-28s %12llu %12.2f %12.2f %8.2f %10.2f\n",
                  paged ? "paged 64 KiB x 512" : "single 32 MiB",
                  static_cast<unsigned long long>(total), o, b, o / b, total / median(d2d) / 1e9);
    }
    // Single writes by size, against a device-to-device copy of the same bytes, and the time
    // from submit to on_done of a 4 KiB write with an immediate (the owner's copy, its count
    // of the immediate and its acknowledgment included).
    std::printf("\n%-28s %12s %12s %12s\n", "single write", "bytes", "ours GB/s", "d2d GB/s");
    for (uint64_t n : {uint64_t{4} << 10, uint64_t{64} << 10, uint64_t{1} << 20, uint64_t{16} << 20,
                       uint64_t{64} << 20}) {
      std::vector<double> ours, d2d;
      for (int i = 0; i < iters + 1; ++i) {
        w.reset();
        auto t0 = Clock::now();
        must(engine->submit(fabric::SingleWrite{reg.handle, 0, dst, 0, n, 2, {}}, w.callbacks()),
             "submit");
        w.wait(1);
        if (i > 0) ours.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
        t0 = Clock::now();
        CUDA_OK(cudaMemcpyAsync(base_dst, src, n, cudaMemcpyDeviceToDevice, stream));
        CUDA_OK(cudaStreamSynchronize(stream));
        if (i > 0) d2d.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      }
      std::printf("%-28s %12llu %12.2f %12.2f\n", "single", static_cast<unsigned long long>(n),
                  n / median(ours) / 1e9, n / median(d2d) / 1e9);
    }
    std::vector<double> lat;
    for (int i = 0; i < 2000; ++i) {
      w.reset();
      const auto t0 = Clock::now();
      must(engine->submit(fabric::SingleWrite{reg.handle, 0, dst, 0, 4096, 3, {}}, w.callbacks()),
           "submit");
      w.wait(1);
      lat.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    std::printf("4 KiB write + immediate, submit to on_done: p50 %.1f us (2000 sequential)\n",
                median(lat) * 1e6);
    // How to copy many pages on one GPU (what the owner's copies could use): one
    // cudaMemcpyAsync per page, one cudaMemcpyBatchAsync, or one kernel (its page tables copied
    // up first, as a transfer would have to). In this process, device to device.
    std::printf("\n%-28s %12s %12s %12s %12s\n", "copying 512 pages", "bytes", "per-page GB/s",
                "batch GB/s", "kernel GB/s");
    for (uint64_t page : {uint64_t{4096}, uint64_t{65536}}) {
      const uint32_t n = kPages;
      std::vector<uint32_t> sp(n), dp(n);
      std::iota(sp.begin(), sp.end(), 0);
      std::iota(dp.begin(), dp.end(), 0);
      std::shuffle(dp.begin(), dp.end(), std::mt19937(2));
      std::vector<void*> dsts(n);
      std::vector<const void*> srcs(n);
      std::vector<size_t> sizes(n, page);
      for (uint32_t i = 0; i < n; ++i) {
        dsts[i] = base_dst + dp[i] * page;
        srcs[i] = src + sp[i] * page;
      }
      uint32_t* tables = nullptr;  // device: dst pages, then src pages
      CUDA_OK(cudaMalloc(&tables, 2 * n * sizeof(uint32_t)));
      uint32_t* host_tables = nullptr;
      CUDA_OK(cudaHostAlloc(&host_tables, 2 * n * sizeof(uint32_t), cudaHostAllocDefault));
      std::memcpy(host_tables, dp.data(), n * sizeof(uint32_t));
      std::memcpy(host_tables + n, sp.data(), n * sizeof(uint32_t));
      cudaMemcpyAttributes attr{};
      attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      size_t attr_index = 0;
      std::vector<double> per_page, batch, kernel;
      bool batch_ok = true;
      for (int i = 0; i < iters + 1; ++i) {
        auto t0 = Clock::now();
        for (uint32_t k = 0; k < n; ++k) {
          CUDA_OK(cudaMemcpyAsync(dsts[k], srcs[k], page, cudaMemcpyDeviceToDevice, stream));
        }
        CUDA_OK(cudaStreamSynchronize(stream));
        if (i > 0) per_page.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
        t0 = Clock::now();
        if (batch_ok && cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), n, &attr,
                                             &attr_index, 1, stream) != cudaSuccess) {
          cudaGetLastError();
          batch_ok = false;
        }
        CUDA_OK(cudaStreamSynchronize(stream));
        if (i > 0) batch.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
        t0 = Clock::now();
        CUDA_OK(cudaMemcpyAsync(tables, host_tables, 2 * n * sizeof(uint32_t),
                                cudaMemcpyHostToDevice, stream));
        CUDA_OK(launch_page_copy(base_dst, src, tables, tables + n, n, page, stream));
        CUDA_OK(cudaStreamSynchronize(stream));
        if (i > 0) kernel.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      }
      if (host_checksum(base_dst + dp[5] * page, page) != host_checksum(src + sp[5] * page, page)) {
        std::fprintf(stderr, "verification failed: the page kernel copied wrong bytes\n");
        return 1;
      }
      const double total = static_cast<double>(n * page);
      std::printf("%-28s %12llu %12.2f %12s %12.2f\n",
                  page == 4096 ? "pages of 4 KiB" : "pages of 64 KiB",
                  static_cast<unsigned long long>(n * page), total / median(per_page) / 1e9,
                  batch_ok ? fmt::format("{:.2f}", total / median(batch) / 1e9).c_str() : "n/a",
                  total / median(kernel) / 1e9);
      cudaFree(tables);
      cudaFreeHost(host_tables);
    }
    const fabric::GroupStats st = engine->stats().groups[0];
    std::printf("transfers over CUDA IPC: %llu of %llu\n",
                static_cast<unsigned long long>(st.cuda_ipc_transfers),
                static_cast<unsigned long long>(st.transfers_submitted));
  }

  if (op == "pipeline" || op == "all") {
    constexpr uint64_t kPage = 64 * 1024;
    const uint64_t layer_bytes = layer_pages * kPage;
    if (layer_bytes * layers > kBuf) {
      std::fprintf(stderr, "layers x layer pages exceed the 64 MiB buffer\n");
      return 1;
    }
    std::vector<std::vector<uint32_t>> layer_page_ids(layers);
    for (int l = 0; l < layers; ++l) {
      layer_page_ids[l].resize(layer_pages);
      std::iota(layer_page_ids[l].begin(), layer_page_ids[l].end(),
                static_cast<uint32_t>(l * layer_pages));
    }
    auto submit_layer = [&](int l) {
      must(engine->submit(fabric::PagedWrite{reg.handle, dst, kPage, layer_page_ids[l], kPage, 0,
                                             layer_page_ids[l], kPage, 0, 100u + l},
                          w.callbacks()),
           "submit layer");
    };
    // Transfer alone: every layer submitted at once.
    std::vector<double> xfer;
    for (int r = 0; r < 5; ++r) {
      w.reset();
      const auto t0 = Clock::now();
      for (int l = 0; l < layers; ++l) submit_layer(l);
      w.wait(layers);
      xfer.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    const double t_xfer = median(xfer);
    // Compute per layer: as long as one layer's share of the transfer, so both matter.
    const uint64_t layer_ns = static_cast<uint64_t>(t_xfer / layers * 1e9);
    auto watchers = must(fabric::UvmWatchers::create(), "watchers");
    std::vector<double> comp, pipe;
    for (int r = 0; r < 5; ++r) {
      const auto t0 = Clock::now();
      for (int l = 0; l < layers; ++l) CUDA_OK(launch_spin(layer_ns, stream));
      CUDA_OK(cudaStreamSynchronize(stream));
      comp.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    for (int r = 0; r < 5; ++r) {
      w.reset();
      std::atomic<int> shipped{0};
      auto watcher = must(watchers->watch([&](uint64_t old_v, uint64_t new_v) {
        for (uint64_t l = old_v; l < new_v; ++l) submit_layer(static_cast<int>(l));
        shipped += static_cast<int>(new_v - old_v);
        return new_v < static_cast<uint64_t>(layers);
      }),
                          "watch");
      const auto t0 = Clock::now();
      for (int l = 0; l < layers; ++l) {
        CUDA_OK(launch_spin(layer_ns, stream));
        CUDA_OK(launch_bump(watcher.device_word, static_cast<uint64_t>(l + 1), stream));
      }
      w.wait(layers);
      pipe.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      CUDA_OK(cudaStreamSynchronize(stream));
    }
    const double t_comp = median(comp), t_pipe = median(pipe);
    const double hidden = std::clamp((t_comp + t_xfer - t_pipe) / t_xfer, 0.0, 1.0);
    if (peer.checksum(0, layer_bytes * layers) != host_checksum(src, layer_bytes * layers)) {
      std::fprintf(stderr, "verification failed: pipelined layers differ\n");
      return 1;
    }
    std::printf("\nlayer pipeline: %d layers x %llu pages of 64 KiB (%.1f MiB per layer)\n", layers,
                static_cast<unsigned long long>(layer_pages), layer_bytes / 1048576.0);
    std::printf("  compute alone   %8.2f ms\n", t_comp * 1e3);
    std::printf("  transfer alone  %8.2f ms\n", t_xfer * 1e3);
    std::printf("  pipelined       %8.2f ms (serial would be %.2f ms)\n", t_pipe * 1e3,
                (t_comp + t_xfer) * 1e3);
    std::printf("  hidden under compute: %.0f%% of the transfer time\n", hidden * 100);
  }
  std::fprintf(peer.to, "quit\n");
  std::fflush(peer.to);
  engine->close();
  return 0;
}
