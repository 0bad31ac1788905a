// plan_sends (send_plan.h) and push_order (fabric/weights/flow.h).
#include "weights/send_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <tuple>

#include "common/invalid.h"

namespace fabric::weights {

using fabric::invalid;  // common/invalid.h

bool is_fp8(ProjectionKind kind) {
  return kind == ProjectionKind::kFp8Quantize || kind == ProjectionKind::kFp8Scale;
}

std::pair<uint64_t, uint64_t> fp8_matrix(const ScheduledParam& p) {
  uint64_t rows = 0, cols = 0;
  for (size_t i = 0; i < p.source_shapes.size(); ++i) {
    const Shape& s = p.source_shapes[i];
    if (s.size() != 2) return {0, 0};
    if (i == 0 || p.projection.dim != 0) rows = s[0];
    if (i == 0 || p.projection.dim != 1) cols = s[1];
    if (i > 0 && p.projection.dim == 0) rows += s[0];
    if (i > 0 && p.projection.dim == 1) cols += s[1];
  }
  return {rows, cols};
}

std::vector<uint32_t> push_order(const Schedule& schedule) {
  std::vector<uint32_t> order(schedule.params.size());
  for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    const ScheduledParam& x = schedule.params[a];
    const ScheduledParam& y = schedule.params[b];
    if (x.projection.sources != y.projection.sources) {
      return x.projection.sources < y.projection.sources;
    }
    return x.name < y.name;
  });
  return order;
}

Result<SendPlan> plan_sends(const Schedule& s, const std::vector<Endpoint>& endpoints,
                            uint32_t rank) {
  for (uint32_t i = 0; i < endpoints.size(); ++i) {
    if (endpoints[i].layout.rank != i) {
      return invalid(fmt::format(
          "WeightSender.connect: the endpoints' ranks are not 0..{} (rank {} is missing)",
          endpoints.size() - 1, i));
    }
  }
  const size_t n = s.params.size();
  SendPlan plan;
  plan.entries.resize(n);
  std::set<uint32_t> targets;
  for (const Entry& e : s.entries) {
    if (e.trainer != rank) continue;
    if (e.param >= n || e.inference >= endpoints.size()) {
      return invalid(
          fmt::format("WeightSender.connect: an entry names parameter {} of {} or "
                      "inference rank {} of {}",
                      e.param, n, e.inference, endpoints.size()));
    }
    plan.entries[e.param].push_back(e);
    targets.insert(e.inference);
  }
  plan.targets.assign(targets.begin(), targets.end());
  plan.local.assign(endpoints.size(), std::vector<int64_t>(n, -1));
  for (uint32_t r = 0; r < endpoints.size(); ++r) {
    const auto& params = endpoints[r].layout.params;
    for (size_t k = 0; k < params.size(); ++k) {
      const int64_t at = s.find(params[k].name);
      if (at >= 0) plan.local[r][static_cast<size_t>(at)] = static_cast<int64_t>(k);
    }
  }
  for (size_t p = 0; p < n; ++p) {
    const ScheduledParam& q = s.params[p];
    if (q.projection.sources.size() != q.source_shapes.size() ||
        q.source_dtypes.size() != q.source_shapes.size() || q.source_shapes.empty()) {
      return invalid(fmt::format("parameter '{}': the schedule's sources are malformed", q.name));
    }
    if (is_fp8(q.projection.kind) && fp8_matrix(q).first == 0 && num_elements(q.shape) > 0) {
      return invalid(fmt::format("parameter '{}': FP8 sources must be 2-D", q.name));
    }
    for (const Entry& e : plan.entries[p]) {
      if (plan.local[e.inference][p] < 0) {
        return invalid(
            fmt::format("parameter '{}': inference rank {} does not hold it", q.name, e.inference));
      }
    }
  }
  // An FP8 weight's scales, and the scales' weight: the other FP8 parameter made from the same
  // sources (joined along the same dim) with the same block.
  plan.partner.assign(n, -1);
  std::map<std::tuple<std::vector<std::string>, uint32_t, uint32_t>, std::vector<uint32_t>> groups;
  for (uint32_t p = 0; p < n; ++p) {
    const Projection& pr = s.params[p].projection;
    if (!is_fp8(pr.kind)) continue;
    groups[{pr.sources, pr.block, pr.sources.size() > 1 ? pr.dim : 0}].push_back(p);
  }
  for (const auto& [key, g] : groups) {
    for (uint32_t a : g) {
      for (uint32_t b : g) {
        if (a != b && s.params[a].projection.kind != s.params[b].projection.kind) {
          plan.partner[a] = b;
          break;
        }
      }
    }
  }
  plan.order = push_order(s);
  std::vector<bool> placed(n, false);
  for (const Endpoint& ep : endpoints) {
    for (const InferenceParam& p : ep.layout.params) {
      const int64_t at = s.find(p.name);
      if (at >= 0 && !placed[static_cast<size_t>(at)]) {
        placed[static_cast<size_t>(at)] = true;
        plan.layout_order.push_back(static_cast<uint32_t>(at));
      }
    }
  }
  for (uint32_t p : plan.order) {
    if (!placed[p]) plan.layout_order.push_back(p);
  }
  return plan;
}

}  // namespace fabric::weights
