// fabric-lib error codes as NIXL status codes: the one place the mapping is decided.
#pragma once

#include "fabric/status.h"
#include "nixl_types.h"

namespace fabric::nixl_backend {

constexpr nixl_status_t to_nixl(ErrorCode code) {
  switch (code) {
    case ErrorCode::kOk:
      return NIXL_SUCCESS;
    case ErrorCode::kInvalidArgument:
    case ErrorCode::kOutOfRange:  // a descriptor outside its registration
      return NIXL_ERR_INVALID_PARAM;
    case ErrorCode::kNotFound:  // unknown agent, unregistered memory
      return NIXL_ERR_NOT_FOUND;
    case ErrorCode::kAlreadyExists:
    case ErrorCode::kRemoteAccess:  // the peer refused: stale or unreadable registration
      return NIXL_ERR_NOT_ALLOWED;
    case ErrorCode::kUnsupported:
      return NIXL_ERR_NOT_SUPPORTED;
    case ErrorCode::kCancelled:
      return NIXL_ERR_CANCELED;
    case ErrorCode::kPeerUnreachable:  // a peer that died or closed mid-transfer
      return NIXL_ERR_REMOTE_DISCONNECT;
    case ErrorCode::kClosed:
    case ErrorCode::kTimeout:
    case ErrorCode::kFabric:
    case ErrorCode::kInternal:
      return NIXL_ERR_BACKEND;
  }
  return NIXL_ERR_UNKNOWN;
}

inline nixl_status_t to_nixl(const Status& status) {
  return to_nixl(status.code());
}

}  // namespace fabric::nixl_backend
