// Worker: its side of the write fence (write_fence.h, docs/hardening.md "Unregister is a
// barrier"): the WriteFence is fed what arrives and what the worker knows, and what it returns is
// sent or run at the pass's top level.
#include <fmt/format.h>

#include <algorithm>
#include <optional>

#include "common/log.h"
#include "engine/worker.h"
#include "engine/write_fence.h"

namespace fabric::engine {

namespace {

// How long an owner waits for a writer's answers before it takes the writer for dead.
std::chrono::milliseconds fence_timeout(const Config& config) {
  return std::min(config.peer_timeout / 4, std::chrono::milliseconds(2000));
}

// How often an unanswered Hello or Fence is sent again (a connection the provider dropped may
// have lost it).
std::chrono::milliseconds fence_resend(const Config& config) {
  return std::clamp(config.peer_timeout / 64, std::chrono::milliseconds(5),
                    std::chrono::milliseconds(250));
}

}  // namespace

void Worker::open_fence() {
  fence_ = std::make_unique<WriteFence>(self_, static_cast<uint32_t>(domains_.size()),
                                        fence_timeout(config_), fence_resend(config_));
  queues_->set_fence(fence_.get());
}

void Worker::send_fence_notes(std::vector<WriteFence::Note>& notes) {
  // Indexed, each note moved out before it is sent: a send starts a transfer, and should one
  // ever end at once and release a region, the fence's next notes would land in this list.
  for (size_t i = 0; i < notes.size(); ++i) {
    WriteFence::Note n = std::move(notes[i]);
    send_internal(std::move(n.to), n.nic, std::move(n.bytes), /*urgent=*/true,
                  /*while_stopping=*/stopping_);
  }
  notes.clear();
}

bool Worker::run_fence_settled() {
  if (!fence_) return false;
  bool any = false;
  for (auto& [done, status] : fence_->take_settled()) {
    any = true;
    if (!status.is_ok()) {
      detail::log().warn("group {}: unregister_memory: {}", group_, status.message());
    }
    if (done) done(status);
  }
  return any;
}

// Below, fence_ is fed and what it returns is left in fence_notes_ and its settled rounds, for
// run_queue_events at the pass's top level: none of these sends or runs anything itself.

void Worker::handle_fence_note(const MessageHeader& header, std::span<const std::byte> body,
                               uint32_t domain) {
  auto note = FenceNote::decode(header.kind, body);
  std::optional<Address> from;
  if (note) {
    if (auto decoded = Address::decode(note->from)) from = std::move(*decoded);
  }
  if (!note || !from || from->num_nics() == 0 || !fence_) {
    detail::log().warn("group {}: dropped a malformed write-fence message (kind {})", group_,
                       static_cast<unsigned>(header.kind));
    return;
  }
  fence_->on_note(*note, *from, domain, fence_notes_);
}

void Worker::fence_writers(std::function<void(const Status&)> done) {
  if (!fence_ || !running_.load()) {
    if (done) done(Status::ok());
    return;
  }
  fence_->fence(std::move(done), health_->message_nic(), std::chrono::steady_clock::now(),
                fence_notes_);
}

void Worker::watch_fences() {
  fence_->tick(health_->message_nic(), now_, fence_notes_);
}

void Worker::peer_gone_from_fence(const Bytes& first_nic) {
  fence_->peer_dead(first_nic);
}

void Worker::say_goodbye() {
  fence_->goodbye(fence_notes_);
  fence_->stop();
}

void Worker::end_fences() {
  if (!fence_) return;
  fence_->end();
  fence_notes_.clear();  // the domains are closed: nothing more is sent
  run_fence_settled();
}

}  // namespace fabric::engine
