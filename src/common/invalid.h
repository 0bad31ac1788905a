// The status of a refused argument, for the checks that name the argument and its value.
#pragma once

#include <string>
#include <utility>

#include "fabric/status.h"

namespace fabric {

inline Status invalid(std::string message) {
  return Status(ErrorCode::kInvalidArgument, std::move(message));
}

}  // namespace fabric
