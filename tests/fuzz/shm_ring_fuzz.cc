// Fuzz target: one slot of the same-host transport's shared region as its consumer reads it
// (src/transport/shm/shm_ring.h), holding whatever another process wrote: the slot's head and
// tail words and the ring's bytes. Properties: the reader never reads outside the ring (ASan
// guards its ends); a record it hands out is a whole number of 64-byte units, inside what was
// published and inside the ring; a record that carries bytes (a send, a write through the ring)
// carries them inside itself; a write to be copied from the writer's memory (kCma) is one whole
// record; consuming never goes past the tail; after kCorrupt, drop() leaves the slot empty.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "fuzz_check.h"
#include "transport/shm/shm_ring.h"

using namespace fabric::transport::shm;

namespace {

constexpr uint64_t kRing = 4096;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 8) return 0;
  uint32_t head = 0, ahead = 0;
  std::memcpy(&head, data, 4);
  std::memcpy(&ahead, data + 4, 4);
  // The slot header, then exactly the ring: a read past its end leaves the allocation.
  std::unique_ptr<void, FreeDeleter> memory(std::aligned_alloc(64, sizeof(SlotHeader) + kRing));
  auto* slot = new (memory.get()) SlotHeader{};
  std::byte* ring = ring_of(slot);
  std::memset(ring, 0, kRing);
  std::memcpy(ring, data + 8, std::min<size_t>(size - 8, kRing));
  slot->head = head;
  slot->tail = uint64_t{head} + ahead;

  RingReader reader(slot, kRing);
  for (int n = 0; n < 200; ++n) {
    const uint64_t before = load(slot->head);
    Record rec{};
    const std::byte* payload = nullptr;
    const auto next = reader.peek(rec, payload);
    const uint64_t at = load(slot->head);  // padding was skipped
    FUZZ_CHECK(at >= before && at <= load(slot->tail), "the head stays within what was published");
    if (next == RingReader::Next::kEmpty) {
      FUZZ_CHECK(at == load(slot->tail), "empty only at the tail");
      break;
    }
    if (next == RingReader::Next::kCorrupt) {
      reader.drop();
      FUZZ_CHECK(load(slot->head) == load(slot->tail), "drop() empties the slot");
      FUZZ_CHECK(reader.peek(rec, payload) == RingReader::Next::kEmpty, "dropped means empty");
      break;
    }
    const uint64_t pos = at & (kRing - 1);
    FUZZ_CHECK(rec.kind != RecordKind::kPad, "padding is never handed out");
    FUZZ_CHECK(rec.bytes >= sizeof(Record) && rec.bytes % kRecordAlign == 0, "whole units");
    FUZZ_CHECK(rec.bytes <= load(slot->tail) - at, "within what was published");
    FUZZ_CHECK(pos + rec.bytes <= kRing, "within the ring");
    FUZZ_CHECK(payload == ring + pos + sizeof(Record), "the payload follows the header");
    const bool cma = rec.kind == RecordKind::kWrite && (rec.flags & kCma) != 0;
    if (cma) {
      FUZZ_CHECK((rec.flags & (kFirst | kLast)) == (kFirst | kLast), "a kCma write is whole");
    } else if (rec.kind == RecordKind::kSend || rec.kind == RecordKind::kWrite) {
      FUZZ_CHECK(rec.length <= rec.bytes - sizeof(Record), "carried bytes inside the record");
      // Touch them: ASan reports a read past the ring.
      volatile std::byte sink{};
      for (uint64_t i = 0; i < rec.length; ++i) sink = payload[i];
      (void)sink;
    }
    reader.pop(rec);
    FUZZ_CHECK(load(slot->head) == at + rec.bytes, "pop() consumes exactly the record");
  }
  return 0;
}
