// IpcCopies: the owner's copies of the CUDA IPC path (docs/cuda-ipc.md), as a component
// (docs/engine.md, "Files").
//
// A Commit with an IPC source (a CommitJob the StagedPath asked to start) is checked against the
// live registration it names (a region unregistered since is refused with kRemoteAccess:
// unregister_memory is a barrier), the writer's allocation is mapped (cached in IpcImports), and
// every range is copied GPU to GPU. The Commits started in one pass are copied together: their
// ranges go into one batch per GPU, launched by flush() at the end of the pass (one kernel
// launch and one event for all the small ranges), on the next of the GPU's streams in turn.
//
// It owns the imports, its copiers (Config::cuda_ipc_streams per GPU), the batches and the sweep
// of idle mappings, and calls nothing above them: the jobs whose copies ended (job.status says
// how) come back from done(), for the worker to hand to StagedPath::commit_done. Used by one
// thread (the worker).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "cuda/device_memory.h"
#include "engine/copier_set.h"
#include "engine/ipc_imports.h"
#include "engine/regions.h"
#include "engine/staged_path.h"

namespace fabric::engine {

class Worker;

class IpcCopies {
 public:
  using Clock = std::chrono::steady_clock;

  struct Options {
    uint32_t streams = 1;  // copiers per GPU (Config::cuda_ipc_streams; 0 counts as 1)
    std::chrono::milliseconds idle_timeout{std::chrono::seconds(10)};  // IpcImports'
    size_t max_mappings = 1024;
  };

  // `regions`: the engine's registrations, which Commits name (may be null: every Commit is
  // refused); `self`: the worker whose regions a Commit may name (compared, never called).
  // `mapper`: null for CUDA's (IpcImports::cuda_mapper), made with the imports on first use.
  IpcCopies(const RegionTable* regions, const Worker* self, Options options,
            std::unique_ptr<IpcImports::Mapper> mapper = nullptr,
            cuda::CopierFactory make = &cuda::Copier::create);
  ~IpcCopies();
  IpcCopies(const IpcCopies&) = delete;
  IpcCopies& operator=(const IpcCopies&) = delete;

  // Checks and maps job's Commit and puts its ranges into this pass's batch for the
  // destination's GPU. A Commit refused, one without ranges (an immediate that follows
  // acknowledged ranges) and one whose source cannot be mapped go to done() at once.
  void start(CommitJob& job, Clock::time_point now);
  bool has_open() const { return !open_.empty(); }
  // Launches this pass's batches; a batch that cannot be launched ends with its error.
  void flush();
  // Batches whose copies completed: their jobs go to done(). True when any did.
  bool poll();
  // The jobs whose copies ended since the last take, in order (status set on failure).
  std::vector<CommitJob*>& done() { return done_; }
  bool has_copiers() const { return !copiers_.empty(); }
  bool copying() const { return copiers_.copying(); }
  // The engine stops: waits for every copy in flight, then forgets the batches.
  void drain();
  // At most once a second: unmaps idle mappings and those of writers that died.
  void sweep(Clock::time_point now);

  const IpcImports* imports() const { return imports_.get(); }

 private:
  // The copies of the Commits started in one pass, for one GPU; its address is the token of
  // the fence that ends them.
  struct Batch {
    cuda::PointerInfo device;
    cuda::Copier* copier = nullptr;
    std::vector<cuda::Copier::DeviceCopy> copies;
    std::vector<CommitJob*> jobs;
  };
  void refuse(CommitJob& job, Status status);
  void batch_done(Batch* batch, const Status& status);

  const RegionTable* const regions_;
  const Worker* const self_;
  const Options options_;
  std::unique_ptr<IpcImports::Mapper> mapper_;  // until the imports take it
  // The imports before the copiers whose copies read their mappings (destroyed after them),
  // and those before the batches that name them.
  std::unique_ptr<IpcImports> imports_;
  CopierSet copiers_;
  std::unordered_map<Batch*, std::unique_ptr<Batch>> batches_;  // open or copying
  std::vector<Batch*> open_;                                    // filled in this pass
  std::vector<cuda::Copier::Done> polled_;
  std::vector<CommitJob*> done_;
  Clock::time_point next_sweep_;
};

}  // namespace fabric::engine
