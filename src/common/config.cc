// Environment overrides of Config, all declared here.
#include <fmt/format.h>

#include <charconv>
#include <climits>
#include <cstdlib>
#include <string_view>

#include "fabric/config.h"

namespace fabric {

namespace {

// An integer in [min, max], or an error naming the variable.
Status parse_int(const char* var, std::string_view text, long long min, long long max,
                 long long& out) {
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  if (ec != std::errc() || ptr != text.data() + text.size()) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("environment variable {}='{}' is not an integer", var, text));
  }
  if (out < min || out > max) {
    return Status(
        ErrorCode::kInvalidArgument,
        fmt::format("environment variable {}='{}' is outside {}..{}", var, text, min, max));
  }
  return Status::ok();
}

// Idle times above an hour are a typo, not a setting.
constexpr long long kMaxIdleMicros = 3'600'000'000;

}  // namespace

Status Config::apply_env_overrides() {
  if (const char* v = std::getenv("FABRIC_PROVIDER"); v && *v) provider = v;
  if (const char* v = std::getenv("FABRIC_NICS"); v && *v) {
    if (groups.empty()) groups.emplace_back();
    groups[0].nics.clear();
    std::string_view rest = v;
    for (bool more = true; more;) {
      auto comma = rest.find(',');
      std::string_view nic = rest.substr(0, comma);
      if (nic.empty()) {
        return Status(ErrorCode::kInvalidArgument,
                      fmt::format("environment variable FABRIC_NICS='{}' has an empty entry", v));
      }
      groups[0].nics.emplace_back(nic);
      more = comma != std::string_view::npos;  // a trailing comma is an empty last entry
      if (more) rest = rest.substr(comma + 1);
    }
  }
  long long n = 0;
  if (const char* v = std::getenv("FABRIC_CPU"); v && *v) {
    if (Status s = parse_int("FABRIC_CPU", v, GroupConfig::kCpuNone, INT_MAX, n); !s) return s;
    if (groups.empty()) groups.emplace_back();
    groups[0].cpu = static_cast<int>(n);
  }
  if (const char* v = std::getenv("FABRIC_SPIN_US"); v && *v) {
    if (Status s = parse_int("FABRIC_SPIN_US", v, 0, kMaxIdleMicros, n); !s) return s;
    spin_time = std::chrono::microseconds(n);
  }
  if (const char* v = std::getenv("FABRIC_IDLE_SLEEP_US"); v && *v) {
    if (Status s = parse_int("FABRIC_IDLE_SLEEP_US", v, 0, kMaxIdleMicros, n); !s) return s;
    idle_sleep = std::chrono::microseconds(n);
  }
  if (const char* v = std::getenv("FABRIC_INFLIGHT_SPIN_US"); v && *v) {
    if (Status s = parse_int("FABRIC_INFLIGHT_SPIN_US", v, -1, kMaxIdleMicros, n); !s) return s;
    inflight_spin = std::chrono::microseconds(n);
  }
  if (const char* v = std::getenv("FABRIC_CALLBACK_SPIN_US"); v && *v) {
    if (std::string_view(v) == "auto") {
      callback_spin.reset();
    } else {
      if (Status s = parse_int("FABRIC_CALLBACK_SPIN_US", v, 0, kMaxIdleMicros, n); !s) return s;
      callback_spin = std::chrono::microseconds(n);
    }
  }
  if (const char* v = std::getenv("FABRIC_WAIT_SPIN_US"); v && *v) {
    if (std::string_view(v) == "auto") {
      wait_spin.reset();
    } else {
      if (Status s = parse_int("FABRIC_WAIT_SPIN_US", v, 0, kMaxIdleMicros, n); !s) return s;
      wait_spin = std::chrono::microseconds(n);
    }
  }
  if (const char* v = std::getenv("FABRIC_SHM_COPY_THREADS"); v && *v) {
    if (Status s = parse_int("FABRIC_SHM_COPY_THREADS", v, 0, 64, n); !s) return s;
    shm_copy_threads = static_cast<uint32_t>(n);
  }
  if (const char* v = std::getenv("FABRIC_CALLBACKS_ON_WORKER"); v && *v) {
    if (Status s = parse_int("FABRIC_CALLBACKS_ON_WORKER", v, 0, 1, n); !s) return s;
    callbacks_on_worker = n != 0;
  }
  if (const char* v = std::getenv("FABRIC_WEIGHTED_SHARDING"); v && *v) {
    if (Status s = parse_int("FABRIC_WEIGHTED_SHARDING", v, 0, 1, n); !s) return s;
    weighted_sharding = n != 0;
  }
  if (const char* v = std::getenv("FABRIC_CUDA_IPC"); v && *v) {
    const std::string_view text = v;
    if (text == "auto") {
      cuda_ipc = CudaIpc::kAuto;
    } else if (text == "on") {
      cuda_ipc = CudaIpc::kOn;
    } else if (text == "off") {
      cuda_ipc = CudaIpc::kOff;
    } else {
      return Status(
          ErrorCode::kInvalidArgument,
          fmt::format("environment variable FABRIC_CUDA_IPC='{}' is not auto, on or off", text));
    }
  }
  return Status::ok();
}

}  // namespace fabric
