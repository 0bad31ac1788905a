// EngineImpl: the caller thread's half of a submission. Each of the six kinds is validated in
// full (bad input gets a clear error and nothing is posted: docs/bad-input.md), sharded over the
// NICs that are up (plan.h), its Ops filled in (op_builder.h), and handed to the device
// group's worker.
#include <fmt/format.h>

#include <algorithm>

#include "engine/engine_impl.h"

namespace fabric {

using engine_impl::invalid;
using engine_impl::kSeqMask;
using engine_impl::kTagShift;

// --- planning helpers -----------------------------------------------------------------------

void EngineImpl::add_writes(Transfer& t, const LocalRegion& src, uint64_t src_offset,
                            uint32_t dst_index, uint64_t dst_offset,
                            const std::vector<engine::Shard>& shards, std::optional<uint32_t> imm,
                            uint32_t group) {
  const RemoteMemory& dst = t.dsts[dst_index];
  const bool staged_dst = dst.staged_region() != 0;
  // Staged memory on either side moves in chunks, so that copies and writes overlap.
  const uint64_t chunk = src.staged() || staged_dst ? config_.staging_chunk_bytes : UINT64_MAX;
  size_t pieces = 0;
  for (const engine::Shard& s : shards) {
    uint64_t done = 0;
    do {
      const uint64_t offset = s.offset + done;
      const uint64_t length = std::min(chunk, s.length - done);
      Op& op = t.ops.emplace_back();
      engine::fill_write(op, t, s.domain, dst, dst_offset + offset, src.host + src_offset + offset,
                         src.regs[s.domain]->local_desc(), length,
                         workers_[group]->scratch(s.domain));
      if (staged_dst) {
        op.dst_index = dst_index;
        op.dst_offset = dst_offset + offset;
      }
      ++pieces;
      done += length;
    } while (done < s.length);
  }
  if (!imm) return;
  // Staged: counted by the owner once the data is in its GPU. Reliable immediates: counted by
  // the owner when the Commit that follows the data arrives, exactly once.
  if (staged_dst || config_.reliable_imm) {
    stage_imm(t, dst_index, *imm, 1);
    return;
  }
  if (pieces == 1) {
    t.ops.back().has_imm = true;
    t.ops.back().imm = *imm;
    return;
  }
  // Several pieces: the immediate follows them all, on the first piece's rail.
  Op op = t.ops[t.ops.size() - pieces];
  const engine::Scratch scratch = workers_[group]->scratch(op.domain);
  op.length = 0;
  op.dst_index = Op::kNoDst;
  op.local = scratch.local;
  op.local_desc = scratch.desc;
  op.has_imm = true;
  op.imm = *imm;
  t.deferred.push_back(op);
}

Op EngineImpl::zero_byte_imm(Transfer& t, uint32_t group, uint32_t domain, const Address& peer,
                             uint32_t imm) {
  Op op = engine::scratch_op(t, domain, peer, workers_[group]->scratch(domain));
  op.has_imm = true;
  op.imm = imm;
  return op;
}

// --- submissions ----------------------------------------------------------------------------

Result<TransferId> EngineImpl::submit(const SingleWrite& w, Callbacks&& cb) {
  const Submitting open(*this);
  if (!open) return closed();
  std::shared_ptr<LocalRegion> src = lookup_region(w.src);
  if (!src) return region_missing(w.src);
  const uint32_t group = src->group;
  const uint32_t nics = workers_[group]->num_domains();
  if (!remote_ok(w.dst, group)) {
    if (Status s = check_remote(w.dst, group, "single write"); !s) return s;
  }
  if (!engine::in_range(w.src_offset, w.length, src->length)) {
    return engine::check_range("single write source", w.src_offset, w.length, src->length);
  }
  if (!engine::in_range(w.dst_offset, w.length, w.dst.length())) {
    return engine::check_range("single write destination", w.dst_offset, w.length, w.dst.length());
  }
  if (w.routing.kind == Routing::Kind::kPinned && w.routing.nic >= nics) {
    return invalid(fmt::format("single write pinned to NIC {}, but the group has {} NIC(s)",
                               w.routing.nic, nics));
  }
  std::vector<engine::Shard>& shards = shard_buf();
  engine::plan_single_up(shards, w.length, up(group), w.routing, next_rotation(group),
                         shard_params(group), weights(group));
  auto t = new_transfer(group, std::move(cb));
  t->src = std::move(src);
  t->dsts.push_back(w.dst);
  const engine::IpcRoute route = ipc_route(*t->src, w.dst, group);
  if (route.kind == engine::IpcRoute::Kind::kRejected) return ipc_rejected("single write", route);
  if (route.kind == engine::IpcRoute::Kind::kIpc) {
    engine::add_ipc_range(*t, 0, w.src_offset, w.dst_offset, w.length);
    if (w.imm) engine::add_ipc_imm(*t, 0, *w.imm, 1);
    return hand_over(group, std::move(t));
  }
  add_writes(*t, *t->src, w.src_offset, 0, w.dst_offset, shards, w.imm, group);
  return hand_over(group, std::move(t));
}

Result<TransferId> EngineImpl::submit(const PagedWrite& w, Callbacks&& cb) {
  const Submitting open(*this);
  if (!open) return closed();
  std::shared_ptr<LocalRegion> src = lookup_region(w.src);
  if (!src) return region_missing(w.src);
  const uint32_t group = src->group;
  if (!remote_ok(w.dst, group)) {
    if (Status s = check_remote(w.dst, group, "paged write"); !s) return s;
  }
  if (w.page_bytes == 0) return invalid("paged write: page_bytes is 0");
  if (w.src_pages.size() != w.dst_pages.size()) {
    return invalid(fmt::format("paged write: {} source pages but {} destination pages",
                               w.src_pages.size(), w.dst_pages.size()));
  }
  if (w.src_pages.empty()) return invalid("paged write: no pages");
  if (w.imm && (w.dst.staged_region() != 0 || config_.reliable_imm) &&
      w.src_pages.size() > engine::Commit::kMaxImmTimes) {
    return Status(ErrorCode::kOutOfRange,
                  fmt::format("paged write: {} pages with an immediate counted by a commit "
                              "message (at most {})",
                              w.src_pages.size(), engine::Commit::kMaxImmTimes));
  }
  const engine::ShardParams params = shard_params(group);
  if (w.page_bytes > params.max_wr_bytes) {
    return Status(ErrorCode::kUnsupported,
                  fmt::format("paged write: pages of {} bytes exceed the NIC's largest work "
                              "request ({} bytes)",
                              w.page_bytes, params.max_wr_bytes));
  }
  auto t = new_transfer(group, std::move(cb));
  t->src = std::move(src);
  t->dsts.push_back(w.dst);
  const RemoteMemory& dst = t->dsts.back();
  const engine::IpcRoute route = ipc_route(*t->src, dst, group);
  if (route.kind == engine::IpcRoute::Kind::kRejected) return ipc_rejected("paged write", route);
  // Page i's offsets in the source and in the destination, checked.
  // Every page must lie inside both regions; offsets computed without overflow.
  auto page_offsets = [&](size_t i, uint64_t& so, uint64_t& d_off) -> Status {
    if (Status s = engine::page_offset("paged write", "src", i, w.src_pages[i], w.src_stride,
                                       w.src_offset, t->src->length, w.page_bytes, so);
        !s) {
      return s;
    }
    return engine::page_offset("paged write", "dst", i, w.dst_pages[i], w.dst_stride, w.dst_offset,
                               dst.length(), w.page_bytes, d_off);
  };
  if (route.kind == engine::IpcRoute::Kind::kIpc) {
    if (w.imm && w.src_pages.size() > engine::Commit::kMaxImmTimes) {
      return Status(
          ErrorCode::kOutOfRange,
          fmt::format("paged write: {} pages with an immediate over CUDA IPC (at most {})",
                      w.src_pages.size(), engine::Commit::kMaxImmTimes));
    }
    for (size_t i = 0; i < w.src_pages.size(); ++i) {
      uint64_t so = 0, d_off = 0;
      if (Status s = page_offsets(i, so, d_off); !s) return s;
      engine::add_ipc_range(*t, 0, so, d_off, w.page_bytes);
    }
    if (w.imm) engine::add_ipc_imm(*t, 0, *w.imm, w.src_pages.size());
    return hand_over(group, std::move(t));
  }
  // What every page's op shares, set once: the pages are copies of it, and each gets only its
  // NIC's rail (once per run of pages on a NIC) and its offsets (op_builder.h, fill_page).
  // page_bytes > 0: no scratch buffer needed.
  const bool staged_dst = dst.staged_region() != 0;
  Op proto = engine::write_op(*t, 0, dst, 0, nullptr, nullptr, w.page_bytes, engine::Scratch{});
  if (staged_dst) {  // the owner counts one arrival per page after its copy
    proto.dst_index = 0;
  } else if (!config_.reliable_imm) {
    proto.has_imm = w.imm.has_value();
    proto.imm = w.imm.value_or(0);
  }
  t->ops.assign(w.src_pages.size(), proto);
  // A page inside both regions, offsets computed without overflow: the common case, without a
  // Status (page_offsets makes the error when it is not).
  auto fits = [&w](uint32_t index, uint64_t stride, uint64_t base, uint64_t region, uint64_t& out) {
    uint64_t scaled = 0;
    return !__builtin_mul_overflow(static_cast<uint64_t>(index), stride, &scaled) &&
           !__builtin_add_overflow(scaled, base, &out) && out <= region &&
           w.page_bytes <= region - out;
  };
  const uint64_t src_length = t->src->length;
  const uint64_t dst_length = dst.length();
  std::byte* const host = t->src->host;
  std::vector<engine::Run>& runs = run_buf();
  engine::split_even_up(runs, w.src_pages.size(), up(group), next_rotation(group), weights(group));
  for (const engine::Run& run : runs) {
    void* const local_desc = t->src->regs[run.domain]->local_desc();
    const engine::RailTarget rail = engine::rail_target(dst, run.domain);
    for (size_t i = run.begin; i < run.end; ++i) {
      uint64_t so = 0, d_off = 0;
      if (!fits(w.src_pages[i], w.src_stride, w.src_offset, src_length, so) ||
          !fits(w.dst_pages[i], w.dst_stride, w.dst_offset, dst_length, d_off)) {
        if (Status s = page_offsets(i, so, d_off); !s) return s;
      }
      Op& op = t->ops[i];
      engine::fill_page(op, run.domain, rail, d_off, host + so, local_desc);
      if (staged_dst) op.dst_offset = d_off;
    }
  }
  if ((dst.staged_region() != 0 || config_.reliable_imm) && w.imm) {
    stage_imm(*t, 0, *w.imm, w.src_pages.size());
  }
  return hand_over(group, std::move(t));
}

Result<TransferId> EngineImpl::submit(const Scatter& sc, Callbacks&& cb) {
  const Submitting open(*this);
  if (!open) return closed();
  std::shared_ptr<LocalRegion> src = lookup_region(sc.src);
  if (!src) return region_missing(sc.src);
  const uint32_t group = src->group;
  if (sc.targets.empty()) return invalid("scatter: no targets");
  std::shared_ptr<const engine::PeerGroupMembers> group_members;
  {
    std::lock_guard gl(groups_mu_);
    auto it = peer_groups_.find(sc.group.id);
    if (it == peer_groups_.end()) {
      return Status(ErrorCode::kNotFound,
                    fmt::format("scatter: peer group {} does not exist", sc.group.id));
    }
    group_members = it->second;
  }
  const engine::PeerGroupMembers& members = *group_members;
  const std::string& provider = infos_[group].provider;
  const uint64_t src_length = src->length;
  for (size_t i = 0; i < sc.targets.size(); ++i) {
    const ScatterTarget& tg = sc.targets[i];
    // The common case without formatting a message: what check_remote and the checks below
    // hold, in one expression (each descriptor accessor is a call: owner read once).
    if (!tg.dst.empty()) {
      const Address& owner = tg.dst.owner();
      if (tg.dst.rails_fit_owner() && owner.provider() == provider && members.contains(owner) &&
          engine::in_range(tg.src_offset, tg.length, src_length) &&
          engine::in_range(tg.dst_offset, tg.length, tg.dst.length())) {
        continue;
      }
    }
    const std::string what = fmt::format("scatter target {}", i);
    if (Status s = check_remote(tg.dst, group, what); !s) return s;
    if (!members.contains(tg.dst.owner())) {
      return Status(ErrorCode::kNotFound,
                    fmt::format("{}: its owner {} is not a member of peer group {}", what,
                                tg.dst.owner().short_name(), sc.group.id));
    }
    if (Status s = engine::check_range(what + " source", tg.src_offset, tg.length, src->length);
        !s) {
      return s;
    }
    if (Status s =
            engine::check_range(what + " destination", tg.dst_offset, tg.length, tg.dst.length());
        !s) {
      return s;
    }
  }
  const uint32_t nics = workers_[group]->num_domains();
  const uint32_t rotation = next_rotation(group);
  const engine::ShardParams params = shard_params(group);
  const std::vector<bool>& up = this->up(group);
  const std::span<const uint64_t> rates = weights(group);
  auto t = new_transfer(group, std::move(cb));
  t->src = std::move(src);
  t->dsts.reserve(sc.targets.size());
  t->ops.reserve(sc.targets.size());  // one op per target when pinned; more when sharded
  bool last_ipc = false;              // the target before went over CUDA IPC (as dsts.back())
  for (size_t i = 0; i < sc.targets.size(); ++i) {
    const ScatterTarget& tg = sc.targets[i];
    const engine::IpcRoute route = ipc_route(*t->src, tg.dst, group);
    if (route.kind == engine::IpcRoute::Kind::kRejected) {
      return ipc_rejected(fmt::format("scatter target {}", i), route);
    }
    if (route.kind == engine::IpcRoute::Kind::kIpc) {
      // Targets in a row into one region share its destination: ranges adjacent on both sides
      // become one copy, and the region's ranges go in one Commit that counts the immediate
      // once per target.
      if (!last_ipc || t->dsts.back() != tg.dst) t->dsts.push_back(tg.dst);
      const uint32_t dst_index = static_cast<uint32_t>(t->dsts.size() - 1);
      engine::add_ipc_range(*t, dst_index, tg.src_offset, tg.dst_offset, tg.length);
      if (sc.imm) engine::add_ipc_imm(*t, dst_index, *sc.imm, 1);
      last_ipc = true;
      continue;
    }
    last_ipc = false;
    t->dsts.push_back(tg.dst);
    const uint32_t dst_index = static_cast<uint32_t>(t->dsts.size() - 1);
    const Routing routing = sc.sharding == Scatter::Sharding::kByBytes
                                ? Routing::sharded(0)
                                : Routing::pinned(static_cast<uint32_t>((rotation + i) % nics));
    std::vector<engine::Shard>& shards = shard_buf();
    engine::plan_single_up(shards, tg.length, up, routing, rotation + static_cast<uint32_t>(i),
                           params, rates);
    add_writes(*t, *t->src, tg.src_offset, dst_index, tg.dst_offset, shards, sc.imm, group);
  }
  return hand_over(group, std::move(t));
}

Result<TransferId> EngineImpl::submit(const Barrier& b, Callbacks&& cb) {
  const Submitting open(*this);
  if (!open) return closed();
  if (Status s = check_group(b.local_group); !s) return s;
  const uint32_t nics = workers_[b.local_group]->num_domains();
  if (b.nic >= nics) {
    return invalid(fmt::format("barrier on NIC {}, but the group has {} NIC(s)", b.nic, nics));
  }
  auto t = new_transfer(b.local_group, std::move(cb));
  {
    std::lock_guard gl(groups_mu_);
    auto it = peer_groups_.find(b.group.id);
    if (it == peer_groups_.end()) {
      return Status(ErrorCode::kNotFound,
                    fmt::format("barrier: peer group {} does not exist", b.group.id));
    }
    t->peers = it->second->peers;
  }
  // A barrier on a NIC that is down goes over a surviving one.
  const uint32_t nic = engine::failover_nic(b.nic, up(b.local_group), 0);
  t->ops.reserve(t->peers.size());
  for (const Address& peer : t->peers) {
    if (Status s = check_peer(peer, b.local_group, "barrier"); !s) return s;
    t->ops.push_back(zero_byte_imm(*t, b.local_group, nic, peer, b.imm));
  }
  return hand_over(b.local_group, std::move(t));
}

Result<TransferId> EngineImpl::submit(const ImmWrite& w, Callbacks&& cb) {
  const Submitting open(*this);
  if (!open) return closed();
  if (Status s = check_group(w.local_group); !s) return s;
  if (Status s = check_peer(w.peer, w.local_group, "imm write"); !s) return s;
  const uint32_t nics = workers_[w.local_group]->num_domains();
  if (w.nic >= nics) {
    return invalid(fmt::format("imm write on NIC {}, but the group has {} NIC(s)", w.nic, nics));
  }
  auto t = new_transfer(w.local_group, std::move(cb));
  t->peers.push_back(w.peer);
  const uint32_t nic = engine::failover_nic(w.nic, up(w.local_group), 0);
  t->ops.push_back(zero_byte_imm(*t, w.local_group, nic, t->peers[0], w.imm));
  return hand_over(w.local_group, std::move(t));
}

Result<TransferId> EngineImpl::submit_send(const Address& peer, std::span<const std::byte> message,
                                           Callbacks cb, uint32_t group) {
  const Submitting open(*this);
  if (!open) return closed();
  if (Status s = check_group(group); !s) return s;
  if (Status s = check_peer(peer, group, "send"); !s) return s;
  if (message.size() > config_.max_message_bytes) {
    return Status(ErrorCode::kOutOfRange,
                  fmt::format("send: message of {} bytes exceeds max_message_bytes ({})",
                              message.size(), config_.max_message_bytes));
  }
  auto t = new_transfer(group, std::move(cb));
  t->peers.push_back(peer);
  t->message.reserve(engine::kMessageHeaderBytes + message.size());
  t->message.resize(engine::kMessageHeaderBytes);  // sender and sequence: stamped by the worker
  t->message[0] = static_cast<std::byte>(engine::MessageKind::kUser);
  t->message.insert(t->message.end(), message.begin(), message.end());
  // Over the first NIC that is up; every NIC of the peer has receive buffers.
  const uint32_t nic = engine::failover_nic(0, up(group), 0);
  t->ops.push_back(engine::send_op(*t, nic, t->peers[0], t->message));
  return hand_over(group, std::move(t));
}

Status EngineImpl::set_receive_handler(std::function<void(std::span<const std::byte>)> on_message,
                                       uint64_t buffer_bytes, uint32_t count, uint32_t group) {
  auto lock = enter();
  if (!lock) return closed();
  if (Status s = check_group(group); !s) return s;
  if (!on_message) return invalid("set_receive_handler: the handler is empty");
  if (buffer_bytes == 0 || count == 0) {
    return invalid("set_receive_handler: buffer_bytes and count must be at least 1");
  }
  on_message = stats_.receiving(group, std::move(on_message));
  engine::Worker* w = workers_[group].get();
  return w->call([&] { return w->start_receives(std::move(on_message), buffer_bytes, count); });
}

}  // namespace fabric
