// Device memory as the engine sees it: telling GPU buffers from host buffers, pinned host
// staging memory, and stream-ordered copies between the two, polled from the worker loop.
//
// Two kinds of device memory exist: CUDA memory (cudaMalloc, cuMemCreate/cuMemMap, torch CUDA
// tensors), and the test double of fabric/testing.h (FakeDeviceBuffer), which stands in for a
// GPU on machines without one. Both go through the same Copier interface, so the staged path
// of the engine is exercised in CI by the double and on GPU machines by CUDA.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "fabric/status.h"

namespace fabric::cuda {

enum class MemoryKind : uint8_t { kHost, kCuda, kFake };

struct PointerInfo {
  MemoryKind kind = MemoryKind::kHost;
  int device = -1;  // CUDA ordinal (kCuda)
};

// What [ptr, ptr + length) is. Host memory, managed memory and pinned host memory are kHost
// (the CPU and the NIC can reach them directly). Fails when the range starts in device memory
// and does not fit in its allocation.
Result<PointerInfo> classify(const void* ptr, uint64_t length);

// Whether CUDA device memory can exist in this process (built with CUDA and a device present).
bool cuda_available();

// Host memory that a GPU's copy engines fill over the CUDA IPC path (RegisterOptions::gpu_copies,
// docs/cuda-ipc.md): page-locks [ptr, ptr + length) and returns the device that copies into it,
// the calling thread's current CUDA device (the double's, while a testing::FakeCopyEngines
// lives in a process without CUDA). Errors: kUnsupported (no CUDA device in this process, or one
// whose kernels cannot use the host address of registered memory), CUDA's refusal of the range.
Result<PointerInfo> pin_for_copies(void* ptr, uint64_t length);
// Undoes pin_for_copies (nothing to undo for the double).
void unpin_for_copies(const PointerInfo& device, void* ptr);

// Pinned host memory (page-locked, so DMA engines can copy to and from it at full speed):
// cudaHostAlloc for CUDA devices, plain aligned memory for the test double.
class HostBuffer {
 public:
  static Result<std::unique_ptr<HostBuffer>> allocate(const PointerInfo& for_device,
                                                      uint64_t bytes);
  ~HostBuffer();
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  HostBuffer(std::byte* data, uint64_t size, bool cuda) : data_(data), size_(size), cuda_(cuda) {}
  std::byte* data_;
  uint64_t size_;
  bool cuda_;
};

// Stream-ordered copies between device memory and pinned host memory for one device, used by
// one thread (a worker). copy() enqueues; fence(token) marks every copy enqueued since the
// previous fence; poll() reports the fences that have completed, in order, with the first
// error of their copies.
class Copier {
 public:
  struct Done {
    uint64_t token;
    Status status;
  };
  enum class Direction : uint8_t { kToHost, kToDevice };

  static Result<std::unique_ptr<Copier>> create(const PointerInfo& device);
  virtual ~Copier() = default;

  // `device_ptr` is the device side, `host_ptr` the pinned host side.
  virtual Status copy(void* device_ptr, std::byte* host_ptr, uint64_t bytes, Direction dir) = 0;
  // Device to device (the CUDA IPC path): both addresses are device memory mapped in this
  // process, `src` possibly a peer process's memory mapped by ipc_open (cuda/ipc.h).
  virtual Status copy_device(std::byte* dst, const std::byte* src, uint64_t bytes) = 0;
  // Several device-to-device copies at once. The CUDA copier does small ones (a paged write's
  // pages) in one kernel launch per up to 1024; by default, one copy_device each.
  struct DeviceCopy {
    std::byte* dst;
    const std::byte* src;
    uint64_t bytes;
  };
  virtual Status copy_device_batch(std::span<const DeviceCopy> copies) {
    for (const DeviceCopy& c : copies) {
      if (Status s = copy_device(c.dst, c.src, c.bytes); !s) return s;
    }
    return Status::ok();
  }
  virtual Status fence(uint64_t token) = 0;
  // Appends completed fences to `done`; returns how many it appended.
  virtual size_t poll(std::vector<Done>& done) = 0;
  // Fences enqueued and not yet reported by poll().
  virtual size_t outstanding() const = 0;
  // Waits for every enqueued copy and forgets the outstanding fences (engine close).
  virtual void drain() = 0;
};

// Makes the copier of a device: Copier::create, or a test double in the engine's unit tests.
using CopierFactory = std::function<Result<std::unique_ptr<Copier>>(const PointerInfo&)>;

// The CUDA implementation (cuda_memory.cc, or a stub without CUDA).
Result<PointerInfo> classify_cuda(const void* ptr, uint64_t length);
Result<std::byte*> cuda_host_alloc(uint64_t bytes);
Result<PointerInfo> cuda_pin_for_copies(void* ptr, uint64_t length);
void cuda_unpin_for_copies(void* ptr);
bool fake_copy_engines();  // a testing::FakeCopyEngines is alive
void cuda_host_free(std::byte* p);
Result<std::unique_ptr<Copier>> make_cuda_copier(int device);
// Device memory on the current CUDA device (the direct path's probe).
Result<void*> cuda_device_alloc(uint64_t bytes);
void cuda_device_free(void* p);

// The test double (fake_device.cc).
bool fake_lookup(const void* ptr, uint64_t length, bool& fits);
Result<std::unique_ptr<Copier>> make_fake_copier();

}  // namespace fabric::cuda
