// plan_gathers (gather_plan.h): per parameter in push order, the ranks that write it must hold
// each source whole; a rank that holds only a shard receives the other shards of its replica
// from their holders, unless an earlier parameter already gathered that source on it.
#include "weights/gather_plan.h"

#include <fmt/format.h>

#include <map>
#include <set>
#include <string>

#include "common/invalid.h"

namespace fabric::weights {

Result<std::vector<std::vector<GatherStep>>> plan_gathers(const Schedule& schedule,
                                                          std::span<const uint32_t> order,
                                                          const std::vector<TrainerRank>& trainers,
                                                          uint32_t rank) {
  // Who holds a shard of each training parameter, by rank.
  std::map<std::string, std::map<uint32_t, const Shard*>> holders;
  for (const TrainerRank& t : trainers) {
    for (const Shard& sh : t.shards) holders[sh.name][t.rank] = &sh;
  }
  std::vector<std::set<uint32_t>> writers(schedule.params.size());
  for (const Entry& e : schedule.entries) {
    if (e.param < writers.size()) writers[e.param].insert(e.trainer);
  }
  std::vector<std::vector<GatherStep>> steps(schedule.params.size());
  std::map<std::string, std::set<uint32_t>> have;  // ranks holding a source whole
  for (uint32_t index : order) {
    const auto& sources = schedule.params[index].projection.sources;
    steps[index].resize(sources.size());
    std::map<std::string, std::set<uint32_t>> after;
    for (size_t k = 0; k < sources.size(); ++k) {
      const auto& held = holders[sources[k]];
      const std::set<uint32_t>& before = have[sources[k]];
      GatherStep& step = steps[index][k];
      step.reuse = before.count(rank) > 0;
      for (uint32_t n : writers[index]) {
        if (before.count(n)) continue;
        auto it = held.find(n);
        if (it == held.end()) {
          return invalid(
              fmt::format("parameter '{}': training rank {} writes it but holds "
                          "no shard of '{}'",
                          schedule.params[index].name, n, sources[k]));
        }
        const Shard& mine = *it->second;
        if (mine.box.empty()) continue;  // whole: nothing to receive
        for (const auto& [h, shard] : held) {
          if (h == n || shard->replica != mine.replica) continue;
          if (h == rank) step.sends.emplace_back(n, shard->box);
          if (n == rank) step.recvs.emplace_back(h, shard->box);
        }
      }
      std::set<uint32_t> now = before;
      now.insert(writers[index].begin(), writers[index].end());
      after[sources[k]] = std::move(now);
    }
    have = std::move(after);
  }
  return steps;
}

}  // namespace fabric::weights
