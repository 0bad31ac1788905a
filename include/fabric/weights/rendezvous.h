// How the ranks of a weight push find each other and agree on the schedule, through a
// membership registry (fabric/kv/registry.h: LocalRegistry, FileRegistry, EtcdRegistry).
//
// Every rank publishes one member; training rank 0 computes the schedule from the members it
// reads and publishes a small header naming its length and sha256; every other rank computes the
// schedule from the same members and checks it against the header. The schedule itself never
// goes through the registry (4000 parameters over 4 inference ranks is 1.4 MB encoded, beyond
// etcd's request limit).
//
//   member           role               tp_rank  data
//   GROUP.tRANK      weights-trainer    rank     hex(encode(TrainerRank))  (tp_size: the world)
//   GROUP.iRANK      weights-inference  rank     hex(encode(Endpoint))
//   GROUP.schedule   weights-schedule   0        "trainers=N inference=M chunk_bytes=C
//                                                 bytes=LENGTH sha256=DIGEST"
//
// Every member's instance is the group and its address the rank's engine Address in hex. A rank
// counts the first n (m) members of a role by rank.
//
// Threads: every call blocks on the registry; the waits poll it every 20 ms until their
// timeout. watch_trainers' callback runs on the registry's watch thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fabric/kv/registry.h"
#include "fabric/weights.h"
#include "fabric/weights/flow.h"

namespace fabric::weights {

inline constexpr std::string_view kTrainerRole = "weights-trainer";
inline constexpr std::string_view kInferenceRole = "weights-inference";
inline constexpr std::string_view kScheduleRole = "weights-schedule";

enum class Side : uint8_t { kTrainer, kInference };

// "<group>.t<rank>" or "<group>.i<rank>".
std::string member_name(const std::string& group, Side side, uint32_t rank);
// "<group>.schedule".
std::string header_name(const std::string& group);

// Publishes (or replaces) rank `rank`'s member of `group`. `description`: encode(TrainerRank)
// of a training rank (tp_size `world`), encode(Endpoint) of an inference rank (world unused).
// The registry's errors as they are.
Status publish_rank(kv::Registry& registry, const std::string& group, Side side, uint32_t rank,
                    uint32_t world, const Address& address, std::span<const std::byte> description);
// Withdraws rank `rank`'s member and, for training rank 0, the schedule header. A member
// already gone is no error.
Status withdraw_rank(kv::Registry& registry, const std::string& group, Side side, uint32_t rank);

// The members of `group` on `side`, by rank.
std::vector<kv::Member> ranks_of(std::span<const kv::Member> members, const std::string& group,
                                 Side side);

// Training rank 0's header: what every rank computes the schedule from and checks it by.
struct ScheduleHeader {
  uint32_t trainers = 0;
  uint32_t inference = 0;
  uint64_t chunk_bytes = 0;
  uint64_t bytes = 0;  // the length of Schedule::encode()
  std::string sha256;  // its digest, 64 lower-case hex digits

  // The member's data: "trainers=<n> inference=<m> chunk_bytes=<c> bytes=<length> sha256=<d>".
  std::string encode() const;
  // kInvalidArgument "weights: the schedule header <name> is malformed: '<data>'" for a field
  // missing, one that is not a number in range, or a digest that is not 64 hex digits.
  static Result<ScheduleHeader> decode(const kv::Member& member);
  friend bool operator==(const ScheduleHeader&, const ScheduleHeader&) = default;
};
// The header of `schedule`, computed with `chunk_bytes`.
ScheduleHeader header_of(const Schedule& schedule, uint64_t chunk_bytes);
// Lower-case hex of the SHA-256 of `data` (OpenSSL's libcrypto).
std::string sha256_hex(std::span<const std::byte> data);

// A schedule and the members it was computed from, decoded.
struct Agreement {
  Schedule schedule;
  ScheduleHeader header;
  std::vector<TrainerRank> trainers;         // by training rank
  std::vector<Endpoint> endpoints;           // by inference rank
  std::vector<Address> inference_addresses;  // by inference rank
};

// The schedule from the first `trainers` training and `inference` inference members of `group`
// in `members` (fewer is kInvalidArgument). compute_schedule's errors; kInvalidArgument naming
// a member whose data or address does not decode.
Result<Agreement> compute_agreement(std::span<const kv::Member> members, const std::string& group,
                                    uint32_t trainers, uint32_t inference, uint64_t chunk_bytes);

// Training rank 0: waits up to `timeout` for `trainers` training and `inference` inference ranks
// of `group`, computes the schedule and publishes its header. kTimeout "weights: <n> training and
// <m> inference ranks (found <a> and <b>) not in the registry after <s> s".
Result<Agreement> publish_schedule(kv::Registry& registry, const std::string& group,
                                   uint32_t trainers, uint32_t inference, uint64_t chunk_bytes,
                                   std::chrono::milliseconds timeout);

// Any other rank: waits up to `timeout` for the header and the ranks it names, computes the
// schedule from them with the header's chunk_bytes and checks its length and sha256 against the
// header's. kTimeout naming the missing header ("the schedule header (<group>.schedule)") or
// ranks (as publish_schedule); kInvalidArgument for a malformed header, or naming both lengths
// and digests when the schedule computed here differs (the ranks read different descriptions).
Result<Agreement> agree_schedule(kv::Registry& registry, const std::string& group,
                                 std::chrono::milliseconds timeout);

// Training rank `rank` of `world`: publish_schedule on rank 0, agree_schedule elsewhere, where a
// header naming other counts than `world` and `inference` is kInvalidArgument naming both.
Result<Agreement> connect_trainer(kv::Registry& registry, const std::string& group, uint32_t rank,
                                  uint32_t world, uint32_t inference, uint64_t chunk_bytes,
                                  std::chrono::milliseconds timeout);

// The first `count` training ranks of `group` in the registry now, as a receiver's peers.
// kPeerUnreachable "<k> of <count> training ranks are in the registry" when fewer.
Result<std::vector<TrainerPeer>> trainer_peers(kv::Registry& registry, const std::string& group,
                                               uint32_t count);

// Watches `group`'s training members: one that leaves fails the receiver's pending version
// (WeightReceiver::fail_trainer). Takes the registry's one watch (kAlreadyExists when taken);
// holds the receiver weakly, so it may go first.
Status watch_trainers(kv::Registry& registry, const std::string& group,
                      std::weak_ptr<WeightReceiver> receiver);

}  // namespace fabric::weights
