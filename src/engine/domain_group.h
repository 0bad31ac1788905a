// Opening one device group's NICs for EngineImpl::create: each NIC's domain (asking for GPU
// memory registration, and opening again without it when the provider claims it but cannot
// register CUDA memory), the fault-injection wrapper when configured, and the worker's CPU.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "fabric/config.h"
#include "fabric/engine.h"
#include "fabric/status.h"
#include "transport/domain.h"

namespace fabric::engine {

struct DomainGroup {
  std::vector<std::unique_ptr<transport::Domain>> domains;  // rail order
  GroupInfo info;       // what TransferEngine::group_info reports
  bool direct = false;  // its NICs register CUDA memory themselves (FI_HMEM)
  int cpu = -1;         // the worker's CPU, or -1: not pinned
};

// Opens group `g` of `config`. `allowed_cpus`: the CPUs this process may run on. Errors name
// the group and the NIC.
Result<DomainGroup> open_domain_group(const Config& config, uint32_t g,
                                      const std::vector<int>& allowed_cpus);

}  // namespace fabric::engine
