// StagedWriter (src/engine/staged_writer.h), the writer's side of the staged path, without a
// domain or a device: gates released in order as their fenced copies complete, a failed copy
// failing its gate's ops only, Commits built in chunks with the immediate last, a Commit sent
// again when its Ack is overdue and acknowledged once, and a transfer given up on.
#include "engine/staged_writer.h"

#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "copier_double.h"
#include "engine/messages.h"
#include "fabric/address.h"

namespace fabric::engine {
namespace {

using namespace std::chrono_literals;
using testing::CopierDoubles;
using Clock = StagedWriter::Clock;

Address owner_address() {
  std::vector<NicAddress> nics{{Bytes{std::byte{2}}, 0x2000, 9}};
  return Address("tcp;ofi_rxm", nics, Origin::of_this_process(2));
}

StagedWriter::Options options(uint64_t chunk = 150) {
  return {chunk, 4096, std::chrono::milliseconds(100)};
}

// A transfer from a staged source: ops of `lengths` bytes, one after another in its mirror.
struct StagedSource {
  std::vector<std::byte> device = std::vector<std::byte>(4096);
  std::vector<std::byte> mirror = std::vector<std::byte>(4096);
  Transfer t;

  explicit StagedSource(const std::vector<uint64_t>& lengths) {
    auto src = std::make_shared<LocalRegion>();
    src->ptr = device.data();
    src->host = mirror.data();
    src->length = device.size();
    src->memory = {cuda::MemoryKind::kFake, 0};
    t.src = src;
    uint64_t at = 0;
    for (uint64_t n : lengths) {
      Op& op = t.ops.emplace_back();
      op.transfer = &t;
      op.local = mirror.data() + at;
      op.length = n;
      at += n;
    }
  }
};

struct Released {
  size_t first, count;
  bool ok;
  friend bool operator==(const Released&, const Released&) = default;
};

std::vector<Released> take(StagedWriter& w) {
  std::vector<Released> out;
  for (const StagedWriter::Release& r : w.released())
    out.push_back({r.first, r.count, r.status.is_ok()});
  w.released().clear();
  return out;
}

TEST(StagedWriter, GatesOpenInOrderAsTheirFencedCopiesComplete) {
  CopierDoubles copiers;
  StagedWriter w(options(150), copiers.factory());
  StagedSource s({100, 100, 0, 100, 100});
  w.stage(s.t);
  EXPECT_EQ(take(w), (std::vector<Released>{{2, 1, true}})) << "a zero-byte op waits for nothing";
  ASSERT_EQ(copiers.made.size(), 1u);
  auto& copier = *copiers.made[0];
  EXPECT_EQ(copier.copies, 4u);
  ASSERT_EQ(copier.fenced.size(), 2u) << "two gates of about 150 bytes";
  EXPECT_TRUE(w.copying());

  EXPECT_FALSE(w.poll());
  EXPECT_TRUE(take(w).empty()) << "no gate opens before its copies complete";
  copier.ready = 1;
  EXPECT_TRUE(w.poll());
  EXPECT_EQ(take(w), (std::vector<Released>{{0, 2, true}}));
  copier.ready = 2;
  EXPECT_TRUE(w.poll());
  EXPECT_EQ(take(w), (std::vector<Released>{{3, 2, true}}));
  EXPECT_FALSE(w.copying());
}

TEST(StagedWriter, AFailedCopyFailsExactlyItsGatesOps) {
  CopierDoubles copiers;
  StagedWriter w(options(150), copiers.factory());
  StagedSource s({100, 100, 100, 100, 100});
  w.stage(s.t);
  auto& copier = *copiers.made[0];
  ASSERT_EQ(copier.fenced.size(), 3u);
  copier.fail_fence = 1;
  copier.ready = 3;
  EXPECT_TRUE(w.poll());
  EXPECT_EQ(take(w), (std::vector<Released>{{0, 2, true}, {2, 2, false}, {4, 1, true}}));
}

TEST(StagedWriter, WithoutACopierEveryOpFailsAtOnce) {
  CopierDoubles copiers;
  copiers.refuse = true;
  StagedWriter w(options(150), copiers.factory());
  StagedSource s({100, 0, 100});
  w.stage(s.t);
  EXPECT_EQ(take(w), (std::vector<Released>{{0, 1, false}, {1, 1, true}, {2, 1, false}}));
  EXPECT_FALSE(w.has_copiers());
}

// A transfer writing into a staged destination (region 0x77 at its owner).
struct StagedDestination {
  Transfer t;
  explicit StagedDestination(bool imm) {
    t.id = 31;
    t.dsts.push_back(RemoteMemory(owner_address(), 0, 1 << 20, {{0, 1}}, 0x77));
    StagedDst& sd = t.staged.emplace_back();
    sd.has_imm = imm;
    sd.imm = 5;
    sd.imm_times = 2;
  }
  Op write(uint64_t offset, uint64_t length) {
    Op op;
    op.transfer = &t;
    op.dst_index = 0;
    op.dst_offset = offset;
    op.length = length;
    return op;
  }
};

TEST(StagedWriter, RangesCommitInChunksAndTheImmediateFollowsWhenTheyNeedSeveralMessages) {
  const Bytes reply = owner_address().encode();
  // Room for one range per Commit message.
  StagedWriter w({150, Commit::kFixedBytes + reply.size() + Commit::kRangeBytes, 100ms});
  StagedDestination d(true);
  EXPECT_FALSE(w.record(d.write(0, 100)));
  EXPECT_TRUE(w.record(d.write(100, 100))) << "150 bytes unflushed: time to commit";
  w.commit_staged(d.t, 0, false, reply);
  ASSERT_EQ(w.outgoing().size(), 1u);
  const Commit& first = w.outgoing()[0].commit;
  EXPECT_EQ(first.region, 0x77u);
  EXPECT_EQ(first.transfer, 31u);
  ASSERT_EQ(first.ranges.size(), 1u) << "adjacent ranges merged";
  EXPECT_EQ(first.ranges[0].offset, 0u);
  EXPECT_EQ(first.ranges[0].length, 200u);
  EXPECT_FALSE(first.has_imm);
  EXPECT_EQ(w.outgoing()[0].owner, &d.t.dsts[0].owner());
  w.outgoing().clear();

  EXPECT_FALSE(w.record(d.write(400, 10)));
  EXPECT_FALSE(w.record(d.write(500, 10)));
  w.commit_staged(d.t, 0, true, reply);
  ASSERT_EQ(w.outgoing().size(), 2u) << "two ranges, one per message";
  EXPECT_FALSE(w.outgoing()[0].commit.has_imm);
  EXPECT_FALSE(w.outgoing()[1].commit.has_imm) << "the ranges did not fit one message";
  EXPECT_TRUE(StagedWriter::staged_left(d.t));
  w.outgoing().clear();

  w.commit_staged(d.t, 0, true, reply);  // after their Acks
  ASSERT_EQ(w.outgoing().size(), 1u);
  const Commit& last = w.outgoing()[0].commit;
  EXPECT_TRUE(last.ranges.empty());
  EXPECT_TRUE(last.has_imm);
  EXPECT_EQ(last.imm, 5u);
  EXPECT_EQ(last.imm_times, 2u);
  EXPECT_FALSE(StagedWriter::staged_left(d.t));
}

TEST(StagedWriter, ACommitIsResentWhenItsAckIsOverdueAndAcknowledgedOnce) {
  StagedWriter w({150, 4096, 1000ms});
  StagedDestination d(false);
  const Bytes message{std::byte{1}};
  const Clock::time_point t0{};
  CommitSend& cs = w.track(d.t, message, 5, d.t.dsts[0].owner(), t0);
  StagedWriter::queued(cs, 0, t0);
  --cs.live;  // sent
  EXPECT_TRUE(w.awaiting());
  EXPECT_TRUE(w.watch(t0 + 10ms, 50ms).resend.empty()) << "not overdue yet";
  StagedWriter::Overdue& overdue = w.watch(t0 + 60ms, 50ms);
  ASSERT_EQ(overdue.resend.size(), 1u);
  EXPECT_EQ(overdue.resend[0], &cs);
  EXPECT_TRUE(overdue.failed.empty());
  StagedWriter::queued(cs, 1, t0 + 60ms);
  EXPECT_TRUE(w.watch(t0 + 200ms, 50ms).resend.empty()) << "a copy is in flight";
  --cs.live;

  EXPECT_EQ(w.on_ack(Ack{31, 5, ErrorCode::kOk, {}}), &d.t) << "every Commit acknowledged";
  EXPECT_EQ(w.on_ack(Ack{31, 5, ErrorCode::kOk, {}}), nullptr) << "the second copy's Ack";
  EXPECT_EQ(d.t.acks, 0u);
  EXPECT_TRUE(d.t.error.is_ok());
  EXPECT_FALSE(w.awaiting());
  EXPECT_EQ(w.unacked(), 0u);
}

TEST(StagedWriter, AnErrorAckFailsTheTransferWithTheOwnersMessage) {
  StagedWriter w(options());
  StagedDestination d(false);
  const Bytes message{std::byte{1}};
  w.track(d.t, message, 5, d.t.dsts[0].owner(), Clock::time_point{});
  w.track(d.t, message, 6, d.t.dsts[0].owner(), Clock::time_point{});
  EXPECT_EQ(w.on_ack(Ack{31, 6, ErrorCode::kRemoteAccess, "bad range"}), nullptr);
  EXPECT_EQ(w.on_ack(Ack{32, 5, ErrorCode::kOk, {}}), nullptr) << "another transfer's id";
  EXPECT_EQ(w.on_ack(Ack{31, 5, ErrorCode::kOk, {}}), &d.t);
  EXPECT_EQ(d.t.error.code(), ErrorCode::kRemoteAccess);
  EXPECT_NE(d.t.error.message().find("bad range"), std::string::npos);
}

TEST(StagedWriter, ATransferWhoseAckIsOverdueFailsAndItsLateAckIsIgnored) {
  StagedWriter w(options());
  StagedDestination d(false);
  const Bytes message{std::byte{1}};
  const Clock::time_point t0{};
  w.track(d.t, message, 5, d.t.dsts[0].owner(), t0);
  StagedWriter::Overdue& overdue = w.watch(t0 + 101ms, 1h);
  ASSERT_EQ(overdue.failed.size(), 1u);
  EXPECT_EQ(overdue.failed[0], &d.t);
  EXPECT_EQ(d.t.error.code(), ErrorCode::kPeerUnreachable);
  EXPECT_EQ(d.t.acks, 0u);
  EXPECT_FALSE(w.awaiting());
  EXPECT_EQ(w.on_ack(Ack{31, 5, ErrorCode::kOk, {}}), nullptr);
}

}  // namespace
}  // namespace fabric::engine
