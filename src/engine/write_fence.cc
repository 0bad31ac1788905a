// WriteFence: the write fence's state machine (write_fence.h). The Worker's lines that feed it
// and send what it returns are in worker_fence.cc.
#include "engine/write_fence.h"

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

bool none(const std::vector<bool>& v) {
  return std::none_of(v.begin(), v.end(), [](bool b) { return b; });
}

}  // namespace

WriteFence::WriteFence(Bytes self, uint32_t nics, std::chrono::milliseconds timeout,
                       std::chrono::milliseconds resend)
    : self_(std::move(self)), nics_(nics), timeout_(timeout), resend_(resend) {}

bool WriteFence::may_write(const Address& owner, uint32_t nic, Clock::time_point now,
                           std::vector<Note>& out) {
  auto [it, fresh] = announced_.try_emplace(key_of(owner.nics()[0].name));
  if (fresh) it->second.owner = owner;
  if (it->second.acked) return true;
  if (fresh || now >= it->second.resend_at) {
    it->second.resend_at = now + resend_;
    out.push_back({owner, nic, FenceNote{MessageKind::kHello, 0, nic, self_}.encode()});
  }
  return false;
}

void WriteFence::forget_owner(const Bytes& owner) {
  if (announced_.erase(key_of(owner)) > 0) ++epoch_;
}

void WriteFence::goodbye(std::vector<Note>& out) const {
  for (const auto& [key, a] : announced_) {
    for (uint32_t nic = 0; nic < nics_; ++nic) {
      out.push_back({a.owner, nic, FenceNote{MessageKind::kGoodbye, 0, nic, self_}.encode()});
    }
  }
}

void WriteFence::fence(Done done, uint32_t message_nic, Clock::time_point now,
                       std::vector<Note>& out) {
  Round r;
  r.done = std::move(done);
  if (stopping_) {  // nothing can be asked now: done once the domains are closed (end())
    rounds_.push_back(std::move(r));
    return;
  }
  if (writers_.empty()) {
    settled_.emplace_back(std::move(r.done), Status::ok());
    return;
  }
  r.id = ++next_round_;
  r.resend_at = now + resend_;
  r.deadline = now + timeout_;
  const Bytes note = FenceNote{MessageKind::kFence, r.id, 0, self_}.encode();
  for (const auto& [key, writer] : writers_) {
    std::vector<bool> waiting(writer.gone.size());
    for (size_t i = 0; i < waiting.size(); ++i) waiting[i] = !writer.gone[i];
    r.waiting.emplace(key, std::move(waiting));
    out.push_back({writer.address, message_nic, note});
  }
  rounds_.push_back(std::move(r));
  settle();
}

void WriteFence::on_note(const FenceNote& note, const Address& from, uint32_t arrived_on,
                         std::vector<Note>& out) {
  const std::string key = key_of(from.nics()[0].name);
  switch (note.kind) {
    case MessageKind::kHello:  // a writer: record it, and let its writes go
      writers_.insert_or_assign(key, Writer{from, std::vector<bool>(from.num_nics(), false)});
      out.push_back(
          {from, arrived_on, FenceNote{MessageKind::kHelloAck, 0, arrived_on, self_}.encode()});
      return;
    case MessageKind::kHelloAck: {  // the writer's queues find it acknowledged when they post
      auto it = announced_.find(key);
      if (it != announced_.end()) it->second.acked = true;
      return;
    }
    case MessageKind::kFence:  // an owner: answer from every NIC, behind what each has posted
      for (uint32_t nic = 0; nic < nics_; ++nic) {
        out.push_back(
            {from, nic, FenceNote{MessageKind::kFenceAck, note.round, nic, self_}.encode()});
      }
      return;
    case MessageKind::kFenceAck:
    case MessageKind::kGoodbye:
      break;
    default:
      return;
  }
  // A writer forgotten after a fence it did not answer in time is back (it ran again).
  if (note.kind == MessageKind::kFenceAck &&
      writers_.try_emplace(key, Writer{from, std::vector<bool>(from.num_nics(), false)}).second) {
    detail::log().warn(
        "a writer that did not answer a write fence in time ({}) answered now; it is fenced "
        "again from here on",
        from.short_name());
  }
  // It proves the order of the connection it came over only: the writer's NIC `nic` writes to
  // this engine's NIC remote_rail(nic, ...). A copy moved to another NIC by failover proves
  // nothing; the Fence is sent again and, failing answers, the writer is dropped.
  if (arrived_on != remote_rail(note.nic, nics_)) return;
  if (note.kind == MessageKind::kGoodbye) {
    auto w = writers_.find(key);
    if (w != writers_.end() && note.nic < w->second.gone.size()) {
      w->second.gone[note.nic] = true;
      const auto& gone = w->second.gone;
      if (std::all_of(gone.begin(), gone.end(), [](bool b) { return b; })) writers_.erase(w);
    }
    answered(key, note.nic, nullptr);
  } else {
    answered(key, note.nic, &note.round);
  }
}

void WriteFence::answered(const std::string& key, uint32_t nic, const uint64_t* round) {
  for (Round& r : rounds_) {
    if (round != nullptr && r.id != *round) continue;
    auto w = r.waiting.find(key);
    if (w == r.waiting.end() || nic >= w->second.size()) continue;
    w->second[nic] = false;
    if (none(w->second)) r.waiting.erase(w);
  }
  settle();
}

void WriteFence::tick(uint32_t message_nic, Clock::time_point now, std::vector<Note>& out) {
  for (Round& r : rounds_) {
    if (r.waiting.empty()) continue;
    if (now >= r.deadline) {
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
                      r.waiting.size(), names, timeout_.count()));
      r.waiting.clear();
      continue;
    }
    if (now < r.resend_at) continue;
    r.resend_at = now + resend_;
    const Bytes note = FenceNote{MessageKind::kFence, r.id, 0, self_}.encode();
    for (const auto& [key, nics] : r.waiting) {
      auto w = writers_.find(key);
      if (w != writers_.end()) out.push_back({w->second.address, message_nic, note});
    }
  }
  settle();
}

void WriteFence::peer_dead(const Bytes& first_nic) {
  const std::string key = key_of(first_nic);
  forget_owner(first_nic);
  if (writers_.erase(key) == 0) return;
  for (Round& r : rounds_) r.waiting.erase(key);
  settle();
}

void WriteFence::settle() {
  if (stopping_) return;  // the rounds end in end(), once the domains are closed
  for (size_t i = 0; i < rounds_.size();) {
    if (!rounds_[i].waiting.empty()) {
      ++i;
      continue;
    }
    settled_.emplace_back(std::move(rounds_[i].done), std::move(rounds_[i].outcome));
    rounds_.erase(rounds_.begin() + static_cast<std::ptrdiff_t>(i));
  }
}

void WriteFence::end() {
  // After the domains closed: no write can arrive any more, whatever a writer still holds.
  for (Round& r : rounds_) settled_.emplace_back(std::move(r.done), std::move(r.outcome));
  rounds_.clear();
}

std::vector<std::pair<WriteFence::Done, Status>> WriteFence::take_settled() {
  return std::exchange(settled_, {});
}

}  // namespace fabric::engine
