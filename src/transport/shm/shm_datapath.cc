// The same-host transport, data side: posting writes and messages, pushing them into the
// peers' rings, ringing their doorbells, and poll(): consuming what arrives in this endpoint's
// slots (writes checked against live registrations and copied in, messages, acknowledgements)
// (docs/shm.md). The control side is shm_domain.cc.
#include <fmt/format.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cstring>

#include "common/log.h"
#include "transport/shm/shm_domain.h"
#include "transport/shm/shm_domain_internal.h"

namespace fabric::transport {

namespace {

constexpr size_t kMaxOpsQueued = 1024;           // per peer, waiting for ring room; beyond: kAgain
constexpr uint64_t kPollBudgetBytes = 16 << 20;  // bytes copied in per poll(), at least one op
constexpr uint64_t kMaxBytesOutstanding = 64 << 20;  // per peer, posted and not acknowledged
constexpr uint64_t kMaxMessage = 64 << 20;
// Smaller writes travel through the ring even where process_vm_readv works: two memcpys of
// a few KiB cost less than the system call.
constexpr uint64_t kCmaMinBytes = 16 << 10;
// A run of CMA writes is copied by several threads from this many bytes: about 140 us of one
// thread's process_vm_readv on the H200 machine's host, against a few microseconds to wake the
// helpers.
constexpr uint64_t kMinParallelBytes = 512 << 10;
constexpr auto kWatchEvery = std::chrono::microseconds(200);
constexpr auto kIdleWatchEvery = std::chrono::milliseconds(50);

// Reads `length` bytes at `src` in process `pid` into `dst` (one copy, by the kernel). False
// when the kernel refuses (no permission, no such process, an address not mapped there).
bool read_process(uint32_t pid, uint64_t src, void* dst, uint64_t length) {
  uint64_t done = 0;
  while (done < length) {
    iovec local{static_cast<std::byte*>(dst) + done, length - done};
    iovec remote{reinterpret_cast<void*>(src + done), length - done};
    const ssize_t n = ::process_vm_readv(static_cast<pid_t>(pid), &local, 1, &remote, 1, 0);
    if (n <= 0) return false;
    done += static_cast<uint64_t>(n);
  }
  return true;
}

// Writes `length` bytes at `src` into `dst` in process `pid` (one copy, by the kernel). False
// when the kernel refuses.
bool write_process(uint32_t pid, uint64_t dst, const void* src, uint64_t length) {
  uint64_t done = 0;
  while (done < length) {
    iovec local{const_cast<std::byte*>(static_cast<const std::byte*>(src)) + done, length - done};
    iovec remote{reinterpret_cast<void*>(dst + done), length - done};
    const ssize_t n = ::process_vm_writev(static_cast<pid_t>(pid), &local, 1, &remote, 1, 0);
    if (n <= 0) return false;
    done += static_cast<uint64_t>(n);
  }
  return true;
}

std::string why_refused(ErrorCode code) {
  switch (code) {
    case ErrorCode::kRemoteAccess:
      return "the peer refused the access (unknown or stale key, a range outside its "
             "registration, or a read of memory not registered readable)";
    case ErrorCode::kInvalidArgument:
      return "the peer's receive buffer is smaller than the message";
    default:
      return "the peer could not complete the operation";
  }
}

}  // namespace

PostResult ShmDomain::post(PeerHandle peer, uint64_t wr_id, TxItem item) {
  if (closed_) return PostResult::failed(Status(ErrorCode::kClosed, "shm endpoint closed"));
  Remote* r = find_remote(peer);
  if (r == nullptr) {
    return PostResult::failed(
        Status(ErrorCode::kPeerUnreachable, "shm: unknown peer handle (the peer was dropped)"));
  }
  if (!r->dead && load(r->header->closed) != 0) fail_remote(*r, "the peer closed its endpoint");
  if (r->dead) {
    return PostResult::failed(
        Status(ErrorCode::kPeerUnreachable, fmt::format("shm peer '{}': {}", r->name, r->why)));
  }
  // Bounded in operations and in bytes: what is posted to a peer drains in bounded time (a
  // closing engine waits for it, Config::close_timeout).
  if (r->ops_queued >= kMaxOpsQueued ||
      (r->outstanding > 0 && r->outstanding_bytes + item.length > kMaxBytesOutstanding)) {
    return PostResult::again();
  }
  if (r->outstanding == 0) r->next_watch = std::chrono::steady_clock::now() + kWatchEvery;
  pending_.put(item.seq,
               {peer, wr_id, item.length,
                item.kind == RecordKind::kRead ? const_cast<std::byte*>(item.local) : nullptr});
  ++r->outstanding;
  r->outstanding_bytes += item.length;
  ++r->ops_queued;
  r->tx.push_back(item);
  pump(*r);
  return PostResult::posted();
}

PostResult ShmDomain::post_write(const WriteRequest& req) {
  TxItem item;
  item.kind = RecordKind::kWrite;
  item.has_imm = req.has_imm;
  item.imm = req.imm;
  item.seq = next_seq_++;
  item.local = static_cast<const std::byte*>(req.local);
  item.length = req.length;
  item.addr = req.remote_addr;
  item.key = req.remote_key;
  return post(req.peer, req.wr_id, item);
}

PostResult ShmDomain::post_read(const ReadRequest& req) {
  TxItem item;
  item.kind = RecordKind::kRead;
  item.seq = next_seq_++;
  item.local = static_cast<const std::byte*>(req.local);
  item.length = req.length;
  item.addr = req.remote_addr;
  item.key = req.remote_key;
  return post(req.peer, req.wr_id, item);
}

PostResult ShmDomain::post_send(const SendRequest& req) {
  if (req.length > kMaxMessage) {
    return PostResult::failed(Status(
        ErrorCode::kInvalidArgument,
        fmt::format("shm: a message of {} bytes exceeds {} bytes", req.length, kMaxMessage)));
  }
  TxItem item;
  item.kind = RecordKind::kSend;
  item.seq = next_seq_++;
  item.local = static_cast<const std::byte*>(req.local);
  item.length = req.length;
  return post(req.peer, req.wr_id, item);
}

PostResult ShmDomain::post_recv(const RecvRequest& req) {
  if (closed_) return PostResult::failed(Status(ErrorCode::kClosed, "shm endpoint closed"));
  if (!unexpected_.empty()) {
    Bytes m = std::move(unexpected_.front());
    unexpected_.pop_front();
    Completion c{Completion::Kind::kRecv, req.wr_id, 0, m.size(), ErrorCode::kOk, {}};
    if (m.size() > req.length) {
      c.error = ErrorCode::kInvalidArgument;
      c.error_message = fmt::format("shm: a message of {} bytes arrived for a {}-byte receive",
                                    m.size(), req.length);
    } else if (!m.empty()) {
      std::memcpy(req.local, m.data(), m.size());
    }
    ready_.push_back(std::move(c));
    return PostResult::posted();
  }
  recvs_.push_back(req);
  return PostResult::posted();
}

bool ShmDomain::push_item(Remote& r, TxItem& item) {
  Record rec{};
  rec.kind = item.kind;
  rec.token = shm::owner_token(r.word);
  rec.seq = item.seq;
  rec.imm = item.imm;
  if (item.kind == RecordKind::kAck) {
    rec.status = item.status;
    return r.writer.push(rec, nullptr, 0);
  }
  if (item.kind == RecordKind::kRead) {  // one record, no payload: the owner answers
    rec.flags = shm::kFirst | shm::kLast;
    rec.addr = item.addr;
    rec.key = item.key;
    rec.length = item.length;
    rec.src = reinterpret_cast<uint64_t>(item.local);
    return r.writer.push(rec, nullptr, 0);
  }
  const uint8_t imm_flag = item.has_imm ? shm::kHasImm : 0;
  if (!item.started) {
    item.started = true;
    const uint64_t cma = load(r.slot->cma);
    item.cma = item.kind == RecordKind::kWrite && item.length >= kCmaMinBytes &&
               (cma >> 32) == shm::owner_token(r.word) && (cma & 0xffffffff) == shm::kCmaYes;
  }
  if (item.cma) {
    rec.flags = shm::kCma | shm::kFirst | shm::kLast | imm_flag;
    rec.addr = item.addr;
    rec.key = item.key;
    rec.length = item.length;
    rec.src = reinterpret_cast<uint64_t>(item.local);
    return r.writer.push(rec, nullptr, 0);
  }
  const std::byte* bytes = item.kind == RecordKind::kReadData ? item.data.data() : item.local;
  const uint64_t max = r.writer.max_payload();
  do {
    const uint64_t chunk = std::min(item.length - item.offset, max);
    const bool last = item.offset + chunk == item.length;
    rec.flags = static_cast<uint8_t>((item.offset == 0 ? shm::kFirst : 0) |
                                     (last ? shm::kLast : 0) | imm_flag);
    rec.addr = item.addr + item.offset;
    rec.key = item.key;
    rec.length = chunk;
    rec.total = item.length;
    if (!r.writer.push(rec, bytes + item.offset, chunk)) return false;
    item.offset += chunk;
  } while (item.offset < item.length);
  return true;
}

void ShmDomain::pump(Remote& r) {
  bool pushed = false;
  while (!r.tx.empty() && !r.dead) {
    TxItem& item = r.tx.front();
    const uint64_t before = item.offset;
    if (!push_item(r, item)) {
      pushed |= item.offset != before;  // some chunks of it went
      break;
    }
    pushed = true;
    if (item.is_op()) --r.ops_queued;
    r.tx.pop_front();
  }
  if (pushed) ring(r);
}

void ShmDomain::ring(Remote& r) {
  if (r.doorbell_len == 0 || doorbell_ < 0) return;
  // The records were published with a seq_cst store of `tail` (RingWriter::push); this load
  // is seq_cst too, as are the owner's store to `sleeping` and its loads of the rings
  // (ready_to_wait): in their single total order one of the two sees the other's store.
  if (load(r.header->sleeping, std::memory_order_seq_cst) == 0) return;
  // One wake-up per sleep: the sender that clears the flag sends it.
  uint32_t expected = 1;
  if (!shm::compare_exchange(r.header->sleeping, expected, uint32_t{0})) return;
  const char byte = 1;
  // A full socket buffer already holds wake-ups; a gone peer is found by the watch.
  (void)::sendto(doorbell_, &byte, 1, MSG_DONTWAIT, reinterpret_cast<const sockaddr*>(&r.doorbell),
                 r.doorbell_len);
}

bool ShmDomain::work_pending() const {
  if (!ready_.empty()) return true;
  for (const auto& [h, r] : remotes_) {
    if (!r->dead && !r->tx.empty()) return true;
  }
  const uint64_t active = load(header_->active_mask);
  for (uint32_t i = 0; i < shm::kSlots; ++i) {
    if ((active >> i & 1) == 0) continue;
    const shm::SlotHeader* s = shm::slot_at(base_, ring_bytes_, i);
    if (load(s->tail, std::memory_order_seq_cst) != load(s->head)) return true;
    // A claim not looked at yet: its CMA check is due.
    const uint64_t word = load(s->owner);
    if (word != 0 && shm::owner_token(word) != inbound_[i]->token &&
        load(s->ready) == shm::owner_token(word)) {
      return true;
    }
  }
  return false;
}

bool ShmDomain::ready_to_wait() {
  if (doorbell_ < 0 || closed_) return true;
  char buf[64];
  while (::recv(doorbell_, buf, sizeof(buf), MSG_DONTWAIT) > 0) {
  }
  store(header_->sleeping, uint32_t{1}, std::memory_order_seq_cst);  // see ring()
  if (work_pending()) {
    store(header_->sleeping, uint32_t{0}, std::memory_order_relaxed);
    return false;
  }
  return true;
}

void ShmDomain::acknowledge(Inbound& in, uint64_t seq, ErrorCode code) {
  auto r = connect(in.sender);
  if (!r || (*r)->dead) return;  // the sender is gone: nobody waits for this
  TxItem ack;
  ack.kind = RecordKind::kAck;
  ack.seq = seq;
  ack.status = static_cast<uint16_t>(code);
  (*r)->tx.push_back(ack);
  pump(**r);
}

void ShmDomain::on_ack(const Record& rec) {
  auto it = pending_.find(rec.seq);
  if (it == pending_.end()) return;  // failed or dropped already
  const Pending p = it->second;
  pending_.erase(it);
  if (Remote* r = find_remote(p.peer); r != nullptr && r->outstanding > 0) {
    --r->outstanding;
    r->outstanding_bytes -= std::min(r->outstanding_bytes, p.bytes);
  }
  const auto code = static_cast<ErrorCode>(rec.status);
  Completion c{Completion::Kind::kLocal, p.wr_id, 0, 0, code, {}};
  if (code != ErrorCode::kOk) c.error_message = why_refused(code);
  ready_.push_back(std::move(c));
}

bool ShmDomain::whole_cma_write(const Record& rec) {
  // RingReader::peek refuses a kCma write that is not first and last too.
  return rec.kind == RecordKind::kWrite && (rec.flags & shm::kCma) != 0;
}

void ShmDomain::on_cma_writes(uint32_t slot, Inbound& in, Record rec, uint64_t& budget) {
  // Writes by process_vm_readv are one record each (push_item): take the run of them at the
  // head of this slot, up to the poll's budget, so that a window of writes is copied side by
  // side rather than one after the other.
  shm::SlotHeader* s = shm::slot_at(base_, ring_bytes_, slot);
  cma_batch_.clear();
  const std::byte* payload = nullptr;
  for (;;) {
    budget -= std::min(budget, rec.length + sizeof(Record));
    in.in_write = false;  // a write of one record ends any chunked write left half done
    cma_batch_.push_back({rec, check_access(rec.addr, rec.length, rec.key), false});
    in.reader.pop(rec);
    if (cma_batch_.size() == kMaxCmaBatch || budget == 0) break;
    if (in.reader.peek(rec, payload) != shm::RingReader::Next::kRecord) break;
    if (!whole_cma_write(rec) || rec.token != in.token ||
        rec.token != shm::owner_token(load(s->owner))) {
      break;  // for consume() to handle
    }
  }
  copy_cma_batch(in.pid);
  for (const CmaWrite& w : cma_batch_) {
    if (w.tried) ++stats_.cma_writes;
    if (w.error == ErrorCode::kOk && (w.rec.flags & shm::kHasImm) != 0) {
      ready_.push_back(Completion{Completion::Kind::kImm, 0, w.rec.imm, 0, ErrorCode::kOk, {}});
    }
    acknowledge(in, w.rec.seq, w.error);
  }
}

void ShmDomain::copy_cma_batch(uint32_t pid) {
  // Each write is cut into page-aligned parts (one below 2 * kMinPartBytes); the parts of all
  // the writes are shared among the copier's threads once they add up to kMinParallelBytes.
  // Smaller batches stay on this thread: a helper's wake-up would cost more than it saves.
  std::vector<CmaPiece>& pieces = cma_pieces_;
  pieces.clear();
  uint64_t total = 0;
  for (uint32_t i = 0; i < cma_batch_.size(); ++i) {
    const Record& rec = cma_batch_[i].rec;
    if (cma_batch_[i].error != ErrorCode::kOk || rec.length == 0) continue;
    cma_batch_[i].tried = true;
    total += rec.length;
    const uint32_t parts = copier_->parts_for(rec.length);
    const uint64_t part = parts == 1 ? rec.length : (rec.length / parts + 4095) & ~uint64_t{4095};
    auto* dst = reinterpret_cast<std::byte*>(rec.addr);
    for (uint64_t at = 0; at < rec.length; at += part) {
      pieces.push_back({rec.src + at, dst + at, std::min(part, rec.length - at), i});
    }
  }
  cma_piece_ok_.assign(pieces.size(), 0);
  auto copy = [&](uint32_t i) {
    const CmaPiece& p = pieces[i];
    cma_piece_ok_[i] = read_process(pid, p.src, p.dst, p.length) ? 1 : 0;
    return true;
  };
  const bool parallel = total >= kMinParallelBytes && pieces.size() > 1 && copier_->threads() > 1;
  if (parallel) {
    copier_->run(static_cast<uint32_t>(pieces.size()), copy);
  } else {
    for (uint32_t i = 0; i < pieces.size(); ++i) copy(i);
  }
  for (uint32_t i = 0; i < pieces.size(); ++i) {
    if (cma_piece_ok_[i] == 0) cma_batch_[pieces[i].write].error = ErrorCode::kFabric;
  }
  if (!parallel) return;
  for (const CmaWrite& w : cma_batch_) stats_.cma_parallel_writes += w.tried ? 1 : 0;
}

void ShmDomain::on_write(Inbound& in, const Record& rec, const std::byte* payload) {
  if ((rec.flags & shm::kFirst) != 0) {
    in.in_write = true;
    in.write_error = ErrorCode::kOk;
  } else if (!in.in_write) {
    return;  // the rest of a write whose start was dropped
  }
  if (in.write_error == ErrorCode::kOk)
    in.write_error = check_access(rec.addr, rec.length, rec.key);
  if (in.write_error == ErrorCode::kOk && rec.length > 0) {
    std::memcpy(reinterpret_cast<void*>(rec.addr), payload, rec.length);
    stats_.ring_write_bytes += rec.length;
  }
  if ((rec.flags & shm::kLast) == 0) return;
  in.in_write = false;
  if (in.write_error == ErrorCode::kOk && (rec.flags & shm::kHasImm) != 0) {
    ready_.push_back(Completion{Completion::Kind::kImm, 0, rec.imm, 0, ErrorCode::kOk, {}});
  }
  acknowledge(in, rec.seq, in.write_error);
}

void ShmDomain::serve_read(Inbound& in, const Record& rec) {
  const ErrorCode code = check_access(rec.addr, rec.length, rec.key, /*read=*/true);
  if (code == ErrorCode::kOk && rec.length > 0) {
    const auto* from = reinterpret_cast<const std::byte*>(rec.addr);
    // Into the reader's memory by the kernel where it lets this process, or through the ring.
    // Either way the bytes leave the registration now, while it is surely registered: the
    // registration is closed on this thread, so no byte is read from it once that returns.
    bool copied = false;
    if (in.cma && rec.length >= kCmaMinBytes) {
      copied = write_process(in.pid, rec.src, from, rec.length);
      if (copied) ++stats_.cma_reads;
    }
    if (!copied) {
      auto r = connect(in.sender);
      if (!r || (*r)->dead) return;  // the reader is gone: nobody waits for this
      TxItem data;
      data.kind = RecordKind::kReadData;
      data.seq = rec.seq;
      data.addr = rec.src;
      data.length = rec.length;
      data.data.assign(from, from + rec.length);
      stats_.ring_read_bytes += rec.length;
      (*r)->tx.push_back(std::move(data));
    }
  }
  acknowledge(in, rec.seq, code);  // behind the data, in the same ring
}

void ShmDomain::on_read_data(const Inbound& in, const Record& rec, const std::byte* payload) {
  auto it = pending_.find(rec.seq);
  if (it == pending_.end() || it->second.read_into == nullptr) return;  // failed already
  // Only the owner the read went to answers it, and only into the read's own buffer.
  const Remote* owner = find_remote(it->second.peer);
  if (owner == nullptr || owner->name != in.sender) return;
  const auto base = reinterpret_cast<uint64_t>(it->second.read_into);
  const uint64_t size = it->second.bytes;
  if (rec.addr < base || rec.length > size || rec.addr - base > size - rec.length) return;
  if (rec.length > 0) std::memcpy(reinterpret_cast<void*>(rec.addr), payload, rec.length);
}

void ShmDomain::on_send(Inbound& in, const Record& rec, const std::byte* payload) {
  if ((rec.flags & shm::kFirst) != 0) {
    in.in_message = true;
    in.total = rec.total;
    in.got = 0;
    in.message_error = rec.total > kMaxMessage ? ErrorCode::kInvalidArgument : ErrorCode::kOk;
    in.has_recv = !recvs_.empty();
    if (in.has_recv) {
      in.recv = recvs_.front();
      recvs_.pop_front();
      if (in.total > in.recv.length) in.message_error = ErrorCode::kInvalidArgument;
    } else if (in.message_error == ErrorCode::kOk) {
      in.buffer.assign(in.total, std::byte{0});
    }
  } else if (!in.in_message) {
    return;
  }
  if (rec.length > in.total - in.got) in.message_error = ErrorCode::kInvalidArgument;
  if (in.message_error == ErrorCode::kOk && rec.length > 0) {
    std::byte* dst = in.has_recv ? static_cast<std::byte*>(in.recv.local) : in.buffer.data();
    std::memcpy(dst + in.got, payload, rec.length);
  }
  in.got += rec.length;
  if ((rec.flags & shm::kLast) == 0) return;
  in.in_message = false;
  if (in.has_recv) {
    Completion c{Completion::Kind::kRecv, in.recv.wr_id, 0, in.total, in.message_error, {}};
    if (in.message_error != ErrorCode::kOk) {
      c.error_message = fmt::format("shm: a message of {} bytes arrived for a {}-byte receive",
                                    in.total, in.recv.length);
    }
    ready_.push_back(std::move(c));
    in.has_recv = false;
  } else if (in.message_error == ErrorCode::kOk) {
    unexpected_.push_back(std::move(in.buffer));
    in.buffer.clear();
  }
  acknowledge(in, rec.seq, in.message_error);
}

void ShmDomain::start_claim(uint32_t slot, Inbound& in, uint64_t word) {
  // What the previous claim left half done is dropped; a receive it had taken goes back.
  if (in.in_message && in.has_recv) recvs_.push_front(in.recv);
  in.in_message = in.has_recv = in.in_write = false;
  in.buffer.clear();
  in.token = shm::owner_token(word);
  in.pid = shm::owner_pid(word);
  shm::SlotHeader* s = shm::slot_at(base_, ring_bytes_, slot);
  char sender[shm::kNameMax];
  std::memcpy(sender, s->sender, sizeof(sender));
  sender[sizeof(sender) - 1] = '\0';
  in.sender = sender;
  if (!valid_name(in.sender)) in.sender = "/";  // acknowledgements then go nowhere
  // Can this worker read the sender's memory? Its probe word says: then writes come as one
  // command each and are copied once; otherwise their bytes come through the ring.
  uint64_t value = 0;
  const bool readable =
      read_process(in.pid, s->probe_addr, &value, sizeof(value)) && value == s->probe_value;
  in.cma = readable;
  store(s->cma, uint64_t{in.token} << 32 | (readable ? shm::kCmaYes : shm::kCmaNo));
}

void ShmDomain::consume(uint32_t slot, Inbound& in, uint64_t& budget) {
  shm::SlotHeader* s = shm::slot_at(base_, ring_bytes_, slot);
  // A claim with nothing sent yet still gets its CMA check, so its first write can use it.
  const uint64_t word = load(s->owner);
  if (word != 0 && shm::owner_token(word) != in.token && load(s->ready) == shm::owner_token(word)) {
    start_claim(slot, in, word);
  }
  Record rec;
  const std::byte* payload = nullptr;
  for (int n = 0; n < 256 && budget > 0; ++n) {
    const auto next = in.reader.peek(rec, payload);
    if (next == shm::RingReader::Next::kEmpty) return;
    if (next == shm::RingReader::Next::kCorrupt) {
      detail::log().warn("shm endpoint '{}': slot {} holds malformed records; dropped", name_,
                         slot);
      in.reader.drop();
      if (in.in_message && in.has_recv) recvs_.push_front(in.recv);
      in.in_write = in.in_message = in.has_recv = false;
      return;
    }
    const uint64_t now_word = load(s->owner);
    if (rec.token != shm::owner_token(now_word)) {
      // An earlier claim's: its sender let go of the slot (closed, or dropped this peer) or
      // died; what it left is not executed.
      in.reader.pop(rec);
      continue;
    }
    if (rec.token != in.token) {
      if (load(s->ready) != rec.token) return;  // the claim's fields are not written yet
      start_claim(slot, in, now_word);
    }
    switch (rec.kind) {
      case RecordKind::kWrite:
        if (whole_cma_write(rec)) {
          on_cma_writes(slot, in, rec, budget);  // pops it and the writes it takes with it
          continue;
        }
        budget -= std::min(budget, rec.length + sizeof(Record));
        on_write(in, rec, payload);
        break;
      case RecordKind::kSend:
        budget -= std::min(budget, rec.length + sizeof(Record));
        on_send(in, rec, payload);
        break;
      case RecordKind::kAck:
        on_ack(rec);
        break;
      case RecordKind::kRead:
        budget -= std::min(budget, rec.length + sizeof(Record));
        serve_read(in, rec);
        break;
      case RecordKind::kReadData:
        budget -= std::min(budget, rec.length + sizeof(Record));
        on_read_data(in, rec, payload);
        break;
      default:
        break;
    }
    in.reader.pop(rec);
  }
}

size_t ShmDomain::poll(std::span<Completion> out) {
  if (!closed_) {
    if (load(header_->sleeping, std::memory_order_relaxed) != 0) {
      store(header_->sleeping, uint32_t{0}, std::memory_order_relaxed);
    }
    now_ = std::chrono::steady_clock::now();
    uint64_t budget = kPollBudgetBytes;
    const uint64_t active = load(header_->active_mask);
    for (uint32_t i = 0; i < shm::kSlots; ++i) {
      if ((active >> i & 1) != 0) consume(i, *inbound_[i], budget);
    }
    for (auto& [h, r] : remotes_) {
      if (r->dead) continue;
      if (!r->tx.empty()) pump(*r);
      // Peers with work outstanding are watched closely; the others (say, writers this
      // endpoint only acknowledges) now and then, so that a dead one's mapping goes.
      const bool busy = r->outstanding > 0 || !r->tx.empty();
      if (now_ < r->next_watch) continue;
      r->next_watch = now_ + (busy ? kWatchEvery : kIdleWatchEvery);
      std::string why;
      if (remote_gone(*r, why)) fail_remote(*r, why);
    }
  }
  size_t n = 0;
  while (n < out.size() && !ready_.empty()) {
    out[n++] = std::move(ready_.front());
    ready_.pop_front();
  }
  return n;
}

}  // namespace fabric::transport
