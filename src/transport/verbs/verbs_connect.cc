// verbs backend, connections: each peer's queue pairs (created, connected, retired and
// reaped) and the handshake datagrams over the UD queue pair that set them up; the async
// events and the progress that drives both (docs/verbs.md).
#include <arpa/inet.h>
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>

#include "common/log.h"
#include "transport/verbs/verbs_domain.h"
#include "transport/verbs/verbs_objects.h"

namespace fabric::transport {

using namespace verbs_detail;

namespace {

// RC transport: local ACK timeout 4.096 us * 2^14 = 67 ms, 7 retries; receiver-not-ready
// retried without bound (the peer reposts its receives), after at least 0.01 ms.
constexpr uint8_t kAckTimeout = 14;
constexpr uint8_t kRetryCount = 7;
constexpr uint8_t kRnrRetryForever = 7;
constexpr uint8_t kMinRnrTimer = 1;
// The payload a write or send carries inside its work request when the device allows it.
constexpr uint32_t kInlineBytes = 256;

}  // namespace

// --- queue pairs ----------------------------------------------------------------------------

Status VerbsDomain::create_qps(Peer& p) {
  auto make = [&](QueuePair::Role role, ibv_srq* srq) -> Result<std::unique_ptr<QueuePair>> {
    ibv_qp_init_attr qa{};
    qa.send_cq = cq_.get();
    qa.recv_cq = cq_.get();
    qa.srq = srq;
    qa.qp_type = IBV_QPT_RC;
    qa.sq_sig_all = 0;  // selective signalling: SignalWindow says which requests are signalled
    // One more than the window's room: the marker that drains it after a refused post.
    qa.cap.max_send_wr = qp_send_depth_ + 1;
    qa.cap.max_send_sge = 1;
    qa.cap.max_inline_data = kInlineBytes;
    auto q = std::make_unique<QueuePair>();
    q->role = role;
    q->peer = p.handle;
    q->qp = ibv_create_qp(dev_->qp_pd(), &qa);
    if (q->qp == nullptr) {  // a device that cannot inline that much: without inline data
      qa.cap.max_inline_data = 0;
      q->qp = ibv_create_qp(dev_->qp_pd(), &qa);
    }
    q->max_inline = qa.cap.max_inline_data;  // what the device granted (at least what was asked)
    if (q->qp == nullptr) {
      return Status(ErrorCode::kFabric, fmt::format("ibv_create_qp (RC) on '{}' failed: {}",
                                                    info_.name, strerror(errno)));
    }
    ibv_qp_attr at{};
    at.qp_state = IBV_QPS_INIT;
    at.pkey_index = 0;
    at.port_num = port_;
    at.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    if (ibv_modify_qp(q->qp, &at,
                      IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) != 0) {
      return Status(ErrorCode::kFabric, fmt::format("ibv_modify_qp (RC to INIT) on '{}' failed: {}",
                                                    info_.name, strerror(errno)));
    }
    if (free_slots_.empty()) {
      if (qp_slots_.size() >= kMaxQpSlots) {
        return Status(ErrorCode::kFabric,
                      fmt::format("'{}': {} queue pairs at once", info_.name, qp_slots_.size()));
      }
      free_slots_.push_back(static_cast<uint32_t>(qp_slots_.size()));
      qp_slots_.push_back(nullptr);
    }
    q->slot = free_slots_.back();
    free_slots_.pop_back();
    qp_slots_[q->slot] = q.get();
    q->window = SignalWindow(qp_send_depth_);
    by_qpn_[q->qp->qp_num] = q.get();
    return q;
  };
  auto forget = [&](QueuePair& q) {
    by_qpn_.erase(q.qp->qp_num);
    qp_slots_[q.slot] = nullptr;
    free_slots_.push_back(q.slot);
  };
  auto msg = make(QueuePair::Role::kMessages, msg_srq_.get());
  if (!msg) return msg.status();
  auto wr = make(QueuePair::Role::kWrites, imm_srq_.get());
  if (!wr) {
    forget(**msg);
    return wr.status();
  }
  p.msg = std::move(*msg);
  p.wr = std::move(*wr);
  std::random_device rd;
  p.msg_psn = rd() & 0xffffff;
  p.wr_psn = rd() & 0xffffff;
  ++p.gen;
  return Status::ok();
}

Status VerbsDomain::connect_qps(Peer& p, const Hello& h) {
  // Path MTU: the smaller of both ports' active MTU.
  const auto mtu = static_cast<ibv_mtu>(std::min(active_mtu_, h.mtu));
  auto connect = [&](QueuePair& q, uint32_t remote_qpn, uint32_t remote_psn, uint32_t my_psn) {
    ibv_qp_attr at{};
    at.qp_state = IBV_QPS_RTR;
    at.path_mtu = mtu;
    at.dest_qp_num = remote_qpn;
    at.rq_psn = remote_psn;
    at.max_dest_rd_atomic = rd_atomic_;
    at.min_rnr_timer = kMinRnrTimer;
    at.ah_attr.is_global = 1;
    std::memcpy(at.ah_attr.grh.dgid.raw, h.gid, 16);
    at.ah_attr.grh.sgid_index = static_cast<uint8_t>(gid_index_);
    at.ah_attr.grh.hop_limit = kHopLimit;
    at.ah_attr.dlid = h.lid;
    at.ah_attr.port_num = port_;
    if (ibv_modify_qp(q.qp, &at,
                      IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                          IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) != 0) {
      return Status(ErrorCode::kFabric, fmt::format("ibv_modify_qp (RC to RTR) on '{}' failed: {}",
                                                    info_.name, strerror(errno)));
    }
    at = {};
    at.qp_state = IBV_QPS_RTS;
    at.timeout = kAckTimeout;
    at.retry_cnt = kRetryCount;
    at.rnr_retry = kRnrRetryForever;
    at.sq_psn = my_psn;
    at.max_rd_atomic = rd_atomic_;
    if (ibv_modify_qp(q.qp, &at,
                      IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                          IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC) != 0) {
      return Status(ErrorCode::kFabric, fmt::format("ibv_modify_qp (RC to RTS) on '{}' failed: {}",
                                                    info_.name, strerror(errno)));
    }
    return Status::ok();
  };
  if (Status s = connect(*p.msg, h.msg_qpn, h.msg_psn, p.msg_psn); !s) return s;
  if (Status s = connect(*p.wr, h.wr_qpn, h.wr_psn, p.wr_psn); !s) return s;
  p.remote_gen = h.gen;
  if (p.state == Peer::State::kConnecting) --connecting_;
  p.state = Peer::State::kConnected;
  detail::log().debug("verbs '{}': connected to {} (QPs {}/{} -> {}/{}, path MTU {})", info_.name,
                      gid_text(p.gid), p.msg->qp->qp_num, p.wr->qp->qp_num, h.msg_qpn, h.wr_qpn,
                      mtu_bytes(mtu));
  return Status::ok();
}

void VerbsDomain::retire_qps(Peer& p, ErrorCode code, const std::string& why) {
  flush();  // chained work goes to the queue pairs first, to be flushed with the rest
  for (auto* q : {&p.msg, &p.wr}) {
    if (!*q) continue;
    ibv_qp_attr at{};
    at.qp_state = IBV_QPS_ERR;
    if (ibv_modify_qp((*q)->qp, &at, IBV_QP_STATE) != 0) {
      detail::log().warn("'{}': ibv_modify_qp (to ERR) failed: {}", info_.name, strerror(errno));
    }
    (*q)->error = code;
    (*q)->error_text = why;
    // Requests finishing without a completion of their own from now on may have been flushed.
    (*q)->window.mark_broken();
    // Its newest posted request is signalled (flush() seals every chain), so its completion,
    // flushed or not, finishes the window; unless a post was refused part way: then a marker.
    if (!(*q)->window.empty() && !(*q)->window.newest_signalled()) post_marker(**q);
    retired_.push_back(std::move(*q));
  }
  if (p.state == Peer::State::kConnected) p.state = Peer::State::kIdle;
}

void VerbsDomain::post_marker(QueuePair& q) {
  // A zero-length write in the error state: never sent, completed as flushed.
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr_id = send_wr_id(q.slot, q.window.push_marker(kMarkerWrId));
  ++cq_outstanding_;
  ibv_send_wr* bad = nullptr;
  const int rc =
      cq_outstanding_ > cq_depth_ + kMarkerReserve ? ENOSPC : ibv_post_send(q.qp, &wr, &bad);
  if (rc != 0) {
    // Nothing will finish what is posted: it fails now. (Completions the device may still
    // generate for it find their sequence numbers retired and are ignored.)
    q.window.pop_newest();
    --cq_outstanding_;
    const std::string text = fmt::format(
        "flushed: the {} queue pair {} of '{}' entered the error state ({}), and posting the "
        "marker that drains it failed: {}",
        q.role_name(), q.qp->qp_num, info_.name, q.error_text, strerror(rc));
    cq_outstanding_ -= q.window.fail_all([&](uint64_t wr_id, SignalWindow::Outcome) {
      if (wr_id != kMarkerWrId) {
        ready_.push_back(
            Completion{Completion::Kind::kLocal, wr_id, 0, 0, ErrorCode::kFabric, text});
      }
    });
  }
}

void VerbsDomain::retire_failed_posts() {
  while (!post_failed_.empty()) {
    QueuePair* q = post_failed_.back();
    post_failed_.pop_back();
    q->post_failed = false;
    Peer* p = peer_of(q->peer);
    // Not current any more: retire_qps already drained it when it moved it.
    if (p == nullptr || (p->msg.get() != q && p->wr.get() != q)) continue;
    retire_qps(*p, ErrorCode::kFabric,
               fmt::format("its {} queue pair refused a chained post", q->role_name()));
  }
}

void VerbsDomain::reap_retired() {
  for (size_t i = 0; i < retired_.size();) {
    QueuePair& q = *retired_[i];
    if (q.window.empty() && q.chain.length == 0 && !q.post_failed) {
      by_qpn_.erase(q.qp->qp_num);
      qp_slots_[q.slot] = nullptr;
      free_slots_.push_back(q.slot);
      retired_[i] = std::move(retired_.back());
      retired_.pop_back();
    } else {
      ++i;
    }
  }
}

// --- the handshake --------------------------------------------------------------------------

PostResult VerbsDomain::not_connected(Peer& p) {
  const auto now = Clock::now();
  if (p.state == Peer::State::kConnecting) return PostResult::again();
  if (p.state == Peer::State::kFailed) {
    if (now < p.failed_at + config_.connect_retry || p.ah == nullptr) {
      return PostResult::failed(Status(ErrorCode::kPeerUnreachable, p.error));
    }
    p.state = Peer::State::kIdle;  // time to try again
  }
  if (!p.msg) {
    if (Status s = create_qps(p); !s) return PostResult::failed(std::move(s));
  }
  p.state = Peer::State::kConnecting;
  ++connecting_;
  p.attempts = 1;
  p.interval = config_.connect_retry;
  p.first_attempt = now;
  p.next_retry = now + p.interval;
  send_hello(p, Hello::kRequest, 0);
  return PostResult::again();
}

void VerbsDomain::send_hello(Peer& p, uint8_t type, uint32_t echo_gen) {
  Hello h{};
  h.magic = kHelloMagic;
  h.type = type;
  h.mtu = active_mtu_;
  h.lid = lid_;
  h.src_instance = instance_;
  h.dst_instance = p.instance;
  h.src_ud_qpn = ud_qp_->qp->qp_num;
  h.gen = p.gen;
  h.echo_gen = echo_gen;
  h.msg_qpn = p.msg->qp->qp_num;
  h.wr_qpn = p.wr->qp->qp_num;
  h.msg_psn = p.msg_psn;
  h.wr_psn = p.wr_psn;
  std::memcpy(h.gid, gid_.raw, 16);
  const uint32_t n = hellos_sent_++;
  if (n < config_.drop_handshakes) {
    detail::log().debug("verbs '{}': dropping handshake datagram {} (fault injection)", info_.name,
                        n);
    return;
  }
  if (n < config_.drop_handshakes + config_.delay_handshakes) {
    delayed_.push_back(
        std::make_unique<DelayedHello>(Clock::now() + config_.handshake_delay, h, p.handle));
    return;
  }
  transmit_hello(h, p);
}

void VerbsDomain::transmit_hello(const Hello& h, Peer& p) {
  if (p.ah == nullptr) return;
  if (ud_free_send_.empty()) {
    detail::log().debug("verbs '{}': no free handshake send slot; the retry will resend",
                        info_.name);
    return;
  }
  const uint32_t slot = ud_free_send_.back();
  ud_free_send_.pop_back();
  std::byte* buf = ud_buf_.data() + static_cast<size_t>(slot) * kUdSlotBytes;
  std::memcpy(buf, &h, sizeof(h));
  ibv_sge sge{reinterpret_cast<uint64_t>(buf), sizeof(h), ud_mr_->lkey};
  ibv_send_wr wr{};
  wr.wr_id = slot;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.ud.ah = p.ah;
  wr.wr.ud.remote_qpn = p.ud_qpn;
  wr.wr.ud.remote_qkey = kQkey;
  ibv_send_wr* bad = nullptr;
  if (ibv_post_send(ud_qp_->qp, &wr, &bad) != 0) {
    ud_free_send_.push_back(slot);
    detail::log().warn("verbs '{}': posting a handshake datagram failed: {}", info_.name,
                       strerror(errno));
  }
}

void VerbsDomain::on_hello(const Hello& h) {
  if (h.magic != kHelloMagic || h.dst_instance != instance_) return;  // not for this domain
  ibv_gid gid{};
  std::memcpy(gid.raw, h.gid, 16);
  Peer& p = peer_by_instance(h.src_instance, gid, h.src_ud_qpn, h.lid, h.mtu);
  if (h.type == Hello::kRequest) {
    if (h.gen < p.remote_gen) return;  // a stale request, delayed past a newer one
    if (p.state == Peer::State::kConnected && h.gen == p.remote_gen) {
      send_hello(p, Hello::kReply, h.gen);  // our reply was lost or is late: answer again
      return;
    }
    if (p.state == Peer::State::kConnected) {
      // The peer made new queue pairs (its old ones broke, or it forgot us): so do we.
      retire_qps(p, ErrorCode::kPeerUnreachable, "the peer reconnected");
    }
    if (!p.msg) {
      if (Status s = create_qps(p); !s) {
        detail::log().warn("verbs '{}': cannot answer a connection request: {}", info_.name,
                           s.message());
        return;
      }
    }
    if (Status s = connect_qps(p, h); !s) {
      detail::log().warn("verbs '{}': {}", info_.name, s.message());
      retire_qps(p, s.code(), s.message());
      return;
    }
    send_hello(p, Hello::kReply, h.gen);
  } else if (h.type == Hello::kReply) {
    if (p.state != Peer::State::kConnecting || h.echo_gen != p.gen) return;  // late or stale
    if (Status s = connect_qps(p, h); !s) {
      detail::log().warn("verbs '{}': {}", info_.name, s.message());
      retire_qps(p, s.code(), s.message());
      --connecting_;
      p.state = Peer::State::kFailed;
      p.failed_at = Clock::now();
      p.error = s.message();
    }
  }
}

void VerbsDomain::read_async_events() {
  ibv_async_event ev{};
  while (ibv_get_async_event(dev_->ctx, &ev) == 0) {
    switch (ev.event_type) {
      case IBV_EVENT_QP_FATAL:
      case IBV_EVENT_QP_REQ_ERR:
      case IBV_EVENT_QP_ACCESS_ERR: {
        auto it = by_qpn_.find(ev.element.qp->qp_num);
        if (it != by_qpn_.end()) {
          Peer* p = peer_of(it->second->peer);
          if (p != nullptr && (p->msg.get() == it->second || p->wr.get() == it->second)) {
            retire_qps(*p, ErrorCode::kFabric,
                       fmt::format("its {} queue pair reported '{}'", it->second->role_name(),
                                   ibv_event_type_str(ev.event_type)));
          }
        }
        break;
      }
      default:
        detail::log().debug("verbs '{}': async event '{}'", info_.name,
                            ibv_event_type_str(ev.event_type));
        break;
    }
    ibv_ack_async_event(&ev);
  }
}

bool VerbsDomain::progress_handshakes() {
  bool any = false;
  ibv_wc wc[16];
  int n = ibv_poll_cq(ud_cq_.get(), 16, wc);
  for (int i = 0; i < n; ++i) {
    any = true;
    const uint32_t slot = static_cast<uint32_t>(wc[i].wr_id);
    if (slot >= ud_recv_slots_) {  // a datagram went out
      ud_free_send_.push_back(slot);
      continue;
    }
    std::byte* buf = ud_buf_.data() + static_cast<size_t>(slot) * kUdSlotBytes;
    if (wc[i].status == IBV_WC_SUCCESS && wc[i].opcode == IBV_WC_RECV &&
        wc[i].byte_len >= kGrhBytes + sizeof(Hello)) {
      Hello h{};
      std::memcpy(&h, buf + kGrhBytes, sizeof(h));
      on_hello(h);
    }
    ibv_sge sge{reinterpret_cast<uint64_t>(buf), kUdSlotBytes, ud_mr_->lkey};
    ibv_recv_wr wr{};
    wr.wr_id = slot;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    if (ibv_post_recv(ud_qp_->qp, &wr, &bad) != 0) {
      detail::log().warn("verbs '{}': reposting a handshake receive failed: {}", info_.name,
                         strerror(errno));
    }
  }
  return any;
}

void VerbsDomain::progress() {
  progress_handshakes();
  if (!delayed_.empty()) {
    const auto now = Clock::now();
    while (!delayed_.empty() && delayed_.front()->due <= now) {
      std::unique_ptr<DelayedHello> d = std::move(delayed_.front());
      delayed_.pop_front();
      if (Peer* p = peer_of(d->peer)) transmit_hello(d->hello, *p);
    }
  }
  if (connecting_ > 0) {
    const auto now = Clock::now();
    for (auto& [h, pp] : peers_) {
      Peer& p = *pp;
      if (p.state != Peer::State::kConnecting || now < p.next_retry) continue;
      if (p.attempts >= config_.connect_attempts) {
        --connecting_;
        p.state = Peer::State::kFailed;
        p.failed_at = now;
        p.error = fmt::format(
            "'{}': the peer at GID {} (handshake QP {}) never answered the connection "
            "handshake: {} requests over {} ms",
            info_.name, gid_text(p.gid), p.ud_qpn, p.attempts,
            std::chrono::duration_cast<std::chrono::milliseconds>(now - p.first_attempt).count());
        retire_qps(p, ErrorCode::kPeerUnreachable, p.error);
        detail::log().warn("verbs {}", p.error);
        continue;
      }
      ++p.attempts;
      p.interval *= 2;
      p.next_retry = now + p.interval;
      send_hello(p, Hello::kRequest, 0);
    }
  }
  if ((++poll_calls_ & 63) == 0) read_async_events();
  if (!retired_.empty()) reap_retired();
}

}  // namespace fabric::transport
