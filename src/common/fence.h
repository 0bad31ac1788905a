// A full (store-load) memory fence: a store before it is visible to other threads before a load
// after it reads. For the two-sided "publish, then check the other side's flag" handshakes
// (the worker's sleep against a submitter's wake-up). ThreadSanitizer does not model fences
// (GCC refuses them under -fsanitize=thread); there a sequentially consistent read-modify-write
// of a private word is the same full fence on the hardware, and one TSan understands.
#pragma once

#include <atomic>

namespace fabric {

inline void full_fence() {
#if defined(__SANITIZE_THREAD__)
  static std::atomic<int> word{0};
  word.fetch_add(0, std::memory_order_seq_cst);
#else
  std::atomic_thread_fence(std::memory_order_seq_cst);
#endif
}

}  // namespace fabric
