// FABRIC backend, data path: requests (prepXfer, postXfer, checkXfer, releaseReqH) and
// notifications (genNotif, getNotifs, and the one a transfer carries).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <thread>
#include <tuple>

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

// One checked descriptor pair.
struct Pair {
  MemoryHandle local;
  uint64_t local_offset = 0;
  RemoteMemory remote;
  uint64_t remote_offset = 0;
  uint64_t length = 0;
};

// Page indices for `offsets` (each from `base`, in units of `stride`), or false when they do
// not fit the engine's 32-bit page numbers.
bool page_indices(const std::vector<uint64_t>& offsets, uint64_t& base, uint64_t& stride,
                  uint64_t length, std::vector<uint32_t>& pages) {
  base = *std::min_element(offsets.begin(), offsets.end());
  stride = 0;
  for (uint64_t o : offsets) stride = std::gcd(stride, o - base);
  if (stride == 0) stride = length;  // every pair at the same offset
  pages.clear();
  pages.reserve(offsets.size());
  for (uint64_t o : offsets) {
    const uint64_t index = (o - base) / stride;
    if (index > std::numeric_limits<uint32_t>::max()) return false;
    pages.push_back(static_cast<uint32_t>(index));
  }
  return true;
}

// The engine transfers for one group of pairs (same registrations, same length): one paged
// transfer when the offsets fit page numbers, else one single transfer per pair.
void add_ops(const std::vector<Pair>& group, std::vector<Request::Op>& ops) {
  auto single = [&ops](const Pair& p) {
    Request::Op op;
    op.local = p.local;
    op.remote = p.remote;
    op.length = p.length;
    op.local_offset = p.local_offset;
    op.remote_offset = p.remote_offset;
    ops.push_back(std::move(op));
  };
  if (group.size() == 1) {
    single(group.front());
    return;
  }
  std::vector<uint64_t> local_offsets, remote_offsets;
  for (const Pair& p : group) {
    local_offsets.push_back(p.local_offset);
    remote_offsets.push_back(p.remote_offset);
  }
  Request::Op op;
  op.local = group.front().local;
  op.remote = group.front().remote;
  op.length = group.front().length;
  if (!page_indices(local_offsets, op.local_offset, op.local_stride, op.length, op.local_pages) ||
      !page_indices(remote_offsets, op.remote_offset, op.remote_stride, op.length,
                    op.remote_pages)) {
    for (const Pair& p : group) single(p);
    return;
  }
  ops.push_back(std::move(op));
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
  // Pairs grouped by (local registration, remote registration, length), in first-seen order.
  using Key = std::tuple<const LocalRegion*, const RemoteRegion*, uint64_t>;
  std::map<Key, size_t> groups;
  std::vector<std::vector<Pair>> pairs;
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
    const Key key{lr, rr, l.len};
    auto [it, inserted] = groups.try_emplace(key, pairs.size());
    if (inserted) pairs.emplace_back();
    pairs[it->second].push_back({lr->handle, *lo, rr->memory, *ro, l.len});
  }
  for (auto& group : pairs) add_ops(group, request->ops);
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

void FabricBackend::claim_notif(const std::shared_ptr<Posting>& posting,
                                const Address& peer) const {
  if (posting->notif_claimed.exchange(true, std::memory_order_acq_rel)) return;
  if (posting->counter.failed() > 0 || !posting->submit_error.is_ok() ||
      posting->released.load(std::memory_order_acquire)) {
    posting->notif_ended.store(true, std::memory_order_release);
    return;  // a failed or abandoned request notifies nobody
  }
  Status s = send_notif(peer, posting->notif, [posting](const Status& outcome) {
    if (!outcome.is_ok()) {
      NIXL_ERROR << "FABRIC: notification not delivered: " << outcome.to_string();
      std::lock_guard lock(posting->error_mu);
      posting->notif_error = outcome;
    }
    posting->notif_ended.store(true, std::memory_order_release);
  });
  if (!s) {
    std::lock_guard lock(posting->error_mu);
    posting->notif_error = s;
    posting->notif_ended.store(true, std::memory_order_release);
  }
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
    posting->notif = opt_args->notifMsg;
    const uint64_t size = kNotifHeader + localAgent.size() + posting->notif.size();
    if (size > options_.config.max_message_bytes) {
      NIXL_ERROR << "FABRIC: a notification of " << posting->notif.size()
                 << " bytes exceeds the engine's messages (" << options_.config.max_message_bytes
                 << " bytes with the header)";
      return NIXL_ERR_INVALID_PARAM;
    }
  }
  retire(std::move(request->posting));
  request->posting = posting;

  // With a notification, each transfer's callback counts down; the last to end (or postXfer
  // itself, which holds one count, when they all ended before it returned) sends it unless
  // checkXfer did already. Without one, the worker's counter is all there is.
  const auto& ops = request->ops;
  posting->unfinished.store(ops.size() + 1, std::memory_order_relaxed);
  auto finish_one = [this, posting, peer = request->peer]() {
    if (posting->unfinished.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    claim_notif(posting, peer);
  };

  uint64_t accepted = 0;
  for (const Request::Op& op : ops) {
    Callbacks cb;
    cb.counter = &posting->counter;  // counted by the worker: checkXfer needs no callback
    if (posting->has_notif) {
      cb.on_done = finish_one;
      cb.on_error = [finish_one](const Status&) { finish_one(); };
    }
    Result<TransferId> id = submit_op(request->op, op, std::move(cb));
    if (!id) {
      posting->submit_error = id.status();
      break;
    }
    ++accepted;
  }
  posting->submitted = accepted;
  const uint64_t not_submitted = ops.size() - accepted;
  if (not_submitted > 0) posting->unfinished.fetch_sub(not_submitted, std::memory_order_acq_rel);
  if (posting->has_notif) finish_one();
  if (!posting->submit_error.is_ok()) {
    // Transfers accepted before it still run; the posting is retired until they end.
    NIXL_ERROR << "FABRIC: transfer " << accepted << " of " << ops.size() << " to agent "
               << request->agent << ": " << posting->submit_error.to_string();
    return to_nixl(posting->submit_error);
  }
  return checkXfer(request);
}

Result<TransferId> FabricBackend::submit_op(nixl_xfer_op_t operation, const Request::Op& op,
                                            Callbacks cb) const {
  const bool paged = !op.local_pages.empty();
  if (operation == NIXL_WRITE && !paged) {
    SingleWrite w;
    w.src = op.local;
    w.src_offset = op.local_offset;
    w.dst = op.remote;
    w.dst_offset = op.remote_offset;
    w.length = op.length;
    return engine_->submit(w, std::move(cb));
  }
  if (operation == NIXL_WRITE) {
    PagedWrite w;
    w.src = op.local;
    w.dst = op.remote;
    w.page_bytes = op.length;
    w.src_pages = op.local_pages;
    w.src_stride = op.local_stride;
    w.src_offset = op.local_offset;
    w.dst_pages = op.remote_pages;
    w.dst_stride = op.remote_stride;
    w.dst_offset = op.remote_offset;
    return engine_->submit(w, std::move(cb));
  }
  if (!paged) {
    SingleRead r;
    r.dst = op.local;
    r.dst_offset = op.local_offset;
    r.src = op.remote;
    r.src_offset = op.remote_offset;
    r.length = op.length;
    return engine_->submit(r, std::move(cb));
  }
  PagedRead r;
  r.dst = op.local;
  r.src = op.remote;
  r.page_bytes = op.length;
  r.dst_pages = op.local_pages;
  r.dst_stride = op.local_stride;
  r.dst_offset = op.local_offset;
  r.src_pages = op.remote_pages;
  r.src_stride = op.remote_stride;
  r.src_offset = op.remote_offset;
  return engine_->submit(r, std::move(cb));
}

nixl_status_t FabricBackend::checkXfer(nixlBackendReqH* handle) const {
  auto* request = dynamic_cast<Request*>(handle);
  if (request == nullptr) return NIXL_ERR_INVALID_PARAM;
  const std::shared_ptr<Posting>& posting = request->posting;
  if (posting == nullptr) return NIXL_ERR_NOT_POSTED;
  if (posting->counter.ended() < posting->submitted) {
    drive();
    if (posting->counter.ended() < posting->submitted) {
      // A caller polling in a loop leaves the CPU to the engine's threads for a moment (on a
      // host with fewer cores than busy threads the worker would otherwise wait its turn).
      if (options_.progress == Progress::kWorker) std::this_thread::yield();
      return NIXL_IN_PROG;
    }
  }
  if (!posting->submit_error.is_ok()) return to_nixl(posting->submit_error);
  if (posting->counter.failed() > 0) {
    Status s = posting->counter.first_error();
    NIXL_ERROR << "FABRIC: transfer to agent " << request->agent << " failed: " << s.to_string();
    return to_nixl(s);
  }
  if (posting->has_notif) {
    claim_notif(posting, request->peer);
    // Caller-driven: nothing moves the message unless a call drives the engine, so the request
    // ends once it is delivered. With worker threads it ends without waiting for that.
    if (options_.progress == Progress::kCaller &&
        !posting->notif_ended.load(std::memory_order_acquire)) {
      drive();
      return NIXL_IN_PROG;
    }
    std::lock_guard lock(posting->error_mu);
    if (!posting->notif_error.is_ok()) {
      NIXL_ERROR << "FABRIC: notification to agent " << request->agent
                 << " not sent: " << posting->notif_error.to_string();
      return to_nixl(posting->notif_error);
    }
  }
  return NIXL_SUCCESS;
}

// Releasing mid-flight: the engine cannot take back what it posted, so the transfers run to
// their end (their posting is retired until then) but the notification is not sent.
nixl_status_t FabricBackend::releaseReqH(nixlBackendReqH* handle) const {
  auto* request = dynamic_cast<Request*>(handle);
  if (request == nullptr) return NIXL_ERR_INVALID_PARAM;
  if (request->posting) request->posting->released.store(true, std::memory_order_release);
  retire(std::move(request->posting));
  delete request;
  return NIXL_SUCCESS;
}

// A posting whose transfers still run keeps its counter alive for the worker: it waits here
// until they have all ended (checked whenever another posting retires, and at close).
void FabricBackend::retire(std::shared_ptr<Posting> posting) const {
  std::lock_guard lock(retired_mu_);
  std::erase_if(retired_, [](const std::shared_ptr<Posting>& p) {
    return p->counter.ended() >= p->submitted;
  });
  if (posting && posting->counter.ended() < posting->submitted) {
    retired_.push_back(std::move(posting));
  }
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
  std::unique_lock lock(notifs_mu_);
  if (notifs_.empty()) {
    lock.unlock();
    // Targets poll this in a loop: leave the CPU to the engine's threads for a moment.
    if (options_.progress == Progress::kWorker) std::this_thread::yield();
    return NIXL_SUCCESS;
  }
  if (notif_list.empty()) {
    notif_list.swap(notifs_);
  } else {
    for (auto& n : notifs_) notif_list.push_back(std::move(n));
    notifs_.clear();
  }
  return NIXL_SUCCESS;
}

}  // namespace fabric::nixl_backend
