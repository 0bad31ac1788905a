// Fuzz target: configuration strings from the environment (Config::apply_env_overrides).
// The input is split at newlines into the values of FABRIC_PROVIDER, FABRIC_NICS, FABRIC_CPU,
// FABRIC_SPIN_US and FABRIC_IDLE_SLEEP_US (a missing or empty line leaves the variable unset).
// Properties: never crashes; an error names the variable at fault; an accepted configuration
// has only non-empty NIC names without commas, a CPU that is a core number or one of the two
// special values, and non-negative idle times.
#include <stdlib.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "fabric/config.h"
#include "fuzz_check.h"

namespace {

// One environment entry per variable, installed once with putenv and rewritten in place:
// setenv would keep every distinct value it was ever given (glibc never frees them), and the
// fuzzer's memory would grow with every input.
constexpr size_t kEntryBytes = 4096;
const char* const kVars[] = {"FABRIC_PROVIDER", "FABRIC_NICS", "FABRIC_CPU", "FABRIC_SPIN_US",
                             "FABRIC_IDLE_SLEEP_US"};
char entries[5][kEntryBytes];

void set_value(size_t i, std::string_view value) {
  static bool installed = false;
  if (!installed) {
    for (size_t k = 0; k < 5; ++k) {
      std::snprintf(entries[k], kEntryBytes, "%s=", kVars[k]);
      putenv(entries[k]);
    }
    installed = true;
  }
  const size_t at = std::strlen(kVars[i]) + 1;
  value = value.substr(0, std::min(value.find('\0'), kEntryBytes - at - 1));  // no NUL inside
  if (!value.empty()) std::memcpy(entries[i] + at, value.data(), value.size());
  entries[i][at + value.size()] = '\0';  // an empty value is the same as unset
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view rest(reinterpret_cast<const char*>(data), size);
  for (size_t i = 0; i < 5; ++i) {
    const size_t nl = rest.find('\n');
    set_value(i, rest.substr(0, nl));
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
