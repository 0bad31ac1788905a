// Worker: two-sided messages: the registered send and receive pools, reposted receives,
// sequence stamps, dispatch of what arrives by kind, and the worker's own (internal) messages.

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "common/log.h"
#include "engine/plan.h"
#include "engine/worker.h"

namespace fabric::engine {

Result<std::unique_ptr<Worker::ReceivePool>> Worker::make_pool(uint32_t domain,
                                                               uint64_t buffer_bytes,
                                                               uint32_t count) {
  auto pool = std::make_unique<ReceivePool>();
  const uint64_t slot = round_up(buffer_bytes, kBufferAlignment);
  pool->storage.reset(static_cast<std::byte*>(std::aligned_alloc(kBufferAlignment, slot * count)));
  if (!pool->storage) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("cannot allocate {} receive buffers of {} bytes", count, slot));
  }
  auto reg = domains_[domain].domain->register_memory(pool->storage.get(), slot * count);
  if (!reg) return reg.status();
  pool->reg = std::move(*reg);
  pool->slots.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    pool->slots.push_back({pool->storage.get() + i * slot, slot, pool->reg->local_desc(), domain});
  }
  return pool;
}

Status Worker::start_receives(std::function<void(std::span<const std::byte>)> handler,
                              uint64_t buffer_bytes, uint32_t count) {
  if (!recv_pools_.empty()) {
    return Status(ErrorCode::kAlreadyExists,
                  fmt::format("group {} already has a receive handler", group_));
  }
  // Every buffer takes the largest message a peer may send, whichever pool it lands in; every
  // NIC gets `count` of them, since a message may come over any rail.
  std::vector<std::unique_ptr<ReceivePool>> pools;
  for (uint32_t i = 0; i < domains_.size(); ++i) {
    auto pool = make_pool(
        i, std::max(buffer_bytes, config_.max_message_bytes + kMessageHeaderBytes), count);
    if (!pool) return pool.status();
    pools.push_back(std::move(*pool));
  }
  recv_pools_ = std::move(pools);
  user_handler_ = std::make_shared<MessageHandler>(std::move(handler));
  for (auto& pool : recv_pools_) {
    for (RecvSlot& s : pool->slots) repost(s);
  }
  return Status::ok();
}

void Worker::repost(RecvSlot& slot) {
  transport::RecvRequest req{reinterpret_cast<uint64_t>(&slot), slot.buf, slot.size, slot.desc};
  auto r = domains_[slot.domain].domain->post_recv(req);
  if (r.kind != transport::PostResult::Kind::kPosted) {
    detail::log().error(
        "group {}: cannot repost a receive buffer on '{}': {}", group_,
        domains_[slot.domain].domain->info().name,
        r.kind == transport::PostResult::Kind::kAgain ? "queue full" : r.error.to_string());
  }
}

uint64_t Worker::stamp(Bytes& message) {
  const uint64_t seq = ++next_seq_;
  stamp_header(message, sender_id_, seq);
  return seq;
}

uint32_t Worker::message_nic() const {
  for (uint32_t i = 0; i < domains_.size(); ++i) {
    if (!domains_[i].down) return i;
  }
  return 0;
}

void Worker::on_recv(const transport::Completion& c, uint32_t domain) {
  RecvSlot& slot = *reinterpret_cast<RecvSlot*>(c.wr_id);
  if (c.error != ErrorCode::kOk) {
    if (stopping_ || c.error == ErrorCode::kCancelled) return;
    detail::log().warn("group {}: a receive failed: {}", group_, c.error_message);
    repost(slot);
    return;
  }
  if (c.length < kMessageHeaderBytes) {
    detail::log().warn("group {}: dropped a message of {} bytes, shorter than its header", group_,
                       c.length);
    repost(slot);
    return;
  }
  const MessageHeader header = *read_header(std::span(slot.buf, c.length));
  const uint64_t arrived = c.length - kMessageHeaderBytes;
  if (header.body_length != arrived) {
    // Bytes after the message, or a message cut short: what the provider handed over is not
    // what the sender sent. Bytes after it are dropped (the message itself is whole). A short
    // one is dropped whole: the engine's own messages are sent again until answered; a user
    // message is lost then, with this warning, rather than delivered cut.
    detail::log().warn(
        "group {}: a message of kind {} arrived on NIC '{}' with {} bytes after "
        "its header where its sender wrote {}: {}",
        group_, static_cast<unsigned>(header.kind), domains_[domain].domain->info().name, arrived,
        header.body_length,
        arrived > header.body_length ? "the bytes after it are dropped" : "cut short, dropped");
    if (arrived < header.body_length) {
      repost(slot);
      return;
    }
  }
  const std::span<const std::byte> body(slot.buf + kMessageHeaderBytes, header.body_length);
  if (!seen_[header.sender].insert(header.seq)) {
    // A copy failover sent again, and the first one arrived too: delivered once. A Commit's
    // writer still waits for an Ack, which may be what got lost.
    if (header.kind == MessageKind::kCommit) commit_duplicate(header, domain);
    repost(slot);
    return;
  }
  const MessageKind kind = header.kind;
  switch (kind) {
    case MessageKind::kUser:
      if (user_handler_) {
        jobs_.push_back([h = user_handler_, m = Bytes(body.begin(), body.end())] { (*h)(m); });
      } else {
        detail::log().warn(
            "group {}: dropped a message of {} bytes: no receive handler is set "
            "(set_receive_handler)",
            group_, body.size());
      }
      break;
    case MessageKind::kCommit:
      handle_commit(header, body, domain);
      break;
    case MessageKind::kAck:
      handle_ack(body);
      break;
    case MessageKind::kHello:
    case MessageKind::kHelloAck:
    case MessageKind::kFence:
    case MessageKind::kFenceAck:
    case MessageKind::kGoodbye:
      handle_fence_note(header, body, domain);
      break;
    default:
      detail::log().warn("group {}: dropped a message of unknown kind {}", group_,
                         static_cast<unsigned>(kind));
  }
  repost(slot);
}

Status Worker::add_send_chunk() {
  SendPool& pool = *send_pool_;
  SendPool::Chunk chunk;
  const uint64_t total = pool.slot_bytes * pool.per_chunk;
  chunk.storage.reset(static_cast<std::byte*>(std::aligned_alloc(kBufferAlignment, total)));
  for (auto& d : domains_) {
    auto reg = d.domain->register_memory(chunk.storage.get(), total);
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

void Worker::release_send_slot(Op& op) {
  if (op.send_slot < 0) return;
  send_pool_->free.push_back(op.send_slot);
  op.send_slot = -1;
}

void Worker::send_internal(Address owner, uint32_t domain, Bytes message, bool urgent,
                           bool while_stopping) {
  TransferPtr t = pool_.take();
  t->id = kInternalTransfer | next_internal_++;
  t->while_stopping = while_stopping;
  t->peers.push_back(std::move(owner));
  t->message = std::move(message);
  t->ops.push_back(send_op(*t, domain, t->peers[0], t->message));
  t->ops.back().urgent = urgent;
  start_transfer(std::move(t));
}

}  // namespace fabric::engine
