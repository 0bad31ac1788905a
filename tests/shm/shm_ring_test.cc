// The same-host transport's rings and slots (src/transport/shm/shm_ring.h): wrap-around, a full
// ring, many messages across two threads, malformed records, and reclaiming the slot of a dead
// owner.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "fabric/address.h"
#include "transport/shm/shm_ring.h"

namespace fabric::transport::shm {
namespace {

constexpr uint64_t kRing = 4096;

// A zeroed region in this process's memory (the layout is the same as in /dev/shm).
struct Region {
  explicit Region(uint64_t ring = kRing) : ring_bytes(ring) {
    bytes = region_bytes(ring);
    base = std::aligned_alloc(4096, bytes);
    std::memset(base, 0, bytes);
  }
  ~Region() { std::free(base); }
  SlotHeader* slot(uint32_t i) const { return slot_at(base, ring_bytes, i); }
  uint64_t ring_bytes;
  uint64_t bytes;
  void* base;
};

Record record(uint64_t seq, uint64_t length) {
  Record r{};
  r.kind = RecordKind::kSend;
  r.flags = kFirst | kLast;
  r.token = 7;
  r.seq = seq;
  r.length = length;
  r.total = length;
  return r;
}

std::vector<std::byte> payload(uint64_t seq, uint64_t n) {
  std::vector<std::byte> p(n);
  for (uint64_t i = 0; i < n; ++i) p[i] = static_cast<std::byte>((seq * 31 + i) & 0xff);
  return p;
}

// Pops one record and checks it is message `seq` of `n` bytes.
void expect_next(RingReader& reader, uint64_t seq, uint64_t n) {
  Record r{};
  const std::byte* data = nullptr;
  ASSERT_EQ(reader.peek(r, data), RingReader::Next::kRecord) << "message " << seq;
  ASSERT_EQ(r.seq, seq);
  ASSERT_EQ(r.length, n);
  const auto want = payload(seq, n);
  if (n > 0) {
    ASSERT_EQ(std::memcmp(data, want.data(), n), 0) << "message " << seq;
  }
  reader.pop(r);
}

TEST(ShmRing, WrapsAroundManyTimesWithExactPayloads) {
  Region region;
  RingWriter writer(region.slot(0), kRing);
  RingReader reader(region.slot(0), kRing);
  ASSERT_EQ(writer.max_payload(), kRing / 4 - sizeof(Record));
  uint64_t next_read = 0;
  uint64_t written = 0;
  // Sizes that do not divide the ring: records end at every offset, and padding is needed.
  for (uint64_t seq = 0; seq < 5000; ++seq) {
    const uint64_t n = (seq * 37) % (writer.max_payload() + 1);
    const auto p = payload(seq, n);
    while (!writer.push(record(seq, n), p.data(), n)) {
      ASSERT_LT(next_read, seq) << "a push into an empty ring failed";
      ASSERT_NO_FATAL_FAILURE(
          expect_next(reader, next_read, (next_read * 37) % (writer.max_payload() + 1)));
      ++next_read;
    }
    written += record_bytes(n);
  }
  while (next_read < 5000) {
    ASSERT_NO_FATAL_FAILURE(
        expect_next(reader, next_read, (next_read * 37) % (writer.max_payload() + 1)));
    ++next_read;
  }
  Record r{};
  const std::byte* data = nullptr;
  EXPECT_EQ(reader.peek(r, data), RingReader::Next::kEmpty);
  EXPECT_GT(load(region.slot(0)->tail), 100 * kRing) << "the ring did not wrap often";
  EXPECT_GE(load(region.slot(0)->tail), written);  // padding included
  EXPECT_EQ(load(region.slot(0)->head), load(region.slot(0)->tail));
}

TEST(ShmRing, FullRingRefusesUntilTheConsumerFreesRoom) {
  Region region;
  RingWriter writer(region.slot(3), kRing);
  RingReader reader(region.slot(3), kRing);
  const uint64_t n = 448;  // 512-byte records: 8 fill the ring
  int pushed = 0;
  while (writer.push(record(pushed, n), payload(pushed, n).data(), n)) ++pushed;
  EXPECT_EQ(pushed, static_cast<int>(kRing / record_bytes(n)));
  // Refused again, and nothing was written meanwhile.
  EXPECT_FALSE(writer.push(record(99, 0), nullptr, 0));
  EXPECT_EQ(load(region.slot(3)->tail), kRing);
  ASSERT_NO_FATAL_FAILURE(expect_next(reader, 0, n));
  EXPECT_TRUE(writer.push(record(pushed, n), payload(pushed, n).data(), n));
  for (int i = 1; i <= pushed; ++i) ASSERT_NO_FATAL_FAILURE(expect_next(reader, i, n));
  // A record bigger than a quarter of the ring is refused outright.
  std::vector<std::byte> big(kRing);
  EXPECT_FALSE(writer.push(record(1000, kRing / 2), big.data(), kRing / 2));
}

TEST(ShmRing, ManyMessagesBetweenTwoThreads) {
  Region region(64 << 10);
  RingWriter writer(region.slot(63), region.ring_bytes);
  RingReader reader(region.slot(63), region.ring_bytes);
  constexpr uint64_t kCount = 200000;
  std::thread producer([&] {
    for (uint64_t seq = 0; seq < kCount; ++seq) {
      const uint64_t n = seq % 200;
      const auto p = payload(seq, n);
      while (!writer.push(record(seq, n), p.data(), n)) std::this_thread::yield();
    }
  });
  uint64_t seq = 0;
  uint64_t bad = 0;
  while (seq < kCount) {
    Record r{};
    const std::byte* data = nullptr;
    const auto next = reader.peek(r, data);
    if (next == RingReader::Next::kEmpty) {
      std::this_thread::yield();
      continue;
    }
    ASSERT_EQ(next, RingReader::Next::kRecord);
    const auto want = payload(seq, seq % 200);
    if (r.seq != seq || r.length != seq % 200 ||
        (r.length > 0 && std::memcmp(data, want.data(), r.length) != 0)) {
      ++bad;
    }
    reader.pop(r);
    ++seq;
  }
  producer.join();
  EXPECT_EQ(bad, 0u);
}

TEST(ShmRing, MalformedRecordsAreReportedAndDropped) {
  Region region;
  RingWriter writer(region.slot(1), kRing);
  RingReader reader(region.slot(1), kRing);
  ASSERT_TRUE(writer.push(record(1, 10), payload(1, 10).data(), 10));
  // Another process scribbles on the published record: a size that runs past what is published.
  auto* r = reinterpret_cast<Record*>(ring_of(region.slot(1)));
  r->bytes = 4096 + 64;
  Record out{};
  const std::byte* data = nullptr;
  EXPECT_EQ(reader.peek(out, data), RingReader::Next::kCorrupt);
  r->bytes = 64;
  r->length = 100;  // payload claimed beyond the record
  EXPECT_EQ(reader.peek(out, data), RingReader::Next::kCorrupt);
  // A write to be read from the writer's memory (kCma) that is not one whole record: its
  // length must not be taken for bytes in the ring either.
  r->kind = RecordKind::kWrite;
  r->length = 10;
  r->flags = kCma | kFirst;
  EXPECT_EQ(reader.peek(out, data), RingReader::Next::kCorrupt);
  r->flags = kCma | kFirst | kLast;
  r->length = 1 << 20;
  EXPECT_EQ(reader.peek(out, data), RingReader::Next::kRecord);
  reader.drop();
  EXPECT_EQ(reader.peek(out, data), RingReader::Next::kEmpty);
  // The ring still works after the drop.
  ASSERT_TRUE(writer.push(record(2, 10), payload(2, 10).data(), 10));
  ASSERT_NO_FATAL_FAILURE(expect_next(reader, 2, 10));
}

// A claimer that died or broke mid-record can leave the shared tail anywhere, say one byte
// before the ring's end (found by fuzz_shm_ring). The reader drops what does not parse, and
// neither it nor the next claimer's writer reads or writes across the ring's end: both move on
// to the next record boundary, so the next claimer's records arrive whole.
TEST(ShmRing, AnUnalignedTailIsSkippedToTheNextRecordBoundary) {
  Region region;
  SlotHeader* slot = region.slot(5);
  RingReader reader(slot, kRing);
  store(slot->tail, uint64_t{kRing - 1});  // garbage published up to one byte before the end
  Record out{};
  const std::byte* data = nullptr;
  EXPECT_EQ(reader.peek(out, data), RingReader::Next::kCorrupt);
  reader.drop();
  EXPECT_EQ(reader.peek(out, data), RingReader::Next::kEmpty);
  RingWriter writer(slot, kRing);             // the next claimer
  for (uint64_t seq = 1; seq <= 40; ++seq) {  // wraps the ring several times
    ASSERT_TRUE(writer.push(record(seq, 200), payload(seq, 200).data(), 200)) << seq;
    ASSERT_NO_FATAL_FAILURE(expect_next(reader, seq, 200));
  }
  EXPECT_EQ(load(slot->head) % kRecordAlign, 0u);
  EXPECT_EQ(load(slot->tail), load(slot->head));
}

// A PID that no process has now: a child that exited and was reaped.
uint32_t dead_pid() {
  const pid_t child = fork();
  if (child == 0) _exit(0);
  int status = 0;
  waitpid(child, &status, 0);
  return static_cast<uint32_t>(child);
}

TEST(ShmSlots, ClaimTakesFreeSlotsThenReclaimsOnlyDeadOwners) {
  Region region;
  const Origin self = Origin::of_this_process(0);
  const uint64_t probe = 42;
  // Every slot claimed by this (live) process.
  for (uint32_t i = 0; i < kSlots; ++i) {
    ASSERT_EQ(claim_slot(region.base, kRing, self.pid, self.start_time, 100 + i, "/me", &probe),
              static_cast<int>(i));
  }
  auto* header = static_cast<RegionHeader*>(region.base);
  EXPECT_EQ(load(header->active_mask), ~uint64_t{0});
  EXPECT_EQ(load(region.slot(5)->ready), 105u);
  EXPECT_STREQ(region.slot(5)->sender, "/me");
  // Another sender finds no slot: all owners live.
  EXPECT_EQ(claim_slot(region.base, kRing, 1, 1, 9, "/other", &probe), -1);
  // Slot 17's owner dies (a PID with no process): it is reclaimed, and only it.
  const uint32_t gone = dead_pid();
  store(region.slot(17)->owner, uint64_t{gone} << 32 | 555);
  store(region.slot(17)->owner_start, uint64_t{12345});
  // ... unless that owner is in another PID namespace, where the pid names another process.
  store(region.slot(17)->owner_pidns, this_pid_namespace() + 1);
  EXPECT_EQ(claim_slot(region.base, kRing, 1, 1, 9, "/other", &probe), -1);
  store(region.slot(17)->owner_pidns, this_pid_namespace());
  EXPECT_EQ(claim_slot(region.base, kRing, 1, 1, 9, "/other", &probe), 17);
  EXPECT_EQ(load(region.slot(17)->owner), uint64_t{1} << 32 | 9);
  EXPECT_STREQ(region.slot(17)->sender, "/other");
  EXPECT_EQ(load(region.slot(17)->ready), 9u);
  // A released slot is free again; releasing with a stale word changes nothing.
  release_slot(region.slot(30), uint64_t{self.pid} << 32 | 999);
  EXPECT_NE(load(region.slot(30)->owner), 0u);
  release_slot(region.slot(30), uint64_t{self.pid} << 32 | 130);
  EXPECT_EQ(load(region.slot(30)->owner), 0u);
  EXPECT_EQ(claim_slot(region.base, kRing, 2, 2, 10, "/third", &probe), 30);
}

}  // namespace
}  // namespace fabric::transport::shm
