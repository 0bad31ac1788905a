// The counters behind TransferEngine::stats() (fabric/stats.h): relaxed atomics per device
// group, bumped where a submission is handed to its worker and where a message is received;
// how transfers end is counted by the worker (WorkerCounters, worker.h).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <utility>

#include "engine/transfer_state.h"
#include "fabric/stats.h"

namespace fabric::engine {

class StatsCounters {
 public:
  explicit StatsCounters(size_t groups) : n_(groups), groups_(new Group[groups]) {}

  // A transfer accepted for `group`: counts it and its bytes. How it ends is counted by the
  // group's worker (WorkerCounters), where it ends: no wrapping of its callbacks, no allocation.
  void submitted(uint32_t group, const Transfer& t) {
    Group& g = groups_[group];
    bool send = false;
    uint64_t bytes = 0;
    for (const Op& op : t.ops) {
      send = send || op.kind == Op::Kind::kSend;
      bytes += op.length;
    }
    if (!t.ipc.empty()) {
      uint64_t ipc_bytes = 0;
      for (const IpcDst& d : t.ipc) {
        for (const Range& r : d.ranges) ipc_bytes += r.length;
      }
      bytes += ipc_bytes;
      g.cuda_ipc_transfers.fetch_add(1, std::memory_order_relaxed);
      g.cuda_ipc_bytes.fetch_add(ipc_bytes, std::memory_order_relaxed);
    }
    if (send) {
      g.messages_sent.fetch_add(1, std::memory_order_relaxed);
    } else {
      g.transfers_submitted.fetch_add(1, std::memory_order_relaxed);
      g.bytes_submitted.fetch_add(bytes, std::memory_order_relaxed);
    }
  }

  // A staging mirror of `bytes` allocated (positive) or given back (negative) for `group`.
  void mirror(uint32_t group, int64_t bytes) {
    groups_[group].host_mirror_bytes.fetch_add(static_cast<uint64_t>(bytes),
                                               std::memory_order_relaxed);
  }

  // A receive handler of `group` that counts the messages it is given.
  std::function<void(std::span<const std::byte>)> receiving(
      uint32_t group, std::function<void(std::span<const std::byte>)> handler) {
    return [counter = &groups_[group].messages_received,
            h = std::move(handler)](std::span<const std::byte> m) {
      counter->fetch_add(1, std::memory_order_relaxed);
      h(m);
    };
  }

  EngineStats snapshot(uint64_t immediates) const {
    EngineStats s;
    s.immediates_received = immediates;
    for (size_t i = 0; i < n_; ++i) {
      const Group& g = groups_[i];
      constexpr auto r = std::memory_order_relaxed;
      GroupStats& out = s.groups.emplace_back();
      out.transfers_submitted = g.transfers_submitted.load(r);
      out.bytes_submitted = g.bytes_submitted.load(r);
      out.messages_sent = g.messages_sent.load(r);
      out.messages_received = g.messages_received.load(r);
      out.cuda_ipc_transfers = g.cuda_ipc_transfers.load(r);
      out.cuda_ipc_bytes = g.cuda_ipc_bytes.load(r);
      out.host_mirror_bytes = g.host_mirror_bytes.load(r);
    }
    return s;
  }

 private:
  struct Group {
    std::atomic<uint64_t> transfers_submitted{0}, bytes_submitted{0}, messages_sent{0},
        messages_received{0}, cuda_ipc_transfers{0}, cuda_ipc_bytes{0}, host_mirror_bytes{0};
  };
  size_t n_;
  std::unique_ptr<Group[]> groups_;
};

}  // namespace fabric::engine
