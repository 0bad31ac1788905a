// libfabric's exported functions, resolved from libfabric.so.1 the first time one is needed.
//
// Everything else libfabric offers (fi_domain, fi_write, fi_cq_read, ...) is an inline call
// through the tables of the objects these return, so these few are all the backend links to.
// Loading them on demand keeps libfabric out of every process that never opens a libfabric
// domain or asks what it offers: one using shm or verbs only, `import fabric_lib`, the unit
// tests. That matters because loading Debian 12's libfabric loads libinfinipath (its psm
// provider's), whose constructor calibrates a clock for about 0.2 s in every process.
#pragma once

#include <rdma/fabric.h>

#include <string>

namespace fabric::transport::lf {

struct Api {
  decltype(&::fi_getinfo) getinfo;
  decltype(&::fi_freeinfo) freeinfo;
  decltype(&::fi_dupinfo) dupinfo;
  decltype(&::fi_fabric) fabric;
  decltype(&::fi_strerror) strerror;
  decltype(&::fi_version) version;
};

// The functions, loaded once (thread-safe); nullptr when libfabric.so.1 cannot be loaded or
// lacks one of them, and load_error() says why.
const Api* api();
// Empty once api() succeeded.
const std::string& load_error();

// fi_strerror(errnum), or "libfabric error <errnum>" when libfabric is not loaded.
std::string strerror(int errnum);

}  // namespace fabric::transport::lf
