#include "engine/plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>

namespace fabric::engine {

namespace {

void append_split(std::vector<Shard>& out, uint32_t domain, uint64_t offset, uint64_t length,
                  uint64_t max_wr) {
  if (length == 0 || max_wr == 0) {
    out.push_back({domain, offset, length});
    return;
  }
  for (uint64_t done = 0; done < length;) {
    uint64_t n = std::min(max_wr, length - done);
    out.push_back({domain, offset + done, n});
    done += n;
  }
}

__extension__ typedef unsigned __int128 Wide;  // products of a 64-bit length and a weight

// The weights of the NICs `domains` (positions into `weights`) after the rules of plan.h:
// unmeasured (0) ones and those near the largest measured weight take it, all are raised to
// the floor; none given or none measured: all 1.
std::vector<uint64_t> effective_weights(std::span<const uint64_t> weights,
                                        const std::vector<uint32_t>& domains) {
  std::vector<uint64_t> w(domains.size(), 1);
  uint64_t top = 0;
  for (uint32_t d : domains) {
    if (d < weights.size()) top = std::max(top, weights[d]);
  }
  if (top == 0) return w;
  const uint64_t floor = std::max<uint64_t>(top / kWeightFloorDivisor, 1);
  const uint64_t near = top - top / kWeightSnapDivisor;
  for (size_t i = 0; i < domains.size(); ++i) {
    const uint64_t x = domains[i] < weights.size() ? weights[domains[i]] : 0;
    w[i] = x == 0 || x >= near ? top : std::max(x, floor);
  }
  return w;
}

bool all_equal(const std::vector<uint64_t>& w) {
  return std::adjacent_find(w.begin(), w.end(), std::not_equal_to<>()) == w.end();
}

// Splits `total` units in proportion to `w` (largest remainders get the units left over, ties
// to the earlier position): the parts sum to `total` exactly. Equal weights give total / n
// each, the first total % n one more.
std::vector<uint64_t> apportion(uint64_t total, const std::vector<uint64_t>& w) {
  Wide sum = 0;
  for (uint64_t x : w) sum += x;
  std::vector<uint64_t> parts(w.size());
  std::vector<Wide> rest(w.size());
  uint64_t given = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    const Wide p = static_cast<Wide>(total) * w[i];
    parts[i] = static_cast<uint64_t>(p / sum);
    rest[i] = p % sum;
    given += parts[i];
  }
  std::vector<size_t> order(w.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return rest[a] > rest[b]; });
  for (size_t k = 0; given < total; ++k, ++given) ++parts[order[k]];  // fewer than w.size()
  return parts;
}

}  // namespace

std::vector<Shard> plan_single(uint64_t length, uint32_t num_domains, const Routing& routing,
                               uint32_t rotation, const ShardParams& params,
                               std::span<const uint64_t> weights) {
  std::vector<Shard> out;
  plan_single(out, length, num_domains, routing, rotation, params, weights);
  return out;
}

void plan_single(std::vector<Shard>& out, uint64_t length, uint32_t num_domains,
                 const Routing& routing, uint32_t rotation, const ShardParams& params,
                 std::span<const uint64_t> weights) {
  out.clear();
  if (routing.kind == Routing::Kind::kPinned) {
    append_split(out, routing.nic, 0, length, params.max_wr_bytes);
    return;
  }
  const uint32_t first = rotation % num_domains;
  uint64_t shards = routing.shards == 0 ? num_domains : std::min(routing.shards, num_domains);
  if (length < params.min_bytes || shards <= 1) {
    append_split(out, first, 0, length, params.max_wr_bytes);
    return;
  }
  const uint64_t align = std::max<uint64_t>(params.alignment, 1);
  if (!weights.empty()) {  // no weights: all equal, nothing to build
    std::vector<uint32_t> domains(shards);
    for (uint32_t i = 0; i < shards; ++i) domains[i] = (first + i) % num_domains;
    if (const std::vector<uint64_t> w = effective_weights(weights, domains); !all_equal(w)) {
      // Whole alignment units by weight; the bytes below one unit ride on the last shard.
      const std::vector<uint64_t> units = apportion(length / align, w);
      uint64_t offset = 0;
      for (uint32_t i = 0; i < shards; ++i) {
        const uint64_t n = units[i] * align + (i + 1 == shards ? length % align : 0);
        if (n == 0) continue;
        append_split(out, domains[i], offset, n, params.max_wr_bytes);
        offset += n;
      }
      return;
    }
  }
  uint64_t size = length / shards + (length % shards != 0);  // ceil, without overflow
  size = (size / align + (size % align != 0)) * align;       // round up to the alignment
  uint32_t index = 0;
  for (uint64_t offset = 0; offset < length; offset += size, ++index) {
    uint64_t n = std::min(size, length - offset);
    append_split(out, (first + index) % num_domains, offset, n, params.max_wr_bytes);
  }
}

std::vector<Run> split_even(size_t count, uint32_t num_domains, uint32_t rotation,
                            std::span<const uint64_t> weights) {
  std::vector<Run> out;
  split_even(out, count, num_domains, rotation, weights);
  return out;
}

void split_even(std::vector<Run>& out, size_t count, uint32_t num_domains, uint32_t rotation,
                std::span<const uint64_t> weights) {
  out.clear();
  if (weights.empty()) {  // equal: count / n each, the first count % n one more; nothing built
    size_t begin = 0;
    for (uint32_t i = 0; i < num_domains; ++i) {
      const size_t n = count / num_domains + (i < count % num_domains);
      if (n == 0) continue;
      out.push_back({(rotation + i) % num_domains, begin, begin + n});
      begin += n;
    }
    return;
  }
  std::vector<uint32_t> domains(num_domains);
  for (uint32_t i = 0; i < num_domains; ++i) domains[i] = (rotation + i) % num_domains;
  const std::vector<uint64_t> sizes = apportion(count, effective_weights(weights, domains));
  size_t begin = 0;
  for (uint32_t i = 0; i < num_domains; ++i) {
    const size_t n = sizes[i];
    if (n == 0) continue;
    out.push_back({(rotation + i) % num_domains, begin, begin + n});
    begin += n;
  }
}

namespace {

std::vector<uint32_t> up_list(const std::vector<bool>& up) {
  std::vector<uint32_t> out;
  for (uint32_t i = 0; i < up.size(); ++i) {
    if (up[i]) out.push_back(i);
  }
  if (out.empty()) {
    for (uint32_t i = 0; i < up.size(); ++i) out.push_back(i);
  }
  return out;
}

// The weights of `nics` (real NIC indices), by position; empty when none are given.
std::vector<uint64_t> up_weights(std::span<const uint64_t> weights,
                                 const std::vector<uint32_t>& nics) {
  std::vector<uint64_t> out;
  if (weights.empty()) return out;
  for (uint32_t n : nics) out.push_back(n < weights.size() ? weights[n] : 0);
  return out;
}

}  // namespace

uint32_t failover_nic(uint32_t nic, const std::vector<bool>& up, uint32_t salt) {
  if (nic < up.size() && up[nic]) return nic;
  std::vector<uint32_t> after;  // the up NICs in the order nic + 1, nic + 2, ... (wrapping)
  for (uint32_t k = 1; k <= up.size(); ++k) {
    const uint32_t i = static_cast<uint32_t>((nic + k) % up.size());
    if (up[i]) after.push_back(i);
  }
  if (after.empty()) return nic;
  return after[salt % after.size()];
}

std::vector<Shard> plan_single_up(uint64_t length, const std::vector<bool>& up,
                                  const Routing& routing, uint32_t rotation,
                                  const ShardParams& params, std::span<const uint64_t> weights) {
  std::vector<Shard> out;
  plan_single_up(out, length, up, routing, rotation, params, weights);
  return out;
}

void plan_single_up(std::vector<Shard>& out, uint64_t length, const std::vector<bool>& up,
                    const Routing& routing, uint32_t rotation, const ShardParams& params,
                    std::span<const uint64_t> weights) {
  const auto n = static_cast<uint32_t>(up.size());
  if (routing.kind == Routing::Kind::kPinned) {
    // The common case (every target of a scatter by peer) in one step: the NIC is up and the
    // write fits one work request; what plan_single and append_split would give.
    if (routing.nic < n && up[routing.nic] &&
        (length <= params.max_wr_bytes || params.max_wr_bytes == 0)) {
      out.clear();
      out.push_back({routing.nic, 0, length});
      return;
    }
    plan_single(out, length, n, Routing::pinned(failover_nic(routing.nic, up, rotation)), rotation,
                params);
    return;
  }
  // Every NIC up (the common case): the NIC list is the identity, nothing to build or map.
  if ((n == 1 && up[0]) || std::all_of(up.begin(), up.end(), [](bool b) { return b; })) {
    // One shard that fits one work request (a write below shard_min_bytes, one NIC, or one
    // shard asked for): what plan_single and append_split would give, in one step.
    if (n > 0 && (length < params.min_bytes || n == 1 || routing.shards == 1) &&
        (length <= params.max_wr_bytes || params.max_wr_bytes == 0)) {
      out.clear();
      out.push_back({rotation % n, 0, length});
      return;
    }
    plan_single(out, length, n, routing, rotation, params, weights);
    return;
  }
  const std::vector<uint32_t> nics = up_list(up);
  plan_single(out, length, static_cast<uint32_t>(nics.size()), routing, rotation, params,
              up_weights(weights, nics));
  for (Shard& s : out) s.domain = nics[s.domain];
}

std::vector<Run> split_even_up(size_t count, const std::vector<bool>& up, uint32_t rotation,
                               std::span<const uint64_t> weights) {
  std::vector<Run> out;
  split_even_up(out, count, up, rotation, weights);
  return out;
}

void split_even_up(std::vector<Run>& out, size_t count, const std::vector<bool>& up,
                   uint32_t rotation, std::span<const uint64_t> weights) {
  if (std::all_of(up.begin(), up.end(), [](bool b) { return b; })) {
    split_even(out, count, static_cast<uint32_t>(up.size()), rotation, weights);
    return;
  }
  const std::vector<uint32_t> nics = up_list(up);
  split_even(out, count, static_cast<uint32_t>(nics.size()), rotation, up_weights(weights, nics));
  for (Run& r : out) r.domain = nics[r.domain];
}

Status check_range(std::string_view what, uint64_t offset, uint64_t length, uint64_t region) {
  if (!in_range(offset, length, region)) {
    return Status(ErrorCode::kOutOfRange,
                  fmt::format("{}: offset {} + length {} exceeds the region's {} bytes", what,
                              offset, length, region));
  }
  return Status::ok();
}

Status page_offset(std::string_view op, std::string_view side, size_t i, uint32_t index,
                   uint64_t stride, uint64_t base, uint64_t region, uint64_t page_bytes,
                   uint64_t& out) {
  uint64_t scaled = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(index), stride, &scaled) ||
      __builtin_add_overflow(scaled, base, &out)) {
    return Status(ErrorCode::kOutOfRange,
                  fmt::format("{}: {}_pages[{}] = {} overflows the offset", op, side, i, index));
  }
  if (in_range(out, page_bytes, region)) return Status::ok();  // no formatting
  return check_range(fmt::format("{}: {}_pages[{}] = {}", op, side, i, index), out, page_bytes,
                     region);
}

}  // namespace fabric::engine
