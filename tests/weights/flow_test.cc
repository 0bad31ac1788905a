// fabric::weights' sender and receiver (fabric/weights/flow.h) between two engines of this
// process over tcp and shm: versions pushed bit-exact against the CPU projections (a copy, a
// fused QKV, a strided column slice, FP8 weight and scales), batches of writes, the version
// protocol's failures (timeout, a trainer leaving, close, in place half-written), the Ready and
// endpoint bytes, the gathers' plan, and the staging ring's bookkeeping against a scan of every
// live range.
#include <gtest/gtest.h>

#include <condition_variable>
#include <cstring>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <thread>

#include "fabric/weights/flow.h"
#include "fabric/weights_projection.h"
#include "test_support.h"
#include "weights/ring.h"

namespace fabric::weights {
namespace {

using namespace std::chrono_literals;
using fabric::testing::Backend;

// --- the staging ring ---------------------------------------------------------------------------

TEST(WeightsRing, OverlapCheckAgreesWithAScanOfEveryLiveRange) {
  std::mt19937 rng(11);
  for (uint64_t size : {uint64_t{4096}, uint64_t{65536}, uint64_t{1} << 20}) {
    RingRanges<int> ring(size);
    for (int step = 0; step < 3000; ++step) {
      if (!ring.empty() && rng() % 10 < 3) {
        ring.release_oldest();
        continue;
      }
      const uint64_t choices[] = {1, 255, 256, 4096 % (size + 1), 1 + rng() % size, size};
      const uint64_t n = std::max<uint64_t>(1, choices[rng() % 6]);
      for (;;) {
        const uint64_t start = ring.next_start(n);
        bool scan = false;
        for (const auto& r : ring.live()) scan = scan || (start < r.end && r.start < start + n);
        ASSERT_EQ(ring.overlaps(start, n), scan) << size << " " << start << " " << n;
        if (!scan) {
          ring.hold(start, n);
          break;
        }
        ring.release_oldest();
      }
      uint64_t held = 0;
      for (const auto& r : ring.live()) held += r.end - r.start;
      ASSERT_EQ(ring.held(), held);
      ASSERT_LE(held, size);
    }
  }
}

// --- bytes --------------------------------------------------------------------------------------

TEST(WeightsWire, ReadyRoundTripsAndOtherMessagesAreRefused) {
  const Ready r{0x0102030405060708, 0xA0000007, 3, 1};
  const Bytes b = encode(r);
  ASSERT_EQ(b.size(), kReadyBytes);
  auto back = decode_ready(b);
  ASSERT_TRUE(back);
  EXPECT_EQ(*back, r);
  EXPECT_FALSE(decode_ready(std::span(b).first(kReadyBytes - 1)));
  Bytes other = b;
  other[0] = std::byte{'X'};
  EXPECT_EQ(decode_ready(other).status().code(), ErrorCode::kInvalidArgument);
}

TEST(WeightsWire, DamagedEndpointBytesNameTheField) {
  Endpoint e;
  e.layout.rank = 2;
  e.layout.params.push_back(InferenceParam{"w", DType::kBFloat16, {4, 8}, {}, {}});
  e.places = {{{0, 0}, {0, 64}}};  // region 0, of none
  const Bytes b = encode(e);
  auto bad = decode_endpoint(b);
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.status().message().find("'place.region'"), std::string::npos)
      << bad.status().message();
  for (size_t cut = 0; cut < b.size(); ++cut) {
    auto cut_bad = decode_endpoint(std::span(b).first(cut));
    ASSERT_FALSE(cut_bad) << "a cut at " << cut << " decoded";
    EXPECT_EQ(cut_bad.status().code(), ErrorCode::kInvalidArgument);
  }
}

// --- the flow over real engines
// -------------------------------------------------------------------

std::vector<uint16_t> bf16_pattern(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<uint16_t> out(n);
  for (auto& x : out) {
    float f = d(rng) * (rng() % 17 == 0 ? 300.0f : 1.0f);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    x = static_cast<uint16_t>(bits >> 16);
  }
  return out;
}

// The training rank's tensors (all held whole) and the inference rank's layout.
struct Model {
  std::map<std::string, std::vector<uint16_t>> train;  // bf16 bits
  std::map<std::string, Shape> shapes;
  std::vector<InferenceParam> layout;
  std::map<std::string, Bytes> want;  // what each inference tensor must hold
};

Bytes bytes_of(const std::vector<uint16_t>& v) {
  Bytes b(v.size() * 2);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// `n` identity parameters of 8 x 16 BF16 (256 bytes each).
Model many_model(int n, uint32_t version) {
  Model m;
  for (int k = 0; k < n; ++k) {
    const std::string name = "p" + std::to_string(1000 + k);
    m.shapes[name] = {8, 16};
    m.train[name] = bf16_pattern(128, version * 1000 + static_cast<uint32_t>(k));
    m.layout.push_back(InferenceParam{name, DType::kBFloat16, {8, 16}, {}, {}});
    m.want[name] = bytes_of(m.train[name]);
  }
  return m;
}

std::map<std::string, Bytes> expected(const Model& m);

Model test_model(uint32_t version) {
  Model m;
  m.shapes = {{"embed", {16, 24}}, {"q", {8, 24}},  {"k", {4, 24}},
              {"v", {4, 24}},      {"o", {24, 16}}, {"up", {130, 135}}};
  uint32_t seed = version * 100;
  for (const auto& [name, shape] : m.shapes) {
    m.train[name] = bf16_pattern(num_elements(shape), ++seed);
  }
  auto param = [](std::string name, DType dtype, Shape shape, Placement placement = {},
                  Projection projection = {}) {
    return InferenceParam{std::move(name), dtype, std::move(shape), placement,
                          std::move(projection)};
  };
  m.layout = {
      param("embed", DType::kBFloat16, {16, 24}),
      param("qkv", DType::kBFloat16, {16, 24}, {},
            Projection{ProjectionKind::kConcat, {"q", "k", "v"}, 0, 128}),
      param("o", DType::kBFloat16, {24, 16}, Placement{1, {4, 8}}),  // a column slice: strided
      param("up", DType::kFloat8E4M3, {130, 135}, {},
            Projection{ProjectionKind::kFp8Quantize, {}, 0, 128}),
      param("up.scale", DType::kFloat32, {2, 2}, {},
            Projection{ProjectionKind::kFp8Scale, {"up"}, 0, 128}),
  };
  m.want = expected(m);
  return m;
}

// What each inference tensor must hold, computed with the CPU projections directly.
std::map<std::string, Bytes> expected(const Model& m) {
  std::map<std::string, Bytes> out;
  out["embed"] = bytes_of(m.train.at("embed"));
  Bytes qkv(16 * 24 * 2);
  std::vector<std::span<const std::byte>> src;
  for (const char* s : {"q", "k", "v"}) {
    src.push_back(std::as_bytes(std::span(m.train.at(s))));
  }
  EXPECT_TRUE(concat_cpu(src, {{8, 24}, {4, 24}, {4, 24}}, 0, 2, qkv));
  out["qkv"] = qkv;
  Bytes o(24 * 8 * 2);
  for (int r = 0; r < 24; ++r) std::memcpy(&o[r * 16], &m.train.at("o")[r * 16 + 4], 16);
  out["o"] = o;
  Bytes q(130 * 135), sc(4 * 4);
  EXPECT_TRUE(quantize_fp8_blocks_cpu(m.train.at("up"), 130, 135, 128,
                                      std::span(reinterpret_cast<uint8_t*>(q.data()), q.size()),
                                      std::span(reinterpret_cast<float*>(sc.data()), 4)));
  out["up"] = q;
  out["up.scale"] = sc;
  return out;
}

class WeightsFlow : public ::testing::TestWithParam<Backend> {
 protected:
  // `ring_bytes` of staging; `flip`: two copies on the inference side.
  void build(bool flip = true, uint64_t ring_bytes = 1 << 16, uint64_t batch_bytes = 0,
             Model model = test_model(1)) {
    auto pair = fabric::testing::make_engine_pair(fabric::testing::make_config(GetParam()));
    ASSERT_TRUE(pair.a && pair.b);
    trainer_engine_ = std::move(pair.a);
    inference_engine_ = std::move(pair.b);
    model_ = std::move(model);
    TrainerRank tr{0, 1, {}};
    for (const auto& [name, shape] : model_.shapes) {
      tr.shards.push_back(Shard{name, DType::kBFloat16, shape, {}, 0});
    }
    InferenceRank ir{0, model_.layout};
    auto s = compute_schedule({tr}, {ir}, ScheduleOptions{4096});
    ASSERT_TRUE(s) << s.status().to_string();
    schedule_ = std::move(*s);
    // The inference tensors, every copy in one registered region.
    Endpoint ep{ir, {}, {}};
    uint64_t at = 0;
    for (const InferenceParam& p : ir.params) {
      auto& places = ep.places.emplace_back();
      for (int copy = 0; copy < (flip ? 2 : 1); ++copy) {
        places.push_back(Place{0, at});
        at += (local_bytes(p) + 63) / 64 * 64;
      }
    }
    memory_.assign(at, std::byte{0});
    auto reg = inference_engine_->register_memory(memory_.data(), memory_.size());
    ASSERT_TRUE(reg) << reg.status().to_string();
    ep.regions.push_back(reg->descriptor);
    endpoint_ = ep;
    auto back = decode_endpoint(encode(ep));  // the bytes a training rank reads
    ASSERT_TRUE(back) << back.status().to_string();
    ASSERT_EQ(back->places, ep.places);
    ASSERT_EQ(back->regions.size(), 1u);

    ring_.assign(ring_bytes, std::byte{0});
    auto ring_reg = trainer_engine_->register_memory(ring_.data(), ring_.size());
    ASSERT_TRUE(ring_reg) << ring_reg.status().to_string();
    auto sender = WeightSender::create(*trainer_engine_, SenderOptions{0, 1, 10s, batch_bytes});
    ASSERT_TRUE(sender) << sender.status().to_string();
    sender_ = std::move(*sender);
    ASSERT_TRUE(sender_->connect(schedule_, {ep}, {inference_engine_->address()},
                                 StagingRing{*ring_reg, ring_.data(), ring_.size(), false}));
    auto receiver =
        WeightReceiver::create(*inference_engine_, ReceiverOptions{0, flip, 0xA0000000, 10s});
    ASSERT_TRUE(receiver) << receiver.status().to_string();
    receiver_ = std::move(*receiver);
  }

  void TearDown() override {
    receiver_.reset();
    sender_.reset();
    if (trainer_engine_) trainer_engine_->close();
    if (inference_engine_) inference_engine_->close();
  }

  std::vector<TrainerPeer> trainers() { return {TrainerPeer{0, "t0", trainer_engine_->address()}}; }

  // Prepares `version`; its outcome lands in outcome_.
  Result<Ready> prepare(uint64_t version) {
    {
      std::lock_guard lock(mu_);
      outcome_.reset();
    }
    return receiver_->prepare(
        version, schedule_.writes_into(0), trainers(), [this](uint64_t v) { end(v, Status::ok()); },
        [this](uint64_t v, const Status& s) { end(v, s); });
  }
  Status outcome(std::chrono::milliseconds timeout = 10s) {
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return outcome_.has_value(); })) {
      return Status(ErrorCode::kTimeout, "the version never ended");
    }
    return *outcome_;
  }

  Result<PushStats> push(uint64_t version, const Model& m) {
    std::vector<std::string> names;
    std::vector<Source> sources;
    for (const auto& [name, data] : m.train) {
      names.push_back(name);
      sources.push_back(Source{data.data(), data.size() * 2, false});
    }
    return sender_->push(version, names, sources);
  }

  // The served copy of every parameter against the projections of `m`.
  void expect_served(const Model& m) {
    const auto& want = m.want;
    const uint8_t copy = receiver_->active_copy();
    for (size_t k = 0; k < endpoint_.layout.params.size(); ++k) {
      const InferenceParam& p = endpoint_.layout.params[k];
      const Bytes& w = want.at(p.name);
      ASSERT_EQ(w.size(), local_bytes(p)) << p.name;
      EXPECT_EQ(std::memcmp(memory_.data() + endpoint_.places[k][copy].offset, w.data(), w.size()),
                0)
          << p.name << " differs";
    }
  }

  void end(uint64_t version, const Status& s) {
    std::lock_guard lock(mu_);
    EXPECT_FALSE(outcome_.has_value()) << "version " << version << " ended twice";
    outcome_ = s;
    cv_.notify_all();
  }

  std::unique_ptr<TransferEngine> trainer_engine_, inference_engine_;
  Model model_;
  Schedule schedule_;
  Endpoint endpoint_;
  std::vector<std::byte> memory_, ring_;
  std::unique_ptr<WeightSender> sender_;
  std::unique_ptr<WeightReceiver> receiver_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<Status> outcome_;
};

TEST_P(WeightsFlow, VersionsLandBitExactInTheCopyNotServed) {
  build();
  if (!sender_) return;
  for (uint32_t version = 1; version <= 3; ++version) {
    const Model m = test_model(version);
    auto ready = prepare(version);
    ASSERT_TRUE(ready) << ready.status().to_string();
    EXPECT_EQ(ready->copy, version % 2);  // flips every version
    auto stats = push(version, m);
    ASSERT_TRUE(stats) << stats.status().to_string();
    ASSERT_TRUE(outcome()) << outcome().to_string();
    EXPECT_EQ(receiver_->version(), version);
    EXPECT_FALSE(receiver_->progress());
    expect_served(m);
    uint64_t bytes = 0;
    for (const auto& p : endpoint_.layout.params) bytes += local_bytes(p);
    EXPECT_EQ(stats->bytes, bytes);
    // The contiguous entries go as one scatter, the column slice as one paged write.
    EXPECT_EQ(stats->writes, 2u);
    EXPECT_LE(stats->temp_high_water, ring_.size());
  }
}

TEST_P(WeightsFlow, BatchesOfTheRingsQuarterAreOneSubmissionPerKindOfWrite) {
  build(true, 1 << 16, 2048);
  if (!sender_) return;
  ASSERT_TRUE(prepare(1));
  const Model m = test_model(1);
  auto stats = push(1, m);
  ASSERT_TRUE(stats) << stats.status().to_string();
  ASSERT_TRUE(outcome());
  expect_served(m);
  // In declaration order: embed, qkv, o (2304 bytes: a batch of a scatter and o's paged write),
  // then the FP8 weight and its scales (one range, a batch of one scatter).
  EXPECT_EQ(stats->writes, 3u);
}

// 64 parameters of 256 bytes through a ring of 16 such ranges. With batches of 4 every wait for
// room finds the oldest range posted: 16 batches, one scatter each. Without a batch limit the
// first wait posts what is queued (16 parameters) and every later wait again: 4 scatters. (A
// flush before every wait posted one parameter at a time once the ring had filled.)
TEST_P(WeightsFlow, AFullRingPostsEarlyOnlyWhenItsOldestRangeIsNotPosted) {
  for (uint64_t batch : {uint64_t{1024}, uint64_t{1} << 40}) {
    SCOPED_TRACE(batch);
    TearDown();
    build(true, 4096, batch, many_model(64, 1));
    if (!sender_) return;
    ASSERT_TRUE(prepare(1));
    auto stats = push(1, model_);
    ASSERT_TRUE(stats) << stats.status().to_string();
    ASSERT_TRUE(outcome());
    expect_served(model_);
    EXPECT_EQ(stats->writes, batch == 1024 ? 16u : 4u);
    EXPECT_EQ(stats->temp_high_water, 4096u);
  }
}

TEST_P(WeightsFlow, AProjectionLargerThanTheRingIsRefusedNamingIt) {
  build(true, 1024);
  if (!sender_) return;
  ASSERT_TRUE(prepare(1));
  auto stats = push(1, test_model(1));
  ASSERT_FALSE(stats);
  EXPECT_EQ(stats.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(stats.status().message().find("more than max_temp_bytes (1024)"), std::string::npos)
      << stats.status().message();
  receiver_->close();
  EXPECT_EQ(outcome().code(), ErrorCode::kClosed);
}

// Each bad push leaves its version to fail at the inference side (here: its trainer "left");
// the sender pushes the next version whole.
TEST_P(WeightsFlow, WrongSourcesAreRefusedNamingTheParameter) {
  build();
  if (!sender_) return;
  ASSERT_TRUE(prepare(1));
  Model m = test_model(1);
  m.train["q"].pop_back();  // one element short
  auto stats = push(1, m);
  ASSERT_FALSE(stats);
  EXPECT_EQ(stats.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(stats.status().message().find(
                "parameter 'qkv': source 'q' has 382 bytes, its shape [8, 24] of bf16 has 384"),
            std::string::npos)
      << stats.status().message();
  receiver_->fail_trainer("t0");
  EXPECT_EQ(outcome().code(), ErrorCode::kPeerUnreachable);
  ASSERT_TRUE(prepare(2));
  m = test_model(2);
  m.train.erase("o");
  stats = push(2, m);
  ASSERT_FALSE(stats);
  EXPECT_NE(stats.status().message().find("training parameter 'o' (a source of 'o')"),
            std::string::npos)
      << stats.status().message();
  receiver_->fail_trainer("t0");
  EXPECT_EQ(outcome().code(), ErrorCode::kPeerUnreachable);
  ASSERT_TRUE(prepare(3));
  stats = push(3, test_model(3));
  ASSERT_TRUE(stats) << stats.status().to_string();
  ASSERT_TRUE(outcome());
  expect_served(test_model(3));
}

TEST_P(WeightsFlow, ReadyMessagesAreAwaitedWithinTheTimeoutThenNamed) {
  build();
  if (!sender_) return;
  // One receive handler per engine: a second sender on it is refused.
  EXPECT_EQ(WeightSender::create(*trainer_engine_, SenderOptions{}).status().code(),
            ErrorCode::kAlreadyExists);
  // A Ready that comes late, within the timeout, is waited for.
  std::thread late([&] {
    std::this_thread::sleep_for(300ms);
    EXPECT_TRUE(prepare(7));
  });
  auto stats = push(7, model_);
  late.join();
  ASSERT_TRUE(stats) << stats.status().to_string();
  ASSERT_TRUE(outcome());
  // A sender on its own engine, 200 ms of timeout, whose inference rank never prepares.
  auto engine = TransferEngine::create(fabric::testing::make_config(GetParam()));
  ASSERT_TRUE(engine);
  auto ring = (*engine)->register_memory(ring_.data(), ring_.size());
  ASSERT_TRUE(ring);
  auto sender = WeightSender::create(**engine, SenderOptions{0, 1, 200ms, 0});
  ASSERT_TRUE(sender);
  ASSERT_TRUE((*sender)->connect(schedule_, {endpoint_}, {inference_engine_->address()},
                                 StagingRing{*ring, ring_.data(), ring_.size(), false}));
  Status st = (*sender)->begin(8);
  EXPECT_EQ(st.code(), ErrorCode::kTimeout);
  EXPECT_NE(st.message().find("version 8: inference ranks [0] did not prepare within 0.2 s"),
            std::string::npos)
      << st.message();
  sender->reset();
  (*engine)->close();
}

TEST_P(WeightsFlow, AVersionFailsOnTimeoutOnATrainerLeavingAndOnClose) {
  build();
  if (!sender_) return;
  auto receiver =
      WeightReceiver::create(*inference_engine_, ReceiverOptions{0, true, 0xB0000000, 300ms});
  ASSERT_TRUE(receiver);
  std::optional<Status> timed_out;
  std::mutex mu;
  ASSERT_TRUE((*receiver)->prepare(
      1, 5, trainers(), [](uint64_t) { ADD_FAILURE(); },
      [&](uint64_t, const Status& s) {
        std::lock_guard lock(mu);
        timed_out = s;
      }));
  std::this_thread::sleep_for(1s);
  {
    std::lock_guard lock(mu);
    ASSERT_TRUE(timed_out.has_value());
    EXPECT_EQ(timed_out->code(), ErrorCode::kTimeout);
    EXPECT_NE(timed_out->message().find("version 1 not complete"), std::string::npos);
  }
  EXPECT_EQ((*receiver)->version(), std::nullopt);
  receiver->reset();

  auto first = prepare(2);
  ASSERT_TRUE(first);
  EXPECT_EQ(prepare(3).status().code(), ErrorCode::kInvalidArgument);  // 2 is pending
  receiver_->fail_trainer("someone-else");
  EXPECT_TRUE(receiver_->progress());
  receiver_->fail_trainer("t0");
  Status left = outcome();
  EXPECT_EQ(left.code(), ErrorCode::kPeerUnreachable);
  EXPECT_NE(left.message().find("version 2: training rank 0 (t0) left"), std::string::npos)
      << left.message();
  auto second = prepare(4);
  ASSERT_TRUE(second);
  EXPECT_NE(second->imm, first->imm) << "an immediate was reused";
  EXPECT_EQ(second->copy, first->copy) << "a failed version flipped the served copy";
  receiver_->close();
  EXPECT_EQ(outcome().code(), ErrorCode::kClosed);
  EXPECT_EQ(prepare(5).status().code(), ErrorCode::kClosed);
}

TEST_P(WeightsFlow, InPlaceAFailedVersionIsHalfWrittenUntilOneCompletes) {
  build(/*flip=*/false);
  if (!sender_) return;
  ASSERT_TRUE(prepare(1));
  receiver_->fail_trainer("t0");
  EXPECT_EQ(outcome().code(), ErrorCode::kPeerUnreachable);
  EXPECT_TRUE(receiver_->half_written());
  auto ready = prepare(2);
  ASSERT_TRUE(ready);
  EXPECT_EQ(ready->copy, 0);
  ASSERT_TRUE(push(2, test_model(2)));
  ASSERT_TRUE(outcome());
  EXPECT_FALSE(receiver_->half_written());
  expect_served(test_model(2));
}

// Two FSDP training ranks holding dim-0 halves of "w": each writes part of "w" and of its FP8
// projection, so each receives the other's half for "w" and reuses it for the FP8 weight and
// its scales; "b", held whole by rank 1 alone, moves nowhere.
TEST(WeightsGather, EachRankReceivesTheOtherHalfOnceAndReusesIt) {
  auto engine = TransferEngine::create(fabric::testing::make_config({"tcp", "tcp", false}));
  if (!engine && engine.status().code() == ErrorCode::kUnsupported) GTEST_SKIP();
  ASSERT_TRUE(engine) << engine.status().to_string();
  const Shape shape{256, 128};
  std::vector<TrainerRank> trainers;
  for (uint32_t r = 0; r < 2; ++r) {
    TrainerRank t{r, 1, {Shard{"w", DType::kBFloat16, shape, {{128 * r, 128}, {0, 128}}, 0}}};
    if (r == 1) t.shards.push_back(Shard{"b", DType::kFloat32, {64}, {}, 0});
    trainers.push_back(std::move(t));
  }
  InferenceRank ir{0,
                   {InferenceParam{"w", DType::kBFloat16, shape, {}, {}},
                    InferenceParam{"w8",
                                   DType::kFloat8E4M3,
                                   shape,
                                   {},
                                   Projection{ProjectionKind::kFp8Quantize, {"w"}, 0, 128}},
                    InferenceParam{"w8.scale",
                                   DType::kFloat32,
                                   {2, 1},
                                   {},
                                   Projection{ProjectionKind::kFp8Scale, {"w"}, 0, 128}},
                    InferenceParam{"b", DType::kFloat32, {64}, {}, {}}}};
  auto schedule = compute_schedule(trainers, {ir}, ScheduleOptions{4096});
  ASSERT_TRUE(schedule) << schedule.status().to_string();
  std::vector<std::byte> memory(1 << 20), ring(1 << 20);
  auto reg = (*engine)->register_memory(memory.data(), memory.size());
  auto ring_reg = (*engine)->register_memory(ring.data(), ring.size());
  ASSERT_TRUE(reg && ring_reg);
  Endpoint ep{ir, {reg->descriptor}, {{{0, 0}}, {{0, 0}}, {{0, 0}}, {{0, 0}}}};
  auto sender = WeightSender::create(**engine, SenderOptions{0, 1, 10s, 0});
  ASSERT_TRUE(sender);
  ASSERT_TRUE((*sender)->connect(*schedule, {ep}, {(*engine)->address()},
                                 StagingRing{*ring_reg, ring.data(), ring.size(), false}));
  ASSERT_TRUE((*sender)->plan_gathers(trainers));
  const auto& s = *schedule;
  const auto w = static_cast<uint32_t>(s.find("w")), w8 = static_cast<uint32_t>(s.find("w8"));
  const auto scale = static_cast<uint32_t>(s.find("w8.scale"));
  const auto b = static_cast<uint32_t>(s.find("b"));
  ASSERT_TRUE((*sender)->sends(w) && (*sender)->sends(w8)) << "rank 0 writes no part of them";
  const std::vector<Range> half0{{0, 128}, {0, 128}}, half1{{128, 128}, {0, 128}};
  const GatherStep& first = (*sender)->gather(w, 0);
  EXPECT_FALSE(first.reuse);
  ASSERT_EQ(first.recvs.size(), 1u);
  EXPECT_EQ(first.recvs[0].first, 1u);
  EXPECT_EQ(first.recvs[0].second, half1);
  ASSERT_EQ(first.sends.size(), 1u);
  EXPECT_EQ(first.sends[0].second, half0);
  for (uint32_t p : {w8, scale}) {  // after "w" in push order: held whole already
    const GatherStep& again = (*sender)->gather(p, 0);
    EXPECT_TRUE(again.reuse) << s.params[p].name;
    EXPECT_TRUE(again.sends.empty() && again.recvs.empty()) << s.params[p].name;
  }
  const GatherStep& none = (*sender)->gather(b, 0);
  EXPECT_TRUE(none.sends.empty() && none.recvs.empty() && !none.reuse);
  // Descriptions other than the schedule's are refused.
  trainers[1].shards.erase(trainers[1].shards.begin());
  Status st = (*sender)->plan_gathers(trainers);
  EXPECT_EQ(st.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(st.message().find("holds no shard of 'w'"), std::string::npos) << st.message();
  trainers.pop_back();
  EXPECT_EQ((*sender)->plan_gathers(trainers).code(), ErrorCode::kInvalidArgument);
  sender->reset();
  (*engine)->close();
}

// tcp and shm as they are (the engine's own suites cover reordering and verbs).
std::vector<Backend> plain_backends() {
  auto all = fabric::testing::all_backends();
  std::erase_if(all, [](const Backend& b) { return b.reorder || b.provider == "verbs"; });
  return all;
}

INSTANTIATE_TEST_SUITE_P(Backends, WeightsFlow, ::testing::ValuesIn(plain_backends()),
                         fabric::testing::backend_name);

}  // namespace
}  // namespace fabric::weights
