// The owner side of the CUDA IPC path (docs/cuda-ipc.md): allocations that writers on this host
// exported, mapped into this process once per (writer process, allocation) and cached. A
// mapping stays while copies read from it (a Lease), and is dropped by sweep() when no copy has
// used it for the idle timeout (its writer may have unregistered and freed it: the mapping
// must not keep that memory alive for long) or when its writer's process has died. Used by one
// thread (the worker).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <tuple>

#include "cuda/ipc.h"
#include "fabric/address.h"
#include "fabric/status.h"

namespace fabric::engine {

class IpcImports {
 public:
  using Clock = std::chrono::steady_clock;

  // What maps and unmaps exports. The engine's maps with CUDA (or the GPU-memory double);
  // unit tests use a test double that counts the calls.
  class Mapper {
   public:
    virtual ~Mapper() = default;
    virtual Result<std::byte*> open(const cuda::IpcExport& e, const cuda::PointerInfo& into,
                                    const Origin& writer) = 0;
    virtual void close(const cuda::IpcExport& e, const Origin& writer) = 0;
  };
  static std::unique_ptr<Mapper> cuda_mapper();

  struct Mapping {
    std::byte* base = nullptr;  // the exported allocation's first byte, in this process
    cuda::IpcExport exported;
    Origin writer;
    Clock::time_point last_use;
  };
  // Holds a mapping open while a copy reads from it.
  using Lease = std::shared_ptr<const Mapping>;

  IpcImports(std::unique_ptr<Mapper> mapper, std::chrono::milliseconds idle_timeout,
             size_t max_mappings);
  ~IpcImports();  // unmaps everything (after the copies that used it were drained)
  IpcImports(const IpcImports&) = delete;
  IpcImports& operator=(const IpcImports&) = delete;

  // The mapping of `e` exported by `writer`, opened on first use. Past max_mappings, the least
  // recently used mapping without a lease is dropped first. Errors: the mapper's.
  Result<Lease> map(const Origin& writer, const cuda::IpcExport& e, const cuda::PointerInfo& into,
                    Clock::time_point now);
  // Drops mappings without a lease that are idle past the timeout, or whose writer is not
  // alive (`alive` decides; the engine asks Origin::process_alive()). Returns how many.
  size_t sweep(Clock::time_point now, const std::function<bool(const Origin&)>& alive);

  size_t size() const { return mappings_.size(); }
  uint64_t opened() const { return opened_; }  // mappings ever opened

 private:
  using Key = std::tuple<uint32_t, uint64_t, uint64_t, Bytes>;  // pid, start, pidns, handle
  static Key key_of(const Origin& writer, const cuda::IpcExport& e);
  void drop(std::map<Key, std::shared_ptr<Mapping>>::iterator it);

  std::unique_ptr<Mapper> mapper_;
  const std::chrono::milliseconds idle_timeout_;
  const size_t max_mappings_;
  std::map<Key, std::shared_ptr<Mapping>> mappings_;
  uint64_t opened_ = 0;
};

}  // namespace fabric::engine
