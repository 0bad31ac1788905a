// FaultDomain: a Domain decorator for tests. It holds completions back and releases them in a
// shuffled order (local completions, immediates and receives alike), and fails chosen writes
// with an error completion, so that the engine's reliable-but-unordered contract is exercised
// on providers that happen to deliver in order.
#pragma once

#include <memory>
#include <random>
#include <vector>

#include "fabric/config.h"
#include "transport/domain.h"

namespace fabric::transport {

class FaultDomain final : public Domain {
 public:
  FaultDomain(std::unique_ptr<Domain> inner, FaultConfig config, uint64_t stream);

  const DomainInfo& info() const override { return inner_->info(); }
  const Bytes& endpoint_name() const override { return inner_->endpoint_name(); }
  Result<std::unique_ptr<MemoryRegistration>> register_memory(void* ptr, uint64_t length,
                                                              bool remote_read) override {
    return inner_->register_memory(ptr, length, remote_read);
  }
  Result<PeerHandle> resolve_peer(std::span<const std::byte> name) override {
    return inner_->resolve_peer(name);
  }
  void forget_peer(PeerHandle peer) override { inner_->forget_peer(peer); }
  void reset_peer(PeerHandle peer) override { inner_->reset_peer(peer); }
  PostResult post_write(const WriteRequest& req) override;
  PostResult post_read(const ReadRequest& req) override;
  PostResult post_send(const SendRequest& req) override { return inner_->post_send(req); }
  void flush() override { inner_->flush(); }
  PostResult post_recv(const RecvRequest& req) override { return inner_->post_recv(req); }
  size_t poll(std::span<Completion> out) override;
  int wait_fd() const override { return inner_->wait_fd(); }
  bool ready_to_wait() override { return held_.empty() && inner_->ready_to_wait(); }
  void close() override { inner_->close(); }

  // Work requests failed on purpose so far.
  uint64_t injected_failures() const { return injected_; }

 private:
  struct Held {
    Completion completion;
    uint32_t polls_left;
  };

  // Fails the work request when FaultConfig::fail_write picks its sequence number, else posts it.
  template <typename Request, typename Post>
  PostResult post_or_fail(const Request& req, Post post);

  std::unique_ptr<Domain> inner_;
  FaultConfig config_;
  std::mt19937_64 rng_;
  uint64_t sequence_ = 0;
  uint64_t injected_ = 0;
  uint64_t receives_ = 0;  // receive completions seen (receive_length_delta)
  std::vector<Held> held_;
  std::vector<Completion> scratch_;
};

}  // namespace fabric::transport
