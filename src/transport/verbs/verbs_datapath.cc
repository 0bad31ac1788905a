// verbs backend, hot path: posting work requests and reading completions.
#include <arpa/inet.h>
#include <fmt/format.h>

#include <sched.h>

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

}  // namespace

PostResult VerbsDomain::post_on(QueuePair& qp, const ibv_send_wr& wr, const ibv_sge* sge) {
  // Room is counted when a request is accepted, so a chain never overflows the queues.
  if (qp.outstanding >= qp_send_depth_ || cq_outstanding_ >= cq_depth_) {
    return PostResult::again();
  }
  Chain& c = qp.chain;
  const uint32_t i = c.length++;
  c.wrs[i] = wr;
  if (sge != nullptr) {
    c.sges[i] = *sge;
    c.wrs[i].sg_list = &c.sges[i];
  }
  c.wrs[i].next = nullptr;
  if (i > 0) c.wrs[i - 1].next = &c.wrs[i];
  ++qp.outstanding;
  ++cq_outstanding_;
  if (i == 0) chained_.push_back(&qp);
  if (c.length == kChainLength) flush(qp);  // flush() skips an empty chain later
  return PostResult::posted();
}

void VerbsDomain::flush(QueuePair& qp) {
  Chain& c = qp.chain;
  if (c.length == 0) return;
  ibv_send_wr* bad = nullptr;
  const int rc = ibv_post_send(qp.qp, c.wrs.data(), &bad);
  if (rc != 0) {
    // The requests from `bad` on were not posted (all of them when the provider says nothing):
    // they complete now, with the provider's error.
    const uint32_t first = bad == nullptr ? 0 : static_cast<uint32_t>(bad - c.wrs.data());
    for (uint32_t i = first; i < c.length; ++i) {
      --qp.outstanding;
      --cq_outstanding_;
      failed_.push_back(Completion{
          Completion::Kind::kLocal, c.wrs[i].wr_id, 0, 0, ErrorCode::kFabric,
          fmt::format("ibv_post_send ({} of a chain of {} on the {} queue pair) on '{}' failed: {}",
                      c.wrs[i].opcode == IBV_WR_SEND ? "a send" : "a write", c.length,
                      qp.role_name(), info_.name, strerror(rc))});
    }
  }
  c.length = 0;
}

void VerbsDomain::flush() {
  for (QueuePair* qp : chained_) flush(*qp);
  chained_.clear();
}

PostResult VerbsDomain::post_write(const WriteRequest& req) {
  Peer* p = peer_of(req.peer);
  if (p == nullptr) {
    return PostResult::failed(Status(
        ErrorCode::kNotFound, fmt::format("'{}': unknown peer handle {}", info_.name, req.peer)));
  }
  if (req.length > info_.max_write_bytes || req.length > UINT32_MAX) {
    return PostResult::failed(Status(
        ErrorCode::kInvalidArgument,
        fmt::format("'{}': a write of {} bytes is larger than one work request can carry ({})",
                    info_.name, req.length,
                    std::min<uint64_t>(info_.max_write_bytes, UINT32_MAX))));
  }
  if (p->state != Peer::State::kConnected) return not_connected(*p);
  ibv_sge sge{reinterpret_cast<uint64_t>(req.local), static_cast<uint32_t>(req.length),
              lkey_of(req.local_desc)};
  ibv_send_wr wr{};
  wr.wr_id = req.wr_id;
  wr.num_sge = req.length > 0 ? 1 : 0;
  wr.opcode = req.has_imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
  wr.imm_data = htonl(req.imm);
  wr.wr.rdma.remote_addr = req.remote_addr;
  wr.wr.rdma.rkey = static_cast<uint32_t>(req.remote_key);
  // Small payloads go inside the work request: the NIC need not read them from memory.
  if (req.length > 0 && req.length <= p->wr->max_inline) wr.send_flags = IBV_SEND_INLINE;
  return post_on(*p->wr, wr, req.length > 0 ? &sge : nullptr);
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

bool VerbsDomain::translate(const ibv_wc& wc, Completion& c) {
  c.error = ErrorCode::kOk;
  c.error_message.clear();
  c.imm = 0;
  c.length = 0;
  --cq_outstanding_;
  auto it = by_qpn_.find(wc.qp_num);
  QueuePair* qp = it == by_qpn_.end() ? nullptr : it->second;
  Peer* peer = qp != nullptr ? peer_of(qp->peer) : nullptr;
  // Whether qp is what the peer uses now (not a queue pair already retired).
  const bool current = peer != nullptr && (peer->msg.get() == qp || peer->wr.get() == qp);
  auto describe = [&](const char* what) {
    std::string text = fmt::format("{} ({}, vendor error {:#x}) on the {} queue pair {} of '{}'",
                                   ibv_wc_status_str(wc.status), what, wc.vendor_err,
                                   qp ? qp->role_name() : "unknown", wc.qp_num, info_.name);
    if (wc.status == IBV_WC_WR_FLUSH_ERR && qp != nullptr && !qp->error_text.empty()) {
      text += fmt::format(": the queue pair had entered the error state ({})", qp->error_text);
    }
    return text;
  };
  // A queue pair whose work failed (not flushed) is in the error state now: retire the peer's
  // pair, so that its other work flushes and its next post connects afresh.
  auto broke = [&](const std::string& text) {
    if (current && wc.status != IBV_WC_WR_FLUSH_ERR) retire_qps(*peer, classify(wc.status), text);
  };

  const uint64_t tag = wc.wr_id & kTagMask;
  if (tag == kImmRecvTag) {
    ++imm_consumed_;
    if (wc.status == IBV_WC_SUCCESS) {
      if (wc.opcode != IBV_WC_RECV_RDMA_WITH_IMM) return false;
      c.kind = Completion::Kind::kImm;
      c.wr_id = 0;
      c.imm = ntohl(wc.imm_data);
      return true;
    }
    c.kind = Completion::Kind::kRemoteError;
    c.wr_id = 0;
    c.error = classify(wc.status);
    c.error_message = describe("a write from the peer");
    broke(c.error_message);
    return true;
  }
  if (tag == kMsgRecvTag) {
    --msg_srq_posted_;
    c.kind = Completion::Kind::kRecv;
    c.wr_id = wc.wr_id & ~kTagMask;
    c.length = wc.byte_len;
    if (wc.status != IBV_WC_SUCCESS) {
      c.error = classify(wc.status);
      c.error_message = describe("a message from the peer");
      broke(c.error_message);
    }
    return true;
  }
  // A send or write of ours.
  if (qp != nullptr) --qp->outstanding;
  c.kind = Completion::Kind::kLocal;
  c.wr_id = wc.wr_id;
  if (wc.status != IBV_WC_SUCCESS) {
    c.error = classify(wc.status);  // flushed work: kFabric, its message says why
    c.error_message = describe(qp && qp->role == QueuePair::Role::kMessages ? "send" : "write");
    broke(c.error_message);
  }
  return true;
}

size_t VerbsDomain::poll(std::span<Completion> out) {
  flush();
  progress();
  size_t j = 0;
  while (j < out.size() && !failed_.empty()) {
    out[j++] = std::move(failed_.back());
    failed_.pop_back();
  }
  while (j < out.size() && !stash_.empty()) {
    ibv_wc wc = stash_.back();
    stash_.pop_back();
    if (translate(wc, out[j])) ++j;
  }
  while (j < out.size()) {
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
    for (int i = 0; i < n; ++i) {
      if (translate(wc_[static_cast<size_t>(i)], out[j])) ++j;
    }
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
      !failed_.empty()) {
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
    // Handed out by the next poll (in reverse order: the contract is unordered anyway).
    stash_.assign(wc_.begin(), wc_.begin() + n);
    return false;
  }
  return n == 0;
}

}  // namespace fabric::transport
