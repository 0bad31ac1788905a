// Worker: the write fence (docs/hardening.md, "Unregister is a barrier").
//
// libfabric tcp checks a write's remote key once, when the write's first bytes arrive, then
// streams the rest into the memory. Closing a registration therefore refuses writes that start
// later but not one already arriving, and no completion tells the owner about such a write.
// What the owner can rely on is the order of one connection: the provider reads a connection's
// bytes in sequence, so a message that arrives on it arrives after every write that was posted
// on it before the message was.
//
// So, on domains whose provider checks a key once per write (DomainInfo::key_checked_once):
//   - a writer announces itself to an owner (Hello) before its first write there, and posts
//     writes towards that owner only once the owner has recorded it (HelloAck);
//   - an owner that closes a registration sends a Fence to every writer it knows, and each
//     writer answers (FenceAck) from each of its NICs, over the connection that NIC's writes
//     take. When the answers from all NICs of all writers are in, every write posted before
//     them has arrived whole, and unregister_memory() returns;
//   - a writer that closes its engine says Goodbye to every owner it announced itself to, from
//     each NIC, behind the writes posted there: once all have come, the owner stops fencing it
//     (an owner unregistering after its writers exited cleanly waits for nobody);
//   - a writer that does not answer within fence_timeout() (a stopped or overloaded process, or
//     one that died) is forgotten, and unregister_memory() returns kTimeout naming it: the
//     registration is closed and new writes are refused, but the rest of a write that writer
//     had already started may still land if it runs again (the owner cannot cut a libfabric tcp
//     connection that the writer opened). A forgotten writer that answers later, or announces
//     itself again, is a writer again: its late answer arrives after every byte it sent first.
// The notes travel ahead of other queued work (Op::urgent): two engines that start writing to
// each other at once must not wait for each other's HelloAck behind their own held writes.
#include <fmt/format.h>

#include <algorithm>

#include "common/log.h"
#include "engine/plan.h"
#include "engine/worker.h"

namespace fabric::engine {

namespace {

std::string key_of(const Bytes& name) {
  return std::string(reinterpret_cast<const char*>(name.data()), name.size());
}

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

bool Worker::held_for_hello(uint32_t domain, PeerQueue& q, const Op& op) {
  // Only writes of bytes into a registered region: zero-byte writes and writes into a peer's
  // scratch buffer (never unregistered) land nothing a fence would protect.
  if (op.kind != Op::Kind::kWrite || op.length == 0 || op.dst_mem == nullptr ||
      op.owner == nullptr || !domains_[domain].domain->info().key_checked_once) {
    return false;
  }
  auto [it, fresh] = announced_.try_emplace(key_of(q.owner));
  if (fresh) it->second.owner = *op.owner;
  if (it->second.acked) {
    q.announced_epoch = announce_epoch_;
    return false;
  }
  if (fresh || now_ >= it->second.resend_at) {
    it->second.resend_at = now_ + fence_resend(config_);
    send_internal(*op.owner, domain, FenceNote{MessageKind::kHello, 0, domain, self_}.encode(),
                  /*urgent=*/true);
  }
  return true;
}

void Worker::handle_fence_note(const MessageHeader& header, std::span<const std::byte> body,
                               uint32_t domain) {
  auto note = FenceNote::decode(header.kind, body);
  std::optional<Address> from;
  if (note) {
    if (auto decoded = Address::decode(note->from)) from = std::move(*decoded);
  }
  if (!note || !from || from->num_nics() == 0) {
    detail::log().warn("group {}: dropped a malformed write-fence message (kind {})", group_,
                       static_cast<unsigned>(header.kind));
    return;
  }
  const std::string key = key_of(from->nics()[0].name);
  switch (note->kind) {
    case MessageKind::kHello:  // a writer: record it, and let its writes go
      writers_.insert_or_assign(key, Writer{*from, std::vector<bool>(from->num_nics(), false)});
      send_internal(*from, domain, FenceNote{MessageKind::kHelloAck, 0, domain, self_}.encode(),
                    /*urgent=*/true);
      break;
    case MessageKind::kHelloAck: {  // its queues find it acknowledged when they post
      auto it = announced_.find(key);
      if (it != announced_.end()) it->second.acked = true;
      break;
    }
    case MessageKind::kFence:  // an owner: answer from every NIC, behind what each has posted
      for (uint32_t nic = 0; nic < domains_.size(); ++nic) {
        send_internal(*from, nic,
                      FenceNote{MessageKind::kFenceAck, note->round, nic, self_}.encode(),
                      /*urgent=*/true);
      }
      break;
    case MessageKind::kFenceAck:
    case MessageKind::kGoodbye: {
      // A writer forgotten after a fence it did not answer in time is back (it ran again).
      if (note->kind == MessageKind::kFenceAck &&
          writers_.try_emplace(key, Writer{*from, std::vector<bool>(from->num_nics(), false)})
              .second) {
        detail::log().warn(
            "group {}: a writer that did not answer a write fence in time ({}) "
            "answered now; it is fenced again from here on",
            group_, from->short_name());
      }
      // It proves the order of the connection it came over only: the writer's NIC `nic` writes
      // to this engine's NIC remote_rail(nic, ...). A copy moved to another NIC by failover
      // proves nothing; the Fence is sent again and, failing answers, the writer dropped.
      if (domain != remote_rail(note->nic, domains_.size())) break;
      if (note->kind == MessageKind::kGoodbye) {
        auto w = writers_.find(key);
        if (w != writers_.end() && note->nic < w->second.gone.size()) {
          w->second.gone[note->nic] = true;
          const auto& gone = w->second.gone;
          if (std::all_of(gone.begin(), gone.end(), [](bool b) { return b; })) writers_.erase(w);
        }
        for (FenceRound& r : fences_) {
          auto it = r.waiting.find(key);
          if (it != r.waiting.end() && note->nic < it->second.size()) it->second[note->nic] = false;
        }
      } else {
        for (FenceRound& r : fences_) {
          if (r.id != note->round) continue;
          auto w = r.waiting.find(key);
          if (w != r.waiting.end() && note->nic < w->second.size()) w->second[note->nic] = false;
          break;
        }
      }
      for (FenceRound& r : fences_) {
        auto w = r.waiting.find(key);
        if (w != r.waiting.end() &&
            std::none_of(w->second.begin(), w->second.end(), [](bool b) { return b; })) {
          r.waiting.erase(w);
        }
      }
      settle_fences();
      break;
    }
    default:
      break;
  }
}

void Worker::fence_writers(std::function<void(const Status&)> done) {
  if (!fence_writes_ || !running_.load() || (writers_.empty() && !stopping_)) {
    if (done) done(Status::ok());
    return;
  }
  FenceRound r;
  if (stopping_) {  // nothing can be asked now: done once the domains are closed (finish_stop)
    r.done = std::move(done);
    fences_.push_back(std::move(r));
    return;
  }
  r.id = ++next_fence_;
  r.done = std::move(done);
  const auto now = std::chrono::steady_clock::now();
  r.resend_at = now + fence_resend(config_);
  r.deadline = now + fence_timeout(config_);
  const Bytes fence = FenceNote{MessageKind::kFence, r.id, 0, self_}.encode();
  for (const auto& [key, writer] : writers_) {
    std::vector<bool> waiting(writer.gone.size());
    for (size_t i = 0; i < waiting.size(); ++i) waiting[i] = !writer.gone[i];
    r.waiting.emplace(key, std::move(waiting));
    send_internal(writer.address, message_nic(), fence, /*urgent=*/true);
  }
  fences_.push_back(std::move(r));
}

void Worker::watch_fences() {
  for (FenceRound& r : fences_) {
    if (now_ >= r.deadline) {
      // Silent writers are forgotten: later unregistrations do not wait for them again (a
      // dead one would hold each of them up), until they answer or announce themselves.
      std::string names;
      for (const auto& [key, nics] : r.waiting) {
        auto w = writers_.find(key);
        if (w == writers_.end()) continue;
        names += (names.empty() ? "" : ", ") + w->second.address.short_name();
        writers_.erase(w);
      }
      r.outcome = Status(
          ErrorCode::kTimeout,
          fmt::format("the registration is closed on every NIC and new writes to it are refused, "
                      "but {} writer(s) that wrote to this engine ({}) did not confirm within {} "
                      "ms that the writes they had already started have ended (a stopped, "
                      "overloaded or dead process): the rest of one such write may still land "
                      "in the memory if the writer runs again (docs/hardening.md, \"Unregister "
                      "is a barrier\")",
                      r.waiting.size(), names, fence_timeout(config_).count()));
      detail::log().warn("group {}: unregister_memory: {}", group_, r.outcome.message());
      r.waiting.clear();
      continue;
    }
    if (now_ < r.resend_at) continue;
    r.resend_at = now_ + fence_resend(config_);
    const Bytes fence = FenceNote{MessageKind::kFence, r.id, 0, self_}.encode();
    for (const auto& [key, nics] : r.waiting) {
      auto w = writers_.find(key);
      if (w != writers_.end()) {
        send_internal(w->second.address, message_nic(), fence, /*urgent=*/true);
      }
    }
  }
  settle_fences();
}

void Worker::say_goodbye() {
  for (const auto& [key, a] : announced_) {
    for (uint32_t nic = 0; nic < domains_.size(); ++nic) {
      send_internal(a.owner, nic, FenceNote{MessageKind::kGoodbye, 0, nic, self_}.encode(),
                    /*urgent=*/true, /*while_stopping=*/true);
    }
  }
}

void Worker::forget_announcement(const Bytes& owner) {
  if (announced_.erase(key_of(owner)) > 0) ++announce_epoch_;
}

void Worker::post_urgent(DomainState& d, PeerQueue& q) {
  if (q.ops.empty() || !q.ops.front()->urgent) return;
  Op& op = *q.ops.front();
  auto r = post(d, op, q.peer);
  if (r.kind == transport::PostResult::Kind::kAgain) return;
  q.ops.pop_front();
  --queued_;
  if (r.kind == transport::PostResult::Kind::kPosted) {
    q.link(op);
    ++posted_;
  } else {
    complete_op(op, r.error);
  }
}

void Worker::writer_dead(const Bytes& first_nic) {
  const std::string key = key_of(first_nic);
  forget_announcement(first_nic);
  if (writers_.erase(key) == 0) return;
  for (FenceRound& r : fences_) r.waiting.erase(key);
  settle_fences();
}

void Worker::settle_fences() {
  if (stopping_) return;  // the rounds end in finish_stop, once the domains are closed
  for (size_t i = 0; i < fences_.size();) {
    if (!fences_[i].waiting.empty()) {
      ++i;
      continue;
    }
    auto done = std::move(fences_[i].done);
    const Status outcome = std::move(fences_[i].outcome);
    fences_.erase(fences_.begin() + static_cast<std::ptrdiff_t>(i));
    if (done) done(outcome);
  }
}

void Worker::end_fences() {
  // After the domains closed: no write can arrive any more, whatever a writer still holds.
  auto rounds = std::move(fences_);
  fences_.clear();
  for (FenceRound& r : rounds) {
    if (r.done) r.done(r.outcome);
  }
}

}  // namespace fabric::engine
