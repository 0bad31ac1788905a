// The verbs backend's own behaviour, on a real verbs device (Soft-RoCE in the rxe lab):
// connection set-up under lost and late handshakes, a peer that never answers, a queue pair
// error reported on the transfer that caused it, immediates far beyond the receive queue's
// depth, rail-aligned sharding over several devices; and, on the backend alone, selective
// signalling (writes completed by later signalled ones, an error in the middle of an unsignalled
// run, a pair torn down mid-run) and the thread domain's use or fallback. Skipped where no verbs
// device exists.
#include <fmt/format.h>

#include <array>
#include <fstream>
#include <iostream>
#include <map>
#include <thread>

#include "test_support.h"
#include "transport/domain.h"
#include "transport/verbs/verbs_domain.h"

namespace fabric::testing {
namespace {

// The devices the lab makes: rxe0, rxe1, ... on dummy0, dummy1, ... (198.18.I.1).
std::vector<std::string> verbs_devices() {
  std::vector<std::string> out;
  for (const auto& p : transport::list_verbs_ports()) {
    if (p.active && p.gid_index >= 0) out.push_back(p.device);
  }
  return out;
}

Config verbs_config(std::vector<std::string> nics = {}) {
  Config c = make_config(Backend{"verbs", "verbs", false});
  if (!nics.empty()) c.groups[0].nics = std::move(nics);
  return c;
}

uint64_t port_counter(const std::string& device, const char* name) {
  std::ifstream f("/sys/class/infiniband/" + device + "/ports/1/hw_counters/" + name);
  uint64_t v = 0;
  f >> v;
  return v;
}

class Verbs : public ::testing::Test {
 protected:
  void SetUp() override {
    devices_ = verbs_devices();
    if (devices_.empty()) GTEST_SKIP() << "no verbs device with an active port and a usable GID";
  }
  std::vector<std::string> devices_;
};

// One 64 KiB write with an immediate from a to b; checks the bytes and the count.
void write_and_check(TransferEngine& a, TransferEngine& b, uint32_t imm, uint64_t seed) {
  constexpr uint64_t kSize = 64 * 1024;
  auto src = make_buffer(a, kSize);
  auto dst = make_buffer(b, kSize);
  fill_pattern(src->bytes.data(), kSize, seed);
  Probe done;
  ASSERT_TRUE(a.submit(SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, kSize, imm, {}},
                       done.callbacks()));
  Status s = done.wait();
  ASSERT_TRUE(s) << s.to_string();
  ASSERT_TRUE(b.wait_imm(imm, 1, 10s));
  EXPECT_EQ(b.imm_count(imm), 1u);
  EXPECT_EQ(0, std::memcmp(src->bytes.data(), dst->bytes.data(), kSize));
}

TEST_F(Verbs, PortListingHasTheIpv4RoceGidAndMtu) {
  bool found = false;
  for (const auto& p : transport::list_verbs_ports()) {
    if (p.device != devices_[0]) continue;
    found = true;
    EXPECT_TRUE(p.active) << p.state;
    EXPECT_GE(p.active_mtu, 256u);
    // An IPv4-mapped GID: ::ffff:a.b.c.d.
    EXPECT_EQ(p.gid.rfind("0000:0000:0000:0000:0000:ffff:", 0), 0u) << p.gid;
  }
  EXPECT_TRUE(found);
}

TEST_F(Verbs, UnknownDeviceAndBadPortAreNamed) {
  auto e = TransferEngine::create(verbs_config({"no-such-rdma-device"}));
  ASSERT_FALSE(e);
  EXPECT_EQ(e.status().code(), ErrorCode::kNotFound);
  EXPECT_NE(e.status().message().find("no-such-rdma-device"), std::string::npos)
      << e.status().to_string();
  auto p = TransferEngine::create(verbs_config({devices_[0] + ":x"}));
  ASSERT_FALSE(p);
  EXPECT_EQ(p.status().code(), ErrorCode::kInvalidArgument) << p.status().to_string();
}

TEST_F(Verbs, ConnectsAfterTheFirstHandshakesAreLost) {
  Config ca = verbs_config();
  ca.verbs.drop_handshakes = 2;  // a's first two requests vanish
  Config cb = verbs_config();
  cb.verbs.drop_handshakes = 1;  // and b's first reply
  FABRIC_ENGINE_OR_SKIP(a, ca);
  FABRIC_ENGINE_OR_SKIP(b, cb);
  write_and_check(*a, *b, 11, 1);
  write_and_check(*b, *a, 12, 2);  // the other direction uses the same connection
}

TEST_F(Verbs, LateHandshakesAreAnsweredOnce) {
  // Every handshake datagram of a and b arrives after the sender already retried: duplicate
  // requests and replies, none of which may reconnect or count an immediate twice.
  Config ca = verbs_config();
  ca.verbs.delay_handshakes = 3;
  ca.verbs.handshake_delay = 250ms;
  Config cb = ca;
  FABRIC_ENGINE_OR_SKIP(a, ca);
  FABRIC_ENGINE_OR_SKIP(b, cb);
  Counter c;
  for (int i = 0; i < 20; ++i)
    ASSERT_TRUE(a->submit(ImmWrite{b->address(), 21, 0, 0}, c.callbacks()));
  ASSERT_TRUE(c.wait_total(20));
  EXPECT_EQ(c.done(), 20) << c.first_error().to_string();
  ASSERT_TRUE(b->wait_imm(21, 20, 10s));
  std::this_thread::sleep_for(600ms);  // every late datagram has arrived by now
  write_and_check(*a, *b, 22, 3);
  EXPECT_EQ(b->imm_count(21), 20u);
}

TEST_F(Verbs, PeerThatNeverAnswersFailsOnlyItsOwnTransfers) {
  Config ca = verbs_config();
  ca.verbs.connect_retry = 50ms;
  ca.verbs.connect_attempts = 3;
  FABRIC_ENGINE_OR_SKIP(a, ca);
  FABRIC_ENGINE_OR_SKIP(b, verbs_config());
  Address gone;
  {
    FABRIC_ENGINE_OR_SKIP(dead, verbs_config());
    gone = dead->address();
  }  // closed: its handshake queue pair no longer exists
  Probe to_dead;
  ASSERT_TRUE(a->submit(ImmWrite{gone, 31, 0, 0}, to_dead.callbacks()));
  write_and_check(*a, *b, 32, 4);  // another peer goes on meanwhile
  Status s = to_dead.wait(20s);
  EXPECT_EQ(s.code(), ErrorCode::kPeerUnreachable) << s.to_string();
  EXPECT_NE(s.message().find("never answered"), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("3 requests"), std::string::npos) << s.to_string();
}

TEST_F(Verbs, QueuePairErrorFailsTheRightTransferAndThePeerReconnects) {
  FABRIC_ENGINE_OR_SKIP(a, verbs_config());
  FABRIC_ENGINE_OR_SKIP(b, verbs_config());
  write_and_check(*a, *b, 41, 5);  // connected
  auto src = make_buffer(*a, 4096);
  auto dst = make_buffer(*b, 4096);
  RemoteMemory stale = dst->reg.descriptor;
  ASSERT_TRUE(b->unregister_memory(dst->reg.handle));
  std::this_thread::sleep_for(50ms);  // the release happens on b's worker
  Probe bad;
  ASSERT_TRUE(a->submit(SingleWrite{src->reg.handle, 0, stale, 0, 64, 42, {}}, bad.callbacks()));
  Status s = bad.wait();
  EXPECT_EQ(s.code(), ErrorCode::kRemoteAccess) << s.to_string();
  EXPECT_NE(s.message().find("remote access error"), std::string::npos) << s.to_string();
  EXPECT_EQ(b->imm_count(42), 0u);
  // The queue pair is in the error state; the next transfer connects afresh, both ways.
  write_and_check(*a, *b, 43, 6);
  write_and_check(*b, *a, 44, 7);
}

TEST_F(Verbs, ThousandsOfImmediatesReplenishTheReceiveQueue) {
  FABRIC_ENGINE_OR_SKIP(a, verbs_config());
  FABRIC_ENGINE_OR_SKIP(b, verbs_config());
  constexpr int kCount = 5000;  // almost five times the receive queue for immediates
  Counter c;
  for (int i = 0; i < kCount; ++i) {
    ASSERT_TRUE(a->submit(ImmWrite{b->address(), 51, 0, 0}, c.callbacks()));
  }
  ASSERT_TRUE(c.wait_total(kCount, 60s));
  EXPECT_EQ(c.done(), kCount) << c.first_error().to_string();
  ASSERT_TRUE(b->wait_imm(51, kCount, 30s)) << b->imm_count(51);
  // Messages still flow on their own queue pair and receive queue afterwards.
  write_and_check(*a, *b, 52, 8);
  EXPECT_EQ(b->imm_count(51), uint64_t{kCount});
}

// A close that times out with writes still posted on the queue pairs stops them before it
// returns: nothing of them leaves the device afterwards (no packet is sent, no immediate
// arrives), so the writer may free its buffers and the peer's receive buffers are safe. (Queue
// pairs left alive until the engine's destruction went on sending for seconds here, into a
// destination the conformance suite then freed.)
TEST_F(Verbs, ACloseThatTimesOutStopsWhatIsPostedBeforeItReturns) {
  // Both on the device whose counter is read (Soft-RoCE delivers only within one device).
  Config c = verbs_config({devices_[0]});
  c.close_timeout = std::chrono::milliseconds(50);
  FABRIC_ENGINE_OR_SKIP(a, c);
  FABRIC_ENGINE_OR_SKIP(b, verbs_config({devices_[0]}));
  constexpr uint64_t kSize = 8 << 20;
  constexpr int kWrites = 300;
  auto src = make_buffer(*a, kSize);
  auto dst = make_buffer(*b, kSize);
  const uint64_t sent_before = port_counter(devices_[0], "sent_pkts");
  Counter writes;
  for (int i = 0; i < kWrites; ++i) {
    ASSERT_TRUE(a->submit(SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, kSize, 71, {}},
                          writes.callbacks()));
  }
  ASSERT_TRUE(b->wait_imm(71, 1, 30s)) << "no write arrived";
  a->close();
  EXPECT_EQ(writes.done() + writes.failed(), kWrites);
  ASSERT_GT(writes.failed(), 0) << "every write finished within the close timeout: nothing to stop";
  EXPECT_EQ(writes.first_error().code(), ErrorCode::kCancelled);
  // What was on the wire when the queue pairs went lands now; then the device is quiet.
  std::this_thread::sleep_for(200ms);
  const uint64_t sent = port_counter(devices_[0], "sent_pkts");
  ASSERT_GT(sent, sent_before) << "the counter did not see the writes";
  const uint64_t arrived = b->imm_count(71);
  std::this_thread::sleep_for(700ms);
  EXPECT_EQ(port_counter(devices_[0], "sent_pkts"), sent) << "packets sent after close() returned";
  EXPECT_EQ(b->imm_count(71), arrived) << "writes arrived after close() returned";
  EXPECT_LT(arrived, uint64_t{kWrites});
  EXPECT_TRUE(b->unregister_memory(dst->reg.handle));
}

TEST_F(Verbs, TwoEnginesShardRailAlignedOverSeveralDevices) {
  if (devices_.size() < 2) GTEST_SKIP() << "needs two verbs devices (the rxe lab makes them)";
  std::vector<std::string> rails(devices_.begin(), devices_.begin() + 2);
  Config c = verbs_config(rails);
  c.shard_min_bytes = 4096;
  FABRIC_ENGINE_OR_SKIP(a, c);
  FABRIC_ENGINE_OR_SKIP(b, c);
  std::vector<uint64_t> before;
  for (const auto& d : rails) before.push_back(port_counter(d, "sent_pkts"));
  constexpr uint64_t kSize = 1 << 20;
  auto src = make_buffer(*a, kSize);
  auto dst = make_buffer(*b, kSize);
  fill_pattern(src->bytes.data(), kSize, 9);
  Probe arrived;
  ASSERT_TRUE(b->expect_imm(61, 1, [cb = arrived.callbacks()] { cb.on_done(); }));
  Probe done;
  ASSERT_TRUE(a->submit(
      SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, kSize, 61, Routing::sharded()},
      done.callbacks()));
  ASSERT_TRUE(done.wait()) << done.wait().to_string();
  ASSERT_TRUE(arrived.wait());
  EXPECT_EQ(0, std::memcmp(src->bytes.data(), dst->bytes.data(), kSize));
  // Both rails carried data. (A cross-rail write would not arrive at all: Soft-RoCE delivers
  // only between queue pairs of the same device here.)
  for (size_t i = 0; i < rails.size(); ++i) {
    EXPECT_GT(port_counter(rails[i], "sent_pkts"), before[i] + 100) << rails[i];
  }
  // Pinned to the second rail: the peer's second NIC receives.
  write_and_check(*a, *b, 62, 10);
  Probe pinned;
  ASSERT_TRUE(a->submit(
      SingleWrite{src->reg.handle, 0, dst->reg.descriptor, 0, 4096, 63, Routing::pinned(1)},
      pinned.callbacks()));
  ASSERT_TRUE(pinned.wait()) << pinned.wait().to_string();
  ASSERT_TRUE(b->wait_imm(63, 1, 10s));
}

// Pages small enough to go inline (64 B) and larger ones (4 KiB), hundreds per transfer: each
// is a work request, chained up to 32 to a doorbell (verbs_datapath.cc, VerbsDomain::flush).
// Every page lands where it should, counted once, in both directions.
TEST_F(Verbs, ChainedAndInlineWorkRequestsLandEveryPage) {
  FABRIC_ENGINE_OR_SKIP(a, verbs_config());
  FABRIC_ENGINE_OR_SKIP(b, verbs_config());
  for (const uint64_t page : {uint64_t{64}, uint64_t{4096}}) {
    constexpr uint32_t kPages = 300;
    const uint64_t bytes = page * kPages;
    auto src = make_buffer(*a, bytes);
    auto dst = make_buffer(*b, bytes);
    fill_pattern(src->bytes.data(), bytes, page);
    PagedWrite w;
    w.src = src->reg.handle;
    w.dst = dst->reg.descriptor;
    w.page_bytes = page;
    w.src_stride = page;
    w.dst_stride = page;
    for (uint32_t i = 0; i < kPages; ++i) {
      w.src_pages.push_back(i);
      w.dst_pages.push_back(kPages - 1 - i);  // reversed: each page has a place of its own
    }
    const uint32_t imm = 70 + static_cast<uint32_t>(page % 1000);
    w.imm = imm;
    Probe done;
    ASSERT_TRUE(a->submit(w, done.callbacks()));
    Status s = done.wait();
    ASSERT_TRUE(s) << s.to_string();
    ASSERT_TRUE(b->wait_imm(imm, kPages, 10s)) << b->imm_count(imm);
    EXPECT_EQ(b->imm_count(imm), uint64_t{kPages});
    for (uint32_t i = 0; i < kPages; ++i) {
      ASSERT_EQ(0, std::memcmp(src->bytes.data() + i * page,
                               dst->bytes.data() + (kPages - 1 - i) * page, page))
          << "page " << i << " of " << page << " bytes";
    }
  }
  // Messages (sends, chained on their own queue pair) and writes back still flow.
  write_and_check(*b, *a, 79, 11);
}

// --- The backend below the engine: two domains on one device, driven by the test itself, so
// that the work requests of one pass, their chains and their signalling are the test's. ---

using transport::Completion;
using transport::PostResult;
using transport::VerbsDomain;

struct Rig {
  std::unique_ptr<VerbsDomain> a, b;
  transport::PeerHandle peer = 0;  // b, as a sees it
  std::vector<std::byte> src, dst;
  std::unique_ptr<transport::MemoryRegistration> src_reg, dst_reg;
  std::map<uint64_t, std::vector<Completion>> done;  // a's local completions by wr_id
};

std::unique_ptr<VerbsDomain> open_domain(const std::string& device, const VerbsConfig& c) {
  auto d = VerbsDomain::open(device, c, false);
  EXPECT_TRUE(d) << d.status().to_string();
  return d ? std::move(*d) : nullptr;
}

// Opens a and b on `device` with `c`, and registers a source and a target of `bytes` each.
void make_rig(Rig& r, const std::string& device, const VerbsConfig& c, size_t bytes) {
  r.a = open_domain(device, c);
  r.b = open_domain(device, c);
  ASSERT_TRUE(r.a && r.b);
  auto peer = r.a->resolve_peer(r.b->endpoint_name());
  ASSERT_TRUE(peer) << peer.status().to_string();
  r.peer = *peer;
  r.src.resize(bytes);
  r.dst.assign(bytes, std::byte{0});
  fill_pattern(r.src.data(), bytes, 77);
  auto s = r.a->register_memory(r.src.data(), bytes, false);
  auto d = r.b->register_memory(r.dst.data(), bytes, false);
  ASSERT_TRUE(s && d);
  r.src_reg = std::move(*s);
  r.dst_reg = std::move(*d);
}

// One poll of each domain; a's local completions are recorded.
void pump(Rig& r) {
  std::array<Completion, 32> cs;
  const size_t n = r.a->poll(cs);
  for (size_t i = 0; i < n; ++i) {
    if (cs[i].kind == Completion::Kind::kLocal) r.done[cs[i].wr_id].push_back(cs[i]);
  }
  if (r.b) (void)r.b->poll(cs);
}

transport::WriteRequest write_req(Rig& r, uint64_t wr_id, uint64_t offset, uint64_t length) {
  return {wr_id,
          r.src.data() + offset,
          length,
          r.src_reg->local_desc(),
          r.peer,
          r.dst_reg->remote_addr() + offset,
          r.dst_reg->remote_key(),
          false,
          0};
}

// Posts `w`; while the queues are full or the peer is connecting, flushes and polls first.
PostResult post(Rig& r, const transport::WriteRequest& w) {
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  for (;;) {
    PostResult res = r.a->post_write(w);
    if (res.kind != PostResult::Kind::kAgain) return res;
    if (std::chrono::steady_clock::now() > deadline) return PostResult::failed(Status::ok());
    r.a->flush();
    pump(r);
  }
}

// Polls until `count` wr_ids have completed (or 30 s).
void wait_done(Rig& r, size_t count) {
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (r.done.size() < count && std::chrono::steady_clock::now() < deadline) pump(r);
  // A little longer: a second completion for any of them would show now.
  for (int i = 0; i < 200; ++i) pump(r);
}

// Connects a to b with one write and waits for it (wr_id 1).
void connect(Rig& r) {
  ASSERT_EQ(post(r, write_req(r, 1, 0, 8)).kind, PostResult::Kind::kPosted);
  r.a->flush();
  wait_done(r, 1);
  ASSERT_EQ(r.done[1].size(), 1u);
  ASSERT_EQ(r.done[1][0].error, ErrorCode::kOk) << r.done[1][0].error_message;
  r.done.clear();
}

// Many writes, chained and selectively signalled: each completes once, successfully, and
// lands; a count that is no multiple of signal_every (nor of the chain length), so that the
// last requests complete only because the chain's last one is signalled. Few completions are
// read with signal_every > 1: the unsignalled requests were completed by the signalled ones.
TEST_F(Verbs, SelectivelySignalledWritesCompleteOnceAndLand) {
  constexpr uint32_t kWrites = 1000;
  constexpr uint64_t kSlot = 512;  // odd requests write 64 B (inline), even ones 512 B
  for (const uint32_t every : {1u, 16u, 1000u}) {
    SCOPED_TRACE(fmt::format("signal_every {}", every));
    VerbsConfig c;
    c.signal_every = every;
    Rig r;
    make_rig(r, devices_[0], c, kWrites * kSlot);
    if (HasFatalFailure()) return;
    connect(r);
    if (HasFatalFailure()) return;
    const uint64_t cqes_before = r.a->send_completions_read();
    for (uint32_t i = 0; i < kWrites; ++i) {
      auto w = write_req(r, 100 + i, i * kSlot, i % 2 ? 64 : kSlot);
      ASSERT_EQ(post(r, w).kind, PostResult::Kind::kPosted) << i;
    }
    r.a->flush();  // the worker's end of a posting pass
    wait_done(r, kWrites);
    ASSERT_EQ(r.done.size(), size_t{kWrites});
    for (uint32_t i = 0; i < kWrites; ++i) {
      const auto& got = r.done[100 + i];
      ASSERT_EQ(got.size(), 1u) << "write " << i;
      ASSERT_EQ(got[0].error, ErrorCode::kOk) << "write " << i << ": " << got[0].error_message;
      ASSERT_EQ(0,
                std::memcmp(r.src.data() + i * kSlot, r.dst.data() + i * kSlot, i % 2 ? 64 : kSlot))
          << "write " << i;
    }
    const uint64_t cqes = r.a->send_completions_read() - cqes_before;
    if (every == 1) {
      EXPECT_EQ(cqes, kWrites);
    } else {
      EXPECT_LT(cqes, kWrites / 8) << "completions read for " << kWrites << " writes";
    }
    EXPECT_EQ(r.a->fast_paths().signal_every, every);
  }
}

// A write that fails (its target lies outside the registration: remote access error) in the
// middle of an unsignalled run, all on one queue pair in one pass: the ones before it succeed
// and landed, it fails with kRemoteAccess, the ones after it are flushed; each exactly once.
// Then the peer reconnects and a write goes through.
TEST_F(Verbs, AnErrorInAnUnsignalledRunFailsItAndFlushesTheRestOnce) {
  constexpr uint32_t kWrites = 40, kBad = 20;
  constexpr uint64_t kSlot = 256;
  VerbsConfig c;
  c.signal_every = 16;  // signalled: the 16th, the 32nd (also a chain's end), the 40th (the end)
  Rig r;
  make_rig(r, devices_[0], c, kWrites * kSlot);
  if (HasFatalFailure()) return;
  connect(r);
  if (HasFatalFailure()) return;
  for (uint32_t i = 0; i < kWrites; ++i) {
    auto w = write_req(r, 100 + i, i * kSlot, kSlot);
    if (i == kBad) w.remote_addr = r.dst_reg->remote_addr() + r.dst.size();  // past its end
    ASSERT_EQ(r.a->post_write(w).kind, PostResult::Kind::kPosted) << i;
  }
  r.a->flush();
  wait_done(r, kWrites);
  ASSERT_EQ(r.done.size(), size_t{kWrites});
  for (uint32_t i = 0; i < kWrites; ++i) {
    const auto& got = r.done[100 + i];
    ASSERT_EQ(got.size(), 1u) << "write " << i << " completed " << got.size() << " times";
    if (i < kBad) {
      EXPECT_EQ(got[0].error, ErrorCode::kOk) << "write " << i << ": " << got[0].error_message;
      EXPECT_EQ(0, std::memcmp(r.src.data() + i * kSlot, r.dst.data() + i * kSlot, kSlot))
          << "write " << i;
    } else if (i == kBad) {
      EXPECT_EQ(got[0].error, ErrorCode::kRemoteAccess) << got[0].error_message;
      EXPECT_NE(got[0].error_message.find("remote access error"), std::string::npos)
          << got[0].error_message;
    } else {
      EXPECT_EQ(got[0].error, ErrorCode::kFabric) << "write " << i;
      EXPECT_NE(got[0].error_message.find("flushed"), std::string::npos) << got[0].error_message;
    }
  }
  // The pair was retired; the next write connects afresh.
  r.done.clear();
  ASSERT_EQ(post(r, write_req(r, 500, 0, kSlot)).kind, PostResult::Kind::kPosted);
  r.a->flush();
  wait_done(r, 1);
  ASSERT_EQ(r.done[500].size(), 1u);
  EXPECT_EQ(r.done[500][0].error, ErrorCode::kOk) << r.done[500][0].error_message;
}

// A pair torn down with an unsignalled run posted (the engine forgetting the peer): every
// request completes exactly once. Towards a live peer they succeed or are flushed (Soft-RoCE had
// sent all of them by then in every run here); towards a peer that is gone (nothing
// acknowledges), all of them are flushed.
TEST_F(Verbs, APairTornDownMidRunCompletesEveryRequestOnce) {
  constexpr uint32_t kWrites = 45;
  constexpr uint64_t kSlot = 4096;
  for (const bool peer_gone : {false, true}) {
    SCOPED_TRACE(peer_gone ? "peer gone" : "peer alive");
    VerbsConfig c;
    c.signal_every = 16;
    Rig r;
    make_rig(r, devices_[0], c, kWrites * kSlot);
    if (HasFatalFailure()) return;
    connect(r);
    if (HasFatalFailure()) return;
    if (peer_gone) r.b.reset();  // its queue pairs are destroyed: nothing answers
    const uint64_t cqes_before = r.a->send_completions_read();
    for (uint32_t i = 0; i < kWrites; ++i) {
      ASSERT_EQ(r.a->post_write(write_req(r, 100 + i, i * kSlot, kSlot)).kind,
                PostResult::Kind::kPosted);
    }
    // The first 32 went out as a chain; the last 13 are still chained: forgetting the peer
    // posts them, then moves the pair to the error state.
    r.a->forget_peer(r.peer);
    wait_done(r, kWrites);
    ASSERT_EQ(r.done.size(), size_t{kWrites});
    int ok = 0;
    for (uint32_t i = 0; i < kWrites; ++i) {
      const auto& got = r.done[100 + i];
      ASSERT_EQ(got.size(), 1u) << "write " << i << " completed " << got.size() << " times";
      if (got[0].error == ErrorCode::kOk) {
        EXPECT_FALSE(peer_gone) << "write " << i << " succeeded towards a peer that is gone";
        ++ok;
      } else {
        EXPECT_EQ(got[0].error, ErrorCode::kFabric)
            << "write " << i << ": " << got[0].error_message;
        EXPECT_NE(got[0].error_message.find("the engine declared the peer unreachable"),
                  std::string::npos)
            << got[0].error_message;
      }
    }
    std::cout << "[ INFO     ] " << (peer_gone ? "peer gone: " : "peer alive: ") << ok << " of "
              << kWrites << " finished before the error state, " << kWrites - ok << " flushed; "
              << r.a->send_completions_read() - cqes_before << " send completions read\n";
  }
}

// The thread domain is in use where the device offers one, and otherwise its absence is
// reported with the reason (Soft-RoCE has no ibv_alloc_td); off, nothing is asked for.
TEST_F(Verbs, ThreadDomainUseOrFallbackIsReported) {
  VerbsConfig c;
  auto on = open_domain(devices_[0], c);
  ASSERT_TRUE(on);
  const transport::VerbsFastPaths& f = on->fast_paths();
  std::cout << "[ INFO     ] " << devices_[0] << ": thread domain "
            << (f.thread_domain ? "yes" : "no") << ", single-threaded CQ "
            << (f.single_threaded_cq ? "yes" : "no") << (f.note.empty() ? "" : "; " + f.note)
            << "\n";
  if (f.thread_domain) {
    EXPECT_EQ(f.note.find("thread domain"), std::string::npos) << f.note;
  } else {
    EXPECT_NE(f.note.find("no thread domain (ibv_alloc_td"), std::string::npos) << f.note;
  }
  if (devices_[0].rfind("rxe", 0) == 0) {
    EXPECT_FALSE(f.thread_domain) << "Soft-RoCE has no thread domains (rdma-core's rxe)";
  }
  c.thread_domain = false;
  auto off = open_domain(devices_[0], c);
  ASSERT_TRUE(off);
  EXPECT_FALSE(off->fast_paths().thread_domain);
  EXPECT_FALSE(off->fast_paths().single_threaded_cq);
  EXPECT_EQ(off->fast_paths().note, "");
  c.signal_every = 0;
  auto bad = VerbsDomain::open(devices_[0], c, false);
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.status().code(), ErrorCode::kInvalidArgument) << bad.status().to_string();
}

}  // namespace
}  // namespace fabric::testing
