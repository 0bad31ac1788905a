// Status and Result: how every fallible fabric-lib call reports failure.
//
// No exceptions cross the public API. A call that can fail returns a Status (nothing else to
// return) or a Result<T> (a value or a Status). Both are [[nodiscard]].
#pragma once

#include <cassert>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace fabric {

enum class ErrorCode {
  kOk = 0,
  kInvalidArgument,  // malformed input: bad descriptor bytes, zero count, wrong version
  kOutOfRange,       // offset/length/page index outside a registered range
  kNotFound,         // unknown memory handle, peer group, or immediate expectation
  kAlreadyExists,    // a second expectation for the same immediate, a second receive pool
  kClosed,           // the engine is closed or closing
  kUnsupported,      // the provider or build cannot do this
  kCancelled,        // the transfer was abandoned because the engine closed
  kTimeout,          // a bounded wait ran out
  kPeerUnreachable,  // the fabric could not reach the peer (refused, reset, unknown)
  kRemoteAccess,     // the peer rejected the access (stale key, range outside its region)
  kFabric,           // any other provider error; the message carries the provider's text
  kInternal,         // a bug in fabric-lib
};

// The name of a code, e.g. "OutOfRange".
std::string_view to_string(ErrorCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(ErrorCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() { return {}; }

  bool is_ok() const { return code_ == ErrorCode::kOk; }
  explicit operator bool() const { return is_ok(); }
  ErrorCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "OutOfRange: dst_offset 4096 + length 8 exceeds the remote region's 4096 bytes"
  std::string to_string() const;

  // Ignores the status on purpose, where the caller has no way to act on it.
  void ignore() const {}

 private:
  ErrorCode code_ = ErrorCode::kOk;
  std::string message_;
};

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {
    assert(!std::get<Status>(v_).is_ok() && "a Result holding a Status must hold an error");
  }

  bool is_ok() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return is_ok(); }

  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

  // The error; Status::ok() when the result holds a value.
  Status status() const { return is_ok() ? Status::ok() : std::get<Status>(v_); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace fabric
