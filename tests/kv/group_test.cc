// DecodeGroup: one callback for a decode TP group (TP4 here, fed by a TP2 prefill instance)
// over shm with reordering: every rank's pages byte-exact in one on_ready; a failure on one
// rank cancels the others and releases the ready ones before one on_error; bad input.
#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>

#include "fabric/kv/group.h"
#include "kv_test_support.h"

namespace fabric::kv {
namespace {

using namespace std::chrono_literals;
using testing::make_rank;
using testing::Rank;
using testing::test_layout;

// The ranks, their engines and the group are shared by the suite (request ids differ per test):
// six engines cost more to open and close than the tests take.
class KvGroup : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    world_ = new KvGroup::World;
    world_->init();
  }
  static void TearDownTestSuite() {
    delete world_;
    world_ = nullptr;
  }
  void SetUp() override { ASSERT_TRUE(world_->group_) << "the ranks did not come up"; }

  struct World {
    void init();
    std::vector<std::unique_ptr<Rank>> prefill_, decode_;
    std::vector<std::unique_ptr<KvPrefiller>> prefillers_;
    std::vector<std::unique_ptr<KvDecoder>> decoders_;
    std::unique_ptr<DecodeGroup> group_;
  };
  static World* world_;
  std::vector<std::unique_ptr<Rank>>& prefill_ = world_->prefill_;
  std::vector<std::unique_ptr<Rank>>& decode_ = world_->decode_;
  std::vector<std::unique_ptr<KvPrefiller>>& prefillers_ = world_->prefillers_;
  std::vector<std::unique_ptr<KvDecoder>>& decoders_ = world_->decoders_;
  std::unique_ptr<DecodeGroup>& group_ = world_->group_;

  // Starts request `id` (2 pages) on both prefill ranks and submits it to the group.
  void submit(RequestId id) {
    const std::vector<uint32_t> src = {uint32_t(2 * (id % 4)), uint32_t(2 * (id % 4) + 1)};
    for (size_t p = 0; p < prefill_.size(); ++p) {
      testing::fill_request(prefill_[p]->layout, prefill_[p]->cache.data(), src, id);
      ASSERT_TRUE(prefillers_[p]->start(id, src, 4, nullptr));
    }
    GroupRequest rq;
    rq.id = id;
    rq.num_pages = 2;
    rq.prefill_ranks = {prefill_[0]->engine->address(), prefill_[1]->engine->address()};
    rq.on_ready = [this](RequestId id, const std::vector<std::vector<uint32_t>>& pages) {
      std::lock_guard lock(mu_);
      ++ends_[id];
      pages_[id] = pages;
      cv_.notify_all();
    };
    rq.on_error = [this](RequestId id, const Status& s) {
      std::lock_guard lock(mu_);
      ++ends_[id];
      errors_[id] = s;
      cv_.notify_all();
    };
    ASSERT_TRUE(group_->submit(std::move(rq)));
  }
  void layers(RequestId id, size_t prefill_rank, uint32_t from, uint32_t to) {
    for (uint32_t l = from; l < to; ++l) ASSERT_TRUE(prefillers_[prefill_rank]->layer_done(id, l));
  }
  bool ended(RequestId id, std::chrono::milliseconds t = 20s) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, t, [&] { return ends_[id] > 0; });
  }
  bool all_pages_free(std::chrono::milliseconds t = 10s) {
    auto deadline = std::chrono::steady_clock::now() + t;
    for (;;) {
      bool free = true;
      for (auto& d : decoders_) free = free && d->free_pages() == d->layout().num_pages;
      if (free) return true;
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(10ms);
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<RequestId, int> ends_;
  std::map<RequestId, std::vector<std::vector<uint32_t>>> pages_;
  std::map<RequestId, Status> errors_;
};

KvGroup::World* KvGroup::world_ = nullptr;

void KvGroup::World::init() {
  Config config = fabric::testing::make_config({"shm_reorder", "shm", true});
  Options o;
  o.heartbeat = 100ms;
  o.quarantine = 300ms;
  for (uint32_t r = 0; r < 2; ++r) {
    auto rank = make_rank(config, test_layout(2, r));
    ASSERT_TRUE(rank) << rank.status().to_string();
    auto p = KvPrefiller::create(*(*rank)->engine, (*rank)->layout, (*rank)->reg, o);
    ASSERT_TRUE(p);
    prefill_.push_back(std::move(*rank));
    prefillers_.push_back(std::move(*p));
  }
  for (uint32_t r = 0; r < 4; ++r) {
    auto rank = make_rank(config, test_layout(4, r));
    ASSERT_TRUE(rank) << rank.status().to_string();
    auto d = KvDecoder::create(*(*rank)->engine, (*rank)->layout, (*rank)->reg, o);
    ASSERT_TRUE(d);
    decode_.push_back(std::move(*rank));
    decoders_.push_back(std::move(*d));
  }
  auto g = DecodeGroup::create(
      {decoders_[0].get(), decoders_[1].get(), decoders_[2].get(), decoders_[3].get()});
  ASSERT_TRUE(g) << g.status().to_string();
  group_ = std::move(*g);
}

TEST_F(KvGroup, OneReadyForTheWholeGroupByteExact) {
  for (RequestId id = 1; id <= 3; ++id) submit(id);
  EXPECT_EQ(group_->live_requests(), 3u);
  // Prefill rank 0 finishes first: the decode ranks it feeds (0, 1) get ready, the group not.
  for (RequestId id = 1; id <= 3; ++id) layers(id, 0, 0, 4);
  EXPECT_FALSE(ended(1, 300ms));
  for (RequestId id = 1; id <= 3; ++id) layers(id, 1, 0, 4);
  for (RequestId id = 1; id <= 3; ++id) {
    ASSERT_TRUE(ended(id));
    std::lock_guard lock(mu_);
    EXPECT_EQ(ends_[id], 1);
    ASSERT_EQ(pages_[id].size(), 4u);
    for (size_t r = 0; r < 4; ++r) {
      std::string where;
      EXPECT_TRUE(testing::check_request(decode_[r]->layout, decode_[r]->cache.data(),
                                         pages_[id][r], id, &where))
          << "request " << id << " rank " << r << ": " << where;
    }
  }
  EXPECT_EQ(group_->live_requests(), 0u);
  EXPECT_EQ(group_->cancel(1).code(), ErrorCode::kNotFound);  // ready: release, not cancel
  for (RequestId id = 1; id <= 3; ++id) EXPECT_TRUE(group_->release(id));
  EXPECT_EQ(group_->release(1).code(), ErrorCode::kNotFound);
  EXPECT_TRUE(all_pages_free(0ms));
}

TEST_F(KvGroup, OneFailedRankFailsTheGroupOnceAndFreesEverything) {
  submit(7);
  layers(7, 0, 0, 4);  // decode ranks 0 and 1 become ready
  layers(7, 1, 0, 1);
  ASSERT_TRUE(prefillers_[1]->cancel(7));  // ranks 2 and 3 fail
  ASSERT_TRUE(ended(7));
  {
    std::lock_guard lock(mu_);
    EXPECT_EQ(errors_[7].code(), ErrorCode::kCancelled) << errors_[7].to_string();
    EXPECT_EQ(pages_.count(7), 0u);
  }
  EXPECT_TRUE(all_pages_free());  // the ready ranks' pages were released
  std::this_thread::sleep_for(100ms);
  {
    std::lock_guard lock(mu_);
    EXPECT_EQ(ends_[7], 1);
  }
  // Cancelled from the group mid-transfer.
  submit(8);
  layers(8, 0, 0, 2);
  ASSERT_TRUE(group_->cancel(8));
  ASSERT_TRUE(ended(8));
  {
    std::lock_guard lock(mu_);
    EXPECT_EQ(errors_[8].code(), ErrorCode::kCancelled);
  }
  EXPECT_TRUE(all_pages_free());
}

TEST_F(KvGroup, BadInput) {
  EXPECT_EQ(DecodeGroup::create({}).status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(DecodeGroup::create({decoders_[1].get(), decoders_[0].get()}).status().code(),
            ErrorCode::kInvalidArgument);  // ranks out of order (and of a TP4 group)
  EXPECT_EQ(DecodeGroup::create({decoders_[0].get(), nullptr}).status().code(),
            ErrorCode::kInvalidArgument);
  GroupRequest rq;
  rq.id = 9;
  rq.num_pages = 100;  // more than a pool holds: refused by rank 0, nothing left behind
  rq.prefill_ranks = {prefill_[0]->engine->address(), prefill_[1]->engine->address()};
  Status st = group_->submit(rq);
  EXPECT_EQ(st.code(), ErrorCode::kOutOfRange) << st.to_string();
  EXPECT_NE(st.message().find("decode rank 0"), std::string::npos) << st.to_string();
  // Rank 3 refuses a page index its pool lacks... after ranks 0-2 took theirs: undone.
  DecodeRequest whole;  // every page of rank 3's pool
  whole.id = 10;
  whole.num_pages = 8;
  whole.prefill_ranks = rq.prefill_ranks;
  ASSERT_TRUE(decoders_[3]->submit(std::move(whole)));
  rq.id = 11;
  rq.num_pages = 2;
  st = group_->submit(rq);
  EXPECT_EQ(st.code(), ErrorCode::kOutOfRange) << st.to_string();
  EXPECT_NE(st.message().find("decode rank 3"), std::string::npos) << st.to_string();
  EXPECT_EQ(group_->live_requests(), 0u);
  ASSERT_TRUE(decoders_[3]->cancel(10));
  EXPECT_TRUE(all_pages_free());
  EXPECT_EQ(group_->cancel(11).code(), ErrorCode::kNotFound);
}

}  // namespace
}  // namespace fabric::kv
