// fabric::weights: the schedule (coverage, balance, errors naming the parameter, bytes), the CPU
// projections, and a property test over random shardings.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <string_view>

#include "fabric/weights.h"
#include "fabric/weights_projection.h"

namespace fabric::weights {
namespace {

// Which projected-tensor byte each byte of an inference rank's local tensor comes from, by the
// schedule's entries; -1 where none wrote, -2 where two did.
std::vector<int64_t> apply(const Schedule& s, uint32_t inference, const std::string& name,
                           uint64_t local_size) {
  std::vector<int64_t> dst(local_size, -1);
  const int64_t param = s.find(name);
  for (const Entry& e : s.entries) {
    if (e.inference != inference || e.param != param) continue;
    for (uint64_t r = 0; r < e.runs; ++r) {
      for (uint64_t b = 0; b < e.length; ++b) {
        const uint64_t at = e.dst_offset + r * e.dst_stride + b;
        if (at >= local_size) {
          ADD_FAILURE() << name << ": entry writes past the local tensor";
          return dst;
        }
        dst[at] = dst[at] == -1 ? static_cast<int64_t>(e.src_offset + r * e.src_stride + b) : -2;
      }
    }
  }
  return dst;
}

// The same mapping computed from the placement directly, element by element.
std::vector<int64_t> expected_map(const InferenceParam& p) {
  const uint64_t eb = element_bytes(p.dtype);
  std::vector<int64_t> out;
  const uint64_t n = num_elements(p.shape);
  for (uint64_t i = 0; i < n; ++i) {
    if (p.placement.dim >= 0) {
      uint64_t rest = i;
      for (size_t d = p.shape.size(); d-- > 0;) {
        const uint64_t coord = rest % p.shape[d];
        rest /= p.shape[d];
        if (static_cast<int32_t>(d) == p.placement.dim &&
            (coord < p.placement.range.start ||
             coord >= p.placement.range.start + p.placement.range.length)) {
          goto skip;
        }
      }
    }
    for (uint64_t b = 0; b < eb; ++b) out.push_back(static_cast<int64_t>(i * eb + b));
  skip:;
  }
  return out;
}

// Every byte of every local tensor written once, from the right projected byte.
void expect_exact_cover(const Schedule& s, const std::vector<InferenceRank>& inference) {
  for (const InferenceRank& r : inference) {
    for (const InferenceParam& p : r.params) {
      const auto want = expected_map(p);
      ASSERT_EQ(want.size(), local_bytes(p)) << p.name;
      EXPECT_EQ(apply(s, r.rank, p.name, local_bytes(p)), want)
          << p.name << " on inference rank " << r.rank;
    }
  }
}

Shard shard(std::string name, Shape shape, std::vector<Range> box = {},
            DType d = DType::kBFloat16) {
  return Shard{std::move(name), d, std::move(shape), std::move(box), 0};
}

InferenceParam param(std::string name, Shape shape, Placement placement = {},
                     Projection projection = {}, DType d = DType::kBFloat16) {
  return InferenceParam{std::move(name), d, std::move(shape), placement, std::move(projection)};
}

// Two FSDP trainers (dim-0 halves) into two TP ranks: column slices of w, row slices of o,
// a replicated norm; every local byte once, load balanced.
TEST(WeightsSchedule, FsdpTrainersIntoTensorParallelRanks) {
  std::vector<TrainerRank> trainers(2);
  for (uint32_t t = 0; t < 2; ++t) {
    trainers[t].rank = t;
    trainers[t].shards = {shard("w", {64, 32}, {{t * 32, 32}, {0, 32}}),
                          shard("o", {32, 64}, {{t * 16, 16}, {0, 64}}),
                          shard("norm", {32}, {{t * 16, 16}})};
  }
  std::vector<InferenceRank> inference(2);
  for (uint32_t r = 0; r < 2; ++r) {
    inference[r].rank = r;
    inference[r].params = {param("w", {64, 32}, {0, {r * 32, 32}}),
                           param("o", {32, 64}, {1, {r * 32, 32}}), param("norm", {32})};
  }
  auto s = compute_schedule(trainers, inference, {.chunk_bytes = 512});
  ASSERT_TRUE(s) << s.status().to_string();
  expect_exact_cover(*s, inference);
  const uint64_t total = s->bytes_from(0) + s->bytes_from(1);
  EXPECT_EQ(total, 2 * (64 * 32 / 2 + 32 * 64 / 2 + 32) * 2u);  // halves of w and o, all of norm
  EXPECT_LE(std::max(s->bytes_from(0), s->bytes_from(1)), total / 2 + 512);
  // Row slices of o are strided: 32 runs of 64 bytes per rank.
  uint64_t o_runs = 0;
  for (const Entry& e : s->entries) {
    if (e.param == s->find("o") && e.inference == 1) o_runs += e.runs;
  }
  EXPECT_EQ(o_runs, 32u);
  uint64_t writes = 0;
  for (const Entry& e : s->entries) {
    if (e.inference == 1) writes += e.runs;
  }
  EXPECT_EQ(s->writes_into(1), writes);
}

TEST(WeightsSchedule, FusedQkvAndFp8Projections) {
  TrainerRank t{
      0,
      2,
      {shard("q", {8, 16}), shard("k", {4, 16}), shard("v", {4, 16}), shard("up", {256, 200})}};
  InferenceRank r{
      0,
      {param("qkv", {16, 16}, {}, {ProjectionKind::kConcat, {"q", "k", "v"}, 0, 128}),
       param("up", {256, 200}, {}, {ProjectionKind::kFp8Quantize, {}, 0, 128}, DType::kFloat8E4M3),
       param("up.scale", {2, 2}, {}, {ProjectionKind::kFp8Scale, {"up"}, 0, 128},
             DType::kFloat32)}};
  auto s = compute_schedule({t}, {r});
  ASSERT_TRUE(s) << s.status().to_string();
  expect_exact_cover(*s, {r});
  const auto& qkv = s->params[static_cast<size_t>(s->find("qkv"))];
  EXPECT_EQ(qkv.projection.sources, (std::vector<std::string>{"q", "k", "v"}));
  EXPECT_EQ(qkv.source_shapes[1], (Shape{4, 16}));
  const auto& up = s->params[static_cast<size_t>(s->find("up"))];
  EXPECT_EQ(up.projection.sources, std::vector<std::string>{"up"});
  EXPECT_EQ(up.source_dtypes[0], DType::kBFloat16);
  // Both NICs carry bytes.
  uint64_t nic_bytes[2] = {0, 0};
  for (const Entry& e : s->entries) nic_bytes[e.nic] += e.bytes();
  EXPECT_GT(nic_bytes[0], 0u);
  EXPECT_GT(nic_bytes[1], 0u);
}

// A parameter held by only some training ranks (EP experts) goes only to them.
TEST(WeightsSchedule, ExpertsGoOnlyToTheRanksHoldingThem) {
  std::vector<TrainerRank> trainers(4);
  for (uint32_t t = 0; t < 4; ++t) {
    trainers[t].rank = t;
    const uint32_t group = t / 2;  // EP 2, FSDP 2 inside each group
    trainers[t].shards = {shard("experts", {4, 16, 8}, {{group * 2, 2}, {t % 2 * 8, 8}, {0, 8}})};
  }
  // A stacked [experts, ...] tensor is one parameter every holder may send; experts as
  // parameters of their own go only to the ranks of their EP group.
  InferenceRank r{0, {param("experts", {4, 16, 8}, {0, {0, 4}})}};
  auto s = compute_schedule(trainers, {r}, {.chunk_bytes = 64});
  ASSERT_TRUE(s) << s.status().to_string();
  expect_exact_cover(*s, {r});
  std::vector<TrainerRank> split(4);
  for (uint32_t t = 0; t < 4; ++t) {
    split[t].rank = t;
    split[t].shards = {shard("e" + std::to_string(t / 2), {32, 8}, {{t % 2 * 16, 16}, {0, 8}})};
  }
  InferenceRank r2{0, {param("e0", {32, 8}), param("e1", {32, 8})}};
  auto s2 = compute_schedule(split, {r2}, {.chunk_bytes = 64});
  ASSERT_TRUE(s2) << s2.status().to_string();
  for (const Entry& e : s2->entries) {
    EXPECT_EQ(e.trainer / 2, static_cast<uint32_t>(e.param)) << "an expert sent by a rank that "
                                                                "does not hold it";
  }
  EXPECT_EQ(s2->bytes_from(0) + s2->bytes_from(1), 32u * 8 * 2);
}

// A fused FP8 gate/up: the FP8 kinds with several sources quantise their concatenation along
// `dim` (the scales' tiles counted on the fused shape, straddling the seam), and the schedule
// checks the fused shape against the inference side's.
TEST(WeightsSchedule, Fp8OfAConcatenation) {
  TrainerRank t{0, 1, {shard("gate", {200, 64}), shard("up", {200, 64})}};
  const Projection weight{ProjectionKind::kFp8Quantize, {"gate", "up"}, 0, 128};
  const Projection scales{ProjectionKind::kFp8Scale, {"gate", "up"}, 0, 128};
  InferenceRank r{0,
                  {param("gate_up", {400, 64}, {0, {200, 200}}, weight, DType::kFloat8E4M3),
                   param("gate_up.scale", {4, 1}, {}, scales, DType::kFloat32)}};
  auto s = compute_schedule({t}, {r});
  ASSERT_TRUE(s) << s.status().to_string();
  expect_exact_cover(*s, {r});
  const auto& fused = s->params[static_cast<size_t>(s->find("gate_up"))];
  EXPECT_EQ(fused.source_shapes, (std::vector<Shape>{{200, 64}, {200, 64}}));
  EXPECT_EQ(fused.projection.dim, 0u);

  // Joined on dim 1 instead: [200, 128], one tile row of scales fewer.
  auto wide = projected_shape("gate_up", {ProjectionKind::kFp8Scale, {"gate", "up"}, 1, 128},
                              {{200, 64}, {200, 64}});
  ASSERT_TRUE(wide) << wide.status().to_string();
  EXPECT_EQ(*wide, (Shape{2, 1}));
  // Sources that do not stack, and a 3-D concatenation, are named.
  auto odd = projected_shape("gate_up", weight, {{200, 64}, {200, 32}});
  ASSERT_FALSE(odd);
  EXPECT_NE(odd.status().message().find("'gate_up': fp8_quantize projection: source 1 has shape "
                                        "[200, 32], which does not stack with [200, 64] along "
                                        "dim 0"),
            std::string::npos)
      << odd.status().message();
  auto cube = projected_shape("e", {ProjectionKind::kFp8Quantize, {"a", "b"}, 0, 128},
                              {{2, 8, 8}, {2, 8, 8}});
  ASSERT_FALSE(cube);
  EXPECT_NE(cube.status().message().find("needs a 2-D concatenation, got [4, 8, 8]"),
            std::string::npos)
      << cube.status().message();
  auto one =
      projected_shape("w", {ProjectionKind::kIdentity, {"a", "b"}, 0, 128}, {{2, 8}, {2, 8}});
  ASSERT_FALSE(one);
  EXPECT_NE(one.status().message().find("identity projection: takes exactly one source"),
            std::string::npos);
  // A BF16 source beside a float32 one has no FP8 projection.
  TrainerRank mixed{0, 1, {shard("gate", {200, 64}), shard("up", {200, 64}, {}, DType::kFloat32)}};
  auto bad = compute_schedule({mixed}, {r});
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.status().message().find("'gate_up': dtype f32 -> fp8_e4m3 has no fp8_quantize"),
            std::string::npos)
      << bad.status().message();
}

// Each bad layout is refused with the parameter named.
TEST(WeightsSchedule, BadLayoutsNameTheParameter) {
  const TrainerRank t{0, 1, {shard("w", {8, 8})}};
  struct Case {
    std::vector<TrainerRank> trainers;
    InferenceRank inference;
    ErrorCode code;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {{t}, {0, {param("missing", {8, 8})}}, ErrorCode::kNotFound, "'missing'"},
      {{t}, {0, {param("w", {8, 4})}}, ErrorCode::kInvalidArgument, "'w': shape mismatch"},
      {{t},
       {0, {param("w", {8, 8}, {}, {}, DType::kFloat16)}},
       ErrorCode::kInvalidArgument,
       "'w': dtype bf16 -> f16 has no identity projection"},
      {{{0, 1, {shard("x", {8, 8}, {}, DType::kFloat32)}}},
       {0,
        {param("x", {8, 8}, {}, {ProjectionKind::kFp8Quantize, {}, 0, 128}, DType::kFloat8E4M3)}},
       ErrorCode::kInvalidArgument,
       "'x': dtype f32 -> fp8_e4m3 has no fp8_quantize"},
      {{{0, 1, {shard("w", {8, 8}, {{0, 5}, {0, 8}})}},
        {1, 1, {shard("w", {8, 8}, {{4, 4}, {0, 8}})}}},
       {0, {param("w", {8, 8})}},
       ErrorCode::kInvalidArgument,
       "'w': the shards of ranks 0 and 1 overlap"},
      {{{0, 1, {shard("w", {8, 8}, {{0, 4}, {0, 8}})}},
        {1, 1, {shard("w", {8, 8}, {{4, 3}, {0, 8}})}}},
       {0, {param("w", {8, 8})}},
       ErrorCode::kInvalidArgument,
       "'w': incomplete shards: replica 0 covers 56 of 64"},
      {{t},
       {0, {param("w", {8, 8}, {1, {6, 4}})}},
       ErrorCode::kInvalidArgument,
       "'w' (inference rank 0): placement"},
      {{t},
       {0, {param("w", {16, 8}, {}, {ProjectionKind::kConcat, {"w", "nope"}})}},
       ErrorCode::kNotFound,
       "'w': no training rank holds its source 'nope'"},
      {{{0, 1, {shard("w", {8, 8}), shard("w", {8, 8})}}},
       {0, {param("w", {8, 8})}},
       ErrorCode::kInvalidArgument,
       "'w' (rank 0): two shards"},
  };
  for (const Case& c : cases) {
    auto s = compute_schedule(c.trainers, {c.inference});
    ASSERT_FALSE(s) << c.needle;
    EXPECT_EQ(s.status().code(), c.code) << s.status().to_string();
    EXPECT_NE(s.status().message().find(c.needle), std::string::npos)
        << "'" << s.status().message() << "' lacks '" << c.needle << "'";
  }
}

TEST(WeightsSchedule, RoundTripsThroughBytesAndRefusesDamagedBytes) {
  TrainerRank t{0, 2, {shard("q", {8, 16}, {}), shard("up", {256, 200})}};
  InferenceRank r{0,
                  {param("qkv", {8, 16}, {1, {0, 8}}, {ProjectionKind::kConcat, {"q"}, 0, 128}),
                   param("up", {256, 200}, {0, {128, 128}},
                         {ProjectionKind::kFp8Quantize, {}, 0, 128}, DType::kFloat8E4M3)}};
  auto s = compute_schedule({t}, {r}, {.chunk_bytes = 100});
  ASSERT_TRUE(s) << s.status().to_string();
  const Bytes bytes = s->encode();
  auto back = Schedule::decode(bytes);
  ASSERT_TRUE(back) << back.status().to_string();
  EXPECT_EQ(*back, *s);
  auto t2 = decode_trainer(encode(t));
  ASSERT_TRUE(t2);
  EXPECT_EQ(*t2, t);
  auto r2 = decode_inference(encode(r));
  ASSERT_TRUE(r2);
  EXPECT_EQ(*r2, r);
  for (size_t n = 0; n < bytes.size(); n += 7) {
    auto cut = Schedule::decode(std::span(bytes).first(n));
    EXPECT_FALSE(cut) << "a schedule cut to " << n << " bytes decoded";
  }
  Bytes longer = bytes;
  longer.push_back(std::byte{0});
  EXPECT_FALSE(Schedule::decode(longer));
  EXPECT_FALSE(decode_trainer(encode(r)));  // the wrong tag
  // Entries that would read past the end of their projected tensor: by offset, by stride, by
  // wrapping around 64 bits, and with no runs.
  ASSERT_FALSE(s->entries.empty());
  for (int k = 0; k < 4; ++k) {
    SCOPED_TRACE(k);
    Schedule bad = *s;
    Entry& e = bad.entries.back();
    const uint64_t whole =
        num_elements(bad.params[e.param].shape) * element_bytes(bad.params[e.param].dtype);
    if (k == 0) e.src_offset = whole - e.length + 1;
    if (k == 1) e.runs = 2, e.src_stride = whole;
    if (k == 2) e.src_offset = ~uint64_t{0} - 3;
    if (k == 3) e.runs = 0;
    auto refused = Schedule::decode(bad.encode());
    ASSERT_FALSE(refused);
    EXPECT_NE(refused.status().message().find("entry.src_offset"), std::string::npos)
        << refused.status().to_string();
  }
  // Destinations, against the inference ranks' layouts: the schedule fits; an entry moved past
  // the end of its rank's tensor, or into a rank that does not hold the parameter, does not.
  EXPECT_TRUE(s->check_destinations({r}));
  {
    Schedule bad = *s;
    Entry& e = bad.entries.back();
    e.dst_offset += 1 << 20;
    Status st = bad.check_destinations({r});
    EXPECT_EQ(st.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(st.message().find("writes past the end of inference rank 0's tensor"),
              std::string::npos)
        << st.to_string();
    InferenceRank without = r;
    without.params.pop_back();
    Status missing = s->check_destinations({without});
    EXPECT_NE(missing.message().find("does not hold it"), std::string::npos) << missing.to_string();
    EXPECT_FALSE(s->check_destinations({}));
  }
  // Parameters out of name order (Schedule::find bisects) or named twice are refused.
  for (const char* second : {"a", "qkv"}) {
    Schedule bad = *s;
    ASSERT_EQ(bad.params.size(), 2u);
    bad.params[1].name = second;  // "qkv" then "a", or "qkv" twice
    auto refused = Schedule::decode(bad.encode());
    ASSERT_FALSE(refused) << second;
    EXPECT_NE(refused.status().message().find("param.name (order)"), std::string::npos)
        << refused.status().to_string();
  }
}

// --- damaged bytes: names that are not UTF-8, a corrupt num_nics, ranges that wrap ----------

// `v` as `n` little-endian bytes, as the codec writes integers.
Bytes le(uint64_t v, int n) {
  Bytes out;
  for (int i = 0; i < n; ++i) out.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xFF));
  return out;
}
Bytes raw(std::string_view s) {
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  return Bytes(p, p + s.size());
}
Bytes cat(Bytes a, const Bytes& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}
// A string as the codec writes it: its u32 length, then its bytes.
Bytes encoded_string(std::string_view s) {
  return cat(le(s.size(), 4), raw(s));
}
// Where `pattern` starts in `b`; it must be there exactly once.
size_t find_once(const Bytes& b, const Bytes& pattern) {
  auto it = std::search(b.begin(), b.end(), pattern.begin(), pattern.end());
  EXPECT_NE(it, b.end()) << "pattern not found";
  if (it == b.end()) return 0;
  EXPECT_EQ(std::search(it + 1, b.end(), pattern.begin(), pattern.end()), b.end())
      << "pattern found twice";
  return static_cast<size_t>(it - b.begin());
}
void overwrite(Bytes& b, size_t at, const Bytes& with) {
  ASSERT_LE(at + with.size(), b.size());
  std::copy(with.begin(), with.end(), b.begin() + static_cast<std::ptrdiff_t>(at));
}
// `status` is InvalidArgument and its message holds `needle`.
void expect_invalid_naming(const Status& status, const std::string& needle) {
  EXPECT_EQ(status.code(), ErrorCode::kInvalidArgument) << status.to_string();
  EXPECT_NE(status.message().find(needle), std::string::npos)
      << "'" << status.message() << "' lacks '" << needle << "'";
}

// Byte sequences that are not UTF-8 (each the same length as what it replaces in a name): a
// byte UTF-8 never uses, a lone continuation byte, an overlong '/', a surrogate (U+D800), a
// code point above U+10FFFF, and a sequence cut short by the next character.
const std::vector<std::string> kNotUtf8 = {
    "\xff", "\x80", "\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80", "\xe2\x82"};

TEST(WeightsCodec, NamesThatAreNotUtf8AreRefusedNamingTheField) {
  const TrainerRank t{0, 1, {shard("layers.0.q", {8, 16}), shard("layers.0.k", {8, 16})}};
  const InferenceRank r{0,
                        {param("layers.0.qkv", {16, 16}, {},
                               {ProjectionKind::kConcat, {"layers.0.q", "layers.0.k"}, 0, 128})}};
  auto s = compute_schedule({t}, {r});
  ASSERT_TRUE(s) << s.status().to_string();
  struct Case {
    std::string what;  // which bytes
    Bytes bytes;
    std::string name;  // the name damaged (found as the codec writes it)
    std::function<Status(const Bytes&)> decode;
    std::string field;  // what the error must name
  };
  const auto trainer = [](const Bytes& b) { return decode_trainer(b).status(); };
  const auto inference = [](const Bytes& b) { return decode_inference(b).status(); };
  const auto schedule = [](const Bytes& b) { return Schedule::decode(b).status(); };
  const std::vector<Case> cases = {
      {"a shard's name", encode(t), "layers.0.k", trainer,
       "field 'shard.name (shard 1: not UTF-8)'"},
      {"a parameter's name", encode(r), "layers.0.qkv", inference,
       "field 'param.name (parameter 0: not UTF-8)'"},
      {"a parameter's source", encode(r), "layers.0.k", inference,
       "field 'projection.source (parameter 0, source 1: not UTF-8)'"},
      {"a scheduled parameter's name", s->encode(), "layers.0.qkv", schedule,
       "field 'param.name (parameter 0: not UTF-8)'"},
      {"a scheduled parameter's source", s->encode(), "layers.0.q", schedule,
       "field 'projection.source (parameter 0, source 0: not UTF-8)'"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    ASSERT_TRUE(c.decode(c.bytes).ok()) << c.decode(c.bytes).to_string();
    const size_t at = find_once(c.bytes, encoded_string(c.name)) + 4;  // the name's first byte
    for (const std::string& bad : kNotUtf8) {
      for (const size_t where : {size_t{0}, c.name.size() - bad.size()}) {  // first, last bytes
        Bytes damaged = c.bytes;
        overwrite(damaged, at + where, raw(bad));
        expect_invalid_naming(c.decode(damaged), c.field);
      }
    }
  }
  // Names in UTF-8 beyond ASCII are names like any other.
  const TrainerRank accented{0, 1, {shard("caf\xc3\xa9.w", {8}), shard("\xf0\x9f\x98\x80", {8})}};
  auto back = decode_trainer(encode(accented));
  ASSERT_TRUE(back) << back.status().to_string();
  EXPECT_EQ(*back, accented);
}

TEST(WeightsSchedule, NumNicsFromBytesMustBeOneToSixtyFour) {
  // A training rank's description with its num_nics field (after the tag, the version and the
  // rank) damaged: it decodes (the field is a plain u32), and compute_schedule refuses it
  // naming num_nics; 4 billion NICs made it allocate a load per NIC (std::bad_alloc).
  const TrainerRank t{0, 2, {shard("w", {8, 8})}};
  const InferenceRank r{0, {param("w", {8, 8})}};
  const Bytes bytes = encode(t);
  ASSERT_EQ(Bytes(bytes.begin() + 12, bytes.begin() + 16), le(2, 4));
  for (const uint32_t nics : {0u, 65u, 1000u, 0xFFFFFFFFu}) {
    SCOPED_TRACE(nics);
    Bytes damaged = bytes;
    overwrite(damaged, 12, le(nics, 4));
    auto decoded = decode_trainer(damaged);
    ASSERT_TRUE(decoded) << decoded.status().to_string();
    ASSERT_EQ(decoded->num_nics, nics);
    auto refused = compute_schedule({*decoded}, {r});
    ASSERT_FALSE(refused);
    expect_invalid_naming(refused.status(),
                          "training rank 0: num_nics is " + std::to_string(nics) + " (1 to 64)");
  }
  for (const uint32_t nics : {1u, 64u}) {
    Bytes fine = bytes;
    overwrite(fine, 12, le(nics, 4));
    auto s = compute_schedule({*decode_trainer(fine)}, {r});
    ASSERT_TRUE(s) << nics << ": " << s.status().to_string();
    for (const Entry& e : s->entries) EXPECT_LT(e.nic, nics);
  }
}

TEST(WeightsSchedule, RangesFromBytesThatWrapAroundAreRefused) {
  // Two trainers hold the halves of w's rows; the second's box (start 4, length 4) and an
  // inference rank's placement (dim 0, start 4, length 4) damaged so that start + length
  // wraps around 64 bits to a small number: refused naming the range (they passed before, the
  // sum being inside the dimension).
  const InferenceRank r{0, {param("w", {8, 8}, {0, {4, 4}})}};
  const std::vector<TrainerRank> t = {{0, 1, {shard("w", {8, 8}, {{0, 4}, {0, 8}})}},
                                      {1, 1, {shard("w", {8, 8}, {{4, 4}, {0, 8}})}}};
  ASSERT_TRUE(compute_schedule(t, {r}));
  const uint64_t max = ~uint64_t{0};
  struct Wrap {
    uint64_t start, length;
  };
  for (const Wrap w : {Wrap{max - 1, 4}, Wrap{4, max - 1}, Wrap{max, 1}, Wrap{9, max - 7}}) {
    SCOPED_TRACE(std::to_string(w.start) + " + " + std::to_string(w.length));
    {
      Bytes damaged = encode(t[1]);
      // The box of dim 0 (start, length), then dim 1's (0, 8).
      const size_t at = find_once(damaged, cat(cat(le(4, 8), le(4, 8)), cat(le(0, 8), le(8, 8))));
      overwrite(damaged, at, cat(le(w.start, 8), le(w.length, 8)));
      auto decoded = decode_trainer(damaged);
      ASSERT_TRUE(decoded) << decoded.status().to_string();
      auto refused = compute_schedule({t[0], *decoded}, {r});
      ASSERT_FALSE(refused);
      expect_invalid_naming(refused.status(), "training parameter 'w' (rank 1): box range [" +
                                                  std::to_string(w.start) + ", ");
      EXPECT_NE(refused.status().message().find("of dim 0 outside its size 8"), std::string::npos)
          << refused.status().to_string();
    }
    {
      Bytes damaged = encode(r);
      // The placement: dim 0 (a u32), start, length.
      const size_t at = find_once(damaged, cat(le(0, 4), cat(le(4, 8), le(4, 8)))) + 4;
      overwrite(damaged, at, cat(le(w.start, 8), le(w.length, 8)));
      auto decoded = decode_inference(damaged);
      ASSERT_TRUE(decoded) << decoded.status().to_string();
      auto refused = compute_schedule(t, {*decoded});
      ASSERT_FALSE(refused);
      expect_invalid_naming(refused.status(),
                            "'w' (inference rank 0): placement [" + std::to_string(w.start) + ", ");
      EXPECT_NE(refused.status().message().find("of dim 0 outside shape"), std::string::npos)
          << refused.status().to_string();
    }
  }
}

// Random shardings on both sides: every local byte once from the right source byte, senders
// hold the parameter, and with every rank eligible no rank (nor NIC) exceeds mean + one chunk.
TEST(WeightsSchedule, PropertyRandomShardings) {
  std::mt19937_64 rng(19);
  auto pick = [&](uint64_t lo, uint64_t hi) {
    return std::uniform_int_distribution<uint64_t>(lo, hi)(rng);
  };
  int scheduled = 0;
  for (int iter = 0; iter < 300; ++iter) {
    const auto num_trainers = static_cast<uint32_t>(pick(1, 6));
    const auto num_inference = static_cast<uint32_t>(pick(1, 4));
    const bool everyone_holds_all = iter % 2 == 0;
    std::vector<TrainerRank> trainers(num_trainers);
    for (uint32_t t = 0; t < num_trainers; ++t)
      trainers[t] = {t, static_cast<uint32_t>(pick(1, 3)), {}};
    std::vector<InferenceRank> inference(num_inference);
    for (uint32_t r = 0; r < num_inference; ++r) inference[r].rank = r;
    const int num_params = static_cast<int>(pick(1, 5));
    for (int pi = 0; pi < num_params; ++pi) {
      const std::string name = "p" + std::to_string(pi);
      Shape shape;
      for (uint64_t d = pick(1, 3); d > 0; --d) shape.push_back(pick(1, 9));
      const DType dtype = pick(0, 1) ? DType::kBFloat16 : DType::kFloat32;
      // Training side: one or two replicas, each a tiling along a random dim over distinct ranks.
      const uint32_t replicas = everyone_holds_all ? 1 : static_cast<uint32_t>(pick(1, 2));
      for (uint32_t rep = 0; rep < replicas; ++rep) {
        const size_t dim = pick(0, shape.size() - 1);
        const uint64_t max_pieces = std::min<uint64_t>(shape[dim], num_trainers);
        const uint64_t pieces = everyone_holds_all ? max_pieces : pick(1, max_pieces);
        std::vector<uint64_t> cuts{0, shape[dim]};
        while (cuts.size() < pieces + 1) {
          const uint64_t c = pick(1, shape[dim] - 1);
          if (std::find(cuts.begin(), cuts.end(), c) == cuts.end()) cuts.push_back(c);
        }
        std::sort(cuts.begin(), cuts.end());
        std::vector<uint32_t> owners(num_trainers);
        std::iota(owners.begin(), owners.end(), 0);
        std::shuffle(owners.begin(), owners.end(), rng);
        for (uint64_t k = 0; k < pieces; ++k) {
          std::vector<Range> box;
          for (size_t d = 0; d < shape.size(); ++d) box.push_back({0, shape[d]});
          box[dim] = {cuts[k], cuts[k + 1] - cuts[k]};
          // A rank holds one shard of a parameter: a piece whose rank has one already (from
          // the other replica) is dropped, and the schedule must find the tiling incomplete.
          auto& held = trainers[owners[k]].shards;
          if (std::none_of(held.begin(), held.end(),
                           [&](const Shard& x) { return x.name == name; })) {
            held.push_back(Shard{name, dtype, shape, box, rep});
          }
        }
        // With everyone eligible, the ranks left without a piece hold full copies (replicas
        // of their own).
        for (uint64_t k = pieces; everyone_holds_all && k < num_trainers; ++k) {
          trainers[owners[k]].shards.push_back(Shard{name, dtype, shape, {}, 1 + owners[k]});
        }
      }
      // Inference side: each rank holds it or not, whole or a slice along a random dim.
      for (auto& r : inference) {
        if (!everyone_holds_all && pick(0, 3) == 0) continue;
        Placement pl;
        if (pick(0, 2) != 0) {
          pl.dim = static_cast<int32_t>(pick(0, shape.size() - 1));
          const uint64_t n = shape[static_cast<size_t>(pl.dim)];
          const uint64_t start = pick(0, n - 1);
          pl.range = {start, pick(1, n - start)};
        }
        r.params.push_back(InferenceParam{name, dtype, shape, pl, {}});
      }
    }
    const uint64_t chunk = pick(1, 64);
    // Skip draws whose tilings collided (a piece left without a free rank): the schedule must
    // then say so, naming the parameter.
    auto s = compute_schedule(trainers, inference, {.chunk_bytes = chunk});
    if (!s) {
      EXPECT_NE(s.status().message().find("incomplete shards"), std::string::npos)
          << s.status().to_string();
      continue;
    }
    ++scheduled;
    SCOPED_TRACE("iteration " + std::to_string(iter));
    expect_exact_cover(*s, inference);
    // What the registry carries decodes to the same schedule: decode's checks (entries inside
    // their parameters among them) refuse nothing compute_schedule makes.
    auto decoded = Schedule::decode(s->encode());
    ASSERT_TRUE(decoded) << decoded.status().to_string();
    EXPECT_EQ(*decoded, *s);
    EXPECT_TRUE(s->check_destinations(inference)) << "a computed schedule writes past a tensor";
    uint64_t total = 0, max_entry = 0;
    for (const Entry& e : s->entries) {
      const auto& sp = s->params[e.param];
      EXPECT_TRUE(std::binary_search(sp.senders.begin(), sp.senders.end(), e.trainer));
      const auto& held = trainers[e.trainer].shards;
      EXPECT_TRUE(
          std::any_of(held.begin(), held.end(), [&](const Shard& x) { return x.name == sp.name; }));
      EXPECT_LT(e.nic, trainers[e.trainer].num_nics);
      EXPECT_LE(e.bytes(), chunk);
      total += e.bytes();
      max_entry = std::max(max_entry, e.bytes());
    }
    if (everyone_holds_all) {
      for (uint32_t t = 0; t < num_trainers; ++t) {
        const uint64_t mine = s->bytes_from(t);
        EXPECT_LE(mine, total / num_trainers + max_entry) << "trainer " << t;
        std::vector<uint64_t> nic(trainers[t].num_nics);
        for (const Entry& e : s->entries) {
          if (e.trainer == t) nic[e.nic] += e.bytes();
        }
        for (uint64_t b : nic) EXPECT_LE(b, mine / nic.size() + max_entry);
      }
    }
  }
  EXPECT_GE(scheduled, 200) << "too few draws gave a valid layout to check";
}

TEST(WeightsProjection, E4m3RoundsToNearestEvenAndSaturates) {
  EXPECT_EQ(float_to_e4m3(0.0f), 0x00);
  EXPECT_EQ(float_to_e4m3(-0.0f), 0x80);
  EXPECT_EQ(float_to_e4m3(1.0f), 0x38);
  EXPECT_EQ(float_to_e4m3(448.0f), 0x7e);
  EXPECT_EQ(float_to_e4m3(1e6f), 0x7e);
  EXPECT_EQ(float_to_e4m3(-1e6f), 0xfe);
  EXPECT_EQ(float_to_e4m3(1.0625f), 0x38);  // halfway between 1 and 1.125: to even (1)
  EXPECT_EQ(float_to_e4m3(1.1875f), 0x3a);  // halfway between 1.125 and 1.25: to even (1.25)
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -9)), 0x01);    // smallest subnormal
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -10)), 0x00);   // half of it: to even (0)
  EXPECT_EQ(float_to_e4m3(std::ldexp(3.0f, -10)), 0x02);   // 1.5 ulps: to even (2)
  EXPECT_EQ(float_to_e4m3(std::ldexp(15.5f, -10)), 0x08);  // rounds up into the normals
  // Every encoding (but NaN) decodes and encodes back to itself.
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7f) == 0x7f) continue;
    EXPECT_EQ(float_to_e4m3(e4m3_to_float(static_cast<uint8_t>(b))), b) << b;
  }
}

TEST(WeightsProjection, Fp8BlocksScaleByTileAmax) {
  const uint64_t rows = 130, cols = 3;
  std::vector<uint16_t> w(rows * cols);
  auto bf16 = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return static_cast<uint16_t>(u >> 16);
  };
  for (uint64_t i = 0; i < w.size(); ++i) w[i] = bf16(static_cast<float>(i % 17) - 8.0f);
  std::fill(w.begin() + 128 * cols, w.end(), 0);  // the second tile: rows 128, 129
  w[128 * cols] = bf16(-2.0f);
  std::vector<uint8_t> out(rows * cols);
  std::vector<float> scales(2);
  ASSERT_TRUE(quantize_fp8_blocks_cpu(w, rows, cols, 128, out, scales));
  EXPECT_EQ(scales[0], 8.0f / 448.0f);
  EXPECT_EQ(scales[1], 2.0f / 448.0f);
  EXPECT_EQ(out[128 * cols], 0xfe);  // -2 / (2/448) = -448
  for (uint64_t i = 0; i < 128 * cols; ++i) {
    const float x = bf16_to_float(w[i]);
    const float back = e4m3_to_float(out[i]) * scales[0];
    EXPECT_NEAR(back, x, std::fabs(x) / 16 + 1e-6) << i;
  }
  std::vector<float> zero_scales(1);
  std::vector<uint16_t> zeros(4);
  std::vector<uint8_t> zout(4, 0xff);
  ASSERT_TRUE(quantize_fp8_blocks_cpu(zeros, 2, 2, 128, zout, zero_scales));
  EXPECT_EQ(zero_scales[0], 1.0f);
  EXPECT_EQ(zout, std::vector<uint8_t>(4, 0));
  EXPECT_FALSE(quantize_fp8_blocks_cpu(zeros, 2, 2, 128, std::span(zout).first(3), zero_scales));
}

TEST(WeightsProjection, ConcatAlongEachDimension) {
  // [2, 3] and [2, 1] along dim 1; [1, 3] and [2, 3] along dim 0; int8 elements.
  std::vector<std::byte> a(6), b(2), c(3);
  for (int i = 0; i < 6; ++i) a[i] = std::byte(i);
  b = {std::byte{10}, std::byte{11}};
  for (int i = 0; i < 3; ++i) c[i] = std::byte(20 + i);
  std::vector<std::byte> out(8);
  ASSERT_TRUE(concat_cpu({a, b}, {{2, 3}, {2, 1}}, 1, 1, out));
  const std::vector<int> want1 = {0, 1, 2, 10, 3, 4, 5, 11};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(std::to_integer<int>(out[i]), want1[i]);
  std::vector<std::byte> out0(9);
  ASSERT_TRUE(concat_cpu({c, a}, {{1, 3}, {2, 3}}, 0, 1, out0));
  const std::vector<int> want0 = {20, 21, 22, 0, 1, 2, 3, 4, 5};
  for (int i = 0; i < 9; ++i) EXPECT_EQ(std::to_integer<int>(out0[i]), want0[i]);
  EXPECT_FALSE(concat_cpu({a, b}, {{2, 3}, {3, 1}}, 1, 1, out));
}

}  // namespace
}  // namespace fabric::weights
