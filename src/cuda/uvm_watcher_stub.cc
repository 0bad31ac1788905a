// UvmWatchers in a build without CUDA: creation reports that CUDA is absent.
#include "fabric/uvm_watcher.h"

namespace fabric {

class UvmWatchers::Impl {};

Result<std::unique_ptr<UvmWatchers>> UvmWatchers::create(const WatcherOptions&) {
  return Status(ErrorCode::kUnsupported,
                "fabric-lib was built without CUDA (FABRIC_WITH_CUDA=OFF): no UvmWatcher");
}

UvmWatchers::UvmWatchers(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
UvmWatchers::~UvmWatchers() = default;
Result<Watcher> UvmWatchers::watch(Callback, uint64_t) {
  return Status(ErrorCode::kUnsupported, "built without CUDA");
}
Status UvmWatchers::unwatch(const Watcher&) {
  return Status(ErrorCode::kUnsupported, "built without CUDA");
}
uint32_t UvmWatchers::live() const {
  return 0;
}
Status UvmWatchers::bump(const Watcher&, uint64_t, void*) {
  return Status(ErrorCode::kUnsupported, "built without CUDA");
}

}  // namespace fabric
