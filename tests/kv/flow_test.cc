// The KV flow between decoder and prefiller ranks in one process, over every provider present:
// byte-exact pages for same and mixed TP sizes, many requests in flight, cancellation at every
// stage from either side.
#include <gtest/gtest.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <numeric>

#include "kv_test_support.h"

namespace fabric::kv {
namespace {

using namespace std::chrono_literals;
using fabric::testing::Backend;
using testing::check_request;
using testing::fill_request;
using testing::make_rank;
using testing::Rank;
using testing::test_layout;

// What the callbacks of many requests reported, per (request, rank); each may end only once.
class Events {
 public:
  DecodeRequest request(RequestId id, uint32_t rank, std::vector<Address> prefill, uint32_t pages) {
    DecodeRequest r;
    r.id = id;
    r.num_pages = pages;
    r.prefill_ranks = std::move(prefill);
    r.on_ready = [this, rank](RequestId id, std::span<const uint32_t>) {
      end(decoded_, id, rank, Status::ok());
    };
    r.on_error = [this, rank](RequestId id, const Status& s) { end(decoded_, id, rank, s); };
    return r;
  }
  KvPrefiller::FinishedFn finished(uint32_t rank) {
    return [this, rank](RequestId id, const Status& s) { end(finished_, id, rank, s); };
  }
  void set_ranks(size_t decode, size_t prefill) {
    decode_ranks_ = decode;
    prefill_ranks_ = prefill;
  }
  // The decode outcome of id on every decode rank (the first error, if any), or kTimeout.
  Status decoded(RequestId id, std::chrono::milliseconds timeout = 20s) {
    return wait(decoded_, id, decode_ranks_, timeout);
  }
  Status prefilled(RequestId id, std::chrono::milliseconds timeout = 20s) {
    return wait(finished_, id, prefill_ranks_, timeout);
  }
  bool has_decoded(RequestId id) {
    std::lock_guard lock(mu_);
    return decoded_.count(id) > 0;
  }

 private:
  using Outcomes = std::map<RequestId, std::map<uint32_t, Status>>;
  void end(Outcomes& o, RequestId id, uint32_t rank, const Status& s) {
    std::lock_guard lock(mu_);
    EXPECT_EQ(o[id].count(rank), 0u) << "request " << id << " rank " << rank << " ended twice";
    o[id][rank] = s;
    cv_.notify_all();
  }
  Status wait(Outcomes& o, RequestId id, size_t ranks, std::chrono::milliseconds timeout) {
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return o.count(id) && o[id].size() >= ranks; })) {
      return Status(ErrorCode::kTimeout, "request " + std::to_string(id) + " never ended");
    }
    for (auto& [rank, s] : o[id]) {
      if (!s.is_ok()) return s;
    }
    return Status::ok();
  }

  std::mutex mu_;
  std::condition_variable cv_;
  size_t decode_ranks_ = 1, prefill_ranks_ = 1;
  Outcomes decoded_, finished_;
};

// A prefill instance of TP `ptp` and a decode instance of TP `dtp`, each rank its own engine.
class KvFlow : public ::testing::TestWithParam<Backend> {
 protected:
  void build(uint32_t ptp, uint32_t dtp, uint32_t prefill_pages = 8, uint32_t decode_pages = 8) {
    Config c = fabric::testing::make_config(GetParam());
    // Six engines on two cores under a sanitizer can starve a worker for seconds: no rank dies
    // in these tests, so give the dead-peer watchdog room.
    c.peer_timeout = std::chrono::milliseconds(15000);
    for (uint32_t r = 0; r < ptp; ++r) {
      auto rank = make_rank(c, test_layout(ptp, r, prefill_pages));
      if (!rank && rank.status().code() == ErrorCode::kUnsupported) {
        GTEST_SKIP() << "provider not available here: " << rank.status().to_string();
      }
      ASSERT_TRUE(rank) << rank.status().to_string();
      auto p = KvPrefiller::create(*(*rank)->engine, (*rank)->layout, (*rank)->reg, options_);
      ASSERT_TRUE(p) << p.status().to_string();
      prefill_addresses_.push_back((*rank)->engine->address());
      prefill_.push_back(std::move(*rank));
      prefillers_.push_back(std::move(*p));
    }
    for (uint32_t r = 0; r < dtp; ++r) {
      auto rank = make_rank(c, test_layout(dtp, r, decode_pages));
      ASSERT_TRUE(rank) << rank.status().to_string();
      auto d = KvDecoder::create(*(*rank)->engine, (*rank)->layout, (*rank)->reg, options_);
      ASSERT_TRUE(d) << d.status().to_string();
      decode_.push_back(std::move(*rank));
      decoders_.push_back(std::move(*d));
    }
    events_.set_ranks(dtp, ptp);
  }
  void TearDown() override {
    decoders_.clear();
    prefillers_.clear();
  }
  // Every prefill rank holds request `seed` in `pages` and starts it.
  void start_prefill(RequestId id, const std::vector<uint32_t>& pages) {
    for (size_t r = 0; r < prefill_.size(); ++r) {
      fill_request(prefill_[r]->layout, prefill_[r]->cache.data(), pages, id);
      ASSERT_TRUE(
          prefillers_[r]->start(id, pages, static_cast<uint32_t>(decoders_.size()),
                                events_.finished(static_cast<uint32_t>(r)),
                                [this](RequestId, uint32_t, uint32_t) { ++layer_events_; }));
    }
  }
  void layers(RequestId id, uint32_t from, uint32_t to) {
    for (uint32_t l = from; l < to; ++l)
      for (auto& p : prefillers_) ASSERT_TRUE(p->layer_done(id, l));
  }
  // Every decode rank submits request id (its own pages from its pool).
  std::vector<std::vector<uint32_t>> submit_decode(RequestId id, uint32_t pages) {
    std::vector<std::vector<uint32_t>> out;
    for (auto& d : decoders_) {
      auto r = d->submit(events_.request(id, d->layout().tp_rank, prefill_addresses_, pages));
      EXPECT_TRUE(r) << r.status().to_string();
      out.push_back(r ? *r : std::vector<uint32_t>{});
    }
    return out;
  }
  void expect_bytes(RequestId id, const std::vector<std::vector<uint32_t>>& pages) {
    for (size_t r = 0; r < decode_.size(); ++r) {
      std::string where;
      EXPECT_TRUE(check_request(decode_[r]->layout, decode_[r]->cache.data(), pages[r], id, &where))
          << "request " << id << " decode rank " << r << ": first wrong byte at " << where;
    }
  }
  // A full request from prefill pages `src` into freshly reserved decode pages; checks bytes.
  void run_request(RequestId id, const std::vector<uint32_t>& src) {
    start_prefill(id, src);
    auto pages = submit_decode(id, static_cast<uint32_t>(src.size()));
    layers(id, 0, 4);
    ASSERT_TRUE(events_.decoded(id)) << events_.decoded(id).to_string();
    ASSERT_TRUE(events_.prefilled(id)) << events_.prefilled(id).to_string();
    expect_bytes(id, pages);
  }

  Options options_ = [] {
    Options o;
    o.heartbeat = 100ms;
    o.quarantine = 300ms;
    o.pull_timeout = 5000ms;
    return o;
  }();
  Events events_;
  std::atomic<int> layer_events_{0};
  std::vector<std::unique_ptr<Rank>> prefill_, decode_;
  std::vector<Address> prefill_addresses_;
  std::vector<std::unique_ptr<KvPrefiller>> prefillers_;
  std::vector<std::unique_ptr<KvDecoder>> decoders_;
};

// Handshakes and edge cases, on fewer backends.
class KvFlowEdges : public KvFlow {};

TEST_P(KvFlow, SameTpPagesByteExact) {
  build(2, 2);
  if (IsSkipped()) return;
  run_request(7, {5, 1, 6});
  for (auto& d : decoders_) {
    EXPECT_EQ(d->live_requests(), 0u);
    EXPECT_EQ(d->free_pages(), 5u);
    EXPECT_TRUE(d->release(7));
    EXPECT_EQ(d->free_pages(), 8u);
    EXPECT_EQ(d->release(7).code(), ErrorCode::kNotFound);
  }
}

TEST_P(KvFlow, Tp2IntoTp4ByteExact) {
  build(2, 4);
  if (IsSkipped()) return;
  run_request(11, {0, 7, 3, 2});
  // Each of the 2 prefill ranks wrote 4 layers into each of its 2 decode ranks.
  EXPECT_EQ(layer_events_.load(), 16);
}

TEST_P(KvFlow, Tp4IntoTp2ByteExact) {
  build(4, 2);
  if (IsSkipped()) return;
  run_request(12, {4, 6});
}

TEST_P(KvFlowEdges, PullBeforeStartAndLayersBeforePull) {
  build(1, 1);
  if (IsSkipped()) return;
  // The decoder asks first; the prefiller starts later.
  auto pages = submit_decode(1, 2);
  std::this_thread::sleep_for(50ms);
  start_prefill(1, {3, 4});
  layers(1, 0, 4);
  ASSERT_TRUE(events_.decoded(1));
  expect_bytes(1, pages);
  // Layers computed before the decoder asks are written when it does.
  start_prefill(2, {0, 1});
  layers(2, 0, 3);
  auto pages2 = submit_decode(2, 2);
  std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(events_.has_decoded(2));
  layers(2, 3, 4);
  ASSERT_TRUE(events_.decoded(2));
  expect_bytes(2, pages2);
}

TEST_P(KvFlow, ManyRequestsInFlight) {
  constexpr uint32_t kRequests = 32;
  build(1, 1, /*prefill_pages=*/2 * kRequests, /*decode_pages=*/2 * kRequests);
  if (IsSkipped()) return;
  std::vector<std::vector<std::vector<uint32_t>>> pages(kRequests);
  for (uint32_t i = 0; i < kRequests; ++i) {
    start_prefill(100 + i, {2 * i + 1, 2 * i});
    pages[i] = submit_decode(100 + i, 2);
  }
  // Layers finish interleaved across requests.
  for (uint32_t l = 0; l < 4; ++l)
    for (uint32_t i = 0; i < kRequests; ++i) layers(100 + i, l, l + 1);
  for (uint32_t i = 0; i < kRequests; ++i) {
    ASSERT_TRUE(events_.decoded(100 + i)) << events_.decoded(100 + i).to_string();
    ASSERT_TRUE(events_.prefilled(100 + i));
    expect_bytes(100 + i, pages[i]);
  }
  EXPECT_EQ(decoders_[0]->live_requests(), 0u);
  EXPECT_EQ(prefillers_[0]->live_requests(), 0u);
}

TEST_P(KvFlowEdges, DecoderCancelsBeforePrefillStarts) {
  build(1, 1, 8, 2);
  if (IsSkipped()) return;
  submit_decode(1, 2);
  EXPECT_EQ(decoders_[0]->free_pages(), 0u);
  ASSERT_TRUE(decoders_[0]->cancel(1));
  EXPECT_EQ(events_.decoded(1).code(), ErrorCode::kCancelled);
  EXPECT_EQ(decoders_[0]->free_pages(), 2u);
  EXPECT_EQ(decoders_[0]->cancel(1).code(), ErrorCode::kNotFound);
  // The prefiller learns of it when it starts: nothing is written.
  start_prefill(1, {0, 1});
  EXPECT_EQ(events_.prefilled(1).code(), ErrorCode::kCancelled);
  // The pages serve the next request untouched by the first.
  run_request(2, {2, 3});
}

TEST_P(KvFlowEdges, DecoderCancelsMidLayers) {
  build(2, 2, 8, 2);
  if (IsSkipped()) return;
  start_prefill(1, {0, 1});
  auto pages = submit_decode(1, 2);
  layers(1, 0, 2);
  for (auto& d : decoders_) ASSERT_TRUE(d->cancel(1));
  EXPECT_EQ(events_.decoded(1).code(), ErrorCode::kCancelled);
  EXPECT_EQ(events_.prefilled(1).code(), ErrorCode::kCancelled);
  for (auto& d : decoders_) EXPECT_EQ(d->free_pages(), 2u);
  // Layers computed after the cancel are not written (the request is gone on both sides).
  for (auto& p : prefillers_) EXPECT_EQ(p->layer_done(1, 2).code(), ErrorCode::kNotFound);
  run_request(2, {4, 5});
}

TEST_P(KvFlowEdges, PrefillerCancelsMidLayers) {
  build(1, 2, 8, 2);
  if (IsSkipped()) return;
  start_prefill(1, {0, 1});
  submit_decode(1, 2);
  layers(1, 0, 1);
  ASSERT_TRUE(prefillers_[0]->cancel(1));
  EXPECT_EQ(events_.prefilled(1).code(), ErrorCode::kCancelled);
  EXPECT_EQ(events_.decoded(1).code(), ErrorCode::kCancelled);
  for (auto& d : decoders_) EXPECT_EQ(d->free_pages(), 2u);
  run_request(2, {2, 3});
}

TEST_P(KvFlowEdges, PrefillerCancelsBeforePull) {
  build(1, 1, 8, 2);
  if (IsSkipped()) return;
  start_prefill(1, {0, 1});
  layers(1, 0, 2);
  ASSERT_TRUE(prefillers_[0]->cancel(1));
  EXPECT_EQ(events_.prefilled(1).code(), ErrorCode::kCancelled);
  submit_decode(1, 2);
  EXPECT_EQ(events_.decoded(1).code(), ErrorCode::kCancelled);
  EXPECT_EQ(decoders_[0]->free_pages(), 2u);
  run_request(2, {2, 3});
}

TEST_P(KvFlowEdges, MismatchedPrefillTpIsRefused) {
  build(2, 1);
  if (IsSkipped()) return;
  start_prefill(1, {0, 1});
  // The decoder believes the prefill instance is TP1 (one address): rank 0 refuses the pull.
  auto r = decoders_[0]->submit(events_.request(1, 0, {prefill_addresses_[0]}, 2));
  ASSERT_TRUE(r);
  Status s = events_.decoded(1);
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("prefill TP"), std::string::npos) << s.to_string();
  EXPECT_EQ(decoders_[0]->free_pages(), 8u);
}

TEST_P(KvFlowEdges, CancelAfterReadyIsNotFound) {
  build(1, 1);
  if (IsSkipped()) return;
  run_request(1, {0});
  EXPECT_EQ(decoders_[0]->cancel(1).code(), ErrorCode::kNotFound);
  EXPECT_EQ(prefillers_[0]->cancel(1).code(), ErrorCode::kNotFound);
}

TEST_P(KvFlowEdges, RejectsBadInput) {
  build(2, 1);
  if (IsSkipped()) return;
  DecodeRequest r = events_.request(1, 0, {}, 2);
  EXPECT_EQ(decoders_[0]->submit(r).status().code(), ErrorCode::kInvalidArgument);
  r = events_.request(1, 0, {prefill_addresses_[0], prefill_addresses_[0], prefill_addresses_[0]},
                      2);
  EXPECT_EQ(decoders_[0]->submit(r).status().code(), ErrorCode::kInvalidArgument);
  r = events_.request(1, 0, prefill_addresses_, 9);
  EXPECT_EQ(decoders_[0]->submit(r).status().code(), ErrorCode::kOutOfRange);
  r = events_.request(1, 0, prefill_addresses_, 0);
  r.pages = {8};
  auto bad_page = decoders_[0]->submit(r);
  EXPECT_EQ(bad_page.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(bad_page.status().message().find("page 8"), std::string::npos);
  EXPECT_EQ(prefillers_[0]->start(1, {}, 1, nullptr).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(prefillers_[0]->start(1, {0}, 3, nullptr).code(), ErrorCode::kInvalidArgument);
  ASSERT_TRUE(prefillers_[0]->start(1, {0}, 1, nullptr));
  EXPECT_EQ(prefillers_[0]->start(1, {0}, 1, nullptr).code(), ErrorCode::kAlreadyExists);
  EXPECT_EQ(prefillers_[0]->layer_done(1, 4).code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(prefillers_[0]->layer_done(2, 0).code(), ErrorCode::kNotFound);
  std::vector<std::byte> small(64);
  auto reg = prefill_[0]->engine->register_memory(small.data(), small.size());
  ASSERT_TRUE(reg);
  EXPECT_EQ(KvDecoder::create(*prefill_[0]->engine, test_layout(1, 0), *reg).status().code(),
            ErrorCode::kInvalidArgument);
  // The engine's receive handler is taken by the prefiller already.
  EXPECT_EQ(
      KvDecoder::create(*prefill_[0]->engine, test_layout(2, 0), prefill_[0]->reg).status().code(),
      ErrorCode::kAlreadyExists);
}

// Plain shm is covered by the edge cases below and, reordered, here (CI time).
INSTANTIATE_TEST_SUITE_P(Backends, KvFlow,
                         ::testing::Values(Backend{"tcp", "tcp", false},
                                           Backend{"tcp_reorder", "tcp", true},
                                           Backend{"shm_reorder", "shm", true}),
                         fabric::testing::backend_name);

// Ordering and cancellation: on the reordering tcp and on plain shm (CI time).
INSTANTIATE_TEST_SUITE_P(Backends, KvFlowEdges,
                         ::testing::Values(Backend{"tcp_reorder", "tcp", true},
                                           Backend{"shm", "shm", false}),
                         fabric::testing::backend_name);

}  // namespace
}  // namespace fabric::kv
