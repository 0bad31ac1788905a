// Membership: the in-process registry, and etcd (a real etcd-server started by the test on
// 127.0.0.1): joins and leaves seen by watchers, a crashed member's lease running out, and
// traffic that keeps flowing, uncorrupted, while prefillers join and leave and etcd restarts.
#include <gtest/gtest.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <set>

#include "etcd_server.h"
#include "kv_test_support.h"
#include "peer_process.h"

namespace fabric::kv {
namespace {

using namespace std::chrono_literals;

// The members a watcher believes in.
class View {
 public:
  Registry::WatchFn fn() {
    return [this](bool joined, const Member& m) {
      std::lock_guard lock(mu_);
      if (joined) {
        members_[m.name] = m;
      } else {
        members_.erase(m.name);
        ++leaves_;
      }
      cv_.notify_all();
    };
  }
  bool wait_for(const std::string& name, bool present, std::chrono::milliseconds t = 10s) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, t, [&] { return members_.count(name) == (present ? 1u : 0u); });
  }
  std::map<std::string, Member> members() {
    std::lock_guard lock(mu_);
    return members_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Member> members_;
  int leaves_ = 0;
};

Member member(const std::string& name, const std::string& role = "prefill") {
  Member m;
  m.name = name;
  m.role = role;
  m.instance = name;
  m.address = "00";
  return m;
}

TEST(KvRegistry, MemberTextRoundTrips) {
  Member m = member("p0");
  m.tp_size = 4;
  m.tp_rank = 3;
  m.data = "layers=94";
  auto back = Member::decode(m.encode());
  ASSERT_TRUE(back);
  EXPECT_EQ(*back, m);
  EXPECT_EQ(Member::decode("tp_size=x\nname=a").status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(Member::decode("role=decode").status().code(), ErrorCode::kInvalidArgument);
}

TEST(KvRegistry, LocalJoinLeaveWatch) {
  auto shared = LocalRegistry::make_shared_state();
  LocalRegistry a(shared);
  auto b = std::make_unique<LocalRegistry>(shared);
  View view;
  ASSERT_TRUE(b->join(member("d0", "decode")));
  ASSERT_TRUE(a.watch(view.fn()));
  EXPECT_EQ(a.watch(view.fn()).code(), ErrorCode::kAlreadyExists);
  EXPECT_TRUE(view.wait_for("d0", true, 0ms));  // the current members come first
  ASSERT_TRUE(a.join(member("p0")));
  EXPECT_TRUE(view.wait_for("p0", true, 0ms));
  EXPECT_EQ(a.leave("d0").code(), ErrorCode::kNotFound);  // not a's member
  EXPECT_EQ(a.join(member("bad/name")).code(), ErrorCode::kInvalidArgument);
  ASSERT_TRUE(a.leave("p0"));
  EXPECT_TRUE(view.wait_for("p0", false, 0ms));
  b.reset();  // a registry that goes away takes its members with it
  EXPECT_TRUE(view.wait_for("d0", false, 0ms));
  EXPECT_TRUE(a.members()->empty());
}

class KvEtcd : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!testing::etcd_binary()) GTEST_SKIP() << "etcd-server is not installed (make deps)";
    ASSERT_TRUE(etcd_.start()) << "etcd did not start";
  }
  EtcdOptions options() {
    EtcdOptions o;
    o.endpoint = etcd_.endpoint();
    o.lease_ttl = 2s;
    o.request_timeout = 1000ms;
    o.retry_interval = 100ms;
    return o;
  }
  std::unique_ptr<EtcdRegistry> connect() {
    auto r = EtcdRegistry::connect(options());
    EXPECT_TRUE(r) << r.status().to_string();
    return r ? std::move(*r) : nullptr;
  }
  testing::EtcdServer etcd_;
};

TEST_F(KvEtcd, JoinLeaveWatch) {
  auto a = connect();
  auto b = connect();
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(a->join(member("p0")));
  View view;
  ASSERT_TRUE(b->watch(view.fn()));
  EXPECT_TRUE(view.wait_for("p0", true));
  ASSERT_TRUE(a->join(member("p1")));
  EXPECT_TRUE(view.wait_for("p1", true));
  auto all = b->members();
  ASSERT_TRUE(all);
  ASSERT_EQ(all->size(), 2u);
  EXPECT_EQ((*all)[0], member("p0"));
  ASSERT_TRUE(a->leave("p0"));
  EXPECT_TRUE(view.wait_for("p0", false));
  EXPECT_EQ(a->leave("p0").code(), ErrorCode::kNotFound);
  EXPECT_EQ(a->join(member("")).code(), ErrorCode::kInvalidArgument);
  a.reset();  // revokes its lease: p1 goes
  EXPECT_TRUE(view.wait_for("p1", false));
  EtcdOptions nowhere = options();
  nowhere.endpoint = "http://127.0.0.1:1";
  EXPECT_EQ(EtcdRegistry::connect(nowhere).status().code(), ErrorCode::kPeerUnreachable);
}

TEST_F(KvEtcd, CrashedMemberDisappearsWithItsLease) {
  auto watcher = connect();
  ASSERT_TRUE(watcher);
  View view;
  ASSERT_TRUE(watcher->watch(view.fn()));
  fabric::testing::PeerProcess child;
  ASSERT_TRUE(child.start({"tcp", "tcp", false}, 0));
  child.send("prefill 1 0 8");
  ASSERT_FALSE(child.read_value("address").empty());
  child.send("etcd " + etcd_.endpoint() + " crashing");
  ASSERT_EQ(child.read_line(), "joined");
  ASSERT_TRUE(view.wait_for("crashing", true));
  child.kill_now();
  const auto killed = std::chrono::steady_clock::now();
  ASSERT_TRUE(view.wait_for("crashing", false, 10s));
  // Its lease TTL is 1 s; etcd checks expiry about every 500 ms.
  EXPECT_LT(std::chrono::steady_clock::now() - killed, 5s);
}

// A router (this test) sends requests to the prefillers it sees in etcd; prefillers join,
// one leaves after draining, etcd restarts in the middle. Every request must land byte-exact.
TEST_F(KvEtcd, TrafficThroughJoinLeaveAndEtcdRestart) {
  using testing::Rank;
  const fabric::testing::Backend tcp{"tcp", "tcp", false};
  Config config = fabric::testing::make_config(tcp);
  Options kv_options;
  kv_options.heartbeat = 100ms;
  kv_options.quarantine = 300ms;
  struct Prefill {
    std::unique_ptr<Rank> rank;
    std::unique_ptr<KvPrefiller> prefiller;
    std::unique_ptr<EtcdRegistry> registry;
    int served = 0;
  };
  std::map<std::string, Prefill> prefills;
  auto add_prefill = [&](const std::string& name) {
    Prefill p;
    auto r = testing::make_rank(config, testing::test_layout(1, 0, 64));
    ASSERT_TRUE(r);
    p.rank = std::move(*r);
    auto k = KvPrefiller::create(*p.rank->engine, p.rank->layout, p.rank->reg, kv_options);
    ASSERT_TRUE(k);
    p.prefiller = std::move(*k);
    p.registry = connect();
    ASSERT_TRUE(p.registry);
    Member m = member(name);
    m.address = p.rank->engine->address().to_hex();
    ASSERT_TRUE(p.registry->join(m));
    prefills[name] = std::move(p);
  };
  auto dec_rank = testing::make_rank(config, testing::test_layout(1, 0, 64));
  ASSERT_TRUE(dec_rank);
  auto& dec = **dec_rank;
  auto decoder = KvDecoder::create(*dec.engine, dec.layout, dec.reg, kv_options);
  ASSERT_TRUE(decoder);
  View view;
  auto router = connect();
  ASSERT_TRUE(router);
  ASSERT_TRUE(router->watch(view.fn()));

  RequestId next_id = 1;
  int corrupt = 0, failed = 0, done = 0;
  // Runs `n` requests, 8 at a time, over the prefillers the router sees now.
  auto traffic = [&](int n) {
    for (int batch = 0; batch < n; batch += 8) {
      auto seen = view.members();
      std::vector<std::string> names;
      for (auto& [name, m] : seen) {
        if (prefills.count(name)) names.push_back(name);
      }
      ASSERT_FALSE(names.empty());
      std::mutex mu;
      std::condition_variable cv;
      int ended = 0;
      for (int i = 0; i < 8; ++i) {
        const RequestId id = next_id++;
        Prefill& p = prefills[names[id % names.size()]];
        ++p.served;
        const std::vector<uint32_t> src = {uint32_t(2 * i), uint32_t(2 * i + 1)};
        testing::fill_request(p.rank->layout, p.rank->cache.data(), src, id);
        ASSERT_TRUE(p.prefiller->start(id, src, 1, nullptr));
        DecodeRequest rq;
        rq.id = id;
        rq.num_pages = 2;
        rq.prefill_ranks = {p.rank->engine->address()};
        rq.on_ready = [&](RequestId id, std::span<const uint32_t> pages) {
          bool ok = testing::check_request(dec.layout, dec.cache.data(),
                                           {pages.begin(), pages.end()}, id, nullptr);
          (*decoder)->release(id).ignore();
          std::lock_guard lock(mu);
          ok ? ++done : ++corrupt;
          ++ended;
          cv.notify_all();
        };
        rq.on_error = [&](RequestId, const Status&) {
          std::lock_guard lock(mu);
          ++failed;
          ++ended;
          cv.notify_all();
        };
        ASSERT_TRUE((*decoder)->submit(std::move(rq)));
        for (uint32_t l = 0; l < 4; ++l) ASSERT_TRUE(p.prefiller->layer_done(id, l));
      }
      std::unique_lock lock(mu);
      ASSERT_TRUE(cv.wait_for(lock, 20s, [&] { return ended == 8; }));
    }
  };

  add_prefill("p1");
  add_prefill("p2");
  ASSERT_TRUE(view.wait_for("p1", true) && view.wait_for("p2", true));
  traffic(16);
  add_prefill("p3");  // joins under load
  ASSERT_TRUE(view.wait_for("p3", true));
  traffic(16);
  EXPECT_GT(prefills["p3"].served, 0);
  ASSERT_TRUE(prefills["p1"].registry->leave("p1"));  // leaves; drained (its requests ended)
  ASSERT_TRUE(view.wait_for("p1", false));
  const int p1_served = prefills["p1"].served;
  traffic(16);
  EXPECT_EQ(prefills["p1"].served, p1_served);

  etcd_.stop();  // the data path does not need etcd
  traffic(16);
  ASSERT_TRUE(etcd_.start());
  add_prefill("p4");  // membership works again: the router's watch re-synced
  ASSERT_TRUE(view.wait_for("p4", true, 15s));
  EXPECT_GE(router->resyncs(), 1u);
  auto all = router->members();
  ASSERT_TRUE(all);
  std::set<std::string> names;
  for (auto& m : *all) names.insert(m.name);
  EXPECT_EQ(names, (std::set<std::string>{"p2", "p3", "p4"}));
  traffic(16);
  EXPECT_GT(prefills["p4"].served, 0);
  EXPECT_EQ(done, 80);
  EXPECT_EQ(corrupt, 0);
  EXPECT_EQ(failed, 0);
}

}  // namespace
}  // namespace fabric::kv
