// libfabric backend, hot path: posting work requests and reading completions.
#include <fmt/format.h>

#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <cerrno>

#include "transport/libfabric/lf_api.h"
#include "transport/libfabric/lf_domain.h"

namespace fabric::transport {

namespace {

ErrorCode classify(int err) {
  switch (err) {
    case FI_ECONNREFUSED:
    case FI_ECONNRESET:
    case FI_ECONNABORTED:
    case FI_EHOSTUNREACH:
    case FI_ENETUNREACH:
    case FI_ENOTCONN:
    case FI_ETIMEDOUT:
    case FI_EADDRNOTAVAIL:
      return ErrorCode::kPeerUnreachable;
    case FI_EACCES:
    case FI_EPERM:
    case FI_EREMOTEIO:
    case FI_EKEYREJECTED:
      return ErrorCode::kRemoteAccess;
    default:
      return ErrorCode::kFabric;
  }
}

PostResult post_failed(const char* op, const DomainInfo& info, ssize_t rc) {
  return PostResult::failed(Status(
      classify(static_cast<int>(-rc)),
      fmt::format("{} on '{}' failed: {}", op, info.name, lf::strerror(static_cast<int>(-rc)))));
}

// The tcp provider reports connection and key failures as FI_ECANCELED / FI_EIO with the
// socket errno (or its own ENOENT for an unknown key) in prov_errno: refine the code with it.
ErrorCode classify_entry(const DomainInfo& info, int err, int prov_errno) {
  if (info.provider.rfind("tcp", 0) == 0 && (err == FI_ECANCELED || err == FI_EIO)) {
    switch (prov_errno) {
      case ECONNRESET:
      case ECONNREFUSED:
      case ECONNABORTED:
      case ENOTCONN:
      case EPIPE:
      case EHOSTUNREACH:
      case ENETUNREACH:
      case ETIMEDOUT:
        return ErrorCode::kPeerUnreachable;
      case ENOENT:
      case EACCES:
      case EPERM:
      case EINVAL:
        return ErrorCode::kRemoteAccess;
      default:
        break;
    }
  }
  // A provider cancelling an operation is not the engine closing: report it as a fabric error.
  if (err == FI_ECANCELED) return ErrorCode::kFabric;
  return classify(err);
}

}  // namespace

void* LfDomain::context_for(uint64_t wr_id) {
  if (!needs_context_) return reinterpret_cast<void*>(wr_id);
  std::unique_ptr<ContextSlot> slot;
  if (free_contexts_.empty()) {
    slot = std::make_unique<ContextSlot>();
  } else {
    slot = std::move(free_contexts_.back());
    free_contexts_.pop_back();
  }
  slot->wr_id = wr_id;
  return slot.release();
}

uint64_t LfDomain::wr_id_from(void* context) {
  if (!needs_context_) return reinterpret_cast<uint64_t>(context);
  return static_cast<ContextSlot*>(context)->wr_id;
}

void LfDomain::release_context(void* context) {
  if (needs_context_ && context != nullptr) {
    free_contexts_.emplace_back(static_cast<ContextSlot*>(context));
  }
}

namespace {

PostResult closed_endpoint() {
  return PostResult::failed(Status(ErrorCode::kClosed, "the domain's endpoint is closed"));
}

// A peer whose address-vector entry was removed (dropped, or a reconnection that failed): the
// provider would look up a freed entry.
PostResult no_peer_address(const DomainInfo& info) {
  return PostResult::failed(
      Status(ErrorCode::kPeerUnreachable,
             fmt::format("'{}' has no address for the peer (a reconnection failed)", info.name)));
}

}  // namespace

PostResult LfDomain::post_write(const WriteRequest& req) {
  if (!ep_) return closed_endpoint();
  const fi_addr_t peer = fi_address(req.peer);
  if (peer == FI_ADDR_UNSPEC) return no_peer_address(info_);
  void* ctx = context_for(req.wr_id);
  // A zero-byte write still passes a valid buffer and descriptor: EFA requires one.
  ssize_t rc = req.has_imm ? fi_writedata(ep_.get(), req.local, req.length, req.local_desc, req.imm,
                                          peer, req.remote_addr, req.remote_key, ctx)
                           : fi_write(ep_.get(), req.local, req.length, req.local_desc, peer,
                                      req.remote_addr, req.remote_key, ctx);
  if (rc == 0) return PostResult::posted();
  release_context(ctx);
  if (rc == -FI_EAGAIN) return PostResult::again();
  return post_failed(req.has_imm ? "fi_writedata" : "fi_write", info_, rc);
}

PostResult LfDomain::post_read(const ReadRequest& req) {
  if (!ep_) return closed_endpoint();
  const fi_addr_t peer = fi_address(req.peer);
  if (peer == FI_ADDR_UNSPEC) return no_peer_address(info_);
  void* ctx = context_for(req.wr_id);
  ssize_t rc = fi_read(ep_.get(), req.local, req.length, req.local_desc, peer, req.remote_addr,
                       req.remote_key, ctx);
  if (rc == 0) return PostResult::posted();
  release_context(ctx);
  if (rc == -FI_EAGAIN) return PostResult::again();
  return post_failed("fi_read", info_, rc);
}

PostResult LfDomain::post_send(const SendRequest& req) {
  if (!ep_) return closed_endpoint();
  const fi_addr_t peer = fi_address(req.peer);
  if (peer == FI_ADDR_UNSPEC) return no_peer_address(info_);
  void* ctx = context_for(req.wr_id);
  ssize_t rc = fi_send(ep_.get(), req.local, req.length, req.local_desc, peer, ctx);
  if (rc == 0) return PostResult::posted();
  release_context(ctx);
  if (rc == -FI_EAGAIN) return PostResult::again();
  return post_failed("fi_send", info_, rc);
}

PostResult LfDomain::post_recv(const RecvRequest& req) {
  if (!ep_) return closed_endpoint();
  void* ctx = context_for(req.wr_id);
  ssize_t rc = fi_recv(ep_.get(), req.local, req.length, req.local_desc, FI_ADDR_UNSPEC, ctx);
  if (rc == 0) return PostResult::posted();
  release_context(ctx);
  if (rc == -FI_EAGAIN) return PostResult::again();
  return post_failed("fi_recv", info_, rc);
}

void LfDomain::read_error(Completion& out) {
  fi_cq_err_entry err{};
  ssize_t rc = fi_cq_readerr(cq_.get(), &err, 0);
  if (rc != 1) {
    out = Completion{Completion::Kind::kRemoteError,
                     0,
                     0,
                     0,
                     ErrorCode::kFabric,
                     fmt::format("fi_cq_readerr on '{}' failed: {}", info_.name,
                                 lf::strerror(static_cast<int>(-rc)))};
    return;
  }
  std::string text =
      fmt::format("{} (provider: {})", lf::strerror(err.err),
                  fi_cq_strerror(cq_.get(), err.prov_errno, err.err_data, nullptr, 0));
  Completion::Kind kind = Completion::Kind::kLocal;
  if (err.op_context == nullptr || (err.flags & FI_REMOTE_WRITE)) {
    kind = Completion::Kind::kRemoteError;
  } else if (err.flags & FI_RECV) {
    kind = Completion::Kind::kRecv;
  }
  uint64_t wr_id = 0;
  if (kind != Completion::Kind::kRemoteError) {
    wr_id = wr_id_from(err.op_context);
    release_context(err.op_context);
  }
  out = Completion{kind,           wr_id, 0, 0, classify_entry(info_, err.err, err.prov_errno),
                   std::move(text)};
}

size_t LfDomain::poll(std::span<Completion> out) {
  size_t want = std::min(out.size(), cq_buf_.size());
  ssize_t n = fi_cq_read(cq_.get(), cq_buf_.data(), want);
  if (n == -FI_EAGAIN) return 0;
  if (n == -FI_EAVAIL) {
    read_error(out[0]);
    return 1;
  }
  if (n < 0) {
    out[0] = Completion{Completion::Kind::kRemoteError,
                        0,
                        0,
                        0,
                        ErrorCode::kFabric,
                        fmt::format("fi_cq_read on '{}' failed: {}", info_.name,
                                    lf::strerror(static_cast<int>(-n)))};
    return 1;
  }
  size_t j = 0;
  for (ssize_t i = 0; i < n; ++i) {
    const fi_cq_data_entry& e = cq_buf_[static_cast<size_t>(i)];
    if ((e.flags & FI_REMOTE_WRITE) && !(e.flags & FI_REMOTE_CQ_DATA)) continue;  // no immediate
    Completion& c = out[j++];
    c.error = ErrorCode::kOk;
    c.error_message.clear();
    if (e.flags & FI_REMOTE_WRITE) {
      c.kind = Completion::Kind::kImm;
      c.wr_id = 0;
      c.imm = static_cast<uint32_t>(e.data);
      c.length = 0;
    } else {
      c.kind = (e.flags & FI_RECV) ? Completion::Kind::kRecv : Completion::Kind::kLocal;
      c.wr_id = wr_id_from(e.op_context);
      release_context(e.op_context);
      c.imm = 0;
      c.length = e.len;
    }
  }
  return j;
}

}  // namespace fabric::transport
