// Topology: which CPUs sit next to which NIC, and pinning threads to them (hwloc).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fabric/status.h"

namespace fabric::topology {

struct NicPlacement {
  std::string name;       // interface or device name, e.g. "eth0", "rdmap0s6"
  std::string pci;        // PCI bus id, empty for virtual interfaces
  int numa_node = -1;     // -1: unknown (virtual interface, or single-node machine)
  std::vector<int> cpus;  // CPUs local to the NIC; empty when unknown
};

struct GpuPlacement {
  std::string pci;                     // PCI bus id
  uint16_t vendor_id = 0;              // PCI vendor id
  int numa_node = -1;                  // -1: unknown (or single-node machine)
  std::vector<int> cpus;               // CPUs local to the GPU
  std::vector<std::string> near_nics;  // behind the same PCI switch, else on the same NUMA node
  std::string nearness;                // "pci-switch", "numa-node", or "" when near_nics is empty
};

// The NICs hwloc sees (network and OpenFabrics OS devices) with their locality.
std::vector<NicPlacement> list_nics();
// The GPUs hwloc sees (PCI display and 3D controllers) and the NICs near each.
std::vector<GpuPlacement> list_gpus();
// The placement of one NIC by interface or device name; numa_node -1 when unknown.
NicPlacement find_nic(const std::string& name);
// The CPUs this process may run on.
std::vector<int> allowed_cpus();
// Pins the calling thread to one CPU.
Status pin_current_thread(int cpu);

}  // namespace fabric::topology
