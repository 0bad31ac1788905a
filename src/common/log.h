// The library's logger: named "fabric", writing to stderr (never stdout, which applications
// may use for their own protocol). FABRIC_LOG_LEVEL (trace, debug, info, warn, error, off)
// sets its level; the default is info.
#pragma once

#include <spdlog/spdlog.h>

namespace fabric::detail {

spdlog::logger& log();

}  // namespace fabric::detail
