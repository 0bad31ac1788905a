// The engine's two-sided messages. Every message a group sends starts with a header: one kind
// byte, the sending worker's id, the message's sequence number and the length of what follows. User
// messages (submit_send) and the staged path's control messages share the receive buffers that
// every NIC of a group keeps posted; the worker tells them apart by the kind byte.
//
// Failover (docs/failover.md) may send a message again over another NIC when it cannot know
// whether the first copy arrived; the receiver drops a (sender, sequence) pair it has already
// seen (SeenWindow), so every message is delivered at most once.
//
// The staged path (GPU memory that a NIC cannot reach, docs/engine.md): a writer puts the data
// into the owner's pinned host mirror, then sends a Commit naming the ranges it wrote; the
// owner copies them into the GPU, counts the Commit's immediate `imm_times` times (after the
// copies), and answers with an Ack. The writer's transfer completes on the last Ack.
//
// A read Commit (kReadCommit, same body, no immediate) turns the direction: a reader asks the
// owner of a region to copy the named ranges out of its GPU memory, into the owner's mirror (the
// staged path: the reader then reads the mirror over the fabric) or, with a CUDA IPC section,
// straight into the reader's exported GPU memory; the owner answers with an Ack once they are
// there, and only for a region it registered readable.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "common/codec.h"
#include "cuda/ipc.h"
#include "fabric/address.h"
#include "fabric/status.h"

namespace fabric::engine {

// kHello .. kFenceAck: the write fence (docs/hardening.md, "Unregister is a barrier").
enum class MessageKind : uint8_t {
  kUser = 1,
  kCommit = 2,
  kAck = 3,
  kHello = 4,
  kHelloAck = 5,
  kFence = 6,
  kFenceAck = 7,
  kGoodbye = 8,
  kReadCommit = 9,
};
// kind (1), sender (8), sequence (8), body length (4). The body length lets the receiver tell a
// message from one a provider handed over with bytes after it or cut short (seen once on
// libfabric tcp;ofi_rxm after a reconnect: a Hello arrived with 21 stale bytes behind it).
constexpr uint64_t kMessageHeaderBytes = 21;

struct MessageHeader {
  MessageKind kind;
  uint64_t sender;
  uint64_t seq;
  uint32_t body_length;
};

// A header with sender, sequence and length zero (stamped when the message is first sent).
inline void put_header(detail::ByteWriter& w, MessageKind kind) {
  w.u8(static_cast<uint8_t>(kind));
  w.u64(0);
  w.u64(0);
  w.u32(0);
}

// Stamps the sender, the sequence and the body's length (the message must be complete).
inline void stamp_header(Bytes& message, uint64_t sender, uint64_t seq) {
  const auto body = static_cast<uint32_t>(message.size() - kMessageHeaderBytes);
  std::memcpy(message.data() + 1, &sender, sizeof(sender));
  std::memcpy(message.data() + 9, &seq, sizeof(seq));
  std::memcpy(message.data() + 17, &body, sizeof(body));
}

inline std::optional<MessageHeader> read_header(std::span<const std::byte> message) {
  detail::ByteReader r(message);
  uint8_t kind = 0;
  MessageHeader h{};
  if (!r.u8(kind) || !r.u64(h.sender) || !r.u64(h.seq) || !r.u32(h.body_length)) {
    return std::nullopt;
  }
  h.kind = static_cast<MessageKind>(kind);
  return h;
}

// The sequence numbers seen from one sender (they start at 1): everything up to `floor`, and
// the ones above it. Messages are unordered, so gaps are normal; a gap that stays open (a
// message whose sender gave up on it) would grow the set for ever, so past kMaxAbove entries
// the floor moves up over the oldest gap: a copy of a message that old arriving later is then
// dropped (its sender reported it failed, which allows either outcome).
class SeenWindow {
 public:
  static constexpr size_t kMaxAbove = size_t{1} << 16;

  // False when seq was seen before (or is 0, which no sender uses).
  bool insert(uint64_t seq) {
    if (seq <= floor_ || !above_.insert(seq).second) return false;
    while (above_.size() > kMaxAbove) {
      floor_ = *above_.begin();
      above_.erase(above_.begin());
      compact();
    }
    compact();
    return true;
  }
  uint64_t floor() const { return floor_; }
  size_t above() const { return above_.size(); }

 private:
  void compact() {
    while (!above_.empty() && *above_.begin() == floor_ + 1) {
      ++floor_;
      above_.erase(above_.begin());
    }
  }
  uint64_t floor_ = 0;
  std::set<uint64_t> above_;
};

struct Range {
  uint64_t offset;
  uint64_t length;
};

// The CUDA IPC path (docs/cuda-ipc.md): a Commit that carries the writer's exported source. The
// owner maps it (once per writer allocation, cached), copies each range GPU to GPU from the
// source offset into its region, and only then counts the immediate and acknowledges.
struct IpcSource {
  cuda::IpcExport exported;       // the writer's source allocation
  uint64_t region = 0;            // the writer's source registration id (for logs)
  uint64_t length = 0;            // the source registration's length: offsets past it are refused
  std::vector<uint64_t> offsets;  // per range of the Commit: where its bytes start in the source
  friend bool operator==(const IpcSource&, const IpcSource&) = default;
};

struct Commit {
  uint64_t transfer = 0;  // the writer's transfer id, echoed in the Ack
  Bytes reply_to;         // the writer's group Address (encoded): the Ack may use any rail
  uint64_t region = 0;    // the owner's staged region id; 0: host memory (Config::reliable_imm)
  bool has_imm = false;
  uint32_t imm = 0;
  uint64_t imm_times = 0;  // arrivals of imm to count once the ranges are in device memory
  std::vector<Range> ranges;
  std::optional<IpcSource> ipc;  // the CUDA IPC path: copy from here, not from the mirror
  // A read Commit (sent as kReadCommit; decode() leaves it false, the receiver sets it from the
  // header): the ranges are the owner's to copy out; `ipc` is then the reader's destination.
  bool read = false;

  // Fixed bytes of the message before the ranges, plus the reply address.
  static constexpr uint64_t kFixedBytes = kMessageHeaderBytes + 8 + 4 + 8 + 1 + 4 + 8 + 4;
  static constexpr uint64_t kRangeBytes = 16;
  // Most arrivals one Commit may ask the owner to count (a paged write counts one per page).
  // The owner tallies them one by one, so a corrupt count must not make it loop for ever.
  static constexpr uint64_t kMaxImmTimes = uint64_t{1} << 24;
  // The CUDA IPC trailer after the ranges: flag, kind, handle length + handle (at most
  // cuda::IpcExport::kMaxHandleBytes), allocation offset, GPU UUID, source region, source
  // length, then one source offset per range.
  static constexpr uint64_t kIpcFixedBytes = 1 + 1 + 1 + 8 + 16 + 8 + 8;
  static constexpr uint64_t kIpcRangeBytes = 8;

  Bytes encode() const {
    detail::ByteWriter w;
    put_header(w, read ? MessageKind::kReadCommit : MessageKind::kCommit);
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
    if (ipc) {
      w.u8(1);
      w.u8(static_cast<uint8_t>(ipc->exported.kind));
      w.u8(static_cast<uint8_t>(ipc->exported.handle.size()));
      w.bytes(ipc->exported.handle);
      w.u64(ipc->exported.offset);
      w.bytes(ipc->exported.device);
      w.u64(ipc->region);
      w.u64(ipc->length);
      for (uint64_t o : ipc->offsets) w.u64(o);
    }
    return w.take();
  }

  // `in` starts after the header.
  static std::optional<Commit> decode(std::span<const std::byte> in) {
    detail::ByteReader r(in);
    Commit c;
    uint32_t name_len = 0, count = 0;
    uint8_t has_imm = 0;
    if (!r.u64(c.transfer) || !r.u32(name_len) || !r.bytes(name_len, c.reply_to) ||
        !r.u64(c.region) || !r.u8(has_imm) || !r.u32(c.imm) || !r.u64(c.imm_times) ||
        !r.u32(count) || r.remaining() < uint64_t{count} * kRangeBytes ||
        c.imm_times > kMaxImmTimes) {
      return std::nullopt;
    }
    c.has_imm = has_imm != 0;
    c.ranges.resize(count);
    for (Range& range : c.ranges) {
      if (!r.u64(range.offset) || !r.u64(range.length)) return std::nullopt;
    }
    if (r.remaining() == 0) return c;
    uint8_t flag = 0, kind = 0, handle_len = 0;
    IpcSource& s = c.ipc.emplace();
    Bytes uuid;
    if (!r.u8(flag) || flag != 1 || !r.u8(kind) || kind == 0 ||
        kind > static_cast<uint8_t>(cuda::IpcExport::Kind::kCudaVmm) || !r.u8(handle_len) ||
        handle_len > cuda::IpcExport::kMaxHandleBytes || !r.bytes(handle_len, s.exported.handle) ||
        !r.u64(s.exported.offset) || !r.bytes(s.exported.device.size(), uuid) || !r.u64(s.region) ||
        !r.u64(s.length) || r.remaining() != uint64_t{count} * kIpcRangeBytes) {
      return std::nullopt;
    }
    s.exported.kind = static_cast<cuda::IpcExport::Kind>(kind);
    std::copy(uuid.begin(), uuid.end(), s.exported.device.begin());
    s.offsets.resize(count);
    for (uint64_t& o : s.offsets) {
      if (!r.u64(o)) return std::nullopt;
    }
    return c;
  }
};

struct Ack {
  uint64_t transfer = 0;
  uint64_t commit = 0;  // the Commit's sequence number: a Commit sent twice is acknowledged once
  ErrorCode code = ErrorCode::kOk;
  std::string message;

  Bytes encode() const {
    detail::ByteWriter w;
    put_header(w, MessageKind::kAck);
    w.u64(transfer);
    w.u64(commit);
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
    if (!r.u64(a.transfer) || !r.u64(a.commit) || !r.u8(code) || !r.u32(len) ||
        !r.bytes(len, text) || r.remaining() != 0) {
      return std::nullopt;
    }
    a.code = static_cast<ErrorCode>(code);
    a.message.assign(reinterpret_cast<const char*>(text.data()), text.size());
    return a;
  }
};

// The write fence, for providers that check a write's key only when its first bytes arrive
// (libfabric tcp), where closing a registration does not stop a write already streaming in:
//   - kHello: a writer announces itself (`from`) before its first write towards an owner;
//   - kHelloAck: the owner (`from`) has recorded it; the writer's writes may go;
//   - kFence: an owner (`from`) closed a registration; round `round` asks every writer it knows
//     to answer from each of its NICs;
//   - kFenceAck: writer `from` answers round `round` from its NIC `nic`, over the connection its
//     writes take, so its arrival means every write that writer posted on that NIC before it
//     has arrived whole;
//   - kGoodbye: writer `from` is closing; sent from its NIC `nic` behind every write that NIC
//     posted, so once one has come from each of its NICs the owner need not fence it again.
struct FenceNote {
  MessageKind kind = MessageKind::kHello;
  uint64_t round = 0;
  uint32_t nic = 0;
  Bytes from;  // the sender's group Address (encoded)

  static bool is_fence_kind(MessageKind k) {
    return k == MessageKind::kHello || k == MessageKind::kHelloAck || k == MessageKind::kFence ||
           k == MessageKind::kFenceAck || k == MessageKind::kGoodbye;
  }

  Bytes encode() const {
    detail::ByteWriter w;
    put_header(w, kind);
    w.u64(round);
    w.u32(nic);
    w.u32(static_cast<uint32_t>(from.size()));
    w.bytes(from);
    return w.take();
  }

  // `in` starts after the header.
  static std::optional<FenceNote> decode(MessageKind kind, std::span<const std::byte> in) {
    detail::ByteReader r(in);
    FenceNote n;
    n.kind = kind;
    uint32_t len = 0;
    if (!is_fence_kind(kind) || !r.u64(n.round) || !r.u32(n.nic) || !r.u32(len) ||
        !r.bytes(len, n.from) || r.remaining() != 0) {
      return std::nullopt;
    }
    return n;
  }
};

}  // namespace fabric::engine
