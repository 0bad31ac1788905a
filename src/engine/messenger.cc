// Messenger (messenger.h): the send and receive pools, reposted receives, and the checks, dedup
// and classification of what arrives.

#include "engine/messenger.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <utility>

#include "common/log.h"

namespace fabric::engine {

Received read_message(std::span<const std::byte> arrived, SeenWindows& seen, bool has_handler,
                      uint32_t group, std::string_view nic) {
  Received r;
  if (arrived.size() < kMessageHeaderBytes) {
    detail::log().warn("group {}: dropped a message of {} bytes, shorter than its header", group,
                       arrived.size());
    return r;
  }
  const MessageHeader header = *read_header(arrived);
  const uint64_t body_bytes = arrived.size() - kMessageHeaderBytes;
  if (header.body_length != body_bytes) {
    // Bytes after the message, or a message cut short: what the provider handed over is not
    // what the sender sent. Bytes after it are dropped (the message itself is whole). A short
    // one is dropped whole: the engine's own messages are sent again until answered; a user
    // message is lost then, with this warning, rather than delivered cut.
    detail::log().warn(
        "group {}: a message of kind {} arrived on NIC '{}' with {} bytes after "
        "its header where its sender wrote {}: {}",
        group, static_cast<unsigned>(header.kind), nic, body_bytes, header.body_length,
        body_bytes > header.body_length ? "the bytes after it are dropped" : "cut short, dropped");
    if (body_bytes < header.body_length) return r;
  }
  r.header = header;
  r.body = arrived.subspan(kMessageHeaderBytes, header.body_length);
  if (!seen[header.sender].insert(header.seq)) {
    // A copy failover sent again, and the first one arrived too: delivered once. A Commit's
    // writer still waits for an Ack, which may be what got lost.
    if (header.kind == MessageKind::kCommit || header.kind == MessageKind::kReadCommit) {
      r.kind = Received::Kind::kDuplicateCommit;
    }
    return r;
  }
  switch (header.kind) {
    case MessageKind::kUser:
      if (has_handler) {
        r.kind = Received::Kind::kUser;
      } else {
        detail::log().warn(
            "group {}: dropped a message of {} bytes: no receive handler is set "
            "(set_receive_handler)",
            group, r.body.size());
      }
      break;
    case MessageKind::kCommit:
    case MessageKind::kReadCommit:
      r.kind = Received::Kind::kCommit;
      break;
    case MessageKind::kAck:
      r.kind = Received::Kind::kAck;
      break;
    case MessageKind::kHello:
    case MessageKind::kHelloAck:
    case MessageKind::kFence:
    case MessageKind::kFenceAck:
    case MessageKind::kGoodbye:
      r.kind = Received::Kind::kFenceNote;
      break;
    default:
      detail::log().warn("group {}: dropped a message of unknown kind {}", group,
                         static_cast<unsigned>(header.kind));
  }
  return r;
}

Result<std::unique_ptr<Messenger>> Messenger::create(uint32_t group,
                                                     std::vector<transport::Domain*> domains,
                                                     const Sizes& sizes) {
  std::unique_ptr<Messenger> m(new Messenger(group, std::move(domains), sizes));
  // Registered send buffers, on every NIC: a message goes over the first NIC that is up.
  m->send_pool_.slot_bytes =
      round_up(sizes.max_message_bytes + kMessageHeaderBytes, kBufferAlignment);
  m->send_pool_.per_chunk = std::max<uint32_t>(sizes.send_buffers, 1);
  if (Status s = m->add_send_chunk(); !s) return s;
  // The engine's own receive buffers on every NIC, posted before anything can be sent here.
  for (uint32_t i = 0; i < m->domains_.size(); ++i) {
    auto control = m->make_pool(i, sizes.max_message_bytes + kMessageHeaderBytes,
                                std::max<uint32_t>(sizes.control_buffers, 1));
    if (!control) return control.status();
    m->control_pools_.push_back(std::move(*control));
    for (RecvSlot& slot : m->control_pools_.back()->slots) m->repost(slot);
  }
  // Receivers tell this worker's messages apart from any other's (a restarted engine's too).
  std::random_device random;
  m->sender_id_ = (uint64_t{random()} << 32) ^ random();
  return m;
}

Result<std::unique_ptr<Messenger::ReceivePool>> Messenger::make_pool(uint32_t domain,
                                                                     uint64_t buffer_bytes,
                                                                     uint32_t count) {
  auto pool = std::make_unique<ReceivePool>();
  const uint64_t slot = round_up(buffer_bytes, kBufferAlignment);
  pool->storage.reset(static_cast<std::byte*>(std::aligned_alloc(kBufferAlignment, slot * count)));
  if (!pool->storage) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("cannot allocate {} receive buffers of {} bytes", count, slot));
  }
  auto reg = domains_[domain]->register_memory(pool->storage.get(), slot * count, false);
  if (!reg) return reg.status();
  pool->reg = std::move(*reg);
  pool->slots.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    pool->slots.push_back({pool->storage.get() + i * slot, slot, pool->reg->local_desc(), domain});
  }
  return pool;
}

Status Messenger::start_receives(Handler handler, uint64_t buffer_bytes, uint32_t count) {
  if (!recv_pools_.empty()) {
    return Status(ErrorCode::kAlreadyExists,
                  fmt::format("group {} already has a receive handler", group_));
  }
  // Every buffer takes the largest message a peer may send, whichever pool it lands in; every
  // NIC gets `count` of them, since a message may come over any rail.
  std::vector<std::unique_ptr<ReceivePool>> pools;
  for (uint32_t i = 0; i < domains_.size(); ++i) {
    auto pool =
        make_pool(i, std::max(buffer_bytes, sizes_.max_message_bytes + kMessageHeaderBytes), count);
    if (!pool) return pool.status();
    pools.push_back(std::move(*pool));
  }
  recv_pools_ = std::move(pools);
  user_handler_ = std::make_shared<Handler>(std::move(handler));
  for (auto& pool : recv_pools_) {
    for (RecvSlot& s : pool->slots) repost(s);
  }
  return Status::ok();
}

void Messenger::repost(RecvSlot& slot) {
  transport::RecvRequest req{reinterpret_cast<uint64_t>(&slot), slot.buf, slot.size, slot.desc};
  auto r = domains_[slot.domain]->post_recv(req);
  if (r.kind != transport::PostResult::Kind::kPosted) {
    detail::log().error(
        "group {}: cannot repost a receive buffer on '{}': {}", group_,
        domains_[slot.domain]->info().name,
        r.kind == transport::PostResult::Kind::kAgain ? "queue full" : r.error.to_string());
  }
}

Received Messenger::on_recv(const transport::Completion& c, uint32_t domain, bool stopping) {
  RecvSlot& slot = *reinterpret_cast<RecvSlot*>(c.wr_id);
  Received r;
  if (c.error != ErrorCode::kOk) {
    if (stopping || c.error == ErrorCode::kCancelled) return r;
    detail::log().warn("group {}: a receive failed: {}", group_, c.error_message);
  } else {
    r = read_message(std::span<const std::byte>(slot.buf, c.length), seen_,
                     user_handler_ != nullptr, group_, domains_[domain]->info().name);
  }
  r.slot = &slot;
  return r;
}

bool Messenger::fill_send(Op& op, bool may_grow) {
  SendPool& pool = send_pool_;
  if (op.send_slot < 0) {
    if (pool.free.empty()) {
      if (!may_grow || pool.chunks.size() >= kMaxSendChunks) return false;
      if (Status s = add_send_chunk(); !s) {
        detail::log().warn("group {}: could not add send buffers: {}", group_, s.to_string());
        return false;
      }
    }
    op.send_slot = pool.free.back();
    pool.free.pop_back();
    std::byte* buf = pool.at(op.send_slot);
    std::memcpy(buf, op.message->data(), op.message->size());
    op.local = buf;
  }
  op.local_desc = pool.desc(op.send_slot, op.domain);
  return true;
}

Status Messenger::add_send_chunk() {
  SendPool& pool = send_pool_;
  SendPool::Chunk chunk;
  const uint64_t total = pool.slot_bytes * pool.per_chunk;
  chunk.storage.reset(static_cast<std::byte*>(std::aligned_alloc(kBufferAlignment, total)));
  for (transport::Domain* d : domains_) {
    auto reg = d->register_memory(chunk.storage.get(), total, false);
    if (!reg) return reg.status();
    chunk.regs.push_back(std::move(*reg));
  }
  const auto first = static_cast<int32_t>(pool.chunks.size() * pool.per_chunk);
  pool.chunks.push_back(std::move(chunk));
  for (int32_t i = static_cast<int32_t>(pool.per_chunk) - 1; i >= 0; --i) {
    pool.free.push_back(first + i);
  }
  return Status::ok();
}

}  // namespace fabric::engine
