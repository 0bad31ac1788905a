// Fuzz target: the engine's own two-sided messages (src/engine/messages.h) as a worker receives
// them: a header (kind byte, sender, sequence), then a Commit (with or without the CUDA IPC
// path's source trailer), an Ack or a write-fence note (FenceNote) (user messages are handed over
// as bytes). Properties: decoding never crashes or over-reads; an accepted message is within the
// bounds the worker relies on (imm_times at most kMaxImmTimes, one 16-byte entry per range) and
// re-encodes to exactly the input.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include "engine/messages.h"
#include "fuzz_check.h"

using namespace fabric::engine;
namespace cuda = fabric::cuda;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < kMessageHeaderBytes) return 0;  // the worker drops empty messages
  const auto message = std::as_bytes(std::span(data, size));
  const auto body = message.subspan(kMessageHeaderBytes);
  // encode() leaves sender and sequence zero (the worker stamps them): compare the rest.
  auto same = [&](const fabric::Bytes& encoded) {
    return encoded.size() == size && encoded[0] == message[0] &&
           std::equal(encoded.begin() + kMessageHeaderBytes, encoded.end(), body.begin());
  };
  switch (static_cast<MessageKind>(data[0])) {
    case MessageKind::kCommit: {
      auto c = Commit::decode(body);
      if (!c) break;
      FUZZ_CHECK(c->imm_times <= Commit::kMaxImmTimes, "imm_times bounded");
      // With a CUDA IPC source: its trailer and one source offset per range follow.
      const uint64_t ipc_bytes = c->ipc ? Commit::kIpcFixedBytes + c->ipc->exported.handle.size() +
                                              c->ranges.size() * Commit::kIpcRangeBytes
                                        : 0;
      FUZZ_CHECK(!c->ipc || c->ipc->offsets.size() == c->ranges.size(),
                 "one source offset per range");
      FUZZ_CHECK(!c->ipc || c->ipc->exported.handle.size() <= cuda::IpcExport::kMaxHandleBytes,
                 "the handle is bounded");
      FUZZ_CHECK(body.size() == Commit::kFixedBytes - kMessageHeaderBytes + c->reply_to.size() +
                                    c->ranges.size() * Commit::kRangeBytes + ipc_bytes,
                 "the ranges (and the IPC source) are what the message holds");
      // has_imm is one byte on the wire, read as a bool: only 0 and 1 round-trip exactly.
      const bool canonical = static_cast<uint8_t>(body[8 + 4 + c->reply_to.size() + 8]) <= 1;
      if (canonical) FUZZ_CHECK(same(c->encode()), "encode(decode(m)) == m");
      break;
    }
    case MessageKind::kAck: {
      auto a = Ack::decode(body);
      if (!a) break;
      FUZZ_CHECK(same(a->encode()), "encode(decode(m)) == m");
      break;
    }
    case MessageKind::kHello:
    case MessageKind::kHelloAck:
    case MessageKind::kFence:
    case MessageKind::kFenceAck:
    case MessageKind::kGoodbye: {
      auto n = FenceNote::decode(static_cast<MessageKind>(data[0]), body);
      if (!n) break;
      FUZZ_CHECK(body.size() == 8 + 4 + 4 + n->from.size(), "the address is what the note holds");
      FUZZ_CHECK(same(n->encode()), "encode(decode(m)) == m");
      break;
    }
    default:
      break;  // user messages and unknown kinds are not parsed by the engine
  }
  return 0;
}
