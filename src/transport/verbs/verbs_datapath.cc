// verbs backend, hot path: posting work requests and reading completions.
#include <arpa/inet.h>
#include <fmt/format.h>

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/log.h"
#include "transport/verbs/verbs_domain.h"
#include "transport/verbs/verbs_objects.h"

namespace fabric::transport {

using namespace verbs_detail;

namespace {

uint32_t lkey_of(void* desc) {
  return static_cast<uint32_t>(reinterpret_cast<uintptr_t>(desc));
}

ErrorCode classify(ibv_wc_status s) {
  switch (s) {
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_REM_INV_REQ_ERR:
    case IBV_WC_LOC_PROT_ERR:
      return ErrorCode::kRemoteAccess;
    case IBV_WC_RETRY_EXC_ERR:
    case IBV_WC_RNR_RETRY_EXC_ERR:
    case IBV_WC_RESP_TIMEOUT_ERR:
      return ErrorCode::kPeerUnreachable;
    default:
      return ErrorCode::kFabric;
  }
}

Completion completion(Completion::Kind kind, uint64_t wr_id, uint32_t imm = 0,
                      uint64_t length = 0) {
  Completion c{};
  c.kind = kind;
  c.wr_id = wr_id;
  c.imm = imm;
  c.length = length;
  return c;
}

}  // namespace

PostResult VerbsDomain::post_on(QueuePair& qp, const ibv_send_wr& wr, const ibv_sge* sge) {
  // Room is counted when a request is accepted, so a chain never overflows the queues; it is
  // given back when the request is retired from the window (SignalWindow).
  if (qp.window.full() || cq_outstanding_ >= cq_depth_) return PostResult::again();
  Chain& c = qp.chain;
  const uint32_t i = c.length++;
  c.wrs[i] = wr;
  if (sge != nullptr) {
    c.sges[i] = *sge;
    c.wrs[i].sg_list = &c.sges[i];
  }
  bool signalled = false;
  const uint32_t seq = qp.window.push(wr.wr_id, config_.signal_every, signalled);
  c.wrs[i].wr_id = send_wr_id(qp.slot, seq);
  if (signalled) c.wrs[i].send_flags |= IBV_SEND_SIGNALED;
  c.wrs[i].next = nullptr;
  if (i > 0) c.wrs[i - 1].next = &c.wrs[i];
  ++cq_outstanding_;
  if (i == 0) chained_.push_back(&qp);
  if (c.length == kChainLength) flush(qp);  // flush() skips an empty chain later
  return PostResult::posted();
}

void VerbsDomain::flush(QueuePair& qp) {
  Chain& c = qp.chain;
  if (c.length == 0) return;
  // The chain's last request asks for a completion, so that every request posted has a
  // signalled one at or behind it: its completion finishes them all.
  if (qp.window.seal()) c.wrs[c.length - 1].send_flags |= IBV_SEND_SIGNALED;
  ibv_send_wr* bad = nullptr;
  const int rc = ibv_post_send(qp.qp, c.wrs.data(), &bad);
  if (rc != 0) {
    // The requests from `bad` on were not posted (all of them when the provider says nothing):
    // they complete now, with the provider's error. They are the newest in the window.
    const uint32_t first = bad == nullptr ? 0 : static_cast<uint32_t>(bad - c.wrs.data());
    const size_t at = ready_.size();
    for (uint32_t i = c.length; i-- > first;) {
      const uint64_t wr_id = qp.window.pop_newest();
      --cq_outstanding_;
      ready_.push_back(Completion{
          Completion::Kind::kLocal, wr_id, 0, 0, ErrorCode::kFabric,
          fmt::format("ibv_post_send ({} of a chain of {} on the {} queue pair) on '{}' failed: {}",
                      c.wrs[i].opcode == IBV_WR_SEND        ? "a send"
                      : c.wrs[i].opcode == IBV_WR_RDMA_READ ? "a read"
                                                            : "a write",
                      c.length, qp.role_name(), info_.name, strerror(rc))});
    }
    std::reverse(ready_.begin() + static_cast<std::ptrdiff_t>(at), ready_.end());
    // What was posted may end with an unsignalled request, and a queue pair that refuses work
    // is not to be trusted with more: its peer's pair is retired (at the next poll), which
    // drains it (post_marker).
    if (!qp.post_failed) {
      qp.post_failed = true;
      post_failed_.push_back(&qp);
    }
  }
  c.length = 0;
}

void VerbsDomain::flush() {
  for (QueuePair* qp : chained_) flush(*qp);
  chained_.clear();
}

PostResult VerbsDomain::post_rdma(ibv_wr_opcode opcode, uint64_t wr_id, const void* local,
                                  uint64_t length, void* local_desc, PeerHandle peer,
                                  uint64_t remote_addr, uint64_t remote_key, uint32_t imm) {
  Peer* p = peer_of(peer);
  if (p == nullptr) {
    return PostResult::failed(Status(
        ErrorCode::kNotFound, fmt::format("'{}': unknown peer handle {}", info_.name, peer)));
  }
  const bool read = opcode == IBV_WR_RDMA_READ;
  if (length > info_.max_write_bytes || length > UINT32_MAX) {
    return PostResult::failed(
        Status(ErrorCode::kInvalidArgument,
               fmt::format("'{}': a {} of {} bytes is larger than one work request can carry ({})",
                           info_.name, read ? "read" : "write", length,
                           std::min<uint64_t>(info_.max_write_bytes, UINT32_MAX))));
  }
  if (p->state != Peer::State::kConnected) return not_connected(*p);
  ibv_sge sge{reinterpret_cast<uint64_t>(local), static_cast<uint32_t>(length),
              lkey_of(local_desc)};
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.num_sge = length > 0 ? 1 : 0;
  wr.opcode = opcode;
  wr.imm_data = htonl(imm);
  wr.wr.rdma.remote_addr = remote_addr;
  wr.wr.rdma.rkey = static_cast<uint32_t>(remote_key);
  // Small payloads of a write go inside the work request: the NIC need not read them from memory.
  if (!read && length > 0 && length <= p->wr->max_inline) wr.send_flags = IBV_SEND_INLINE;
  return post_on(*p->wr, wr, length > 0 ? &sge : nullptr);
}

PostResult VerbsDomain::post_write(const WriteRequest& req) {
  return post_rdma(req.has_imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE, req.wr_id,
                   req.local, req.length, req.local_desc, req.peer, req.remote_addr, req.remote_key,
                   req.imm);
}

PostResult VerbsDomain::post_read(const ReadRequest& req) {
  return post_rdma(IBV_WR_RDMA_READ, req.wr_id, req.local, req.length, req.local_desc, req.peer,
                   req.remote_addr, req.remote_key, 0);
}

PostResult VerbsDomain::post_send(const SendRequest& req) {
  Peer* p = peer_of(req.peer);
  if (p == nullptr) {
    return PostResult::failed(Status(
        ErrorCode::kNotFound, fmt::format("'{}': unknown peer handle {}", info_.name, req.peer)));
  }
  if (p->state != Peer::State::kConnected) return not_connected(*p);
  ibv_sge sge{reinterpret_cast<uint64_t>(req.local), static_cast<uint32_t>(req.length),
              lkey_of(req.local_desc)};
  ibv_send_wr wr{};
  wr.wr_id = req.wr_id;
  wr.num_sge = req.length > 0 ? 1 : 0;
  wr.opcode = IBV_WR_SEND;
  if (req.length > 0 && req.length <= p->msg->max_inline) wr.send_flags = IBV_SEND_INLINE;
  return post_on(*p->msg, wr, req.length > 0 ? &sge : nullptr);
}

PostResult VerbsDomain::post_recv(const RecvRequest& req) {
  if (msg_srq_posted_ >= msg_srq_depth_ || cq_outstanding_ >= cq_depth_) {
    return PostResult::again();
  }
  ibv_sge sge{reinterpret_cast<uint64_t>(req.local), static_cast<uint32_t>(req.length),
              lkey_of(req.local_desc)};
  ibv_recv_wr wr{};
  wr.wr_id = req.wr_id | kMsgRecvTag;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  const int rc = ibv_post_srq_recv(msg_srq_.get(), &wr, &bad);
  if (rc == 0) {
    ++msg_srq_posted_;
    ++cq_outstanding_;
    return PostResult::posted();
  }
  if (rc == ENOMEM || rc == EAGAIN) return PostResult::again();
  return PostResult::failed(
      Status(ErrorCode::kFabric,
             fmt::format("ibv_post_srq_recv on '{}' failed: {}", info_.name, strerror(rc))));
}

void VerbsDomain::repost_imm_receives() {
  // Chained: one doorbell for every receive consumed since the last poll.
  constexpr uint32_t kChain = 64;
  ibv_recv_wr wrs[kChain];
  while (imm_consumed_ > 0) {
    const uint32_t n = std::min(imm_consumed_, kChain);
    for (uint32_t i = 0; i < n; ++i) {
      wrs[i] = ibv_recv_wr{};
      wrs[i].wr_id = kImmRecvTag;
      wrs[i].next = i + 1 < n ? &wrs[i + 1] : nullptr;
    }
    ibv_recv_wr* bad = nullptr;
    if (ibv_post_srq_recv(imm_srq_.get(), wrs, &bad) != 0) {
      const uint32_t posted = static_cast<uint32_t>(bad - wrs);
      imm_consumed_ -= posted;
      cq_outstanding_ += posted;
      detail::log().warn("verbs '{}': reposting receives for immediates failed: {}", info_.name,
                         strerror(errno));
      return;
    }
    imm_consumed_ -= n;
    cq_outstanding_ += n;
  }
}

void VerbsDomain::translate(const ibv_wc& wc) {
  const uint64_t tag = wc.wr_id & kTagMask;
  if (tag == kSendTag) {
    on_send_completion(wc);
    return;
  }
  if (tag == kImmRecvTag) {
    --cq_outstanding_;
    ++imm_consumed_;
    if (wc.status == IBV_WC_SUCCESS) {
      if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
        ready_.push_back(completion(Completion::Kind::kImm, 0, ntohl(wc.imm_data)));
      }
      return;
    }
  } else if (tag == kMsgRecvTag) {
    --cq_outstanding_;
    --msg_srq_posted_;
    if (wc.status == IBV_WC_SUCCESS) {
      ready_.push_back(completion(Completion::Kind::kRecv, wc.wr_id & ~kTagMask, 0, wc.byte_len));
      return;
    }
  } else {
    detail::log().warn("verbs '{}': a completion with an unknown work request id {:#x}", info_.name,
                       wc.wr_id);
    return;
  }
  // A receive that failed: the queue pair it arrived on (found by number: errors only) is in
  // the error state now; the peer's pair is retired, so that its other work flushes and its
  // next post connects afresh.
  auto it = by_qpn_.find(wc.qp_num);
  QueuePair* qp = it == by_qpn_.end() ? nullptr : it->second;
  Peer* peer = qp != nullptr ? peer_of(qp->peer) : nullptr;
  const bool current = peer != nullptr && (peer->msg.get() == qp || peer->wr.get() == qp);
  std::string text = fmt::format(
      "{} ({}, vendor error {:#x}) on the {} queue pair {} of '{}'", ibv_wc_status_str(wc.status),
      tag == kImmRecvTag ? "a write from the peer" : "a message from the peer", wc.vendor_err,
      qp ? qp->role_name() : "unknown", wc.qp_num, info_.name);
  if (wc.status == IBV_WC_WR_FLUSH_ERR && qp != nullptr && !qp->error_text.empty()) {
    text += fmt::format(": the queue pair had entered the error state ({})", qp->error_text);
  }
  if (current && wc.status != IBV_WC_WR_FLUSH_ERR) retire_qps(*peer, classify(wc.status), text);
  Completion c =
      completion(tag == kImmRecvTag ? Completion::Kind::kRemoteError : Completion::Kind::kRecv,
                 tag == kImmRecvTag ? 0 : wc.wr_id & ~kTagMask);
  c.error = classify(wc.status);
  c.error_message = std::move(text);
  ready_.push_back(std::move(c));
}

void VerbsDomain::on_send_completion(const ibv_wc& wc) {
  // The queue pair by the slot in the wr_id: an index, no lookup. A slot freed and reused since
  // (a completion for a queue pair already destroyed) shows in the queue pair number or in a
  // sequence number outside the window; such a completion is ignored.
  ++send_cqes_;
  const uint32_t slot = slot_of(wc.wr_id);
  QueuePair* qp = slot < qp_slots_.size() ? qp_slots_[slot] : nullptr;
  if (qp == nullptr || qp->qp->qp_num != wc.qp_num) {
    detail::log().debug("verbs '{}': a send completion for queue pair {} (slot {}), gone",
                        info_.name, wc.qp_num, slot);
    return;
  }
  const bool ok = wc.status == IBV_WC_SUCCESS;
  const bool flush = wc.status == IBV_WC_WR_FLUSH_ERR;
  std::string text;
  if (!ok) {
    text = fmt::format("{} ({}, vendor error {:#x}) on the {} queue pair {} of '{}'",
                       ibv_wc_status_str(wc.status),
                       qp->role == QueuePair::Role::kMessages ? "send" : "write", wc.vendor_err,
                       qp->role_name(), wc.qp_num, info_.name);
    if (flush && !qp->error_text.empty()) {
      text += fmt::format(": the queue pair had entered the error state ({})", qp->error_text);
    }
  }
  std::string flushed;  // for requests retired as flushed without a completion of their own
  const uint32_t n = qp->window.complete(
      seq_of(wc.wr_id), ok, flush, [&](uint64_t wr_id, SignalWindow::Outcome o) {
        if (wr_id == kMarkerWrId) return;
        Completion c = completion(Completion::Kind::kLocal, wr_id);
        if (o == SignalWindow::Outcome::kFailed) {
          c.error = classify(wc.status);
          c.error_message = text;
        } else if (o == SignalWindow::Outcome::kFlushed) {
          if (flushed.empty()) {
            flushed =
                fmt::format("flushed: the {} queue pair {} of '{}' entered the error state ({})",
                            qp->role_name(), wc.qp_num, info_.name,
                            !qp->error_text.empty() ? qp->error_text : text);
          }
          c.error = ErrorCode::kFabric;
          c.error_message = flushed;
        }
        ready_.push_back(std::move(c));
      });
  cq_outstanding_ -= n;
  if (n == 0) {
    detail::log().debug(
        "verbs '{}': a completion ({}) for a request of queue pair {} already "
        "retired, ignored",
        info_.name, ibv_wc_status_str(wc.status), wc.qp_num);
  }
  if (!ok) {
    // The queue pair is in the error state: retire the peer's pair (if it is still the one in
    // use), so that its other work flushes and its next post connects afresh.
    Peer* peer = peer_of(qp->peer);
    if (peer != nullptr && (peer->msg.get() == qp || peer->wr.get() == qp)) {
      retire_qps(*peer, classify(wc.status), text);
    }
  }
}

void VerbsDomain::hand_out(std::span<Completion> out, size_t& j) {
  while (j < out.size() && ready_head_ < ready_.size()) out[j++] = std::move(ready_[ready_head_++]);
  if (ready_head_ == ready_.size()) {
    ready_.clear();  // keeps its capacity
    ready_head_ = 0;
  }
}

size_t VerbsDomain::poll(std::span<Completion> out) {
  flush();
  if (!post_failed_.empty()) retire_failed_posts();
  progress();
  size_t j = 0;
  hand_out(out, j);
  // The completion queue is read only while ready_ is empty, so that it stays short.
  if (j < out.size() && !stash_.empty()) {
    for (const ibv_wc& wc : stash_) translate(wc);
    stash_.clear();
    hand_out(out, j);
  }
  while (j < out.size() && ready_.empty()) {
    const int want = static_cast<int>(std::min(out.size() - j, wc_.size()));
    const int n = ibv_poll_cq(cq_.get(), want, wc_.data());
    if (n < 0) {
      out[j++] = Completion{Completion::Kind::kRemoteError,
                            0,
                            0,
                            0,
                            ErrorCode::kFabric,
                            fmt::format("ibv_poll_cq on '{}' failed ({})", info_.name, n)};
      break;
    }
    for (int i = 0; i < n; ++i) translate(wc_[static_cast<size_t>(i)]);
    hand_out(out, j);
    if (n < want) break;
  }
  if (imm_consumed_ > 0) repost_imm_receives();
  if (!retired_.empty()) reap_retired();
  if (j == 0 && software_device_) sched_yield();
  return j;
}

bool VerbsDomain::ready_to_wait() {
  flush();
  if (connecting_ > 0 || !delayed_.empty() || !retired_.empty() || !stash_.empty() ||
      !ready_.empty() || !post_failed_.empty()) {
    return false;
  }
  // Acknowledge what woke us, ask for the next event on both queues, then look once more:
  // a completion that arrived before the request raises no event.
  ibv_cq* ev_cq = nullptr;
  void* ev_ctx = nullptr;
  while (ibv_get_cq_event(channel_.get(), &ev_cq, &ev_ctx) == 0) ibv_ack_cq_events(ev_cq, 1);
  if (ibv_req_notify_cq(cq_.get(), 0) != 0 || ibv_req_notify_cq(ud_cq_.get(), 0) != 0) {
    return false;
  }
  if (progress_handshakes()) return false;
  const int n = ibv_poll_cq(cq_.get(), static_cast<int>(wc_.size()), wc_.data());
  if (n > 0) {
    // Handed out by the next poll, in the order read (a signalled send's completion finishes
    // the requests before it, so completions of one queue pair keep their order).
    stash_.assign(wc_.begin(), wc_.begin() + n);
    return false;
  }
  return n == 0;
}

}  // namespace fabric::transport
