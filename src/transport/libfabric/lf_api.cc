#include "transport/libfabric/lf_api.h"

#include <dlfcn.h>
#include <fmt/format.h>
#include <signal.h>

#include <array>

#include "common/log.h"

namespace fabric::transport::lf {
namespace {

// Keeps the process's signal handlers as they were across a call into libfabric. Loading
// Debian 12's libfabric runs libinfinipath's constructor (its psm provider's), which installs
// its own handlers for SIGINT, SIGILL, SIGABRT, SIGBUS, SIGSEGV and SIGTERM: they print a
// backtrace and exit, replacing the application's (Python's KeyboardInterrupt among them).
// Providers initialise when libfabric first lists them (fi_getinfo), so that call is kept too.
// A library has no business changing an application's handlers: whatever changed is put back.
class SignalsKept {
 public:
  SignalsKept() {
    for (int s = 1; s < NSIG; ++s) saved_[s].ok = sigaction(s, nullptr, &saved_[s].action) == 0;
  }
  ~SignalsKept() {
    for (int s = 1; s < NSIG; ++s) {
      struct sigaction now {};
      if (!saved_[s].ok || sigaction(s, nullptr, &now) != 0 || same(now, saved_[s].action)) {
        continue;
      }
      if (sigaction(s, &saved_[s].action, nullptr) == 0) {
        detail::log().debug("libfabric changed the handler of signal {}; put back", s);
      }
    }
  }
  SignalsKept(const SignalsKept&) = delete;
  SignalsKept& operator=(const SignalsKept&) = delete;

 private:
  static bool same(const struct sigaction& a, const struct sigaction& b) {
    const bool info = (a.sa_flags & SA_SIGINFO) != 0;
    if (info != ((b.sa_flags & SA_SIGINFO) != 0) || a.sa_flags != b.sa_flags) return false;
    return info ? a.sa_sigaction == b.sa_sigaction : a.sa_handler == b.sa_handler;
  }
  struct Saved {
    struct sigaction action {};
    bool ok = false;
  };
  std::array<Saved, NSIG> saved_{};
};

decltype(&::fi_getinfo) g_getinfo = nullptr;  // set once, before api() hands out the table

int getinfo_keeping_signals(uint32_t version, const char* node, const char* service, uint64_t flags,
                            const fi_info* hints, fi_info** info) {
  SignalsKept kept;
  return g_getinfo(version, node, service, flags, hints, info);
}

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
  void* handle = nullptr;
  std::string why = kLibrary;
  {
    SignalsKept kept;
    handle = dlopen(kLibrary, RTLD_NOW | RTLD_GLOBAL);
    if (const char* e = handle == nullptr ? dlerror() : nullptr; e != nullptr) why = e;
  }
  if (handle == nullptr) {
    l.error = fmt::format("libfabric could not be loaded ({}): install libfabric1", why);
    return l;
  }
  Api& a = l.api;
  resolve(handle, "fi_getinfo", a.getinfo, l.error);
  resolve(handle, "fi_freeinfo", a.freeinfo, l.error);
  resolve(handle, "fi_dupinfo", a.dupinfo, l.error);
  resolve(handle, "fi_fabric", a.fabric, l.error);
  resolve(handle, "fi_strerror", a.strerror, l.error);
  resolve(handle, "fi_version", a.version, l.error);
  if (a.getinfo != nullptr) {
    g_getinfo = a.getinfo;
    a.getinfo = &getinfo_keeping_signals;
  }
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
