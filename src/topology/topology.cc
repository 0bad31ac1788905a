#include "topology/topology.h"

#include <fmt/format.h>
#include <hwloc.h>
#include <pthread.h>
#include <sched.h>

#include <cstring>
#include <memory>

namespace fabric::topology {

namespace {

struct TopologyDeleter {
  void operator()(hwloc_topology_t t) const noexcept { hwloc_topology_destroy(t); }
};
using Topology = std::unique_ptr<hwloc_topology, TopologyDeleter>;

Topology load() {
  hwloc_topology_t t = nullptr;
  if (hwloc_topology_init(&t) != 0) return nullptr;
  hwloc_topology_set_io_types_filter(t, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
  if (hwloc_topology_load(t) != 0) {
    hwloc_topology_destroy(t);
    return nullptr;
  }
  return Topology(t);
}

std::vector<int> cpus_of(hwloc_const_cpuset_t set) {
  std::vector<int> out;
  for (int i = hwloc_bitmap_first(set); i >= 0; i = hwloc_bitmap_next(set, i)) out.push_back(i);
  return out;
}

std::string pci_address(hwloc_obj_t pci) {
  return fmt::format("{:04x}:{:02x}:{:02x}.{:x}", pci->attr->pcidev.domain, pci->attr->pcidev.bus,
                     pci->attr->pcidev.dev, pci->attr->pcidev.func);
}

// The NUMA node and CPUs of the first non-I/O ancestor of an I/O object.
void locate(hwloc_topology_t t, hwloc_obj_t io, int& numa_node, std::vector<int>& cpus) {
  hwloc_obj_t local = hwloc_get_non_io_ancestor_obj(t, io);
  if (local != nullptr && local->cpuset != nullptr) cpus = cpus_of(local->cpuset);
  if (local != nullptr && local->nodeset != nullptr &&
      hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_NUMANODE) > 1) {
    numa_node = hwloc_bitmap_first(local->nodeset);
  }
}

NicPlacement describe(hwloc_topology_t t, hwloc_obj_t osdev) {
  NicPlacement p;
  p.name = osdev->name ? osdev->name : "";
  hwloc_obj_t pci = osdev->parent;
  if (pci != nullptr && pci->type == HWLOC_OBJ_PCI_DEVICE) {
    p.pci = pci_address(pci);
    locate(t, osdev, p.numa_node, p.cpus);
  }
  return p;
}

// The nearest object above both (hwloc's helper compares depths, which I/O objects lack).
hwloc_obj_t common_ancestor(hwloc_obj_t a, hwloc_obj_t b) {
  for (hwloc_obj_t x = a; x != nullptr; x = x->parent) {
    for (hwloc_obj_t y = b; y != nullptr; y = y->parent) {
      if (x == y) return x;
    }
  }
  return nullptr;
}

bool is_nic(hwloc_obj_t o) {
  return o->attr->osdev.type == HWLOC_OBJ_OSDEV_NETWORK ||
         o->attr->osdev.type == HWLOC_OBJ_OSDEV_OPENFABRICS;
}

}  // namespace

std::vector<NicPlacement> list_nics() {
  std::vector<NicPlacement> out;
  Topology t = load();
  if (!t) return out;
  for (hwloc_obj_t o = hwloc_get_next_osdev(t.get(), nullptr); o != nullptr;
       o = hwloc_get_next_osdev(t.get(), o)) {
    if (is_nic(o)) out.push_back(describe(t.get(), o));
  }
  return out;
}

std::vector<GpuPlacement> list_gpus() {
  std::vector<GpuPlacement> out;
  Topology t = load();
  if (!t) return out;
  for (hwloc_obj_t g = hwloc_get_next_pcidev(t.get(), nullptr); g != nullptr;
       g = hwloc_get_next_pcidev(t.get(), g)) {
    if ((g->attr->pcidev.class_id >> 8) != 0x03) continue;  // PCI class 03: display controllers
    GpuPlacement p;
    p.pci = pci_address(g);
    p.vendor_id = g->attr->pcidev.vendor_id;
    locate(t.get(), g, p.numa_node, p.cpus);
    std::vector<std::string> same_switch, same_numa;
    for (hwloc_obj_t o = hwloc_get_next_osdev(t.get(), nullptr); o != nullptr;
         o = hwloc_get_next_osdev(t.get(), o)) {
      if (!is_nic(o) || o->parent == nullptr || o->parent->type != HWLOC_OBJ_PCI_DEVICE) continue;
      hwloc_obj_t common = common_ancestor(g, o->parent);
      if (common != nullptr && common->type == HWLOC_OBJ_BRIDGE &&
          common->attr->bridge.upstream_type == HWLOC_OBJ_BRIDGE_PCI) {
        same_switch.push_back(o->name ? o->name : "");
        continue;
      }
      int numa = -1;
      std::vector<int> cpus;
      locate(t.get(), o, numa, cpus);
      if (numa >= 0 && numa == p.numa_node) same_numa.push_back(o->name ? o->name : "");
    }
    if (!same_switch.empty()) {
      p.near_nics = std::move(same_switch);
      p.nearness = "pci-switch";
    } else if (!same_numa.empty()) {
      p.near_nics = std::move(same_numa);
      p.nearness = "numa-node";
    }
    out.push_back(std::move(p));
  }
  return out;
}

NicPlacement find_nic(const std::string& name) {
  for (auto& p : list_nics()) {
    if (p.name == name) return p;
  }
  return NicPlacement{name, "", -1, {}};
}

std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> out;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return out;
  for (int i = 0; i < CPU_SETSIZE; ++i) {
    if (CPU_ISSET(i, &set)) out.push_back(i);
  }
  return out;
}

Status pin_current_thread(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  int rc = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  if (rc != 0) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("cannot pin the worker to CPU {}: {}", cpu, std::strerror(rc)));
  }
  return Status::ok();
}

}  // namespace fabric::topology
