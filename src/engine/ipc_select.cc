// choose_route: the CUDA IPC path or the fabric, per destination.
#include "engine/ipc_select.h"

namespace fabric::engine {

IpcRoute choose_route(Config::CudaIpc mode, const Origin& self, const cuda::PointerInfo& src_memory,
                      const cuda::IpcExport* src_export, const std::string& src_why,
                      bool src_ipc_only, const RemoteMemory& dst,
                      const std::function<bool(const cuda::DeviceUuid&)>& reachable, bool read) {
  // The words for the two sides: a write's source and destination, or a read's local region
  // (where the bytes go) and the peer's region (where they come from).
  const std::string mine = read ? "the local region" : "the source";
  const std::string theirs = read ? "the peer's region" : "the destination";
  // What makes the path the only way, if anything: a side registered without a host mirror
  // (only CUDA IPC reaches it), or the mode forced on.
  const std::string required =
      dst.ipc_only() ? theirs +
                           " was registered without a host mirror "
                           "(RegisterOptions::host_mirror), so only the CUDA IPC path " +
                           (read ? "reads it" : "reaches it")
      : src_ipc_only ? mine +
                           " was registered without a host mirror "
                           "(RegisterOptions::host_mirror), so only the CUDA IPC path " +
                           (read ? "reaches it" : "reads it")
      : mode == Config::CudaIpc::kOn ? "Config::cuda_ipc is on"
                                     : "";
  auto no = [&](std::string why) {
    if (required.empty()) return IpcRoute{IpcRoute::Kind::kFabric, std::move(why)};
    return IpcRoute{IpcRoute::Kind::kRejected,
                    required + ", but the CUDA IPC path is impossible: " + why};
  };
  if (mode == Config::CudaIpc::kOff) return no("CUDA IPC is off");
  const bool src_device = src_memory.kind != cuda::MemoryKind::kHost;
  // Host memory registered with RegisterOptions::gpu_copies has a section too: its owner's
  // GPU copies a same-host writer's GPU memory into it.
  const bool dst_device =
      (dst.cuda_ipc().has_value() && !dst.cuda_ipc()->host) || dst.staged_region() != 0;
  // Host to host: the fabric, whatever the mode (the path moves GPU memory only). The common
  // case of every submission: no reason spelled out (no allocation).
  if (!src_device && !dst_device) return {IpcRoute::Kind::kFabric, {}};
  if (!src_device) return no(mine + " is host memory");
  if (src_export == nullptr) return no(mine + " has no CUDA IPC export: " + src_why);
  if (!dst.cuda_ipc()) {
    return no(theirs +
              "'s descriptor has no CUDA IPC section (host memory, memory CUDA could not "
              "export, or an owner with CUDA IPC off)");
  }
  const Origin& owner = dst.owner().origin();
  if (!self.same_host(owner)) return no(theirs + "'s owner runs on another host");
  if (src_export->kind == cuda::IpcExport::Kind::kCuda && self.same_process(owner)) {
    return no(theirs + "'s owner is this process (CUDA IPC maps another process's memory)");
  }
  if (!reachable(dst.cuda_ipc()->device)) {
    return no(mine + "'s GPU cannot reach " + theirs + "'s GPU (no peer access)");
  }
  return {IpcRoute::Kind::kIpc, {}};
}

namespace {

IpcDst& ipc_dst(Transfer& t, uint32_t dst_index) {
  // The last one first: a scatter's targets come in order.
  if (!t.ipc.empty() && t.ipc.back().dst_index == dst_index) return t.ipc.back();
  for (IpcDst& d : t.ipc) {
    if (d.dst_index == dst_index) return d;
  }
  IpcDst& d = t.ipc.emplace_back();
  d.dst_index = dst_index;
  return d;
}

}  // namespace

void add_ipc_range(Transfer& t, uint32_t dst_index, uint64_t src_offset, uint64_t dst_offset,
                   uint64_t length) {
  IpcDst& d = ipc_dst(t, dst_index);
  if (length == 0) return;
  if (!d.ranges.empty()) {
    Range& last = d.ranges.back();
    if (last.offset + last.length == dst_offset &&
        d.src_offsets.back() + last.length == src_offset) {
      last.length += length;
      return;
    }
  }
  d.ranges.push_back({dst_offset, length});
  d.src_offsets.push_back(src_offset);
}

void add_ipc_imm(Transfer& t, uint32_t dst_index, uint32_t imm, uint64_t times) {
  IpcDst& d = ipc_dst(t, dst_index);
  d.has_imm = true;
  d.imm = imm;
  d.imm_times += times;
}

const char* cuda_ipc_mode_name(Config::CudaIpc mode) {
  switch (mode) {
    case Config::CudaIpc::kAuto:
      return "auto";
    case Config::CudaIpc::kOn:
      return "on";
    case Config::CudaIpc::kOff:
      return "off";
  }
  return "?";
}

}  // namespace fabric::engine
