// The messages of the KV flow, carried by the engine's send/recv. Little-endian, versioned by
// a magic word; decode() names the first field that does not fit.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fabric/address.h"
#include "fabric/kv/layout.h"
#include "fabric/status.h"

namespace fabric::kv::wire {

constexpr uint32_t kMagic = 0x314d564b;  // "KVM1"

enum class Type : uint8_t {
  kPull = 1,      // decoder -> prefiller: write this request's layers into these pages
  kCancel = 2,    // decoder -> prefiller: stop writing this request
  kFinished = 3,  // prefiller -> decoder: nothing of this request is in flight from me (error)
  kPing = 4,      // either way: liveness (a failed send marks the peer dead)
};

struct Message {
  Type type = Type::kPing;
  uint64_t request = 0;
  uint32_t decode_rank = 0;   // the decoder rank the message is about
  uint32_t prefill_rank = 0;  // the prefill rank the message is about (kFinished)
  // kPull
  uint32_t imm = 0;
  uint32_t prefill_tp = 0;  // the prefill TP size the decoder planned with
  KvLayout layout;          // the decoder's layout
  std::vector<uint32_t> pages;
  Bytes memory;  // the decoder's RemoteMemory, encoded
  // kCancel, kPing: the sender's address, encoded (replies go there)
  Bytes sender;
  // kFinished
  uint32_t code = 0;
  std::string text;
};

Bytes encode(const Message& m);
Result<Message> decode(std::span<const std::byte> bytes);

}  // namespace fabric::kv::wire
