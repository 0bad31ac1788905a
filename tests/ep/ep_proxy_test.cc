// fabric::ep's inter-node path without a GPU: the schedule's pure functions, and the proxy
// protocol end to end over real engines (tcp and shm, two or four in this process, each proxy
// driving its own caller-progress group). FakeGpu is a test double for the kernels: it plays
// their part on the proxy's regions in host memory (stages a round and raises the ready word,
// waits for the receive flag, checks every byte, raises the done word), as the kernels do
// through the regions' device mappings. A data region may also be a FakeDeviceBuffer, the test
// double for GPU memory that no NIC reaches.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>

#include "ep/proxy.h"
#include "ep_fake_gpu.h"
#include "fabric/testing.h"
#include "slowdown.h"

namespace fabric::ep {
namespace {

using namespace std::chrono_literals;
using fabric::testing::kSlowdown;  // sanitized builds: every time bound of this file scales
using Clock = std::chrono::steady_clock;
using testing::amount;
using testing::FakeGpu;
using testing::HostRegion;
using testing::small_config;

// --- the schedule ------------------------------------------------------------------------------

TEST(EpSchedule, RemotePeersAndIndicesAgree) {
  for (int per_node : {1, 2, 4}) {
    const int world = 8;
    for (int rank = 0; rank < world; ++rank) {
      const std::vector<int> peers = remote_peers(rank, world, per_node);
      EXPECT_EQ(peers.size(), static_cast<size_t>(world - per_node));
      for (int r = 0; r < world; ++r) {
        const int i = remote_index(rank, r, per_node);
        if (r / per_node == rank / per_node) {
          EXPECT_EQ(i, -1) << rank << " " << r;
          EXPECT_FALSE(on_other_nodes(rank, r, per_node));
        } else {
          ASSERT_GE(i, 0);
          ASSERT_LT(static_cast<size_t>(i), peers.size());
          EXPECT_EQ(peers[static_cast<size_t>(i)], r);
          EXPECT_TRUE(on_other_nodes(rank, r, per_node));
        }
      }
    }
  }
}

TEST(EpSchedule, ImmediatesRoundTripAndDiffer) {
  const ImmKind kinds[] = {ImmKind::kDispatchCounts, ImmKind::kDispatchData, ImmKind::kDispatchAck,
                           ImmKind::kCombineCounts,  ImmKind::kCombineData,  ImmKind::kCombineAck};
  std::set<uint32_t> seen;
  for (ImmKind k : kinds) {
    for (int source : {0, 1, 31, 511}) {
      for (uint32_t round : {1u, 2u, 65535u, 65536u + 7u}) {
        const uint32_t imm = encode_imm(k, source, round);
        auto d = decode_imm(imm);
        ASSERT_TRUE(d) << d.status().to_string();
        EXPECT_EQ(d->kind, k);
        EXPECT_EQ(d->source, source);
        EXPECT_EQ(d->round, round & 0xffffu);
        if (round < 65536) {
          EXPECT_TRUE(seen.insert(imm).second) << std::hex << imm;
        }
      }
    }
  }
  // Round r and r + 2^16 share a value (a peer is at most one round ahead).
  EXPECT_EQ(encode_imm(ImmKind::kDispatchData, 3, 5), encode_imm(ImmKind::kDispatchData, 3, 65541));
  EXPECT_EQ(decode_imm(0x12345678).status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(decode_imm(0xE0000000).status().code(), ErrorCode::kInvalidArgument);  // kind 0
  EXPECT_EQ(decode_imm(0xEE000000).status().code(), ErrorCode::kInvalidArgument);  // kind 7
}

TEST(EpSchedule, ChunksCoverTheBytesExactly) {
  EXPECT_TRUE(split_chunks(0, 100).empty());
  EXPECT_EQ(split_chunks(250, 100), (std::vector<Chunk>{{0, 100}, {100, 100}, {200, 50}}));
  EXPECT_EQ(split_chunks(200, 100), (std::vector<Chunk>{{0, 100}, {100, 100}}));
  EXPECT_EQ(split_chunks(7, 0), (std::vector<Chunk>{{0, 7}}));
  for (uint64_t bytes : {0ull, 1ull, 99ull, 100ull, 101ull, 12345ull}) {
    for (uint64_t chunk : {0ull, 1ull, 64ull, 100ull, 1ull << 20}) {
      // Contiguous from 0, each within the chunk size, together exactly the bytes.
      uint64_t at = 0;
      for (const Chunk& c : split_chunks(bytes, chunk)) {
        EXPECT_EQ(c.offset, at) << bytes << " " << chunk;
        EXPECT_GT(c.length, 0u);
        EXPECT_LE(c.length, chunk == 0 ? bytes : chunk);
        at += c.length;
      }
      EXPECT_EQ(at, bytes) << bytes << " " << chunk;
      EXPECT_EQ(chunk_count(bytes, chunk), split_chunks(bytes, chunk).size());
    }
  }
}

TEST(EpSchedule, BytesPerRoundFollowTheLayout) {
  auto l = Layout::of(small_config(0, 2, 1));
  ASSERT_TRUE(l) << l.status().to_string();
  EXPECT_EQ(dispatch_bytes(*l, 0), 0u);
  EXPECT_EQ(dispatch_bytes(*l, 5), 5 * l->entry_bytes);
  EXPECT_EQ(dispatch_bytes(*l, 24), l->dispatch_area_bytes);
  EXPECT_EQ(combine_bytes(*l, 0), 0u);
  EXPECT_EQ(combine_bytes(*l, 3), 3u * 2 * 256);       // three rows of hidden 256 in bf16
  EXPECT_EQ(combine_bytes(*l, 48), l->combine_bytes);  // every (token, slot): 24 x top-2
}

// A round's writes cover what the receiver reads: its counts write (a combine's with its rows'
// slot ids behind the counts, control region), then dispatch entries or compact combine rows
// from 0 of the data region's areas, in chunks.
TEST(EpSchedule, RoundChunksCoverTheIdsAndTheRows) {
  const AllToAllConfig c = small_config(0, 2, 1);
  auto l = Layout::of(c);
  ASSERT_TRUE(l);
  auto p = ProxyLayout::of(c, *l);
  ASSERT_TRUE(p);
  EXPECT_EQ(p->combine_slots, 48u);
  EXPECT_EQ(p->combine_ids_bytes, 192u);
  EXPECT_EQ(p->combine_area_bytes, l->combine_bytes);
  EXPECT_TRUE(round_chunks(*l, false, 0, 100).empty());
  EXPECT_TRUE(round_chunks(*l, true, 0, 100).empty());
  EXPECT_EQ(round_chunks(*l, false, 2, 0), (std::vector<Chunk>{{0, dispatch_bytes(*l, 2)}}));
  // 5 rows: their 20 bytes of ids behind the counts, then 5 x 512 bytes of rows, in chunks of
  // 1000.
  EXPECT_EQ(counts_write_bytes(true, 5), kCountsBytes + 20);
  EXPECT_EQ(counts_write_bytes(false, 5), kCountsBytes);
  EXPECT_EQ(counts_write_bytes(true, 0), kCountsBytes);
  EXPECT_EQ(round_chunks(*l, true, 5, 1000),
            (std::vector<Chunk>{{0, 1000}, {1000, 1000}, {2000, 560}}));
  EXPECT_EQ(round_chunks(*l, true, 5, 0), (std::vector<Chunk>{{0, 2560}}));
  // The receiver's count agrees with the sender's chunks, at every size and chunking.
  for (uint64_t chunk : {0ull, 1ull, 7ull, 20ull, 512ull, 1000ull, 1ull << 20}) {
    for (uint32_t v : {0u, 1u, 4u, 5u, 47u, 48u}) {
      for (bool combine : {false, true}) {
        EXPECT_EQ(chunk_count(round_bytes(*l, combine, v), chunk),
                  round_chunks(*l, combine, v, chunk).size())
            << "chunk " << chunk << ", value " << v << (combine ? ", combine" : ", dispatch");
      }
    }
  }
  // The most a round can carry stays inside one peer's areas.
  EXPECT_LE(counts_write_bytes(true, p->combine_slots), p->combine_counts_bytes);
  for (uint64_t chunk : {0ull, 7ull, 1000ull, 1ull << 20}) {
    for (const Chunk& k : round_chunks(*l, true, p->combine_slots, chunk)) {
      EXPECT_LE(k.offset + k.length, p->combine_area_bytes);
    }
    for (const Chunk& k : round_chunks(*l, false, c.max_tokens_per_rank, chunk)) {
      EXPECT_LE(k.offset + k.length, p->dispatch_area_bytes);
    }
  }
}

TEST(EpSchedule, CountsRoundTrip) {
  std::byte slot[kCountsBytes];
  store_counts(slot, Counts{0xfffffffeu, 77});
  const Counts c = load_counts(slot);
  EXPECT_EQ(c.round, 0xfffffffeu);
  EXPECT_EQ(c.value, 77u);
}

TEST(EpSchedule, ProxyLayoutRegionsAreAlignedAndDisjoint) {
  for (auto [world, per_node] : {std::pair{2, 1}, std::pair{4, 2}, std::pair{8, 1}}) {
    const AllToAllConfig c = small_config(0, world, per_node);
    auto l = Layout::of(c);
    ASSERT_TRUE(l);
    auto p = ProxyLayout::of(c, *l);
    ASSERT_TRUE(p) << p.status().to_string();
    EXPECT_EQ(p->num_remote, world - per_node);
    const uint64_t n = static_cast<uint64_t>(p->num_remote);
    // The control region: the words, the dispatch counts, the map and the two arrays of combine
    // counts with their slot ids, in that order.
    EXPECT_GE(p->counts_offset, ProxyLayout::kWords * kMaxRanks * 8u);
    EXPECT_GE(p->combine_map_offset, p->counts_offset + 2 * n * kCountsBytes);
    EXPECT_GE(p->combine_counts_send_offset, p->combine_map_offset + 4ull * p->combine_slots);
    EXPECT_GE(p->combine_ids_bytes, 4ull * p->combine_slots);
    EXPECT_EQ(p->combine_counts_bytes, kCountsBytes + p->combine_ids_bytes);
    EXPECT_GE(p->combine_counts_recv_offset,
              p->combine_counts_send_offset + n * p->combine_counts_bytes);
    EXPECT_GE(p->control_bytes, p->combine_counts_recv_offset + n * p->combine_counts_bytes);
    // A combine's slot ids right behind its counts slot, within the peer's part.
    for (bool recv : {false, true}) {
      for (int i = 0; i < p->num_remote; ++i) {
        const uint64_t slot = p->counts_slot(recv, true, i);
        const uint64_t ids = recv ? p->combine_ids_recv(i) : p->combine_ids_send(i);
        EXPECT_EQ(ids, slot + kCountsBytes);
        EXPECT_EQ(slot, (recv ? p->combine_counts_recv_offset : p->combine_counts_send_offset) +
                            static_cast<uint64_t>(i) * p->combine_counts_bytes);
        EXPECT_EQ(slot % 16, 0u);
      }
    }
    // The data region: the four per-peer arrays of areas.
    EXPECT_EQ(p->dispatch_send_offset, 0u);
    EXPECT_GE(p->combine_send_offset, p->dispatch_send_offset + n * l->dispatch_area_bytes);
    EXPECT_EQ(p->combine_area_bytes, l->combine_bytes);
    EXPECT_GE(p->dispatch_recv_offset, p->combine_send_offset + n * p->combine_area_bytes);
    EXPECT_GE(p->combine_recv_offset, p->dispatch_recv_offset + n * l->dispatch_area_bytes);
    EXPECT_GE(p->data_bytes, p->combine_recv_offset + n * p->combine_area_bytes);
    EXPECT_EQ(p->combine_ids_bytes % 16, 0u);
    EXPECT_EQ(p->combine_area_bytes % 16, 0u);
    for (uint64_t off : {p->counts_offset, p->combine_map_offset, p->combine_counts_send_offset,
                         p->combine_counts_recv_offset, p->control_bytes, p->combine_send_offset,
                         p->dispatch_recv_offset, p->combine_recv_offset, p->data_bytes}) {
      EXPECT_EQ(off % 4096, 0u);
    }
    // Counts slots: four disjoint arrays (a combine's with room for its ids behind it).
    std::set<uint64_t> slots;
    for (bool recv : {false, true}) {
      for (bool combine : {false, true}) {
        for (int i = 0; i < p->num_remote; ++i) {
          EXPECT_TRUE(slots.insert(p->counts_slot(recv, combine, i)).second);
        }
      }
    }
  }
  auto bad = small_config(0, 3, 2);
  bad.num_experts = 6;
  auto l = Layout::of(bad);
  ASSERT_FALSE(l);  // validate() refuses it first
  EXPECT_NE(l.status().message().find("divide"), std::string::npos) << l.status().to_string();
}

// Where a test puts the proxies' data regions.
enum class DataIn { kHost, kFakeDevice };

// One rank: its regions, its proxy and its FakeGpu.
struct Rank {
  AllToAllConfig config;
  Layout layout;
  ProxyLayout proxy_layout;
  std::unique_ptr<HostRegion> control;
  std::unique_ptr<HostRegion> data;                                // DataIn::kHost
  std::unique_ptr<fabric::testing::FakeDeviceBuffer> device_data;  // DataIn::kFakeDevice
  bool told_direct = true;  // what Proxy::create told the allocator
  std::unique_ptr<Proxy> proxy;
  std::unique_ptr<FakeGpu> gpu;
};

class EpProxy : public ::testing::TestWithParam<std::string> {
 protected:
  // Creates and connects `world` ranks of `per_node` GPUs per node; false (and a skip reason)
  // when the provider is absent.
  bool make(int world, int per_node, ProxyOptions options = {}, DataIn data_in = DataIn::kHost) {
    options.provider = GetParam();
    options.nics = {GetParam() == "tcp" ? "lo" : "shm"};
    options.timeout = 1000ms * kSlowdown;
    options.chunk_bytes = 3000;  // several chunks for the larger rounds
    ranks_.resize(static_cast<size_t>(world));
    std::vector<Bytes> handles;
    for (int r = 0; r < world; ++r) {
      Rank& k = ranks_[static_cast<size_t>(r)];
      k.config = small_config(r, world, per_node);
      auto l = Layout::of(k.config);
      EXPECT_TRUE(l) << l.status().to_string();
      if (!l) return false;
      k.layout = *l;
      auto pl = ProxyLayout::of(k.config, k.layout);
      EXPECT_TRUE(pl) << pl.status().to_string();
      if (!pl) return false;
      k.proxy_layout = *pl;
      auto p = Proxy::create(
          k.config, k.layout, options,
          [&k, data_in](const ProxyLayout& l, bool direct) -> Result<ProxyAreas> {
            k.told_direct = direct;
            k.control = std::make_unique<HostRegion>(l.control_bytes);
            if (data_in == DataIn::kHost) {
              k.data = std::make_unique<HostRegion>(l.data_bytes);
              return ProxyAreas{{k.control->at, l.control_bytes}, {k.data->at, l.data_bytes}};
            }
            auto device = fabric::testing::FakeDeviceBuffer::create(l.data_bytes);
            if (!device) return device.status();
            k.device_data = std::move(*device);
            return ProxyAreas{{k.control->at, l.control_bytes},
                              {static_cast<std::byte*>(k.device_data->device_ptr()), l.data_bytes}};
          });
      if (!p && p.status().code() == ErrorCode::kUnsupported) {
        skip_ = p.status().to_string();
        return false;
      }
      EXPECT_TRUE(p) << p.status().to_string();
      if (!p) return false;
      k.proxy = std::move(*p);
      k.gpu = std::make_unique<FakeGpu>(
          k.config, k.layout, k.proxy_layout, k.control->at,
          data_in == DataIn::kHost ? k.data->at : k.device_data->contents().data());
      handles.push_back(k.proxy->handle());
    }
    for (Rank& k : ranks_) {
      Status s = k.proxy->connect(handles);
      EXPECT_TRUE(s) << s.to_string();
      if (!s) return false;
    }
    return true;
  }

  // Every rank runs `rounds` full rounds on a thread of its own; `slow` sleeps before reading.
  void run_rounds(uint32_t first, uint32_t rounds, int slow = -1) {
    std::vector<std::thread> threads;
    std::vector<Status> results(ranks_.size());
    for (size_t r = 0; r < ranks_.size(); ++r) {
      threads.emplace_back([&, r] {
        FakeGpu& g = *ranks_[r].gpu;
        for (uint32_t round = first; round < first + rounds; ++round) {
          Status s = g.dispatch_send(round);
          if (s && static_cast<int>(r) == slow) std::this_thread::sleep_for(5ms);
          if (s) s = g.dispatch_recv(round);
          if (s) s = g.combine_send(round);
          if (s && static_cast<int>(r) == slow) std::this_thread::sleep_for(5ms);
          if (s) s = g.combine_recv(round);
          if (!s) {
            results[r] = Status(s.code(), "round " + std::to_string(round) + ": " + s.message());
            return;
          }
        }
      });
    }
    for (auto& t : threads) t.join();
    for (size_t r = 0; r < ranks_.size(); ++r) {
      EXPECT_TRUE(results[r]) << "rank " << r << ": " << results[r].to_string();
      EXPECT_TRUE(ranks_[r].proxy->status()) << ranks_[r].proxy->status().to_string();
    }
  }

  std::vector<Rank> ranks_;
  std::string skip_;
};

#define MAKE_OR_SKIP(...)                                                         \
  if (!make(__VA_ARGS__)) {                                                       \
    if (!skip_.empty()) GTEST_SKIP() << "provider not available here: " << skip_; \
    FAIL() << "set-up failed";                                                    \
  }

TEST_P(EpProxy, TwoNodesCarryEveryByteOfManyRounds) {
  MAKE_OR_SKIP(2, 1);
  run_rounds(1, 60);
}

// The data regions in (test double) GPU memory that no NIC reaches: the engine stages every
// entry and row through host memory, and every byte still arrives (the control region, which
// the proxy reads, stays in host memory). The allocator was told the engine is not direct.
TEST_P(EpProxy, DataRegionsInDeviceMemoryGoThroughTheStagedPath) {
  MAKE_OR_SKIP(2, 1, ProxyOptions{}, DataIn::kFakeDevice);
  for (const Rank& k : ranks_) EXPECT_FALSE(k.told_direct);
  run_rounds(1, 20);
}

// The counters say what was sent: per kind a round and a counts write per peer and round (a
// combine's with its slot ids), then the round's chunks, with exactly their bytes; every round
// sent was received by the other side.
TEST_P(EpProxy, StatsCountTheRoundsWritesAndBytes) {
  MAKE_OR_SKIP(4, 2);
  const uint32_t rounds = 6;
  run_rounds(1, rounds);
  for (Rank& k : ranks_) {
    const ProxyStats st = k.proxy->stats();
    for (int kind = 0; kind < 2; ++kind) {
      uint64_t writes = 0, bytes = 0;
      for (int d : remote_peers(k.config.rank, 4, 2)) {
        const uint32_t most = kind == 0 ? k.config.max_tokens_per_rank
                                        : k.proxy_layout.combine_slots / 2;  // two remote peers
        for (uint32_t round = 1; round <= rounds; ++round) {
          const uint32_t n = amount(k.config.rank, d, round, kind, most);
          const auto chunks = round_chunks(k.layout, kind == 1, n, 3000);
          writes += 1 + chunks.size();
          bytes += kCountsBytes + (kind == 1 ? 4ull * n : 0u);  // a combine's slot ids too
          for (const Chunk& c : chunks) bytes += c.length;
        }
      }
      EXPECT_EQ(st.rounds_sent[kind], 2u * rounds) << "rank " << k.config.rank << " kind " << kind;
      EXPECT_EQ(st.rounds_received[kind], 2u * rounds);
      EXPECT_EQ(st.writes_sent[kind], writes);
      EXPECT_EQ(st.bytes_sent[kind], bytes);
      EXPECT_GT(st.post_ns[kind], 0u);
      EXPECT_GT(st.complete_ns[kind], 0u);
    }
    EXPECT_GT(st.passes, 0u);
  }
}

TEST_P(EpProxy, FourRanksOnTwoNodesAndOnFourNodes) {
  {
    MAKE_OR_SKIP(4, 2);
    run_rounds(1, 20);
  }
  ranks_.clear();
  MAKE_OR_SKIP(4, 1);
  run_rounds(1, 20);
}

// A slow reader: the others may not reuse their staging for it before its acknowledgement, so
// every byte of every round still arrives as sent.
TEST_P(EpProxy, RoundReuseWaitsForTheReadersAck) {
  MAKE_OR_SKIP(2, 1);
  FakeGpu& g0 = *ranks_[0].gpu;
  FakeGpu& g1 = *ranks_[1].gpu;
  ASSERT_TRUE(g0.dispatch_send(1));
  ASSERT_TRUE(g1.dispatch_send(1));
  // Rank 1's data has arrived at rank 0 (its flag is up), but rank 0 has not read it: rank 1
  // gets no acknowledgement, so its round 2 would have to wait.
  ASSERT_TRUE(g0.wait(ProxyLayout::kDispatchFlag, 1, 32, 1, 5000ms));
  EXPECT_FALSE(g1.wait(ProxyLayout::kDispatchAck, 0, 0, 1, 300ms));
  ASSERT_TRUE(g0.dispatch_recv(1));
  EXPECT_TRUE(g1.wait(ProxyLayout::kDispatchAck, 0, 0, 1, 5000ms));
  ASSERT_TRUE(g1.dispatch_recv(1));
  ASSERT_TRUE(g0.combine_send(1));
  ASSERT_TRUE(g1.combine_send(1));
  ASSERT_TRUE(g1.wait(ProxyLayout::kCombineFlag, 0, 32, 1, 5000ms));
  EXPECT_FALSE(g0.wait(ProxyLayout::kCombineAck, 1, 0, 1, 300ms));
  ASSERT_TRUE(g0.combine_recv(1));
  ASSERT_TRUE(g1.combine_recv(1));
  run_rounds(2, 40, /*slow=*/1);
}

// A peer whose proxy goes away: the other side's next round ends in an error within a bound,
// and its own destruction does not hang.
TEST_P(EpProxy, APeerThatGoesAwayIsAnErrorWithinABound) {
  MAKE_OR_SKIP(2, 1);
  run_rounds(1, 3);
  // Rank 1's acknowledgement of round 3 has reached rank 0, so that rank 0 stages round 4.
  ASSERT_TRUE(ranks_[0].gpu->wait(ProxyLayout::kDispatchAck, 1, 0, 3, 5000ms));
  ranks_[1].proxy.reset();
  const auto start = Clock::now();
  ASSERT_TRUE(ranks_[0].gpu->dispatch_send(4));
  Status got = ranks_[0].gpu->dispatch_recv(4);
  EXPECT_EQ(got.code(), ErrorCode::kTimeout) << got.to_string();
  Status s;
  while ((s = ranks_[0].proxy->status()) && Clock::now() - start < 10s * kSlowdown) {
    std::this_thread::sleep_for(10ms);
  }
  const auto took = Clock::now() - start;
  ASSERT_FALSE(s) << "no error after " << (took / 1ms) << " ms";
  EXPECT_TRUE(s.code() == ErrorCode::kTimeout || s.code() == ErrorCode::kPeerUnreachable)
      << s.to_string();
  EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s.to_string();
  EXPECT_LT(took, 5s * kSlowdown) << s.to_string();
  const auto destroy = Clock::now();
  ranks_[0].proxy.reset();
  EXPECT_LT(Clock::now() - destroy, 5s * kSlowdown);
}

// A peer that stays connected but stops calling the halves: kTimeout naming it.
TEST_P(EpProxy, ASilentPeerIsATimeout) {
  MAKE_OR_SKIP(2, 1);
  run_rounds(1, 2);
  const auto start = Clock::now();
  ASSERT_TRUE(ranks_[0].gpu->dispatch_send(3));
  Status s;
  while ((s = ranks_[0].proxy->status()) && Clock::now() - start < 10s * kSlowdown) {
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_FALSE(s);
  EXPECT_EQ(s.code(), ErrorCode::kTimeout) << s.to_string();
  EXPECT_NE(s.message().find("rank 1's dispatch of round 3"), std::string::npos) << s.to_string();
  EXPECT_GE(Clock::now() - start, 900ms * kSlowdown);
  EXPECT_LT(Clock::now() - start, 5s * kSlowdown);
  EXPECT_TRUE(ranks_[1].proxy->status()) << ranks_[1].proxy->status().to_string();
}

// Destruction mid-round, with writes posted and nothing read: bounded, on every rank.
TEST_P(EpProxy, DestructionMidRoundDoesNotHang) {
  MAKE_OR_SKIP(4, 1);
  for (Rank& k : ranks_) ASSERT_TRUE(k.gpu->dispatch_send(1));
  std::this_thread::sleep_for(20ms);
  const auto start = Clock::now();
  for (Rank& k : ranks_) k.proxy.reset();
  EXPECT_LT(Clock::now() - start, 10s * kSlowdown);
}

// A combine row naming a slot beyond the receiver's tokens: the receiving proxy stops with a
// protocol error naming it, and its map is not written (the GPU would read the row there).
TEST_P(EpProxy, ACombineRowNamingAnUnknownSlotIsAProtocolError) {
  MAKE_OR_SKIP(2, 1);
  run_rounds(1, 2);
  // Round 3 of rank 0's combine to rank 1 carries rows (amount(0, 1, 3, 1, 48) = 19).
  ASSERT_GT(amount(0, 1, 3, 1, ranks_[0].proxy_layout.combine_slots), 0u);
  // (One remote peer each: rank 0 may send rows for all 48 slots of rank 1's tokens.)
  ASSERT_EQ(ranks_[0].proxy_layout.num_remote, 1);
  ASSERT_TRUE(ranks_[0].gpu->dispatch_send(3));
  ASSERT_TRUE(ranks_[1].gpu->dispatch_send(3));
  ASSERT_TRUE(ranks_[0].gpu->dispatch_recv(3));
  ASSERT_TRUE(ranks_[1].gpu->dispatch_recv(3));
  const uint32_t slots = ranks_[1].proxy_layout.combine_slots;
  ranks_[0].gpu->corrupt_next_slot(slots + 5);
  ASSERT_TRUE(ranks_[0].gpu->combine_send(3));
  Status got = ranks_[1].gpu->combine_recv(3);
  EXPECT_EQ(got.code(), ErrorCode::kTimeout) << got.to_string();  // its flag never came
  Status s = ranks_[1].proxy->status();
  ASSERT_FALSE(s);
  EXPECT_EQ(s.code(), ErrorCode::kInternal) << s.to_string();
  EXPECT_NE(s.message().find("rank 0's combine of round 3 names slot " + std::to_string(slots + 5)),
            std::string::npos)
      << s.to_string();
}

// ProxyOptions::before_flag runs once per peer, kind and round, after the round's bytes and
// before its flag (with two ranks, the proxy calling it for peer s is rank 1 - s's).
TEST_P(EpProxy, BeforeFlagRunsOncePerRoundBeforeTheFlag) {
  std::atomic<int> calls{0}, early{0};
  ProxyOptions options;
  options.before_flag = [&](int peer, bool combine, uint32_t round) {
    const Rank& me = ranks_[static_cast<size_t>(1 - peer)];
    const uint64_t flag = load_word(
        me.control->at, combine ? ProxyLayout::kCombineFlag : ProxyLayout::kDispatchFlag, peer);
    if (static_cast<uint32_t>(flag >> 32) >= round) ++early;
    ++calls;
    return Status::ok();
  };
  MAKE_OR_SKIP(2, 1, options);
  run_rounds(1, 10);
  EXPECT_EQ(calls.load(), 2 * 2 * 10);
  EXPECT_EQ(early.load(), 0);
}

// A before_flag that fails: the proxy stops with its error, naming the round, and the flag stays
// down (the receiving half times out). Which rank's proxy meets it first depends on timing (the
// other one may stop before it has sent its own round, and then times out).
TEST_P(EpProxy, AFailingBeforeFlagIsTheProxysFailure) {
  ProxyOptions options;
  options.before_flag = [](int, bool combine, uint32_t round) {
    return combine && round == 2 ? Status(ErrorCode::kFabric, "the flush failed") : Status::ok();
  };
  MAKE_OR_SKIP(2, 1, options);
  run_rounds(1, 1);
  for (Rank& k : ranks_) ASSERT_TRUE(k.gpu->dispatch_send(2));
  for (Rank& k : ranks_) ASSERT_TRUE(k.gpu->dispatch_recv(2));
  for (Rank& k : ranks_) ASSERT_TRUE(k.gpu->combine_send(2));
  int failed_by_hook = 0;
  for (int r = 0; r < 2; ++r) {
    Rank& k = ranks_[static_cast<size_t>(r)];
    EXPECT_EQ(k.gpu->combine_recv(2).code(), ErrorCode::kTimeout) << "rank " << r;
    // The proxy's own timeout (the other rank silent) may come just after the GPU's.
    Status s;
    const auto until = Clock::now() + 5s * kSlowdown;
    while ((s = k.proxy->status()) && Clock::now() < until) std::this_thread::sleep_for(10ms);
    ASSERT_FALSE(s) << "rank " << r;
    if (s.code() != ErrorCode::kFabric) continue;
    ++failed_by_hook;
    EXPECT_NE(s.message().find(fmt::format("before raising rank {}'s combine flag of round 2: "
                                           "the flush failed",
                                           1 - r)),
              std::string::npos)
        << s.to_string();
  }
  EXPECT_GE(failed_by_hook, 1);
}

TEST_P(EpProxy, ConnectRefusesBadHandles) {
  MAKE_OR_SKIP(2, 1);
  // Connected already.
  std::vector<Bytes> handles = {ranks_[0].proxy->handle(), ranks_[1].proxy->handle()};
  EXPECT_EQ(ranks_[0].proxy->connect(handles).code(), ErrorCode::kAlreadyExists);
  // A fresh proxy: wrong count, garbage.
  Rank k;
  k.config = small_config(0, 2, 1);
  k.layout = *Layout::of(k.config);
  k.proxy_layout = *ProxyLayout::of(k.config, k.layout);
  HostRegion control(k.proxy_layout.control_bytes), data(k.proxy_layout.data_bytes);
  ProxyOptions o;
  o.provider = GetParam();
  o.nics = {GetParam() == "tcp" ? "lo" : "shm"};
  auto with = [&](uint64_t control_offset, uint64_t data_bytes) {
    return [&, control_offset, data_bytes](const ProxyLayout& l, bool) -> Result<ProxyAreas> {
      return ProxyAreas{{control.at + control_offset, l.control_bytes}, {data.at, data_bytes}};
    };
  };
  auto p = Proxy::create(k.config, k.layout, o, with(0, k.proxy_layout.data_bytes));
  ASSERT_TRUE(p) << p.status().to_string();
  EXPECT_EQ((*p)->connect({handles[0]}).code(), ErrorCode::kInvalidArgument);
  Status s = (*p)->connect({handles[0], Bytes(10)});
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s.to_string();
  // Regions too small or misaligned; the allocator's own failure comes back as it is.
  s = Proxy::create(k.config, k.layout, o, with(0, 100)).status();
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("data region of 100 bytes"), std::string::npos) << s.to_string();
  s = Proxy::create(k.config, k.layout, o, with(8, k.proxy_layout.data_bytes)).status();
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("control region is not 16-byte aligned"), std::string::npos)
      << s.to_string();
  s = Proxy::create(k.config, k.layout, o, [](const ProxyLayout&, bool) -> Result<ProxyAreas> {
        return Status(ErrorCode::kFabric, "no memory for it");
      }).status();
  EXPECT_EQ(s.code(), ErrorCode::kFabric);
  EXPECT_NE(s.message().find("no memory for it"), std::string::npos) << s.to_string();
}

INSTANTIATE_TEST_SUITE_P(Providers, EpProxy, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace fabric::ep
