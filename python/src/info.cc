// fabric_lib.info(): what fabric-info reports, as the dict of `fabric-info --json`.
//
// The public API has no discovery calls, so this uses the same internal listings as
// tools/fabric_info.cc (libfabric domains, hwloc NICs, allowed CPUs).
#include <rdma/fabric.h>

#include <cstdlib>
#include <optional>
#include <string_view>

#include "bindings.h"
#include "topology/topology.h"
#include "transport/libfabric/lf_domain.h"

namespace fabric::python {
namespace {

// The providers the engine is built and tested for, in the order fabric-info lists them.
constexpr std::string_view kKnownProviders[] = {"tcp", "shm", "efa", "verbs"};

std::vector<std::string> default_nics(const std::string& provider) {
  if (provider == "tcp") return {"lo"};
  if (provider == "shm") return {"shm"};
  return {};
}

int parse_cpu(const std::string& text) {
  if (text == "auto") return GroupConfig::kCpuAuto;
  if (text == "none") return GroupConfig::kCpuNone;
  char* end = nullptr;
  long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || v < 0 || v > 1 << 20) {
    throw StatusError{Status(ErrorCode::kInvalidArgument,
                             "info: cpu '" + text + "' is not auto, none or a CPU number")};
  }
  return static_cast<int>(v);
}

py::dict open_engine(std::optional<std::string> provider,
                     std::optional<std::vector<std::string>> nics, std::optional<std::string> cpu) {
  Config config;
  config.provider = provider.value_or("tcp");
  config.groups = {GroupConfig{}};
  config.groups[0].cpu = parse_cpu(cpu.value_or("auto"));
  py::dict e;
  e["ok"] = false;
  Status env = config.apply_env_overrides();
  if (provider) config.provider = *provider;
  if (cpu) config.groups[0].cpu = parse_cpu(*cpu);
  if (nics) {
    config.groups[0].nics = *nics;
  } else if (std::getenv("FABRIC_NICS") == nullptr) {
    config.groups[0].nics = default_nics(config.provider);
  }
  e["provider"] = config.provider;
  e["nics"] = config.groups[0].nics;
  // What was asked for (fabric-info's text header); "provider" and "nics" become what opened.
  e["requested_provider"] = config.provider;
  e["requested_nics"] = config.groups[0].nics;
  if (!env) {
    e["error"] = env.to_string();
    return e;
  }
  std::optional<GroupInfo> info;
  std::string address_short, address_hex, error;
  {
    py::gil_scoped_release nogil;
    auto created = TransferEngine::create(config);
    if (created) {
      TransferEngine& engine = **created;
      info = engine.group_info(0);
      address_short = engine.address(0).short_name();
      address_hex = engine.address(0).to_hex();
      engine.close();
    } else {
      error = created.status().to_string();
    }
  }
  if (!info) {
    e["error"] = error;
    return e;
  }
  e["ok"] = true;
  e["provider"] = info->provider;
  e["nics"] = info->nics;
  e["cpu"] = info->cpu;
  e["delivery_complete"] = info->delivery_complete;
  e["gpu_memory"] = info->gpu_memory;
  e["cuda"] = info->cuda;
  e["address"] = address_short;
  e["address_hex"] = address_hex;
  return e;
}

py::dict gather(std::optional<std::string> provider, std::optional<std::vector<std::string>> nics,
                std::optional<std::string> cpu, bool engine) {
  py::dict r;
  const uint32_t v = fi_version();
  r["libfabric"] = std::to_string(FI_MAJOR(v)) + "." + std::to_string(FI_MINOR(v));
  std::string auto_provider;
  std::vector<std::pair<std::string, std::vector<transport::DomainListing>>> listings;
  std::vector<topology::NicPlacement> placements;
  std::vector<int> cpus;
  {
    py::gil_scoped_release nogil;
    auto_provider = transport::resolve_provider("auto");
    for (std::string_view p : kKnownProviders) {
      listings.emplace_back(std::string(p), transport::list_domains(std::string(p)));
    }
    placements = topology::list_nics();
    cpus = topology::allowed_cpus();
  }
  r["auto_provider"] = auto_provider;
  py::list providers;
  for (const auto& [name, domains] : listings) {
    py::list ds;
    for (const auto& d : domains) {
      py::dict dd;
      dd["nic"] = d.domain;
      dd["fabric"] = d.fabric;
      dd["provider"] = d.provider;
      dd["ipv4"] = d.ipv4;
      ds.append(dd);
    }
    py::dict p;
    p["name"] = name;
    p["present"] = !domains.empty();
    p["domains"] = ds;
    providers.append(p);
  }
  r["providers"] = providers;
  py::list nic_list;
  for (const auto& n : placements) {
    py::dict d;
    d["name"] = n.name;
    d["pci"] = n.pci;
    d["numa_node"] = n.numa_node;
    d["cpus"] = n.cpus;
    nic_list.append(d);
  }
  r["nics"] = nic_list;
  r["allowed_cpus"] = cpus;
  r["engine"] = engine
                    ? py::object(open_engine(std::move(provider), std::move(nics), std::move(cpu)))
                    : py::object(py::none());
  return r;
}

}  // namespace

void bind_info(py::module_& m) {
  m.def("_gather_info", &gather, py::arg("provider") = py::none(), py::arg("nics") = py::none(),
        py::arg("cpu") = py::none(), py::arg("engine") = true,
        "The report of `fabric-info --json` as a dict (fabric_lib.info() wraps it).");
}

}  // namespace fabric::python
