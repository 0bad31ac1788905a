// Discovery (include/fabric/discovery.h): one place that gathers and formats what fabric-info,
// fabric_lib.info() and fabric-bench report.
#include "fabric/discovery.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <rdma/fabric.h>

#include <algorithm>
#include <cstdlib>

#include "common/json.h"
#include "cuda/device_memory.h"
#include "topology/topology.h"
#include "transport/libfabric/lf_api.h"
#include "transport/libfabric/lf_domain.h"
#include "transport/open_domain.h"
#ifdef FABRIC_WITH_VERBS
#include "transport/verbs/verbs_domain.h"
#endif

namespace fabric {

namespace {

// The providers the engine is built and tested for, in the order they are listed.
constexpr std::string_view kKnownProviders[] = {"tcp", "shm", "efa", "verbs"};

using detail::json_string;

std::string json_ints(const std::vector<int>& v) {
  return fmt::format("[{}]", fmt::join(v, ","));
}

std::string json_strings(const std::vector<std::string>& v) {
  std::vector<std::string> quoted;
  for (const auto& s : v) quoted.push_back(json_string(s));
  return fmt::format("[{}]", fmt::join(quoted, ","));
}

// "0-3,8,10-11"; "-" when empty.
std::string cpu_ranges(const std::vector<int>& cpus) {
  if (cpus.empty()) return "-";
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += j == i ? fmt::format("{}", cpus[i]) : fmt::format("{}-{}", cpus[i], cpus[j]);
    i = j + 1;
  }
  return out;
}

std::string or_dash(const std::string& s) {
  return s.empty() ? "-" : s;
}

std::string numa_text(int node) {
  return node < 0 ? "-" : std::to_string(node);
}

std::string vendor_name(uint16_t id) {
  switch (id) {
    case 0x10de:
      return "nvidia";
    case 0x1002:
      return "amd";
    case 0x8086:
      return "intel";
    default:
      return fmt::format("{:04x}", id);
  }
}

// The hwloc NIC a path runs on: the interface or device itself, an EFA domain's device (its
// name less "-rdm" / "-dgrm"), a RoCE port's interface; "" when none (shm).
std::string placement_of(const std::string& nic, const std::vector<NicInfo>& nics,
                         const std::string& alternative = "") {
  auto known = [&](const std::string& n) {
    return std::any_of(nics.begin(), nics.end(), [&](const NicInfo& i) { return i.name == n; });
  };
  if (known(nic)) return nic;
  for (std::string_view suffix : {"-rdm", "-dgrm"}) {
    if (nic.size() > suffix.size() && nic.ends_with(suffix)) {
      std::string base = nic.substr(0, nic.size() - suffix.size());
      if (known(base)) return base;
    }
  }
  if (!alternative.empty() && known(alternative)) return alternative;
  return "";
}

}  // namespace

MachineInfo discover() {
  MachineInfo m;
  if (const transport::lf::Api* lf = transport::lf::api()) {
    const uint32_t v = lf->version();
    m.libfabric_version = fmt::format("{}.{}", FI_MAJOR(v), FI_MINOR(v));
  } else {
    m.libfabric_version = "not loaded: " + transport::lf::load_error();
  }
  m.auto_provider = transport::resolve_provider("auto");
  for (std::string_view p : kKnownProviders) {
    ProviderReport r{std::string(p), {}};
    for (const auto& d : transport::list_domains(std::string(p))) {
      r.domains.push_back({d.domain, d.fabric, d.provider, d.ipv4});
    }
    m.providers.push_back(std::move(r));
  }
  m.verbs_built = transport::verbs_built();
#ifdef FABRIC_WITH_VERBS
  for (const auto& p : transport::list_verbs_ports()) {
    m.verbs_ports.push_back(VerbsPort{p.device, p.port, p.state, p.active, p.link_layer,
                                      p.active_mtu, p.gid_index, p.gid, p.netdev});
  }
#endif
  for (auto& n : topology::list_nics()) {
    m.nics.push_back({std::move(n.name), std::move(n.pci), n.numa_node, std::move(n.cpus)});
  }
  for (auto& g : topology::list_gpus()) {
    m.gpus.push_back({std::move(g.pci), vendor_name(g.vendor_id), g.numa_node, std::move(g.cpus),
                      std::move(g.near_nics), std::move(g.nearness)});
  }
  // Paths: the engine's libfabric providers on each NIC they offer (once per NIC, whatever
  // the fabrics), then the verbs backend on each port.
  for (const ProviderReport& r : m.providers) {
    if (r.name == transport::kVerbsProvider) continue;  // the engine's own backend, below
    for (const ProviderDomain& d : r.domains) {
      const bool seen = std::any_of(m.paths.begin(), m.paths.end(), [&](const PathInfo& p) {
        return p.provider == r.name && p.nic == d.nic;
      });
      if (seen) continue;
      m.paths.push_back(
          {r.name, d.nic, d.provider, placement_of(d.nic, m.nics), true, true, true, true});
    }
  }
  for (const VerbsPort& p : m.verbs_ports) {
    const bool usable = p.active && p.gid_index >= 0;
    m.paths.push_back({transport::kVerbsProvider, fmt::format("{}:{}", p.device, p.port), "verbs",
                       placement_of(p.device, m.nics, p.netdev), usable, usable, usable, usable});
  }
  m.allowed_cpus = topology::allowed_cpus();
#ifdef FABRIC_WITH_CUDA
  m.cuda_built = true;
#endif
  m.cuda_device = cuda::cuda_available();
  return m;
}

std::vector<std::string> default_nics(std::string_view provider) {
  if (provider == "tcp") return {"lo"};
  if (provider == "shm") return {"shm"};
  return {};
}

Result<int> parse_cpu(std::string_view text) {
  if (text == "auto") return GroupConfig::kCpuAuto;
  if (text == "none") return GroupConfig::kCpuNone;
  const std::string s(text);
  char* end = nullptr;
  const long v = std::strtol(s.c_str(), &end, 10);
  if (s.empty() || *end != '\0' || v < 0 || v > 1 << 20) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("cpu '{}' is not auto, none or a CPU number", text));
  }
  return static_cast<int>(v);
}

EngineProbe probe_engine(const EngineProbeRequest& request) {
  Config config;
  config.provider = "tcp";
  config.groups = {GroupConfig{}};
  EngineProbe e;
  const Status env = config.apply_env_overrides();
  if (request.provider) config.provider = *request.provider;
  if (request.cpu) config.groups[0].cpu = *request.cpu;
  if (request.nics) {
    config.groups[0].nics = *request.nics;
  } else if (std::getenv("FABRIC_NICS") == nullptr) {
    config.groups[0].nics = default_nics(config.provider);
  }
  e.requested_provider = config.provider;
  e.requested_nics = config.groups[0].nics;
  if (!env) {
    e.error = env.to_string();
    return e;
  }
  auto created = TransferEngine::create(config);
  if (!created) {
    e.error = created.status().to_string();
    return e;
  }
  TransferEngine& engine = **created;
  e.ok = true;
  e.info = engine.group_info(0);
  e.address = engine.address(0).short_name();
  e.address_hex = engine.address(0).to_hex();
  engine.close();
  return e;
}

std::string to_json(const MachineInfo& m, const EngineProbe* engine) {
  std::vector<std::string> providers;
  for (const ProviderReport& p : m.providers) {
    std::vector<std::string> domains;
    for (const auto& d : p.domains) {
      domains.push_back(fmt::format(R"({{"nic":{},"fabric":{},"provider":{},"ipv4":{}}})",
                                    json_string(d.nic), json_string(d.fabric),
                                    json_string(d.provider), d.ipv4));
    }
    providers.push_back(fmt::format(R"({{"name":{},"present":{},"domains":[{}]}})",
                                    json_string(p.name), p.present(), fmt::join(domains, ",")));
  }
  std::vector<std::string> verbs;
  for (const auto& v : m.verbs_ports) {
    verbs.push_back(fmt::format(
        R"({{"device":{},"port":{},"state":{},"active":{},"link_layer":{},"active_mtu":{},)"
        R"("gid_index":{},"gid":{},"netdev":{}}})",
        json_string(v.device), v.port, json_string(v.state), v.active, json_string(v.link_layer),
        v.active_mtu, v.gid_index, json_string(v.gid), json_string(v.netdev)));
  }
  std::vector<std::string> nics;
  for (const auto& n : m.nics) {
    nics.push_back(fmt::format(R"({{"name":{},"pci":{},"numa_node":{},"cpus":{}}})",
                               json_string(n.name), json_string(n.pci), n.numa_node,
                               json_ints(n.cpus)));
  }
  std::vector<std::string> gpus;
  for (const auto& g : m.gpus) {
    gpus.push_back(fmt::format(
        R"({{"pci":{},"vendor":{},"numa_node":{},"cpus":{},"near_nics":{},"nearness":{}}})",
        json_string(g.pci), json_string(g.vendor), g.numa_node, json_ints(g.cpus),
        json_strings(g.near_nics), json_string(g.nearness)));
  }
  std::vector<std::string> paths;
  for (const auto& p : m.paths) {
    paths.push_back(
        fmt::format(R"({{"provider":{},"nic":{},"stack":{},"placement":{},"usable":{},"writes":{},)"
                    R"("immediates":{},"messages":{}}})",
                    json_string(p.provider), json_string(p.nic), json_string(p.stack),
                    json_string(p.placement), p.usable, p.writes, p.immediates, p.messages));
  }
  std::string e = "null";
  if (engine != nullptr && engine->ok) {
    const GroupInfo& i = engine->info;
    e = fmt::format(
        R"({{"ok":true,"requested_provider":{},"requested_nics":{},"provider":{},"nics":{},)"
        R"("cpu":{},"delivery_complete":{},"gpu_memory":{},"cuda":{},"cuda_ipc":{},)"
        R"("address":{},"address_hex":{}}})",
        json_string(engine->requested_provider), json_strings(engine->requested_nics),
        json_string(i.provider), json_strings(i.nics), i.cpu, i.delivery_complete,
        json_string(i.gpu_memory), i.cuda, json_string(i.cuda_ipc), json_string(engine->address),
        json_string(engine->address_hex));
  } else if (engine != nullptr) {
    e = fmt::format(
        R"({{"ok":false,"requested_provider":{},"requested_nics":{},"provider":{},"nics":{},)"
        R"("error":{}}})",
        json_string(engine->requested_provider), json_strings(engine->requested_nics),
        json_string(engine->requested_provider), json_strings(engine->requested_nics),
        json_string(engine->error));
  }
  return fmt::format(
      R"({{"libfabric":{},"auto_provider":{},"providers":[{}],"verbs_built":{},"verbs":[{}],)"
      R"("nics":[{}],"gpus":[{}],"paths":[{}],"allowed_cpus":{},"cuda_built":{},)"
      R"("cuda_device":{},"engine":{}}})",
      json_string(m.libfabric_version), json_string(m.auto_provider), fmt::join(providers, ","),
      m.verbs_built, fmt::join(verbs, ","), fmt::join(nics, ","), fmt::join(gpus, ","),
      fmt::join(paths, ","), json_ints(m.allowed_cpus), m.cuda_built, m.cuda_device, e);
}

std::string to_text(const MachineInfo& m, const EngineProbe* engine) {
  std::string out = fmt::format("libfabric {}; provider \"auto\" resolves to {}\n\n",
                                m.libfabric_version, m.auto_provider);
  out += "Providers (reliable-datagram endpoints with RMA and remote CQ data):\n";
  for (const ProviderReport& p : m.providers) {
    if (!p.present()) {
      out += fmt::format("  {:<6} absent\n", p.name);
      continue;
    }
    // One line per NIC, with every fabric (address family) it is offered on.
    std::vector<std::string> stacks, nics;
    for (const auto& d : p.domains) {
      if (std::find(stacks.begin(), stacks.end(), d.provider) == stacks.end()) {
        stacks.push_back(d.provider);
      }
      if (std::find(nics.begin(), nics.end(), d.nic) == nics.end()) nics.push_back(d.nic);
    }
    out += fmt::format("  {:<6} present ({})\n", p.name, fmt::join(stacks, ", "));
    for (const auto& nic : nics) {
      std::vector<std::string> fabrics;
      for (const auto& d : p.domains) {
        if (d.nic == nic) fabrics.push_back(d.fabric + (d.ipv4 ? " (ipv4)" : ""));
      }
      out += fmt::format("           NIC {:<10} fabric {}\n", nic, fmt::join(fabrics, ", "));
    }
  }

  out += "\nRDMA devices for the verbs backend (provider \"verbs\", NIC DEVICE or DEVICE:PORT):\n";
  if (!m.verbs_built) out += "  (this build has no verbs backend: libibverbs-dev was missing)\n";
  if (m.verbs_built && m.verbs_ports.empty()) out += "  (none)\n";
  for (const auto& v : m.verbs_ports) {
    out += fmt::format("  {:<10} port {} {:<6} {:<10} MTU {:<5} GID {} {}{}\n", v.device, v.port,
                       v.state, v.link_layer, v.active_mtu,
                       v.gid_index < 0 ? std::string("-") : std::to_string(v.gid_index),
                       v.gid.empty() ? "(no usable GID)" : v.gid,
                       v.netdev.empty() ? "" : " on " + v.netdev);
  }

  out += "\nNICs seen by hwloc:\n";
  if (m.nics.empty()) out += "  (none)\n";
  for (const auto& n : m.nics) {
    out += fmt::format("  {:<14} pci {:<13} numa {:<3} cpus {}\n", n.name, or_dash(n.pci),
                       numa_text(n.numa_node), cpu_ranges(n.cpus));
  }

  out +=
      fmt::format("\nGPUs seen by hwloc (CUDA: {}):\n",
                  !m.cuda_built ? "not built" : (m.cuda_device ? "device present" : "no device"));
  if (m.gpus.empty()) out += "  (none)\n";
  for (const auto& g : m.gpus) {
    out += fmt::format("  {:<14} {:<6} numa {:<3} cpus {:<10} near NICs {}{}\n", g.pci, g.vendor,
                       numa_text(g.numa_node), cpu_ranges(g.cpus),
                       g.near_nics.empty() ? "-" : fmt::format("{}", fmt::join(g.near_nics, ",")),
                       g.nearness.empty() ? "" : " (" + g.nearness + ")");
  }

  out += "\nPaths (provider on NIC: writes, immediates, messages):\n";
  if (m.paths.empty()) out += "  (none)\n";
  for (const auto& p : m.paths) {
    out += fmt::format("  {:<6} {:<14} {:<14} {:<9} on {}\n", p.provider, p.nic, p.stack,
                       p.usable ? "usable" : "not ready", or_dash(p.placement));
  }
  out += fmt::format("\nCPUs this process may run on: {} ({} in all)\n", cpu_ranges(m.allowed_cpus),
                     m.allowed_cpus.size());

  if (engine == nullptr) return out;
  const EngineProbe& e = *engine;
  out +=
      fmt::format("\nTransferEngine on provider {}, NIC(s) {}:\n", e.requested_provider,
                  e.requested_nics.empty() ? std::string("(first)")
                                           : fmt::format("{}", fmt::join(e.requested_nics, ",")));
  if (!e.ok) return out + fmt::format("  could not be created: {}\n", e.error);
  out += fmt::format("  provider           {}\n", e.info.provider);
  out += fmt::format("  NICs               {}\n", fmt::join(e.info.nics, ", "));
  out += fmt::format("  worker CPU         {}\n",
                     e.info.cpu < 0 ? std::string("unpinned") : std::to_string(e.info.cpu));
  out += fmt::format("  delivery_complete  {}\n", e.info.delivery_complete ? "yes" : "no");
  out += fmt::format("  GPU memory         {} (CUDA device here: {})\n", e.info.gpu_memory,
                     e.info.cuda ? "yes" : "no");
  out += fmt::format(
      "  CUDA IPC           {} (same-host GPU peers: copied GPU to GPU by the destination's "
      "owner{})\n",
      e.info.cuda_ipc, e.info.cuda ? "" : "; no CUDA device here");
  out += fmt::format("  address            {}\n", e.address);
  out += fmt::format("  address hex        {}\n", e.address_hex);
  return out;
}

}  // namespace fabric
