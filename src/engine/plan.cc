#include "engine/plan.h"

#include <fmt/format.h>

#include <algorithm>

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

}  // namespace

std::vector<Shard> plan_single(uint64_t length, uint32_t num_domains, const Routing& routing,
                               uint32_t rotation, const ShardParams& params) {
  std::vector<Shard> out;
  if (routing.kind == Routing::Kind::kPinned) {
    append_split(out, routing.nic, 0, length, params.max_wr_bytes);
    return out;
  }
  const uint32_t first = rotation % num_domains;
  uint64_t shards = routing.shards == 0 ? num_domains : std::min(routing.shards, num_domains);
  if (length < params.min_bytes || shards <= 1) {
    append_split(out, first, 0, length, params.max_wr_bytes);
    return out;
  }
  const uint64_t align = std::max<uint64_t>(params.alignment, 1);
  uint64_t size = length / shards + (length % shards != 0);  // ceil, without overflow
  size = (size / align + (size % align != 0)) * align;       // round up to the alignment
  uint32_t index = 0;
  for (uint64_t offset = 0; offset < length; offset += size, ++index) {
    uint64_t n = std::min(size, length - offset);
    append_split(out, (first + index) % num_domains, offset, n, params.max_wr_bytes);
  }
  return out;
}

std::vector<Run> split_even(size_t count, uint32_t num_domains, uint32_t rotation) {
  std::vector<Run> out;
  const size_t base = count / num_domains;
  const size_t extra = count % num_domains;
  size_t begin = 0;
  for (uint32_t i = 0; i < num_domains; ++i) {
    size_t n = base + (i < extra ? 1 : 0);
    if (n == 0) continue;
    out.push_back({(rotation + i) % num_domains, begin, begin + n});
    begin += n;
  }
  return out;
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
                                  const ShardParams& params) {
  if (routing.kind == Routing::Kind::kPinned) {
    return plan_single(length, static_cast<uint32_t>(up.size()),
                       Routing::pinned(failover_nic(routing.nic, up, rotation)), rotation, params);
  }
  const std::vector<uint32_t> nics = up_list(up);
  auto shards = plan_single(length, static_cast<uint32_t>(nics.size()), routing, rotation, params);
  for (Shard& s : shards) s.domain = nics[s.domain];
  return shards;
}

std::vector<Run> split_even_up(size_t count, const std::vector<bool>& up, uint32_t rotation) {
  const std::vector<uint32_t> nics = up_list(up);
  auto runs = split_even(count, static_cast<uint32_t>(nics.size()), rotation);
  for (Run& r : runs) r.domain = nics[r.domain];
  return runs;
}

Status check_range(std::string_view what, uint64_t offset, uint64_t length, uint64_t region) {
  if (offset > region || length > region - offset) {
    return Status(ErrorCode::kOutOfRange,
                  fmt::format("{}: offset {} + length {} exceeds the region's {} bytes", what,
                              offset, length, region));
  }
  return Status::ok();
}

}  // namespace fabric::engine
