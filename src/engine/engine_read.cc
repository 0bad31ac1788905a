// EngineImpl: the caller thread's half of a one-sided read (single and paged). Validated in
// full (bad input gets a clear error and nothing is posted), sharded over the NICs that are up
// like a write (plan.h), its Ops filled in (op_builder.h) and handed to the worker. A read's Op
// is a write's with the direction turned: `local` receives, dst_mem is the peer's region the
// bytes come from, and the transfer's `src` is the local region (what failover re-registers on
// another NIC).
//
// GPU memory (docs/reads.md): between GPUs of one host the read goes over the CUDA IPC path
// (read Commits: the owner copies into this engine's exported destination, ipc_copies.h); else
// over the fabric, where a staged peer region is first copied out of its GPU into its mirror
// (`read_prep`, read Commits the ops wait for) and a staged local region receives into its own
// mirror, each op's bytes then copied into the GPU before it counts as done (worker).
#include <fmt/format.h>

#include "engine/engine_impl.h"

namespace fabric {

using engine_impl::invalid;

namespace {

// Appends [offset, offset + length) to `ranges`, merged with the last range when it continues it.
void add_range(std::vector<engine::Range>& ranges, uint64_t offset, uint64_t length) {
  if (!ranges.empty() && ranges.back().offset + ranges.back().length == offset) {
    ranges.back().length += length;
    return;
  }
  ranges.push_back({offset, length});
}

}  // namespace

Status EngineImpl::check_read(const RemoteMemory& remote, uint32_t group,
                              std::string_view what) const {
  if (!remote_ok(remote, group)) {
    if (Status s = check_remote(remote, group, what); !s) return s;
  }
  if (!remote.readable()) {
    return Status(ErrorCode::kRemoteAccess,
                  fmt::format("{}: the peer did not register the region readable "
                              "(RegisterOptions::remote_read); nothing was read",
                              what));
  }
  return Status::ok();
}

Result<TransferId> EngineImpl::submit(const SingleRead& r, Callbacks&& cb) {
  const Submitting open(*this);
  if (!open) return closed();
  std::shared_ptr<LocalRegion> local = lookup_region(r.dst);
  if (!local) return region_missing(r.dst);
  const uint32_t group = local->group;
  const uint32_t nics = workers_[group]->num_domains();
  if (Status s = check_read(r.src, group, "single read"); !s) return s;
  if (!engine::in_range(r.src_offset, r.length, r.src.length())) {
    return engine::check_range("single read source", r.src_offset, r.length, r.src.length());
  }
  if (!engine::in_range(r.dst_offset, r.length, local->length)) {
    return engine::check_range("single read destination", r.dst_offset, r.length, local->length);
  }
  if (r.routing.kind == Routing::Kind::kPinned && r.routing.nic >= nics) {
    return invalid(fmt::format("single read pinned to NIC {}, but the group has {} NIC(s)",
                               r.routing.nic, nics));
  }
  const engine::IpcRoute route = ipc_route(*local, r.src, group, /*read=*/true);
  if (route.kind == engine::IpcRoute::Kind::kRejected) return ipc_rejected("single read", route);
  auto t = new_transfer(group, std::move(cb));
  t->src = std::move(local);
  t->dsts.push_back(r.src);
  t->reading = true;
  if (r.length == 0) return hand_over(group, std::move(t));  // nothing to read: done at once
  if (route.kind == engine::IpcRoute::Kind::kIpc) {
    engine::add_ipc_range(*t, 0, r.dst_offset, r.src_offset, r.length);
    return hand_over(group, std::move(t));
  }
  if (r.src.staged_region() != 0) add_range(t->read_prep, r.src_offset, r.length);
  std::vector<engine::Shard>& shards = shard_buf();
  engine::plan_single_up(shards, r.length, up(group), r.routing, next_rotation(group),
                         shard_params(group), weights(group));
  const RemoteMemory& remote = t->dsts.back();
  std::byte* const host = t->src->host;
  for (const engine::Shard& s : shards) {
    Op& op = t->ops.emplace_back();
    engine::fill_write(op, *t, s.domain, remote, r.src_offset + s.offset,
                       host + r.dst_offset + s.offset, t->src->regs[s.domain]->local_desc(),
                       s.length, workers_[group]->scratch(s.domain));
    op.kind = Op::Kind::kRead;
  }
  return hand_over(group, std::move(t));
}

Result<TransferId> EngineImpl::submit(const PagedRead& r, Callbacks&& cb) {
  const Submitting open(*this);
  if (!open) return closed();
  std::shared_ptr<LocalRegion> local = lookup_region(r.dst);
  if (!local) return region_missing(r.dst);
  const uint32_t group = local->group;
  if (Status s = check_read(r.src, group, "paged read"); !s) return s;
  if (r.page_bytes == 0) return invalid("paged read: page_bytes is 0");
  if (r.src_pages.size() != r.dst_pages.size()) {
    return invalid(fmt::format("paged read: {} source pages but {} destination pages",
                               r.src_pages.size(), r.dst_pages.size()));
  }
  if (r.src_pages.empty()) return invalid("paged read: no pages");
  const engine::ShardParams params = shard_params(group);
  if (r.page_bytes > params.max_wr_bytes) {
    return Status(ErrorCode::kUnsupported,
                  fmt::format("paged read: pages of {} bytes exceed the NIC's largest work "
                              "request ({} bytes)",
                              r.page_bytes, params.max_wr_bytes));
  }
  const engine::IpcRoute route = ipc_route(*local, r.src, group, /*read=*/true);
  if (route.kind == engine::IpcRoute::Kind::kRejected) return ipc_rejected("paged read", route);
  auto t = new_transfer(group, std::move(cb));
  t->src = std::move(local);
  t->dsts.push_back(r.src);
  t->reading = true;
  const RemoteMemory& remote = t->dsts.back();
  // Page i's offsets in the peer's region and the local one.
  auto offsets = [&](size_t i, uint64_t& remote_off, uint64_t& local_off) {
    if (Status s = engine::page_offset("paged read", "src", i, r.src_pages[i], r.src_stride,
                                       r.src_offset, remote.length(), r.page_bytes, remote_off);
        !s) {
      return s;
    }
    return engine::page_offset("paged read", "dst", i, r.dst_pages[i], r.dst_stride, r.dst_offset,
                               t->src->length, r.page_bytes, local_off);
  };
  if (route.kind == engine::IpcRoute::Kind::kIpc) {
    for (size_t i = 0; i < r.src_pages.size(); ++i) {
      uint64_t remote_off = 0, local_off = 0;
      if (Status s = offsets(i, remote_off, local_off); !s) return s;
      engine::add_ipc_range(*t, 0, local_off, remote_off, r.page_bytes);
    }
    return hand_over(group, std::move(t));
  }
  const bool prep = remote.staged_region() != 0;
  Op proto = engine::write_op(*t, 0, remote, 0, nullptr, nullptr, r.page_bytes, engine::Scratch{});
  proto.kind = Op::Kind::kRead;
  t->ops.assign(r.src_pages.size(), proto);
  std::byte* const host = t->src->host;
  std::vector<engine::Run>& runs = run_buf();
  engine::split_even_up(runs, r.src_pages.size(), up(group), next_rotation(group), weights(group));
  for (const engine::Run& run : runs) {
    void* const local_desc = t->src->regs[run.domain]->local_desc();
    const engine::RailTarget rail = engine::rail_target(remote, run.domain);
    for (size_t i = run.begin; i < run.end; ++i) {
      uint64_t remote_off = 0, local_off = 0;
      if (Status s = offsets(i, remote_off, local_off); !s) return s;
      if (prep) add_range(t->read_prep, remote_off, r.page_bytes);
      engine::fill_page(t->ops[i], run.domain, rail, remote_off, host + local_off, local_desc);
    }
  }
  return hand_over(group, std::move(t));
}

}  // namespace fabric
