// Dying peers: for each operation, a peer process is killed with SIGKILL while transfers to it
// are in flight (and more are submitted after its death). Every transfer towards it ends with
// exactly one callback, the ones that did not finish with kPeerUnreachable, all within
// Config::peer_timeout plus a slack; transfers to a second, living peer process complete with
// their data and immediates intact; and a new process started at the dead one's endpoint
// address (tcp: the same port) is reached afresh, with its own descriptors.
#include <algorithm>
#include <numeric>
#include <random>

#include "peer_process.h"
#include "reliability_support.h"

namespace fabric::testing {
namespace {

enum class OpKind { kSingle, kPaged, kScatter, kBarrier, kImm, kSend };

const char* op_name(OpKind k) {
  switch (k) {
    case OpKind::kSingle:
      return "single";
    case OpKind::kPaged:
      return "paged";
    case OpKind::kScatter:
      return "scatter";
    case OpKind::kBarrier:
      return "barrier";
    case OpKind::kImm:
      return "imm";
    case OpKind::kSend:
      return "send";
  }
  return "?";
}

using Param = std::tuple<Backend, OpKind>;

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return std::get<0>(info.param).name + "_" + op_name(std::get<1>(info.param));
}

// Short, so the test is quick; longer under sanitizers, where a live peer process (slowed down
// as much) may really not answer for a second on a loaded machine.
constexpr std::chrono::milliseconds kPeerTimeout{kSanitized ? 3000 : 1000};
constexpr uint64_t kPeerBytes = 8 << 20;
constexpr uint64_t kWriteBytes = 1 << 20;  // single writes and scatter targets
constexpr uint64_t kPage = 64 << 10;       // paged: 16 pages of 64 KiB
constexpr uint32_t kPages = 16;
// Immediates: transfers to the survivor alone use kSurvivorImm; those that touch the victim
// (also a scatter or barrier over both) use kVictimImm, so the survivor's count stays exact.
constexpr uint32_t kSurvivorImm = 500;
constexpr uint32_t kVictimImm = 501;

struct Peer {
  PeerProcess process;
  Address address;
  RemoteMemory memory;
};

class DyingPeer : public ::testing::TestWithParam<Param> {
 protected:
  const Backend& backend() const { return std::get<0>(GetParam()); }
  OpKind kind() const { return std::get<1>(GetParam()); }

  void SetUp() override {
    Config config = make_config(backend());
    config.peer_timeout = kPeerTimeout;
    auto e = TransferEngine::create(config);
    if (!e && e.status().code() == ErrorCode::kUnsupported) {
      GTEST_SKIP() << "provider not available: " << e.status().to_string();
    }
    ASSERT_TRUE(e) << e.status().to_string();
    engine_ = std::move(*e);
    src_ = make_buffer(*engine_, kPeerBytes);
    fill_pattern(src_->bytes.data(), kPeerBytes, 99);
    const int port = free_loopback_port();
    ASSERT_GT(port, 0);
    victim_env_ = {"FI_TCP_PORT_LOW_RANGE=" + std::to_string(port),
                   "FI_TCP_PORT_HIGH_RANGE=" + std::to_string(port)};
    ASSERT_NO_FATAL_FAILURE(start(victim_, victim_env_));
    ASSERT_NO_FATAL_FAILURE(start(survivor_, {}));
    auto both = engine_->add_peer_group({victim_.address, survivor_.address});
    auto alone = engine_->add_peer_group({survivor_.address});
    ASSERT_TRUE(both && alone);
    both_ = *both;
    alone_ = *alone;
  }

  void TearDown() override { engine_.reset(); }  // before the memory it registered

  void start(Peer& p, const std::vector<std::string>& env) {
    PeerOptions options;
    options.env = env;
    ASSERT_TRUE(p.process.start(backend(), kPeerBytes, options));
    auto addr = Address::from_hex(p.process.read_value("address"));
    ASSERT_TRUE(addr) << addr.status().to_string();
    auto mem = RemoteMemory::from_hex(p.process.read_value("memory"));
    ASSERT_TRUE(mem) << mem.status().to_string();
    ASSERT_EQ(p.process.read_line(), "ready");
    p.address = *addr;
    p.memory = *mem;
  }

  // One transfer of the test's kind towards the victim (with the survivor where the kind
  // addresses a group) or towards the survivor alone.
  Result<TransferId> submit(bool to_victim, Callbacks cb) {
    const Peer& target = to_victim ? victim_ : survivor_;
    const uint32_t imm = to_victim ? kVictimImm : kSurvivorImm;
    switch (kind()) {
      case OpKind::kSingle:
        return engine_->submit(
            SingleWrite{src_->reg.handle, 0, target.memory, 0, kWriteBytes, imm, {}}, cb);
      case OpKind::kPaged: {
        std::vector<uint32_t> pages(kPages);
        std::iota(pages.begin(), pages.end(), 0);
        std::shuffle(pages.begin(), pages.end(), rng_);
        return engine_->submit(PagedWrite{src_->reg.handle, target.memory, kPage, pages, kPage, 0,
                                          pages, kPage, 0, imm},
                               cb);
      }
      case OpKind::kScatter: {
        Scatter sc{src_->reg.handle, to_victim ? both_ : alone_, {}, imm, {}};
        if (to_victim) {
          sc.targets.push_back({victim_.memory, kWriteBytes, 0, 0});
          // The survivor's part of a scatter over both lands above the range checked below.
          sc.targets.push_back({survivor_.memory, kWriteBytes, 0, 4 * kWriteBytes});
        } else {
          sc.targets.push_back({survivor_.memory, kWriteBytes, 0, 0});
        }
        return engine_->submit(sc, cb);
      }
      case OpKind::kBarrier:
        return engine_->submit(Barrier{to_victim ? both_ : alone_, imm, 0, 0}, cb);
      case OpKind::kImm:
        return engine_->submit(ImmWrite{target.address, imm, 0, 0}, cb);
      case OpKind::kSend: {
        std::vector<std::byte> message(1024, std::byte{0x5a});
        return engine_->submit_send(target.address, message, cb);
      }
    }
    return Status(ErrorCode::kInternal, "unknown kind");
  }

  // Arrivals of kSurvivorImm at the survivor per transfer addressed to it alone.
  uint64_t survivor_imms_per_transfer() const {
    switch (kind()) {
      case OpKind::kPaged:
        return kPages;
      case OpKind::kSend:
        return 0;
      default:
        return 1;
    }
  }
  bool writes_data() const {
    return kind() == OpKind::kSingle || kind() == OpKind::kPaged || kind() == OpKind::kScatter;
  }

  std::unique_ptr<TransferEngine> engine_;
  std::unique_ptr<Buffer> src_;
  std::vector<std::string> victim_env_;
  Peer victim_;
  Peer survivor_;
  PeerGroup both_;
  PeerGroup alone_;
  std::mt19937 rng_{7};
};

TEST_P(DyingPeer, EveryAffectedTransferFailsOnceInTimeAndOthersComplete) {
  // Zero-byte operations finish quickly, so more of them are needed to be in flight at the kill.
  const int before = writes_data() ? 48 : 2000;
  const int after = writes_data() ? 16 : 200;
  Tally victim, survivor;
  for (int i = 0; i < before; ++i) {
    ASSERT_TRUE(submit(true, victim.callbacks()));
    ASSERT_TRUE(submit(false, survivor.callbacks()));
  }
  const Clock::time_point killed = Clock::now();
  victim_.process.kill_now();
  // Submitted after the death: each must fail, none may hang.
  for (int i = 0; i < after; ++i) {
    ASSERT_TRUE(submit(true, victim.callbacks()));
    ASSERT_TRUE(submit(false, survivor.callbacks()));
  }
  const int total = before + after;
  const auto bound = kPeerTimeout + std::chrono::seconds(3 * kSlowdown);
  ASSERT_TRUE(victim.wait_total(total, bound + 20s)) << victim.summary();
  ASSERT_TRUE(survivor.wait_total(total, 60s)) << survivor.summary();
  std::this_thread::sleep_for(50ms);  // a second callback would show up here

  // Towards the dead peer: exactly one callback each, within the bound; the failures say why.
  EXPECT_EQ(victim.done() + victim.failed(), total) << victim.summary();
  EXPECT_EQ(victim.twice(), 0);
  EXPECT_GE(victim.failed(), after)
      << "a transfer submitted after the death succeeded: " << victim.summary();
  EXPECT_EQ(victim.codes()[ErrorCode::kPeerUnreachable], victim.failed()) << victim.summary();
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(victim.last() - killed);
  EXPECT_LE(took, bound) << "the last callback came " << took.count() << " ms after the kill";
  std::cout << "[          ] " << op_name(kind()) << ": " << victim.summary() << "; last after "
            << took.count() << " ms\n";

  // Towards the living peer: everything done, data and immediates exact.
  EXPECT_EQ(survivor.done(), total) << survivor.summary();
  EXPECT_EQ(survivor.twice(), 0);
  if (const uint64_t per = survivor_imms_per_transfer(); per > 0) {
    const uint64_t want = per * static_cast<uint64_t>(total);
    survivor_.process.send("expect " + std::to_string(kSurvivorImm) + " " + std::to_string(want));
    EXPECT_EQ(survivor_.process.read_line(),
              "got " + std::to_string(kSurvivorImm) + " " + std::to_string(want));
  }
  if (writes_data()) {
    const uint64_t n = kind() == OpKind::kPaged ? kPages * kPage : kWriteBytes;
    survivor_.process.send("checksum 0 " + std::to_string(n));
    EXPECT_EQ(survivor_.process.read_value("checksum"),
              std::to_string(fnv1a(src_->bytes.data(), n)));
  }

  // A new process at the dead one's address is reached afresh: the same kind of transfer over
  // the same peer group (scatter, barrier) or address, and a verified write.
  Peer reborn;
  ASSERT_NO_FATAL_FAILURE(start(reborn, victim_env_));
  // On tcp the endpoint is the same (the port range holds one port); the scratch region behind
  // imm-only writes is the new process's. A shm endpoint names its process, so there the new
  // process is a new address.
  ASSERT_EQ(reborn.address.num_nics(), victim_.address.num_nics());
  for (size_t i = 0; backend().provider == "tcp" && i < reborn.address.num_nics(); ++i) {
    ASSERT_EQ(reborn.address.nics()[i].name, victim_.address.nics()[i].name)
        << "the new process did not get the dead one's endpoint (FI_TCP_PORT_*_RANGE ignored?)";
  }
  victim_.address = reborn.address;
  victim_.memory = reborn.memory;
  auto both = engine_->add_peer_group({reborn.address, survivor_.address});
  ASSERT_TRUE(both) << both.status().to_string();
  both_ = *both;
  Probe again;
  ASSERT_TRUE(submit(true, again.callbacks()));
  Status s = again.wait(30s);
  EXPECT_TRUE(s) << "the same kind of transfer to the new process: " << s.to_string();
  Probe write;
  ASSERT_TRUE(engine_->submit(SingleWrite{src_->reg.handle, 0, reborn.memory, 0, 4096, 77, {}},
                              write.callbacks()));
  s = write.wait(30s);
  ASSERT_TRUE(s) << "a write to the new process: " << s.to_string();
  reborn.process.send("expect 77 1");
  EXPECT_EQ(reborn.process.read_line(), "got 77 1");
  reborn.process.send("checksum 0 4096");
  EXPECT_EQ(reborn.process.read_value("checksum"), std::to_string(fnv1a(src_->bytes.data(), 4096)));
}

// tcp, and the engine's own shm transport (libfabric 1.17's shm provider could not survive a
// peer killed mid-transfer: docs/shm.md).
std::vector<Backend> dying_peer_backends() {
  std::vector<Backend> out;
  for (const Backend& b : all_backends()) {
    if (b.provider == "tcp" || b.provider == "shm") out.push_back(b);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Providers, DyingPeer,
                         ::testing::Combine(::testing::ValuesIn(dying_peer_backends()),
                                            ::testing::Values(OpKind::kSingle, OpKind::kPaged,
                                                              OpKind::kScatter, OpKind::kBarrier,
                                                              OpKind::kImm, OpKind::kSend)),
                         param_name);

}  // namespace
}  // namespace fabric::testing
