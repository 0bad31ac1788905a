// fabric::ep's kernels as the host sets them up: their parameters (device::Params) from the
// configuration and the layouts, the routes (for every peer rank, where each half's data goes or
// comes from and which word carries its signal), the private scratch's layout, and the error
// report read back as a Status. Host code without CUDA: AllToAll (ep/all_to_all.cc) calls it with
// device addresses, and the tests (tests/ep) with host memory and FakeDeviceBuffer mappings, where
// FakeGpu (tests/support/ep_fake_gpu.h) plays the kernels through the same routes.
#pragma once

#include <cstdint>
#include <vector>

#include "ep/device.h"
#include "ep/schedule.h"
#include "fabric/ep.h"
#include "fabric/status.h"

namespace fabric::ep {

// Where one rank's memory is, as its kernels address it: device addresses for AllToAll (a mapped
// pointer for pinned host memory), host addresses in the tests. Null where there is none.
struct KernelMemory {
  uint8_t* buffer = nullptr;   // this rank's exported buffer (Layout::buffer_bytes)
  uint8_t* scratch = nullptr;  // ScratchLayout::bytes
  device::ErrorReport* report = nullptr;
  // The proxy's regions (ProxyLayout), when some rank is on another node.
  uint8_t* proxy_control = nullptr;
  uint8_t* proxy_data = nullptr;
  // [r]: rank r's buffer as mapped here, for the other ranks of this node (once connected). A
  // rank of this node left null here (or this rank, with `buffer` null) gets no routes.
  std::vector<uint8_t*> peers;
};

// The private scratch of a rank's kernels (GPU memory, zeroed): State, then the row sources
// (max_recv_rows), then the per-expert offsets and cursors (num_local_experts each).
struct ScratchLayout {
  uint64_t rows_offset = 0;
  uint64_t experts_offset = 0;
  uint64_t bytes = 0;

  static ScratchLayout of(const Layout& layout);
};

// The kernels' parameters before connect(): sizes, offsets, the scratch, the report, the ranks
// on other nodes and the proxy's combine map; no routes yet (route_peers). `num_sms`: the GPU's
// multiprocessors. `config` and `layout` valid, `proxy_layout` of them.
device::Params kernel_params(const AllToAllConfig& config, const Layout& layout,
                             const ProxyLayout& proxy_layout, const KernelMemory& memory,
                             uint32_t num_sms);

// Every rank's routes into `params`: for a rank of this node its mapped buffer (or this rank's
// own) and the Signals words in it; for a rank of another node this rank's areas in the proxy's
// data region and the proxy's words in its control region, as the proxy (ep/proxy.h) reads and
// writes them (none without the proxy's regions in `memory`).
void route_peers(device::Params& params, const AllToAllConfig& config, const Layout& layout,
                 const ProxyLayout& proxy_layout, const KernelMemory& memory);

// The failure a kernel recorded, as check() returns it: ok for none; kTimeout naming the half,
// the peer, the round and the signal's last value; kInvalidArgument for an expert index out of
// range; kInternal for an unknown kind.
Status gpu_failure(const device::ErrorReport& report, const AllToAllConfig& config);

}  // namespace fabric::ep
