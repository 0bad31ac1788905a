// The same-host transport's Domain, two endpoints in this process driven by hand: writes through
// the ring and through process_vm_readv, immediates counted after the bytes, stale keys failing
// alone, unregister as a barrier, messages, back-pressure, a closed peer, and the region's file.
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>

#include <chrono>
#include <fstream>
#include <memory>
#include <vector>

#include <gtest/gtest.h>

#include "transport/shm/shm_domain.h"

namespace fabric::transport {
namespace {

using Kind = Completion::Kind;

std::unique_ptr<ShmDomain> open_domain(uint64_t ring = 4096, uint32_t copy_threads = 1) {
  auto d = ShmDomain::open("shm", ring, copy_threads);
  EXPECT_TRUE(d) << d.status().to_string();
  return d ? std::move(*d) : nullptr;
}

std::vector<std::byte> pattern(size_t n, int seed) {
  std::vector<std::byte> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((i * 7 + seed) & 0xff);
  return v;
}

// Polls both endpoints until `pred` holds (5 s at most); collects what each reported.
struct Pair {
  std::unique_ptr<ShmDomain> a = open_domain();
  std::unique_ptr<ShmDomain> b = open_domain();
  std::vector<Completion> at_a, at_b;

  template <typename Pred>
  bool run_until(Pred pred) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    std::vector<Completion> buf(64);
    while (!pred()) {
      if (std::chrono::steady_clock::now() > end) return false;
      for (size_t i = 0, n = a->poll(buf); i < n; ++i) at_a.push_back(buf[i]);
      for (size_t i = 0, n = b->poll(buf); i < n; ++i) at_b.push_back(buf[i]);
    }
    return true;
  }
  const Completion* local(uint64_t wr_id) const {
    for (const Completion& c : at_a) {
      if (c.kind == Kind::kLocal && c.wr_id == wr_id) return &c;
    }
    return nullptr;
  }
  size_t imms(uint32_t imm) const {
    size_t n = 0;
    for (const Completion& c : at_b) n += c.kind == Kind::kImm && c.imm == imm;
    return n;
  }
  bool check_cma(PeerHandle peer, const MemoryRegistration& dst, uint64_t wr_id);
  PeerHandle b_from_a() {
    auto h = a->resolve_peer(b->endpoint_name());
    EXPECT_TRUE(h) << h.status().to_string();
    return h ? *h : 0;
  }
};

WriteRequest write(uint64_t id, const std::vector<std::byte>& src, PeerHandle peer,
                   const MemoryRegistration& dst, uint64_t offset, uint32_t imm) {
  return {id,   src.data(), src.size(), nullptr, peer, dst.remote_addr() + offset, dst.remote_key(),
          true, imm};
}

// One write through the ring, b checking meanwhile whether it can read a's memory: a's later
// writes of 16 KiB or more to b travel by process_vm_readv.
bool Pair::check_cma(PeerHandle peer, const MemoryRegistration& dst, uint64_t wr_id) {
  const auto warm = pattern(4096, 3);
  if (a->post_write(write(wr_id, warm, peer, dst, 0, 0)).kind != PostResult::Kind::kPosted) {
    return false;
  }
  return run_until([&] { return local(wr_id) != nullptr; });
}

TEST(ShmDomain, WritesThroughTheRingThenThroughCmaWithImmediatesAfterTheBytes) {
  Pair p;
  std::vector<std::byte> dst(1 << 20);
  auto reg = p.b->register_memory(dst.data(), dst.size(), false);
  ASSERT_TRUE(reg);
  const PeerHandle peer = p.b_from_a();
  // Posted before b ever polled: b has not checked whether it can read a's memory, so the
  // bytes travel through b's 4 KiB ring (hundreds of chunks, wrapping).
  const auto first = pattern(1 << 20, 1);
  ASSERT_EQ(p.a->post_write(write(1, first, peer, **reg, 0, 10)).kind, PostResult::Kind::kPosted);
  ASSERT_TRUE(p.run_until([&] { return p.local(1) != nullptr; }));
  EXPECT_EQ(p.local(1)->error, ErrorCode::kOk) << p.local(1)->error_message;
  EXPECT_EQ(dst, first);
  EXPECT_EQ(p.imms(10), 1u);
  EXPECT_EQ(p.b->stats().ring_write_bytes, first.size());
  // Now b has checked: the next write is one command, copied once by process_vm_readv.
  const auto second = pattern(1 << 20, 2);
  ASSERT_EQ(p.a->post_write(write(2, second, peer, **reg, 0, 11)).kind, PostResult::Kind::kPosted);
  ASSERT_TRUE(p.run_until([&] { return p.local(2) != nullptr; }));
  EXPECT_EQ(p.local(2)->error, ErrorCode::kOk);
  EXPECT_EQ(dst, second);
  EXPECT_EQ(p.imms(11), 1u);
  EXPECT_EQ(p.b->stats().cma_writes, 1u) << "process_vm_readv is refused here?";
}

// Large writes by process_vm_readv are cut into parts that several threads copy: the bytes land
// exactly, the immediate comes after all of them, a small write stays with one thread, and a
// part that cannot be read fails the whole write (no immediate).
TEST(ShmDomain, LargeCmaWritesAreCopiedBySeveralThreads) {
  Pair p;
  p.b = open_domain(4096, /*copy_threads=*/4);
  ASSERT_TRUE(p.b);
  EXPECT_EQ(p.b->copy_threads(), 4u);
  constexpr uint64_t kBig = (5ull << 20) + 13;
  std::vector<std::byte> dst(kBig + 64);
  auto reg = p.b->register_memory(dst.data(), dst.size(), false);
  ASSERT_TRUE(reg);
  const PeerHandle peer = p.b_from_a();
  ASSERT_TRUE(p.check_cma(peer, **reg, 1));

  const auto big = pattern(kBig, 4);
  ASSERT_EQ(p.a->post_write(write(2, big, peer, **reg, 7, 21)).kind, PostResult::Kind::kPosted);
  ASSERT_TRUE(p.run_until([&] { return p.local(2) != nullptr; }));
  ASSERT_EQ(p.local(2)->error, ErrorCode::kOk) << p.local(2)->error_message;
  EXPECT_EQ(0, std::memcmp(dst.data() + 7, big.data(), kBig));
  EXPECT_EQ(p.imms(21), 1u);
  ASSERT_EQ(p.b->stats().cma_writes, 1u) << "process_vm_readv is refused here?";
  EXPECT_EQ(p.b->stats().cma_parallel_writes, 1u);

  const auto small = pattern(1 << 20, 5);  // one part: under two of kMinPartBytes
  ASSERT_EQ(p.a->post_write(write(3, small, peer, **reg, 0, 22)).kind, PostResult::Kind::kPosted);
  ASSERT_TRUE(p.run_until([&] { return p.local(3) != nullptr; }));
  EXPECT_EQ(p.local(3)->error, ErrorCode::kOk);
  EXPECT_EQ(0, std::memcmp(dst.data(), small.data(), small.size()));
  EXPECT_EQ(p.b->stats().cma_writes, 2u);
  EXPECT_EQ(p.b->stats().cma_parallel_writes, 1u);

  // A source whose last MiB is unmapped: that part fails, so the write does, and no
  // immediate is counted.
  const size_t map = 4 << 20;
  void* m = ::mmap(nullptr, map, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(m, MAP_FAILED);
  std::memset(m, 0x5a, map);
  ASSERT_EQ(::munmap(static_cast<std::byte*>(m) + (3 << 20), 1 << 20), 0);
  WriteRequest torn{4,    m, map, nullptr, peer, (*reg)->remote_addr(), (*reg)->remote_key(),
                    true, 23};
  ASSERT_EQ(p.a->post_write(torn).kind, PostResult::Kind::kPosted);
  ASSERT_TRUE(p.run_until([&] { return p.local(4) != nullptr; }));
  EXPECT_NE(p.local(4)->error, ErrorCode::kOk);
  EXPECT_EQ(p.imms(23), 0u);
  EXPECT_EQ(p.b->stats().cma_parallel_writes, 2u);
  ::munmap(m, 3 << 20);
}

// A window of writes by process_vm_readv is taken from the ring in one run and copied side by
// side, though each is too small to be cut: each lands exactly with its immediate, and one that
// fails (a source not mapped, a range beyond its registration) fails alone.
TEST(ShmDomain, AWindowOfCmaWritesIsCopiedSideBySide) {
  Pair p;
  p.b = open_domain(4096, /*copy_threads=*/4);
  ASSERT_TRUE(p.b);
  constexpr size_t kWrites = 8;
  constexpr size_t kSize = 1 << 20;  // one part each: under two of kMinPartBytes
  std::vector<std::byte> dst(kWrites * kSize);
  auto reg = p.b->register_memory(dst.data(), dst.size(), false);
  ASSERT_TRUE(reg);
  const PeerHandle peer = p.b_from_a();
  ASSERT_TRUE(p.check_cma(peer, **reg, 100));

  // Reserved but unreadable (not unmapped: the next allocation could take its place).
  void* gone = ::mmap(nullptr, kSize, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(gone, MAP_FAILED);
  constexpr size_t kUnmapped = 3, kBeyond = 6;
  std::vector<std::vector<std::byte>> src;
  for (size_t i = 0; i < kWrites; ++i) {
    src.push_back(pattern(kSize, static_cast<int>(10 + i)));
    WriteRequest w = write(i, src[i], peer, **reg, i * kSize, static_cast<uint32_t>(200 + i));
    if (i == kUnmapped) w.local = gone;
    if (i == kBeyond) w.remote_addr += kSize + 1;  // runs past the registration's end
    ASSERT_EQ(p.a->post_write(w).kind, PostResult::Kind::kPosted);
  }
  ASSERT_TRUE(p.run_until([&] {
    for (size_t i = 0; i < kWrites; ++i) {
      if (p.local(i) == nullptr) return false;
    }
    return true;
  }));
  for (size_t i = 0; i < kWrites; ++i) {
    SCOPED_TRACE(i);
    const uint32_t imm = static_cast<uint32_t>(200 + i);
    if (i == kUnmapped || i == kBeyond) {
      EXPECT_NE(p.local(i)->error, ErrorCode::kOk);
      EXPECT_EQ(p.imms(imm), 0u);
      continue;
    }
    EXPECT_EQ(p.local(i)->error, ErrorCode::kOk) << p.local(i)->error_message;
    EXPECT_EQ(p.imms(imm), 1u);
    EXPECT_EQ(0, std::memcmp(dst.data() + i * kSize, src[i].data(), kSize));
  }
  EXPECT_EQ(p.local(kBeyond)->error, ErrorCode::kRemoteAccess);
  ASSERT_EQ(p.b->stats().cma_writes, kWrites - 1) << "process_vm_readv is refused here?";
  // All eight were in the ring when b polled: the seven in range went to the copier together.
  EXPECT_EQ(p.b->stats().cma_parallel_writes, kWrites - 1);
  ::munmap(gone, kSize);
}

TEST(ParallelCopier, PartsByLengthAndThreads) {
  shm::ParallelCopier four(4);
  const uint64_t part = shm::ParallelCopier::kMinPartBytes;
  EXPECT_EQ(four.parts_for(0), 1u);
  EXPECT_EQ(four.parts_for(2 * part - 1), 1u);
  EXPECT_EQ(four.parts_for(2 * part), 2u);
  EXPECT_EQ(four.parts_for(4 * part), 4u);
  EXPECT_EQ(four.parts_for(1ull << 30), 4u);
  shm::ParallelCopier one(1);
  EXPECT_EQ(one.parts_for(1ull << 30), 1u);
  const uint32_t auto_threads = shm::ParallelCopier::default_threads();
  EXPECT_GE(auto_threads, 1u);
  EXPECT_LE(auto_threads, 8u);
  EXPECT_EQ(shm::ParallelCopier(0).threads(), auto_threads);
}

// Every part runs exactly once per run, on whichever thread, many runs in a row (ThreadSanitizer
// watches the hand-off); a failing part fails the run without skipping the others.
TEST(ParallelCopier, EveryPartRunsOnceAndAFailureIsReported) {
  shm::ParallelCopier copier(4);
  constexpr uint32_t kParts = 7;
  std::vector<std::atomic<int>> runs(kParts);
  std::mutex mu;
  std::set<std::thread::id> threads;
  for (int round = 0; round < 2000; ++round) {
    for (auto& r : runs) r.store(0);
    const uint32_t fail = round % 3 == 0 ? static_cast<uint32_t>(round / 3) % kParts : kParts;
    // The first rounds' parts take a while, so that the helpers take some of them.
    const auto busy = round < 200 ? std::chrono::microseconds(50) : std::chrono::microseconds(0);
    const bool ok = copier.run(kParts, [&](uint32_t i) {
      const auto until = std::chrono::steady_clock::now() + busy;
      while (std::chrono::steady_clock::now() < until) {
      }
      runs[i].fetch_add(1);
      std::lock_guard lock(mu);
      threads.insert(std::this_thread::get_id());
      return i != fail;
    });
    ASSERT_EQ(ok, fail == kParts) << "round " << round;
    for (uint32_t i = 0; i < kParts; ++i) ASSERT_EQ(runs[i].load(), 1) << "round " << round;
  }
  EXPECT_GE(threads.size(), 2u) << "no helper ever took a part";
  EXPECT_LE(threads.size(), 4u);
}

TEST(ShmDomain, StaleKeyFailsAloneAndUnregisterIsABarrier) {
  Pair p;
  std::vector<std::byte> live(4096), dead(4096);
  auto live_reg = p.b->register_memory(live.data(), live.size(), false);
  auto dead_reg = p.b->register_memory(dead.data(), dead.size(), false);
  ASSERT_TRUE(live_reg && dead_reg);
  const uint64_t dead_addr = (*dead_reg)->remote_addr();
  const uint64_t dead_key = (*dead_reg)->remote_key();
  const PeerHandle peer = p.b_from_a();
  dead_reg->reset();  // unregistered on b's thread: its key is refused from now on
  const auto src = pattern(4096, 3);
  ASSERT_EQ(p.a->post_write(write(1, src, peer, **live_reg, 0, 20)).kind,
            PostResult::Kind::kPosted);
  WriteRequest stale{2, src.data(), src.size(), nullptr, peer, dead_addr, dead_key, true, 21};
  ASSERT_EQ(p.a->post_write(stale).kind, PostResult::Kind::kPosted);
  // Out of range on a live key, too.
  WriteRequest beyond = write(3, src, peer, **live_reg, 1, 22);
  ASSERT_EQ(p.a->post_write(beyond).kind, PostResult::Kind::kPosted);
  ASSERT_EQ(p.a->post_write(write(4, src, peer, **live_reg, 0, 23)).kind,
            PostResult::Kind::kPosted);
  ASSERT_TRUE(p.run_until([&] { return p.local(1) && p.local(2) && p.local(3) && p.local(4); }));
  EXPECT_EQ(p.local(1)->error, ErrorCode::kOk);
  EXPECT_EQ(p.local(2)->error, ErrorCode::kRemoteAccess);
  EXPECT_EQ(p.local(3)->error, ErrorCode::kRemoteAccess);
  EXPECT_EQ(p.local(4)->error, ErrorCode::kOk) << "a write after the stale one failed too";
  EXPECT_EQ(live, src);
  EXPECT_EQ(dead, std::vector<std::byte>(4096)) << "a write landed in unregistered memory";
  EXPECT_EQ(p.imms(20), 1u);
  EXPECT_EQ(p.imms(21), 0u);
  EXPECT_EQ(p.imms(22), 0u);
  EXPECT_EQ(p.imms(23), 1u);
}

TEST(ShmDomain, MessagesBeforeAndAfterTheirReceives) {
  Pair p;
  const PeerHandle peer = p.b_from_a();
  const auto early = pattern(10000, 4);  // several chunks of a 4 KiB ring
  ASSERT_EQ(p.a->post_send({1, early.data(), early.size(), nullptr, peer}).kind,
            PostResult::Kind::kPosted);
  ASSERT_TRUE(p.run_until([&] { return p.local(1) != nullptr; }));
  EXPECT_EQ(p.local(1)->error, ErrorCode::kOk);
  std::vector<std::byte> r1(16384), r2(16384), small(8);
  ASSERT_EQ(p.b->post_recv({7, r1.data(), r1.size(), nullptr}).kind, PostResult::Kind::kPosted);
  ASSERT_EQ(p.b->post_recv({8, r2.data(), r2.size(), nullptr}).kind, PostResult::Kind::kPosted);
  const auto late = pattern(3000, 5);
  ASSERT_EQ(p.a->post_send({2, late.data(), late.size(), nullptr, peer}).kind,
            PostResult::Kind::kPosted);
  auto recv = [&](uint64_t id) -> const Completion* {
    for (const Completion& c : p.at_b) {
      if (c.kind == Kind::kRecv && c.wr_id == id) return &c;
    }
    return nullptr;
  };
  ASSERT_TRUE(p.run_until([&] { return recv(7) && recv(8) && p.local(2); }));
  EXPECT_EQ(recv(7)->length, early.size());
  EXPECT_EQ(std::memcmp(r1.data(), early.data(), early.size()), 0);
  EXPECT_EQ(recv(8)->length, late.size());
  EXPECT_EQ(std::memcmp(r2.data(), late.data(), late.size()), 0);
  // Bigger than the receive: the receive and the send both fail, nothing overruns.
  ASSERT_EQ(p.b->post_recv({9, small.data(), small.size(), nullptr}).kind,
            PostResult::Kind::kPosted);
  ASSERT_EQ(p.a->post_send({3, late.data(), late.size(), nullptr, peer}).kind,
            PostResult::Kind::kPosted);
  ASSERT_TRUE(p.run_until([&] { return recv(9) && p.local(3); }));
  EXPECT_NE(recv(9)->error, ErrorCode::kOk);
  EXPECT_NE(p.local(3)->error, ErrorCode::kOk);
}

TEST(ShmDomain, BackPressureThenAClosedPeerFailsEverythingPromptly) {
  Pair p;
  std::vector<std::byte> dst(64);
  auto reg = p.b->register_memory(dst.data(), dst.size(), false);
  ASSERT_TRUE(reg);
  const PeerHandle peer = p.b_from_a();
  const auto src = pattern(64, 6);
  // b never polls: a's queue towards it fills, then posting says "again", not "failed".
  uint64_t posted = 0;
  PostResult r;
  while ((r = p.a->post_write(write(posted + 1, src, peer, **reg, 0, 30))).kind ==
         PostResult::Kind::kPosted) {
    ++posted;
    ASSERT_LT(posted, 100000u);
  }
  EXPECT_EQ(r.kind, PostResult::Kind::kAgain);
  EXPECT_GT(posted, 10u);
  // b closes without ever reading them: every one fails with kPeerUnreachable, none succeeds.
  const std::string file = "/dev/shm/" + p.b->region_name();
  EXPECT_EQ(access(file.c_str(), F_OK), 0);
  p.b->close();
  EXPECT_NE(access(file.c_str(), F_OK), 0) << "close() left " << file;
  std::vector<Completion> buf(256);
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (p.at_a.size() < posted && std::chrono::steady_clock::now() < end) {
    for (size_t i = 0, n = p.a->poll(buf); i < n; ++i) p.at_a.push_back(buf[i]);
  }
  ASSERT_EQ(p.at_a.size(), posted);
  for (const Completion& c : p.at_a) ASSERT_EQ(c.error, ErrorCode::kPeerUnreachable);
  // Posting to it now fails at once; a new resolve finds no endpoint.
  r = p.a->post_write(write(999999, src, peer, **reg, 0, 30));
  EXPECT_EQ(r.kind, PostResult::Kind::kFailed);
  EXPECT_EQ(r.error.code(), ErrorCode::kPeerUnreachable);
  // Once b is gone nothing in this process maps its region: a let go of it when it found b
  // closed (before any forget_peer).
  const std::string name = p.b->region_name();
  const Bytes endpoint = p.b->endpoint_name();
  p.b.reset();
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    EXPECT_EQ(line.find(name), std::string::npos) << "still mapped: " << line;
  }
  p.a->forget_peer(peer);
  auto again = p.a->resolve_peer(endpoint);
  ASSERT_FALSE(again);
  EXPECT_EQ(again.status().code(), ErrorCode::kPeerUnreachable);
  EXPECT_EQ(dst, std::vector<std::byte>(64));
}

TEST(ShmDomain, ForgetCompletesWhatWasPostedAndReconnects) {
  Pair p;
  std::vector<std::byte> dst(64);
  auto reg = p.b->register_memory(dst.data(), dst.size(), false);
  ASSERT_TRUE(reg);
  const PeerHandle peer = p.b_from_a();
  const auto src = pattern(64, 7);
  ASSERT_EQ(p.a->post_write(write(1, src, peer, **reg, 0, 40)).kind, PostResult::Kind::kPosted);
  p.a->forget_peer(peer);
  std::vector<Completion> buf(8);
  ASSERT_EQ(p.a->poll(buf), 1u);  // each posted request completes exactly once
  EXPECT_EQ(buf[0].wr_id, 1u);
  EXPECT_EQ(buf[0].error, ErrorCode::kPeerUnreachable);
  EXPECT_EQ(p.a->post_write(write(2, src, peer, **reg, 0, 40)).kind, PostResult::Kind::kFailed);
  const PeerHandle fresh = p.b_from_a();
  EXPECT_NE(fresh, peer);
  ASSERT_EQ(p.a->post_write(write(3, src, fresh, **reg, 0, 41)).kind, PostResult::Kind::kPosted);
  ASSERT_TRUE(p.run_until([&] { return p.local(3) != nullptr; }));
  EXPECT_EQ(p.local(3)->error, ErrorCode::kOk);
  EXPECT_EQ(p.imms(41), 1u);
  EXPECT_EQ(p.local(1), nullptr) << "the forgotten write completed a second time";
}

TEST(ShmDomain, RejectsOtherNicsAndForeignNames) {
  EXPECT_FALSE(ShmDomain::open("lo"));
  auto d = open_domain();
  ASSERT_TRUE(d);
  const std::string bogus = "fi_shm://1234:0";
  auto r = d->resolve_peer(std::as_bytes(std::span(bogus.data(), bogus.size())));
  ASSERT_FALSE(r);
  EXPECT_EQ(r.status().code(), ErrorCode::kInvalidArgument);
}

}  // namespace
}  // namespace fabric::transport
