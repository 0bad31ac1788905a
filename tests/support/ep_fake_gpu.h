// FakeGpu, a test double for the GPU side of fabric::ep's inter-node path: it plays the kernels'
// part on a proxy's regions in host memory (stages a round with a byte pattern per (source,
// destination, round, kind) and a varying count, raises the ready word, waits for the receive
// flag, checks every byte and the count, raises the done word), as the kernels do through the
// regions' device mappings. Used by the proxy's unit tests (tests/ep/ep_proxy_test.cc) and by
// the proxy benchmark (bench/ep_proxy_bench.cc), which run without a GPU.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ep/proxy.h"
#include "fabric/status.h"

namespace fabric::ep::testing {

using FakeGpuClock = std::chrono::steady_clock;

// The byte `i` of what `src` sends `dst` in `round` (kind 0 dispatch, 1 combine).
inline std::byte pattern(int src, int dst, uint32_t round, int kind, uint64_t i) {
  uint64_t x = (static_cast<uint64_t>(src) << 48) ^ (static_cast<uint64_t>(dst) << 40) ^
               (static_cast<uint64_t>(round) << 8) ^ static_cast<uint64_t>(kind) ^ (i * 0x9e37);
  x ^= x >> 29;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 32;
  return static_cast<std::byte>(x);
}

// How many entries (dispatch) or rows (combine) src sends dst in a round: 0 included.
inline uint32_t amount(int src, int dst, uint32_t round, int kind, uint32_t max) {
  return static_cast<uint32_t>((src * 7 + dst * 3 + static_cast<int>(round) * 5 + kind) %
                               static_cast<int>(max + 1));
}

// The slot (token x top_k + k) of the row that a source stages in place `i` of its combine to a
// rank, in a round. As with real routings, the sources of one receiver hold disjoint slots
// (source `from`, the receiver's remote peer of that index among `peers`, has the slots equal to
// `from` modulo `peers`); distinct for the places of one round (7 is prime to the slots of a
// source here), in an order that differs from round to round, so that only the map finds them.
inline uint32_t slot_of(int from, int peers, uint32_t round, uint32_t i, uint32_t slots) {
  const uint32_t per_source = slots / static_cast<uint32_t>(peers);
  return (i * 7 + round) % per_source * static_cast<uint32_t>(peers) + static_cast<uint32_t>(from);
}

// A test double for the GPU of one rank. Each half returns kTimeout when a word it waits for
// does not move within the timeout, and kInternal naming the first wrong byte.
class FakeGpu {
 public:
  // `data`: the data region as this test reaches it (the same bytes as the proxy's, or a second
  // mapping of them for a FakeDeviceBuffer).
  FakeGpu(const AllToAllConfig& c, const Layout& l, const ProxyLayout& p, std::byte* control,
          std::byte* data)
      : c_(c), l_(l), p_(p), control_(control), data_(data) {
    peers_ = remote_peers(c.rank, c.world_size, c.gpus_per_node);
  }

  // The next combine_send stages `slot` as its first row's slot id, whatever the row's is.
  void corrupt_next_slot(uint32_t slot) { bad_slot_ = slot; }
  // From now on neither write nor check the entries' and rows' bytes (counts, slot ids and the
  // map are still written and checked): for timing the proxy rather than this double.
  void skip_bytes() { check_bytes_ = false; }

  Status dispatch_send(uint32_t round) { return send(round, 0); }
  Status dispatch_recv(uint32_t round) { return recv(round, 0); }
  Status combine_send(uint32_t round) { return send(round, 1); }
  Status combine_recv(uint32_t round) { return recv(round, 1); }

  // Waits until `word` of `rank` reaches `round` in bits [shift, shift + 32).
  bool wait(ProxyLayout::Word w, int rank, int shift, uint32_t round,
            std::chrono::milliseconds timeout, uint64_t* value = nullptr) const {
    const auto until = FakeGpuClock::now() + timeout;
    for (;;) {
      const uint64_t v = load_word(control_, w, rank);
      if (static_cast<int32_t>(static_cast<uint32_t>(v >> shift) - round) >= 0) {
        if (value != nullptr) *value = v;
        return true;
      }
      if (FakeGpuClock::now() > until) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

 private:
  // Combine: a source sends at most its share of the receiver's slots (slot_of).
  uint32_t most(int kind) const {
    return kind == 0 ? c_.max_tokens_per_rank
                     : p_.combine_slots / static_cast<uint32_t>(p_.num_remote);
  }

  Status send(uint32_t round, int kind) {
    for (int d : peers_) {
      // The previous round's staging must have been read by d.
      if (!wait(kind == 0 ? ProxyLayout::kDispatchAck : ProxyLayout::kCombineAck, d, 0, round - 1,
                c_.timeout)) {
        return Status(ErrorCode::kTimeout, "ack of rank " + std::to_string(d));
      }
      const int i = remote_index(c_.rank, d, c_.gpus_per_node);
      const uint32_t n = amount(c_.rank, d, round, kind, most(kind));
      if (kind == 0) {
        std::byte* to = data_ + p_.dispatch_send(i);
        const uint64_t bytes = check_bytes_ ? dispatch_bytes(l_, n) : 0;
        for (uint64_t b = 0; b < bytes; ++b) to[b] = pattern(c_.rank, d, round, kind, b);
      } else {
        // Compact: row j holds slot_of(j)'s output, its id in place j of the ids.
        std::byte* rows = data_ + p_.combine_send(i);
        std::byte* ids = control_ + p_.combine_ids_send(i);
        const int from = remote_index(d, c_.rank, c_.gpus_per_node);
        for (uint32_t j = 0; j < n; ++j) {
          uint32_t slot = slot_of(from, p_.num_remote, round, j, p_.combine_slots);
          const uint64_t from = slot * l_.combine_row_bytes;
          std::byte* row = rows + j * l_.combine_row_bytes;
          for (uint64_t b = 0; check_bytes_ && b < l_.combine_row_bytes; ++b) {
            row[b] = pattern(c_.rank, d, round, kind, from + b);
          }
          if (j == 0 && bad_slot_) slot = *std::exchange(bad_slot_, std::nullopt);
          std::memcpy(ids + 4ull * j, &slot, 4);
        }
      }
      store_word(control_, kind == 0 ? ProxyLayout::kDispatchReady : ProxyLayout::kCombineReady, d,
                 (static_cast<uint64_t>(round) << 32) | n);
    }
    return Status::ok();
  }

  Status recv(uint32_t round, int kind) {
    for (int s : peers_) {
      uint64_t v = 0;
      if (!wait(kind == 0 ? ProxyLayout::kDispatchFlag : ProxyLayout::kCombineFlag, s, 32, round,
                c_.timeout, &v)) {
        return Status(ErrorCode::kTimeout,
                      "rank " + std::to_string(c_.rank) + " waited for rank " + std::to_string(s));
      }
      if (static_cast<uint32_t>(v >> 32) != round) {
        return Status(ErrorCode::kInternal, "flag of a later round: " + std::to_string(v >> 32));
      }
      const uint32_t n = amount(s, c_.rank, round, kind, most(kind));
      if (static_cast<uint32_t>(v) != n) {
        return Status(ErrorCode::kInternal, "count " + std::to_string(static_cast<uint32_t>(v)) +
                                                " instead of " + std::to_string(n));
      }
      const int i = remote_index(c_.rank, s, c_.gpus_per_node);
      const std::string which =
          " of rank " + std::to_string(s) + "'s round " + std::to_string(round) + " differs";
      if (kind == 0) {
        const std::byte* from = data_ + p_.dispatch_recv(i);
        for (uint64_t b = 0; check_bytes_ && b < dispatch_bytes(l_, n); ++b) {
          if (from[b] != pattern(s, c_.rank, round, kind, b)) {
            return Status(ErrorCode::kInternal, "byte " + std::to_string(b) + which);
          }
        }
      } else {
        // As combine_recv reads: each expected slot's row where the proxy's map says.
        const auto* map = reinterpret_cast<const uint32_t*>(control_ + p_.combine_map_offset);
        const std::byte* rows = data_ + p_.combine_recv(i);
        for (uint32_t j = 0; j < n; ++j) {
          const uint32_t slot = slot_of(i, p_.num_remote, round, j, p_.combine_slots);
          if (map[slot] >= n) {
            return Status(ErrorCode::kInternal, "the map's place of slot " + std::to_string(slot) +
                                                    " is outside the round" + which);
          }
          const std::byte* row = rows + map[slot] * l_.combine_row_bytes;
          for (uint64_t b = 0; check_bytes_ && b < l_.combine_row_bytes; ++b) {
            if (row[b] != pattern(s, c_.rank, round, kind, slot * l_.combine_row_bytes + b)) {
              return Status(ErrorCode::kInternal, "byte " + std::to_string(b) + " of slot " +
                                                      std::to_string(slot) + which);
            }
          }
        }
      }
      store_word(control_, kind == 0 ? ProxyLayout::kDispatchDone : ProxyLayout::kCombineDone, s,
                 round);
    }
    return Status::ok();
  }

  AllToAllConfig c_;
  Layout l_;
  ProxyLayout p_;
  std::byte* control_;
  std::byte* data_;
  std::vector<int> peers_;
  std::optional<uint32_t> bad_slot_;
  bool check_bytes_ = true;
};

// Host memory of `bytes`, zeroed, 64-byte aligned.
struct HostRegion {
  std::unique_ptr<std::byte[]> storage;
  std::byte* at = nullptr;
  explicit HostRegion(uint64_t bytes) : storage(new std::byte[bytes + 64]()) {
    at = reinterpret_cast<std::byte*>((reinterpret_cast<uintptr_t>(storage.get()) + 63) / 64 * 64);
  }
};

}  // namespace fabric::ep::testing
