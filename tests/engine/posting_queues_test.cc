// PostingQueues (src/engine/posting_queues.h) over a test double of transport::Domain: the
// component's own logic (round-robin order, the budget, urgent work first, "again" keeping the
// order, isolation's one-at-a-time posting and its outcomes, taking out a dead peer's queue),
// with no provider underneath.
#include "engine/posting_queues.h"

#include <gtest/gtest.h>

#include <deque>
#include <map>

namespace fabric::engine {
namespace {

using namespace std::chrono_literals;
using Clock = PostingQueues::Clock;
using Kind = PostingQueues::Event::Kind;

// A test double of transport::Domain: records what is posted (wr_ids, in order), answers posts
// from a script (posted when the script is empty), and records peers forgotten and reset.
class RecordingDomain final : public transport::Domain {
 public:
  explicit RecordingDomain(std::string name) { info_ = {"test", std::move(name), 1 << 20, true}; }
  const transport::DomainInfo& info() const override { return info_; }
  const Bytes& endpoint_name() const override { return endpoint_; }
  Result<std::unique_ptr<transport::MemoryRegistration>> register_memory(void*, uint64_t,
                                                                         bool) override {
    return std::unique_ptr<transport::MemoryRegistration>(new Registration);
  }
  Result<transport::PeerHandle> resolve_peer(std::span<const std::byte> name) override {
    return static_cast<transport::PeerHandle>(name[0]);
  }
  void forget_peer(transport::PeerHandle peer) override { forgotten.push_back(peer); }
  void reset_peer(transport::PeerHandle peer) override { resets.push_back(peer); }
  transport::PostResult post_write(const transport::WriteRequest& req) override {
    return answer(req.wr_id);
  }
  transport::PostResult post_read(const transport::ReadRequest& req) override {
    return answer(req.wr_id);
  }
  transport::PostResult post_send(const transport::SendRequest& req) override {
    return answer(req.wr_id);
  }
  transport::PostResult post_recv(const transport::RecvRequest&) override { return {}; }
  size_t poll(std::span<transport::Completion>) override { return 0; }
  int wait_fd() const override { return -1; }
  bool ready_to_wait() override { return true; }

  std::deque<transport::PostResult> script;  // the next posts' answers
  std::vector<Op*> posted;                   // in the order posted
  std::vector<transport::PeerHandle> forgotten, resets;

 private:
  struct Registration : transport::MemoryRegistration {};
  transport::PostResult answer(uint64_t wr_id) {
    transport::PostResult r;
    if (!script.empty()) {
      r = script.front();
      script.pop_front();
    }
    if (r.kind == transport::PostResult::Kind::kPosted)
      posted.push_back(reinterpret_cast<Op*>(wr_id));
    return r;
  }
  transport::DomainInfo info_;
  Bytes endpoint_{std::byte{0}};
};

Config config(uint32_t budget) {
  Config c;
  c.post_budget = budget;
  c.peer_timeout = 1000ms;
  c.nic_timeout = 100ms;
  return c;
}

// The queues over `nics` RecordingDomains, with the components below them.
struct Fixture {
  explicit Fixture(uint32_t budget, size_t nics = 1) : cfg(config(budget)), counters(nics) {
    std::vector<transport::Domain*> raw;
    std::vector<std::string> names;
    for (size_t i = 0; i < nics; ++i) {
      domains.push_back(std::make_unique<RecordingDomain>("nic" + std::to_string(i)));
      raw.push_back(domains.back().get());
      names.push_back("nic" + std::to_string(i));
    }
    health = std::make_unique<NicHealth>(0, std::move(names), cfg);
    auto made = Messenger::create(0, raw, {256, 4, 1});
    EXPECT_TRUE(made);
    messages = std::move(*made);
    queues = std::make_unique<PostingQueues>(
        0, cfg, PostingQueues::Below{raw, messages.get(), health.get(), &counters});
  }
  RecordingDomain& nic(size_t i = 0) { return *domains[i]; }
  // A write of `length` bytes towards peer NIC `peer` (a one-byte name: its handle).
  Op& write(uint8_t peer, bool urgent = false, uint32_t domain = 0) {
    Op& op = ops.emplace_back();
    op.transfer = &transfer;
    op.domain = domain;
    op.length = 64;
    op.urgent = urgent;
    op.owner = &owner;
    op.peer = &names.emplace_back(Bytes{std::byte{peer}});
    return op;
  }
  // The same, queued.
  Op& queue(uint8_t peer, bool urgent = false) {
    Op& op = write(peer, urgent);
    EXPECT_TRUE(queues->enqueue(op, now));
    return op;
  }
  std::vector<PostingQueues::Event> events() {
    std::vector<PostingQueues::Event> out;
    queues->take_events(out);
    return out;
  }

  Config cfg;
  WorkerCounters counters;
  std::vector<std::unique_ptr<RecordingDomain>> domains;
  std::unique_ptr<NicHealth> health;
  std::unique_ptr<Messenger> messages;
  std::unique_ptr<PostingQueues> queues;
  Transfer transfer;
  Address owner{"test",
                {{Bytes{std::byte{1}}, 0, 0}, {Bytes{std::byte{2}}, 0, 0}},
                Origin::of_this_process(1)};
  std::deque<Op> ops;  // stable addresses
  std::deque<Bytes> names;
  Clock::time_point now = Clock::now();
};

const Status kDropped(ErrorCode::kPeerUnreachable, "connection dropped");

TEST(PostingQueues, PostsRoundRobinAcrossPeers) {
  Fixture f(1);
  Op& a1 = f.queue(1);
  Op& a2 = f.queue(1);
  Op& b1 = f.queue(2);
  Op& b2 = f.queue(2);
  EXPECT_EQ(f.queues->queued(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(f.queues->post_some(0, f.now));
  EXPECT_EQ(f.nic().posted, (std::vector<Op*>{&a1, &b1, &a2, &b2}));
  EXPECT_EQ(f.queues->posted(), 4u);
  EXPECT_EQ(f.queues->queued(), 0u);
  EXPECT_EQ(f.queues->inflight(0), 4u);
  EXPECT_FALSE(f.queues->post_some(0, f.now));  // nothing left
}

TEST(PostingQueues, PostsAtMostTheBudgetPerCall) {
  Fixture f(2);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(f.queues->enqueue(f.write(1), f.now));
  f.queues->post_some(0, f.now);
  EXPECT_EQ(f.nic().posted.size(), 2u);
  EXPECT_EQ(f.queues->queued(), 3u);
  f.queues->post_some(0, f.now);
  f.queues->post_some(0, f.now);
  EXPECT_EQ(f.nic().posted.size(), 5u);
  EXPECT_EQ(f.counters.nic[0].posted.load(), 5u);
}

TEST(PostingQueues, UrgentWorkGoesFirst) {
  Fixture f(8);
  Op& a = f.queue(1);
  Op& b = f.queue(1);
  Op& urgent = f.queue(1, /*urgent=*/true);
  f.queues->post_some(0, f.now);
  EXPECT_EQ(f.nic().posted, (std::vector<Op*>{&urgent, &a, &b}));
}

TEST(PostingQueues, AgainKeepsThePeersOrderAndOthersGoOn) {
  Fixture f(8);
  Op& a1 = f.queue(1);
  Op& a2 = f.queue(1);
  Op& b1 = f.queue(2);
  f.nic().script.push_back(transport::PostResult::again());  // a1's first post
  f.queues->post_some(0, f.now);
  EXPECT_EQ(f.nic().posted, std::vector<Op*>{&b1});
  EXPECT_EQ(f.queues->queued(), 2u);
  EXPECT_EQ(f.counters.nic[0].retries.load(), 1u);
  EXPECT_TRUE(f.events().empty());  // "again" is no failure
  f.queues->post_some(0, f.now);
  EXPECT_EQ(f.nic().posted, (std::vector<Op*>{&b1, &a1, &a2}));
}

TEST(PostingQueues, AFailedPostIsAnOpToCompleteWithItsError) {
  Fixture f(8);
  Op& a = f.write(1);
  ASSERT_TRUE(f.queues->enqueue(a, f.now));
  f.nic().script.push_back(
      transport::PostResult::failed(Status(ErrorCode::kInvalidArgument, "bad")));
  f.queues->post_some(0, f.now);
  auto events = f.events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, Kind::kComplete);
  EXPECT_EQ(events[0].op, &a);
  EXPECT_EQ(events[0].status.code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(f.queues->queued(), 0u);
  EXPECT_EQ(f.queues->posted(), 0u);
}

TEST(PostingQueues, APostUnreachableWhileAnotherNicIsUpKeepsTheOpAndNamesTheNic) {
  Fixture f(8, 2);
  ASSERT_TRUE(f.health->active());
  Op& a = f.write(1);
  ASSERT_TRUE(f.queues->enqueue(a, f.now));
  f.nic(0).script.push_back(transport::PostResult::failed(kDropped));
  f.queues->post_some(0, f.now);
  auto events = f.events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, Kind::kUnreachable);
  EXPECT_EQ(events[0].nic, 0u);
  EXPECT_EQ(events[0].peer, 1u);
  EXPECT_EQ(f.queues->queued(), 1u);  // still queued: the worker moves it
}

// Posts `n` writes to peer 1 and fails them all as a dropped connection does: all suspects.
std::vector<Op*> isolate(Fixture& f, int n) {
  std::vector<Op*> ops;
  for (int i = 0; i < n; ++i) {
    ops.push_back(&f.write(1));
    EXPECT_TRUE(f.queues->enqueue(*ops.back(), f.now));
  }
  f.queues->post_some(0, f.now);
  for (Op* op : ops) EXPECT_FALSE(f.queues->completed(*op, kDropped, f.now));
  EXPECT_TRUE(f.events().empty());
  EXPECT_EQ(f.queues->queued(), static_cast<size_t>(n));
  f.nic().posted.clear();
  return ops;
}

TEST(PostingQueues, IsolationPostsSuspectsOneAtATimeAfterAReset) {
  Fixture f(8);
  std::vector<Op*> ops = isolate(f, 3);
  f.queues->post_some(0, f.now);  // within the backoff: nothing
  EXPECT_TRUE(f.nic().posted.empty());
  f.now += 2ms;
  f.queues->post_some(0, f.now);
  EXPECT_EQ(f.nic().resets, std::vector<transport::PeerHandle>{1});
  ASSERT_EQ(f.nic().posted, std::vector<Op*>{ops[0]});
  EXPECT_TRUE(ops[0]->lone);
  f.queues->post_some(0, f.now);  // one at a time
  EXPECT_EQ(f.nic().posted.size(), 1u);
  // Innocent alone: completes as it is, and the next suspect goes alone.
  EXPECT_FALSE(f.queues->completed(*ops[0], Status::ok(), f.now));
  auto events = f.events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].op, ops[0]);
  EXPECT_TRUE(events[0].status.is_ok());
  f.queues->post_some(0, f.now);
  EXPECT_EQ(f.nic().posted, (std::vector<Op*>{ops[0], ops[1]}));
}

TEST(PostingQueues, IsolationFailsTheOneRefusedAloneOnceAFreshConnectionWorksAndGoesOn) {
  Fixture f(8);
  std::vector<Op*> ops = isolate(f, 2);
  f.now += 2ms;
  f.queues->post_some(0, f.now);
  ASSERT_EQ(f.nic().posted, std::vector<Op*>{ops[0]});
  const Status refused(ErrorCode::kRemoteAccess, "bad key");
  EXPECT_FALSE(f.queues->completed(*ops[0], refused, f.now));
  // Found at fault, but not reported yet: a check over a fresh connection comes first.
  auto events = f.events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, Kind::kCheck);
  EXPECT_EQ(events[0].op, ops[0]);
  ASSERT_TRUE(f.queues->wants_check(0, 1));
  Op& check = f.write(1);
  Transfer check_transfer;
  check_transfer.check_nic = 0;
  check.transfer = &check_transfer;
  check.length = 0;
  f.queues->set_check(0, 1, check);
  f.now += 2ms;  // the connection is made afresh, and the check goes alone
  f.queues->post_some(0, f.now);
  EXPECT_EQ(f.nic().posted, (std::vector<Op*>{ops[0], &check}));
  EXPECT_EQ(f.nic().resets.size(), 2u);
  // The first check fails too (the peer had not let go of the old connection): another, later.
  EXPECT_TRUE(f.queues->completed(check, kDropped, f.now));
  f.queues->check_done(0, 1, kDropped, f.now);
  events = f.events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, Kind::kCheck);
  f.queues->set_check(0, 1, check);
  f.now += 5ms;
  f.queues->post_some(0, f.now);
  EXPECT_EQ(f.nic().posted.back(), &check);
  EXPECT_EQ(f.nic().resets.size(), 3u);
  EXPECT_TRUE(f.queues->completed(check, Status::ok(), f.now));
  f.queues->check_done(0, 1, Status::ok(), f.now);
  // Now the refusal is reported, with its own error, and the innocent one goes on.
  events = f.events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].op, ops[0]);
  EXPECT_EQ(events[0].status.code(), ErrorCode::kRemoteAccess);
  EXPECT_EQ(events[0].status.message(), "bad key");
  f.queues->post_some(0, f.now);
  EXPECT_EQ(f.nic().posted.back(), ops[1]);
}

TEST(PostingQueues, ARefusalWaitingForItsCheckIsReportedAsSuchWhenThePeerGoesQuiet) {
  Fixture f(8);
  std::vector<Op*> ops = isolate(f, 1);
  f.now += 2ms;
  f.queues->post_some(0, f.now);
  EXPECT_FALSE(f.queues->completed(*ops[0], Status(ErrorCode::kRemoteAccess, "bad key"), f.now));
  ASSERT_EQ(f.events().size(), 1u);  // the check asked for
  Op& check = f.write(1);
  Transfer check_transfer;
  check_transfer.check_nic = 0;
  check.transfer = &check_transfer;
  f.queues->set_check(0, 1, check);
  f.now += 2ms;
  f.queues->post_some(0, f.now);
  EXPECT_TRUE(f.queues->completed(check, kDropped, f.now));
  f.queues->check_done(0, 1, kDropped, f.now + f.cfg.peer_timeout);
  auto events = f.events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].op, ops[0]);
  EXPECT_EQ(events[0].status.code(), ErrorCode::kRemoteAccess);
  EXPECT_EQ(f.queues->queued(), 0u);
}

TEST(PostingQueues, IsolationChecksThePeerAndAFailedCheckFailsEverySuspect) {
  Fixture f(8);
  std::vector<Op*> ops = isolate(f, 2);
  f.now += 2ms;
  f.queues->post_some(0, f.now);
  EXPECT_FALSE(f.queues->completed(*ops[0], kDropped, f.now));  // failed alone, not refused
  auto events = f.events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, Kind::kCheck);
  EXPECT_EQ(events[0].op, ops[0]);
  ASSERT_TRUE(f.queues->wants_check(0, 1));
  Op& check = f.write(1);
  Transfer check_transfer;  // the worker's check transfer
  check_transfer.check_nic = 0;
  check.transfer = &check_transfer;
  check.length = 0;
  f.queues->set_check(0, 1, check);
  EXPECT_FALSE(f.queues->wants_check(0, 1));
  f.now += 3ms;
  f.queues->post_some(0, f.now);
  EXPECT_EQ(f.nic().posted.back(), &check);  // the check goes alone
  f.queues->post_some(0, f.now);
  EXPECT_EQ(f.nic().posted.back(), &check);
  // The check fails past peer_timeout: the peer is unreachable, every suspect fails.
  EXPECT_TRUE(f.queues->completed(check, kDropped, f.now));  // the worker completes a check
  f.queues->check_done(0, 1, kDropped, f.now + f.cfg.peer_timeout);
  events = f.events();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].op, ops[0]);
  EXPECT_EQ(events[1].op, ops[1]);
  for (auto& e : events) EXPECT_EQ(e.status.code(), ErrorCode::kPeerUnreachable);
  EXPECT_EQ(f.queues->queued(), 0u);
}

TEST(PostingQueues, TakingOutADeadPeerReturnsPostedAndQueuedOps) {
  Fixture f(2);
  f.queue(1);
  f.queue(1);
  Op& c = f.queue(1);
  f.queue(2);
  f.queues->post_some(0, f.now);  // peer 1's first two posted, c queued; nothing to peer 2
  std::vector<std::pair<uint32_t, transport::PeerHandle>> dead;
  f.queues->find_dead(f.now + 2 * f.cfg.peer_timeout, dead);
  // Peer 2 has nothing posted while peer 1 stalls with work posted: peer 1 goes first.
  EXPECT_EQ(dead, (std::vector<std::pair<uint32_t, transport::PeerHandle>>{{0, 1}}));
  PostingQueues::Taken taken = f.queues->take_out(0, 1, /*posted_too=*/true);
  EXPECT_EQ(taken.owner, f.owner.nics()[0].name);
  EXPECT_EQ(taken.posted.size(), 2u);
  EXPECT_EQ(taken.queued, std::vector<Op*>{&c});
  EXPECT_EQ(f.nic().forgotten, std::vector<transport::PeerHandle>{1});
  EXPECT_EQ(f.queues->find(0, 1), nullptr);
  EXPECT_EQ(f.queues->queued(), 1u);  // peer 2's
  EXPECT_EQ(f.queues->inflight(0), 0u);
  // Posted work stays counted until the provider lets go of it.
  for (Op* op : taken.posted) f.queues->abandon(*op);
  EXPECT_EQ(f.queues->posted(), 2u);
  EXPECT_EQ(f.queues->abandoned(), 2u);
  f.queues->let_go();
  f.queues->let_go();
  EXPECT_EQ(f.queues->posted(), f.queues->abandoned());
}

TEST(PostingQueues, TakingOutOnlyQueuedWorkKeepsAQueueWithPostedWork) {
  Fixture f(1);
  Op& a = f.queue(1);
  Op& b = f.queue(1);
  f.queues->post_some(0, f.now);  // a posted
  PostingQueues::Taken taken = f.queues->take_out(0, 1, /*posted_too=*/false);
  EXPECT_TRUE(taken.posted.empty());
  EXPECT_EQ(taken.queued, std::vector<Op*>{&b});
  EXPECT_TRUE(f.nic().forgotten.empty());
  ASSERT_NE(f.queues->find(0, 1), nullptr);
  EXPECT_TRUE(f.queues->completed(a, Status::ok(), f.now));
  EXPECT_FALSE(f.queues->post_some(0, f.now));  // b went: nothing is posted again
}

}  // namespace
}  // namespace fabric::engine
