// fabric-bench-ep-proxy: the host side of fabric::ep's inter-node path, timed without a GPU.
//
// `--world` ranks, each its own one-GPU node (every other rank a remote peer), each with a proxy
// (src/ep/proxy.h) on its own caller-driven engine over tcp or shm in this process, and a FakeGpu
// (tests/support/ep_fake_gpu.h, the test double for the kernels) on a thread of its own that runs
// the rounds: dispatch_send, dispatch_recv, combine_send, combine_recv. With --no-bytes the
// doubles stage and check no payload bytes (counts, slot ids and the combine map still), so what
// is timed is the proxies, their engines and the fabric; the writes still carry the counted bytes.
//
// Per kind, from rank 0's proxy counters read after every round (medians and p99 over rounds):
// the posting cost per peer (post_ns / rounds sent: the GPU's ready word seen to the peer's writes
// posted), writes per peer, posted-to-completed per peer, counts-to-flag per peer; and rank 0's
// round time (its send half called to its receive half returned). Reports numbers; asserts none.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ep/proxy.h"
#include "ep_fake_gpu.h"
#include "fabric/ep.h"

namespace {

using namespace fabric;
using namespace fabric::ep;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string provider = "shm";
  int world = 8;
  uint32_t rounds = 300;
  uint32_t warmup = 30;
  uint32_t hidden = 7168;
  uint32_t tokens = 128;
  uint32_t top_k = 8;
  uint32_t experts = 256;
  bool bf16 = false;
  bool no_bytes = false;
  uint64_t chunk_bytes = 1 << 20;
};

struct Rank {
  AllToAllConfig config;
  Layout layout;
  ProxyLayout proxy_layout;
  std::unique_ptr<ep::testing::HostRegion> control, data;
  std::unique_ptr<Proxy> proxy;
  std::unique_ptr<ep::testing::FakeGpu> gpu;
};

// Per round of rank 0, per kind (0 dispatch, 1 combine).
struct Sample {
  double post_us = 0, complete_us = 0, receive_us = 0, writes = 0, round_us = 0;
};

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())));
  return v[i];
}

int run(const Options& o) {
  std::vector<Rank> ranks(static_cast<size_t>(o.world));
  std::vector<Bytes> handles;
  ProxyOptions po;
  po.provider = o.provider;
  po.nics = {o.provider == "tcp" ? "lo" : "shm"};
  po.timeout = std::chrono::milliseconds(20000);
  po.chunk_bytes = o.chunk_bytes;
  for (int r = 0; r < o.world; ++r) {
    Rank& k = ranks[static_cast<size_t>(r)];
    k.config.rank = r;
    k.config.world_size = o.world;
    k.config.gpus_per_node = 1;
    k.config.num_experts = o.experts;
    k.config.hidden = o.hidden;
    k.config.top_k = o.top_k;
    k.config.max_tokens_per_rank = o.tokens;
    k.config.dtype = o.bf16 ? TokenDtype::kBf16 : TokenDtype::kFp8E4m3;
    k.config.timeout = std::chrono::milliseconds(20000);
    if (Status s = validate(k.config); !s) {
      std::fprintf(stderr, "configuration: %s\n", s.to_string().c_str());
      return 2;
    }
    auto l = Layout::of(k.config);
    if (!l) return std::fprintf(stderr, "%s\n", l.status().to_string().c_str()), 1;
    k.layout = *l;
    auto pl = ProxyLayout::of(k.config, k.layout);
    if (!pl) return std::fprintf(stderr, "%s\n", pl.status().to_string().c_str()), 1;
    k.proxy_layout = *pl;
    auto p = Proxy::create(
        k.config, k.layout, po, [&k](const ProxyLayout& layout, bool) -> Result<ProxyAreas> {
          k.control = std::make_unique<ep::testing::HostRegion>(layout.control_bytes);
          k.data = std::make_unique<ep::testing::HostRegion>(layout.data_bytes);
          return ProxyAreas{{k.control->at, layout.control_bytes}, {k.data->at, layout.data_bytes}};
        });
    if (!p) {
      std::fprintf(stderr, "rank %d's proxy: %s\n", r, p.status().to_string().c_str());
      return p.status().code() == ErrorCode::kUnsupported ? 3 : 1;
    }
    k.proxy = std::move(*p);
    k.gpu = std::make_unique<ep::testing::FakeGpu>(k.config, k.layout, k.proxy_layout,
                                                   k.control->at, k.data->at);
    if (o.no_bytes) k.gpu->skip_bytes();
    handles.push_back(k.proxy->handle());
  }
  for (Rank& k : ranks) {
    if (Status s = k.proxy->connect(handles); !s) {
      std::fprintf(stderr, "connect: %s\n", s.to_string().c_str());
      return 1;
    }
  }

  const uint32_t total = o.warmup + o.rounds;
  std::vector<std::array<Sample, 2>> samples;
  samples.reserve(total);
  std::vector<Status> results(ranks.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < ranks.size(); ++r) {
    threads.emplace_back([&, r] {
      ep::testing::FakeGpu& g = *ranks[r].gpu;
      ProxyStats before = ranks[r].proxy->stats();
      for (uint32_t round = 1; round <= total; ++round) {
        std::array<Sample, 2> s{};
        for (int kind = 0; kind < 2; ++kind) {
          const auto start = Clock::now();
          Status st = kind == 0 ? g.dispatch_send(round) : g.combine_send(round);
          if (st) st = kind == 0 ? g.dispatch_recv(round) : g.combine_recv(round);
          if (!st) {
            results[r] = Status(st.code(), fmt::format("round {}: {}", round, st.message()));
            return;
          }
          s[static_cast<size_t>(kind)].round_us =
              std::chrono::duration<double, std::micro>(Clock::now() - start).count();
        }
        if (r != 0) continue;
        const ProxyStats now = ranks[r].proxy->stats();
        for (int kind = 0; kind < 2; ++kind) {
          const double sent = static_cast<double>(now.rounds_sent[kind] - before.rounds_sent[kind]);
          const double got =
              static_cast<double>(now.rounds_received[kind] - before.rounds_received[kind]);
          Sample& x = s[static_cast<size_t>(kind)];
          if (sent > 0) {
            x.post_us = static_cast<double>(now.post_ns[kind] - before.post_ns[kind]) / sent / 1e3;
            x.complete_us =
                static_cast<double>(now.complete_ns[kind] - before.complete_ns[kind]) / sent / 1e3;
            x.writes = static_cast<double>(now.writes_sent[kind] - before.writes_sent[kind]) / sent;
          }
          if (got > 0) {
            x.receive_us =
                static_cast<double>(now.receive_ns[kind] - before.receive_ns[kind]) / got / 1e3;
          }
        }
        before = now;
        samples.push_back(s);
      }
    });
  }
  for (auto& t : threads) t.join();
  for (size_t r = 0; r < ranks.size(); ++r) {
    if (!results[r]) {
      std::fprintf(stderr, "rank %zu: %s (proxy: %s)\n", r, results[r].to_string().c_str(),
                   ranks[r].proxy->status().to_string().c_str());
      return 1;
    }
  }

  const Layout& l = ranks[0].layout;
  std::printf(
      "fabric-bench-ep-proxy: %s, %d ranks as one-GPU nodes (%d remote peers each), "
      "%u tokens, hidden %u %s, top-%u of %u experts, chunks of %llu B, %u rounds after "
      "%u%s\n",
      o.provider.c_str(), o.world, o.world - 1, o.tokens, o.hidden, o.bf16 ? "bf16" : "fp8",
      o.top_k, o.experts, static_cast<unsigned long long>(o.chunk_bytes), o.rounds, o.warmup,
      o.no_bytes ? ", payload bytes neither staged nor checked" : "");
  std::printf(
      "entry %llu B, combine row %llu B; rank 0's proxy, per peer and round (p50 / p99 "
      "over rounds)\n\n",
      static_cast<unsigned long long>(l.entry_bytes),
      static_cast<unsigned long long>(l.combine_row_bytes));
  std::printf(
      "| kind | writes/peer | post us/peer | posted->complete us | counts->flag us | "
      "round us (rank 0) |\n| --- | ---: | ---: | ---: | ---: | ---: |\n");
  for (int kind = 0; kind < 2; ++kind) {
    std::vector<double> post, complete, receive, writes, round;
    for (size_t i = o.warmup; i < samples.size(); ++i) {
      const Sample& x = samples[i][static_cast<size_t>(kind)];
      post.push_back(x.post_us);
      complete.push_back(x.complete_us);
      receive.push_back(x.receive_us);
      writes.push_back(x.writes);
      round.push_back(x.round_us);
    }
    std::printf("| %s | %.2f | %.2f / %.2f | %.1f / %.1f | %.1f / %.1f | %.0f / %.0f |\n",
                kind == 0 ? "dispatch" : "combine", percentile(writes, 0.5), percentile(post, 0.5),
                percentile(post, 0.99), percentile(complete, 0.5), percentile(complete, 0.99),
                percentile(receive, 0.5), percentile(receive, 0.99), percentile(round, 0.5),
                percentile(round, 0.99));
  }
  const ProxyStats st = ranks[0].proxy->stats();
  std::printf("\nrank 0's proxy: %llu passes, %llu naps\n",
              static_cast<unsigned long long>(st.passes), static_cast<unsigned long long>(st.naps));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"fabric-bench-ep-proxy: fabric::ep's inter-node proxies timed without a GPU"};
  app.add_option("--provider", o.provider, "tcp or shm")->check(CLI::IsMember({"tcp", "shm"}));
  app.add_option("--world", o.world, "ranks, each its own node")->check(CLI::Range(2, 32));
  app.add_option("--rounds", o.rounds, "rounds timed")->check(CLI::Range(1, 100000));
  app.add_option("--warmup", o.warmup, "rounds run first, not timed");
  app.add_option("--hidden", o.hidden, "token elements");
  app.add_option("--tokens", o.tokens, "max_tokens_per_rank");
  app.add_option("--top-k", o.top_k, "experts per token");
  app.add_option("--experts", o.experts, "experts in all (a multiple of --world)");
  app.add_flag("--bf16", o.bf16, "bf16 dispatch (default fp8 with block scales)");
  app.add_flag("--no-bytes", o.no_bytes,
               "the doubles neither stage nor check payload bytes (the proxy is what is timed)");
  app.add_option("--chunk-bytes", o.chunk_bytes, "ProxyOptions::chunk_bytes");
  CLI11_PARSE(app, argc, argv);
  return run(o);
}
