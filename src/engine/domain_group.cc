#include "engine/domain_group.h"

#include <fmt/format.h>

#include <algorithm>
#include <string>

#include "common/log.h"
#include "cuda/device_memory.h"
#include "engine/ipc_select.h"
#include "topology/topology.h"
#include "transport/fault/fault_domain.h"
#include "transport/open_domain.h"

namespace fabric::engine {

namespace {

// Opens every NIC of group `g`, asking for GPU memory registration or not.
Status open_nics(const Config& config, uint32_t g, bool gpu_direct, DomainGroup& out) {
  const GroupConfig& gc = config.groups[g];
  const std::vector<std::string> nics = gc.nics.empty() ? std::vector<std::string>{""} : gc.nics;
  out.domains.clear();
  out.info = GroupInfo{};
  out.direct = false;
  for (size_t i = 0; i < nics.size(); ++i) {
    auto d = transport::open_domain(
        {config.provider, config.verbs, gpu_direct, config.shm_copy_threads}, nics[i]);
    if (!d) {
      return Status(d.status().code(),
                    fmt::format("group {} NIC {}: {}", g, i, d.status().message()));
    }
    const transport::DomainInfo& di = (*d)->info();
    out.info.nics.push_back(di.name);
    if (out.info.provider.empty()) out.info.provider = di.provider;
    out.info.delivery_complete = (i == 0 || out.info.delivery_complete) && di.delivery_complete;
    out.direct = (i == 0 || out.direct) && di.hmem;
    out.domains.push_back(std::move(*d));
  }
  return Status::ok();
}

// Why the group's NICs cannot register CUDA memory although they claim to, or "" when they can.
std::string cuda_registration_problem(const DomainGroup& group) {
  auto probe = cuda::cuda_device_alloc(4096);
  if (!probe) return probe.status().message();
  std::string why;
  for (const auto& d : group.domains) {
    auto reg = d->register_memory(*probe, 4096, false);
    if (!reg) {
      why = fmt::format("'{}': {}", d->info().name, reg.status().message());
      break;
    }
  }
  cuda::cuda_device_free(*probe);
  return why;
}

}  // namespace

Result<DomainGroup> open_domain_group(const Config& config, uint32_t g,
                                      const std::vector<int>& allowed_cpus) {
  DomainGroup out;
  if (Status s = open_nics(config, g, config.gpu_direct, out); !s) return s;
  out.info.cuda = cuda::cuda_available();
  // A provider may claim FI_HMEM yet be unable to register CUDA memory (a libfabric built
  // without working CUDA support): register a small device buffer once to find out, and if
  // it cannot, reopen the NICs without FI_HMEM (which costs host transfers a memory-type
  // check per operation on some providers).
  if (out.direct && out.info.cuda) {
    if (std::string why = cuda_registration_problem(out); !why.empty()) {
      detail::log().info(
          "group {}: the provider advertises FI_HMEM but cannot register CUDA memory ({}); "
          "staging GPU memory instead",
          g, why);
      if (Status s = open_nics(config, g, false, out); !s) return s;
      out.info.cuda = true;
      out.direct = false;
    }
  }
  if (config.faults.enabled) {
    for (size_t i = 0; i < out.domains.size(); ++i) {
      out.domains[i] = std::make_unique<transport::FaultDomain>(std::move(out.domains[i]),
                                                                config.faults, g * 64 + i);
    }
  }
  const GroupConfig& gc = config.groups[g];
  if (gc.cpu >= 0) {
    out.cpu = gc.cpu;
  } else if (gc.cpu == GroupConfig::kCpuAuto) {
    topology::NicPlacement p = topology::find_nic(out.info.nics[0]);
    if (p.numa_node >= 0 && !p.cpus.empty()) out.cpu = p.cpus[g % p.cpus.size()];
  }
  if (out.cpu >= 0 &&
      std::find(allowed_cpus.begin(), allowed_cpus.end(), out.cpu) == allowed_cpus.end()) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("group {}: CPU {} is not available to this process", g, out.cpu));
  }
  out.info.cpu = out.cpu;
  out.info.gpu_memory = out.direct ? "direct (FI_HMEM)" : "staged";
  out.info.cuda_ipc = cuda_ipc_mode_name(config.cuda_ipc);
  return out;
}

}  // namespace fabric::engine
