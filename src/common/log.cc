#include "common/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>

namespace fabric::detail {

spdlog::logger& log() {
  static std::shared_ptr<spdlog::logger> logger = [] {
    auto l = spdlog::get("fabric");
    if (!l) l = spdlog::stderr_color_mt("fabric");
    const char* level = std::getenv("FABRIC_LOG_LEVEL");
    l->set_level(level ? spdlog::level::from_str(level) : spdlog::level::info);
    return l;
  }();
  return *logger;
}

}  // namespace fabric::detail
