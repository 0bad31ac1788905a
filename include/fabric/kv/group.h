// DecodeGroup: one request over every decode rank of a TP group hosted in one process (one
// process driving the group's GPUs), with one ready callback for the whole group.
//
// Each KvDecoder reports its own rank ready; a group request submits the same request on every
// rank and reports once: on_ready with every rank's pages when all are ready, or on_error once
// every rank has ended and at least one failed (the other ranks are cancelled as soon as one
// fails, and the pages of ranks that were ready are released, so the request holds nothing
// when on_error runs beyond what each KvDecoder keeps in quarantine itself).
//
// Threads: calls are thread-safe and non-blocking; callbacks run on the thread of the last
// rank's callback (an engine's callback thread or a decoder's timer thread), with no lock held.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "fabric/kv/flow.h"

namespace fabric::kv {

struct GroupRequest {
  RequestId id = 0;
  uint32_t num_pages = 0;  // pages per rank, reserved from each rank's pool
  // The prefill instance: the address of each of its TP ranks, in rank order.
  std::vector<Address> prefill_ranks;
  // Exactly one of the two runs, once. pages[r] are decode rank r's; give them back with
  // DecodeGroup::release.
  std::function<void(RequestId, const std::vector<std::vector<uint32_t>>& pages)> on_ready;
  std::function<void(RequestId, const Status&)> on_error;
};

class DecodeGroup {
 public:
  // decoders[r] is decode rank r (its layout's tp_rank r, tp_size decoders.size()). Not owned:
  // they must outlive the group. Errors: kInvalidArgument (none, a null one, ranks out of
  // order, layouts of different TP sizes).
  static Result<std::unique_ptr<DecodeGroup>> create(std::vector<KvDecoder*> decoders);
  // Callbacks of requests still live never run after this returns.
  ~DecodeGroup();
  DecodeGroup(const DecodeGroup&) = delete;
  DecodeGroup& operator=(const DecodeGroup&) = delete;

  // Submits the request on every rank. When a rank refuses it (the errors of
  // KvDecoder::submit), the ranks already submitted are cancelled, their pages come back by
  // themselves, no callback runs, and that error is returned. kAlreadyExists: the id is live.
  Status submit(GroupRequest request);
  // Cancels a request not ready on every rank yet: on_error gets kCancelled once every rank
  // ended. Errors: kNotFound.
  Status cancel(RequestId id);
  // Gives every rank's pages of a ready request back. Errors: kNotFound.
  Status release(RequestId id);
  size_t live_requests() const;  // submitted, not yet ready or ended
  size_t size() const;           // ranks

  class Impl;

 private:
  explicit DecodeGroup(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

}  // namespace fabric::kv
