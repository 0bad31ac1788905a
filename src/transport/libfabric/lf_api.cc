#include "transport/libfabric/lf_api.h"

#include <dlfcn.h>
#include <fmt/format.h>

namespace fabric::transport::lf {
namespace {

// The soname of the ABI these headers describe (libfabric 1.x).
constexpr const char* kLibrary = "libfabric.so.1";

struct Loaded {
  Api api{};
  std::string error;  // empty when every function resolved
};

// Sets `out`, or `error` (the first symbol missing) when the library lacks it.
template <typename Fn>
void resolve(void* handle, const char* name, Fn& out, std::string& error) {
  out = reinterpret_cast<Fn>(dlsym(handle, name));
  if (out == nullptr && error.empty()) error = fmt::format("{} has no symbol {}", kLibrary, name);
}

Loaded load() {
  Loaded l;
  // RTLD_GLOBAL as when linked: libfabric's loadable providers resolve its symbols from here.
  // Never closed: providers, their threads and atexit handlers outlive any one domain.
  void* handle = dlopen(kLibrary, RTLD_NOW | RTLD_GLOBAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    l.error = fmt::format("libfabric could not be loaded ({}): install libfabric1",
                          why != nullptr ? why : kLibrary);
    return l;
  }
  Api& a = l.api;
  resolve(handle, "fi_getinfo", a.getinfo, l.error);
  resolve(handle, "fi_freeinfo", a.freeinfo, l.error);
  resolve(handle, "fi_dupinfo", a.dupinfo, l.error);
  resolve(handle, "fi_fabric", a.fabric, l.error);
  resolve(handle, "fi_strerror", a.strerror, l.error);
  resolve(handle, "fi_version", a.version, l.error);
  return l;
}

const Loaded& loaded() {
  static const Loaded l = load();
  return l;
}

}  // namespace

const Api* api() {
  const Loaded& l = loaded();
  return l.error.empty() ? &l.api : nullptr;
}

const std::string& load_error() {
  return loaded().error;
}

std::string strerror(int errnum) {
  const Api* a = api();
  return a != nullptr ? std::string(a->strerror(errnum))
                      : fmt::format("libfabric error {}", errnum);
}

}  // namespace fabric::transport::lf
