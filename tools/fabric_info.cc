// fabric-info: what fabric-lib can use on this machine.
//
//   fabric-info [--provider P] [--nic N[,N...]] [--cpu auto|none|K] [--no-engine] [--json]
//
// Prints the libfabric providers the engine knows (tcp, shm, efa, verbs): present or absent,
// and the domains (NICs) each offers with the capabilities the engine needs; the NICs hwloc
// sees with their NUMA node and local CPUs; the CPUs this process may run on. Then it opens a
// TransferEngine on --provider / --nic and prints what its device group turned out to be and
// its address. Exit status: 0 on success, 1 when the engine cannot be created, 2 on bad usage.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <rdma/fabric.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/json.h"
#include "fabric/fabric.h"
#include "topology/topology.h"
#include "transport/libfabric/lf_domain.h"
#include "transport/open_domain.h"
#ifdef FABRIC_WITH_VERBS
#include "transport/verbs/verbs_domain.h"
#endif

namespace {

using fabric::Config;
using fabric::GroupConfig;
using fabric::GroupInfo;
using fabric::TransferEngine;

// The providers the engine is built and tested for, in the order they are listed.
constexpr std::string_view kKnownProviders[] = {"tcp", "shm", "efa", "verbs"};

struct Options {
  std::string provider = "tcp";
  std::vector<std::string> nics;  // empty: the provider's loopback-style default
  std::string cpu = "auto";       // "auto", "none" or a CPU number
  bool open_engine = true;
  bool json = false;
};

struct ProviderReport {
  std::string name;
  std::vector<fabric::transport::DomainListing> domains;
  bool present() const { return !domains.empty(); }
};

struct EngineReport {
  std::string provider;  // as configured
  std::vector<std::string> nics;
  std::optional<GroupInfo> info;
  std::string address_short;
  std::string address_hex;
  std::string error;  // set when the engine could not be created
};

// A port of an RDMA device, as the verbs backend (provider "verbs") sees it.
struct VerbsPort {
  std::string device;
  int port = 0;
  std::string state;
  std::string link_layer;
  uint32_t active_mtu = 0;
  int gid_index = -1;
  std::string gid;
  std::string netdev;
};

struct Report {
  std::string libfabric_version;
  bool verbs_built = false;
  std::vector<VerbsPort> verbs_ports;
  std::string auto_provider;
  std::vector<ProviderReport> providers;
  std::vector<fabric::topology::NicPlacement> nics;
  std::vector<int> allowed_cpus;
  std::optional<EngineReport> engine;
};

// The NIC the engine tests use for a provider on a machine without an RDMA NIC.
std::vector<std::string> default_nics(const std::string& provider) {
  if (provider == "tcp") return {"lo"};
  if (provider == "shm") return {"shm"};
  return {};  // the provider's first domain
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

using fabric::detail::json_string;

std::string json_ints(const std::vector<int>& v) {
  return fmt::format("[{}]", fmt::join(v, ","));
}

std::string json_strings(const std::vector<std::string>& v) {
  std::vector<std::string> quoted;
  for (const auto& s : v) quoted.push_back(json_string(s));
  return fmt::format("[{}]", fmt::join(quoted, ","));
}

// Parses --cpu; false when malformed.
bool parse_cpu(const std::string& text, int& out) {
  if (text == "auto") {
    out = GroupConfig::kCpuAuto;
    return true;
  }
  if (text == "none") {
    out = GroupConfig::kCpuNone;
    return true;
  }
  char* end = nullptr;
  long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || v < 0 || v > 1 << 20) return false;
  out = static_cast<int>(v);
  return true;
}

// --- gathering ------------------------------------------------------------------------------

Report gather_machine() {
  Report r;
  const uint32_t v = fi_version();
  r.libfabric_version = fmt::format("{}.{}", FI_MAJOR(v), FI_MINOR(v));
  r.auto_provider = fabric::transport::resolve_provider("auto");
  for (std::string_view p : kKnownProviders) {
    r.providers.push_back({std::string(p), fabric::transport::list_domains(std::string(p))});
  }
  r.verbs_built = fabric::transport::verbs_built();
#ifdef FABRIC_WITH_VERBS
  for (const auto& p : fabric::transport::list_verbs_ports()) {
    r.verbs_ports.push_back(VerbsPort{p.device, p.port, p.state, p.link_layer, p.active_mtu,
                                      p.gid_index, p.gid, p.netdev});
  }
#endif
  r.nics = fabric::topology::list_nics();
  r.allowed_cpus = fabric::topology::allowed_cpus();
  return r;
}

// Opens an engine as configured by the options (environment overrides first, then the command
// line) and describes its group 0. The engine is closed before returning.
EngineReport open_engine(const Options& opts, const CLI::App& app) {
  Config config;
  config.provider = opts.provider;
  config.groups = {GroupConfig{}};
  int cpu = GroupConfig::kCpuAuto;
  parse_cpu(opts.cpu, cpu);  // validated by the caller
  config.groups[0].cpu = cpu;

  EngineReport e;
  if (fabric::Status s = config.apply_env_overrides(); !s) {
    e.error = s.to_string();
    return e;
  }
  if (app.count("--provider") > 0) config.provider = opts.provider;
  if (app.count("--cpu") > 0) config.groups[0].cpu = cpu;
  if (app.count("--nic") > 0) {
    config.groups[0].nics = opts.nics;
  } else if (std::getenv("FABRIC_NICS") == nullptr) {
    config.groups[0].nics = default_nics(config.provider);
  }
  e.provider = config.provider;
  e.nics = config.groups[0].nics;

  auto created = TransferEngine::create(config);
  if (!created) {
    e.error = created.status().to_string();
    return e;
  }
  TransferEngine& engine = **created;
  e.info = engine.group_info(0);
  e.address_short = engine.address(0).short_name();
  e.address_hex = engine.address(0).to_hex();
  engine.close();
  return e;
}

// --- printing -------------------------------------------------------------------------------

void print_text(const Report& r) {
  fmt::print("libfabric {}; provider \"auto\" resolves to {}\n\n", r.libfabric_version,
             r.auto_provider);

  fmt::print("Providers (reliable-datagram endpoints with RMA and remote CQ data):\n");
  for (const ProviderReport& p : r.providers) {
    if (!p.present()) {
      fmt::print("  {:<6} absent\n", p.name);
      continue;
    }
    // One line per NIC, with every fabric (address family) it is offered on.
    std::vector<std::string> providers, nics;
    for (const auto& d : p.domains) {
      if (std::find(providers.begin(), providers.end(), d.provider) == providers.end()) {
        providers.push_back(d.provider);
      }
      if (std::find(nics.begin(), nics.end(), d.domain) == nics.end()) nics.push_back(d.domain);
    }
    fmt::print("  {:<6} present ({})\n", p.name, fmt::join(providers, ", "));
    for (const auto& nic : nics) {
      std::vector<std::string> fabrics;
      for (const auto& d : p.domains) {
        if (d.domain == nic) fabrics.push_back(d.fabric + (d.ipv4 ? " (ipv4)" : ""));
      }
      fmt::print("           NIC {:<10} fabric {}\n", nic, fmt::join(fabrics, ", "));
    }
  }

  fmt::print(
      "\nRDMA devices for the verbs backend (provider \"verbs\", NIC DEVICE or DEVICE:PORT):\n");
  if (!r.verbs_built)
    fmt::print("  (this build has no verbs backend: libibverbs-dev was missing)\n");
  if (r.verbs_built && r.verbs_ports.empty()) fmt::print("  (none)\n");
  for (const auto& v : r.verbs_ports) {
    fmt::print("  {:<10} port {} {:<6} {:<10} MTU {:<5} GID {} {}{}\n", v.device, v.port, v.state,
               v.link_layer, v.active_mtu,
               v.gid_index < 0 ? std::string("-") : std::to_string(v.gid_index),
               v.gid.empty() ? "(no usable GID)" : v.gid,
               v.netdev.empty() ? "" : " on " + v.netdev);
  }

  fmt::print("\nNICs seen by hwloc:\n");
  if (r.nics.empty()) fmt::print("  (none)\n");
  for (const auto& n : r.nics) {
    fmt::print("  {:<14} pci {:<13} numa {:<3} cpus {}\n", n.name, n.pci.empty() ? "-" : n.pci,
               n.numa_node < 0 ? std::string("-") : std::to_string(n.numa_node),
               cpu_ranges(n.cpus));
  }
  fmt::print("\nCPUs this process may run on: {} ({} in all)\n", cpu_ranges(r.allowed_cpus),
             r.allowed_cpus.size());

  if (!r.engine) return;
  const EngineReport& e = *r.engine;
  fmt::print("\nTransferEngine on provider {}, NIC(s) {}:\n", e.provider,
             e.nics.empty() ? std::string("(first)") : fmt::format("{}", fmt::join(e.nics, ",")));
  if (!e.info) {
    fmt::print("  could not be created: {}\n", e.error);
    return;
  }
  fmt::print("  provider           {}\n", e.info->provider);
  fmt::print("  NICs               {}\n", fmt::join(e.info->nics, ", "));
  fmt::print("  worker CPU         {}\n",
             e.info->cpu < 0 ? std::string("unpinned") : std::to_string(e.info->cpu));
  fmt::print("  delivery_complete  {}\n", e.info->delivery_complete ? "yes" : "no");
  fmt::print("  GPU memory         {} (CUDA device here: {})\n", e.info->gpu_memory,
             e.info->cuda ? "yes" : "no");
  fmt::print("  address            {}\n", e.address_short);
  fmt::print("  address hex        {}\n", e.address_hex);
}

void print_json(const Report& r) {
  std::vector<std::string> providers;
  for (const ProviderReport& p : r.providers) {
    std::vector<std::string> domains;
    for (const auto& d : p.domains) {
      domains.push_back(fmt::format(R"({{"nic":{},"fabric":{},"provider":{},"ipv4":{}}})",
                                    json_string(d.domain), json_string(d.fabric),
                                    json_string(d.provider), d.ipv4));
    }
    providers.push_back(fmt::format(R"({{"name":{},"present":{},"domains":[{}]}})",
                                    json_string(p.name), p.present(), fmt::join(domains, ",")));
  }
  std::vector<std::string> nics;
  for (const auto& n : r.nics) {
    nics.push_back(fmt::format(R"({{"name":{},"pci":{},"numa_node":{},"cpus":{}}})",
                               json_string(n.name), json_string(n.pci), n.numa_node,
                               json_ints(n.cpus)));
  }
  std::vector<std::string> verbs;
  for (const auto& v : r.verbs_ports) {
    verbs.push_back(fmt::format(
        R"({{"device":{},"port":{},"state":{},"link_layer":{},"active_mtu":{},"gid_index":{},)"
        R"("gid":{},"netdev":{}}})",
        json_string(v.device), v.port, json_string(v.state), json_string(v.link_layer),
        v.active_mtu, v.gid_index, json_string(v.gid), json_string(v.netdev)));
  }
  std::string engine = "null";
  if (r.engine) {
    const EngineReport& e = *r.engine;
    if (e.info) {
      engine = fmt::format(R"({{"ok":true,"provider":{},"nics":{},"cpu":{},"delivery_complete":{},)"
                           R"("gpu_memory":{},"cuda":{},"address":{},"address_hex":{}}})",
                           json_string(e.info->provider), json_strings(e.info->nics), e.info->cpu,
                           e.info->delivery_complete, json_string(e.info->gpu_memory), e.info->cuda,
                           json_string(e.address_short), json_string(e.address_hex));
    } else {
      engine = fmt::format(R"({{"ok":false,"provider":{},"nics":{},"error":{}}})",
                           json_string(e.provider), json_strings(e.nics), json_string(e.error));
    }
  }
  fmt::print(
      R"({{"libfabric":{},"auto_provider":{},"providers":[{}],"verbs_built":{},"verbs":[{}],)"
      R"("nics":[{}],"allowed_cpus":{},"engine":{}}})"
      "\n",
      json_string(r.libfabric_version), json_string(r.auto_provider), fmt::join(providers, ","),
      r.verbs_built, fmt::join(verbs, ","), fmt::join(nics, ","), json_ints(r.allowed_cpus),
      engine);
}

}  // namespace

int main(int argc, char** argv) {
  Options opts;
  CLI::App app{"fabric-info: the providers, NICs and CPUs fabric-lib can use on this machine"};
  app.add_option("--provider", opts.provider,
                 "provider of the engine to open: tcp, shm, efa, verbs, auto, ...")
      ->capture_default_str();
  app.add_option("--nic", opts.nics,
                 "NIC(s) of the engine's group, comma-separated (default: lo for tcp, shm for "
                 "shm, else the provider's first)")
      ->delimiter(',');
  app.add_option("--cpu", opts.cpu, "worker CPU: auto, none or a CPU number")
      ->capture_default_str();
  app.add_flag("!--no-engine", opts.open_engine, "only list; do not open an engine");
  app.add_flag("--json", opts.json, "print one JSON object instead of text");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;  // --help is not an error
  }

  int cpu = 0;
  if (!parse_cpu(opts.cpu, cpu)) {
    fmt::print(stderr, "fabric-info: --cpu '{}' is not auto, none or a CPU number\n", opts.cpu);
    return 2;
  }

  Report report = gather_machine();
  if (opts.open_engine) report.engine = open_engine(opts, app);
  if (opts.json) {
    print_json(report);
  } else {
    print_text(report);
  }
  if (report.engine && !report.engine->info) {
    fmt::print(stderr, "fabric-info: cannot create a TransferEngine on provider '{}': {}\n",
               report.engine->provider, report.engine->error);
    return 1;
  }
  return 0;
}
