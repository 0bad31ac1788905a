// Selective signalling's bookkeeping for one queue pair: the send work requests it has accepted,
// in posting order, until each is known to be finished. Pure (no verbs calls), so that the rules
// below are unit-tested without a device (tests/verbs/signal_window_test.cc).
//
// Only some requests ask for a completion (IBV_SEND_SIGNALED): every Nth, and the newest of
// every chained post (seal()). An RC send queue completes in posting order, so a completion for
// one entry finishes every older entry too; which outcome each of them gets:
//
// - a successful completion: it and every older entry succeeded;
// - the first error on a queue pair that was healthy (not flushed, not marked broken): every
//   older entry succeeded (they completed before the error), this one failed with its status;
// - a flush, or any error once the queue pair is broken: this one failed, and the older entries
//   that had no completion of their own are reported flushed (a device may or may not generate
//   flush completions for unsignalled requests; either way each entry is retired exactly once,
//   by its position, and a completion for an entry already retired is ignored).
//
// Entries are identified by a 32-bit sequence number (the posting order, wrapping), which the
// backend carries in the work request's wr_id; the caller's own wr_id is kept here.
#pragma once

#include <cstdint>
#include <vector>

namespace fabric::transport::verbs_detail {

class SignalWindow {
 public:
  enum class Outcome : uint8_t { kOk, kFailed, kFlushed };

  SignalWindow() = default;
  // Room for `capacity` requests, and one marker beyond them (push_marker), allocated once.
  // `first_seq`: the first sequence number (tests start near the wrap).
  explicit SignalWindow(uint32_t capacity, uint32_t first_seq = 0)
      : capacity_(capacity), head_(first_seq), tail_(first_seq) {
    uint32_t ring = 1;
    while (ring < capacity + 1) ring <<= 1;
    entries_.resize(ring);
    mask_ = ring - 1;
  }

  uint32_t capacity() const { return capacity_; }
  uint32_t size() const { return tail_ - head_; }
  bool empty() const { return head_ == tail_; }
  bool full() const { return size() >= capacity_; }
  // Whether `seq` names an entry not yet retired.
  bool contains(uint32_t seq) const { return seq - head_ < size(); }
  // The queue pair entered the error state (an error completion, or moved there by the
  // backend): entries finishing without a completion of their own are reported flushed.
  bool broken() const { return broken_; }
  void mark_broken() { broken_ = true; }

  // Appends a request (the caller checked !full()); returns its sequence number.
  // `signal_every`: every that many-th request since the last signalled one is signalled; so is
  // one that fills the window, so that a full window always holds a signalled request.
  uint32_t push(uint64_t wr_id, uint32_t signal_every, bool& signalled) {
    signalled = ++unsignalled_run_ >= signal_every || size() + 1 >= capacity_;
    if (signalled) unsignalled_run_ = 0;
    const uint32_t seq = tail_++;
    entries_[seq & mask_] = Entry{wr_id, signalled};
    return seq;
  }
  // Appends a signalled entry even to a full window (once: the room beyond capacity()): the
  // backend's marker that drains a queue pair in the error state.
  uint32_t push_marker(uint64_t wr_id) {
    unsignalled_run_ = 0;
    const uint32_t seq = tail_++;
    entries_[seq & mask_] = Entry{wr_id, true};
    return seq;
  }
  // Makes the newest entry signalled (the last request of a chained post, so that no request
  // is left without a signalled one behind it); false when it already was (or none exists).
  bool seal() {
    if (empty() || entries_[(tail_ - 1) & mask_].signalled) return false;
    entries_[(tail_ - 1) & mask_].signalled = true;
    unsignalled_run_ = 0;
    return true;
  }
  bool newest_signalled() const { return !empty() && entries_[(tail_ - 1) & mask_].signalled; }
  uint32_t newest() const { return tail_ - 1; }
  // Removes the newest entry (a request the provider refused to post) and returns its wr_id.
  uint64_t pop_newest() {
    --tail_;
    unsignalled_run_ = 0;  // conservative: the next request may be signalled early
    return entries_[tail_ & mask_].wr_id;
  }

  // A completion for entry `seq` (success, or an error that is or is not a flush): retires it
  // and every older entry, oldest first, calling report(wr_id, Outcome). Returns how many were
  // retired: 0 when `seq` was already retired (the completion is ignored).
  template <typename Report>
  uint32_t complete(uint32_t seq, bool success, bool flush, Report&& report) {
    if (!contains(seq)) return 0;
    const Outcome older = success || (!broken_ && !flush) ? Outcome::kOk : Outcome::kFlushed;
    const Outcome own = success ? Outcome::kOk : flush ? Outcome::kFlushed : Outcome::kFailed;
    if (!success) broken_ = true;
    const uint32_t n = seq - head_ + 1;
    while (head_ != seq) report(entries_[head_++ & mask_].wr_id, older);
    report(entries_[head_++ & mask_].wr_id, own);
    return n;
  }
  // Retires every entry as flushed (a queue pair given up on without completions to come).
  template <typename Report>
  uint32_t fail_all(Report&& report) {
    const uint32_t n = size();
    while (!empty()) report(entries_[head_++ & mask_].wr_id, Outcome::kFlushed);
    return n;
  }

 private:
  struct Entry {
    uint64_t wr_id = 0;
    bool signalled = false;
  };
  std::vector<Entry> entries_;
  uint32_t capacity_ = 0;
  uint32_t mask_ = 0;
  uint32_t head_ = 0;  // sequence number of the oldest entry
  uint32_t tail_ = 0;  // sequence number the next entry gets
  uint32_t unsignalled_run_ = 0;
  bool broken_ = false;
};

}  // namespace fabric::transport::verbs_detail
