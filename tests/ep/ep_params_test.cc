// fabric::ep's kernels as the host sets them up (ep/params.h), without a GPU: the parameters
// from the configuration and the layouts, the scratch's layout, the routes between the ranks of
// one node (what one rank's kernels write is where its peer's kernels read) and to the ranks of
// other nodes (this rank's areas and words in the proxy's regions), and the error report read
// back as a Status. Host memory stands for the buffers; the proxy tests (ep_proxy_test.cc) carry
// rounds through the same routes with FakeGpu, over real engines.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "ep/params.h"
#include "ep/schedule.h"
#include "ep_fake_gpu.h"
#include "fabric/ep.h"
#include "fabric/testing.h"

namespace fabric::ep {
namespace {

using testing::HostRegion;

// fp8 tokens: their scales are part of the entries.
AllToAllConfig config_of(int rank, int world, int per_node) {
  return testing::small_config(rank, world, per_node, TokenDtype::kFp8E4m3);
}

// A configuration's two layouts.
struct Layouts {
  Layout layout;
  ProxyLayout proxy;
};
Layouts layouts_of(const AllToAllConfig& c) {
  auto l = Layout::of(c);
  EXPECT_TRUE(l) << l.status().to_string();
  if (!l) return {};
  auto pl = ProxyLayout::of(c, *l);
  EXPECT_TRUE(pl) << pl.status().to_string();
  return {*l, pl ? *pl : ProxyLayout{}};
}

// One rank's memory in host memory: its buffer, scratch, report and proxy regions.
struct Rank {
  AllToAllConfig config;
  Layout layout;
  ProxyLayout proxy_layout;
  std::unique_ptr<HostRegion> buffer, scratch, control, data;
  device::ErrorReport report{};
  KernelMemory memory;
  device::Params params{};

  uint8_t* at(const std::unique_ptr<HostRegion>& r) const {
    return reinterpret_cast<uint8_t*>(r->at);
  }
};

// `world` ranks of `per_node` GPUs per node, each with its parameters; the ranks of one node map
// each other's buffers (here: the same host memory), as connect() does.
std::vector<Rank> make_ranks(int world, int per_node) {
  std::vector<Rank> ranks(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    Rank& k = ranks[static_cast<size_t>(r)];
    k.config = config_of(r, world, per_node);
    const Layouts ls = layouts_of(k.config);
    k.layout = ls.layout;
    k.proxy_layout = ls.proxy;
    k.buffer = std::make_unique<HostRegion>(k.layout.buffer_bytes);
    k.scratch = std::make_unique<HostRegion>(ScratchLayout::of(k.layout).bytes);
    k.memory.buffer = k.at(k.buffer);
    k.memory.scratch = k.at(k.scratch);
    k.memory.report = &k.report;
    if (k.proxy_layout.num_remote > 0) {
      k.control = std::make_unique<HostRegion>(k.proxy_layout.control_bytes);
      k.data = std::make_unique<HostRegion>(k.proxy_layout.data_bytes);
      k.memory.proxy_control = k.at(k.control);
      k.memory.proxy_data = k.at(k.data);
    }
    k.params = kernel_params(k.config, k.layout, k.proxy_layout, k.memory, 132);
  }
  for (Rank& k : ranks) {
    k.memory.peers.assign(static_cast<size_t>(world), nullptr);
    for (int r = 0; r < world; ++r) {
      if (r != k.config.rank && !on_other_nodes(k.config.rank, r, per_node)) {
        k.memory.peers[static_cast<size_t>(r)] = ranks[static_cast<size_t>(r)].memory.buffer;
      }
    }
    route_peers(k.params, k.config, k.layout, k.proxy_layout, k.memory);
  }
  return ranks;
}

TEST(EpParams, CarryTheConfigurationTheLayoutAndTheScratch) {
  const std::vector<Rank> ranks = make_ranks(4, 2);
  const Rank& k = ranks[2];
  const device::Params& p = k.params;
  EXPECT_EQ(p.rank, 2);
  EXPECT_EQ(p.world, 4);
  EXPECT_EQ(p.num_experts, 8u);
  EXPECT_EQ(p.num_local_experts, 2u);
  EXPECT_EQ(p.hidden, 256u);
  EXPECT_EQ(p.top_k, 2u);
  EXPECT_EQ(p.scale_columns, k.layout.scale_columns);
  EXPECT_EQ(p.num_sms, 132u);
  EXPECT_EQ(p.token_bytes, k.layout.token_bytes);
  EXPECT_EQ(p.entry_bytes, k.layout.entry_bytes);
  EXPECT_EQ(p.entry_token_offset, k.layout.entry_token_offset);
  EXPECT_EQ(p.entry_scale_offset, k.layout.entry_scale_offset);
  EXPECT_EQ(p.max_recv_rows, k.layout.max_recv_rows);
  EXPECT_EQ(p.timeout_ns, static_cast<uint64_t>(k.config.timeout.count()) * 1'000'000);
  EXPECT_EQ(p.report, &k.report);
  // Ranks 0 and 1 are on the other node.
  EXPECT_EQ(p.remote_mask, 0b0011u);
  EXPECT_EQ(reinterpret_cast<const uint8_t*>(p.combine_map),
            k.memory.proxy_control + k.proxy_layout.combine_map_offset);

  // The scratch: State, then the rows, then offsets and cursors, disjoint and in its bytes.
  const ScratchLayout s = ScratchLayout::of(k.layout);
  const auto* base = k.memory.scratch;
  EXPECT_EQ(reinterpret_cast<const uint8_t*>(p.state), base);
  EXPECT_GE(s.rows_offset, sizeof(device::State));
  EXPECT_EQ(s.rows_offset % 256, 0u);
  EXPECT_EQ(reinterpret_cast<const uint8_t*>(p.rows), base + s.rows_offset);
  EXPECT_EQ(s.experts_offset, s.rows_offset + k.layout.max_recv_rows * sizeof(device::RowSource));
  EXPECT_EQ(reinterpret_cast<const uint8_t*>(p.expert_offset), base + s.experts_offset);
  EXPECT_EQ(p.expert_cursor, p.expert_offset + p.num_local_experts);
  EXPECT_EQ(reinterpret_cast<const uint8_t*>(p.expert_cursor + p.num_local_experts),
            base + s.bytes);
}

TEST(EpParams, OneNodeHasNoProxyAndNoRanksElsewhere) {
  const std::vector<Rank> ranks = make_ranks(4, 4);
  for (const Rank& k : ranks) {
    EXPECT_EQ(k.params.remote_mask, 0u);
    EXPECT_EQ(k.params.combine_map, nullptr);
    for (int r = 0; r < 4; ++r) EXPECT_EQ(k.params.combine_ids_dst[r], nullptr);
  }
}

// What rank s's kernels write for rank d of its node is where d's kernels read what s sent, and
// each signal s raises is the one d waits on (and the other way round), in d's buffer or s's.
TEST(EpParams, RoutesWithinANodeMeetInTheReceiversBuffer) {
  for (auto [world, per_node] : {std::pair{4, 4}, std::pair{4, 2}, std::pair{8, 4}}) {
    const std::vector<Rank> ranks = make_ranks(world, per_node);
    for (int s = 0; s < world; ++s) {
      for (int d = 0; d < world; ++d) {
        if (on_other_nodes(s, d, per_node)) continue;
        SCOPED_TRACE("world " + std::to_string(world) + ", rank " + std::to_string(s) +
                     " to rank " + std::to_string(d));
        const device::Params& ps = ranks[static_cast<size_t>(s)].params;
        const device::Params& pd = ranks[static_cast<size_t>(d)].params;
        const Rank& to = ranks[static_cast<size_t>(d)];
        // Dispatch: s's entries in d's dispatch area for s; s's flag there; d's ack in s's.
        EXPECT_EQ(ps.dispatch_dst[d], pd.dispatch_src[s]);
        EXPECT_EQ(ps.dispatch_dst[d], to.memory.buffer + to.layout.dispatch_entry(s, 0));
        EXPECT_EQ(ps.dispatch_flag_out[d], pd.dispatch_flag_in[s]);
        EXPECT_EQ(pd.dispatch_ack_out[s], ps.dispatch_ack_in[d]);
        // Combine: s's rows in d's combine area; the same two signals.
        EXPECT_EQ(ps.combine_dst[d], pd.combine_src[s]);
        EXPECT_EQ(ps.combine_dst[d], to.memory.buffer + to.layout.combine_offset);
        EXPECT_EQ(ps.combine_flag_out[d], pd.combine_flag_in[s]);
        EXPECT_EQ(pd.combine_ack_out[s], ps.combine_ack_in[d]);
        EXPECT_EQ(ps.combine_ids_dst[d], nullptr);
        // Every signal is word [s] or [d] of the Signals at the start of a buffer of the node.
        const auto* sig = reinterpret_cast<const device::Signals*>(to.memory.buffer);
        EXPECT_EQ(ps.dispatch_flag_out[d], &sig->dispatch_flag[s]);
        EXPECT_EQ(ps.combine_flag_out[d], &sig->combine_flag[s]);
      }
    }
  }
}

// For a rank d of another node, rank s's kernels use s's proxy regions: staging and receive
// areas at d's index among s's remote peers, and the words indexed by d, each part inside its
// region and no two peers' parts overlapping.
TEST(EpParams, RoutesToOtherNodesAreThisRanksProxyAreasAndWords) {
  for (auto [world, per_node] : {std::pair{2, 1}, std::pair{4, 2}, std::pair{8, 2}}) {
    const std::vector<Rank> ranks = make_ranks(world, per_node);
    for (const Rank& k : ranks) {
      const device::Params& p = k.params;
      const ProxyLayout& pl = k.proxy_layout;
      const uint8_t* control = k.memory.proxy_control;
      const uint8_t* data = k.memory.proxy_data;
      std::set<const void*> seen;
      for (int d : remote_peers(k.config.rank, world, per_node)) {
        const int i = remote_index(k.config.rank, d, per_node);
        SCOPED_TRACE("rank " + std::to_string(k.config.rank) + " to rank " + std::to_string(d));
        EXPECT_EQ(p.dispatch_dst[d], data + pl.dispatch_send(i));
        EXPECT_EQ(p.dispatch_src[d], data + pl.dispatch_recv(i));
        EXPECT_EQ(p.combine_dst[d], data + pl.combine_send(i));
        EXPECT_EQ(p.combine_src[d], data + pl.combine_recv(i));
        EXPECT_EQ(reinterpret_cast<const uint8_t*>(p.combine_ids_dst[d]),
                  control + pl.combine_ids_send(i));
        const std::pair<const uint64_t*, ProxyLayout::Word> words[] = {
            {p.dispatch_flag_out[d], ProxyLayout::kDispatchReady},
            {p.dispatch_flag_in[d], ProxyLayout::kDispatchFlag},
            {p.dispatch_ack_out[d], ProxyLayout::kDispatchDone},
            {p.dispatch_ack_in[d], ProxyLayout::kDispatchAck},
            {p.combine_flag_out[d], ProxyLayout::kCombineReady},
            {p.combine_flag_in[d], ProxyLayout::kCombineFlag},
            {p.combine_ack_out[d], ProxyLayout::kCombineDone},
            {p.combine_ack_in[d], ProxyLayout::kCombineAck}};
        for (auto [word, w] : words) {
          EXPECT_EQ(reinterpret_cast<const uint8_t*>(word),
                    control + ProxyLayout::word_offset(w, d));
          EXPECT_TRUE(seen.insert(word).second);
        }
        // The areas: inside the data region, one per peer and kind.
        const std::pair<const uint8_t*, uint64_t> areas[] = {
            {p.dispatch_dst[d], pl.dispatch_area_bytes},
            {p.dispatch_src[d], pl.dispatch_area_bytes},
            {p.combine_dst[d], pl.combine_area_bytes},
            {p.combine_src[d], pl.combine_area_bytes}};
        for (auto [area, bytes] : areas) {
          EXPECT_GE(area, data);
          EXPECT_LE(area + bytes, data + pl.data_bytes);
          EXPECT_TRUE(seen.insert(area).second);
        }
      }
    }
  }
}

// Before connect() (no peers mapped), or in a double that plays only the proxy's side, the ranks
// of this node get no routes; this rank's own route is its buffer.
TEST(EpParams, PeersNotMappedGetNoRoutes) {
  const AllToAllConfig c = config_of(1, 4, 2);
  const Layouts ls = layouts_of(c);
  const Layout* l = &ls.layout;
  const ProxyLayout* pl = &ls.proxy;
  HostRegion buffer(l->buffer_bytes), control(pl->control_bytes), data(pl->data_bytes);
  KernelMemory m;
  m.buffer = reinterpret_cast<uint8_t*>(buffer.at);
  m.proxy_control = reinterpret_cast<uint8_t*>(control.at);
  m.proxy_data = reinterpret_cast<uint8_t*>(data.at);
  device::Params p = kernel_params(c, *l, *pl, m, 1);
  EXPECT_EQ(p.state, nullptr);  // no scratch given
  route_peers(p, c, *l, *pl, m);
  EXPECT_EQ(p.dispatch_dst[0], nullptr);  // rank 0: this node, not mapped
  EXPECT_EQ(p.dispatch_dst[1], m.buffer + l->dispatch_entry(1, 0));
  EXPECT_NE(p.dispatch_dst[2], nullptr);  // ranks 2 and 3: the proxy's areas
  EXPECT_NE(p.dispatch_dst[3], nullptr);
}

TEST(EpParams, TheErrorReportReadsAsTheFirstFailure) {
  AllToAllConfig c = config_of(3, 4, 2);
  c.timeout = std::chrono::milliseconds(250);
  device::ErrorReport r{};
  EXPECT_TRUE(gpu_failure(r, c));

  r.kind = device::kTimedOut;
  r.half = device::kDispatchRecv;
  r.peer = 1;
  r.round = 7;
  r.seen = (6ull << 32) | 5;  // a receive's flag: the round in the high half
  Status s = gpu_failure(r, c);
  EXPECT_EQ(s.code(), ErrorCode::kTimeout);
  for (const char* w : {"dispatch_recv on rank 3", "more than 250 ms", "rank 1's dispatched tokens",
                        "round 7", "at round 6", "cannot be used again"}) {
    EXPECT_NE(s.message().find(w), std::string::npos) << w << ": " << s.to_string();
  }
  r.half = device::kCombineSend;
  r.seen = 6;  // an acknowledgement: the round in the low half
  s = gpu_failure(r, c);
  EXPECT_NE(s.message().find("combine_send"), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("acknowledgement of the previous round's combine"), std::string::npos);
  EXPECT_NE(s.message().find("at round 6"), std::string::npos) << s.to_string();

  r = {};
  r.kind = device::kBadExpert;
  r.half = device::kDispatchSend;
  r.peer = 9;  // the token
  r.round = 2;
  r.seen = 77;   // the index
  r.detail = 3;  // the top-k slot
  s = gpu_failure(r, c);
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  for (const char* w : {"dispatch_send on rank 3, round 2", "expert index 77 of token 9", "slot 3",
                        "num_experts 8"}) {
    EXPECT_NE(s.message().find(w), std::string::npos) << w << ": " << s.to_string();
  }

  r.kind = 42;
  EXPECT_EQ(gpu_failure(r, c).code(), ErrorCode::kInternal);
}

// FakeGpu, the proxy tests' double for the kernels, finds its areas and words through these
// routes; over a FakeDeviceBuffer data region it addresses the second mapping, as the kernels
// address a device mapping, while the proxy registers the device address.
TEST(EpParams, FakeGpuUsesTheRoutes) {
  const AllToAllConfig c = config_of(0, 2, 1);
  const Layouts ls = layouts_of(c);
  const Layout* l = &ls.layout;
  const ProxyLayout* pl = &ls.proxy;
  HostRegion control(pl->control_bytes);
  auto device = fabric::testing::FakeDeviceBuffer::create(pl->data_bytes);
  ASSERT_TRUE(device) << device.status().to_string();
  std::byte* gpu_view = (*device)->contents().data();
  testing::FakeGpu gpu(c, *l, *pl, control.at, gpu_view);
  const auto* data = reinterpret_cast<const uint8_t*>(gpu_view);
  EXPECT_EQ(gpu.params().dispatch_dst[1], data + pl->dispatch_send(0));
  EXPECT_EQ(gpu.params().combine_src[1], data + pl->combine_recv(0));
  EXPECT_EQ(reinterpret_cast<const std::byte*>(gpu.params().dispatch_flag_out[1]),
            control.at + ProxyLayout::word_offset(ProxyLayout::kDispatchReady, 1));
}

}  // namespace
}  // namespace fabric::ep
