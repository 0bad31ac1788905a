// The counters behind TransferEngine::stats() (fabric/stats.h): relaxed atomics per device
// group, bumped where a submission is handed to its worker and where its callback runs.
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

  // A transfer accepted for `group`: counts it and its bytes, and makes its callbacks count
  // how it ended (one allocation: the original callbacks move into a box that the callback
  // which runs, exactly one of the two, frees).
  void submitted(uint32_t group, Transfer& t) {
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
    auto* box =
        new Box{std::move(t.callbacks), send ? &g.messages_completed : &g.transfers_completed,
                send ? &g.messages_failed : &g.transfers_failed};
    t.callbacks.on_done = [box] {
      box->completed->fetch_add(1, std::memory_order_relaxed);
      std::unique_ptr<Box> owned(box);
      if (owned->inner.on_done) owned->inner.on_done();
    };
    t.callbacks.on_error = [box](const Status& s) {
      box->failed->fetch_add(1, std::memory_order_relaxed);
      std::unique_ptr<Box> owned(box);
      if (owned->inner.on_error) owned->inner.on_error(s);
    };
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
      out.transfers_completed = g.transfers_completed.load(r);
      out.transfers_failed = g.transfers_failed.load(r);
      out.bytes_submitted = g.bytes_submitted.load(r);
      out.messages_sent = g.messages_sent.load(r);
      out.messages_completed = g.messages_completed.load(r);
      out.messages_failed = g.messages_failed.load(r);
      out.messages_received = g.messages_received.load(r);
      out.cuda_ipc_transfers = g.cuda_ipc_transfers.load(r);
      out.cuda_ipc_bytes = g.cuda_ipc_bytes.load(r);
      const uint64_t ended = out.transfers_completed + out.transfers_failed +
                             out.messages_completed + out.messages_failed;
      const uint64_t started = out.transfers_submitted + out.messages_sent;
      out.in_flight = started > ended ? started - ended : 0;
    }
    return s;
  }

 private:
  struct Group {
    std::atomic<uint64_t> transfers_submitted{0}, transfers_completed{0}, transfers_failed{0},
        bytes_submitted{0}, messages_sent{0}, messages_completed{0}, messages_failed{0},
        messages_received{0}, cuda_ipc_transfers{0}, cuda_ipc_bytes{0};
  };
  struct Box {
    Callbacks inner;
    std::atomic<uint64_t>* completed;
    std::atomic<uint64_t>* failed;
  };
  size_t n_;
  std::unique_ptr<Group[]> groups_;
};

}  // namespace fabric::engine
