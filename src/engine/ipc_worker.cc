// The Worker's part of the CUDA IPC path (docs/cuda-ipc.md).
//
// Writer: a transfer whose destination goes over CUDA IPC has no work requests for it; when the
// transfer starts, the worker sends the destination's owner Commits that name the ranges to
// fill and carry this engine's export of the source. The immediate rides on the last Commit
// (or, when the ranges need several messages, follows in its own Commit once every range
// Commit is acknowledged). The transfer completes on the last Ack.
//
// Owner: a Commit with an IPC source is checked against the live registration it names (a
// region unregistered since is refused with kRemoteAccess: unregister_memory is a barrier), the
// writer's allocation is mapped (cached in IpcImports), every range is copied GPU to GPU on one
// of the worker's IPC streams, and once the copies' event has completed the immediate is
// counted and the Commit acknowledged (StagedPath::commit_done, shared with the staged path). The
// Commits read in one pass are copied together: their ranges go into one batch per GPU
// (IpcBatch), launched at the end of the pass (one kernel launch and one event for all the
// small ranges), on the next stream in turn.
#include <fmt/format.h>

#include "common/log.h"
#include "engine/plan.h"
#include "engine/worker.h"

namespace fabric::engine {

bool Worker::ipc_left(const Transfer& t) {
  for (const IpcDst& d : t.ipc) {
    if (!d.ranges.empty() || d.has_imm) return true;
  }
  return false;
}

void Worker::send_ipc_commits(Transfer& t, bool final) {
  if (!t.error.is_ok()) return;
  const uint64_t room = config_.max_message_bytes + kMessageHeaderBytes;
  for (IpcDst& d : t.ipc) {
    if (d.ranges.empty() && !(final && d.has_imm)) continue;
    const RemoteMemory& dst = t.dsts[d.dst_index];
    const LocalRegion& src = *t.src;
    const uint64_t fixed =
        Commit::kFixedBytes + self_.size() + Commit::kIpcFixedBytes + src.ipc->handle.size();
    const uint64_t per_message =
        room > fixed ? (room - fixed) / (Commit::kRangeBytes + Commit::kIpcRangeBytes) : 0;
    if (per_message == 0) {
      t.error = Status(ErrorCode::kInvalidArgument,
                       "max_message_bytes is too small for the CUDA IPC path's commit messages");
      d.ranges.clear();
      d.has_imm = false;
      continue;
    }
    // The immediate rides on the last range Commit when one message holds every range;
    // otherwise it follows, alone, after their Acks (advance() calls again with `final`).
    const bool imm_now =
        d.has_imm && (d.ranges.size() <= per_message || (final && d.ranges.empty()));
    size_t pos = 0;
    do {
      const size_t n = std::min<size_t>(per_message, d.ranges.size() - pos);
      Commit c;
      c.transfer = t.id;
      c.reply_to = self_;
      c.region = dst.cuda_ipc()->region;
      c.ranges.assign(d.ranges.begin() + static_cast<std::ptrdiff_t>(pos),
                      d.ranges.begin() + static_cast<std::ptrdiff_t>(pos + n));
      IpcSource& is = c.ipc.emplace();
      is.exported = *src.ipc;
      is.region = src.id;
      is.length = src.length;
      is.offsets.assign(d.src_offsets.begin() + static_cast<std::ptrdiff_t>(pos),
                        d.src_offsets.begin() + static_cast<std::ptrdiff_t>(pos + n));
      pos += n;
      if (imm_now && pos == d.ranges.size()) {
        c.has_imm = true;
        c.imm = d.imm;
        c.imm_times = d.imm_times;
        d.has_imm = false;
      }
      send_commit(t, c, dst.owner());
    } while (pos < d.ranges.size());
    d.ranges.clear();
    d.src_offsets.clear();
  }
}

Result<cuda::Copier*> Worker::ipc_copier(const cuda::PointerInfo& device) {
  std::vector<cuda::Copier*> mine;
  for (auto& [info, copier] : ipc_copiers_) {
    if (info.kind == device.kind && info.device == device.device) mine.push_back(copier);
  }
  const size_t streams = std::max<uint32_t>(1, config_.cuda_ipc_streams);
  if (mine.size() < streams) {
    auto copier = cuda::Copier::create(device);
    if (!copier) return copier.status();
    cuda::Copier* raw = copier->get();
    copiers_.push_back({device, std::move(*copier), Tokens::kIpcBatches});
    ipc_copiers_.emplace_back(device, raw);
    return raw;
  }
  return mine[ipc_turn_++ % mine.size()];
}

void Worker::start_ipc_copy(CommitJob& job) {
  const Commit& c = job.commit;
  const IpcSource& src = *c.ipc;
  job.region = services_.regions ? services_.regions->find(c.region) : nullptr;
  if (!job.region || job.region->worker != this || !job.region->ipc) {
    job.status = Status(ErrorCode::kRemoteAccess,
                        fmt::format("CUDA IPC destination region {:#x} is not registered on this "
                                    "group (was it unregistered?)",
                                    c.region));
    staged_->commit_done(job);
    return;
  }
  const LocalRegion& region = *job.region;
  for (size_t i = 0; i < c.ranges.size(); ++i) {
    const Range& r = c.ranges[i];
    const uint64_t so = src.offsets[i];
    if (r.offset > region.length || r.length > region.length - r.offset || so > src.length ||
        r.length > src.length - so) {
      job.status =
          Status(ErrorCode::kRemoteAccess,
                 fmt::format("CUDA IPC copy of {} bytes from source offset {} (of {}) to offset {} "
                             "exceeds a region ({} bytes)",
                             r.length, so, src.length, r.offset, region.length));
      staged_->commit_done(job);
      return;
    }
  }
  if (c.ranges.empty()) {  // an immediate that follows acknowledged ranges
    staged_->commit_done(job);
    return;
  }
  auto writer = Address::decode(c.reply_to);
  if (!ipc_imports_) {
    ipc_imports_ =
        std::make_unique<IpcImports>(IpcImports::cuda_mapper(), std::chrono::seconds(10), 1024);
  }
  auto lease = ipc_imports_->map(writer->origin(), src.exported, region.memory, now_);
  if (!lease) {
    job.status =
        Status(lease.status().code(),
               fmt::format("mapping the writer's CUDA IPC export: {}", lease.status().message()));
    staged_->commit_done(job);
    return;
  }
  job.lease = *lease;
  // Into this pass's batch for the destination's GPU (a new one on the next copier in turn).
  IpcBatch* batch = nullptr;
  for (IpcBatch* b : ipc_open_) {
    if (b->device.kind == region.memory.kind && b->device.device == region.memory.device) batch = b;
  }
  if (batch == nullptr) {
    auto copier = ipc_copier(region.memory);
    if (!copier) {
      job.status = copier.status();
      staged_->commit_done(job);
      return;
    }
    auto owned = std::make_unique<IpcBatch>();
    batch = owned.get();
    batch->device = region.memory;
    batch->copier = *copier;
    ipc_batches_.emplace(batch, std::move(owned));
    ipc_open_.push_back(batch);
  }
  const std::byte* from = (*lease)->base + src.exported.offset;
  for (size_t i = 0; i < c.ranges.size(); ++i) {
    batch->copies.push_back(
        {region.ptr + c.ranges[i].offset, from + src.offsets[i], c.ranges[i].length});
  }
  batch->jobs.push_back(&job);
}

void Worker::flush_ipc_batches() {
  for (IpcBatch* b : ipc_open_) {
    Status s = b->copier->copy_device_batch(b->copies);
    if (s.is_ok()) s = b->copier->fence(reinterpret_cast<uint64_t>(b));
    b->copies.clear();
    if (!s.is_ok()) ipc_batch_done(b, s);
  }
  ipc_open_.clear();
}

void Worker::ipc_batch_done(IpcBatch* batch, const Status& status) {
  auto owned = ipc_batches_.extract(batch);
  for (CommitJob* job : batch->jobs) {
    if (!status.is_ok()) job->status = status;
    staged_->commit_done(*job);
  }
  run_staged_events();
}

void Worker::sweep_ipc() {
  if (!ipc_imports_ || ipc_imports_->size() == 0 || now_ < next_ipc_sweep_) return;
  next_ipc_sweep_ = now_ + std::chrono::seconds(1);
  ipc_imports_->sweep(now_, [](const Origin& o) { return o.process_alive(); });
}

}  // namespace fabric::engine
