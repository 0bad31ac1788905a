// compute_schedule: checks both sides' descriptions, then cuts every inference rank's local
// tensor of every parameter into strided writes and gives each to a training rank.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <set>

#include "common/invalid.h"
#include "fabric/weights.h"

namespace fabric::weights {

using fabric::invalid;  // common/invalid.h
namespace {

// The most NICs a training rank may have (as many as an engine's device group may: an
// Address holds at most 64): the schedule keeps a load per NIC.
constexpr uint32_t kMaxNics = 64;

std::string shape_str(const Shape& s) {
  return fmt::format("[{}]", fmt::join(s, ", "));
}

// Every training parameter, from all ranks' shards.
struct TrainingParam {
  DType dtype;
  Shape shape;
  uint32_t first_rank;
  std::map<uint32_t, std::vector<std::pair<uint32_t, std::vector<Range>>>> replicas;
  std::set<uint32_t> holders;
};

// The box as ranges over every dimension (an empty box is the whole tensor).
std::vector<Range> full_box(const Shard& s) {
  if (!s.box.empty()) return s.box;
  std::vector<Range> box;
  for (uint64_t d : s.shape) box.push_back({0, d});
  return box;
}

bool boxes_overlap(const std::vector<Range>& a, const std::vector<Range>& b) {
  for (size_t d = 0; d < a.size(); ++d) {
    if (a[d].start + a[d].length <= b[d].start || b[d].start + b[d].length <= a[d].start) {
      return false;
    }
  }
  return true;
}

uint64_t box_volume(const std::vector<Range>& box) {
  uint64_t v = 1;
  for (const Range& r : box) v *= r.length;
  return v;
}

Status check_ranks(std::string_view side, const std::vector<uint32_t>& ranks) {
  std::vector<bool> seen(ranks.size());
  for (uint32_t r : ranks) {
    if (r >= ranks.size() || seen[r]) {
      return invalid(fmt::format("{} ranks must be numbered 0..{} once each (rank {})", side,
                                 ranks.size() == 0 ? 0 : ranks.size() - 1, r));
    }
    seen[r] = true;
  }
  return Status::ok();
}

Result<std::map<std::string, TrainingParam>> collect_training(
    const std::vector<TrainerRank>& trainers) {
  std::vector<uint32_t> ranks;
  for (const auto& t : trainers) ranks.push_back(t.rank);
  if (Status s = check_ranks("training", ranks); !s) return s;
  std::map<std::string, TrainingParam> params;
  for (const TrainerRank& t : trainers) {
    if (t.num_nics == 0 || t.num_nics > kMaxNics) {
      return invalid(
          fmt::format("training rank {}: num_nics is {} (1 to {})", t.rank, t.num_nics, kMaxNics));
    }
    std::set<std::string_view> names;
    for (const Shard& s : t.shards) {
      const std::string where = fmt::format("training parameter '{}' (rank {})", s.name, t.rank);
      if (s.name.empty())
        return invalid(fmt::format("training rank {}: a shard has no name", t.rank));
      if (!names.insert(s.name).second) return invalid(where + ": two shards on one rank");
      if (!s.box.empty() && s.box.size() != s.shape.size()) {
        return invalid(fmt::format("{}: a box of {} ranges for a {}-D shape", where, s.box.size(),
                                   s.shape.size()));
      }
      for (size_t d = 0; d < s.box.size(); ++d) {
        const Range& r = s.box[d];
        if (r.length == 0 || r.start > s.shape[d] || r.length > s.shape[d] - r.start) {
          return invalid(fmt::format("{}: box range [{}, {}) of dim {} outside its size {}", where,
                                     r.start, r.start + r.length, d, s.shape[d]));
        }
      }
      auto [it, fresh] =
          params.try_emplace(s.name, TrainingParam{s.dtype, s.shape, t.rank, {}, {}});
      TrainingParam& p = it->second;
      if (!fresh && (p.dtype != s.dtype || p.shape != s.shape)) {
        return invalid(fmt::format("{}: {} {} here but {} {} on rank {}", where, to_string(s.dtype),
                                   shape_str(s.shape), to_string(p.dtype), shape_str(p.shape),
                                   p.first_rank));
      }
      p.replicas[s.replica].push_back({t.rank, full_box(s)});
      p.holders.insert(t.rank);
    }
  }
  // Each replica must tile its tensor: pairwise disjoint boxes whose volumes add up.
  for (const auto& [name, p] : params) {
    const uint64_t total = num_elements(p.shape);
    for (const auto& [replica, boxes] : p.replicas) {
      uint64_t covered = 0;
      for (size_t i = 0; i < boxes.size(); ++i) {
        covered += box_volume(boxes[i].second);
        for (size_t j = i + 1; j < boxes.size(); ++j) {
          if (boxes_overlap(boxes[i].second, boxes[j].second)) {
            return invalid(fmt::format(
                "training parameter '{}': the shards of ranks {} and {} overlap (replica {})", name,
                boxes[i].first, boxes[j].first, replica));
          }
        }
      }
      if (covered != total) {
        return invalid(fmt::format(
            "training parameter '{}': incomplete shards: replica {} covers {} of {} elements", name,
            replica, covered, total));
      }
    }
  }
  return params;
}

// The dtype rule of each projection: what the sources and the result must be.
Status check_dtypes(const std::string& name, const InferenceParam& p,
                    const std::vector<DType>& sources) {
  auto no_projection = [&](DType from) {
    return invalid(fmt::format("parameter '{}': dtype {} -> {} has no {} projection", name,
                               to_string(from), to_string(p.dtype), to_string(p.projection.kind)));
  };
  for (DType from : sources) {
    switch (p.projection.kind) {
      case ProjectionKind::kIdentity:
      case ProjectionKind::kConcat:
        if (from != p.dtype) return no_projection(from);
        break;
      case ProjectionKind::kFp8Quantize:
        if (from != DType::kBFloat16 || p.dtype != DType::kFloat8E4M3) return no_projection(from);
        break;
      case ProjectionKind::kFp8Scale:
        if (from != DType::kBFloat16 || p.dtype != DType::kFloat32) return no_projection(from);
        break;
    }
  }
  return Status::ok();
}

// A piece of a local tensor before it has a sender.
struct Piece {
  uint32_t param;
  uint32_t inference;
  uint64_t src_offset, length, runs, src_stride, dst_offset, dst_stride;
};

// Cuts one rank's local tensor of `p` into pieces of at most `chunk` bytes (whole runs where a
// run fits in a chunk).
void cut(uint32_t param_index, uint32_t inference, const InferenceParam& p, uint64_t chunk,
         std::vector<Piece>& out) {
  const uint64_t eb = element_bytes(p.dtype);
  uint64_t outer = 1, inner = eb, run_start = 0, run_elems = 0, dim_size = 1;
  if (p.placement.dim < 0) {
    run_elems = num_elements(p.shape);
  } else {
    const size_t d = static_cast<size_t>(p.placement.dim);
    for (size_t i = 0; i < d; ++i) outer *= p.shape[i];
    for (size_t i = d + 1; i < p.shape.size(); ++i) inner *= p.shape[i];
    run_start = p.placement.range.start;
    run_elems = p.placement.range.length;
    dim_size = p.shape[d];
  }
  uint64_t length = run_elems * (p.placement.dim < 0 ? eb : inner);
  uint64_t src_offset = run_start * inner;
  uint64_t src_stride = dim_size * inner;
  uint64_t runs = outer;
  if (length == 0 || runs == 0) return;
  if (runs > 1 && length == src_stride) {  // the whole dimension: one contiguous range
    length *= runs;
    runs = 1;
  }
  if (length >= chunk || runs == 1) {
    for (uint64_t r = 0; r < runs; ++r) {
      for (uint64_t at = 0; at < length; at += chunk) {
        const uint64_t n = std::min(chunk, length - at);
        out.push_back({param_index, inference, src_offset + r * src_stride + at, n, 1, 0,
                       r * length + at, 0});
      }
    }
    return;
  }
  const uint64_t per_piece = std::max<uint64_t>(1, chunk / length);
  for (uint64_t r = 0; r < runs; r += per_piece) {
    const uint64_t n = std::min(per_piece, runs - r);
    out.push_back({param_index, inference, src_offset + r * src_stride, length, n,
                   n > 1 ? src_stride : 0, r * length, n > 1 ? length : 0});
  }
}

}  // namespace

Result<Schedule> compute_schedule(const std::vector<TrainerRank>& trainers,
                                  const std::vector<InferenceRank>& inference,
                                  const ScheduleOptions& options) {
  if (trainers.empty()) return invalid("no training ranks");
  if (inference.empty()) return invalid("no inference ranks");
  if (options.chunk_bytes == 0) return invalid("chunk_bytes is 0");
  auto training = collect_training(trainers);
  if (!training) return training.status();

  std::vector<uint32_t> ranks;
  for (const auto& r : inference) ranks.push_back(r.rank);
  if (Status s = check_ranks("inference", ranks); !s) return s;

  // Every inference parameter name once, checked against the first rank that holds it.
  Schedule schedule;
  schedule.num_trainers = static_cast<uint32_t>(trainers.size());
  schedule.num_inference = static_cast<uint32_t>(inference.size());
  std::map<std::string, std::pair<const InferenceParam*, uint32_t>> first;
  for (const InferenceRank& r : inference) {
    std::set<std::string_view> names;
    for (const InferenceParam& p : r.params) {
      const std::string where = fmt::format("parameter '{}' (inference rank {})", p.name, r.rank);
      if (p.name.empty())
        return invalid(fmt::format("inference rank {}: a parameter has no name", r.rank));
      if (!names.insert(p.name).second) return invalid(where + ": twice on one rank");
      if (p.placement.dim >= 0) {
        const auto d = static_cast<size_t>(p.placement.dim);
        const Range& rg = p.placement.range;
        if (d >= p.shape.size() || rg.length == 0 || rg.start > p.shape[d] ||
            rg.length > p.shape[d] - rg.start) {
          return invalid(fmt::format("{}: placement [{}, {}) of dim {} outside shape {}", where,
                                     rg.start, rg.start + rg.length, d, shape_str(p.shape)));
        }
      }
      auto [it, fresh] = first.try_emplace(p.name, &p, r.rank);
      const InferenceParam& q = *it->second.first;
      if (!fresh && (q.dtype != p.dtype || q.shape != p.shape || !(q.projection == p.projection))) {
        return invalid(fmt::format("{}: its dtype, shape or projection differs from rank {}'s",
                                   where, it->second.second));
      }
    }
  }
  for (const auto& [name, entry] : first) {
    const InferenceParam& p = *entry.first;
    ScheduledParam sp{name, p.dtype, p.shape, p.projection, {}, {}, {}};
    std::vector<std::string> sources = p.projection.sources;
    if (sources.empty()) sources.push_back(name);
    std::set<uint32_t> senders;
    for (size_t i = 0; i < sources.size(); ++i) {
      auto it = training->find(sources[i]);
      if (it == training->end()) {
        return Status(ErrorCode::kNotFound,
                      fmt::format("parameter '{}': no training rank holds its source '{}'", name,
                                  sources[i]));
      }
      sp.source_dtypes.push_back(it->second.dtype);
      sp.source_shapes.push_back(it->second.shape);
      if (i == 0) {
        senders = it->second.holders;
      } else {
        std::erase_if(senders, [&](uint32_t r) { return !it->second.holders.contains(r); });
      }
    }
    if (Status s = check_dtypes(name, p, sp.source_dtypes); !s) return s;
    auto shape = projected_shape(name, p.projection, sp.source_shapes);
    if (!shape) return shape.status();
    if (*shape != p.shape) {
      return invalid(
          fmt::format("parameter '{}': shape mismatch: the {} projection of the "
                      "training side gives {}, the inference side has {}",
                      name, to_string(p.projection.kind), shape_str(*shape), shape_str(p.shape)));
    }
    if (senders.empty()) {
      return invalid(
          fmt::format("parameter '{}': no training rank holds shards of all its "
                      "sources ({})",
                      name, fmt::join(sources, ", ")));
    }
    sp.senders.assign(senders.begin(), senders.end());
    sp.projection.sources = std::move(sources);
    schedule.params.push_back(std::move(sp));
  }

  // Cut, then hand the pieces out largest first to the least-loaded eligible rank and NIC.
  std::vector<Piece> pieces;
  for (const InferenceRank& r : inference) {
    for (const InferenceParam& p : r.params) {
      const auto index = static_cast<uint32_t>(schedule.find(p.name));
      cut(index, r.rank, p, options.chunk_bytes, pieces);
    }
  }
  std::stable_sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) {
    return a.length * a.runs > b.length * b.runs;
  });
  std::vector<uint64_t> load(trainers.size());
  std::vector<std::vector<uint64_t>> nic_load(trainers.size());
  for (const TrainerRank& t : trainers) nic_load[t.rank].assign(t.num_nics, 0);
  schedule.entries.reserve(pieces.size());
  for (const Piece& piece : pieces) {
    const auto& senders = schedule.params[piece.param].senders;
    uint32_t best = senders[0];
    for (uint32_t r : senders) {
      if (load[r] < load[best]) best = r;
    }
    auto& nics = nic_load[best];
    const auto nic =
        static_cast<uint32_t>(std::min_element(nics.begin(), nics.end()) - nics.begin());
    const uint64_t bytes = piece.length * piece.runs;
    load[best] += bytes;
    nics[nic] += bytes;
    schedule.entries.push_back(Entry{best, nic, piece.param, piece.inference, piece.src_offset,
                                     piece.length, piece.runs, piece.src_stride, piece.dst_offset,
                                     piece.dst_stride});
  }
  std::sort(schedule.entries.begin(), schedule.entries.end(), [](const Entry& a, const Entry& b) {
    return std::tie(a.trainer, a.param, a.inference, a.dst_offset) <
           std::tie(b.trainer, b.param, b.inference, b.dst_offset);
  });
  return schedule;
}

uint64_t Schedule::bytes_from(uint32_t trainer) const {
  uint64_t n = 0;
  for (const Entry& e : entries) {
    if (e.trainer == trainer) n += e.bytes();
  }
  return n;
}

uint64_t Schedule::writes_into(uint32_t inference) const {
  uint64_t n = 0;
  for (const Entry& e : entries) {
    if (e.inference == inference) n += e.runs;
  }
  return n;
}

int64_t Schedule::find(std::string_view name) const {
  auto it =
      std::lower_bound(params.begin(), params.end(), name,
                       [](const ScheduledParam& p, std::string_view n) { return p.name < n; });
  if (it == params.end() || it->name != name) return -1;
  return it - params.begin();
}

}  // namespace fabric::weights
