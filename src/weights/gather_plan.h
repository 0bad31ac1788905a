// Gathers of a push whose trainers hold shards (FSDP, HSDP): which training rank sends which
// shard of each source to which, planned from the shards every trainer published, so that each
// rank writing a parameter holds its sources whole. A pure function of its inputs.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "fabric/status.h"
#include "fabric/weights.h"
#include "fabric/weights/flow.h"

namespace fabric::weights {

// For every parameter (indexed like schedule.params) and each of its sources, this rank's
// (`rank`) step: the shards it sends, those it receives, whether it holds the source already
// from an earlier parameter (`order`: the push's order). InvalidArgument when a rank writing a
// parameter holds no shard of one of its sources.
Result<std::vector<std::vector<GatherStep>>> plan_gathers(const Schedule& schedule,
                                                          std::span<const uint32_t> order,
                                                          const std::vector<TrainerRank>& trainers,
                                                          uint32_t rank);

}  // namespace fabric::weights
