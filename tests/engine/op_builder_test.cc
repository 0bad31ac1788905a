// The Op builder: which rail, address, key and local buffer each kind of work request gets, and
// what failover's retarget changes. Pure functions, checked without a fabric.
#include <gtest/gtest.h>

#include <memory>

#include "engine/op_builder.h"
#include "engine/regions.h"

namespace fabric::engine {
namespace {

Bytes name_of(uint8_t b) {
  return Bytes{std::byte{b}, std::byte{b}};
}

// A peer with three NICs; NIC i's scratch buffer at 0x1000 * (i + 1), key 100 + i.
Address three_nic_peer() {
  std::vector<NicAddress> nics;
  for (uint8_t i = 0; i < 3; ++i) nics.push_back({name_of(i), 0x1000u * (i + 1u), 100u + i});
  return Address("test", std::move(nics));
}

// A registration double: fixed descriptor, address and key (no provider behind it).
class FixedRegistration : public transport::MemoryRegistration {
 public:
  explicit FixedRegistration(uintptr_t desc) { local_desc_ = reinterpret_cast<void*>(desc); }
};

struct OpBuilderTest : ::testing::Test {
  Address peer = three_nic_peer();
  // Its region on three rails: rail i at 0x10000 * (i + 1), key 200 + i.
  RemoteMemory dst{peer, 0x5000, 4096, {{0x10000, 200}, {0x20000, 201}, {0x30000, 202}}};
  Transfer t;
  char scratch0 = 0, scratch1 = 0;
  Scratch s0{&scratch0, reinterpret_cast<void*>(0x50)};
  Scratch s1{&scratch1, reinterpret_cast<void*>(0x51)};
  char data[64] = {};

  void SetUp() override {
    auto region = std::make_shared<LocalRegion>();
    region->id = 7;
    for (uintptr_t i = 0; i < 2; ++i)
      region->regs.push_back(std::make_unique<FixedRegistration>(0x90 + i));
    t.src = region;
  }
};

TEST_F(OpBuilderTest, WriteGoesToTheRailFacingItsNic) {
  const Op op = write_op(t, 1, dst, 96, data, reinterpret_cast<void*>(0x91), 64, s1);
  EXPECT_EQ(op.transfer, &t);
  EXPECT_EQ(op.kind, Op::Kind::kWrite);
  EXPECT_EQ(op.domain, 1u);
  EXPECT_EQ(*op.peer, name_of(1));
  EXPECT_EQ(op.owner, &dst.owner());
  EXPECT_EQ(op.dst_mem, &dst);
  EXPECT_EQ(op.remote_addr, 0x20000u + 96);
  EXPECT_EQ(op.remote_key, 201u);
  EXPECT_EQ(op.local, data);
  EXPECT_EQ(op.local_desc, reinterpret_cast<void*>(0x91));
  EXPECT_EQ(op.length, 64u);
  EXPECT_FALSE(op.has_imm);
}

TEST_F(OpBuilderTest, ZeroByteWriteNamesTheLocalScratchBuffer) {
  const Op op = write_op(t, 0, dst, 8, data, reinterpret_cast<void*>(0x90), 0, s0);
  EXPECT_EQ(op.local, &scratch0);
  EXPECT_EQ(op.local_desc, s0.desc);
  EXPECT_EQ(op.remote_addr, 0x10000u + 8);  // still the region's byte
}

TEST_F(OpBuilderTest, ScratchWriteTargetsThePeersScratchOnTheFacingRail) {
  const Op op = scratch_op(t, 2, peer, s0);
  EXPECT_EQ(*op.peer, name_of(2));
  EXPECT_EQ(op.remote_addr, 0x3000u);
  EXPECT_EQ(op.remote_key, 102u);
  EXPECT_EQ(op.length, 0u);
  EXPECT_EQ(op.local, &scratch0);
  EXPECT_EQ(op.dst_mem, nullptr);
}

TEST_F(OpBuilderTest, SendCarriesItsMessage) {
  const Bytes message(40, std::byte{3});
  const Op op = send_op(t, 1, peer, message);
  EXPECT_EQ(op.kind, Op::Kind::kSend);
  EXPECT_EQ(op.message, &message);
  EXPECT_EQ(op.length, 40u);
  EXPECT_EQ(*op.peer, name_of(1));
}

TEST_F(OpBuilderTest, RetargetMovesAWriteToTheSameBytesOnTheOtherRail) {
  Op op = write_op(t, 0, dst, 96, data, reinterpret_cast<void*>(0x90), 64, s0);
  retarget(op, 1, s1);
  EXPECT_EQ(op.domain, 1u);
  EXPECT_EQ(*op.peer, name_of(1));
  EXPECT_EQ(op.remote_addr, 0x20000u + 96);
  EXPECT_EQ(op.remote_key, 201u);
  EXPECT_EQ(op.local, data);                                // the same source bytes
  EXPECT_EQ(op.local_desc, reinterpret_cast<void*>(0x91));  // registered on NIC 1
}

TEST_F(OpBuilderTest, RetargetMovesScratchWritesAndSendsWithTheirCommit) {
  Op zero = scratch_op(t, 0, peer, s0);
  retarget(zero, 1, s1);
  EXPECT_EQ(zero.remote_addr, 0x2000u);
  EXPECT_EQ(zero.remote_key, 101u);
  EXPECT_EQ(zero.local, &scratch1);
  EXPECT_EQ(zero.local_desc, s1.desc);

  const Bytes message(8, std::byte{1});
  CommitSend commit;
  Op send = send_op(t, 0, peer, message);
  send.commit = &commit;
  retarget(send, 2, Scratch{});
  EXPECT_EQ(send.domain, 2u);
  EXPECT_EQ(*send.peer, name_of(2));
  EXPECT_EQ(commit.domain, 2u);
}

TEST(RegionTable, FindAndTakeOnce) {
  RegionTable table;
  auto r = std::make_shared<LocalRegion>();
  r->id = 42;
  table.add(r);
  EXPECT_EQ(table.find(42), r);
  EXPECT_EQ(table.find(43), nullptr);
  EXPECT_EQ(table.take(42), r);
  EXPECT_EQ(table.take(42), nullptr);
  EXPECT_EQ(table.find(42), nullptr);
}

}  // namespace
}  // namespace fabric::engine
