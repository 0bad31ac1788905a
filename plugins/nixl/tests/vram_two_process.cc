// VRAM to VRAM between two processes through NIXL's C++ API and the FABRIC plugin, verified:
// the C++ twin of vram_two_process.py, for GPU hosts where NIXL's Python module is not built for
// the interpreter that has torch.
//
//   fabric-nixl-vram-check [--device cpu] [--bytes N]
//
// The process forks a target; they exchange NIXL metadata through files in a fresh folder.
//   1. WRITE initiator VRAM -> target VRAM with a notification; the target compares every byte
//      with the expected pattern the moment the notification is seen, and answers ok or bad
//   2. WRITE initiator DRAM -> target VRAM, the same
//   3. READ  target VRAM -> initiator VRAM: verified, or refused with a NIXL error (the engine
//      cannot read GPU memory it reaches only through a mirror or CUDA IPC yet)
// Exit 0 when 1 and 2 are verified and 3 is verified or refused; 77 without a CUDA device.
// FABRIC_PROVIDER picks the engine's provider; --device cpu runs the exchange on DRAM.
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "nixl.h"

namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kDeadline = std::chrono::seconds(60);

bool g_gpu = true;
size_t g_bytes = 64 << 20;

#define CHECK_NIXL(call)                                                                  \
  do {                                                                                    \
    nixl_status_t s_ = (call);                                                            \
    if (s_ != NIXL_SUCCESS) {                                                             \
      std::fprintf(stderr, "%s:%d: %s: status %d\n", __FILE__, __LINE__, #call, int(s_)); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

#define CHECK_CUDA(call)                                                                          \
  do {                                                                                            \
    cudaError_t e_ = (call);                                                                      \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

std::vector<uint8_t> pattern(uint32_t seed) {
  std::vector<uint8_t> v(g_bytes);
  uint32_t x = seed * 2654435761u + 1;
  for (auto& b : v) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<uint8_t>(x >> 24);
  }
  return v;
}

// A buffer in GPU memory (or host memory with --device cpu).
struct Buffer {
  explicit Buffer(bool gpu) : gpu(gpu) {
    if (gpu) {
      CHECK_CUDA(cudaMalloc(&ptr, g_bytes));
      CHECK_CUDA(cudaMemset(ptr, 0, g_bytes));
    } else {
      ptr = std::calloc(1, g_bytes);
    }
  }
  ~Buffer() {
    if (gpu) {
      cudaFree(ptr);
    } else {
      std::free(ptr);
    }
  }
  void fill(const std::vector<uint8_t>& v) {
    if (gpu) {
      CHECK_CUDA(cudaMemcpy(ptr, v.data(), g_bytes, cudaMemcpyHostToDevice));
    } else {
      std::memcpy(ptr, v.data(), g_bytes);
    }
  }
  bool equals(const std::vector<uint8_t>& v) const {
    std::vector<uint8_t> got(g_bytes);
    if (gpu) {
      CHECK_CUDA(cudaMemcpy(got.data(), ptr, g_bytes, cudaMemcpyDeviceToHost));
    } else {
      std::memcpy(got.data(), ptr, g_bytes);
    }
    return got == v;
  }
  nixl_mem_t mem() const { return gpu ? VRAM_SEG : DRAM_SEG; }
  bool gpu;
  void* ptr = nullptr;
};

void put_file(const std::filesystem::path& path, const std::string& data) {
  std::ofstream(path.string() + ".tmp", std::ios::binary) << data;
  std::filesystem::rename(path.string() + ".tmp", path);
}

std::string wait_file(const std::filesystem::path& path) {
  const auto end = Clock::now() + kDeadline;
  while (!std::filesystem::exists(path)) {
    if (Clock::now() > end) {
      std::fprintf(stderr, "no %s\n", path.c_str());
      std::exit(1);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The first notification from anyone that starts with `prefix`.
std::pair<std::string, std::string> wait_notif(nixlAgent& agent, const std::string& prefix) {
  const auto end = Clock::now() + kDeadline;
  while (Clock::now() < end) {
    nixl_notifs_t notifs;
    CHECK_NIXL(agent.getNotifs(notifs));
    for (auto& [sender, msgs] : notifs) {
      for (auto& m : msgs) {
        if (m.rfind(prefix, 0) == 0) return {sender, m};
      }
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  std::fprintf(stderr, "no notification %s\n", prefix.c_str());
  std::exit(1);
}

std::unique_ptr<nixlAgent> make_agent(const std::string& name) {
  nixlAgentConfig cfg(true);
  auto agent = std::make_unique<nixlAgent>(name, cfg);
  nixlBackendH* backend = nullptr;
  CHECK_NIXL(agent->createBackend("FABRIC", {}, backend));
  return agent;
}

nixl_reg_dlist_t reg_list(const Buffer& b) {
  nixl_reg_dlist_t l(b.mem());
  l.addDesc(nixlBlobDesc(reinterpret_cast<uintptr_t>(b.ptr), g_bytes, 0));
  return l;
}

nixl_xfer_dlist_t xfer_list(uintptr_t addr, nixl_mem_t mem) {
  nixl_xfer_dlist_t l(mem);
  l.addDesc(nixlBasicDesc(addr, g_bytes, 0));
  return l;
}

int run_target(const std::filesystem::path& dir) {
  auto agent = make_agent("target");
  Buffer vram(g_gpu);
  CHECK_NIXL(agent->registerMem(reg_list(vram)));
  std::string md;
  CHECK_NIXL(agent->getLocalMD(md));
  put_file(dir / "target.md", md);
  put_file(dir / "target.ptr", std::to_string(reinterpret_cast<uintptr_t>(vram.ptr)));
  std::string name;
  CHECK_NIXL(agent->loadRemoteMD(wait_file(dir / "initiator.md"), name));
  int bad = 0;
  const std::pair<const char*, uint32_t> steps[] = {{"vram-write", 1}, {"dram-write", 2}};
  for (const auto& [step, seed] : steps) {
    auto [sender, msg] = wait_notif(*agent, step);
    const bool ok = vram.equals(pattern(seed));
    std::printf("target: %s from %s: %s\n", step, sender.c_str(), ok ? "verified" : "WRONG BYTES");
    std::fflush(stdout);
    bad += ok ? 0 : 1;
    CHECK_NIXL(agent->genNotif(sender, std::string(step) + (ok ? ":ok" : ":bad")));
  }
  vram.fill(pattern(3));
  CHECK_NIXL(agent->genNotif(name, "read-ready"));
  wait_notif(*agent, "read-finished");
  CHECK_NIXL(agent->deregisterMem(reg_list(vram)));
  return bad == 0 ? 0 : 1;
}

int run_initiator(const std::filesystem::path& dir) {
  auto agent = make_agent("initiator");
  Buffer vram(g_gpu), back(g_gpu), dram(false);
  vram.fill(pattern(1));
  dram.fill(pattern(2));
  for (const Buffer* b : {&vram, &back, &dram}) CHECK_NIXL(agent->registerMem(reg_list(*b)));
  std::string md;
  CHECK_NIXL(agent->getLocalMD(md));
  put_file(dir / "initiator.md", md);
  std::string name;
  CHECK_NIXL(agent->loadRemoteMD(wait_file(dir / "target.md"), name));
  const uintptr_t remote_ptr = std::stoull(wait_file(dir / "target.ptr"));
  const nixl_mem_t remote_mem = g_gpu ? VRAM_SEG : DRAM_SEG;

  // Runs one request to its end: its final status, or the status that refused it.
  auto run = [&](nixl_xfer_op_t op, const Buffer& local, const std::string& notif) {
    nixl_opt_args_t extra;
    extra.notif = notif;
    nixlXferReqH* req = nullptr;
    nixl_status_t s =
        agent->createXferReq(op, xfer_list(reinterpret_cast<uintptr_t>(local.ptr), local.mem()),
                             xfer_list(remote_ptr, remote_mem), name, req, &extra);
    if (s != NIXL_SUCCESS) return s;
    s = agent->postXferReq(req);
    const auto end = Clock::now() + kDeadline;
    while (s == NIXL_IN_PROG && Clock::now() < end) s = agent->getXferStatus(req);
    agent->releaseXferReq(req);
    return s;
  };

  int failures = 0;
  const std::pair<const char*, const Buffer*> writes[] = {{"vram-write", &vram},
                                                          {"dram-write", &dram}};
  for (const auto& [step, local] : writes) {
    const auto start = Clock::now();
    nixl_status_t s = run(NIXL_WRITE, *local, step);
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    if (s != NIXL_SUCCESS) {
      std::printf("initiator: %s: status %d\n", step, int(s));
      ++failures;
      continue;
    }
    auto [sender, reply] = wait_notif(*agent, std::string(step) + ":");
    const bool ok = reply == std::string(step) + ":ok";
    std::printf("initiator: %s: %zu bytes in %.2f ms, %s\n", step, g_bytes, ms,
                ok ? "verified by the target" : "WRONG BYTES at the target");
    failures += ok ? 0 : 1;
  }
  wait_notif(*agent, "read-ready");
  const nixl_status_t s = run(NIXL_READ, back, "read");
  if (s == NIXL_SUCCESS) {
    const bool ok = back.equals(pattern(3));
    std::printf("initiator: vram-read: %s\n", ok ? "verified" : "WRONG BYTES");
    failures += ok ? 0 : 1;
  } else {
    std::printf("initiator: vram-read refused with status %d (see the log line for why)\n", int(s));
  }
  std::fflush(stdout);
  CHECK_NIXL(agent->genNotif(name, "read-finished"));
  for (const Buffer* b : {&vram, &back, &dram}) CHECK_NIXL(agent->deregisterMem(reg_list(*b)));
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--device") == 0 && i + 1 < argc) {
      g_gpu = std::strcmp(argv[++i], "cpu") != 0;
    } else if (std::strcmp(argv[i], "--bytes") == 0 && i + 1 < argc) {
      g_bytes = std::strtoull(argv[++i], nullptr, 10);
    } else {
      std::fprintf(stderr, "usage: %s [--device cpu|cuda] [--bytes N]\n", argv[0]);
      return 2;
    }
  }
  char tmpl[] = "/tmp/nixl-vram-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return 1;
  const std::filesystem::path dir(tmpl);
  // Fork before either side touches CUDA or NIXL (CUDA does not survive a fork).
  auto has_gpu = [] {
    int devices = 0;
    return cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
  };
  const pid_t child = fork();
  if (child == 0) _exit(g_gpu && !has_gpu() ? 77 : run_target(dir));
  if (g_gpu && !has_gpu()) {
    std::printf("SKIPPED: no CUDA device\n");
    waitpid(child, nullptr, 0);
    std::filesystem::remove_all(dir);
    return 77;
  }
  const int rc = run_initiator(dir);
  int status = 0;
  waitpid(child, &status, 0);
  const int target_rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
  std::filesystem::remove_all(dir);
  std::printf("initiator exit %d, target exit %d\n", rc, target_rc);
  return rc == 0 && target_rc == 0 ? 0 : 1;
}
