// Multi-NIC sharding on real links. This process enters network namespace <lab>-a (setns,
// before any thread exists); its peers run in <lab>-b (through `ip netns exec`); the two are
// joined by veth0..vethN-1, one shaped link and one libfabric tcp domain each (tools/netlab,
// brought up and down by the CTest fixture of tests/netlab/CMakeLists.txt).
//
// Every test checks the data at the receiver (checksums), the receiver's immediate counts
// (exact), and which links carried the bytes: the transmit counters of this namespace's veths
// (/proc/self/net/dev), e.g. a write pinned to NIC 1 moves its bytes over veth1 and none over
// veth0. Cross-rail or wrong-key writes show up here as a failed write or as bytes on the wrong
// link, since each endpoint is bound to its own link's address.
#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <numeric>
#include <random>
#include <sstream>
#include <thread>

#include "peer_process.h"
#include "test_support.h"

namespace fabric::testing {
namespace {

constexpr uint32_t kLabLinks = FABRIC_NETLAB_LINKS;
constexpr uint64_t kMiB = 1 << 20;
// A link that carries less than this during a step counts as unused (ARP and TCP ACKs only).
constexpr uint64_t kQuietBytes = 16 * 1024;
constexpr uint64_t kPeerBytes = 96 * kMiB;

std::string g_lab = FABRIC_NETLAB_NAME;  // FABRIC_NETLAB_NAME in the environment overrides
std::string g_skip;                      // why the lab tests cannot run here; empty: they can

// Enters <lab>-a, or records why not. Must run before any thread is created: a network
// namespace is per thread, and threads inherit it from their creator.
void enter_lab() {
  if (const char* name = std::getenv("FABRIC_NETLAB_NAME")) g_lab = name;
  if (std::ifstream f(FABRIC_NETLAB_SKIP_FILE); f) {
    std::getline(f, g_skip);
    if (!g_skip.empty()) return;
  }
  if (geteuid() != 0) {
    g_skip = "not root (network namespaces need root)";
    return;
  }
  const std::string path = "/run/netns/" + g_lab + "-a";
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    g_skip = "lab '" + g_lab + "' is not up (" + path + ": " + std::strerror(errno) +
             "); run the tests through ctest (fixture netlab_up) or: tools/netlab up --name " +
             g_lab + " --links " + std::to_string(kLabLinks);
    return;
  }
  if (setns(fd, CLONE_NEWNET) != 0) g_skip = "setns(" + path + "): " + std::strerror(errno);
  close(fd);
}

// Bytes this namespace has transmitted on veth0 .. veth<kLabLinks - 1>.
std::vector<uint64_t> tx_bytes() {
  std::vector<uint64_t> out(kLabLinks, 0);
  std::ifstream f("/proc/self/net/dev");
  std::string line;
  while (std::getline(f, line)) {
    auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string name = line.substr(0, colon);
    name.erase(0, name.find_first_not_of(' '));
    if (name.rfind("veth", 0) != 0) continue;
    const unsigned long index = std::strtoul(name.c_str() + 4, nullptr, 10);
    std::istringstream fields(line.substr(colon + 1));
    uint64_t v[9] = {};
    for (uint64_t& x : v) fields >> x;  // rx: bytes packets errs drop fifo frame compr mcast
    if (index < kLabLinks) out[index] = v[8];
  }
  return out;
}

// What each link transmitted since `before`.
struct LinkDelta {
  std::vector<uint64_t> before = tx_bytes();
  std::vector<uint64_t> get() const {
    std::vector<uint64_t> now = tx_bytes();
    for (size_t i = 0; i < now.size(); ++i) now[i] -= before[i];
    return now;
  }
};

std::string show(const std::vector<uint64_t>& bytes) {
  std::string s;
  for (size_t i = 0; i < bytes.size(); ++i) {
    s += (i ? ", " : "") + ("veth" + std::to_string(i)) + " " + std::to_string(bytes[i]);
  }
  return s;
}

// at_least[i] > 0: link i carried at least that many bytes; 0: link i stayed quiet.
void expect_links(const std::vector<uint64_t>& delta, const std::vector<uint64_t>& at_least,
                  const std::string& what) {
  for (size_t i = 0; i < delta.size(); ++i) {
    const uint64_t want = i < at_least.size() ? at_least[i] : 0;
    if (want > 0) {
      EXPECT_GE(delta[i], want) << what << ": link " << i << " carried too little; " << show(delta);
    } else {
      EXPECT_LT(delta[i], kQuietBytes)
          << what << ": link " << i << " should be unused; " << show(delta);
    }
  }
}

std::string nic_list(uint32_t nics) {
  std::string s;
  for (uint32_t i = 0; i < nics; ++i) s += (i ? ",veth" : "veth") + std::to_string(i);
  return s;
}

// Equal shares (Config::weighted_sharding off) unless `weighted`: most tests check the even
// policy's shares, which rate estimates that differ by a few percent between equal links would
// blur.
Config lab_config(uint32_t nics, bool weighted = false) {
  Config c = make_config(Backend{"tcp", "tcp", false});
  c.weighted_sharding = weighted;
  c.groups[0].nics.clear();
  for (uint32_t i = 0; i < nics; ++i) c.groups[0].nics.push_back("veth" + std::to_string(i));
  return c;
}

// A fabric_test_peer in namespace <lab>-b on the first `nics` links.
struct LabPeer {
  PeerProcess process;
  Address address;
  RemoteMemory memory;

  static std::unique_ptr<LabPeer> start(uint32_t nics) {
    auto p = std::make_unique<LabPeer>();
    PeerOptions options{{"ip", "netns", "exec", g_lab + "-b"}, nic_list(nics), {}};
    if (!p->process.start(Backend{"tcp", "tcp", false}, kPeerBytes, options)) return nullptr;
    auto addr = Address::from_hex(p->process.read_value("address"));
    auto mem = from_hex(p->process.read_value("memory"));
    if (!addr || !mem || !RemoteMemory::decode(*mem)) return nullptr;
    p->address = *addr;
    p->memory = *RemoteMemory::decode(*mem);
    if (p->process.read_line() != "ready") return nullptr;
    return p;
  }
  // The peer's count of `imm` once it has reached `count` (30 s at most).
  std::string count(uint32_t imm, uint64_t count) {
    process.send("expect " + std::to_string(imm) + " " + std::to_string(count));
    return process.read_line();
  }
  std::string checksum(uint64_t offset, uint64_t length) {
    process.send("checksum " + std::to_string(offset) + " " + std::to_string(length));
    return process.read_value("checksum");
  }
  void fill(uint64_t seed) {
    process.send("fill " + std::to_string(seed));
    EXPECT_EQ(process.read_line(), "filled");
  }
};

std::string got(uint32_t imm, uint64_t n) {
  return "got " + std::to_string(imm) + " " + std::to_string(n);
}

class LabTest : public ::testing::Test {
 protected:
  // A skip inside a helper would only leave the helper: skip here, before the body runs.
  void SetUp() override {
    if (!g_skip.empty()) GTEST_SKIP() << g_skip;
  }
  // This process's engine on the first `nics` links, a source buffer, and one peer.
  void open(uint32_t nics, bool weighted = false) {
    if (!g_skip.empty()) GTEST_SKIP() << g_skip;
    nics_ = nics;
    auto e = TransferEngine::create(lab_config(nics, weighted));
    ASSERT_TRUE(e) << e.status().to_string();
    engine_ = std::move(*e);
    ASSERT_EQ(engine_->group_info().nics.size(), nics);
    src_ = make_buffer(*engine_, kPeerBytes);
    fill_pattern(src_->bytes.data(), kPeerBytes, 5);
    peer_ = LabPeer::start(nics);
    ASSERT_TRUE(peer_) << "the peer in " << g_lab << "-b did not start";
  }

  std::string src_checksum(uint64_t offset, uint64_t length) const {
    return std::to_string(fnv1a(src_->bytes.data() + offset, length));
  }

  // One single write with an immediate into peer_, verified: done, counted once, same bytes.
  void write_verified(uint64_t src_offset, uint64_t dst_offset, uint64_t length, uint32_t imm,
                      Routing routing, const std::string& what) {
    Probe done;
    ASSERT_TRUE(engine_->submit(
        SingleWrite{src_->reg.handle, src_offset, peer_->memory, dst_offset, length, imm, routing},
        done.callbacks()))
        << what;
    Status s = done.wait(60s);
    ASSERT_TRUE(s) << what << ": " << s.to_string();
    EXPECT_EQ(peer_->count(imm, 1), got(imm, 1)) << what;
    EXPECT_EQ(peer_->checksum(dst_offset, length), src_checksum(src_offset, length)) << what;
  }

  uint32_t nics_ = 0;
  std::unique_ptr<TransferEngine> engine_;
  std::unique_ptr<Buffer> src_;
  std::unique_ptr<LabPeer> peer_;
};

class NetLab : public LabTest, public ::testing::WithParamInterface<uint32_t> {
 protected:
  void SetUp() override { open(GetParam()); }
};

// The smallest shard of a write sharded over k NICs (Config::shard_alignment 8192).
uint64_t last_shard(uint64_t length, uint64_t k) {
  uint64_t size = (length + k - 1) / k;
  size = (size + 8191) / 8192 * 8192;
  return length - (k - 1) * size;
}

TEST_P(NetLab, SingleWritesShardedRoundRobinOverEveryLink) {
  const uint64_t sizes[] = {32 * kMiB, 32 * kMiB + 12345, 3 * kMiB + 1};
  uint32_t imm = 100;
  for (uint64_t length : sizes) {
    const std::string what = "sharded write of " + std::to_string(length) + " B";
    LinkDelta links;
    write_verified(imm, 0, length, imm, Routing::sharded(), what);
    // Every link of the group carried a share (the remainder shard the smallest); the lab's
    // other links nothing.
    std::vector<uint64_t> want(nics_, last_shard(length, nics_));
    const auto delta = links.get();
    expect_links(delta, want, what);
    EXPECT_GE(std::accumulate(delta.begin(), delta.begin() + nics_, uint64_t{0}), length);
    ++imm;
  }
}

TEST_P(NetLab, SingleWritesPinnedToEachNic) {
  // Reference defect: pinning to a NIC other than the first posted with the first NIC's keys.
  const uint64_t length = 8 * kMiB + 3;
  for (uint32_t nic = 0; nic < nics_; ++nic) {
    const std::string what = "write pinned to NIC " + std::to_string(nic);
    LinkDelta links;
    write_verified(nic * 4096 + 1, nic, length, 200 + nic, Routing::pinned(nic), what);
    std::vector<uint64_t> want(nics_, 0);
    want[nic] = length;
    expect_links(links.get(), want, what);
  }
}

TEST_P(NetLab, SingleWritesShardedOntoFewerNics) {
  // Reference defect: sharding onto k < N NICs posted with the wrong NIC's keys.
  const uint64_t length = 16 * kMiB + 777;
  for (uint32_t k = 1; k < nics_; ++k) {
    for (uint32_t round = 0; round < nics_; ++round) {  // the rotation moves the k NICs
      const std::string what =
          "write sharded onto " + std::to_string(k) + " NICs, round " + std::to_string(round);
      LinkDelta links;
      const uint32_t imm = 250 + k * 16 + round;
      write_verified(round * 512 + 3, 0, length, imm, Routing::sharded(k), what);
      const auto delta = links.get();
      uint32_t used = 0, quiet = 0;
      for (uint32_t i = 0; i < kLabLinks; ++i) {
        if (delta[i] >= last_shard(length, k)) ++used;
        if (delta[i] < kQuietBytes) ++quiet;
      }
      EXPECT_EQ(used, k) << what << ": " << show(delta);
      EXPECT_EQ(quiet, kLabLinks - k) << what << ": " << show(delta);
    }
  }
}

TEST_P(NetLab, PagedWritesSplitAcrossNicsOneImmediatePerPage) {
  constexpr uint64_t kPage = 16 * 1024;
  for (uint32_t pages : {401u, 64u, 3u}) {
    const std::string what = std::to_string(pages) + " pages";
    std::vector<uint32_t> order(pages);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937(pages));
    const uint32_t imm = 300 + pages;
    LinkDelta links;
    Probe done;
    ASSERT_TRUE(engine_->submit(PagedWrite{src_->reg.handle, peer_->memory, kPage, order, kPage,
                                           kPage * pages, order, kPage, 0, imm},
                                done.callbacks()));
    ASSERT_TRUE(done.wait(60s)) << what;
    EXPECT_EQ(peer_->count(imm, pages), got(imm, pages)) << what;
    EXPECT_EQ(peer_->checksum(0, pages * kPage), src_checksum(kPage * pages, pages * kPage))
        << what;
    // split_even: every NIC takes pages / N or one more, in one run; fewer pages than NICs
    // leave some NICs out.
    const auto delta = links.get();
    if (pages >= nics_) {
      expect_links(delta, std::vector<uint64_t>(nics_, pages / nics_ * kPage), what);
    } else {
      uint32_t carried = 0;
      for (uint32_t i = 0; i < nics_; ++i) carried += delta[i] >= kPage;
      EXPECT_EQ(carried, pages) << what << ": " << show(delta);
    }
  }
}

TEST_P(NetLab, ScatterByPeersAndByBytesKeepsEveryByte) {
  // Reference defect: byte sharding dropped the remainder (lengths not divisible by N).
  auto peer2 = LabPeer::start(nics_);
  ASSERT_TRUE(peer2);
  auto group = engine_->add_peer_group({peer_->address, peer2->address});
  ASSERT_TRUE(group) << group.status().to_string();
  const uint64_t lengths[] = {kMiB + 3, 777777, 2 * kMiB + 1, 300001,    5,
                              500009,   333333, 4 * kMiB + 7, 654321 + 2};
  constexpr uint64_t kFillSeed = 9;
  constexpr uint64_t kGap = 4099;  // untouched bytes after every target, checked
  std::vector<std::byte> poison(kPeerBytes);
  fill_pattern(poison.data(), kPeerBytes, kFillSeed);
  for (Scatter::Sharding sharding : {Scatter::Sharding::kByPeer, Scatter::Sharding::kByBytes}) {
    const bool by_bytes = sharding == Scatter::Sharding::kByBytes;
    const std::string what = by_bytes ? "scatter by bytes" : "scatter by peers";
    const uint32_t imm = by_bytes ? 401 : 400;
    peer_->fill(kFillSeed);
    peer2->fill(kFillSeed);
    LabPeer* peers[] = {peer_.get(), peer2.get()};
    std::vector<ScatterTarget> targets;
    uint64_t dst_next[2] = {11, 11};
    uint64_t src_next = 1;
    for (size_t i = 0; i < std::size(lengths); ++i) {
      LabPeer* p = peers[i % 2];
      targets.push_back({p->memory, lengths[i], src_next, dst_next[i % 2]});
      dst_next[i % 2] += lengths[i] + kGap;
      src_next += lengths[i] + 17;
    }
    LinkDelta links;
    Probe done;
    ASSERT_TRUE(engine_->submit(Scatter{src_->reg.handle, *group, targets, imm, sharding},
                                done.callbacks()));
    ASSERT_TRUE(done.wait(60s)) << what;
    EXPECT_EQ(peer_->count(imm, 5), got(imm, 5)) << what;
    EXPECT_EQ(peer2->count(imm, 4), got(imm, 4)) << what;
    for (size_t i = 0; i < targets.size(); ++i) {
      const ScatterTarget& t = targets[i];
      LabPeer* p = peers[i % 2];
      EXPECT_EQ(p->checksum(t.dst_offset, t.length), src_checksum(t.src_offset, t.length))
          << what << ": target " << i << " (" << t.length << " B)";
      EXPECT_EQ(p->checksum(t.dst_offset + t.length, kGap),
                std::to_string(fnv1a(poison.data() + t.dst_offset + t.length, kGap)))
          << what << ": bytes after target " << i << " were written";
    }
    // By peers: targets rotate over the NICs, each NIC takes at least two of the nine, at most
    // one of them the 5-byte one. By bytes: every target above shard_min_bytes (256 KiB) is
    // split over every NIC, the smallest share of the 4 MiB one alone more than 512 KiB / N.
    const uint64_t least = by_bytes ? 512 * 1024 / nics_ : 300001;
    expect_links(links.get(), std::vector<uint64_t>(nics_, least), what);
  }
}

TEST_P(NetLab, ImmOnlyAndBarrierGoOverTheChosenRail) {
  // Reference defect: imm-only and barrier writes picked the remote NIC by chunk index, so they
  // crossed rails. Here each endpoint is bound to its link's address: a cross-rail write would
  // travel (and count) on another link.
  auto peer2 = LabPeer::start(nics_);
  ASSERT_TRUE(peer2);
  auto group = engine_->add_peer_group({peer_->address, peer2->address});
  ASSERT_TRUE(group);
  constexpr int kImms = 400;
  constexpr int kBarriers = 20;
  // A zero-byte write with an immediate is one rxm message, a TCP segment: > 50 B on the wire.
  constexpr uint64_t kLeastBytes = kImms * 50;
  for (uint32_t nic = 0; nic < nics_; ++nic) {
    const std::string what = "imm-only and barrier on NIC " + std::to_string(nic);
    LinkDelta links;
    Counter c;
    for (int i = 0; i < kImms; ++i) {
      ASSERT_TRUE(engine_->submit(ImmWrite{peer_->address, 500 + nic, nic, 0}, c.callbacks()));
    }
    for (int i = 0; i < kBarriers; ++i) {
      ASSERT_TRUE(engine_->submit(Barrier{*group, 520 + nic, nic, 0}, c.callbacks()));
    }
    ASSERT_TRUE(c.wait_total(kImms + kBarriers, 60s)) << what;
    EXPECT_EQ(c.done(), kImms + kBarriers) << what << ": " << c.first_error().to_string();
    EXPECT_EQ(peer_->count(500 + nic, kImms), got(500 + nic, kImms)) << what;
    EXPECT_EQ(peer_->count(520 + nic, kBarriers), got(520 + nic, kBarriers)) << what;
    EXPECT_EQ(peer2->count(520 + nic, kBarriers), got(520 + nic, kBarriers)) << what;
    EXPECT_EQ(peer2->count(500 + nic, 0), got(500 + nic, 0)) << what;
    std::vector<uint64_t> want(nics_, 0);
    want[nic] = kLeastBytes;
    expect_links(links.get(), want, what);
  }
}

TEST_P(NetLab, ReceiverCountDoesNotDependOnSharding) {
  // The same immediate, sent by engines of 1 .. N NICs with every routing they offer, and by
  // paged writes: the receiver counts exactly one arrival per single write and per page.
  const uint64_t length = 2 * kMiB + 4097;
  constexpr uint32_t kSingleImm = 600, kPageImm = 601;
  constexpr uint32_t kPages = 37;
  constexpr uint64_t kPage = 8192;
  uint64_t singles = 0, pages = 0, dst = 0;
  for (uint32_t n = 1; n <= nics_; ++n) {
    std::unique_ptr<TransferEngine> other;
    TransferEngine* sender = engine_.get();
    std::unique_ptr<Buffer> other_src;
    const Buffer* src = src_.get();
    if (n < nics_) {
      auto e = TransferEngine::create(lab_config(n));
      ASSERT_TRUE(e) << e.status().to_string();
      other = std::move(*e);
      other_src = make_buffer(*other, kPeerBytes / 4);
      std::memcpy(other_src->bytes.data(), src_->bytes.data(), kPeerBytes / 4);
      sender = other.get();
      src = other_src.get();
    }
    std::vector<Routing> routings = {Routing::sharded()};
    for (uint32_t k = 1; k <= n; ++k) routings.push_back(Routing::sharded(k));
    for (uint32_t i = 0; i < n; ++i) routings.push_back(Routing::pinned(i));
    Counter c;
    std::vector<std::pair<uint64_t, uint64_t>> written;  // (src offset, dst offset)
    for (const Routing& r : routings) {
      const uint64_t so = (singles % 7) * 4096 + singles;
      ASSERT_TRUE(sender->submit(
          SingleWrite{src->reg.handle, so, peer_->memory, dst, length, kSingleImm, r},
          c.callbacks()));
      written.emplace_back(so, dst);
      dst += length;
      ++singles;
    }
    std::vector<uint32_t> page_list(kPages);
    std::iota(page_list.begin(), page_list.end(), 0);
    ASSERT_TRUE(sender->submit(PagedWrite{src->reg.handle, peer_->memory, kPage, page_list, kPage,
                                          0, page_list, kPage, dst, kPageImm},
                               c.callbacks()));
    const uint64_t paged_dst = dst;
    dst += kPages * kPage;
    pages += kPages;
    ASSERT_TRUE(c.wait_total(static_cast<int>(routings.size()) + 1, 60s));
    EXPECT_EQ(c.failed(), 0) << c.first_error().to_string();
    EXPECT_EQ(peer_->count(kSingleImm, singles), got(kSingleImm, singles)) << n << " NIC(s)";
    EXPECT_EQ(peer_->count(kPageImm, pages), got(kPageImm, pages)) << n << " NIC(s)";
    for (auto [so, d] : written) {
      EXPECT_EQ(peer_->checksum(d, length), src_checksum(so, length)) << n << " NIC(s)";
    }
    EXPECT_EQ(peer_->checksum(paged_dst, kPages * kPage), src_checksum(0, kPages * kPage));
  }
  // Nothing arrives late: the counts stay exact after one more round trip on every rail.
  Counter c;
  for (uint32_t i = 0; i < nics_; ++i) {
    ASSERT_TRUE(engine_->submit(ImmWrite{peer_->address, 602, i, 0}, c.callbacks()));
  }
  ASSERT_TRUE(c.wait_total(static_cast<int>(nics_), 60s));
  EXPECT_EQ(peer_->count(602, nics_), got(602, nics_));
  EXPECT_EQ(peer_->count(kSingleImm, 0), got(kSingleImm, singles));
  EXPECT_EQ(peer_->count(kPageImm, 0), got(kPageImm, pages));
}

// NIC failover (docs/failover.md): a link taken down in the middle of a stream of transfers.
class Failover : public LabTest {
 protected:
  static constexpr auto kNicTimeout = std::chrono::milliseconds(1000);
  static constexpr auto kPeerTimeout = std::chrono::milliseconds(4000);

  void open_failover(uint32_t nics, bool reliable_imm) {
    if (!g_skip.empty()) GTEST_SKIP() << g_skip;
    // A test that died with a link down (a crash skips TearDown) must not break this one.
    for (uint32_t i = 0; i < kLabLinks; ++i) set_link(i, "up");
    nics_ = nics;
    Config c = lab_config(nics);
    c.nic_timeout = kNicTimeout;
    c.peer_timeout = kPeerTimeout;
    c.nic_probe_interval = std::chrono::milliseconds(250);
    c.reliable_imm = reliable_imm;
    auto e = TransferEngine::create(c);
    ASSERT_TRUE(e) << e.status().to_string();
    engine_ = std::move(*e);
    src_ = make_buffer(*engine_, kPeerBytes);
    fill_pattern(src_->bytes.data(), kPeerBytes, 5);
    peer_ = LabPeer::start(nics);
    ASSERT_TRUE(peer_) << "the peer in " << g_lab << "-b did not start";
    // The peer's buffer starts zeroed (not the source's pattern), so bytes no write delivered
    // fail the checksum. (Not `fill`: the peer's main thread writing the buffer while its
    // worker receives into it has no happens-before edge TSan can see.)
  }
  void TearDown() override {
    for (uint32_t i = 0; i < kLabLinks; ++i) {
      if (down_[i]) set_link(i, "up");
    }
  }
  void set_link(uint32_t index, const char* state) {
    const std::string cmd = std::string(FABRIC_NETLAB_TOOL) + " link --name " + g_lab + " " +
                            std::to_string(index) + " " + state;
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    down_[index] = std::string(state) == "down";
  }
  // One side's end of link `index` only ("a": this engine's, "b": the peer's).
  void set_link_side(uint32_t index, const char* side, const char* state) {
    const std::string cmd = std::string("ip -n ") + g_lab + "-" + side + " link set veth" +
                            std::to_string(index) + " " + state;
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    if (std::string(state) == "down") down_[index] = true;
  }
  // Waits (bounded) until NIC `nic` is marked `up`; returns whether it was.
  bool wait_nic(uint32_t nic, bool up, std::chrono::milliseconds timeout) {
    const auto until = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < until) {
      auto state = engine_->nics_up();
      if (nic < state.size() && state[nic] == up) return true;
      std::this_thread::sleep_for(20ms);
    }
    return false;
  }

  // A stream over [0, kSingleSpan) with sharded single writes and over
  // [kSingleSpan, kPeerBytes) with paged writes of shuffled pages; every write copies the
  // source's bytes to the same offsets, so a rewrite never changes a byte and the destination
  // must end up equal to the source.
  static constexpr uint64_t kSingleBytes = 4 * kMiB;
  static constexpr uint64_t kSingleSpan = 64 * kMiB;
  static constexpr uint64_t kPageBytes = 16 * 1024;
  static constexpr size_t kPagesPerWrite = 64;
  static constexpr uint32_t kSingleImm = 800, kPageImm = 801;
  struct Stream {
    std::vector<std::unique_ptr<Probe>> probes;
    int singles = 0, paged = 0;
  };
  void submit_stream(Stream& st, int singles, int paged, uint64_t seed) {
    const uint64_t pages_total = (kPeerBytes - kSingleSpan) / kPageBytes;
    std::vector<uint32_t> perm(pages_total);
    std::iota(perm.begin(), perm.end(), 0u);
    std::shuffle(perm.begin(), perm.end(), std::mt19937_64(seed));
    size_t next_page = 0;
    for (int i = 0; i < std::max(singles, paged); ++i) {
      if (i < singles) {
        const uint64_t off = (static_cast<uint64_t>(i) * kSingleBytes) % kSingleSpan;
        auto& p = st.probes.emplace_back(std::make_unique<Probe>());
        ASSERT_TRUE(engine_->submit(SingleWrite{src_->reg.handle, off, peer_->memory, off,
                                                kSingleBytes, kSingleImm, Routing::sharded()},
                                    p->callbacks()));
        ++st.singles;
      }
      if (i < paged) {
        std::vector<uint32_t> pages;
        for (size_t k = 0; k < kPagesPerWrite; ++k)
          pages.push_back(perm[next_page++ % perm.size()]);
        auto& p = st.probes.emplace_back(std::make_unique<Probe>());
        ASSERT_TRUE(engine_->submit(
            PagedWrite{src_->reg.handle, peer_->memory, kPageBytes, pages, kPageBytes, kSingleSpan,
                       pages, kPageBytes, kSingleSpan, kPageImm},
            p->callbacks()));
        ++st.paged;
      }
    }
  }
  // Waits for every callback of the stream (bounded); counts done and failed, checks that none
  // came twice.
  void wait_stream(const Stream& st, std::chrono::seconds bound, int& done, int& failed,
                   Status& first_error) {
    done = failed = 0;
    for (const auto& p : st.probes) {
      Status s = p->wait(bound);
      if (s.code() == ErrorCode::kTimeout) {
        // What the worker was doing: passes that still advance mean it runs (a transfer lost in
        // its state); passes that stand still mean it is blocked in a call.
        const std::string before = describe_worker();
        std::this_thread::sleep_for(1s);
        FAIL() << "a transfer got no callback within the bound; the worker then: " << before
               << "; one second later: " << describe_worker();
      }
      EXPECT_EQ(p->calls(), 1);
      if (s) {
        ++done;
      } else {
        if (failed++ == 0) first_error = s;
      }
    }
  }
  // Waits for `st` (`singles` single writes and `paged` paged writes, submit_stream's first
  // round): every transfer done, none failed, NIC 1 marked down, and the receiver's counts exact
  // (one arrival per single write and per page, none twice: a re-sent shard carries no
  // immediate, a reliable immediate is counted once).
  void expect_stream_exact_with_nic1_down(Stream& st, int singles, int paged, int& done,
                                          int& failed, Status& first_error) {
    wait_stream(st, 60s, done, failed, first_error);
    EXPECT_EQ(failed, 0) << "first error: " << first_error.to_string();
    EXPECT_EQ(done, singles + paged);
    EXPECT_TRUE(wait_nic(1, false, 5s)) << "NIC 1 was not marked down";
    EXPECT_EQ(peer_count(kSingleImm, singles), static_cast<uint64_t>(singles));
    EXPECT_EQ(peer_count(kPageImm, paged * kPagesPerWrite),
              static_cast<uint64_t>(paged * kPagesPerWrite));
  }
  // The links just went down under `st`: every transfer gets its one callback within
  // nic_timeout + peer_timeout (a NIC that fails over first hands its work to one that then
  // times out), with slack for the machine on top, and some of them failed.
  void expect_every_callback_within_the_bound(const Stream& st, const char* what) {
    const auto down_at = std::chrono::steady_clock::now();
    const auto bound = kNicTimeout + kPeerTimeout + std::chrono::milliseconds(5000);
    int done = 0, failed = 0;
    Status first_error;
    ASSERT_NO_FATAL_FAILURE(
        wait_stream(st, std::chrono::duration_cast<std::chrono::seconds>(bound) + 1s, done, failed,
                    first_error));
    const auto took = std::chrono::steady_clock::now() - down_at;
    std::cout << "observation: " << what << ": " << done << " done, " << failed
              << " failed; all callbacks within "
              << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
              << " ms; first error: " << first_error.to_string() << std::endl;
    EXPECT_LE(took, bound);
    EXPECT_EQ(done + failed, st.singles + st.paged);
    EXPECT_GT(failed, 0) << "the links went down after everything completed: this shows nothing";
    if (failed > 0) {
      EXPECT_EQ(first_error.code(), ErrorCode::kPeerUnreachable);
    }
    // No late second callback.
    std::this_thread::sleep_for(1s);
    for (const auto& p : st.probes) EXPECT_EQ(p->calls(), 1);
  }
  std::string describe_worker() {
    const GroupStats g = engine_->stats().groups.at(0);
    std::ostringstream out;
    out << "passes " << g.worker_passes << ", sleeps " << g.worker_sleeps << ", in flight "
        << g.in_flight << ", completed " << g.transfers_completed << ", failed "
        << g.transfers_failed;
    for (size_t i = 0; i < g.nics.size(); ++i) {
      const NicStats& n = g.nics[i];
      out << "; NIC " << i << (engine_->nics_up().at(i) ? " up" : " down") << ": posted "
          << n.work_requests_posted << ", completed " << n.work_requests_completed << ", failed "
          << n.work_requests_failed << ", again " << n.post_retries;
    }
    return out.str();
  }
  uint64_t peer_count(uint32_t imm, uint64_t want) {
    std::istringstream in(peer_->count(imm, want));
    std::string word;
    uint32_t got_imm = 0;
    uint64_t n = 0;
    in >> word >> got_imm >> n;
    return n;
  }

  bool down_[kLabLinks] = {};
};

// (a) A link killed mid-stream of sharded and paged writes with immediates (reliable
// immediates): every transfer completes, the data is the source's, the receiver's counts are
// exact; the dead NIC is marked down and carries nothing while down, new work avoids it, and
// it carries its share again once the link is back.
TEST_F(Failover, LinkKilledMidStreamEveryTransferCompletesWithExactCounts) {
  ASSERT_NO_FATAL_FAILURE(open_failover(4, true));
  constexpr int kSingles = 48, kPaged = 48;
  Stream st;
  submit_stream(st, kSingles, kPaged, 1);
  std::this_thread::sleep_for(150ms);  // under way: 240 MiB at 4 x 1 Gbit/s take about 0.5 s
  set_link(1, "down");
  const LinkDelta while_down;
  int done = 0, failed = 0;
  Status first_error;
  expect_stream_exact_with_nic1_down(st, kSingles, kPaged, done, failed, first_error);
  EXPECT_EQ(peer_->checksum(0, kPeerBytes), src_checksum(0, kPeerBytes)) << "data differs";

  // While down: new work (sharded, and pinned to the dead NIC) completes over the others.
  Stream st2;
  submit_stream(st2, 8, 8, 2);
  for (uint32_t i = 0; i < 4; ++i) {
    auto& p = st2.probes.emplace_back(std::make_unique<Probe>());
    ASSERT_TRUE(engine_->submit(
        SingleWrite{src_->reg.handle, 0, peer_->memory, 0, kMiB, 802, Routing::pinned(1)},
        p->callbacks()));
  }
  wait_stream(st2, 60s, done, failed, first_error);
  EXPECT_EQ(failed, 0) << "first error: " << first_error.to_string();
  EXPECT_EQ(peer_count(802, 4), 4u);
  const auto down_delta = while_down.get();
  EXPECT_LT(down_delta[1], kQuietBytes) << "the dead link carried traffic: " << show(down_delta);
  EXPECT_TRUE(engine_->nics_up()[1] == false) << "NIC 1 came back while its link was down";

  // Back up: a probe brings NIC 1 back, and it carries its share of new sharded writes.
  set_link(1, "up");
  ASSERT_TRUE(wait_nic(1, true, 20s)) << "NIC 1 did not come back after its link did";
  LinkDelta after;
  Stream st3;
  submit_stream(st3, 8, 0, 3);
  wait_stream(st3, 60s, done, failed, first_error);
  EXPECT_EQ(failed, 0) << "first error: " << first_error.to_string();
  const auto up_delta = after.get();
  EXPECT_GE(up_delta[1], 8 * kSingleBytes / 4 / 2) << "NIC 1 is not used again: " << show(up_delta);
  EXPECT_EQ(peer_count(kSingleImm, kSingles + 16), static_cast<uint64_t>(kSingles + 16));
  EXPECT_EQ(peer_count(kPageImm, (kPaged + 8) * kPagesPerWrite),
            static_cast<uint64_t>((kPaged + 8) * kPagesPerWrite));
}

// (a3) A link killed mid-stream of sharded and paged reads: a read is idempotent, so the shards
// stalled on the dead NIC are read again over the others. Every read completes, the bytes read
// are the peer's, and the dead NIC is marked down.
TEST_F(Failover, LinkKilledMidReadEveryReadCompletesWithThePeersBytes) {
  ASSERT_NO_FATAL_FAILURE(open_failover(4, false));
  peer_->fill(17);  // before any read: nothing else touches the peer's buffer meanwhile
  auto dst = make_buffer(*engine_, kPeerBytes);
  const uint64_t pages_total = (kPeerBytes - kSingleSpan) / kPageBytes;
  std::vector<std::unique_ptr<Probe>> probes;
  constexpr int kSingles = 48, kPaged = 48;
  for (int i = 0; i < kSingles; ++i) {
    const uint64_t off = (static_cast<uint64_t>(i) * kSingleBytes) % kSingleSpan;
    auto& p = probes.emplace_back(std::make_unique<Probe>());
    ASSERT_TRUE(engine_->submit(
        SingleRead{dst->reg.handle, off, peer_->memory, off, kSingleBytes, Routing::sharded()},
        p->callbacks()));
  }
  for (int i = 0; i < kPaged; ++i) {
    std::vector<uint32_t> pages;
    for (size_t k = 0; k < kPagesPerWrite; ++k) {
      pages.push_back(static_cast<uint32_t>((i * kPagesPerWrite + k) % pages_total));
    }
    auto& p = probes.emplace_back(std::make_unique<Probe>());
    ASSERT_TRUE(engine_->submit(PagedRead{dst->reg.handle, peer_->memory, kPageBytes, pages,
                                          kPageBytes, kSingleSpan, pages, kPageBytes, kSingleSpan},
                                p->callbacks()));
  }
  std::this_thread::sleep_for(150ms);  // under way: 240 MiB at 4 x 1 Gbit/s take about 0.5 s
  set_link(1, "down");
  int failed = 0;
  Status first_error;
  for (const auto& p : probes) {
    Status s = p->wait(60s);
    ASSERT_NE(s.code(), ErrorCode::kTimeout) << "a read got no callback within 60 s";
    if (!s && failed++ == 0) first_error = s;
    EXPECT_EQ(p->calls(), 1);
  }
  EXPECT_EQ(failed, 0) << "first error: " << first_error.to_string();
  EXPECT_TRUE(wait_nic(1, false, 5s)) << "NIC 1 was not marked down";
  const uint64_t paged_bytes =
      std::min<uint64_t>(kPaged * kPagesPerWrite, pages_total) * kPageBytes;
  EXPECT_EQ(std::to_string(fnv1a(dst->bytes.data(), kSingleSpan)), peer_->checksum(0, kSingleSpan))
      << "the single reads' bytes differ";
  EXPECT_EQ(std::to_string(fnv1a(dst->bytes.data() + kSingleSpan, paged_bytes)),
            peer_->checksum(kSingleSpan, paged_bytes))
      << "the paged reads' bytes differ";
  // The original reads abandoned on the dead NIC may still land once its link is back (the
  // provider keeps them): their memory outlives the engine, freed only at the process's exit.
  static std::unique_ptr<Buffer> outlives_the_engine;
  outlives_the_engine = std::move(dst);
}

// (a2) A link down before its NIC ever connected to the peer: the provider refuses the first
// posts there at once ("Network is unreachable") instead of letting them stall. That NIC, not
// the peer, is at fault while the others reach it: it is marked down and its work moves, so
// every transfer completes with exact counts (a loaded machine reached this state in (a) when
// the link went down before NIC 1's first write; here it is forced).
TEST_F(Failover, ANicThatCannotConnectIsMarkedDownAndItsWorkMoves) {
  ASSERT_NO_FATAL_FAILURE(open_failover(4, true));
  set_link(1, "down");
  constexpr int kSingles = 16, kPaged = 16;
  Stream st;
  submit_stream(st, kSingles, kPaged, 1);
  int done = 0, failed = 0;
  Status first_error;
  expect_stream_exact_with_nic1_down(st, kSingles, kPaged, done, failed, first_error);
  set_link(1, "up");
  EXPECT_TRUE(wait_nic(1, true, 20s)) << "NIC 1 did not come back after its link did";
}

// The same with immediates on the fabric (the default): data-only shards and unposted work
// fail over; a write whose immediate was in flight on the dead NIC cannot be re-sent and fails
// with that reason. Every transfer gets exactly one callback, within the bound, and the
// receiver never counts more than was sent.
TEST_F(Failover, LinkKilledWithFabricImmediatesFailsOnlyWhatIsUncertain) {
  ASSERT_NO_FATAL_FAILURE(open_failover(2, false));
  constexpr int kSingles = 24, kPaged = 24;
  Stream st;
  submit_stream(st, kSingles, kPaged, 4);
  std::this_thread::sleep_for(150ms);
  set_link(1, "down");
  int done = 0, failed = 0;
  Status first_error;
  wait_stream(st, 60s, done, failed, first_error);
  std::cout << "observation: fabric immediates, link 1 down mid-stream: " << done << " done, "
            << failed << " failed; first error: " << first_error.to_string() << std::endl;
  EXPECT_EQ(done + failed, kSingles + kPaged);
  if (failed > 0) {
    EXPECT_NE(first_error.message().find("may or may not"), std::string::npos)
        << first_error.to_string();
  }
  EXPECT_TRUE(wait_nic(1, false, 5s)) << "NIC 1 was not marked down";
  // Sharded single writes send their immediate after the data: re-posted shards never double
  // count, so every done single write is counted exactly once and none more than once.
  std::this_thread::sleep_for(500ms);  // nothing is in flight any more; let the peer poll
  int singles_done = 0;
  for (size_t i = 0; i < st.probes.size(); i += 2)
    singles_done += st.probes[i]->calls() == 1 && st.probes[i]->wait(1s).is_ok();
  const uint64_t singles = peer_count(kSingleImm, 0);
  // Done means counted (the deferred immediate follows the data); a failed one may have been
  // counted (its deferred immediate was in flight), but none twice.
  EXPECT_GE(singles, static_cast<uint64_t>(singles_done));
  EXPECT_LE(singles, static_cast<uint64_t>(kSingles));
  const uint64_t pages = peer_count(kPageImm, 0);
  EXPECT_LE(pages, static_cast<uint64_t>(kPaged * kPagesPerWrite));
  // The engine keeps serving over the surviving link.
  write_verified(0, 0, 3 * kMiB, 803, Routing::sharded(), "sharded write while NIC 1 is down");
}

// The first link is the one that carried every message before messages learned to fail over:
// killed mid-stream of writes (reliable immediates: Commits and Acks are messages too) and of
// user messages, every transfer and every message completes, the peer receives each message
// exactly once (none twice, even once the link is back and TCP delivers what it held), the
// counts and the data are exact, and new messages go over the surviving link while it is down.
TEST_F(Failover, FirstLinkKilledMessagesAndCommitsFailOver) {
  ASSERT_NO_FATAL_FAILURE(open_failover(2, true));
  // Each half of the stream covers the whole destination, so the checksum covers every byte.
  constexpr int kSingles = 32, kPaged = 64, kMessages = 200;
  std::vector<std::unique_ptr<Probe>> messages;
  auto send = [&](int k) {
    const std::string text = "msg " + std::to_string(k) + std::string(1000, '.');
    auto& p = messages.emplace_back(std::make_unique<Probe>());
    ASSERT_TRUE(
        engine_->submit_send(peer_->address, std::as_bytes(std::span(text)), p->callbacks()));
  };
  Stream st;
  submit_stream(st, kSingles / 2, kPaged / 2, 6);
  for (int k = 0; k < kMessages / 2; ++k) send(k);
  submit_stream(st, kSingles / 2, kPaged / 2, 7);
  for (int k = kMessages / 2; k < kMessages; ++k) send(k);
  std::this_thread::sleep_for(150ms);
  set_link(0, "down");
  int done = 0, failed = 0;
  Status first_error;
  wait_stream(st, 60s, done, failed, first_error);
  EXPECT_EQ(failed, 0) << "first error: " << first_error.to_string();
  EXPECT_EQ(done, kSingles + kPaged);
  int sent = 0;
  for (const auto& p : messages) {
    Status s = p->wait(60s);
    EXPECT_TRUE(s) << s.to_string();
    EXPECT_EQ(p->calls(), 1);
    sent += s.is_ok();
  }
  EXPECT_EQ(sent, kMessages);
  EXPECT_TRUE(wait_nic(0, false, 5s)) << "NIC 0 was not marked down";
  EXPECT_EQ(peer_count(kSingleImm, kSingles), static_cast<uint64_t>(kSingles));
  EXPECT_EQ(peer_count(kPageImm, kPaged * kPagesPerWrite),
            static_cast<uint64_t>(kPaged * kPagesPerWrite));
  EXPECT_EQ(peer_->checksum(0, kPeerBytes), src_checksum(0, kPeerBytes)) << "data differs";
  peer_->process.send("messages " + std::to_string(kMessages));
  EXPECT_EQ(peer_->process.read_line(), "messages " + std::to_string(kMessages) + " 0 0");

  // While NIC 0 is down, new messages go over NIC 1.
  for (int k = kMessages; k < kMessages + 50; ++k) send(k);
  for (const auto& p : messages) EXPECT_TRUE(p->wait(30s));
  EXPECT_FALSE(engine_->nics_up()[0]) << "NIC 0 came back while its link was down";
  peer_->process.send("messages " + std::to_string(kMessages + 50));
  EXPECT_EQ(peer_->process.read_line(), "messages " + std::to_string(kMessages + 50) + " 0 0");

  // Back up: whatever the dead link still held arrives now, and is dropped as a copy.
  set_link(0, "up");
  // 40 s: after a long outage on a loaded machine a probe can sit on the old connection until
  // TCP resets it (seen once: reset 20 s after the link came back).
  ASSERT_TRUE(wait_nic(0, true, 40s)) << "NIC 0 did not come back after its link did";
  std::this_thread::sleep_for(500ms);
  write_verified(0, 0, 3 * kMiB, 805, Routing::sharded(), "sharded write after NIC 0 is back");
  peer_->process.send("messages " + std::to_string(kMessages + 50));
  EXPECT_EQ(peer_->process.read_line(), "messages " + std::to_string(kMessages + 50) + " 0 0");
  EXPECT_EQ(peer_count(kSingleImm, 0), static_cast<uint64_t>(kSingles));
}

// (b) Every link down: every transfer fails within peer_timeout plus slack, exactly once, and
// the engine serves again once the links are back.
TEST_F(Failover, AllLinksDownEveryTransferFailsWithinTheBound) {
  ASSERT_NO_FATAL_FAILURE(open_failover(2, true));
  Stream st;
  // 128 MiB of single writes: still streaming when the links go down, even on a loaded machine
  // where taking them down (two `ip` commands) took over a second (with 64 MiB the stream once
  // completed first, and the test showed nothing).
  submit_stream(st, 32, 16, 5);
  std::this_thread::sleep_for(100ms);
  set_link(0, "down");
  set_link(1, "down");
  ASSERT_NO_FATAL_FAILURE(expect_every_callback_within_the_bound(st, "all links down"));
  // Every transfer reported done was counted; none more than once.
  EXPECT_LE(peer_count(kSingleImm, 0), 32u);
  // The engine serves again once the links are back.
  set_link(0, "up");
  set_link(1, "up");
  bool served = false;
  for (int attempt = 0; attempt < 5 && !served; ++attempt) {
    Probe p;
    ASSERT_TRUE(engine_->submit(
        SingleWrite{src_->reg.handle, 0, peer_->memory, 0, 3 * kMiB, 804, Routing::sharded()},
        p.callbacks()));
    served = p.wait(60s).is_ok();
  }
  EXPECT_TRUE(served) << "no write completed after the links came back";
}

// (b') The same when one NIC never connects (its handshakes go unanswered) and the other link
// dies while the stream is in flight: the first NIC is marked down with the other's recent
// progress as evidence, its work moves onto a NIC that is dead too, and every transfer still
// fails within the bound, once. (A fresh-clone run once saw the shape of (b) end this way: NIC 1
// marked down, then no callback for 11 s; not reproduced here since.)
TEST_F(Failover, OneNicNeverConnectsThenTheOtherLinkDiesEveryTransferFailsWithinTheBound) {
  ASSERT_NO_FATAL_FAILURE(open_failover(2, true));
  // Down on the peer's side only: this side's connection attempts go out and are never
  // answered (as when a first handshake is lost), rather than refused at once.
  set_link_side(1, "b", "down");
  Stream st;
  submit_stream(st, 16, 16, 8);
  std::this_thread::sleep_for(100ms);
  set_link(0, "down");
  ASSERT_NO_FATAL_FAILURE(
      expect_every_callback_within_the_bound(st, "one NIC never connects, the other link down"));
}

// (b'') Links die after the connections are made but before the peer has answered this
// engine's write-fence Hello: the writes wait for that answer, the Hello is sent again every
// few ms and, on tcp, completes as soon as the socket takes it. Those completions are no sign
// of the peer, so every transfer still fails within the bound (a fresh-clone run twice saw
// them keep the dead link "alive": no callback for 11 s).
TEST_F(Failover, WritesWaitingForAnUnansweredHelloFailWithinTheBound) {
  ASSERT_NO_FATAL_FAILURE(open_failover(2, true));
  // A message connects NIC 0 (messages need no Hello); then the peer's ends go down, so what
  // this side sends is taken by its sockets and never answered.
  const std::string text = "connect";
  Probe sent;
  ASSERT_TRUE(
      engine_->submit_send(peer_->address, std::as_bytes(std::span(text)), sent.callbacks()));
  ASSERT_TRUE(sent.wait(20s));
  set_link_side(0, "b", "down");
  set_link_side(1, "b", "down");
  Stream st;
  submit_stream(st, 8, 8, 9);
  ASSERT_NO_FATAL_FAILURE(
      expect_every_callback_within_the_bound(st, "links down before the Hello was answered"));
}

// Weighted sharding (Config::weighted_sharding, docs/netlab.md "Unequal links"): link 1
// re-shaped to 50 Mbit next to link 0's 1 Gbit. After a few writes have measured the links, the
// faster link carries most of every sharded and paged write, and the receiver's data and
// immediate counts are exact (one per single write, one per page, whatever the split).
class Weighted : public LabTest {
 protected:
  void SetUp() override {
    // FABRIC_WEIGHTED_SHARDING=0 here shows what equal shares do (this test then fails).
    const char* env = std::getenv("FABRIC_WEIGHTED_SHARDING");
    open(2, /*weighted=*/env == nullptr || std::string(env) != "0");
    if (IsSkipped() || HasFatalFailure()) return;
    set_rate(1, "50mbit");
  }
  void TearDown() override {
    if (reshaped_) set_rate(1, FABRIC_NETLAB_RATE);
  }
  void set_rate(uint32_t index, const std::string& rate) {
    const std::string cmd = std::string(FABRIC_NETLAB_TOOL) + " rate --name " + g_lab + " " +
                            std::to_string(index) + " " + rate;
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    reshaped_ = rate != FABRIC_NETLAB_RATE;
  }
  bool reshaped_ = false;
};

TEST_F(Weighted, FasterLinkCarriesTheLargerShareWithExactCounts) {
  const uint64_t length = 2 * kMiB + 12345;  // not a multiple of the alignment
  // Warm-up: the first writes measure both links.
  for (uint32_t i = 0; i < 3; ++i) {
    write_verified(i * 4099, 0, length, 900 + i, Routing::sharded(), "warm-up write");
  }
  LinkDelta links;
  constexpr uint32_t kWrites = 12;
  for (uint32_t i = 0; i < kWrites; ++i) {
    write_verified(i * 4099 + 1, i * length, length, 910 + i, Routing::sharded(),
                   "sharded write " + std::to_string(i));
  }
  constexpr uint64_t kPage = 16 * 1024;
  constexpr uint32_t kPages = 256;
  const uint64_t paged_dst = 40 * kMiB;
  std::vector<uint32_t> order(kPages);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(7));
  Probe done;
  ASSERT_TRUE(engine_->submit(PagedWrite{src_->reg.handle, peer_->memory, kPage, order, kPage, 0,
                                         order, kPage, paged_dst, 950},
                              done.callbacks()));
  ASSERT_TRUE(done.wait(60s));
  EXPECT_EQ(peer_->count(950, kPages), got(950, kPages)) << "one immediate per page";
  EXPECT_EQ(peer_->checksum(paged_dst, kPages * kPage), src_checksum(0, kPages * kPage));
  const auto delta = links.get();
  std::printf("bytes per link: %s\n", show(delta).c_str());
  const uint64_t payload = kWrites * length + kPages * kPage;
  EXPECT_GE(delta[0] + delta[1], payload) << show(delta);
  // Equal shares would put about half on each link; 1 Gbit against 50 Mbit, weighted, puts
  // 16 parts in 17 (the floor) on link 0. Twice link 1's bytes leaves room for noise.
  EXPECT_GE(delta[0], 2 * delta[1])
      << "the faster link did not carry the larger share; " << show(delta);
  EXPECT_GE(delta[1], payload / 40) << "the floor keeps the slow link in use; " << show(delta);
  for (uint32_t i = 2; i < kLabLinks; ++i) EXPECT_LT(delta[i], kQuietBytes) << show(delta);
}

INSTANTIATE_TEST_SUITE_P(Links, NetLab, ::testing::Values(2u, 4u),
                         [](const ::testing::TestParamInfo<uint32_t>& info) {
                           return std::to_string(info.param) + "nics";
                         });

}  // namespace
}  // namespace fabric::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  std::signal(SIGPIPE, SIG_IGN);  // a peer that died fails its test, not the whole binary
  fabric::testing::enter_lab();   // before any test creates a thread
  return RUN_ALL_TESTS();
}
