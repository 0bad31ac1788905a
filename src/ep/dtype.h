// The names of fabric::ep's token dtypes, as errors (and the Python module's arguments) spell them.
#pragma once

#include "fabric/ep.h"

namespace fabric::ep {

inline const char* dtype_name(TokenDtype d) {
  switch (d) {
    case TokenDtype::kBf16:
      return "bf16";
    case TokenDtype::kFp8E4m3:
      return "fp8_e4m3";
  }
  return "unknown";
}

}  // namespace fabric::ep
