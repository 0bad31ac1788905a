// fabric-info: what fabric-lib can use on this machine.
//
//   fabric-info [--provider P] [--nic N[,N...]] [--cpu auto|none|K] [--no-engine] [--json]
//
// Prints the providers the engine knows (tcp, shm, efa, verbs) and the NICs each offers, the
// RDMA ports of the verbs backend, the NICs and GPUs hwloc sees with their PCI address, NUMA
// node, local CPUs and (for GPUs) the NICs near them, each path's use, and the CPUs this
// process may run on. Then it opens a TransferEngine on --provider / --nic and prints what its
// device group turned out to be and its address. Everything comes from the public discovery
// API (fabric/discovery.h), which fabric_lib.info() and fabric-bench use too.
// Exit status: 0 on success, 1 when the engine cannot be created, 2 on bad usage.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "fabric/discovery.h"

int main(int argc, char** argv) {
  std::string provider = "tcp";
  std::vector<std::string> nics;
  std::string cpu = "auto";
  bool open_engine = true;
  bool json = false;
  CLI::App app{"fabric-info: the providers, NICs and CPUs fabric-lib can use on this machine"};
  app.add_option("--provider", provider,
                 "provider of the engine to open: tcp, shm, efa, verbs, auto, ...")
      ->capture_default_str();
  app.add_option("--nic", nics,
                 "NIC(s) of the engine's group, comma-separated (default: lo for tcp, shm for "
                 "shm, else the provider's first)")
      ->delimiter(',');
  app.add_option("--cpu", cpu, "worker CPU: auto, none or a CPU number")->capture_default_str();
  app.add_flag("!--no-engine", open_engine, "only list; do not open an engine");
  app.add_flag("--json", json, "print one JSON object instead of text");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;  // --help is not an error
  }
  auto parsed_cpu = fabric::parse_cpu(cpu);
  if (!parsed_cpu) {
    std::fprintf(stderr, "fabric-info: --%s\n", parsed_cpu.status().message().c_str());
    return 2;
  }

  const fabric::MachineInfo machine = fabric::discover();
  std::optional<fabric::EngineProbe> engine;
  if (open_engine) {
    // The environment (FABRIC_*) first, then what the command line names.
    fabric::EngineProbeRequest request;
    if (app.count("--provider") > 0) request.provider = provider;
    if (app.count("--nic") > 0) request.nics = nics;
    if (app.count("--cpu") > 0) request.cpu = *parsed_cpu;
    engine = fabric::probe_engine(request);
  }
  const fabric::EngineProbe* e = engine ? &*engine : nullptr;
  const std::string out = json ? fabric::to_json(machine, e) + "\n" : fabric::to_text(machine, e);
  std::fputs(out.c_str(), stdout);
  if (engine && !engine->ok) {
    std::fprintf(stderr, "fabric-info: cannot create a TransferEngine on provider '%s': %s\n",
                 engine->requested_provider.c_str(), engine->error.c_str());
    return 1;
  }
  return 0;
}
