// IpcCopies (ipc_copies.h): the owner's copies of the CUDA IPC path (docs/cuda-ipc.md).
//
// Writer (StagedWriter::commit_ipc): a transfer whose destination goes over CUDA IPC has no
// work requests for it; when the transfer starts, the worker sends the destination's owner
// Commits that name the ranges to fill and carry this engine's export of the source.
//
// Owner (here): a Commit with an IPC source is checked against the live registration it names,
// the writer's allocation is mapped, every range is copied GPU to GPU on one of the GPU's IPC
// streams, and once the copies' event has completed the job goes back to the worker, which has
// the StagedPath count the immediate and acknowledge (StagedPath::commit_done, shared with the
// staged path).
//
// Reader: a read of a peer's GPU memory on this host sends the owner read Commits carrying the
// reader's export of its destination; the owner maps it the same way and copies from its region
// into it, and acknowledges once the copies completed.
#include "engine/ipc_copies.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

namespace fabric::engine {

IpcCopies::IpcCopies(const RegionTable* regions, const Worker* self, Options options,
                     std::unique_ptr<IpcImports::Mapper> mapper, cuda::CopierFactory make)
    : regions_(regions),
      self_(self),
      options_(options),
      mapper_(std::move(mapper)),
      copiers_(std::move(make), options.streams) {}

IpcCopies::~IpcCopies() = default;

void IpcCopies::refuse(CommitJob& job, Status status) {
  job.status = std::move(status);
  done_.push_back(&job);
}

void IpcCopies::start(CommitJob& job, Clock::time_point now) {
  const Commit& c = job.commit;
  const IpcSource& src = *c.ipc;
  job.region = regions_ ? regions_->find(c.region) : nullptr;
  if (!job.region || job.region->worker != self_ || !job.region->ipc_destination()) {
    refuse(job, Status(ErrorCode::kRemoteAccess,
                       fmt::format("CUDA IPC destination region {:#x} is not registered on this "
                                   "group (was it unregistered?)",
                                   c.region)));
    return;
  }
  const LocalRegion& region = *job.region;
  if (c.read && !region.remote_read) {
    refuse(job, Status(ErrorCode::kRemoteAccess,
                       fmt::format("region {:#x} was not registered readable "
                                   "(RegisterOptions::remote_read); nothing was read",
                                   c.region)));
    return;
  }
  for (size_t i = 0; i < c.ranges.size(); ++i) {
    const Range& r = c.ranges[i];
    const uint64_t so = src.offsets[i];
    if (r.offset > region.length || r.length > region.length - r.offset || so > src.length ||
        r.length > src.length - so) {
      refuse(job, Status(ErrorCode::kRemoteAccess,
                         fmt::format("CUDA IPC copy of {} bytes from source offset {} (of {}) to "
                                     "offset {} exceeds a region ({} bytes)",
                                     r.length, so, src.length, r.offset, region.length)));
      return;
    }
  }
  if (c.ranges.empty()) {  // an immediate that follows acknowledged ranges
    done_.push_back(&job);
    return;
  }
  auto writer = Address::decode(c.reply_to);
  if (!imports_) {
    imports_ =
        std::make_unique<IpcImports>(mapper_ ? std::move(mapper_) : IpcImports::cuda_mapper(),
                                     options_.idle_timeout, options_.max_mappings);
  }
  // GPU memory is copied into by its own GPU; host memory registered for GPU copies by the
  // GPU it named.
  const cuda::PointerInfo& device = region.ipc_device();
  auto lease = imports_->map(writer->origin(), src.exported, device, now);
  if (!lease) {
    refuse(job,
           Status(lease.status().code(), fmt::format("mapping the writer's CUDA IPC export: {}",
                                                     lease.status().message())));
    return;
  }
  job.lease = *lease;
  // Into this pass's batch for the destination's GPU (a new one on the next copier in turn).
  Batch* batch = nullptr;
  for (Batch* b : open_) {
    if (b->device.kind == device.kind && b->device.device == device.device) batch = b;
  }
  if (batch == nullptr) {
    auto copier = copiers_.get(device);
    if (!copier) {
      refuse(job, copier.status());
      return;
    }
    auto owned = std::make_unique<Batch>();
    batch = owned.get();
    batch->device = device;
    batch->copier = *copier;
    batches_.emplace(batch, std::move(owned));
    open_.push_back(batch);
  }
  // A write's ranges come from the writer's mapped source into the region; a read's go from
  // the region into the reader's mapped destination.
  std::byte* peer = (*lease)->base + src.exported.offset;
  // A copy that continues the last one on both sides (the next parameter of a region, often)
  // extends it: one copy instead of many.
  for (size_t i = 0; i < c.ranges.size(); ++i) {
    std::byte* mine = region.ptr + c.ranges[i].offset;
    std::byte* theirs = peer + src.offsets[i];
    const uint64_t n = c.ranges[i].length;
    const cuda::Copier::DeviceCopy next = c.read ? cuda::Copier::DeviceCopy{theirs, mine, n}
                                                 : cuda::Copier::DeviceCopy{mine, theirs, n};
    if (!batch->copies.empty()) {
      cuda::Copier::DeviceCopy& last = batch->copies.back();
      if (last.dst + last.bytes == next.dst && last.src + last.bytes == next.src) {
        last.bytes += n;
        continue;
      }
    }
    batch->copies.push_back(next);
  }
  batch->jobs.push_back(&job);
}

void IpcCopies::flush() {
  for (Batch* b : open_) {
    Status s = b->copier->copy_device_batch(b->copies);
    if (s.is_ok()) s = b->copier->fence(reinterpret_cast<uint64_t>(b));
    b->copies.clear();
    if (!s.is_ok()) batch_done(b, s);
  }
  open_.clear();
}

void IpcCopies::batch_done(Batch* batch, const Status& status) {
  auto owned = batches_.extract(batch);
  for (CommitJob* job : batch->jobs) {
    if (!status.is_ok()) job->status = status;
    done_.push_back(job);
  }
}

bool IpcCopies::poll() {
  polled_.clear();
  if (copiers_.poll(polled_) == 0) return false;
  for (const cuda::Copier::Done& d : polled_)
    batch_done(reinterpret_cast<Batch*>(d.token), d.status);
  return true;
}

void IpcCopies::drain() {
  copiers_.drain();
  open_.clear();
  batches_.clear();
}

void IpcCopies::sweep(Clock::time_point now) {
  if (!imports_ || imports_->size() == 0 || now < next_sweep_) return;
  next_sweep_ = now + std::chrono::seconds(1);
  imports_->sweep(now, [](const Origin& o) { return o.process_alive(); });
}

}  // namespace fabric::engine
