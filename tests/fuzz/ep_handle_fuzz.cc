// Fuzz target: an all-to-all rank's handle as connect() receives it from another rank
// (decode_handle, then check_peer against this rank's own handle; src/ep/handle.h). Properties:
// decoding never crashes or over-reads (the proxy handle's length is checked against the bytes
// left); a rejection is InvalidArgument with a message; an accepted handle decodes again to itself
// and re-encodes to the input except for the reserved 16 bits (written as zero); a handle agrees
// with itself at its own rank and with nothing at another position; check_peer against a real
// rank's handle accepts only a peer of the same configuration at its own position, and refuses
// with InvalidArgument or (another rank of this node in this process) Unsupported, with a message.
#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "ep/handle.h"
#include "ep_configs.h"
#include "fuzz_check.h"

using namespace fabric::ep;
using fabric::ErrorCode;

namespace {

constexpr uint64_t kMyPid = 100;   // the seeds' handles of this process (make_seeds.cc)
constexpr size_t kReservedAt = 6;  // magic (4), version (2), then 2 reserved bytes

const std::vector<PeerHandle>& mine() {
  static const std::vector<PeerHandle> handles = [] {
    std::vector<PeerHandle> out;
    for (const AllToAllConfig& c : fuzz::configs()) out.push_back(fuzz::handle(c, 0, kMyPid));
    return out;
  }();
  return handles;
}

bool same_config(const PeerHandle& a, const PeerHandle& b) {
  return a.world_size == b.world_size && a.gpus_per_node == b.gpus_per_node &&
         a.num_experts == b.num_experts && a.hidden == b.hidden && a.top_k == b.top_k &&
         a.max_tokens_per_rank == b.max_tokens_per_rank && a.dtype == b.dtype &&
         a.buffer_bytes == b.buffer_bytes;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto bytes = std::as_bytes(std::span(data, size));
  auto peer = decode_handle(bytes);
  if (!peer) {
    FUZZ_CHECK(peer.status().code() == ErrorCode::kInvalidArgument, "rejection code");
    FUZZ_CHECK(!peer.status().message().empty(), "a rejection names what is wrong");
    return 0;
  }
  const fabric::Bytes encoded = encode(*peer);
  FUZZ_CHECK(encoded.size() == size, "encode(decode(b)) has the input's size");
  FUZZ_CHECK(std::equal(encoded.begin(), encoded.begin() + kReservedAt, bytes.begin()) &&
                 std::equal(encoded.begin() + kReservedAt + 2, encoded.end(),
                            bytes.begin() + kReservedAt + 2),
             "encode(decode(b)) == b but for the reserved bytes");
  auto again = decode_handle(encoded);
  FUZZ_CHECK(again.is_ok() && *again == *peer, "decode(encode(h)) == h");

  FUZZ_CHECK(check_peer(*peer, *peer, peer->rank).is_ok(), "a handle agrees with itself");
  if (peer->rank != INT_MAX) {
    const fabric::Status s = check_peer(*peer, *peer, peer->rank + 1);
    FUZZ_CHECK(s.code() == ErrorCode::kInvalidArgument && !s.message().empty(),
               "a handle out of its place is refused");
  }
  for (const PeerHandle& m : mine()) {
    const fabric::Status s = check_peer(m, *peer, peer->rank);
    if (s.is_ok()) {
      FUZZ_CHECK(same_config(m, *peer), "an accepted peer has this rank's configuration");
      continue;
    }
    FUZZ_CHECK(!s.message().empty(), "a refusal names what differs");
    const bool same_node = peer->rank / m.gpus_per_node == m.rank / m.gpus_per_node;
    if (s.code() == ErrorCode::kUnsupported) {
      FUZZ_CHECK(peer->pid == m.pid && peer->rank != m.rank && same_node,
                 "Unsupported only for another rank of this node in this process");
    } else {
      FUZZ_CHECK(s.code() == ErrorCode::kInvalidArgument, "refusal code");
      FUZZ_CHECK(!same_config(m, *peer), "InvalidArgument only for another configuration");
    }
  }
  return 0;
}
