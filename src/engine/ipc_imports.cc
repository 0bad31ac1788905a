// IpcImports: the cache of peers' CUDA IPC exports mapped into this process.
#include "engine/ipc_imports.h"

#include "common/log.h"

namespace fabric::engine {

namespace {

class CudaMapper final : public IpcImports::Mapper {
 public:
  Result<std::byte*> open(const cuda::IpcExport& e, const cuda::PointerInfo& into,
                          const Origin& writer) override {
    return cuda::ipc_open(e, into, writer);
  }
  void close(const cuda::IpcExport& e, const Origin& writer) override {
    cuda::ipc_close(e, writer);
  }
};

}  // namespace

std::unique_ptr<IpcImports::Mapper> IpcImports::cuda_mapper() {
  return std::make_unique<CudaMapper>();
}

IpcImports::IpcImports(std::unique_ptr<Mapper> mapper, std::chrono::milliseconds idle_timeout,
                       size_t max_mappings)
    : mapper_(std::move(mapper)), idle_timeout_(idle_timeout), max_mappings_(max_mappings) {}

IpcImports::~IpcImports() {
  for (auto& [key, m] : mappings_) mapper_->close(m->exported, m->writer);
}

IpcImports::Key IpcImports::key_of(const Origin& writer, const cuda::IpcExport& e) {
  return {writer.pid, writer.start_time, writer.pidns, e.handle};
}

void IpcImports::drop(std::map<Key, std::shared_ptr<Mapping>>::iterator it) {
  mapper_->close(it->second->exported, it->second->writer);
  mappings_.erase(it);
}

Result<IpcImports::Lease> IpcImports::map(const Origin& writer, const cuda::IpcExport& e,
                                          const cuda::PointerInfo& into, Clock::time_point now) {
  const Key key = key_of(writer, e);
  if (auto it = mappings_.find(key); it != mappings_.end()) {
    it->second->last_use = now;
    return Lease(it->second);
  }
  // Room first: the least recently used mapping that no copy holds.
  while (mappings_.size() >= max_mappings_) {
    auto victim = mappings_.end();
    for (auto it = mappings_.begin(); it != mappings_.end(); ++it) {
      if (it->second.use_count() > 1) continue;
      if (victim == mappings_.end() || it->second->last_use < victim->second->last_use) {
        victim = it;
      }
    }
    if (victim == mappings_.end()) break;  // every mapping is in use: exceed the bound
    drop(victim);
  }
  auto base = mapper_->open(e, into, writer);
  if (!base) return base.status();
  ++opened_;
  auto m = std::make_shared<Mapping>(Mapping{*base, e, writer, now});
  mappings_.emplace(key, m);
  return Lease(std::move(m));
}

size_t IpcImports::sweep(Clock::time_point now, const std::function<bool(const Origin&)>& alive) {
  size_t dropped = 0;
  for (auto it = mappings_.begin(); it != mappings_.end();) {
    auto next = std::next(it);
    const Mapping& m = *it->second;
    if (it->second.use_count() == 1 && (now - m.last_use >= idle_timeout_ || !alive(m.writer))) {
      drop(it);
      ++dropped;
    }
    it = next;
  }
  if (dropped > 0) {
    detail::log().debug("CUDA IPC: unmapped {} idle or orphaned peer allocation(s)", dropped);
  }
  return dropped;
}

}  // namespace fabric::engine
