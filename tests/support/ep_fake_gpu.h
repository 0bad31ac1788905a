// FakeGpu, a test double for the GPU side of fabric::ep's inter-node path: it plays the kernels'
// part on a proxy's regions in host memory (stages a round with a byte pattern per (source,
// destination, round, kind) and a varying count, raises the ready word, waits for the receive
// flag, checks every byte and the count, raises the done word), as the kernels do through the
// regions' device mappings. Like the kernels, it finds every area and word through the
// parameters and routes the host side sets up (ep/params.h: kernel_params, route_peers), so what
// it carries checks those too. Used by the proxy's unit tests (tests/ep/ep_proxy_test.cc) and by
// the proxy benchmark (bench/ep_proxy_bench.cc), which run without a GPU.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ep/params.h"
#include "ep/schedule.h"
#include "fabric/ep.h"
#include "fabric/status.h"
#include "slowdown.h"

namespace fabric::ep::testing {

using FakeGpuClock = std::chrono::steady_clock;

// Host memory of `bytes`, zeroed, 64-byte aligned.
struct HostRegion {
  std::unique_ptr<std::byte[]> storage;
  std::byte* at = nullptr;
  explicit HostRegion(uint64_t bytes) : storage(new std::byte[bytes + 64]()) {
    at = reinterpret_cast<std::byte*>((reinterpret_cast<uintptr_t>(storage.get()) + 63) / 64 * 64);
  }
};

// A small all-to-all of `world` ranks, `per_node` per node, for the tests: two experts per rank,
// hidden 256, top-2, 24 tokens per rank; the FakeGpu's waits for a round bounded by a second
// (scaled in sanitized builds).
inline AllToAllConfig small_config(int rank, int world, int per_node,
                                   TokenDtype dtype = TokenDtype::kBf16) {
  AllToAllConfig c;
  c.rank = rank;
  c.world_size = world;
  c.gpus_per_node = per_node;
  c.num_experts = static_cast<uint32_t>(2 * world);
  c.hidden = 256;
  c.top_k = 2;
  c.max_tokens_per_rank = 24;
  c.dtype = dtype;
  c.timeout = std::chrono::milliseconds(1000) * fabric::testing::kSlowdown;
  return c;
}

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

// A test double for the GPU of one rank, towards the ranks of other nodes. Each half returns
// kTimeout when a word it waits for does not move within the timeout, and kInternal naming the
// first wrong byte.
class FakeGpu {
 public:
  // `control` and `data`: the proxy's regions as this double's "GPU" reaches them (the same bytes
  // as the proxy's, or a second mapping of them for a FakeDeviceBuffer), as AllToAll hands their
  // device mappings to kernel_params and route_peers. Its own buffer and scratch are host memory.
  FakeGpu(const AllToAllConfig& c, const Layout& l, const ProxyLayout& p, std::byte* control,
          std::byte* data)
      : c_(c),
        l_(l),
        p_(p),
        control_(control),
        buffer_(l.buffer_bytes),
        scratch_(ScratchLayout::of(l).bytes) {
    KernelMemory m;
    m.buffer = reinterpret_cast<uint8_t*>(buffer_.at);
    m.scratch = reinterpret_cast<uint8_t*>(scratch_.at);
    m.report = &report_;
    m.proxy_control = reinterpret_cast<uint8_t*>(control);
    m.proxy_data = reinterpret_cast<uint8_t*>(data);
    params_ = kernel_params(c, l, p, m, 1);
    route_peers(params_, c, l, p, m);
    peers_ = remote_peers(c.rank, c.world_size, c.gpus_per_node);
  }

  // The parameters the kernels would get.
  const device::Params& params() const { return params_; }

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
    return wait(reinterpret_cast<const uint64_t*>(control_ + ProxyLayout::word_offset(w, rank)),
                shift, round, timeout, value);
  }

 private:
  // The kernels' wait: an acquire load of `word` until its round (bits [shift, shift + 32))
  // reaches `round`.
  static bool wait(const uint64_t* word, int shift, uint32_t round,
                   std::chrono::milliseconds timeout, uint64_t* value = nullptr) {
    const auto until = FakeGpuClock::now() + timeout;
    for (;;) {
      const uint64_t v =
          std::atomic_ref<uint64_t>(*const_cast<uint64_t*>(word)).load(std::memory_order_acquire);
      if (static_cast<int32_t>(static_cast<uint32_t>(v >> shift) - round) >= 0) {
        if (value != nullptr) *value = v;
        return true;
      }
      if (FakeGpuClock::now() > until) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // The kernels' signal: a release store.
  static void raise(uint64_t* word, uint64_t value) {
    std::atomic_ref<uint64_t>(*word).store(value, std::memory_order_release);
  }
  // Combine: a source sends at most its share of the receiver's slots (slot_of).
  uint32_t most(int kind) const {
    return kind == 0 ? c_.max_tokens_per_rank
                     : p_.combine_slots / static_cast<uint32_t>(p_.num_remote);
  }

  Status send(uint32_t round, int kind) {
    for (int d : peers_) {
      // The previous round's staging must have been read by d.
      if (!wait(kind == 0 ? params_.dispatch_ack_in[d] : params_.combine_ack_in[d], 0, round - 1,
                c_.timeout)) {
        return Status(ErrorCode::kTimeout, "ack of rank " + std::to_string(d));
      }
      const uint32_t n = amount(c_.rank, d, round, kind, most(kind));
      if (kind == 0) {
        auto* to = reinterpret_cast<std::byte*>(params_.dispatch_dst[d]);
        const uint64_t bytes = check_bytes_ ? dispatch_bytes(l_, n) : 0;
        for (uint64_t b = 0; b < bytes; ++b) to[b] = pattern(c_.rank, d, round, kind, b);
      } else {
        // Compact: row j holds slot_of(j)'s output, its id in place j of the ids.
        auto* rows = reinterpret_cast<std::byte*>(params_.combine_dst[d]);
        auto* ids = reinterpret_cast<std::byte*>(params_.combine_ids_dst[d]);
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
      raise(kind == 0 ? params_.dispatch_flag_out[d] : params_.combine_flag_out[d],
            (static_cast<uint64_t>(round) << 32) | n);
    }
    return Status::ok();
  }

  Status recv(uint32_t round, int kind) {
    for (int s : peers_) {
      uint64_t v = 0;
      if (!wait(kind == 0 ? params_.dispatch_flag_in[s] : params_.combine_flag_in[s], 32, round,
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
        const auto* from = reinterpret_cast<const std::byte*>(params_.dispatch_src[s]);
        for (uint64_t b = 0; check_bytes_ && b < dispatch_bytes(l_, n); ++b) {
          if (from[b] != pattern(s, c_.rank, round, kind, b)) {
            return Status(ErrorCode::kInternal, "byte " + std::to_string(b) + which);
          }
        }
      } else {
        // As combine_recv reads: each expected slot's row where the proxy's map says.
        const uint32_t* map = params_.combine_map;
        const auto* rows = reinterpret_cast<const std::byte*>(params_.combine_src[s]);
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
      raise(kind == 0 ? params_.dispatch_ack_out[s] : params_.combine_ack_out[s], round);
    }
    return Status::ok();
  }

  AllToAllConfig c_;
  Layout l_;
  ProxyLayout p_;
  std::byte* control_;
  HostRegion buffer_;
  HostRegion scratch_;
  device::ErrorReport report_{};
  device::Params params_{};
  std::vector<int> peers_;
  std::optional<uint32_t> bad_slot_;
  bool check_bytes_ = true;
};

}  // namespace fabric::ep::testing
