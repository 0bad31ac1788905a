// The shared-memory layout of the same-host transport (docs/shm.md) and its rings.
//
// Each endpoint owns one region: a header, then kSlots inbound slots. A sender claims a slot
// with a compare-and-swap on its owner word and is then the slot's only producer; the region's
// owner is its only consumer. Nothing in a region is a lock: a process that dies while writing
// leaves at most an unpublished record behind, never a word another process waits on.
//
// Every field another process writes is read as untrusted: record sizes are checked against the
// published bytes before use, and a slot whose records do not add up is dropped whole.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace fabric::transport::shm {

inline constexpr uint64_t kMagic = 0x3130'4d48'5342'4146ULL;  // "FABSHM01", little-endian
inline constexpr uint32_t kVersion = 1;
inline constexpr uint32_t kSlots = 64;
inline constexpr uint64_t kRecordAlign = 64;
inline constexpr size_t kNameMax = 64;  // region names, NUL included

// Reads and writes of words another process also touches.
template <typename T>
T load(const T& word, std::memory_order order = std::memory_order_acquire) {
  return std::atomic_ref<T>(const_cast<T&>(word)).load(order);
}
template <typename T>
void store(T& word, T value, std::memory_order order = std::memory_order_release) {
  std::atomic_ref<T>(word).store(value, order);
}
template <typename T>
bool compare_exchange(T& word, T& expected, T desired) {
  return std::atomic_ref<T>(word).compare_exchange_strong(expected, desired,
                                                          std::memory_order_acq_rel);
}

struct alignas(64) RegionHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t slots;
  uint64_t ring_bytes;   // per slot, a power of two
  uint64_t owner_pid;    // the process that made the region
  uint64_t owner_start;  // its start time (clock ticks after boot, /proc/<pid>/stat field 22)
  uint64_t owner_pidns;  // inode of its PID namespace: pids are only compared within one
  uint32_t closed;       // set by the owner on close(): senders fail what is outstanding
  uint32_t doorbell;     // 1: the owner waits on a datagram socket named "\0" + region name
  uint64_t active_mask;  // bit i: slot i was claimed at least once (the consumer scans these)
  // Set by the owner before it blocks (after checking its rings), cleared when it polls: a
  // sender that published records and then clears it (compare-and-swap) sends the owner a
  // datagram, so one sleep costs one wake-up.
  alignas(64) uint32_t sleeping;
};

// Slot claim word: 0 free, else owner pid << 32 | a random non-zero token of that claim.
inline uint32_t owner_pid(uint64_t word) {
  return static_cast<uint32_t>(word >> 32);
}
inline uint32_t owner_token(uint64_t word) {
  return static_cast<uint32_t>(word);
}

// What the receiver found when it tried to read the claimer's memory (process_vm_readv).
enum : uint32_t { kCmaUnknown = 0, kCmaYes = 1, kCmaNo = 2 };

struct alignas(64) SlotHeader {
  uint64_t owner;        // claim word, above
  uint64_t owner_start;  // the claimer's start time, written after the claim
  uint64_t owner_pidns;  // the claimer's PID namespace (inode), written after the claim
  uint32_t ready;        // token of the claim whose fields below are written
  uint32_t reserved;
  uint64_t cma;         // the consumer's kCma* finding, tagged: token << 32 | finding
  uint64_t probe_addr;  // the claimer's address of probe_value, for the consumer's CMA check
  uint64_t probe_value;
  char sender[kNameMax];      // the claimer's own region: where acknowledgements go
  alignas(64) uint64_t tail;  // bytes published so far (producer)
  alignas(64) uint64_t head;  // bytes consumed so far (consumer)
};

// kRead: a reader asks the owner for `length` bytes at `addr` (key `key`) into its own memory at
// `src`; the owner answers with kReadData records carrying the bytes (or copies them into the
// reader itself by process_vm_writev), then a kAck.
enum class RecordKind : uint8_t {
  kPad = 1,
  kWrite = 2,
  kSend = 3,
  kAck = 4,
  kRead = 5,
  kReadData = 6,
};
// kCma: a write the receiver copies from the writer's memory, always one record (kFirst and
// kLast too; the reader refuses one without).
enum RecordFlags : uint8_t { kHasImm = 1, kFirst = 2, kLast = 4, kCma = 8 };

// One record: this header, then `inline_bytes` of payload, padded to kRecordAlign.
struct Record {
  uint32_t bytes;  // the whole record, header included: a multiple of kRecordAlign
  RecordKind kind;
  uint8_t flags;
  uint16_t status;  // kAck: an ErrorCode
  uint32_t token;   // the claim that wrote it: records of an earlier claim are dropped
  uint32_t imm;
  uint64_t seq;     // the sender's operation (kAck: the operation acknowledged)
  uint64_t addr;    // kWrite, kRead: the receiver's address of the first byte; kReadData: the
                    // reader's
  uint64_t key;     // kWrite, kRead: the registration it must lie in
  uint64_t length;  // kWrite + kCma, kRead: bytes at `src` / `addr`; else payload bytes here
  uint64_t src;     // kWrite + kCma: the writer's address; kRead: where the reader wants them
  uint64_t total;   // kSend: the whole message's length
};
static_assert(sizeof(Record) == kRecordAlign);

// Where records start: head and tail are multiples of kRecordAlign, unless a broken or dying
// claimer left the tail elsewhere (the words are shared memory). Both ends then move on to the
// next multiple, so no record is ever read or written across the ring's end.
inline uint64_t align_record(uint64_t at) {
  return (at + kRecordAlign - 1) & ~(kRecordAlign - 1);
}

inline uint64_t record_bytes(uint64_t payload) {
  return (sizeof(Record) + payload + kRecordAlign - 1) / kRecordAlign * kRecordAlign;
}

// The bytes of a region with `ring_bytes` per slot.
uint64_t region_bytes(uint64_t ring_bytes);
// Slot i of a mapped region, and its ring.
SlotHeader* slot_at(void* region, uint64_t ring_bytes, uint32_t i);
std::byte* ring_of(SlotHeader* slot);

// The inode of this process's PID namespace (/proc/self/ns/pid), 0 where unknown. A pid (and
// so a liveness check) means something only within one namespace.
uint64_t this_pid_namespace();

// Claims a slot of a mapped region for a sender (pid, start time, a random non-zero token):
// a free slot first, else one whose owner process is dead (reclaimed). Writes the claim's
// fields (sender name, CMA probe) and publishes it. Returns the slot index, or -1 when every
// slot has a live owner. Owners in another PID namespace are never taken for dead.
int claim_slot(void* region, uint64_t ring_bytes, uint32_t pid, uint64_t start_time, uint32_t token,
               const char* sender, const uint64_t* probe);
// Lets go of a claim (nothing happens when the slot no longer holds it).
void release_slot(SlotHeader* slot, uint64_t word);

// Producer side of one slot (the claimer). Not thread-safe; one per claim.
class RingWriter {
 public:
  RingWriter() = default;
  RingWriter(SlotHeader* slot, uint64_t ring_bytes)
      : slot_(slot),
        ring_(ring_of(slot)),
        size_(ring_bytes),
        tail_(align_record(load(slot->tail))) {}
  bool valid() const { return slot_ != nullptr; }
  // Bytes a record may carry at most (a quarter of the ring).
  uint64_t max_payload() const { return size_ / 4 - sizeof(Record); }
  // Appends `r` (its `bytes` set here) with `n` bytes of payload; false (nothing written) when
  // the ring lacks room. Publishes it at once.
  bool push(Record r, const void* payload, uint64_t n);

 private:
  SlotHeader* slot_ = nullptr;
  std::byte* ring_ = nullptr;
  uint64_t size_ = 0;
  uint64_t tail_ = 0;
};

// Consumer side of one slot (the region's owner).
class RingReader {
 public:
  RingReader() = default;
  RingReader(SlotHeader* slot, uint64_t ring_bytes)
      : slot_(slot), ring_(ring_of(slot)), size_(ring_bytes), head_(load(slot->head)) {}
  bool valid() const { return slot_ != nullptr; }
  enum class Next { kEmpty, kRecord, kCorrupt };
  // The next published record (skipping padding): its header copied into `out` and its
  // payload at `payload` (inline bytes, checked to lie inside the record). kCorrupt: the
  // published bytes do not parse; drop() then discards them.
  Next peek(Record& out, const std::byte*& payload);
  void pop(const Record& r);
  void drop();  // everything published so far

 private:
  SlotHeader* slot_ = nullptr;
  std::byte* ring_ = nullptr;
  uint64_t size_ = 0;
  uint64_t head_ = 0;
};

}  // namespace fabric::transport::shm
