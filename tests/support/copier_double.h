// TEST DOUBLE for cuda::Copier, for the unit tests of the worker's components that copy
// (StagedWriter, IpcCopies): it records what is enqueued, and a fence completes only once the
// test allows it (`ready`), the one at index `fail_fence` with an error. No GPU, no memory
// touched.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "cuda/device_memory.h"
#include "fabric/status.h"

namespace fabric::testing {

class ScriptedCopierDouble final : public cuda::Copier {
 public:
  Status copy(void*, std::byte*, uint64_t bytes, Direction) override {
    ++copies;
    bytes_copied += bytes;
    return Status::ok();
  }
  Status copy_device(std::byte* dst, const std::byte* src, uint64_t bytes) override {
    device_copies.push_back({dst, src, bytes});
    return Status::ok();
  }
  Status fence(uint64_t token) override {
    fenced.push_back(token);
    return Status::ok();
  }
  size_t poll(std::vector<Done>& done) override {
    size_t n = 0;
    for (; reported < fenced.size() && reported < ready; ++reported, ++n) {
      done.push_back({fenced[reported], reported == fail_fence
                                            ? Status(ErrorCode::kInternal, "the copy failed")
                                            : Status::ok()});
    }
    return n;
  }
  size_t outstanding() const override { return fenced.size() - reported; }
  void drain() override { reported = ready = fenced.size(); }

  cuda::PointerInfo device;
  size_t copies = 0;
  uint64_t bytes_copied = 0;
  std::vector<DeviceCopy> device_copies;
  std::vector<uint64_t> fenced;  // tokens, in order
  size_t ready = 0;              // fences poll() may report
  size_t reported = 0;
  size_t fail_fence = SIZE_MAX;
};

// Makes ScriptedCopierDoubles (owned by the component under test) and lists them, or refuses.
struct CopierDoubles {
  std::vector<ScriptedCopierDouble*> made;
  bool refuse = false;

  cuda::CopierFactory factory() {
    return [this](const cuda::PointerInfo& device) -> Result<std::unique_ptr<cuda::Copier>> {
      if (refuse) return Status(ErrorCode::kUnsupported, "no copier for this device");
      auto c = std::make_unique<ScriptedCopierDouble>();
      c->device = device;
      made.push_back(c.get());
      return std::unique_ptr<cuda::Copier>(std::move(c));
    };
  }
};

}  // namespace fabric::testing
