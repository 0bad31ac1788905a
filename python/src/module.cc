// fabric_lib._fabric_lib: the compiled half of the fabric_lib package (python/fabric_lib/
// re-exports it and adds the futures, info() and the torch.distributed helpers).
#include "bindings.h"

#ifndef FABRIC_VERSION
#define FABRIC_VERSION "0.0.0"
#endif

PYBIND11_MODULE(_fabric_lib, m) {
  namespace fp = fabric::python;
  m.doc() =
      "fabric-lib bindings: TransferEngine, its configuration, addresses and descriptors, "
      "fabric::kv (KV-cache transfer and membership), fabric::ep (MoE all-to-all), and one "
      "exception class per status code. "
      "Import the fabric_lib package, not this module.";
  m.attr("__version__") = FABRIC_VERSION;
  // Built with CUDA: register() takes CUDA tensors (staged through pinned host memory).
#ifdef FABRIC_WITH_CUDA
  m.attr("HAS_CUDA") = true;
#else
  m.attr("HAS_CUDA") = false;
#endif
  fp::bind_errors(m);
  fp::bind_types(m);
  fp::bind_config(m);
  fp::bind_engine(m);
  fp::bind_watchers(m);
  fp::bind_info(m);
  fp::bind_kv(m);
  fp::bind_ep(m);
  fp::bind_weights(m);
}
