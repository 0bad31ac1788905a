#include "transport/shm/shm_ring.h"

#include <sys/stat.h>

#include "fabric/address.h"

namespace fabric::transport::shm {

namespace {

constexpr uint64_t kHeaderBytes = 4096;

uint64_t slot_stride(uint64_t ring_bytes) {
  return sizeof(SlotHeader) + ring_bytes;
}

}  // namespace

uint64_t region_bytes(uint64_t ring_bytes) {
  return kHeaderBytes + kSlots * slot_stride(ring_bytes);
}

SlotHeader* slot_at(void* region, uint64_t ring_bytes, uint32_t i) {
  return reinterpret_cast<SlotHeader*>(static_cast<std::byte*>(region) + kHeaderBytes +
                                       i * slot_stride(ring_bytes));
}

std::byte* ring_of(SlotHeader* slot) {
  return reinterpret_cast<std::byte*>(slot + 1);
}

namespace {

void take(SlotHeader* s, uint64_t word, uint64_t start_time, const char* sender,
          const uint64_t* probe) {
  store(s->owner_start, start_time);
  store(s->owner_pidns, this_pid_namespace());
  store(s->cma, uint64_t{0});
  s->probe_addr = reinterpret_cast<uint64_t>(probe);
  s->probe_value = *probe;
  std::memset(s->sender, 0, sizeof(s->sender));
  std::strncpy(s->sender, sender, sizeof(s->sender) - 1);
  store(s->ready, owner_token(word));
}

}  // namespace

uint64_t this_pid_namespace() {
  static const uint64_t ns = [] {
    struct stat st {};
    return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
  }();
  return ns;
}

int claim_slot(void* region, uint64_t ring_bytes, uint32_t pid, uint64_t start_time, uint32_t token,
               const char* sender, const uint64_t* probe) {
  auto* header = static_cast<RegionHeader*>(region);
  const uint64_t word = uint64_t{pid} << 32 | token;
  // Free slots first; only when none is left, those of dead processes (reading /proc).
  for (int pass = 0; pass < 2; ++pass) {
    for (uint32_t i = 0; i < kSlots; ++i) {
      SlotHeader* s = slot_at(region, ring_bytes, i);
      uint64_t seen = load(s->owner);
      if (pass == 0 && seen != 0) continue;
      if (pass == 1) {
        if (seen == 0) continue;
        Origin o;
        o.pid = owner_pid(seen);
        o.start_time = load(s->owner_start);
        if (o.pid == pid && o.start_time == start_time) continue;  // ours (another claim)
        const uint64_t ns = load(s->owner_pidns);
        if (ns != 0 && ns != this_pid_namespace()) continue;  // its pid means nothing here
        if (o.process_alive()) continue;
      }
      if (!compare_exchange(s->owner, seen, word)) continue;
      take(s, word, start_time, sender, probe);
      std::atomic_ref<uint64_t>(header->active_mask)
          .fetch_or(uint64_t{1} << i, std::memory_order_acq_rel);
      return static_cast<int>(i);
    }
  }
  return -1;
}

void release_slot(SlotHeader* slot, uint64_t word) {
  uint64_t expected = word;
  compare_exchange(slot->owner, expected, uint64_t{0});
}

bool RingWriter::push(Record r, const void* payload, uint64_t n) {
  if (n > max_payload()) return false;
  const uint64_t need = record_bytes(n);
  const uint64_t used = tail_ - load(slot_->head);
  if (used > size_) return false;  // the consumer's word makes no sense: treat as full
  const uint64_t free = size_ - used;
  uint64_t pos = tail_ & (size_ - 1);
  const uint64_t pad = pos + need > size_ ? size_ - pos : 0;
  if (pad + need > free) return false;
  if (pad > 0) {
    Record p{};
    p.bytes = static_cast<uint32_t>(pad);
    p.kind = RecordKind::kPad;
    p.token = r.token;
    std::memcpy(ring_ + pos, &p, sizeof(p));
    tail_ += pad;
    pos = 0;
  }
  r.bytes = static_cast<uint32_t>(need);
  std::memcpy(ring_ + pos, &r, sizeof(r));
  if (n > 0) std::memcpy(ring_ + pos + sizeof(r), payload, n);
  tail_ += need;
  // seq_cst, not just release: the doorbell (ShmDomain::ring) needs it ordered before the
  // sender's look at the owner's `sleeping` word.
  store(slot_->tail, tail_, std::memory_order_seq_cst);
  return true;
}

RingReader::Next RingReader::peek(Record& out, const std::byte*& payload) {
  const uint64_t tail = load(slot_->tail);
  while (head_ != tail) {
    const uint64_t avail = tail - head_;
    if (avail > size_) return Next::kCorrupt;
    if (head_ % kRecordAlign != 0) {  // drop() took a tail left unaligned: records start after
      if (align_record(head_) - head_ > avail) return Next::kCorrupt;
      head_ = align_record(head_);
      store(slot_->head, head_);
      continue;
    }
    const uint64_t pos = head_ & (size_ - 1);
    std::memcpy(&out, ring_ + pos, sizeof(out));
    if (out.bytes < sizeof(Record) || out.bytes % kRecordAlign != 0 || out.bytes > avail ||
        pos + out.bytes > size_) {
      return Next::kCorrupt;
    }
    if (out.kind == RecordKind::kPad) {
      head_ += out.bytes;
      store(slot_->head, head_);
      continue;
    }
    const bool cma = out.kind == RecordKind::kWrite && (out.flags & kCma) != 0;
    // A write by process_vm_readv is one record, first and last: nothing else reads its
    // `length` as bytes the reader may take from elsewhere.
    if (cma && (out.flags & (kFirst | kLast)) != (kFirst | kLast)) return Next::kCorrupt;
    const bool carries = out.kind == RecordKind::kSend || out.kind == RecordKind::kReadData ||
                         (out.kind == RecordKind::kWrite && !cma);
    if (carries && out.length > out.bytes - sizeof(Record)) return Next::kCorrupt;
    payload = ring_ + pos + sizeof(Record);
    return Next::kRecord;
  }
  return Next::kEmpty;
}

void RingReader::pop(const Record& r) {
  head_ += r.bytes;
  store(slot_->head, head_);
}

void RingReader::drop() {
  head_ = load(slot_->tail);
  store(slot_->head, head_);
}

}  // namespace fabric::transport::shm
