// The engine's two-sided messages. Every message a group sends starts with one kind byte:
// user messages (submit_send) and the staged path's control messages share the receive
// buffers of the group's first NIC, and the worker tells them apart by that byte.
//
// The staged path (GPU memory that a NIC cannot reach, docs/engine.md): a writer puts the data
// into the owner's pinned host mirror, then sends a Commit naming the ranges it wrote; the
// owner copies them into the GPU, counts the Commit's immediate `imm_times` times (after the
// copies), and answers with an Ack. The writer's transfer completes on the last Ack.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/codec.h"
#include "fabric/address.h"
#include "fabric/status.h"

namespace fabric::engine {

enum class MessageKind : uint8_t { kUser = 1, kCommit = 2, kAck = 3 };
constexpr uint64_t kMessageHeaderBytes = 1;

struct Range {
  uint64_t offset;
  uint64_t length;
};

struct Commit {
  uint64_t transfer = 0;  // the writer's transfer id, echoed in the Ack
  Bytes reply_to;         // the writer's first NIC endpoint name
  uint64_t region = 0;    // the owner's staged region id; 0: host memory (Config::reliable_imm)
  bool has_imm = false;
  uint32_t imm = 0;
  uint64_t imm_times = 0;  // arrivals of imm to count once the ranges are in device memory
  std::vector<Range> ranges;

  // Fixed bytes before the ranges, plus the reply address.
  static constexpr uint64_t kFixedBytes = 1 + 8 + 4 + 8 + 1 + 4 + 8 + 4;
  static constexpr uint64_t kRangeBytes = 16;
  // Most arrivals one Commit may ask the owner to count (a paged write counts one per page).
  // The owner tallies them one by one, so a corrupt count must not make it loop for ever.
  static constexpr uint64_t kMaxImmTimes = uint64_t{1} << 24;

  Bytes encode() const {
    detail::ByteWriter w;
    w.u8(static_cast<uint8_t>(MessageKind::kCommit));
    w.u64(transfer);
    w.u32(static_cast<uint32_t>(reply_to.size()));
    w.bytes(reply_to);
    w.u64(region);
    w.u8(has_imm ? 1 : 0);
    w.u32(imm);
    w.u64(imm_times);
    w.u32(static_cast<uint32_t>(ranges.size()));
    for (const Range& r : ranges) {
      w.u64(r.offset);
      w.u64(r.length);
    }
    return w.take();
  }

  // `in` starts after the kind byte.
  static std::optional<Commit> decode(std::span<const std::byte> in) {
    detail::ByteReader r(in);
    Commit c;
    uint32_t name_len = 0, count = 0;
    uint8_t has_imm = 0;
    if (!r.u64(c.transfer) || !r.u32(name_len) || !r.bytes(name_len, c.reply_to) ||
        !r.u64(c.region) || !r.u8(has_imm) || !r.u32(c.imm) || !r.u64(c.imm_times) ||
        !r.u32(count) || r.remaining() != uint64_t{count} * kRangeBytes ||
        c.imm_times > kMaxImmTimes) {
      return std::nullopt;
    }
    c.has_imm = has_imm != 0;
    c.ranges.resize(count);
    for (Range& range : c.ranges) {
      if (!r.u64(range.offset) || !r.u64(range.length)) return std::nullopt;
    }
    return c;
  }
};

struct Ack {
  uint64_t transfer = 0;
  ErrorCode code = ErrorCode::kOk;
  std::string message;

  Bytes encode() const {
    detail::ByteWriter w;
    w.u8(static_cast<uint8_t>(MessageKind::kAck));
    w.u64(transfer);
    w.u8(static_cast<uint8_t>(code));
    w.u32(static_cast<uint32_t>(message.size()));
    w.bytes(std::as_bytes(std::span(message.data(), message.size())));
    return w.take();
  }

  static std::optional<Ack> decode(std::span<const std::byte> in) {
    detail::ByteReader r(in);
    Ack a;
    uint8_t code = 0;
    uint32_t len = 0;
    Bytes text;
    if (!r.u64(a.transfer) || !r.u8(code) || !r.u32(len) || !r.bytes(len, text) ||
        r.remaining() != 0) {
      return std::nullopt;
    }
    a.code = static_cast<ErrorCode>(code);
    a.message.assign(reinterpret_cast<const char*>(text.data()), text.size());
    return a;
  }
};

}  // namespace fabric::engine
