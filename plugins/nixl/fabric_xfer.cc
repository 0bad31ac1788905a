// FABRIC backend, data path: requests (prepXfer, postXfer, checkXfer, releaseReqH) and
// notifications (genNotif, getNotifs, and the one a transfer carries).
#include <cstring>
#include <ios>

#include "common/nixl_log.h"
#include "fabric_backend.h"
#include "status_map.h"

namespace fabric::nixl_backend {
namespace {

// A notification on the wire: magic, the sender's agent name (length-prefixed), the message.
constexpr char kNotifMagic[4] = {'F', 'N', 'T', 'F'};
constexpr size_t kNotifHeader = sizeof(kNotifMagic) + sizeof(uint16_t);

Bytes encode_notif(const std::string& agent, const std::string& msg) {
  Bytes out(kNotifHeader + agent.size() + msg.size());
  std::memcpy(out.data(), kNotifMagic, sizeof(kNotifMagic));
  const auto name_len = static_cast<uint16_t>(agent.size());
  std::memcpy(out.data() + sizeof(kNotifMagic), &name_len, sizeof(name_len));
  std::memcpy(out.data() + kNotifHeader, agent.data(), agent.size());
  std::memcpy(out.data() + kNotifHeader + agent.size(), msg.data(), msg.size());
  return out;
}

// Where [addr, addr + len) sits in [base, base + length), or an error naming the range.
Result<uint64_t> offset_in(uintptr_t addr, uint64_t len, uintptr_t base, uint64_t length,
                           const char* side, size_t index) {
  if (addr < base || addr - base > length || len > length - (addr - base)) {
    char buf[200];
    std::snprintf(buf, sizeof(buf),
                  "%s descriptor %zu (0x%jx + %ju bytes) is outside its registration (0x%jx + "
                  "%ju bytes)",
                  side, index, static_cast<uintmax_t>(addr), static_cast<uintmax_t>(len),
                  static_cast<uintmax_t>(base), static_cast<uintmax_t>(length));
    return Status(ErrorCode::kOutOfRange, buf);
  }
  return addr - base;
}

}  // namespace

Result<Request*> FabricBackend::make_request(const nixl_xfer_op_t& operation,
                                             const nixl_meta_dlist_t& local,
                                             const nixl_meta_dlist_t& remote,
                                             const std::string& remote_agent) const {
  if (operation != NIXL_WRITE && operation != NIXL_READ) {
    return Status(ErrorCode::kInvalidArgument, "operation is neither WRITE nor READ");
  }
  if (local.descCount() != remote.descCount()) {
    return Status(ErrorCode::kInvalidArgument,
                  std::to_string(local.descCount()) + " local descriptors for " +
                      std::to_string(remote.descCount()) + " remote ones");
  }
  auto peer = peer_address(remote_agent);
  if (!peer) return peer.status();
  auto request = std::make_unique<Request>();
  request->op = operation;
  request->agent = remote_agent;
  request->peer = std::move(*peer);
  request->pairs.reserve(static_cast<size_t>(local.descCount()));
  for (int i = 0; i < local.descCount(); ++i) {
    const nixlMetaDesc& l = local[i];
    const nixlMetaDesc& r = remote[i];
    const auto index = static_cast<size_t>(i);
    const auto* lr = dynamic_cast<const LocalRegion*>(l.metadataP);
    if (lr == nullptr) {
      return Status(ErrorCode::kNotFound, "local descriptor " + std::to_string(i) +
                                              " is not in memory registered with FABRIC");
    }
    const auto* rr = dynamic_cast<const RemoteRegion*>(r.metadataP);
    if (rr == nullptr) {
      return Status(ErrorCode::kNotFound, "remote descriptor " + std::to_string(i) +
                                              " is not in a loaded FABRIC registration");
    }
    if (rr->agent != remote_agent) {
      return Status(ErrorCode::kInvalidArgument, "remote descriptor " + std::to_string(i) +
                                                     " belongs to agent " + rr->agent +
                                                     ", the transfer targets " + remote_agent);
    }
    if (l.len != r.len) {
      return Status(ErrorCode::kInvalidArgument,
                    "descriptor " + std::to_string(i) + ": local length " + std::to_string(l.len) +
                        " differs from remote " + std::to_string(r.len));
    }
    auto lo = offset_in(l.addr, l.len, lr->base, lr->length, "local", index);
    if (!lo) return lo.status();
    auto ro = offset_in(r.addr, r.len, rr->base, rr->memory.length(), "remote", index);
    if (!ro) return ro.status();
    if (operation == NIXL_READ && !rr->memory.readable()) {
      return Status(ErrorCode::kUnsupported,
                    "remote descriptor " + std::to_string(i) +
                        " is memory its owner could not register readable (GPU memory "
                        "staged through a host mirror): WRITE into it instead");
    }
    request->pairs.push_back({lr->handle, *lo, rr->memory, *ro, l.len});
  }
  return request.release();
}

nixl_status_t FabricBackend::prepXfer(const nixl_xfer_op_t& operation,
                                      const nixl_meta_dlist_t& local,
                                      const nixl_meta_dlist_t& remote,
                                      const std::string& remote_agent, nixlBackendReqH*& handle,
                                      const nixl_opt_b_args_t*) const {
  auto request = make_request(operation, local, remote, remote_agent);
  if (!request) {
    NIXL_ERROR << "FABRIC: " << request.status().to_string();
    return to_nixl(request.status());
  }
  handle = *request;
  return NIXL_SUCCESS;
}

nixl_status_t FabricBackend::postXfer(const nixl_xfer_op_t& operation,
                                      const nixl_meta_dlist_t& local,
                                      const nixl_meta_dlist_t& remote,
                                      const std::string& remote_agent, nixlBackendReqH*& handle,
                                      const nixl_opt_b_args_t* opt_args) const {
  auto* request = dynamic_cast<Request*>(handle);
  if (request == nullptr) {
    nixl_status_t s = prepXfer(operation, local, remote, remote_agent, handle, opt_args);
    if (s != NIXL_SUCCESS) return s;
    request = static_cast<Request*>(handle);
  }
  auto posting = std::make_shared<Posting>();
  if (opt_args != nullptr && opt_args->hasNotif) {
    posting->has_notif = true;
    posting->notif_agent = request->agent;
    posting->notif = opt_args->notifMsg;
    const uint64_t size = kNotifHeader + localAgent.size() + posting->notif.size();
    if (size > options_.config.max_message_bytes) {
      NIXL_ERROR << "FABRIC: a notification of " << posting->notif.size()
                 << " bytes exceeds the engine's messages (" << options_.config.max_message_bytes
                 << " bytes with the header)";
      return NIXL_ERR_INVALID_PARAM;
    }
  }
  request->posting = posting;

  // The last of the transfers to end (or postXfer itself, when they all ended before it
  // returned: it holds one count) sends the notification.
  const auto& pairs = request->pairs;
  posting->unfinished.store(pairs.size() + 1, std::memory_order_relaxed);
  auto finish_one = [this, posting, peer = request->peer]() {
    if (posting->unfinished.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    if (!posting->has_notif) return;
    if (posting->counter.failed() > 0 || !posting->submit_error.is_ok() ||
        posting->released.load(std::memory_order_acquire)) {
      posting->notif_state.store(Posting::kNotifFailed, std::memory_order_release);
      return;
    }
    Status s = send_notif(peer, posting->notif, [posting](const Status& outcome) {
      if (!outcome.is_ok()) {
        std::lock_guard lock(posting->error_mu);
        posting->notif_error = outcome;
      }
      posting->notif_state.store(outcome.is_ok() ? Posting::kNotifSent : Posting::kNotifFailed,
                                 std::memory_order_release);
    });
    if (!s) {
      std::lock_guard lock(posting->error_mu);
      posting->notif_error = s;
      posting->notif_state.store(Posting::kNotifFailed, std::memory_order_release);
    }
  };

  uint64_t accepted = 0;
  for (const Request::Pair& pair : pairs) {
    Callbacks cb;
    cb.counter = &posting->counter;  // counted by the worker: checkXfer needs no callback
    cb.on_done = finish_one;         // also keeps the posting (and its counter) alive
    cb.on_error = [finish_one](const Status&) { finish_one(); };
    Result<TransferId> id = Status(ErrorCode::kInternal, "not submitted");
    if (request->op == NIXL_WRITE) {
      SingleWrite w;
      w.src = pair.local;
      w.src_offset = pair.local_offset;
      w.dst = pair.remote;
      w.dst_offset = pair.remote_offset;
      w.length = pair.length;
      id = engine_->submit(w, std::move(cb));
    } else {
      SingleRead r;
      r.dst = pair.local;
      r.dst_offset = pair.local_offset;
      r.src = pair.remote;
      r.src_offset = pair.remote_offset;
      r.length = pair.length;
      id = engine_->submit(r, std::move(cb));
    }
    if (!id) {
      posting->submit_error = id.status();
      break;
    }
    ++accepted;
  }
  posting->submitted = accepted;
  const uint64_t not_submitted = pairs.size() - accepted;
  if (not_submitted > 0) posting->unfinished.fetch_sub(not_submitted, std::memory_order_acq_rel);
  if (!posting->submit_error.is_ok()) {
    // Transfers accepted before it still run; the posting outlives the request for them.
    NIXL_ERROR << "FABRIC: transfer " << accepted << " of " << pairs.size() << " to agent "
               << request->agent << ": " << posting->submit_error.to_string();
    finish_one();
    return to_nixl(posting->submit_error);
  }
  finish_one();
  return checkXfer(request);
}

nixl_status_t FabricBackend::checkXfer(nixlBackendReqH* handle) const {
  auto* request = dynamic_cast<Request*>(handle);
  if (request == nullptr) return NIXL_ERR_INVALID_PARAM;
  const Posting* posting = request->posting.get();
  if (posting == nullptr) return NIXL_ERR_NOT_POSTED;
  if (posting->counter.ended() < posting->submitted) {
    drive();
    if (posting->counter.ended() < posting->submitted) return NIXL_IN_PROG;
  }
  if (!posting->submit_error.is_ok()) return to_nixl(posting->submit_error);
  if (posting->counter.failed() > 0) {
    Status s = posting->counter.first_error();
    NIXL_ERROR << "FABRIC: transfer to agent " << request->agent << " failed: " << s.to_string();
    return to_nixl(s);
  }
  if (posting->has_notif) {
    switch (posting->notif_state.load(std::memory_order_acquire)) {
      case Posting::kNotifPending:
        drive();
        return NIXL_IN_PROG;
      case Posting::kNotifFailed: {
        std::lock_guard lock(request->posting->error_mu);
        NIXL_ERROR << "FABRIC: notification to agent " << request->agent
                   << " failed: " << posting->notif_error.to_string();
        return to_nixl(posting->notif_error);
      }
      default:
        break;
    }
  }
  return NIXL_SUCCESS;
}

// Releasing mid-flight: the engine cannot take back what it posted, so the transfers run to
// their end (their callbacks hold the posting) but the notification is not sent.
nixl_status_t FabricBackend::releaseReqH(nixlBackendReqH* handle) const {
  auto* request = dynamic_cast<Request*>(handle);
  if (request == nullptr) return NIXL_ERR_INVALID_PARAM;
  if (request->posting) request->posting->released.store(true, std::memory_order_release);
  delete request;
  return NIXL_SUCCESS;
}

// --- notifications ------------------------------------------------------------------------------

Status FabricBackend::send_notif(const Address& peer, const std::string& msg,
                                 std::function<void(const Status&)> on_sent) const {
  Bytes message = encode_notif(localAgent, msg);
  if (message.size() > options_.config.max_message_bytes) {
    return Status(ErrorCode::kInvalidArgument,
                  "a notification of " + std::to_string(msg.size()) +
                      " bytes exceeds the engine's messages (" +
                      std::to_string(options_.config.max_message_bytes) + " bytes with header)");
  }
  Callbacks cb;
  if (on_sent) {
    cb.on_done = [on_sent] { on_sent(Status::ok()); };
    cb.on_error = on_sent;
  } else {
    cb.on_error = [](const Status& s) {
      NIXL_ERROR << "FABRIC: notification not delivered: " << s.to_string();
    };
  }
  auto id = engine_->submit_send(peer, message, std::move(cb));
  return id.status();
}

nixl_status_t FabricBackend::genNotif(const std::string& remote_agent,
                                      const std::string& msg) const {
  auto peer = peer_address(remote_agent);
  if (!peer) {
    NIXL_ERROR << "FABRIC: genNotif: " << peer.status().message();
    return to_nixl(peer.status());
  }
  Status s = send_notif(*peer, msg, nullptr);
  if (!s) {
    NIXL_ERROR << "FABRIC: genNotif to agent " << remote_agent << ": " << s.to_string();
    return to_nixl(s);
  }
  return NIXL_SUCCESS;
}

void FabricBackend::on_message(std::span<const std::byte> message) {
  uint16_t name_len = 0;
  if (message.size() >= kNotifHeader) {
    std::memcpy(&name_len, message.data() + sizeof(kNotifMagic), sizeof(name_len));
  }
  if (message.size() < kNotifHeader ||
      std::memcmp(message.data(), kNotifMagic, sizeof(kNotifMagic)) != 0 ||
      message.size() - kNotifHeader < name_len) {
    NIXL_WARN << "FABRIC: dropped a message of " << message.size()
              << " bytes that is not a notification";
    return;
  }
  const char* p = reinterpret_cast<const char*>(message.data()) + kNotifHeader;
  std::string agent(p, name_len);
  std::string msg(p + name_len, message.size() - kNotifHeader - name_len);
  std::lock_guard lock(notifs_mu_);
  notifs_.emplace_back(std::move(agent), std::move(msg));
}

nixl_status_t FabricBackend::getNotifs(notif_list_t& notif_list) {
  drive();
  std::lock_guard lock(notifs_mu_);
  if (notif_list.empty()) {
    notif_list.swap(notifs_);
  } else {
    for (auto& n : notifs_) notif_list.push_back(std::move(n));
    notifs_.clear();
  }
  return NIXL_SUCCESS;
}

}  // namespace fabric::nixl_backend
