// WriteFence (src/engine/write_fence.h) as a state machine, without a domain: two engines'
// fences pass each other the notes they return, as the workers would send them, and the tests
// say which NIC each note arrives on.
#include "engine/write_fence.h"

#include <gtest/gtest.h>

#include <optional>

#include "engine/messages.h"

namespace fabric::engine {
namespace {

using Clock = WriteFence::Clock;
using namespace std::chrono_literals;

constexpr auto kTimeout = 100ms;
constexpr auto kResend = 10ms;

Address engine_address(uint8_t id, size_t nics) {
  std::vector<NicAddress> v;
  for (size_t i = 0; i < nics; ++i) {
    v.push_back({Bytes{std::byte{id}, static_cast<std::byte>(i)}, 0x1000 * (i + 1), 7});
  }
  return Address("tcp;ofi_rxm", v, Origin::of_this_process(id));
}

struct Side {
  Address address;
  WriteFence fence;
  Side(uint8_t id, size_t nics)
      : address(engine_address(id, nics)),
        fence(address.encode(), static_cast<uint32_t>(nics), kTimeout, kResend) {}
};

FenceNote decoded(const WriteFence::Note& n) {
  auto note = FenceNote::decode(static_cast<MessageKind>(n.bytes[0]),
                                std::span(n.bytes).subspan(kMessageHeaderBytes));
  EXPECT_TRUE(note.has_value());
  return note.value_or(FenceNote{});
}

// Delivers `notes` from `from` to `to`, each on the receiver's NIC its sender's NIC writes to
// (remote_rail), or on `only_nic` when given; returns what the receiver answers.
std::vector<WriteFence::Note> deliver(const Side& from, Side& to,
                                      const std::vector<WriteFence::Note>& notes,
                                      std::optional<uint32_t> only_nic = std::nullopt) {
  std::vector<WriteFence::Note> answers;
  const auto nics = static_cast<uint32_t>(to.address.num_nics());
  for (const auto& n : notes) {
    EXPECT_EQ(n.to.nics()[0].name, to.address.nics()[0].name);
    const uint32_t on = only_nic.value_or(n.nic % nics);
    to.fence.on_note(decoded(n), from.address, on, answers);
  }
  return answers;
}

// The writer announces itself once, writes only after the owner's HelloAck, and sends the
// Hello again while it waits.
TEST(WriteFence, WriterWaitsForTheHelloAckAndResendsTheHello) {
  Side writer(1, 1), owner(2, 1);
  auto t = Clock::now();
  std::vector<WriteFence::Note> out;
  EXPECT_FALSE(writer.fence.may_write(owner.address, 0, t, out));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(decoded(out[0]).kind, MessageKind::kHello);
  std::vector<WriteFence::Note> again;
  EXPECT_FALSE(writer.fence.may_write(owner.address, 0, t + 1ms, again));
  EXPECT_TRUE(again.empty()) << "the Hello went again before its resend interval";
  EXPECT_FALSE(writer.fence.may_write(owner.address, 0, t + kResend, again));
  EXPECT_EQ(again.size(), 1u);
  auto acks = deliver(writer, owner, out);
  ASSERT_EQ(acks.size(), 1u);
  EXPECT_EQ(decoded(acks[0]).kind, MessageKind::kHelloAck);
  EXPECT_EQ(owner.fence.writers(), 1u);
  EXPECT_TRUE(deliver(owner, writer, acks).empty());
  std::vector<WriteFence::Note> none;
  EXPECT_TRUE(writer.fence.may_write(owner.address, 0, t + kResend, none));
  EXPECT_TRUE(none.empty());
  // A dropped connection: the writer announces itself afresh, at a new epoch.
  const uint64_t epoch = writer.fence.epoch();
  writer.fence.forget_owner(owner.address.nics()[0].name);
  EXPECT_NE(writer.fence.epoch(), epoch);
  EXPECT_FALSE(writer.fence.may_write(owner.address, 0, t + 2 * kResend, none));
  EXPECT_EQ(none.size(), 1u);
}

// Sets up `writer` as a writer known to `owner`.
void announce(Side& writer, Side& owner) {
  std::vector<WriteFence::Note> out;
  ASSERT_FALSE(writer.fence.may_write(owner.address, 0, Clock::now(), out));
  auto acks = deliver(writer, owner, out);
  deliver(owner, writer, acks);
  std::vector<WriteFence::Note> none;
  ASSERT_TRUE(writer.fence.may_write(owner.address, 0, Clock::now(), none));
}

TEST(WriteFence, NoWritersNoWait) {
  Side owner(2, 1);
  std::vector<WriteFence::Note> out;
  int done = 0;
  owner.fence.fence([&](const Status& s) { done += s.is_ok() ? 1 : 100; }, 0, Clock::now(), out);
  EXPECT_TRUE(out.empty());
  for (auto& [fn, status] : owner.fence.take_settled()) fn(status);
  EXPECT_EQ(done, 1);
}

// A round ends once every NIC of every writer has answered over the connection its writes take;
// an answer that came over another NIC (moved there by failover) proves nothing.
TEST(WriteFence, RoundEndsWhenEveryWriterNicAnsweredOnItsOwnRail) {
  Side writer(1, 2), owner(2, 2);
  announce(writer, owner);
  std::vector<WriteFence::Note> fences;
  std::optional<Status> result;
  owner.fence.fence([&](const Status& s) { result = s; }, 0, Clock::now(), fences);
  ASSERT_EQ(fences.size(), 1u);
  auto acks = deliver(owner, writer, fences);
  ASSERT_EQ(acks.size(), 2u) << "one FenceAck per writer NIC";
  // Both answers arrive on NIC 1: the one from writer NIC 0 does not count.
  deliver(writer, owner, acks, 1);
  EXPECT_TRUE(owner.fence.take_settled().empty());
  EXPECT_TRUE(owner.fence.has_rounds());
  deliver(writer, owner, {acks[0]});  // now on its own rail
  auto settled = owner.fence.take_settled();
  ASSERT_EQ(settled.size(), 1u);
  EXPECT_TRUE(settled[0].second.is_ok()) << settled[0].second.to_string();
  EXPECT_FALSE(owner.fence.has_rounds());
}

// A writer that does not answer: the Fence goes again, then the round ends with kTimeout naming
// it, and it is forgotten; a late answer makes it a writer again.
TEST(WriteFence, SilentWriterTimesOutIsForgottenAndComesBack) {
  Side writer(1, 1), owner(2, 1);
  announce(writer, owner);
  const auto t = Clock::now();
  std::vector<WriteFence::Note> fences;
  owner.fence.fence(nullptr, 0, t, fences);
  std::vector<WriteFence::Note> resent;
  owner.fence.tick(0, t + kResend, resent);
  EXPECT_EQ(resent.size(), 1u) << "the Fence is sent again while unanswered";
  owner.fence.tick(0, t + kTimeout, resent);
  auto settled = owner.fence.take_settled();
  ASSERT_EQ(settled.size(), 1u);
  EXPECT_EQ(settled[0].second.code(), ErrorCode::kTimeout);
  EXPECT_NE(settled[0].second.message().find(writer.address.short_name()), std::string::npos)
      << settled[0].second.message();
  EXPECT_EQ(owner.fence.writers(), 0u);
  // The writer runs again and answers the round it missed: fenced again from then on.
  auto late = deliver(owner, writer, fences);
  deliver(writer, owner, late);
  EXPECT_EQ(owner.fence.writers(), 1u);
  EXPECT_TRUE(owner.fence.take_settled().empty()) << "a late answer settles nothing";
}

// A writer that closes says Goodbye from each NIC: a round waiting for it ends, and the next
// round does not wait for it.
TEST(WriteFence, GoodbyeFromEveryNicEndsTheWait) {
  Side writer(1, 2), owner(2, 2);
  announce(writer, owner);
  std::vector<WriteFence::Note> fences;
  owner.fence.fence(nullptr, 0, Clock::now(), fences);
  std::vector<WriteFence::Note> bye;
  writer.fence.goodbye(bye);
  ASSERT_EQ(bye.size(), 2u);
  deliver(writer, owner, {bye[0]});
  EXPECT_TRUE(owner.fence.take_settled().empty()) << "one NIC's Goodbye is not enough";
  deliver(writer, owner, {bye[1]});
  auto settled = owner.fence.take_settled();
  ASSERT_EQ(settled.size(), 1u);
  EXPECT_TRUE(settled[0].second.is_ok());
  EXPECT_EQ(owner.fence.writers(), 0u);
  std::vector<WriteFence::Note> next;
  owner.fence.fence(nullptr, 0, Clock::now(), next);
  EXPECT_TRUE(next.empty());
  EXPECT_EQ(owner.fence.take_settled().size(), 1u);
}

// A writer declared dead is waited for no more.
TEST(WriteFence, DeadPeerIsNotWaitedFor) {
  Side writer(1, 1), owner(2, 1);
  announce(writer, owner);
  std::vector<WriteFence::Note> fences;
  owner.fence.fence(nullptr, 0, Clock::now(), fences);
  EXPECT_TRUE(owner.fence.take_settled().empty());
  owner.fence.peer_dead(writer.address.nics()[0].name);
  auto settled = owner.fence.take_settled();
  ASSERT_EQ(settled.size(), 1u);
  EXPECT_TRUE(settled[0].second.is_ok());
}

// While the engine stops, rounds do not settle on answers: they end once the domains are closed.
TEST(WriteFence, RoundsWhileStoppingEndAtEnd) {
  Side writer(1, 1), owner(2, 1);
  announce(writer, owner);
  std::vector<WriteFence::Note> fences;
  owner.fence.fence(nullptr, 0, Clock::now(), fences);
  owner.fence.stop();
  std::vector<WriteFence::Note> none;
  owner.fence.fence(nullptr, 0, Clock::now(), none);
  EXPECT_TRUE(none.empty()) << "nothing is asked while stopping";
  deliver(writer, owner, deliver(owner, writer, fences));
  EXPECT_TRUE(owner.fence.take_settled().empty());
  owner.fence.end();
  EXPECT_EQ(owner.fence.take_settled().size(), 2u);
  EXPECT_FALSE(owner.fence.has_rounds());
}

}  // namespace
}  // namespace fabric::engine
