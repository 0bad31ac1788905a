// The GPU's copy engines between device memory and host memory, pageable against registered
// (cudaHostRegister), for the question docs/cuda-ipc.md leaves open: whether a same-host write
// with host memory on one side should be one cudaMemcpyAsync by a process that maps the GPU
// side, instead of the fabric's two copies (a staged mirror and the shm transport). Also what
// cudaHostRegister costs per GiB, which registering host memory would pay. Not part of the build:
//   nvcc -O2 -o /tmp/host_copies bench/probes/host_copies.cu && /tmp/host_copies
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define OK(x)                                                                           \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s: %s (line %d)\n", #x, cudaGetErrorString(e_), __LINE__); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

using Clock = std::chrono::steady_clock;

static double seconds(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// A window of `count` copies of `size` bytes, on `streams` streams in turn, timed from the first
// enqueue to the last stream's synchronisation: the median of `iters` windows, in GB/s.
static double window(char* dev, char* host, size_t size, int count, bool to_host,
                     std::vector<cudaStream_t>& streams, int iters) {
  std::vector<double> rates;
  for (int it = 0; it < iters + 1; ++it) {
    auto t = Clock::now();
    for (int i = 0; i < count; ++i) {
      char* d = dev + static_cast<size_t>(i) * size;
      char* h = host + static_cast<size_t>(i) * size;
      cudaStream_t s = streams[i % streams.size()];
      if (to_host) {
        OK(cudaMemcpyAsync(h, d, size, cudaMemcpyDeviceToHost, s));
      } else {
        OK(cudaMemcpyAsync(d, h, size, cudaMemcpyHostToDevice, s));
      }
    }
    for (cudaStream_t s : streams) OK(cudaStreamSynchronize(s));
    if (it > 0) rates.push_back(static_cast<double>(size) * count / seconds(t) / 1e9);
  }
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

int main() {
  constexpr size_t kBytes = 256ull << 20;
  OK(cudaSetDevice(0));
  cudaDeviceProp prop{};
  OK(cudaGetDeviceProperties(&prop, 0));
  std::printf("GPU 0: %s\n", prop.name);
  char* dev = nullptr;
  OK(cudaMalloc(&dev, kBytes));
  OK(cudaMemset(dev, 1, kBytes));
  // Host memory as a user's allocation is: pageable, touched (so its pages exist).
  char* host = static_cast<char*>(std::aligned_alloc(4096, kBytes));
  std::memset(host, 2, kBytes);
  std::vector<cudaStream_t> one(1), four(4);
  for (auto& s : one) OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (auto& s : four) OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  struct Row {
    size_t size;
    int count;
  };
  const Row rows[] = {{64 << 10, 256}, {1 << 20, 64}, {32 << 20, 8}, {256 << 20, 1}};
  std::printf("%-9s %-6s %-10s %12s %12s %12s %12s\n", "size", "count", "direction", "pageable 1s",
              "pageable 4s", "registered 1s", "registered 4s");
  double results[4][2][4] = {};
  for (int pass = 0; pass < 2; ++pass) {  // 0: pageable, 1: registered
    if (pass == 1) {
      auto t = Clock::now();
      OK(cudaHostRegister(host, kBytes, cudaHostRegisterDefault));
      const double reg = seconds(t);
      std::printf("cudaHostRegister of %zu MiB: %.1f ms (%.1f ms per GiB)\n", kBytes >> 20,
                  reg * 1e3, reg * 1e3 * (1ull << 30) / kBytes);
    }
    for (int r = 0; r < 4; ++r) {
      for (int dir = 0; dir < 2; ++dir) {
        results[r][dir][pass * 2] =
            window(dev, host, rows[r].size, rows[r].count, dir == 0, one, 5);
        results[r][dir][pass * 2 + 1] =
            window(dev, host, rows[r].size, rows[r].count, dir == 0, four, 5);
      }
    }
  }
  for (int r = 0; r < 4; ++r) {
    for (int dir = 0; dir < 2; ++dir) {
      std::printf("%-9zu %-6d %-10s %12.2f %12.2f %12.2f %12.2f\n", rows[r].size, rows[r].count,
                  dir == 0 ? "D2H" : "H2D", results[r][dir][0], results[r][dir][1],
                  results[r][dir][2], results[r][dir][3]);
    }
  }
  std::printf("(GB/s, medians of 5 windows; 1s/4s: the window's copies on one stream or four)\n");
  auto t = Clock::now();
  OK(cudaHostUnregister(host));
  std::printf("cudaHostUnregister: %.1f ms\n", seconds(t) * 1e3);
  // One 4 KiB copy alone, enqueue to synchronisation: the latency floor of such a path.
  for (int dir = 0; dir < 2; ++dir) {
    std::vector<double> us;
    for (int i = 0; i < 201; ++i) {
      auto t0 = Clock::now();
      if (dir == 0) {
        OK(cudaMemcpyAsync(host, dev, 4096, cudaMemcpyDeviceToHost, one[0]));
      } else {
        OK(cudaMemcpyAsync(dev, host, 4096, cudaMemcpyHostToDevice, one[0]));
      }
      OK(cudaStreamSynchronize(one[0]));
      us.push_back(seconds(t0) * 1e6);
    }
    std::sort(us.begin(), us.end());
    std::printf("one 4 KiB %s (pageable) alone: %.1f us p50, %.1f us p99\n",
                dir == 0 ? "D2H" : "H2D", us[us.size() / 2], us[us.size() * 99 / 100]);
  }
  std::free(host);
  OK(cudaFree(dev));
  return 0;
}
