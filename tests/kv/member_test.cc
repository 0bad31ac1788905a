// A member killed mid-transfer (a separate process, SIGKILL): its requests fail within a
// bounded time on the survivor, which frees what it held and keeps serving everyone else.
// tcp only: shm can wedge later writes inside the provider when a peer dies mid-write
// (docs/engine.md).
#include <gtest/gtest.h>

#include <future>
#include <thread>

#include "kv_test_support.h"
#include "peer_process.h"

namespace fabric::kv {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

const fabric::testing::Backend kTcp{"tcp", "tcp", false};

Options test_options() {
  Options o;
  o.heartbeat = 100ms;
  o.quarantine = 300ms;
  o.pull_timeout = 5000ms;
  return o;
}

struct Local {
  std::unique_ptr<testing::Rank> rank;
  std::unique_ptr<KvPrefiller> prefiller;
  std::unique_ptr<KvDecoder> decoder;
};

std::unique_ptr<Local> local(bool prefill) {
  auto l = std::make_unique<Local>();
  Config c = fabric::testing::make_config(kTcp);
  c.peer_timeout = 1000ms;  // how soon the engine gives up on a dead peer
  auto r = testing::make_rank(c, testing::test_layout(1, 0));
  EXPECT_TRUE(r) << r.status().to_string();
  if (!r) return nullptr;
  l->rank = std::move(*r);
  if (prefill) {
    auto p = KvPrefiller::create(*l->rank->engine, l->rank->layout, l->rank->reg, test_options());
    EXPECT_TRUE(p);
    l->prefiller = std::move(*p);
  } else {
    auto d = KvDecoder::create(*l->rank->engine, l->rank->layout, l->rank->reg, test_options());
    EXPECT_TRUE(d);
    l->decoder = std::move(*d);
  }
  return l;
}

// Layers of request `id` finished one every `delay` on a thread.
std::thread slow_layers(KvPrefiller& p, RequestId id, std::chrono::milliseconds delay) {
  return std::thread([&p, id, delay] {
    for (uint32_t l = 0; l < 4; ++l) {
      std::this_thread::sleep_for(delay);
      if (!p.layer_done(id, l)) return;
    }
  });
}

TEST(KvMember, PrefillerKilledMidTransfer) {
  fabric::testing::PeerProcess child;
  ASSERT_TRUE(child.start(kTcp, 0));
  child.send("prefill 1 0 8");
  auto child_address = Address::from_hex(child.read_value("address"));
  ASSERT_TRUE(child_address);
  auto dec = local(false);
  auto pre = local(true);
  ASSERT_TRUE(dec && pre);

  std::promise<Status> dead_request, live_request;
  auto dead_done = dead_request.get_future(), live_done = live_request.get_future();
  auto request = [&](RequestId id, Address from, std::promise<Status>& outcome) {
    DecodeRequest rq;
    rq.id = id;
    rq.num_pages = 2;
    rq.prefill_ranks = {std::move(from)};
    rq.on_ready = [&outcome, &dec](RequestId id, std::span<const uint32_t> pages) {
      std::string where;
      bool ok = testing::check_request(dec->rank->layout, dec->rank->cache.data(),
                                       {pages.begin(), pages.end()}, id, &where);
      outcome.set_value(ok ? Status::ok() : Status(ErrorCode::kInternal, "corrupt at " + where));
    };
    rq.on_error = [&outcome](RequestId, const Status& s) { outcome.set_value(s); };
    return rq;
  };
  // Request 1 from the child (a layer every 200 ms), request 2 from the local prefiller.
  ASSERT_TRUE(dec->decoder->submit(request(1, *child_address, dead_request)));
  ASSERT_TRUE(dec->decoder->submit(request(2, pre->rank->engine->address(), live_request)));
  child.send("serve 1 2 1 200");
  ASSERT_EQ(child.read_line(), "serving 1");
  testing::fill_request(pre->rank->layout, pre->rank->cache.data(), {0, 1}, 2);
  ASSERT_TRUE(pre->prefiller->start(2, {0, 1}, 1, nullptr));
  std::thread layers = slow_layers(*pre->prefiller, 2, 250ms);

  std::this_thread::sleep_for(450ms);  // the child has written one or two layers
  child.kill_now();
  const auto killed = Clock::now();
  ASSERT_EQ(dead_done.wait_for(15s), std::future_status::ready) << "no error for request 1";
  const auto waited = Clock::now() - killed;
  Status dead = dead_done.get();
  EXPECT_EQ(dead.code(), ErrorCode::kPeerUnreachable) << dead.to_string();
  // Bound: the engine's peer_timeout (1 s here) plus a heartbeat, with slack for a busy machine.
  EXPECT_LT(waited, 3s * fabric::testing::kSlowdown);
  ASSERT_EQ(live_done.wait_for(15s), std::future_status::ready) << "request 2 never ended";
  EXPECT_TRUE(live_done.get());
  layers.join();
  // Request 1's pages come back after the quarantine; request 2 still holds its own.
  for (int i = 0; i < 50 && dec->decoder->free_pages() != 6; ++i) std::this_thread::sleep_for(20ms);
  EXPECT_EQ(dec->decoder->free_pages(), 6u);
  EXPECT_TRUE(dec->decoder->release(2));
  EXPECT_EQ(dec->decoder->live_requests(), 0u);
}

TEST(KvMember, DecoderKilledMidTransfer) {
  fabric::testing::PeerProcess child;
  ASSERT_TRUE(child.start(kTcp, 0));
  child.send("decode 1 0 8");
  auto child_address = Address::from_hex(child.read_value("address"));
  ASSERT_TRUE(child_address);
  auto pre = local(true);
  auto dec = local(false);
  ASSERT_TRUE(dec && pre);

  std::promise<Status> p1, p2, d2;
  auto f1 = p1.get_future(), f2 = p2.get_future(), fd2 = d2.get_future();
  testing::fill_request(pre->rank->layout, pre->rank->cache.data(), {0, 1}, 1);
  testing::fill_request(pre->rank->layout, pre->rank->cache.data(), {2, 3}, 2);
  ASSERT_TRUE(
      pre->prefiller->start(1, {0, 1}, 1, [&](RequestId, const Status& s) { p1.set_value(s); }));
  ASSERT_TRUE(
      pre->prefiller->start(2, {2, 3}, 1, [&](RequestId, const Status& s) { p2.set_value(s); }));
  child.send("pull 1 2 " + pre->rank->engine->address().to_hex());
  ASSERT_EQ(child.read_line(), "pulling");
  DecodeRequest rq;
  rq.id = 2;
  rq.num_pages = 2;
  rq.prefill_ranks = {pre->rank->engine->address()};
  rq.on_ready = [&](RequestId id, std::span<const uint32_t> pages) {
    bool ok = testing::check_request(dec->rank->layout, dec->rank->cache.data(),
                                     {pages.begin(), pages.end()}, id, nullptr);
    d2.set_value(ok ? Status::ok() : Status(ErrorCode::kInternal, "corrupt"));
  };
  rq.on_error = [&](RequestId, const Status& s) { d2.set_value(s); };
  ASSERT_TRUE(dec->decoder->submit(std::move(rq)));
  std::thread l1 = slow_layers(*pre->prefiller, 1, 200ms);
  std::thread l2 = slow_layers(*pre->prefiller, 2, 200ms);

  std::this_thread::sleep_for(300ms);  // one layer of request 1 went to the child
  child.kill_now();
  const auto killed = Clock::now();
  ASSERT_EQ(f1.wait_for(15s), std::future_status::ready) << "no end for the dead decoder's pull";
  EXPECT_LT(Clock::now() - killed, 3s * fabric::testing::kSlowdown);
  Status s1 = f1.get();
  EXPECT_FALSE(s1.is_ok());
  ASSERT_EQ(f2.wait_for(15s), std::future_status::ready);
  EXPECT_TRUE(f2.get());
  ASSERT_EQ(fd2.wait_for(15s), std::future_status::ready);
  EXPECT_TRUE(fd2.get());
  l1.join();
  l2.join();
  EXPECT_EQ(pre->prefiller->live_requests(), 0u);
}

}  // namespace
}  // namespace fabric::kv
