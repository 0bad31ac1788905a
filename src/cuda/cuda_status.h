// CUDA errors as library statuses: no device or no driver is kUnsupported (a capability this
// machine lacks), anything else kFabric with CUDA's own name and text.
#pragma once

#include <cuda_runtime.h>
#include <fmt/format.h>

#include "fabric/status.h"

namespace fabric::cuda {

inline Status cuda_error(std::string_view what, cudaError_t err) {
  return Status(
      err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver ? ErrorCode::kUnsupported
                                                                     : ErrorCode::kFabric,
      fmt::format("{} failed: {} ({})", what, cudaGetErrorString(err), cudaGetErrorName(err)));
}

}  // namespace fabric::cuda
