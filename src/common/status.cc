#include "fabric/status.h"

#include <fmt/format.h>

namespace fabric {

std::string_view to_string(ErrorCode code) {
  switch (code) {
    case ErrorCode::kOk:
      return "Ok";
    case ErrorCode::kInvalidArgument:
      return "InvalidArgument";
    case ErrorCode::kOutOfRange:
      return "OutOfRange";
    case ErrorCode::kNotFound:
      return "NotFound";
    case ErrorCode::kAlreadyExists:
      return "AlreadyExists";
    case ErrorCode::kClosed:
      return "Closed";
    case ErrorCode::kUnsupported:
      return "Unsupported";
    case ErrorCode::kCancelled:
      return "Cancelled";
    case ErrorCode::kTimeout:
      return "Timeout";
    case ErrorCode::kPeerUnreachable:
      return "PeerUnreachable";
    case ErrorCode::kRemoteAccess:
      return "RemoteAccess";
    case ErrorCode::kFabric:
      return "Fabric";
    case ErrorCode::kInternal:
      return "Internal";
  }
  return "Unknown";
}

std::string Status::to_string() const {
  if (is_ok()) return "Ok";
  return fmt::format("{}: {}", fabric::to_string(code_), message_);
}

}  // namespace fabric
