// Discovery: what fabric-lib can use on this machine. The providers and the NICs each offers,
// the RDMA ports of the verbs backend, where each NIC sits (PCI address, NUMA node, local
// CPUs), the GPUs and the NICs near them, and what each path (a provider on a NIC) can do.
//
// fabric-info, fabric_lib.info() in Python and fabric-bench all report through these calls
// (and the same to_json / to_text), so they cannot disagree. Nothing here needs an engine
// except probe_engine(), which opens one and closes it again.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fabric/engine.h"
#include "fabric/status.h"

namespace fabric {

// One libfabric domain a provider offers with what the engine needs (reliable datagrams, RMA
// writes, remote CQ data): a NIC on one fabric (address family).
struct ProviderDomain {
  std::string nic;       // the domain name, as GroupConfig::nics takes it ("lo", "eth0")
  std::string fabric;    // the fabric name ("127.0.0.1/32")
  std::string provider;  // the provider stack ("tcp;ofi_rxm")
  bool ipv4 = false;     // the domain's addresses are IPv4
};

// A provider the engine is built and tested for: "tcp", "shm", "efa" (libfabric) or "verbs".
// For "verbs", domains lists what libfabric's verbs provider offers; the engine's own verbs
// backend uses the ports of MachineInfo::verbs_ports.
struct ProviderReport {
  std::string name;
  std::vector<ProviderDomain> domains;  // empty: the provider is absent here
  bool present() const { return !domains.empty(); }
};

// One port of an RDMA device, as the verbs backend (Config::provider "verbs") sees it.
struct VerbsPort {
  std::string device;  // "rxe0", "mlx5_0"
  int port = 0;
  std::string state;  // "active", "down", ...
  bool active = false;
  std::string link_layer;   // "Ethernet" (RoCE) or "InfiniBand"
  uint32_t active_mtu = 0;  // bytes
  int gid_index = -1;       // the GID the backend would use (-1: none usable)
  std::string gid;          // that GID, in the usual colon form
  std::string netdev;       // the network interface of a RoCE port
};

// A NIC as hwloc sees it (a network interface or an RDMA device) and where it sits.
struct NicInfo {
  std::string name;       // interface or device name: "eth0", "mlx5_0", "rdmap0s6"
  std::string pci;        // PCI address "0000:3b:00.0"; empty for virtual interfaces
  int numa_node = -1;     // -1: unknown (virtual interface, or a machine with one node)
  std::vector<int> cpus;  // the CPUs local to the NIC; empty when unknown
};

// A GPU (a PCI display or 3D controller) and the NICs near it.
struct GpuInfo {
  std::string pci;        // PCI address
  std::string vendor;     // "nvidia", "amd", "intel" or the PCI vendor id in hex
  int numa_node = -1;     // -1: unknown or a machine with one node
  std::vector<int> cpus;  // the CPUs local to the GPU
  // The NICs near the GPU, nearest first: those behind the same PCI switch, then those on the
  // same NUMA node. Empty when no NIC is near.
  std::vector<std::string> near_nics;
  // How near near_nics are: "pci-switch", "numa-node" or "" when near_nics is empty.
  std::string nearness;
};

// A path: one provider on one NIC, and what the engine can do over it.
struct PathInfo {
  std::string provider;   // the Config::provider value: "tcp", "shm", "efa", "verbs"
  std::string nic;        // the GroupConfig::nics value
  std::string stack;      // the provider stack ("tcp;ofi_rxm"), "verbs" for the verbs backend
  std::string placement;  // the hwloc NIC the path runs on ("" when none, e.g. shm)
  bool usable = false;    // it can be opened (a verbs port is active and has a GID)
  // What the engine does over a usable path. Every path offers writes with immediates and
  // messages (the listing keeps only those); GPU memory is staged through host mirrors unless
  // the path registers it itself, which an engine finds out when it opens
  // (GroupInfo::gpu_memory, probe_engine()).
  bool writes = false;
  bool immediates = false;
  bool messages = false;
};

// Everything discover() finds.
struct MachineInfo {
  std::string libfabric_version;          // "1.17"
  std::string auto_provider;              // what Config::provider "auto" stands for here
  std::vector<ProviderReport> providers;  // tcp, shm, efa, verbs, in that order
  bool verbs_built = false;               // this build has the verbs backend
  std::vector<VerbsPort> verbs_ports;
  std::vector<NicInfo> nics;
  std::vector<GpuInfo> gpus;
  std::vector<PathInfo> paths;
  std::vector<int> allowed_cpus;  // the CPUs this process may run on
  bool cuda_built = false;        // built with CUDA
  bool cuda_device = false;       // and a CUDA device is present
};

// Looks at the machine: libfabric's providers, the verbs devices, hwloc's topology. Blocking
// (tens of milliseconds); never fails (what cannot be found is absent).
MachineInfo discover();

// What probe_engine() opens. Unset fields come from the environment (FABRIC_PROVIDER,
// FABRIC_NICS, FABRIC_CPU, ... as Config::apply_env_overrides reads them), then from the
// defaults: provider tcp, NIC default_nics(provider), CPU auto.
struct EngineProbeRequest {
  std::optional<std::string> provider;
  std::optional<std::vector<std::string>> nics;
  std::optional<int> cpu;  // GroupConfig::cpu: a CPU, kCpuAuto or kCpuNone
};

// What an engine opened with one device group turned out to be.
struct EngineProbe {
  bool ok = false;
  std::string requested_provider;           // as asked for
  std::vector<std::string> requested_nics;  // as asked for (empty: the provider's first)
  GroupInfo info;                           // what opened (when ok)
  std::string address;                      // its address, short form (when ok)
  std::string address_hex;                  // its address as hex bytes (when ok)
  std::string error;                        // why it could not be opened (when not ok)
};

// Opens a TransferEngine with one group as asked, describes it and closes it. Blocking.
EngineProbe probe_engine(const EngineProbeRequest& request = {});

// The NICs the tests and tools use for a provider on a machine without RDMA NICs: {"lo"} for
// tcp, {"shm"} for shm, else empty (the provider's first NIC).
std::vector<std::string> default_nics(std::string_view provider);

// Parses a worker CPU as the tools take it: "auto", "none" or a CPU number.
// Errors: kInvalidArgument.
Result<int> parse_cpu(std::string_view text);

// The report as one JSON object (fabric-info --json): keys libfabric, auto_provider,
// providers, verbs_built, verbs, nics, gpus, paths, allowed_cpus, cuda_built, cuda_device and
// engine (null without a probe).
std::string to_json(const MachineInfo& machine, const EngineProbe* engine = nullptr);
// The report as fabric-info prints it.
std::string to_text(const MachineInfo& machine, const EngineProbe* engine = nullptr);

}  // namespace fabric
