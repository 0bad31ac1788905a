// NicHealth (src/engine/nic_health.h) without a domain: the watchdog's verdicts on described
// queues, marking down, probes, the NICs chosen for moved work, and what is published.
#include "engine/nic_health.h"

#include <gtest/gtest.h>

namespace fabric::engine {
namespace {

using Clock = NicHealth::Clock;
using Kind = NicHealth::Verdict::Kind;
using Look = NicHealth::QueueLook;
using namespace std::chrono_literals;

Config timings() {
  Config c;
  c.nic_timeout = 100ms;
  c.peer_timeout = 1000ms;
  c.nic_probe_interval = 50ms;
  return c;
}

NicHealth health(size_t nics, const Config& c = timings()) {
  std::vector<std::string> names;
  for (size_t i = 0; i < nics; ++i) names.push_back("nic" + std::to_string(i));
  return NicHealth(0, std::move(names), c);
}

Address owner(uint8_t id) {
  return Address("tcp;ofi_rxm", {{Bytes{std::byte{id}}, 0x1000, 7}}, Origin::of_this_process(id));
}

std::vector<bool> up(const NicHealth& h) {
  std::vector<bool> out;
  h.up_nics(out);
  return out;
}

TEST(NicHealth, ActiveOnlyWithTwoNicsAndANicTimeoutBelowThePeerTimeout) {
  EXPECT_TRUE(health(2).active());
  EXPECT_FALSE(health(1).active());
  Config c = timings();
  c.nic_timeout = 0ms;
  EXPECT_FALSE(health(2, c).active());
  c.nic_timeout = c.peer_timeout;
  EXPECT_FALSE(health(2, c).active());
}

TEST(NicHealth, AStallWhileAnotherNicReachedTheSamePeerMarksDown) {
  NicHealth h = health(2);
  const Bytes peer{std::byte{1}};
  const Bytes other{std::byte{2}};
  std::vector<std::vector<Look>> looks(2);
  looks[0] = {{&other, false, true}, {&peer, true, false}};
  looks[1] = {{&peer, false, true}};
  const NicHealth::Verdict v = h.judge(0, looks);
  EXPECT_EQ(v.kind, Kind::kMarkDown);
  EXPECT_EQ(v.culprit, 1u);
  ASSERT_EQ(v.stalled, std::vector<size_t>{1});
  EXPECT_FALSE(h.down(0));  // judging changes nothing
  // NIC 1 made progress: nothing against it.
  EXPECT_EQ(h.judge(1, looks).kind, Kind::kNone);
}

TEST(NicHealth, AStallWithNoOtherNicReachingThePeerReroutesInstead) {
  NicHealth h = health(3);
  const Bytes peer{std::byte{1}};
  const Bytes other{std::byte{2}};
  const Bytes unknown;
  std::vector<std::vector<Look>> looks(3);
  looks[0] = {{&peer, true, false}, {&unknown, true, false}};
  looks[1] = {{&other, false, true}};  // progress, but towards another peer
  looks[2] = {{&peer, true, false}};   // the same peer, stalled too
  const NicHealth::Verdict v = h.judge(0, looks);
  EXPECT_EQ(v.kind, Kind::kReroute);
  EXPECT_EQ(v.stalled, (std::vector<size_t>{0, 1}));
  // A NIC that is down is no evidence: its progress does not count.
  looks[1] = {{&peer, false, true}};
  EXPECT_EQ(h.judge(0, looks).kind, Kind::kMarkDown);
  h.mark_down(1, Clock::now(), owner(1));
  EXPECT_EQ(h.judge(0, looks).kind, Kind::kReroute);
}

TEST(NicHealth, ADownNicReportsItsStalledQueuesAndIsProbedAfterTheInterval) {
  NicHealth h = health(2);
  const auto t0 = Clock::now();
  h.mark_down(0, t0, owner(7), "a post failed");
  EXPECT_TRUE(h.down(0));
  EXPECT_EQ(up(h), (std::vector<bool>{false, true}));
  const Bytes peer{std::byte{7}};
  std::vector<std::vector<Look>> looks(2);
  looks[0] = {{&peer, false, true}, {&peer, true, false}};
  const NicHealth::Verdict v = h.judge(0, looks);
  EXPECT_EQ(v.kind, Kind::kStuckWhileDown);
  EXPECT_EQ(v.stalled, std::vector<size_t>{1});

  EXPECT_FALSE(h.probe_due(0, t0 + 49ms, false));
  EXPECT_FALSE(h.probe_due(0, t0 + 50ms, true));  // stopping: no probe
  auto probe = h.probe_due(0, t0 + 50ms, false);
  ASSERT_TRUE(probe);
  EXPECT_EQ(*probe, owner(7));
  EXPECT_FALSE(h.probe_due(0, t0 + 60ms, false));  // one in flight
  // A failed probe: the next one after the interval.
  h.probe_done(0, false, t0 + 70ms);
  EXPECT_TRUE(h.down(0));
  EXPECT_FALSE(h.probe_due(0, t0 + 119ms, false));
  ASSERT_TRUE(h.probe_due(0, t0 + 120ms, false));
  h.probe_done(0, true, t0 + 130ms);
  EXPECT_FALSE(h.down(0));
  EXPECT_EQ(up(h), (std::vector<bool>{true, true}));
  EXPECT_FALSE(h.probe_due(0, t0 + 1s, false));  // up: nothing to probe
}

TEST(NicHealth, ADownNicWithNoPeerToProbeTowardsIsTakenAsUpAgain) {
  NicHealth h = health(2);
  const auto t0 = Clock::now();
  h.mark_down(1, t0, Address());
  EXPECT_FALSE(h.probe_due(1, t0 + 10ms, false));
  EXPECT_TRUE(h.down(1));
  EXPECT_FALSE(h.probe_due(1, t0 + 50ms, false));
  EXPECT_FALSE(h.down(1));
  EXPECT_EQ(up(h), (std::vector<bool>{true, true}));
}

TEST(NicHealth, MovedWorkGoesToTheNicsThatAreUpInTurn) {
  NicHealth h = health(4);
  EXPECT_EQ(h.survivor(2), 2u);  // up: keeps its work
  h.mark_down(2, Clock::now(), owner(1));
  std::vector<uint32_t> to;
  for (int k = 0; k < 6; ++k) to.push_back(h.survivor(2));
  // The survivors 3, 0, 1 in turn (from where the salt got to).
  EXPECT_EQ(to, (std::vector<uint32_t>{0, 1, 3, 0, 1, 3}));
  for (int k = 0; k < 6; ++k) EXPECT_NE(h.other_up(0), 0u);
  // Every other NIC excluded or down: the NIC itself.
  EXPECT_EQ(h.other_up(0, {false, true, false, true}), 0u);
  EXPECT_EQ(h.other_up(0, {false, true, false, false}), 3u);
  h.mark_down(0, Clock::now(), owner(1));
  h.mark_down(1, Clock::now(), owner(1));
  h.mark_down(3, Clock::now(), owner(1));
  EXPECT_EQ(h.survivor(1), 1u);
  EXPECT_EQ(h.other_up(1), 1u);
}

TEST(NicHealth, MessagesGoOverTheFirstNicThatIsUp) {
  NicHealth h = health(3);
  EXPECT_EQ(h.message_nic(), 0u);
  h.mark_down(0, Clock::now(), owner(1));
  EXPECT_EQ(h.message_nic(), 1u);
  h.mark_down(1, Clock::now(), owner(1));
  h.mark_down(2, Clock::now(), owner(1));
  EXPECT_EQ(h.message_nic(), 0u);  // none is up
}

TEST(NicHealth, AnUnreachablePeerShowsTheNicAtFaultOnlyWhileAnotherIsUp) {
  NicHealth h = health(2);
  const Status unreachable(ErrorCode::kPeerUnreachable, "no route");
  EXPECT_TRUE(h.unreachable_here(0, unreachable, true));
  EXPECT_FALSE(h.unreachable_here(0, unreachable, false));  // a probe, or nowhere else to go
  EXPECT_FALSE(h.unreachable_here(0, Status(ErrorCode::kInternal, "x"), true));
  h.mark_down(1, Clock::now(), owner(1));
  EXPECT_FALSE(h.unreachable_here(0, unreachable, true));  // the only NIC up
  EXPECT_FALSE(h.unreachable_here(1, unreachable, true));  // already down
  Config c = timings();
  c.nic_timeout = 0ms;
  EXPECT_FALSE(health(2, c).unreachable_here(0, unreachable, true));  // failover off
}

TEST(NicHealth, RatesArePublishedAndForgottenWhenANicComesBack) {
  NicHealth h = health(2);
  const auto t0 = Clock::now();
  std::vector<uint64_t> rates;
  h.rates(rates);
  EXPECT_EQ(rates, (std::vector<uint64_t>{0, 0}));
  h.posted(1, t0);
  h.completed(1, 1'000'000, t0 + 10ms, true);  // 1 MB in 10 ms
  h.rates(rates);
  EXPECT_EQ(rates[0], 0u);
  EXPECT_NEAR(static_cast<double>(rates[1]), 1e8, 1e6);
  h.mark_down(1, t0 + 20ms, owner(1));
  ASSERT_TRUE(h.probe_due(1, t0 + 70ms, false));
  h.probe_done(1, true, t0 + 80ms);
  h.rates(rates);
  EXPECT_EQ(rates[1], 0u);
}

TEST(NicHealth, TheStampChangesExactlyWhenTheUpNicsDo) {
  // Submitting threads keep their copy of up_nics() while stamp() stays the same.
  NicHealth h = health(2);
  NicHealth other = health(2);
  const uint64_t first = h.stamp();
  EXPECT_NE(first, 0u);  // 0: a thread's copy that was never filled
  EXPECT_NE(first, other.stamp());
  const auto t0 = Clock::now();
  h.mark_down(1, t0, owner(1));
  const uint64_t down = h.stamp();
  EXPECT_NE(down, first);
  EXPECT_EQ(up(h), (std::vector<bool>{true, false}));
  h.mark_down(1, t0 + 1ms, owner(1));  // down already: the same answer, the same stamp
  EXPECT_EQ(h.stamp(), down);
  ASSERT_TRUE(h.probe_due(1, t0 + 60ms, false).has_value());
  h.probe_done(1, false, t0 + 70ms);  // still down: the same answer, the same stamp
  EXPECT_EQ(h.stamp(), down);
  ASSERT_TRUE(h.probe_due(1, t0 + 130ms, false).has_value());
  h.probe_done(1, true, t0 + 140ms);  // back up: a new stamp, not the first one again
  EXPECT_EQ(up(h), (std::vector<bool>{true, true}));
  EXPECT_NE(h.stamp(), down);
  EXPECT_NE(h.stamp(), first);
}

}  // namespace
}  // namespace fabric::engine
