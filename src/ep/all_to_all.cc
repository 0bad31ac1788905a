// fabric::ep::AllToAll with CUDA: this rank's buffer (cudaMalloc, exported with
// cudaIpcGetMemHandle), the buffers of this node's peers mapped with cudaIpcOpenMemHandle, the
// proxy (ep/proxy.h) towards other nodes with its control region (pinned host memory, mapped)
// and its data region (GPU memory, or pinned host memory mapped), the private device state, the
// pinned error report, and the launchers (kernels in ep/kernels.cu). What needs no CUDA (the
// kernels' parameters and routes, the error report's reading) is in ep/params.cc.
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <cstring>

#include "cuda/cuda_status.h"
#include "ep/handle.h"
#include "ep/kernels.h"
#include "ep/params.h"
#include "ep/proxy.h"
#include "fabric/ep.h"

namespace fabric::ep {

static_assert(sizeof(cudaIpcMemHandle_t) == PeerHandle::kIpcBytes);

namespace {

using cuda::cuda_error;

// Makes `device` current for the scope (when it is not already) and restores the caller's.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&saved_) != cudaSuccess) saved_ = -1;
    if (saved_ != device) status_ = cudaSetDevice(device);
  }
  ~DeviceScope() {
    int now = -1;
    if (saved_ >= 0 && cudaGetDevice(&now) == cudaSuccess && now != saved_) {
      cudaSetDevice(saved_);
    }
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  cudaError_t status() const { return status_; }

 private:
  int saved_ = -1;
  cudaError_t status_ = cudaSuccess;
};

}  // namespace

class AllToAll::Impl {
 public:
  // Sequencing of the halves (host side; a captured graph replays a sequence checked here once).
  enum class Phase { kIdle, kDispatchSent, kDispatchReceived, kCombineSent };

  AllToAllConfig config;
  Layout layout;
  int device = 0;
  PeerHandle mine;
  // Members in creation order: the destructor releases them in reverse.
  uint8_t* buffer = nullptr;              // this rank's exported buffer
  uint8_t* scratch = nullptr;             // State, then the rows, then the per-expert arrays
  device::ErrorReport* report = nullptr;  // pinned host memory, device-mapped
  device::ErrorReport* report_device = nullptr;
  int per_node = 0;                    // gpus_per_node, resolved
  ProxyLayout proxy_layout;            // num_remote 0: every rank on this node, no proxy
  std::byte* proxy_control = nullptr;  // pinned host memory, device-mapped
  uint8_t* proxy_control_device = nullptr;
  std::byte* proxy_data = nullptr;  // GPU memory (proxy_data_on_gpu) or pinned host memory
  uint8_t* proxy_data_device = nullptr;
  bool proxy_data_on_gpu = false;
  bool flush_writes = false;     // GPUDirect writes into the data region need a flush before a flag
  std::unique_ptr<Proxy> proxy;  // reads and writes the proxy's regions: goes first
  std::vector<void*> opened;     // peers' buffers mapped here (null for this rank and unmapped)
  device::Params params{};
  bool connected = false;
  Phase phase = Phase::kIdle;
  uint32_t dispatched_tokens = 0;

  ~Impl() {
    // The proxy's thread and engine stop before the memory they use goes.
    proxy.reset();
    DeviceScope scope(device);
    for (void* p : opened) {
      if (p != nullptr) cudaIpcCloseMemHandle(p);
    }
    if (proxy_data != nullptr && proxy_data_on_gpu) cudaFree(proxy_data);
    if (proxy_data != nullptr && !proxy_data_on_gpu) cudaFreeHost(proxy_data);
    if (proxy_control != nullptr) cudaFreeHost(proxy_control);
    if (report != nullptr) cudaFreeHost(report);
    if (scratch != nullptr) cudaFree(scratch);
    if (buffer != nullptr) cudaFree(buffer);
  }

  Status create() {
    if (config.cuda_device >= 0) {
      device = config.cuda_device;
    } else if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) {
      return cuda_error("cudaGetDevice", err);
    }
    DeviceScope scope(device);
    if (scope.status() != cudaSuccess) return cuda_error("cudaSetDevice", scope.status());
    int sms = 0;
    if (cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
        err != cudaSuccess) {
      return cuda_error("cudaDeviceGetAttribute(multiprocessors)", err);
    }
    cudaDeviceProp prop{};
    if (cudaError_t err = cudaGetDeviceProperties(&prop, device); err != cudaSuccess) {
      return cuda_error("cudaGetDeviceProperties", err);
    }
    if (cudaError_t err = cudaMalloc(&buffer, layout.buffer_bytes); err != cudaSuccess) {
      return cuda_error(
          fmt::format("cudaMalloc of the {}-byte all-to-all buffer", layout.buffer_bytes), err);
    }
    const uint64_t scratch_bytes = ScratchLayout::of(layout).bytes;
    if (cudaError_t err = cudaMalloc(&scratch, scratch_bytes); err != cudaSuccess) {
      return cuda_error("cudaMalloc of the all-to-all's state", err);
    }
    if (cudaError_t err = cudaMemset(buffer, 0, layout.buffer_bytes); err != cudaSuccess) {
      return cuda_error("cudaMemset", err);
    }
    if (cudaError_t err = cudaMemset(scratch, 0, scratch_bytes); err != cudaSuccess) {
      return cuda_error("cudaMemset", err);
    }
    if (cudaError_t err = cudaHostAlloc(reinterpret_cast<void**>(&report),
                                        sizeof(device::ErrorReport), cudaHostAllocMapped);
        err != cudaSuccess) {
      return cuda_error("cudaHostAlloc of the error report", err);
    }
    std::memset(report, 0, sizeof(*report));
    if (cudaError_t err =
            cudaHostGetDevicePointer(reinterpret_cast<void**>(&report_device), report, 0);
        err != cudaSuccess) {
      return cuda_error("cudaHostGetDevicePointer", err);
    }
    per_node = config.gpus_per_node == 0 ? config.world_size : config.gpus_per_node;
    auto pl = ProxyLayout::of(config, layout);
    if (!pl) return pl.status();
    proxy_layout = *pl;
    if (proxy_layout.num_remote > 0) {
      ProxyOptions options;
      options.provider = config.provider;
      options.nics = config.nics;
      options.timeout = config.timeout;
      options.before_flag = [this](int, bool, uint32_t) { return flush_gpudirect_writes(); };
      auto created = Proxy::create(
          config, layout, options,
          [this](const ProxyLayout& l, bool direct) { return allocate_proxy_regions(l, direct); });
      if (!created) {
        return Status(created.status().code(),
                      fmt::format("the inter-node proxy (provider '{}'): {}", config.provider,
                                  created.status().message()));
      }
      proxy = std::move(*created);
    }
    // Zeroed before any peer can have the handle: the peers' first writes come after it.
    if (cudaError_t err = cudaDeviceSynchronize(); err != cudaSuccess) {
      return cuda_error("cudaDeviceSynchronize", err);
    }
    cudaIpcMemHandle_t ipc{};
    if (cudaError_t err = cudaIpcGetMemHandle(&ipc, buffer); err != cudaSuccess) {
      return cuda_error("cudaIpcGetMemHandle of the all-to-all buffer", err);
    }
    mine = make_handle(config, layout);
    mine.pid = static_cast<uint64_t>(::getpid());
    std::memcpy(mine.device.data(), prop.uuid.bytes, mine.device.size());
    std::memcpy(mine.ipc.data(), &ipc, mine.ipc.size());
    if (proxy) mine.proxy = proxy->handle();

    params = kernel_params(config, layout, proxy_layout, memory(), static_cast<uint32_t>(sms));
    return Status::ok();
  }

  // On the proxy thread, before it raises a flag: with the data region in GPU memory, what the
  // NICs wrote into it must be visible to this GPU's kernels, which read it once the flag is up.
  // Where the GPU does not order GPUDirect RDMA writes for its own consumers
  // (cudaDevAttrGPUDirectRDMAWritesOrdering below Owner), cudaDeviceFlushGPUDirectRDMAWrites
  // waits until they are.
  Status flush_gpudirect_writes() const {
    if (!flush_writes) return Status::ok();
    if (cudaError_t err = cudaSetDevice(device); err != cudaSuccess) {
      return cuda_error("cudaSetDevice", err);
    }
    if (cudaError_t err = cudaDeviceFlushGPUDirectRDMAWrites(
            cudaFlushGPUDirectRDMAWritesTargetCurrentDevice, cudaFlushGPUDirectRDMAWritesToOwner);
        err != cudaSuccess) {
      return cuda_error("cudaDeviceFlushGPUDirectRDMAWrites", err);
    }
    return Status::ok();
  }

  // The proxy's regions, zeroed: the control region in pinned host memory; the data region in GPU
  // memory when config.proxy_memory says "gpu", or "auto" and the engine reaches GPU memory
  // itself (`direct`), else in pinned host memory.
  Result<ProxyAreas> allocate_proxy_regions(const ProxyLayout& l, bool direct) {
    if (config.proxy_memory == "gpu" && !direct) {
      return Status(
          ErrorCode::kUnsupported,
          fmt::format("proxy_memory 'gpu' needs NICs that reach GPU memory themselves (GPUDirect "
                      "RDMA), and the proxy's engine (provider '{}') stages GPU memory through "
                      "host memory: with the kernels waiting on the GPU, its copies did not "
                      "complete (seen on an H200). Use 'host' or 'auto' (host here)",
                      config.provider));
    }
    auto host = [](uint64_t bytes, const char* what, std::byte** at,
                   uint8_t** device_at) -> Status {
      if (cudaError_t err = cudaHostAlloc(reinterpret_cast<void**>(at), bytes,
                                          cudaHostAllocMapped | cudaHostAllocPortable);
          err != cudaSuccess) {
        return cuda_error(
            fmt::format("cudaHostAlloc of the proxy's {}-byte {} region", bytes, what), err);
      }
      std::memset(*at, 0, bytes);
      if (cudaError_t err = cudaHostGetDevicePointer(reinterpret_cast<void**>(device_at), *at, 0);
          err != cudaSuccess) {
        return cuda_error(fmt::format("cudaHostGetDevicePointer of the proxy's {} region", what),
                          err);
      }
      return Status::ok();
    };
    if (Status s = host(l.control_bytes, "control", &proxy_control, &proxy_control_device); !s) {
      return s;
    }
    proxy_data_on_gpu = direct && config.proxy_memory != "host";  // "gpu" needs `direct`
    if (!proxy_data_on_gpu) {
      if (Status s = host(l.data_bytes, "data", &proxy_data, &proxy_data_device); !s) return s;
    } else {
      if (cudaError_t err = cudaMalloc(reinterpret_cast<void**>(&proxy_data), l.data_bytes);
          err != cudaSuccess) {
        return cuda_error(
            fmt::format("cudaMalloc of the proxy's {}-byte data region", l.data_bytes), err);
      }
      if (cudaError_t err = cudaMemset(proxy_data, 0, l.data_bytes); err != cudaSuccess) {
        return cuda_error("cudaMemset of the proxy's data region", err);
      }
      proxy_data_device = reinterpret_cast<uint8_t*>(proxy_data);
      int ordering = 0, options = 0;
      if (cudaError_t err =
              cudaDeviceGetAttribute(&ordering, cudaDevAttrGPUDirectRDMAWritesOrdering, device);
          err != cudaSuccess) {
        return cuda_error("cudaDeviceGetAttribute(GPUDirectRDMAWritesOrdering)", err);
      }
      if (ordering < cudaGPUDirectRDMAWritesOrderingOwner) {
        if (cudaError_t err = cudaDeviceGetAttribute(
                &options, cudaDevAttrGPUDirectRDMAFlushWritesOptions, device);
            err != cudaSuccess) {
          return cuda_error("cudaDeviceGetAttribute(GPUDirectRDMAFlushWritesOptions)", err);
        }
        if ((options & cudaFlushGPUDirectRDMAWritesOptionHost) == 0) {
          return Status(ErrorCode::kUnsupported,
                        fmt::format("proxy_memory 'gpu': GPU {} neither orders GPUDirect RDMA "
                                    "writes for its own kernels nor can flush them from the host",
                                    device));
        }
        flush_writes = true;
      }
    }
    return ProxyAreas{{proxy_control, l.control_bytes}, {proxy_data, l.data_bytes}};
  }

  Status connect(const std::vector<Bytes>& handles) {
    if (connected) return Status(ErrorCode::kAlreadyExists, "connect: connected already");
    if (handles.size() != static_cast<size_t>(config.world_size)) {
      return Status(ErrorCode::kInvalidArgument,
                    fmt::format("connect: {} handles for world_size {} (one per rank, this "
                                "rank's included, in rank order)",
                                handles.size(), config.world_size));
    }
    std::vector<PeerHandle> peers;
    for (int r = 0; r < config.world_size; ++r) {
      auto h = decode_handle(handles[r]);
      if (!h) {
        return Status(h.status().code(),
                      fmt::format("connect: handle {}: {}", r, h.status().message()));
      }
      if (Status s = check_peer(mine, *h, r); !s) {
        return Status(s.code(), "connect: " + s.message());
      }
      if (r == config.rank && !(*h == mine)) {
        return Status(ErrorCode::kInvalidArgument,
                      fmt::format("connect: handle {} is not this rank's own handle()", r));
      }
      peers.push_back(*h);
    }
    DeviceScope scope(device);
    if (scope.status() != cudaSuccess) return cuda_error("cudaSetDevice", scope.status());
    opened.assign(handles.size(), nullptr);
    for (int r = 0; r < config.world_size; ++r) {
      if (r == config.rank || on_other_nodes(config.rank, r, per_node)) continue;
      cudaIpcMemHandle_t ipc{};
      std::memcpy(&ipc, peers[r].ipc.data(), sizeof(ipc));
      void* p = nullptr;
      if (cudaError_t err = cudaIpcOpenMemHandle(&p, ipc, cudaIpcMemLazyEnablePeerAccess);
          err != cudaSuccess) {
        cudaGetLastError();
        return Status(ErrorCode::kRemoteAccess,
                      fmt::format("connect: cannot map rank {}'s buffer on GPU {} "
                                  "(cudaIpcOpenMemHandle: {}: {}); its GPU must be on this host "
                                  "and reachable by peer access (NVLink or PCIe)",
                                  r, device, cudaGetErrorName(err), cudaGetErrorString(err)));
      }
      opened[r] = p;
    }
    if (proxy) {
      std::vector<Bytes> proxies;
      for (const PeerHandle& h : peers) proxies.push_back(h.proxy);
      if (Status s = proxy->connect(proxies); !s) {
        return Status(s.code(), "connect: the inter-node proxy: " + s.message());
      }
    }
    route_peers(params, config, layout, proxy_layout, memory());
    connected = true;
    return Status::ok();
  }

  // Where the kernels find this rank's memory and, once connected, its peers' buffers.
  KernelMemory memory() const {
    KernelMemory m{.buffer = buffer,
                   .scratch = scratch,
                   .report = report_device,
                   .proxy_control = proxy_control_device,
                   .proxy_data = proxy_data_device,
                   .peers = {}};
    for (void* p : opened) m.peers.push_back(static_cast<uint8_t*>(p));
    return m;
  }

  Status check() const {
    const auto* r = static_cast<const volatile device::ErrorReport*>(report);
    // The proxy's failure first: a kernel's timeout that follows it is its consequence.
    if (proxy) {
      if (Status s = proxy->status(); !s) {
        return Status(s.code(), fmt::format("rank {}: {}; this all-to-all cannot be used again",
                                            config.rank, s.message()));
      }
    }
    device::ErrorReport seen{};
    seen.kind = r->kind;
    if (seen.kind == device::kNoError) return Status::ok();
    std::atomic_thread_fence(std::memory_order_acquire);
    seen.half = r->half;
    seen.peer = r->peer;
    seen.round = r->round;
    seen.seen = r->seen;
    seen.detail = r->detail;
    return gpu_failure(seen, config);
  }

  // Common checks of a half: connected, in order, no recorded failure.
  Status ready(const char* half, Phase before, Phase before_too) const {
    if (!connected) {
      return Status(ErrorCode::kInvalidArgument, fmt::format("{}: connect() first", half));
    }
    if (phase != before && phase != before_too) {
      static constexpr const char* kAfter[] = {"combine_recv (or at the start)", "dispatch_send",
                                               "dispatch_recv", "combine_send"};
      return Status(ErrorCode::kInvalidArgument,
                    fmt::format("{} called out of order: the last half was {}", half,
                                kAfter[static_cast<int>(phase)]));
    }
    return check();
  }

  Status launched(const char* half, cudaError_t err) const {
    if (err != cudaSuccess) return cuda_error(fmt::format("{} launch", half), err);
    return Status::ok();
  }
};

Result<std::unique_ptr<AllToAll>> AllToAll::create(const AllToAllConfig& config) {
  auto layout = Layout::of(config);
  if (!layout) return layout.status();
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  impl->layout = *layout;
  if (Status s = impl->create(); !s) return s;
  return std::unique_ptr<AllToAll>(new AllToAll(std::move(impl)));
}

AllToAll::AllToAll(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
AllToAll::~AllToAll() = default;

const AllToAllConfig& AllToAll::config() const {
  return impl_->config;
}

const Layout& AllToAll::layout() const {
  return impl_->layout;
}

Bytes AllToAll::handle() const {
  return encode(impl_->mine);
}

Status AllToAll::connect(const std::vector<Bytes>& handles) {
  return impl_->connect(handles);
}

Status AllToAll::dispatch_send(const DispatchSendArgs& a, void* cuda_stream) {
  using Phase = Impl::Phase;
  if (Status s = impl_->ready("dispatch_send", Phase::kIdle, Phase::kDispatchReceived); !s) {
    return s;
  }
  if (Status s = check_dispatch_send(impl_->config, a); !s) return s;
  DeviceScope scope(impl_->device);
  Status s = impl_->launched(
      "dispatch_send",
      device::launch_dispatch_send(impl_->params, a.tokens, a.scales, a.topk_idx, a.topk_weights,
                                   a.num_tokens, static_cast<cudaStream_t>(cuda_stream)));
  if (s) {
    impl_->phase = Phase::kDispatchSent;
    impl_->dispatched_tokens = a.num_tokens;
  }
  return s;
}

Status AllToAll::dispatch_recv(const DispatchRecvArgs& a, void* cuda_stream) {
  using Phase = Impl::Phase;
  if (Status s = impl_->ready("dispatch_recv", Phase::kDispatchSent, Phase::kDispatchSent); !s) {
    return s;
  }
  if (Status s = check_dispatch_recv(impl_->config, a); !s) return s;
  DeviceScope scope(impl_->device);
  Status s = impl_->launched(
      "dispatch_recv",
      device::launch_dispatch_recv(impl_->params, a.out_tokens, a.out_scales, a.out_weights,
                                   a.out_source, a.expert_counts, a.expert_offsets,
                                   static_cast<cudaStream_t>(cuda_stream)));
  if (s) impl_->phase = Phase::kDispatchReceived;
  return s;
}

Status AllToAll::combine_send(const CombineSendArgs& a, void* cuda_stream) {
  using Phase = Impl::Phase;
  if (Status s = impl_->ready("combine_send", Phase::kDispatchReceived, Phase::kDispatchReceived);
      !s) {
    return s;
  }
  if (Status s = check_combine_send(impl_->config, a); !s) return s;
  DeviceScope scope(impl_->device);
  Status s = impl_->launched("combine_send",
                             device::launch_combine_send(impl_->params, a.expert_out,
                                                         static_cast<cudaStream_t>(cuda_stream)));
  if (s) impl_->phase = Phase::kCombineSent;
  return s;
}

Status AllToAll::combine_recv(const CombineRecvArgs& a, void* cuda_stream) {
  using Phase = Impl::Phase;
  if (Status s = impl_->ready("combine_recv", Phase::kCombineSent, Phase::kCombineSent); !s) {
    return s;
  }
  if (Status s = check_combine_recv(impl_->config, a); !s) return s;
  if (a.num_tokens != impl_->dispatched_tokens) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("combine_recv: num_tokens {} differs from the dispatch's {}",
                              a.num_tokens, impl_->dispatched_tokens));
  }
  DeviceScope scope(impl_->device);
  Status s = impl_->launched(
      "combine_recv",
      device::launch_combine_recv(impl_->params, a.topk_idx, a.topk_weights, a.num_tokens, a.out,
                                  static_cast<cudaStream_t>(cuda_stream)));
  if (s) impl_->phase = Phase::kIdle;
  return s;
}

Status AllToAll::check() const {
  return impl_->check();
}

ProxyStats AllToAll::proxy_stats() const {
  return impl_->proxy ? impl_->proxy->stats() : ProxyStats{};
}

std::string AllToAll::proxy_memory() const {
  if (!impl_->proxy) return "none";
  return impl_->proxy_data_on_gpu ? "gpu" : "host";
}

}  // namespace fabric::ep
