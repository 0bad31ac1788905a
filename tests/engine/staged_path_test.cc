// StagedPath (src/engine/staged_path.h), the owner's side of Commits, without a domain or a
// device: what it asks the worker to do (count, acknowledge, start a CUDA IPC copy) for Commits
// that need no copy into device memory, and how a Commit sent twice is answered.
#include "engine/staged_path.h"

#include <gtest/gtest.h>

#include "engine/messages.h"
#include "fabric/address.h"

namespace fabric::engine {
namespace {

using Kind = StagedPath::Event::Kind;

Address writer_address() {
  std::vector<NicAddress> nics{{Bytes{std::byte{1}}, 0x1000, 7}};
  return Address("tcp;ofi_rxm", nics, Origin::of_this_process(1));
}

// A Commit from the writer, encoded; its header as the Messenger read it (sender, sequence).
struct Arrived {
  Bytes bytes;
  MessageHeader header;
  std::span<const std::byte> body() const { return std::span(bytes).subspan(kMessageHeaderBytes); }
};

Arrived commit_message(Commit c, uint64_t seq) {
  c.reply_to = writer_address().encode();
  Arrived a{c.encode(), {}};
  stamp_header(a.bytes, 0x5e, seq);
  a.header = *read_header(a.bytes);
  return a;
}

// A reliable immediate for host memory (region 0): nothing to copy.
Commit reliable_imm(uint64_t transfer) {
  Commit c;
  c.transfer = transfer;
  c.has_imm = true;
  c.imm = 7;
  c.imm_times = 3;
  return c;
}

std::vector<StagedPath::Event> take(StagedPath& s) {
  std::vector<StagedPath::Event> events;
  events.swap(s.events());
  return events;
}

TEST(StagedPath, AHostImmediateIsCountedThenAcknowledgedOverTheNicItCameBy) {
  StagedPath s(0, nullptr, nullptr);
  const Arrived a = commit_message(reliable_imm(42), 1);
  s.on_commit(a.header, a.body(), 1);
  const auto events = take(s);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].kind, Kind::kCountImm);
  EXPECT_EQ(events[0].imm, 7u);
  EXPECT_EQ(events[0].times, 3u);
  EXPECT_EQ(events[1].kind, Kind::kSendAck);
  EXPECT_EQ(events[1].to.encode(), writer_address().encode());
  EXPECT_EQ(events[1].domain, 1u);
  EXPECT_EQ(events[1].ack.transfer, 42u);
  EXPECT_EQ(events[1].ack.commit, 1u);
  EXPECT_EQ(events[1].ack.code, ErrorCode::kOk);
  EXPECT_FALSE(s.copying());
}

TEST(StagedPath, ACommitSentAgainIsAcknowledgedWithTheFirstResultAndNotCounted) {
  StagedPath s(0, nullptr, nullptr);
  const Arrived a = commit_message(reliable_imm(42), 1);
  s.on_commit(a.header, a.body(), 0);
  take(s);
  s.on_duplicate(a.header, 2);
  const auto events = take(s);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, Kind::kSendAck);
  EXPECT_EQ(events[0].domain, 2u) << "the way the copy came";
  EXPECT_EQ(events[0].ack.transfer, 42u);
  EXPECT_EQ(events[0].ack.code, ErrorCode::kOk);

  MessageHeader unknown = a.header;
  unknown.seq = 99;
  s.on_duplicate(unknown, 0);
  EXPECT_TRUE(take(s).empty()) << "a result forgotten (or never known) is not acknowledged";
}

TEST(StagedPath, ACommitOfAnUnknownRegionIsRefusedAndNotCounted) {
  StagedPath s(0, nullptr, nullptr);
  Commit c = reliable_imm(5);
  c.region = 0x77;
  c.ranges = {{0, 64}};
  const Arrived a = commit_message(c, 1);
  s.on_commit(a.header, a.body(), 0);
  const auto events = take(s);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, Kind::kSendAck);
  EXPECT_EQ(events[0].ack.code, ErrorCode::kRemoteAccess);

  Commit ranges_on_host = reliable_imm(6);
  ranges_on_host.ranges = {{0, 8}};
  const Arrived b = commit_message(ranges_on_host, 2);
  s.on_commit(b.header, b.body(), 0);
  const auto refused = take(s);
  ASSERT_EQ(refused.size(), 1u);
  EXPECT_EQ(refused[0].ack.code, ErrorCode::kRemoteAccess);
}

TEST(StagedPath, AMalformedCommitIsDropped) {
  StagedPath s(0, nullptr, nullptr);
  const Arrived a = commit_message(reliable_imm(1), 1);
  s.on_commit(a.header, a.body().first(5), 0);
  EXPECT_TRUE(take(s).empty());
}

TEST(StagedPath, ACudaIpcCommitGoesToTheWorkerAndItsAckBackTheWayTheLatestCopyCame) {
  StagedPath s(0, nullptr, nullptr);
  Commit c = reliable_imm(9);
  c.region = 0x10;
  c.ranges = {{0, 64}};
  IpcSource& src = c.ipc.emplace();
  src.exported.kind = cuda::IpcExport::Kind::kFake;
  src.exported.handle = Bytes(8, std::byte{1});
  src.length = 64;
  src.offsets = {0};
  const Arrived a = commit_message(c, 1);
  s.on_commit(a.header, a.body(), 0);
  auto events = take(s);
  ASSERT_EQ(events.size(), 1u);
  ASSERT_EQ(events[0].kind, Kind::kStartIpc);
  CommitJob& job = *events[0].job;
  EXPECT_EQ(job.commit.transfer, 9u);

  s.on_duplicate(a.header, 3);
  EXPECT_TRUE(take(s).empty()) << "still copying: no Ack yet";

  s.commit_done(job);  // the worker's copies completed
  events = take(s);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].kind, Kind::kCountImm);
  EXPECT_EQ(events[1].kind, Kind::kSendAck);
  EXPECT_EQ(events[1].domain, 3u);
  EXPECT_EQ(events[1].ack.transfer, 9u);
}

}  // namespace
}  // namespace fabric::engine
