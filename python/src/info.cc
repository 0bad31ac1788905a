// fabric_lib.info(): the report of fabric-info, through the same public discovery API
// (fabric/discovery.h) and the same formatting, so the two cannot drift apart.
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "fabric/discovery.h"

namespace fabric::python {
namespace {

// (fabric-info --json's object as UTF-8 bytes, fabric-info's text). The JSON goes as bytes:
// a name holding bytes that are not UTF-8 (a NIC, an environment variable in an error) is
// escaped by the package's own decoder, into JSON that still parses.
std::pair<py::bytes, std::string> gather(std::optional<std::string> provider,
                                         std::optional<std::vector<std::string>> nics,
                                         std::optional<std::string> cpu, bool engine) {
  EngineProbeRequest request;
  request.provider = std::move(provider);
  request.nics = std::move(nics);
  if (cpu) {
    auto parsed = parse_cpu(*cpu);
    if (!parsed) {
      throw StatusError{Status(parsed.status().code(), "info: " + parsed.status().message())};
    }
    request.cpu = *parsed;
  }
  std::string json, text;
  {
    py::gil_scoped_release nogil;
    const MachineInfo machine = discover();
    std::optional<EngineProbe> probe;
    if (engine) probe = probe_engine(request);
    const EngineProbe* e = probe ? &*probe : nullptr;
    json = to_json(machine, e);
    text = to_text(machine, e);
  }
  return {py::bytes(json), std::move(text)};
}

}  // namespace

void bind_info(py::module_& m) {
  m.def("_gather_info", &gather, py::arg("provider") = py::none(), py::arg("nics") = py::none(),
        py::arg("cpu") = py::none(), py::arg("engine") = true,
        "fabric-info's report as (JSON as UTF-8 bytes, text); fabric_lib.info() wraps it.");
}

}  // namespace fabric::python
