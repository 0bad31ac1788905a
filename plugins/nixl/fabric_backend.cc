// FABRIC backend, control path: options, the engine, registrations, metadata and connection
// info. The data path (requests, notifications) is in fabric_xfer.cc.
#include "fabric_backend.h"

#include <sched.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "common/nixl_log.h"
#include "metrics_server.h"
#include "status_map.h"

namespace fabric::nixl_backend {
namespace {

std::span<const std::byte> as_bytes(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

std::string as_string(const Bytes& b) {
  return {reinterpret_cast<const char*>(b.data()), b.size()};
}

Result<uint64_t> parse_uint(const std::string& key, const std::string& value) {
  uint64_t v = 0;
  auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  if (ec != std::errc() || end != value.data() + value.size()) {
    return Status(ErrorCode::kInvalidArgument,
                  "parameter " + key + "=\"" + value + "\" is not a non-negative integer");
  }
  return v;
}

size_t cpus_allowed() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return Config::kAutoSpinMinCpus;
  return static_cast<size_t>(CPU_COUNT(&set));
}

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find(',', start);
    if (end == std::string::npos) end = s.size();
    if (end > start) out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

}  // namespace

nixl_b_params_t BackendOptions::defaults() {
  // Empty values keep the engine's default, or its FABRIC_* environment (Config's
  // apply_env_overrides: FABRIC_PROVIDER, FABRIC_NICS, ...).
  return {
      {"provider", ""},         // tcp, shm, verbs, efa, ...
      {"nics", ""},             // comma-separated NICs of the one device group
      {"progress", "worker"},   // worker: the engine's threads; caller: checkXfer/getNotifs
      {"peer_timeout_ms", ""},  // a silent peer fails its transfers after this long
      {"metrics_port", ""},     // serve the engine's Prometheus metrics on this TCP port
  };
}

Result<BackendOptions> BackendOptions::parse(const nixl_b_params_t& params) {
  BackendOptions o;
  // NIXL's callers poll checkXfer and getNotifs in loops of their own. On a host with few
  // CPUs a worker that spins after its work keeps the CPU from the very thread that polls for
  // it (on 2 CPUs, nixlbench's 64 KiB writes took 430 us in postXfer with the engine's 200 us
  // spin and 4 us without): there the worker sleeps at once, as the callback thread already
  // does (Config::callback_spin). FABRIC_SPIN_US and FABRIC_INFLIGHT_SPIN_US still override.
  if (cpus_allowed() < Config::kAutoSpinMinCpus) {
    o.config.spin_time = std::chrono::microseconds(0);
    o.config.inflight_spin = std::chrono::microseconds(0);
  }
  if (Status s = o.config.apply_env_overrides(); !s) return s;
  // vLLM's and SGLang's agents pass no parameters: one left empty may come from the
  // environment as FABRIC_NIXL_<NAME> (FABRIC_NIXL_METRICS_PORT, FABRIC_NIXL_PROGRESS, ...).
  nixl_b_params_t given = params;
  for (const auto& [key, unused] : defaults()) {
    if (auto it = given.find(key); it != given.end() && !it->second.empty()) continue;
    std::string var = "FABRIC_NIXL_" + key;
    std::transform(var.begin(), var.end(), var.begin(),
                   [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
    if (const char* value = std::getenv(var.c_str()); value != nullptr && *value != '\0') {
      given[key] = value;
    }
  }
  for (const auto& [key, value] : given) {
    if (value.empty()) continue;
    if (key == "provider") {
      o.config.provider = value;
    } else if (key == "nics") {
      o.config.groups.at(0).nics = split_commas(value);
    } else if (key == "progress") {
      if (value == "worker") {
        o.progress = Progress::kWorker;
      } else if (value == "caller") {
        o.progress = Progress::kCaller;
      } else {
        return Status(ErrorCode::kInvalidArgument,
                      "parameter progress=\"" + value + "\": expected worker or caller");
      }
    } else if (key == "peer_timeout_ms") {
      auto ms = parse_uint(key, value);
      if (!ms) return ms.status();
      o.config.peer_timeout = std::chrono::milliseconds(*ms);
    } else if (key == "metrics_port") {
      auto port = parse_uint(key, value);
      if (!port) return port.status();
      if (*port > 65535) {
        return Status(ErrorCode::kInvalidArgument,
                      "parameter metrics_port=" + value + " is not a TCP port");
      }
      o.metrics_port = static_cast<int>(*port);
    } else {
      // NIXL's own tests and tools pass parameters meant for other backends (engine_config,
      // num_threads): they are not errors.
      NIXL_DEBUG << "FABRIC: ignoring parameter " << key << "=" << value;
    }
  }
  o.config.groups.at(0).caller_progress = o.progress == Progress::kCaller;
  return o;
}

FabricBackend::FabricBackend(const nixlBackendInitParams* init_params)
    : nixlBackendEngine(init_params) {
  auto options = BackendOptions::parse(getCustomParams());
  if (!options) {
    NIXL_ERROR << "FABRIC: " << options.status().to_string();
    initErr = true;
    return;
  }
  options_ = std::move(*options);
  auto engine = TransferEngine::create(options_.config);
  if (!engine) {
    NIXL_ERROR << "FABRIC: cannot open the engine: " << engine.status().to_string();
    initErr = true;
    return;
  }
  engine_ = std::move(*engine);
  Status s = engine_->set_receive_handler(
      [this](std::span<const std::byte> message) { on_message(message); },
      options_.config.max_message_bytes);
  if (!s) {
    NIXL_ERROR << "FABRIC: cannot post receive buffers: " << s.to_string();
    initErr = true;
    return;
  }
  if (options_.metrics_port >= 0) {
    auto server = MetricsServer::start(*engine_, localAgent, options_.metrics_port);
    if (!server) {
      NIXL_ERROR << "FABRIC: " << server.status().to_string();
      initErr = true;
      return;
    }
    metrics_ = std::move(*server);
  }
  NIXL_INFO << "FABRIC: agent " << localAgent << " on " << engine_->group_info().provider << " ("
            << engine_->group_info().nics.size() << " NICs, "
            << (options_.progress == Progress::kCaller ? "caller-driven" : "worker threads") << ")";
}

// The metrics server reads the engine: it stops first. close() runs every pending callback
// (they may still send notifications), after which nothing touches this object.
FabricBackend::~FabricBackend() {
  metrics_.reset();
  if (engine_) engine_->close();
}

void FabricBackend::drive() const {
  if (options_.progress == Progress::kCaller) engine_->progress(0);
}

// --- memory ------------------------------------------------------------------------------------

nixl_status_t FabricBackend::registerMem(const nixlBlobDesc& mem, const nixl_mem_t& nixl_mem,
                                         nixlBackendMD*& out) {
  if (nixl_mem != DRAM_SEG && nixl_mem != VRAM_SEG) {
    NIXL_ERROR << "FABRIC: memory type " << nixl_mem << " is not DRAM or VRAM";
    return NIXL_ERR_NOT_SUPPORTED;
  }
  void* ptr = reinterpret_cast<void*>(mem.addr);
  RegisterOptions opts;
  opts.remote_read = true;  // NIXL peers may READ any registration
  auto reg = engine_->register_memory(ptr, mem.len, opts);
  if (!reg && reg.status().code() == ErrorCode::kUnsupported && nixl_mem == VRAM_SEG) {
    // GPU memory the NICs reach only through a host mirror cannot be read by peers yet
    // (docs/reads.md): register it for writes, and let a READ of it fail with a clear error.
    NIXL_WARN << "FABRIC: VRAM at 0x" << std::hex << mem.addr << std::dec
              << " registered without remote reads: " << reg.status().message();
    opts.remote_read = false;
    reg = engine_->register_memory(ptr, mem.len, opts);
  }
  if (!reg) {
    NIXL_ERROR << "FABRIC: registering " << mem.len << " bytes at 0x" << std::hex << mem.addr
               << std::dec << ": " << reg.status().to_string();
    return to_nixl(reg.status());
  }
  auto region = std::make_unique<LocalRegion>();
  region->handle = reg->handle;
  region->base = mem.addr;
  region->length = mem.len;
  region->mem = nixl_mem;
  region->descriptor = reg->descriptor;
  out = region.release();
  return NIXL_SUCCESS;
}

nixl_status_t FabricBackend::deregisterMem(nixlBackendMD* meta) {
  auto* region = dynamic_cast<LocalRegion*>(meta);
  if (region == nullptr) {
    NIXL_ERROR << "FABRIC: deregisterMem of metadata that is not a FABRIC registration";
    return NIXL_ERR_INVALID_PARAM;
  }
  // A barrier: transfers reading the region finish first, and no peer writes land after.
  Status s = engine_->unregister_memory(region->handle);
  delete region;
  if (!s) {
    NIXL_ERROR << "FABRIC: unregistering: " << s.to_string();
    return to_nixl(s);
  }
  return NIXL_SUCCESS;
}

// --- metadata and connection info ---------------------------------------------------------------

nixl_status_t FabricBackend::getPublicData(const nixlBackendMD* meta, std::string& str) const {
  const auto* region = dynamic_cast<const LocalRegion*>(meta);
  if (region == nullptr) {
    NIXL_ERROR << "FABRIC: getPublicData of metadata that is not a FABRIC registration";
    return NIXL_ERR_INVALID_PARAM;
  }
  str = as_string(region->descriptor.encode());
  return NIXL_SUCCESS;
}

nixl_status_t FabricBackend::getConnInfo(std::string& str) const {
  str = as_string(engine_->address().encode());
  return NIXL_SUCCESS;
}

nixl_status_t FabricBackend::loadRemoteConnInfo(const std::string& remote_agent,
                                                const std::string& remote_conn_info) {
  auto address = Address::decode(as_bytes(remote_conn_info));
  if (!address) {
    NIXL_ERROR << "FABRIC: connection info of agent " << remote_agent
               << " is not a FABRIC address: " << address.status().to_string();
    return NIXL_ERR_MISMATCH;
  }
  if (address->provider() != engine_->address().provider()) {
    NIXL_ERROR << "FABRIC: agent " << remote_agent << " runs provider " << address->provider()
               << ", this agent " << engine_->address().provider();
    return NIXL_ERR_MISMATCH;
  }
  std::unique_lock lock(mu_);
  peers_[remote_agent] = std::move(*address);
  return NIXL_SUCCESS;
}

Result<Address> FabricBackend::peer_address(const std::string& agent) const {
  if (agent == localAgent) return engine_->address();
  std::shared_lock lock(mu_);
  auto it = peers_.find(agent);
  if (it == peers_.end()) {
    return Status(ErrorCode::kNotFound, "no connection info loaded for agent " + agent);
  }
  return it->second;
}

nixl_status_t FabricBackend::connect(const std::string& remote_agent) {
  // The engine connects on first use; this only checks that the agent is known.
  auto peer = peer_address(remote_agent);
  if (!peer) {
    NIXL_ERROR << "FABRIC: connect: " << peer.status().message();
    return to_nixl(peer.status());
  }
  return NIXL_SUCCESS;
}

nixl_status_t FabricBackend::disconnect(const std::string& remote_agent) {
  std::unique_lock lock(mu_);
  peers_.erase(remote_agent);
  return NIXL_SUCCESS;
}

nixl_status_t FabricBackend::loadRemoteMD(const nixlBlobDesc& input, const nixl_mem_t& nixl_mem,
                                          const std::string& remote_agent, nixlBackendMD*& output) {
  if (nixl_mem != DRAM_SEG && nixl_mem != VRAM_SEG) return NIXL_ERR_NOT_SUPPORTED;
  auto peer = peer_address(remote_agent);
  if (!peer) {
    NIXL_ERROR << "FABRIC: loadRemoteMD: " << peer.status().message();
    return to_nixl(peer.status());
  }
  auto memory = RemoteMemory::decode(as_bytes(input.metaInfo));
  if (!memory) {
    NIXL_ERROR << "FABRIC: metadata from agent " << remote_agent
               << " is not a FABRIC descriptor: " << memory.status().to_string();
    return NIXL_ERR_MISMATCH;
  }
  if (!(memory->owner() == *peer)) {
    NIXL_ERROR << "FABRIC: a descriptor loaded for agent " << remote_agent
               << " belongs to another engine (" << memory->owner().short_name() << ", agent is "
               << peer->short_name() << ")";
    return NIXL_ERR_MISMATCH;
  }
  if (memory->base() != input.addr || memory->length() < input.len) {
    NIXL_ERROR << "FABRIC: agent " << remote_agent << " describes 0x" << std::hex << input.addr
               << std::dec << "+" << input.len << " with a descriptor of 0x" << std::hex
               << memory->base() << std::dec << "+" << memory->length();
    return NIXL_ERR_MISMATCH;
  }
  auto region = std::make_unique<RemoteRegion>();
  region->agent = remote_agent;
  region->memory = std::move(*memory);
  region->base = input.addr;
  output = region.release();
  return NIXL_SUCCESS;
}

nixl_status_t FabricBackend::loadLocalMD(nixlBackendMD* input, nixlBackendMD*& output) {
  auto* local = dynamic_cast<LocalRegion*>(input);
  if (local == nullptr) {
    NIXL_ERROR << "FABRIC: loadLocalMD of metadata that is not a FABRIC registration";
    return NIXL_ERR_INVALID_PARAM;
  }
  auto region = std::make_unique<RemoteRegion>();
  region->agent = localAgent;
  region->memory = local->descriptor;
  region->base = local->base;
  output = region.release();
  return NIXL_SUCCESS;
}

nixl_status_t FabricBackend::unloadMD(nixlBackendMD* input) {
  auto* region = dynamic_cast<RemoteRegion*>(input);
  if (region == nullptr) {
    NIXL_ERROR << "FABRIC: unloadMD of metadata that is not a loaded FABRIC descriptor";
    return NIXL_ERR_INVALID_PARAM;
  }
  delete region;
  return NIXL_SUCCESS;
}

}  // namespace fabric::nixl_backend
