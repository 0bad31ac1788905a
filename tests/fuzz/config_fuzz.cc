// Fuzz target: configuration strings from the environment (Config::apply_env_overrides).
// The input is split at newlines into the values of FABRIC_PROVIDER, FABRIC_NICS, FABRIC_CPU,
// FABRIC_SPIN_US and FABRIC_IDLE_SLEEP_US (a missing line leaves the variable unset).
// Properties: never crashes; an error names the variable at fault; an accepted configuration
// has only non-empty NIC names without commas, a CPU that is a core number or one of the two
// special values, and non-negative idle times.
#include <stdlib.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "fabric/config.h"
#include "fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const char* const kVars[] = {"FABRIC_PROVIDER", "FABRIC_NICS", "FABRIC_CPU",
                                      "FABRIC_SPIN_US", "FABRIC_IDLE_SLEEP_US"};
  std::string_view rest(reinterpret_cast<const char*>(data), size);
  for (const char* var : kVars) {
    if (rest.empty()) {
      unsetenv(var);
      continue;
    }
    const size_t nl = rest.find('\n');
    std::string value(rest.substr(0, nl));
    value = value.substr(0, value.find('\0'));  // the environment cannot carry a NUL
    setenv(var, value.c_str(), 1);
    rest = nl == std::string_view::npos ? std::string_view{} : rest.substr(nl + 1);
  }
  fabric::Config config;
  fabric::Status s = config.apply_env_overrides();
  if (!s) {
    FUZZ_CHECK(s.code() == fabric::ErrorCode::kInvalidArgument, "rejection code");
    FUZZ_CHECK(s.message().find("FABRIC_") != std::string::npos, "the error names the variable");
    return 0;
  }
  FUZZ_CHECK(!config.groups.empty(), "a group");
  for (const std::string& nic : config.groups[0].nics) {
    FUZZ_CHECK(!nic.empty() && nic.find(',') == std::string::npos, "NIC names");
  }
  const int cpu = config.groups[0].cpu;
  FUZZ_CHECK(
      cpu >= 0 || cpu == fabric::GroupConfig::kCpuAuto || cpu == fabric::GroupConfig::kCpuNone,
      "a CPU number or a special value");
  FUZZ_CHECK(config.spin_time.count() >= 0 && config.idle_sleep.count() >= 0,
             "non-negative idle times");
  return 0;
}
