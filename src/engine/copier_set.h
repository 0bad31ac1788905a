// CopierSet: the cuda::Copiers of one component of the worker (StagedWriter, StagedPath,
// IpcCopies), by device, and their fences polled together. Each component keeps its own set, so
// a fence's token always means one thing (a Gate, a CommitJob, a batch of CUDA IPC copies).
// Used by one thread (the worker).
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "cuda/device_memory.h"
#include "fabric/status.h"

namespace fabric::engine {

class CopierSet {
 public:
  // `per_device`: how many copiers (streams) a device gets before they are taken in turn.
  explicit CopierSet(cuda::CopierFactory make = &cuda::Copier::create, uint32_t per_device = 1)
      : make_(std::move(make)), per_device_(per_device > 0 ? per_device : 1) {}

  // A copier of `device`: a new one while it has fewer than per_device, then each in turn.
  // Errors: the factory's.
  Result<cuda::Copier*> get(const cuda::PointerInfo& device) {
    size_t mine = 0;
    for (const Entry& e : entries_) mine += same(e.device, device);
    if (mine < per_device_) {
      auto copier = make_(device);
      if (!copier) return copier.status();
      entries_.push_back({device, std::move(*copier)});
      return entries_.back().copier.get();
    }
    size_t pick = turn_++ % mine;
    for (Entry& e : entries_) {
      if (same(e.device, device) && pick-- == 0) return e.copier.get();
    }
    return Status(ErrorCode::kInternal, "no copier for the device");  // not reached
  }
  // Appends the fences of every copier that completed (each copier's in order) to `done`;
  // returns how many.
  size_t poll(std::vector<cuda::Copier::Done>& done) {
    size_t n = 0;
    for (Entry& e : entries_) {
      if (e.copier->outstanding() > 0) n += e.copier->poll(done);
    }
    return n;
  }
  bool empty() const { return entries_.empty(); }
  bool copying() const {
    for (const Entry& e : entries_) {
      if (e.copier->outstanding() > 0) return true;
    }
    return false;
  }
  // Waits for every enqueued copy and forgets the outstanding fences (engine close).
  void drain() {
    for (Entry& e : entries_) e.copier->drain();
  }

 private:
  struct Entry {
    cuda::PointerInfo device;
    std::unique_ptr<cuda::Copier> copier;
  };
  static bool same(const cuda::PointerInfo& a, const cuda::PointerInfo& b) {
    return a.kind == b.kind && a.device == b.device;
  }

  cuda::CopierFactory make_;
  uint32_t per_device_;
  std::vector<Entry> entries_;
  size_t turn_ = 0;
};

}  // namespace fabric::engine
