// The engine's registrations by id. The engine adds and removes them (register_memory,
// unregister_memory); submissions look up their source, and the worker looks up the region a
// staged-path or CUDA IPC Commit names. Thread-safe; lookups hand out shared ownership, so a
// region found stays alive while it is used even if it is unregistered meanwhile.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "engine/transfer_state.h"

namespace fabric::engine {

class RegionTable {
 public:
  void add(std::shared_ptr<LocalRegion> region) {
    std::lock_guard lock(mu_);
    const uint64_t id = region->id;
    regions_.emplace(id, std::move(region));
  }
  // The region registered under `id`, or null.
  std::shared_ptr<LocalRegion> find(uint64_t id) const {
    std::lock_guard lock(mu_);
    auto it = regions_.find(id);
    return it == regions_.end() ? nullptr : it->second;
  }
  // Removes the region registered under `id` and returns it, or null when there is none.
  std::shared_ptr<LocalRegion> take(uint64_t id) {
    std::lock_guard lock(mu_);
    auto it = regions_.find(id);
    if (it == regions_.end()) return nullptr;
    std::shared_ptr<LocalRegion> region = std::move(it->second);
    regions_.erase(it);
    return region;
  }

 private:
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, std::shared_ptr<LocalRegion>> regions_;
};

}  // namespace fabric::engine
