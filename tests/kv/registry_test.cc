// Membership: the in-process registry, the file registry across processes, and etcd (a real
// etcd-server started by the test on 127.0.0.1): joins and leaves seen by watchers, a crashed
// member's lease running out, and traffic that keeps flowing, uncorrupted, while prefillers join
// and leave and etcd restarts.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/stat.h>

#include <condition_variable>
#include <filesystem>
#include <fstream>
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

// A private directory for one file-registry test (in /dev/shm where it exists).
class KvFileRegistry : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (std::filesystem::is_directory("/dev/shm") ? "/dev/shm" : "/tmp") +
                       std::string("/fabric-kv-test-XXXXXX");
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }
  FileOptions options(std::chrono::milliseconds ttl = 1000ms) {
    FileOptions o;
    o.directory = dir_;
    o.lease_ttl = ttl;
    o.poll_interval = 50ms;
    return o;
  }
  std::unique_ptr<FileRegistry> open() {
    auto r = FileRegistry::open(options());
    EXPECT_TRUE(r) << r.status().to_string();
    return r ? std::move(*r) : nullptr;
  }
  // A kv peer process (its own engine) that joins the directory as member `name`.
  void spawn_member(fabric::testing::PeerProcess& child, const std::string& name) {
    ASSERT_TRUE(child.start({"tcp", "tcp", false}, 0));
    child.send("prefill 1 0 8");
    ASSERT_FALSE(child.read_value("address").empty());
    child.send("file " + dir_ + " " + name);
    ASSERT_EQ(child.read_line(), "joined");
  }
  std::string dir_;
};

TEST_F(KvFileRegistry, JoinLeaveWatchInOneProcess) {
  View view;  // outlives the registries whose threads call it
  auto a = open();
  auto b = open();
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(b->join(member("d0", "decode")));
  ASSERT_TRUE(a->watch(view.fn()));
  EXPECT_EQ(a->watch(view.fn()).code(), ErrorCode::kAlreadyExists);
  EXPECT_TRUE(view.wait_for("d0", true, 0ms));  // the current members come first
  ASSERT_TRUE(a->join(member("p0")));
  EXPECT_TRUE(view.wait_for("p0", true));
  Member changed = member("p0");
  changed.data = "layers=94";
  ASSERT_TRUE(a->join(changed));  // a change is reported as a join
  ASSERT_TRUE(view.wait_for("p0", true));
  for (int i = 0; i < 100 && view.members()["p0"].data.empty(); ++i)
    std::this_thread::sleep_for(10ms);
  EXPECT_EQ(view.members()["p0"], changed);
  EXPECT_EQ(a->leave("d0").code(), ErrorCode::kNotFound);  // not a's member
  EXPECT_EQ(a->join(member("bad/name")).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(a->join(member(".hidden")).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(a->join(member(std::string(201, 'x'))).code(), ErrorCode::kInvalidArgument);
  auto all = b->members();
  ASSERT_TRUE(all);
  ASSERT_EQ(all->size(), 2u);
  EXPECT_EQ((*all)[0], member("d0", "decode"));
  EXPECT_EQ((*all)[1], changed);
  ASSERT_TRUE(a->leave("p0"));
  EXPECT_TRUE(view.wait_for("p0", false));
  b.reset();  // a registry that goes away takes its members with it
  EXPECT_TRUE(view.wait_for("d0", false));
  EXPECT_TRUE(a->members()->empty());
  // Only temporary files could remain, and none does.
  EXPECT_TRUE(std::filesystem::is_empty(dir_));
}

TEST_F(KvFileRegistry, LeaseKeepsAMemberAcrossSeveralTtls) {
  auto a = FileRegistry::open(options(600ms));
  ASSERT_TRUE(a);
  ASSERT_TRUE((*a)->join(member("p0")));
  const std::string file = dir_ + "/p0";
  const auto written = std::filesystem::last_write_time(file);
  // Refreshed every 200 ms, it is still a member 2.5 TTLs later, and its file was touched.
  std::this_thread::sleep_for(1500ms);
  auto all = (*a)->members();
  ASSERT_TRUE(all);
  ASSERT_EQ(all->size(), 1u);
  EXPECT_EQ((*all)[0].name, "p0");
  EXPECT_GT(std::filesystem::last_write_time(file), written);
}

TEST_F(KvFileRegistry, MembersInOtherProcesses) {
  View view;  // outlives the registry whose thread calls it
  auto watcher = open();
  ASSERT_TRUE(watcher);
  ASSERT_TRUE(watcher->watch(view.fn()));
  fabric::testing::PeerProcess quitting, crashing, stopped;
  spawn_member(quitting, "quitting");
  spawn_member(crashing, "crashing");
  spawn_member(stopped, "stopped");
  ASSERT_TRUE(view.wait_for("quitting", true));
  ASSERT_TRUE(view.wait_for("crashing", true));
  ASSERT_TRUE(view.wait_for("stopped", true));
  EXPECT_EQ(view.members()["crashing"].role, "prefill");

  signal(SIGPIPE, SIG_IGN);  // ~PeerProcess says quit again, to a process that is gone
  quitting.send("quit");     // leaves on exit
  EXPECT_TRUE(view.wait_for("quitting", false));

  crashing.kill_now();  // its pid is gone: noticed at the next scan, well within its TTL
  auto killed = std::chrono::steady_clock::now();
  ASSERT_TRUE(view.wait_for("crashing", false));
  EXPECT_LT(std::chrono::steady_clock::now() - killed, 1000ms);
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/crashing"));  // the dead owner's file went

  // A process that stops refreshing (alive, but hung) is gone once its 1 s lease runs out, and
  // back once it refreshes again.
  ASSERT_EQ(kill(stopped.pid(), SIGSTOP), 0);
  auto frozen = std::chrono::steady_clock::now();
  ASSERT_TRUE(view.wait_for("stopped", false, 5s));
  EXPECT_GE(std::chrono::steady_clock::now() - frozen, 500ms);
  ASSERT_EQ(kill(stopped.pid(), SIGCONT), 0);
  EXPECT_TRUE(view.wait_for("stopped", true, 5s));
}

TEST_F(KvFileRegistry, BadDirectoryIsAClearError) {
  FileOptions o = options();
  o.directory = "";
  EXPECT_EQ(FileRegistry::open(o).status().code(), ErrorCode::kInvalidArgument);
  std::string file = dir_ + "/plain";
  std::ofstream(file) << "x";
  o.directory = file + "/sub";
  auto r = FileRegistry::open(o);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find(file), std::string::npos) << r.status().to_string();
  o.directory = file;
  EXPECT_EQ(FileRegistry::open(o).status().code(), ErrorCode::kInvalidArgument);
  o = options();
  o.lease_ttl = 0ms;
  EXPECT_EQ(FileRegistry::open(o).status().code(), ErrorCode::kInvalidArgument);
  // A file in the directory that is not a member is ignored.
  auto reg = open();
  ASSERT_TRUE(reg);
  auto all = reg->members();
  ASSERT_TRUE(all);
  EXPECT_TRUE(all->empty());
  if (geteuid() != 0) {
    std::string ro = dir_ + "/ro";
    ASSERT_EQ(mkdir(ro.c_str(), 0500), 0);
    o.directory = ro;
    o.lease_ttl = 1000ms;
    EXPECT_EQ(FileRegistry::open(o).status().code(), ErrorCode::kInvalidArgument);
  }
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
  View view;  // outlives the registries whose threads call it
  auto a = connect();
  auto b = connect();
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(a->join(member("p0")));
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
  View view;  // outlives the registry whose thread calls it
  auto watcher = connect();
  ASSERT_TRUE(watcher);
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
  EXPECT_LT(std::chrono::steady_clock::now() - killed, 5s * fabric::testing::kSlowdown);
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
