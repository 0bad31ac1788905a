#include "transport/fault/fault_domain.h"

#include <algorithm>

namespace fabric::transport {

FaultDomain::FaultDomain(std::unique_ptr<Domain> inner, FaultConfig config, uint64_t stream)
    : inner_(std::move(inner)), config_(std::move(config)), rng_(config_.seed * 7919 + stream) {
  scratch_.resize(64);
}

template <typename Request, typename Post>
PostResult FaultDomain::post_or_fail(const Request& req, Post post) {
  // Sequence numbers count accepted writes and reads only, so a retry after kAgain keeps its
  // number.
  if (config_.fail_write && config_.fail_write(sequence_)) {
    ++sequence_;
    ++injected_;
    Completion c{Completion::Kind::kLocal,
                 req.wr_id,
                 0,
                 0,
                 ErrorCode::kFabric,
                 "injected failure (fault-injection domain)"};
    held_.push_back({std::move(c), 0});
    return PostResult::posted();
  }
  PostResult r = post(req);
  if (r.kind != PostResult::Kind::kAgain) ++sequence_;
  return r;
}

PostResult FaultDomain::post_write(const WriteRequest& req) {
  return post_or_fail(req, [&](const WriteRequest& w) { return inner_->post_write(w); });
}

PostResult FaultDomain::post_read(const ReadRequest& req) {
  return post_or_fail(req, [&](const ReadRequest& r) { return inner_->post_read(r); });
}

size_t FaultDomain::poll(std::span<Completion> out) {
  const size_t got = inner_->poll(scratch_);
  std::uniform_int_distribution<uint32_t> hold(0, config_.max_hold_polls);
  for (size_t i = 0; i < got; ++i) {
    Completion& c = scratch_[i];
    if (config_.receive_length_delta && c.kind == Completion::Kind::kRecv &&
        c.error == ErrorCode::kOk) {
      const int64_t length =
          static_cast<int64_t>(c.length) + config_.receive_length_delta(receives_++);
      c.length = static_cast<uint64_t>(std::max<int64_t>(length, 0));
    }
    held_.push_back({std::move(c), hold(rng_)});
  }
  if (held_.empty()) return 0;

  // Release what is due, in a random order; the rest waits one more poll.
  std::shuffle(held_.begin(), held_.end(), rng_);
  size_t n = 0;
  for (size_t i = 0; i < held_.size();) {
    if (held_[i].polls_left == 0 && n < out.size()) {
      out[n++] = std::move(held_[i].completion);
      if (i + 1 != held_.size()) held_[i] = std::move(held_.back());
      held_.pop_back();
    } else {
      if (held_[i].polls_left > 0) --held_[i].polls_left;
      ++i;
    }
  }
  return n;
}

}  // namespace fabric::transport
