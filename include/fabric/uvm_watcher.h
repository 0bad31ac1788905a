// UvmWatcher: GPU progress seen by the host. Each watcher is a 64-bit word in pinned,
// device-mapped host memory (cudaHostAlloc with the mapped and portable flags; never managed
// memory). A CUDA kernel, or a node of a CUDA graph, stores a new value into it
// (fabric/uvm_watcher.cuh); one polling thread per UvmWatchers compares every live word with
// the last value it saw and runs that watcher's callback with (old, new) on change. A
// callback typically submits the next layer's transfer; it returns whether to keep watching.
//
// This is a host proxy, not GPU-initiated RDMA: it works with every NIC. Available when
// fabric-lib is built with CUDA (FABRIC_WITH_CUDA); otherwise create() returns kUnsupported.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "fabric/status.h"

namespace fabric {

struct WatcherOptions {
  int cuda_device = 0;      // the device whose kernels bump the words
  uint32_t capacity = 512;  // words in the pool (one 4 KiB page holds 512)
  int cpu = -1;             // pin the polling thread to this CPU; -1: no pinning
};

// A live watcher: where a kernel stores (device_word) and where the host reads (host_word).
struct Watcher {
  uint32_t slot = 0;
  uint64_t* device_word = nullptr;  // pass to kernels: fabric::watcher_store(device_word, v)
  volatile uint64_t* host_word = nullptr;
};

class UvmWatchers {
 public:
  // Runs on the polling thread for each observed change; returns false to stop watching (the
  // slot is then freed). Values stored faster than the poller reads them coalesce: the
  // callback sees the latest, with the previous one it saw as `old`.
  using Callback = std::function<bool(uint64_t old_value, uint64_t new_value)>;

  // Allocates the pinned pool and starts the polling thread. Blocking. Errors: kUnsupported
  // (built without CUDA, or no CUDA device), kInvalidArgument (capacity 0).
  static Result<std::unique_ptr<UvmWatchers>> create(const WatcherOptions& options = {});
  // Stops the thread (no callback runs after it returns) and frees the pool.
  ~UvmWatchers();
  UvmWatchers(const UvmWatchers&) = delete;
  UvmWatchers& operator=(const UvmWatchers&) = delete;

  // Takes a free word, sets it to `initial`, and starts watching it. Thread-safe; callable
  // from a callback. Errors: kOutOfRange (the pool is full), kInvalidArgument (no callback).
  Result<Watcher> watch(Callback callback, uint64_t initial = 0);
  // Stops watching; its callback will not start after this returns (unless called from the
  // callback itself, which is running). Errors: kNotFound.
  Status unwatch(const Watcher& watcher);
  // Words being watched now.
  uint32_t live() const;
  // Host launcher for code that has no kernel of its own (Python, a CUDA graph built on the
  // host): enqueues a one-thread kernel on `cuda_stream` (a cudaStream_t; null: the legacy
  // default stream) that stores `value` into the watcher's word after the stream's earlier
  // work. Non-blocking. Errors: kUnsupported (no CUDA), kFabric (the launch failed).
  Status bump(const Watcher& watcher, uint64_t value, void* cuda_stream = nullptr);

  class Impl;

 private:
  explicit UvmWatchers(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace fabric
