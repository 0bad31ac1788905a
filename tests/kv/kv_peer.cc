// The other process of the KV member tests: one prefill or decode rank over its own engine,
// driven by line commands on stdin (replies on stdout):
//   prefill TP RANK PAGES              become prefill rank RANK of TP (PAGES pages per layer)
//   decode TP RANK PAGES               become decode rank RANK of TP
//   serve ID NPAGES DECODE_TP DELAY_MS prefill: pages 0..NPAGES-1 hold request ID; start it
//                                      and finish one layer every DELAY_MS
//                                      -> "finished ID CODE" when the prefill side ends
//   pull ID NPAGES ADDR_HEX...         decode: pull request ID from these prefill ranks
//                                      -> "ready ID ok|corrupt" or "error ID CODE"
//   etcd ENDPOINT NAME                 join an etcd registry (lease TTL 1 s) as member NAME
//   file DIRECTORY NAME                join a FileRegistry (lease TTL 1 s) as member NAME
//   quit
// Arguments as tests/support/peer_process.h passes them: PROVIDER REORDER(0|1) BUFFER_BYTES.
#include <iostream>
#include <mutex>
#include <sstream>
#include <thread>

#include "fabric/kv/registry.h"
#include "kv_test_support.h"

using namespace fabric;
using namespace fabric::kv;

namespace {

std::mutex out_mu;
void say(const std::string& line) {
  std::lock_guard lock(out_mu);
  std::cout << line << std::endl;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::cerr << "usage: fabric_kv_test_peer PROVIDER REORDER(0|1) BUFFER_BYTES\n";
    return 2;
  }
  fabric::testing::Backend backend{"peer", argv[1], std::string(argv[2]) == "1"};
  Config config = fabric::testing::make_config(backend);
  Options options;
  options.heartbeat = std::chrono::milliseconds(100);
  options.quarantine = std::chrono::milliseconds(300);
  std::unique_ptr<kv::testing::Rank> rank;
  std::unique_ptr<KvPrefiller> prefiller;
  std::unique_ptr<KvDecoder> decoder;
  std::vector<std::thread> threads;
  std::unique_ptr<Registry> registry;
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "prefill" || cmd == "decode") {
      uint32_t tp = 0, r = 0, pages = 0;
      in >> tp >> r >> pages;
      auto made = kv::testing::make_rank(config, kv::testing::test_layout(tp, r, pages));
      if (!made) {
        say("error " + made.status().to_string());
        return 1;
      }
      rank = std::move(*made);
      Status st;
      if (cmd == "prefill") {
        auto p = KvPrefiller::create(*rank->engine, rank->layout, rank->reg, options);
        st = p.status();
        if (p) prefiller = std::move(*p);
      } else {
        auto d = KvDecoder::create(*rank->engine, rank->layout, rank->reg, options);
        st = d.status();
        if (d) decoder = std::move(*d);
      }
      if (!st) {
        say("error " + st.to_string());
        return 1;
      }
      say("address " + rank->engine->address().to_hex());
    } else if (cmd == "serve" && prefiller) {
      RequestId id = 0;
      uint32_t n = 0, dtp = 0, delay = 0;
      in >> id >> n >> dtp >> delay;
      std::vector<uint32_t> pages(n);
      for (uint32_t i = 0; i < n; ++i) pages[i] = i;
      kv::testing::fill_request(rank->layout, rank->cache.data(), pages, id);
      Status st = prefiller->start(id, pages, dtp, [](RequestId id, const Status& s) {
        say("finished " + std::to_string(id) + " " + std::string(to_string(s.code())));
      });
      if (!st) {
        say("error " + st.to_string());
        continue;
      }
      say("serving " + std::to_string(id));
      threads.emplace_back([&prefiller, id, delay, layers = rank->layout.num_layers] {
        for (uint32_t l = 0; l < layers; ++l) {
          std::this_thread::sleep_for(std::chrono::milliseconds(delay));
          if (!prefiller->layer_done(id, l)) return;
        }
      });
    } else if (cmd == "pull" && decoder) {
      DecodeRequest rq;
      uint32_t n = 0;
      in >> rq.id >> n;
      rq.num_pages = n;
      for (std::string hex; in >> hex;) {
        auto a = Address::from_hex(hex);
        if (a) rq.prefill_ranks.push_back(*a);
      }
      const KvLayout layout = rank->layout;
      const std::byte* cache = rank->cache.data();
      rq.on_ready = [layout, cache](RequestId id, std::span<const uint32_t> pages) {
        bool ok =
            kv::testing::check_request(layout, cache, {pages.begin(), pages.end()}, id, nullptr);
        say("ready " + std::to_string(id) + (ok ? " ok" : " corrupt"));
      };
      rq.on_error = [](RequestId id, const Status& s) {
        say("error " + std::to_string(id) + " " + std::string(to_string(s.code())));
      };
      auto r = decoder->submit(std::move(rq));
      say(r ? "pulling" : "error " + r.status().to_string());
    } else if (cmd == "etcd" && rank) {
      EtcdOptions o;
      Member m;
      in >> o.endpoint >> m.name;
      o.lease_ttl = std::chrono::seconds(1);
      m.role = prefiller ? "prefill" : "decode";
      m.address = rank->engine->address().to_hex();
      auto r = EtcdRegistry::connect(o);
      Status st = r ? (*r)->join(m) : r.status();
      if (r) registry = std::move(*r);
      say(st ? "joined" : "error " + st.to_string());
    } else if (cmd == "file" && rank) {
      FileOptions o;
      Member m;
      in >> o.directory >> m.name;
      o.lease_ttl = std::chrono::seconds(1);
      m.role = prefiller ? "prefill" : "decode";
      m.address = rank->engine->address().to_hex();
      auto r = FileRegistry::open(o);
      Status st = r ? (*r)->join(m) : r.status();
      if (r) registry = std::move(*r);
      say(st ? "joined" : "error " + st.to_string());
    } else if (cmd == "quit") {
      break;
    } else {
      say("error unknown command: " + line);
    }
  }
  for (auto& t : threads) t.join();
  decoder.reset();
  prefiller.reset();
  return 0;
}
