// Which way a write goes (docs/cuda-ipc.md): over the fabric, or GPU to GPU over CUDA IPC. A
// pure function of the configuration, the source registration and the destination descriptor,
// decided per destination of each transfer on the submitting thread.
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "cuda/ipc.h"
#include "engine/transfer_state.h"
#include "fabric/address.h"
#include "fabric/config.h"

namespace fabric::engine {

struct IpcRoute {
  enum class Kind : uint8_t {
    kFabric,    // as before: direct or staged over the group's NICs
    kIpc,       // the destination's owner copies from this engine's exported source
    kRejected,  // the path is the only way (Config::CudaIpc::kOn, or a side registered without
                // a host mirror) and it is impossible: `why` says both
  };
  Kind kind = Kind::kFabric;
  // For kRejected, and kFabric with GPU memory on a side: what rules the path out.
  std::string why;
};

// `src_memory`: the source registration's memory; `src_export`: its CUDA IPC export, or null
// with `src_why` saying why there is none; `src_ipc_only`: the source has no host mirror (only
// the path reads it); `self`: this engine's origin; `reachable`: whether the source's GPU can
// copy to and from the GPU with the given UUID (cuda::ipc_reachable). `read`: a read, whose
// local region is this side (`src_*`) and the peer's region `dst`; only the words change.
IpcRoute choose_route(Config::CudaIpc mode, const Origin& self, const cuda::PointerInfo& src_memory,
                      const cuda::IpcExport* src_export, const std::string& src_why,
                      bool src_ipc_only, const RemoteMemory& dst,
                      const std::function<bool(const cuda::DeviceUuid&)>& reachable,
                      bool read = false);

// Planning a transfer over the path: a range of `length` bytes from `src_offset` of the source
// to `dst_offset` of destination `dst_index` (merged with the range before it when both ends
// continue it), and the immediate its owner counts `times` after the copies.
void add_ipc_range(Transfer& t, uint32_t dst_index, uint64_t src_offset, uint64_t dst_offset,
                   uint64_t length);
void add_ipc_imm(Transfer& t, uint32_t dst_index, uint32_t imm, uint64_t times);

// The mode's name, as fabric-info and GroupInfo show it: "auto", "on", "off".
const char* cuda_ipc_mode_name(Config::CudaIpc mode);

}  // namespace fabric::engine
