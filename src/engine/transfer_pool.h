// Recycled Transfer objects, so that a submission takes its state from a pool instead of the
// heap: a transfer the worker is done with is reset (its vectors emptied, their capacity kept)
// and goes back to its group's pool; the next submission on any thread takes it from there.
// The pool is a bounded lock-free queue (common/bounded_queue.h): taking and giving back never
// lock. An empty pool allocates a fresh Transfer; a full one frees what is given back.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "common/bounded_queue.h"
#include "engine/transfer_state.h"

namespace fabric::engine {

class TransferPool;

// The deleter of a pooled transfer: gives it back to its pool, or deletes it when it has none
// (the worker's own transfers made with TransferPool::unpooled()).
struct TransferRecycler {
  TransferPool* pool = nullptr;
  void operator()(Transfer* t) const;
};
using TransferPtr = std::unique_ptr<Transfer, TransferRecycler>;

class TransferPool {
 public:
  // Keeps at most `capacity` (rounded up to a power of two) idle transfers.
  explicit TransferPool(size_t capacity) : idle_(capacity) {}
  // Frees the idle transfers. Every TransferPtr of this pool must be gone by then.
  ~TransferPool();
  TransferPool(const TransferPool&) = delete;
  TransferPool& operator=(const TransferPool&) = delete;

  // A transfer in its default state (any thread). From the pool when it holds one, else new.
  TransferPtr take();
  // A transfer outside any pool, freed when its pointer goes.
  static TransferPtr unpooled();

  // Resets `t` and keeps it, or frees it when the pool is full (any thread).
  void give_back(Transfer* t);

 private:
  BoundedQueue<Transfer*> idle_;
};

}  // namespace fabric::engine
