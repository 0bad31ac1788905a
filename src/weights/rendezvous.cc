// The weight push's rendezvous through a membership registry: members, the schedule header,
// the waits, the digest check (fabric/weights/rendezvous.h).
#include "fabric/weights/rendezvous.h"

#include <fmt/format.h>
#include <openssl/evp.h>

#include <algorithm>
#include <charconv>
#include <map>
#include <thread>

#include "common/invalid.h"

namespace fabric::weights {
namespace {

using Clock = std::chrono::steady_clock;

std::string_view role_of(Side side) {
  return side == Side::kTrainer ? kTrainerRole : kInferenceRole;
}

size_t count(std::span<const kv::Member> members, const std::string& group, Side side) {
  return static_cast<size_t>(std::count_if(members.begin(), members.end(), [&](const auto& m) {
    return m.role == role_of(side) && m.instance == group;
  }));
}

const kv::Member* find_header(std::span<const kv::Member> members, const std::string& group) {
  for (const kv::Member& m : members) {
    if (m.role == kScheduleRole && m.instance == group) return &m;
  }
  return nullptr;
}

std::string ranks_missing(std::span<const kv::Member> members, const std::string& group,
                          uint64_t trainers, uint64_t inference) {
  return fmt::format("{} training and {} inference ranks (found {} and {})", trainers, inference,
                     count(members, group, Side::kTrainer),
                     count(members, group, Side::kInference));
}

// Reads the registry until `ready(members)` holds (the members, or its error), polling; after
// `timeout`, kTimeout naming what `missing(members)` says is missing.
template <typename Ready, typename Missing>
Result<std::vector<kv::Member>> wait_members(kv::Registry& registry,
                                             std::chrono::milliseconds timeout, Ready ready,
                                             Missing missing) {
  const auto deadline = Clock::now() + timeout;
  while (true) {
    auto members = registry.members();
    if (!members) return members.status();
    Result<bool> done = ready(*members);
    if (!done) return done.status();
    if (*done) return members;
    if (Clock::now() > deadline) {
      return Status(ErrorCode::kTimeout,
                    fmt::format("weights: {} not in the registry after {:g} s", missing(*members),
                                std::chrono::duration<double>(timeout).count()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

Result<Bytes> member_data(const kv::Member& m) {
  auto bytes = from_hex(m.data);
  if (!bytes) return invalid("weights: member " + m.name + ": " + bytes.status().message());
  return bytes;
}

template <typename T>
bool parse_number(std::string_view text, T& out) {
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, out);
  return ec == std::errc() && p == end && !text.empty();
}

}  // namespace

std::string member_name(const std::string& group, Side side, uint32_t rank) {
  return fmt::format("{}.{}{}", group, side == Side::kTrainer ? 't' : 'i', rank);
}

std::string header_name(const std::string& group) {
  return group + ".schedule";
}

Status publish_rank(kv::Registry& registry, const std::string& group, Side side, uint32_t rank,
                    uint32_t world, const Address& address,
                    std::span<const std::byte> description) {
  kv::Member m;
  m.name = member_name(group, side, rank);
  m.role = role_of(side);
  m.instance = group;
  m.tp_size = side == Side::kTrainer ? world : 1;
  m.tp_rank = rank;
  m.address = address.to_hex();
  m.data = to_hex(description);
  return registry.join(m);
}

Status withdraw_rank(kv::Registry& registry, const std::string& group, Side side, uint32_t rank) {
  std::vector<std::string> names{member_name(group, side, rank)};
  if (side == Side::kTrainer && rank == 0) names.push_back(header_name(group));
  for (const std::string& name : names) {
    Status s = registry.leave(name);
    if (!s && s.code() != ErrorCode::kNotFound) return s;
  }
  return {};
}

std::vector<kv::Member> ranks_of(std::span<const kv::Member> members, const std::string& group,
                                 Side side) {
  std::vector<kv::Member> out;
  for (const kv::Member& m : members) {
    if (m.role == role_of(side) && m.instance == group) out.push_back(m);
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const auto& a, const auto& b) { return a.tp_rank < b.tp_rank; });
  return out;
}

std::string ScheduleHeader::encode() const {
  return fmt::format("trainers={} inference={} chunk_bytes={} bytes={} sha256={}", trainers,
                     inference, chunk_bytes, bytes, sha256);
}

Result<ScheduleHeader> ScheduleHeader::decode(const kv::Member& member) {
  std::map<std::string, std::string, std::less<>> fields;
  bool ok = true;
  const std::string& text = member.data;
  for (size_t pos = 0; pos < text.size();) {
    const size_t start = text.find_first_not_of(" \t", pos);
    if (start == std::string::npos) break;
    const size_t end = std::min(text.find_first_of(" \t", start), text.size());
    const std::string_view field(text.data() + start, end - start);
    const size_t eq = field.find('=');
    if (eq == std::string_view::npos)
      ok = false;
    else
      fields.emplace(std::string(field.substr(0, eq)), std::string(field.substr(eq + 1)));
    pos = end;
  }
  ScheduleHeader h;
  auto number = [&](std::string_view key, auto& out) {
    auto it = fields.find(key);
    ok = ok && it != fields.end() && parse_number(it->second, out);
  };
  number("trainers", h.trainers);
  number("inference", h.inference);
  number("chunk_bytes", h.chunk_bytes);
  number("bytes", h.bytes);
  if (auto it = fields.find("sha256"); it != fields.end()) h.sha256 = it->second;
  ok = ok && h.sha256.size() == 64 && std::all_of(h.sha256.begin(), h.sha256.end(), [](char c) {
         return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
       });
  if (!ok) {
    return invalid(fmt::format("weights: the schedule header {} is malformed: '{}'", member.name,
                               text.substr(0, 100)));
  }
  return h;
}

std::string sha256_hex(std::span<const std::byte> data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (EVP_Digest(data.data(), data.size(), digest, &length, EVP_sha256(), nullptr) != 1) {
    return {};  // not reached: SHA-256 is always there
  }
  return to_hex(std::as_bytes(std::span(digest, length)));
}

ScheduleHeader header_of(const Schedule& schedule, uint64_t chunk_bytes) {
  const Bytes bytes = schedule.encode();
  return ScheduleHeader{schedule.num_trainers, schedule.num_inference, chunk_bytes, bytes.size(),
                        sha256_hex(bytes)};
}

Result<Agreement> compute_agreement(std::span<const kv::Member> members, const std::string& group,
                                    uint32_t trainers, uint32_t inference, uint64_t chunk_bytes) {
  const auto t = ranks_of(members, group, Side::kTrainer);
  const auto i = ranks_of(members, group, Side::kInference);
  if (t.size() < trainers || i.size() < inference) {
    return invalid("weights: " + ranks_missing(members, group, trainers, inference) +
                   " to compute the schedule from");
  }
  Agreement a;
  for (uint32_t k = 0; k < trainers; ++k) {
    auto data = member_data(t[k]);
    if (!data) return data.status();
    auto rank = decode_trainer(*data);
    if (!rank) return invalid("weights: member " + t[k].name + ": " + rank.status().message());
    a.trainers.push_back(std::move(*rank));
  }
  std::vector<InferenceRank> layouts;
  for (uint32_t k = 0; k < inference; ++k) {
    auto data = member_data(i[k]);
    if (!data) return data.status();
    auto endpoint = decode_endpoint(*data);
    auto address = Address::from_hex(i[k].address);
    if (!endpoint || !address) {
      const Status& bad = !endpoint ? endpoint.status() : address.status();
      return invalid("weights: member " + i[k].name + ": " + bad.message());
    }
    layouts.push_back(endpoint->layout);
    a.endpoints.push_back(std::move(*endpoint));
    a.inference_addresses.push_back(std::move(*address));
  }
  auto schedule = compute_schedule(a.trainers, layouts, ScheduleOptions{chunk_bytes});
  if (!schedule) return schedule.status();
  a.schedule = std::move(*schedule);
  a.header = header_of(a.schedule, chunk_bytes);
  return a;
}

Result<Agreement> publish_schedule(kv::Registry& registry, const std::string& group,
                                   uint32_t trainers, uint32_t inference, uint64_t chunk_bytes,
                                   std::chrono::milliseconds timeout) {
  auto members = wait_members(
      registry, timeout,
      [&](const std::vector<kv::Member>& ms) -> Result<bool> {
        return count(ms, group, Side::kTrainer) >= trainers &&
               count(ms, group, Side::kInference) >= inference;
      },
      [&](const std::vector<kv::Member>& ms) {
        return ranks_missing(ms, group, trainers, inference);
      });
  if (!members) return members.status();
  auto a = compute_agreement(*members, group, trainers, inference, chunk_bytes);
  if (!a) return a;
  kv::Member header;
  header.name = header_name(group);
  header.role = kScheduleRole;
  header.instance = group;
  header.data = a->header.encode();
  if (Status s = registry.join(header); !s) return s;
  return a;
}

Result<Agreement> agree_schedule(kv::Registry& registry, const std::string& group,
                                 std::chrono::milliseconds timeout) {
  auto header = [&](const std::vector<kv::Member>& ms) -> Result<std::optional<ScheduleHeader>> {
    const kv::Member* m = find_header(ms, group);
    if (m == nullptr) return std::optional<ScheduleHeader>();
    auto h = ScheduleHeader::decode(*m);
    if (!h) return h.status();
    return std::optional<ScheduleHeader>(std::move(*h));
  };
  auto members = wait_members(
      registry, timeout,
      [&](const std::vector<kv::Member>& ms) -> Result<bool> {
        auto h = header(ms);
        if (!h) return h.status();
        return h->has_value() && count(ms, group, Side::kTrainer) >= (*h)->trainers &&
               count(ms, group, Side::kInference) >= (*h)->inference;
      },
      [&](const std::vector<kv::Member>& ms) {
        auto h = header(ms);
        if (!h || !h->has_value()) return "the schedule header (" + header_name(group) + ")";
        return ranks_missing(ms, group, (*h)->trainers, (*h)->inference);
      });
  if (!members) return members.status();
  const ScheduleHeader want = **header(*members);
  auto a = compute_agreement(*members, group, want.trainers, want.inference, want.chunk_bytes);
  if (!a) return a;
  if (a->header.bytes != want.bytes || a->header.sha256 != want.sha256) {
    return invalid(fmt::format(
        "weights: the schedule computed here ({} bytes, sha256 {}...) differs from training rank "
        "0's ({} bytes, sha256 {}...): the ranks read different descriptions from the registry",
        a->header.bytes, a->header.sha256.substr(0, 16), want.bytes, want.sha256.substr(0, 16)));
  }
  return a;
}

Result<Agreement> connect_trainer(kv::Registry& registry, const std::string& group, uint32_t rank,
                                  uint32_t world, uint32_t inference, uint64_t chunk_bytes,
                                  std::chrono::milliseconds timeout) {
  if (rank == 0) return publish_schedule(registry, group, world, inference, chunk_bytes, timeout);
  auto a = agree_schedule(registry, group, timeout);
  if (a && (a->header.trainers != world || a->header.inference != inference)) {
    return invalid(fmt::format(
        "weights: training rank 0's schedule is for {} training and {} inference ranks, training "
        "rank {} expects {} and {}",
        a->header.trainers, a->header.inference, rank, world, inference));
  }
  return a;
}

Result<std::vector<TrainerPeer>> trainer_peers(kv::Registry& registry, const std::string& group,
                                               uint32_t count) {
  auto members = registry.members();
  if (!members) return members.status();
  const auto trainers = ranks_of(*members, group, Side::kTrainer);
  if (trainers.size() < count) {
    return Status(
        ErrorCode::kPeerUnreachable,
        fmt::format("{} of {} training ranks are in the registry", trainers.size(), count));
  }
  std::vector<TrainerPeer> out;
  for (const kv::Member& m : trainers) {
    auto address = Address::from_hex(m.address);
    if (!address) return invalid("weights: member " + m.name + ": " + address.status().message());
    out.push_back(TrainerPeer{m.tp_rank, m.name, std::move(*address)});
  }
  return out;
}

Status watch_trainers(kv::Registry& registry, const std::string& group,
                      std::weak_ptr<WeightReceiver> receiver) {
  return registry.watch([group, receiver = std::move(receiver)](bool joined, const kv::Member& m) {
    if (joined || m.role != kTrainerRole || m.instance != group) return;
    if (auto r = receiver.lock()) r->fail_trainer(m.name);
  });
}

}  // namespace fabric::weights
