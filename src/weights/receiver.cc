// WeightReceiver: the version protocol of an inference rank. One mutex guards the state; the
// engine calls (expect_imm, sends) and the user callbacks run outside it. A timer thread fails
// a version that is not complete by its deadline.
#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "fabric/weights/flow.h"

namespace fabric::weights {

using Clock = std::chrono::steady_clock;

class WeightReceiver::Impl : public std::enable_shared_from_this<Impl> {
 public:
  Impl(TransferEngine& engine, const ReceiverOptions& options)
      : engine_(engine), options_(options) {}

  void start_timer() {
    std::weak_ptr<Impl> weak = weak_from_this();
    timer_ = std::thread([weak] {
      for (;;) {
        auto self = weak.lock();
        if (!self || !self->timer_pass()) return;
      }
    });
  }

  Result<Ready> prepare(uint64_t version, uint64_t expected, std::vector<TrainerPeer> trainers,
                        CompleteFn on_complete, FailFn on_fail) {
    Ready ready;
    {
      std::lock_guard lock(mu_);
      if (closed_) return Status(ErrorCode::kClosed, "the weights receiver is closed");
      if (pending_) {
        return Status(ErrorCode::kInvalidArgument,
                      fmt::format("version {} is still pending", pending_->version));
      }
      if (trainers.empty()) {
        return Status(ErrorCode::kInvalidArgument,
                      fmt::format("version {}: no training rank to tell", version));
      }
      if (seq_ >= kReceiverImmediates) {
        return Status(
            ErrorCode::kOutOfRange,
            fmt::format("version {}: every immediate of the receiver's range was used", version));
      }
      ready = Ready{version, options_.imm_base + seq_++, options_.rank,
                    static_cast<uint8_t>(options_.flip ? 1 - active_ : 0)};
      pending_ = Pending{version,
                         ready.imm,
                         ready.copy,
                         expected,
                         std::move(trainers),
                         std::move(on_complete),
                         std::move(on_fail),
                         Clock::now() + options_.timeout};
    }
    if (expected == 0) {
      complete(version);
      return ready;
    }
    engine_.reset_imm(ready.imm);
    std::weak_ptr<Impl> weak = weak_from_this();
    Status armed = engine_.expect_imm(ready.imm, expected, [weak, version] {
      if (auto self = weak.lock()) self->complete(version);
    });
    if (!armed) {
      fail(version, armed);
      return ready;
    }
    cv_.notify_all();  // the timer's deadline
    std::vector<TrainerPeer> peers;
    {
      std::lock_guard lock(mu_);
      if (pending_ && pending_->version == version) peers = pending_->trainers;
    }
    const Bytes message = encode(ready);
    for (const TrainerPeer& t : peers) {
      Callbacks cb;
      cb.on_error = [weak, version, rank = t.rank, name = t.name](const Status& s) {
        if (auto self = weak.lock()) {
          self->fail(version, Status(ErrorCode::kPeerUnreachable,
                                     fmt::format("version {}: the Ready to training rank {} ({}) "
                                                 "failed: {}",
                                                 version, rank, name, s.to_string())));
        }
      };
      auto sent = engine_.submit_send(t.address, message, std::move(cb));
      if (!sent) {
        fail(version,
             Status(sent.status().code(),
                    fmt::format("version {}: the Ready to training rank {} ({}) failed: {}",
                                version, t.rank, t.name, sent.status().message())));
        break;
      }
    }
    return ready;
  }

  void fail_trainer(const std::string& name) {
    uint64_t version = 0;
    uint32_t rank = 0;
    {
      std::lock_guard lock(mu_);
      if (!pending_) return;
      auto it = std::find_if(pending_->trainers.begin(), pending_->trainers.end(),
                             [&](const TrainerPeer& t) { return t.name == name; });
      if (it == pending_->trainers.end()) return;
      version = pending_->version;
      rank = it->rank;
    }
    fail(version, Status(ErrorCode::kPeerUnreachable,
                         fmt::format("version {}: training rank {} ({}) left the registry before "
                                     "the version was complete",
                                     version, rank, name)));
  }

  void close() {
    std::optional<uint64_t> version;
    {
      std::lock_guard lock(mu_);
      if (pending_) version = pending_->version;
    }
    if (version) {
      fail(*version, Status(ErrorCode::kClosed,
                            fmt::format("version {}: the receiver was closed", *version)));
    }
    {
      std::lock_guard lock(mu_);
      closed_ = true;
    }
    cv_.notify_all();
    if (timer_.joinable()) {
      if (timer_.get_id() == std::this_thread::get_id()) {
        timer_.detach();
      } else {
        timer_.join();
      }
    }
  }

  uint8_t active_copy() const {
    std::lock_guard lock(mu_);
    return active_;
  }
  std::optional<uint64_t> version() const {
    std::lock_guard lock(mu_);
    return version_;
  }
  bool half_written() const {
    std::lock_guard lock(mu_);
    return dirty_;
  }
  std::optional<Progress> progress() const {
    uint32_t imm = 0;
    Progress p;
    {
      std::lock_guard lock(mu_);
      if (!pending_) return std::nullopt;
      imm = pending_->imm;
      p.version = pending_->version;
      p.expected = pending_->expected;
    }
    p.landed = engine_.imm_count(imm);
    return p;
  }

 private:
  struct Pending {
    uint64_t version;
    uint32_t imm;
    uint8_t copy;
    uint64_t expected;
    std::vector<TrainerPeer> trainers;
    CompleteFn on_complete;
    FailFn on_fail;
    Clock::time_point deadline;
  };

  void complete(uint64_t version) {
    CompleteFn fn;
    {
      std::lock_guard lock(mu_);
      if (!pending_ || pending_->version != version) return;
      active_ = pending_->copy;
      version_ = version;
      dirty_ = false;
      fn = std::move(pending_->on_complete);
      pending_.reset();
    }
    cv_.notify_all();
    if (fn) fn(version);
  }

  void fail(uint64_t version, const Status& error) {
    FailFn fn;
    uint32_t imm = 0;
    {
      std::lock_guard lock(mu_);
      if (!pending_ || pending_->version != version) return;
      if (!options_.flip) dirty_ = true;
      imm = pending_->imm;
      fn = std::move(pending_->on_fail);
      pending_.reset();
    }
    cv_.notify_all();
    engine_.cancel_expect_imm(imm).ignore();  // kNotFound once reached or never armed
    if (fn) fn(version, error);
  }

  // One wait of the timer thread; false once closed.
  bool timer_pass() {
    std::unique_lock lock(mu_);
    if (closed_) return false;
    if (!pending_) {
      cv_.wait_for(lock, std::chrono::milliseconds(200));
      return true;
    }
    const uint64_t version = pending_->version;
    const auto deadline = pending_->deadline;
    if (Clock::now() < deadline) {
      cv_.wait_until(lock, deadline);
      return true;
    }
    lock.unlock();
    fail(version, Status(ErrorCode::kTimeout,
                         fmt::format("version {} not complete after {} s", version,
                                     std::chrono::duration<double>(options_.timeout).count())));
    return true;
  }

  TransferEngine& engine_;
  ReceiverOptions options_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint32_t seq_ = 0;
  uint8_t active_ = 0;
  std::optional<uint64_t> version_;
  bool dirty_ = false;
  bool closed_ = false;
  std::optional<Pending> pending_;
  std::thread timer_;  // last: started once the rest exists, joined by close()
};

WeightReceiver::WeightReceiver(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
WeightReceiver::~WeightReceiver() {
  impl_->close();
}

Result<std::unique_ptr<WeightReceiver>> WeightReceiver::create(TransferEngine& engine,
                                                               const ReceiverOptions& options) {
  if (options.imm_base > UINT32_MAX - kReceiverImmediates + 1) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("imm_base {:#x}: the receiver's 2^24 immediates would wrap around",
                              options.imm_base));
  }
  auto impl = std::make_shared<Impl>(engine, options);
  impl->start_timer();
  return std::unique_ptr<WeightReceiver>(new WeightReceiver(std::move(impl)));
}

Result<Ready> WeightReceiver::prepare(uint64_t version, uint64_t expected,
                                      std::vector<TrainerPeer> trainers, CompleteFn on_complete,
                                      FailFn on_fail) {
  return impl_->prepare(version, expected, std::move(trainers), std::move(on_complete),
                        std::move(on_fail));
}
void WeightReceiver::fail_trainer(const std::string& name) {
  impl_->fail_trainer(name);
}
void WeightReceiver::close() {
  impl_->close();
}
uint8_t WeightReceiver::active_copy() const {
  return impl_->active_copy();
}
std::optional<uint64_t> WeightReceiver::version() const {
  return impl_->version();
}
bool WeightReceiver::half_written() const {
  return impl_->half_written();
}
std::optional<Progress> WeightReceiver::progress() const {
  return impl_->progress();
}

}  // namespace fabric::weights
