// fabric-bench-gpu --op nvlink: the CUDA IPC path GPU to GPU (gpu_nvlink.cc).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "fabric/fabric.h"
#include "gpu_common.h"

// The ping-pong's immediates: the writer's ping, the serving process's answer.
inline constexpr uint32_t kPing = 0x70696e67;
inline constexpr uint32_t kPong = 0x706f6e67;

struct NvlinkSetup {
  std::string provider;
  int peer_gpu = 0;
  int iters = 20;
  std::function<fabric::Config()> config;
  // Starts a serving process owning `bytes` on the peer GPU; on_worker: it answers pings from
  // its worker (Config::callbacks_on_worker).
  std::function<bench_gpu::Peer(uint64_t bytes, bool on_worker)> spawn;
};

int run_nvlink(const NvlinkSetup& setup);
