// plan_sends (src/weights/send_plan.h): what a training rank derives at connect from the
// schedule and the inference ranks' endpoints. No engine: endpoints without regions.
#include "weights/send_plan.h"

#include <gtest/gtest.h>

namespace fabric::weights {
namespace {

const Shape kShape{256, 128};

InferenceParam fp8(const std::string& name) {
  return {name,
          DType::kFloat8E4M3,
          kShape,
          {},
          Projection{ProjectionKind::kFp8Quantize, {"w"}, 0, 128}};
}
InferenceParam scales(const std::string& name) {
  return {name, DType::kFloat32, {2, 1}, {}, Projection{ProjectionKind::kFp8Scale, {"w"}, 0, 128}};
}
InferenceParam whole(const std::string& name, DType dtype, Shape shape) {
  return {name, dtype, std::move(shape), {}, {}};
}

// Training rank 0 holds "w" and "b"; inference rank 0 declares b, w8, w8.scale, rank 1 the FP8
// pair the other way round, then "w".
struct Fixture {
  TrainerRank trainer{
      0,
      1,
      {Shard{"w", DType::kBFloat16, kShape, {}, 0}, Shard{"b", DType::kFloat32, {64}, {}, 0}}};
  std::vector<Endpoint> endpoints{
      Endpoint{InferenceRank{0, {whole("b", DType::kFloat32, {64}), fp8("w8"), scales("w8.scale")}},
               {},
               {}},
      Endpoint{
          InferenceRank{1, {scales("w8.scale"), fp8("w8"), whole("w", DType::kBFloat16, kShape)}},
          {},
          {}}};
  Schedule schedule() const {
    std::vector<InferenceRank> layouts;
    for (const Endpoint& e : endpoints) layouts.push_back(e.layout);
    auto s = compute_schedule({trainer}, layouts, ScheduleOptions{4096});
    EXPECT_TRUE(s) << s.status().to_string();
    return *s;
  }
};

TEST(WeightsSendPlan, EntriesTargetsPlacesPartnersAndOrders) {
  Fixture f;
  const Schedule s = f.schedule();
  auto plan = plan_sends(s, f.endpoints, 0);
  ASSERT_TRUE(plan) << plan.status().to_string();
  const auto at = [&](const char* name) { return static_cast<uint32_t>(s.find(name)); };
  const uint32_t w = at("w"), b = at("b"), w8 = at("w8"), scale = at("w8.scale");
  EXPECT_EQ(plan->targets, (std::vector<uint32_t>{0, 1}));
  for (uint32_t p : {w, b, w8, scale}) {
    EXPECT_FALSE(plan->entries[p].empty()) << s.params[p].name;
    for (const Entry& e : plan->entries[p]) EXPECT_EQ(e.trainer, 0u);
  }
  EXPECT_EQ(plan->local[0][b], 0);
  EXPECT_EQ(plan->local[0][w], -1) << "rank 0 does not hold w";
  EXPECT_EQ(plan->local[1][w8], 1);
  EXPECT_EQ(plan->local[1][scale], 0);
  EXPECT_EQ(plan->partner[w8], scale);
  EXPECT_EQ(plan->partner[scale], w8);
  EXPECT_EQ(plan->partner[w], -1);
  EXPECT_EQ(plan->partner[b], -1);
  EXPECT_EQ(plan->order, push_order(s));
  EXPECT_EQ(plan->layout_order, (std::vector<uint32_t>{b, w8, scale, w}))
      << "rank 0's declarations first, then what only rank 1 holds";
  // Another training rank writes nothing.
  auto other = plan_sends(s, f.endpoints, 1);
  ASSERT_TRUE(other);
  EXPECT_TRUE(other->targets.empty());
}

TEST(WeightsSendPlan, EndpointsThatDoNotMatchTheScheduleAreRefusedNamingWhat) {
  Fixture f;
  const Schedule s = f.schedule();
  std::vector<Endpoint> swapped{f.endpoints[1], f.endpoints[0]};
  auto bad = plan_sends(s, swapped, 0);
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("rank 0 is missing"), std::string::npos)
      << bad.status().message();
  // Rank 1's endpoint lost "w", which the schedule writes there.
  std::vector<Endpoint> lacking = f.endpoints;
  lacking[1].layout.params.pop_back();
  bad = plan_sends(s, lacking, 0);
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.status().message().find("parameter 'w': inference rank 1 does not hold it"),
            std::string::npos)
      << bad.status().message();
  // Fewer endpoints than the entries name.
  bad = plan_sends(s, {f.endpoints[0]}, 0);
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.status().message().find("inference rank 1 of 1"), std::string::npos)
      << bad.status().message();
}

}  // namespace
}  // namespace fabric::weights
