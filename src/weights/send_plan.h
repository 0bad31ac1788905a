// What a training rank writes in every push, derived once, at connect, from the schedule and
// the inference ranks' endpoints: its entries per parameter, the ranks it writes into, where
// each parameter sits in each inference rank's layout, each FP8 parameter's other half, and
// the orders parameters are staged in. A pure function of its inputs; WeightSender keeps it.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "fabric/status.h"
#include "fabric/weights.h"
#include "fabric/weights/flow.h"

namespace fabric::weights {

struct SendPlan {
  std::vector<std::vector<Entry>> entries;  // per parameter: this rank's entries
  std::vector<uint32_t> targets;            // the inference ranks written into, ascending
  std::vector<std::vector<int64_t>> local;  // [inference rank][param]: its layout index, or -1
  std::vector<int64_t> partner;             // an FP8 parameter's other half (weight, scales), or -1
  std::vector<uint32_t> order;              // push_order(schedule): the gathers' order
  // push()'s order without gathers: the parameters as the inference ranks declared them
  // (usually their order in memory, so that consecutive writes are adjacent on both sides and
  // the engine joins them), then the rest in `order`.
  std::vector<uint32_t> layout_order;
};

// `endpoints` by inference rank (0..n-1, as many as the schedule's). kInvalidArgument: ranks
// that are not 0..n-1, an entry naming a parameter or rank out of range, malformed sources, FP8
// sources that are not 2-D, an inference rank written that does not hold the parameter.
Result<SendPlan> plan_sends(const Schedule& schedule, const std::vector<Endpoint>& endpoints,
                            uint32_t rank);

bool is_fp8(ProjectionKind kind);
// The 2-D shape an FP8 projection quantises: its sources joined along projection.dim ({0, 0}
// when a source is not 2-D).
std::pair<uint64_t, uint64_t> fp8_matrix(const ScheduledParam& param);

}  // namespace fabric::weights
