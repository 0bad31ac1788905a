// CUDA side of device memory: pointer classification, pinned host memory, and a copier with
// its own stream and events.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>

#include "cuda/copy_kernels.h"
#include "cuda/cuda_status.h"
#include "cuda/device_memory.h"

namespace fabric::cuda {

namespace {

// Whether a CUDA driver and device exist; asked once (the first call initializes the runtime).
bool probe_cuda() {
  static const bool present = [] {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return count > 0;
  }();
  return present;
}

Result<PointerInfo> attributes(const void* ptr) {
  cudaPointerAttributes attr{};
  cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    cudaGetLastError();  // an unknown pointer is host memory; clear the sticky error
    return PointerInfo{};
  }
  if (attr.type == cudaMemoryTypeDevice) return PointerInfo{MemoryKind::kCuda, attr.device};
  return PointerInfo{};  // host, pinned host, managed or unregistered: the CPU can reach it
}

class CudaCopier final : public Copier {
 public:
  explicit CudaCopier(int device) : device_(device) {}
  ~CudaCopier() override {
    drain();
    if (cudaSetDevice(device_) == cudaSuccess) {
      for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
      if (stream_ != nullptr) cudaStreamDestroy(stream_);
    }
  }

  Status init() {
    if (cudaError_t err = cudaSetDevice(device_); err != cudaSuccess) {
      return cuda_error("cudaSetDevice", err);
    }
    if (cudaError_t err = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
        err != cudaSuccess) {
      return cuda_error("cudaStreamCreateWithFlags", err);
    }
    return Status::ok();
  }

  Status copy(void* device_ptr, std::byte* host_ptr, uint64_t bytes, Direction dir) override {
    if (cudaError_t err = cudaSetDevice(device_); err != cudaSuccess) {
      return cuda_error("cudaSetDevice", err);
    }
    cudaError_t err =
        dir == Direction::kToHost
            ? cudaMemcpyAsync(host_ptr, device_ptr, bytes, cudaMemcpyDeviceToHost, stream_)
            : cudaMemcpyAsync(device_ptr, host_ptr, bytes, cudaMemcpyHostToDevice, stream_);
    if (err != cudaSuccess) return cuda_error("cudaMemcpyAsync", err);
    return Status::ok();
  }

  Status copy_device(std::byte* dst, const std::byte* src, uint64_t bytes) override {
    if (cudaError_t err = cudaSetDevice(device_); err != cudaSuccess) {
      return cuda_error("cudaSetDevice", err);
    }
    // Default: the destination may be host memory registered for GPU copies.
    if (cudaError_t err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_);
        err != cudaSuccess) {
      return cuda_error("cudaMemcpyAsync (from device memory)", err);
    }
    return Status::ok();
  }

  Status copy_device_batch(std::span<const DeviceCopy> copies) override {
    // Ranges up to this size go into the batch kernel, even one alone (a launch starts sooner
    // than a copy engine's copy); larger ones to the copy engines.
    static const uint64_t kernel_max_bytes = [] {
      const char* v = std::getenv("FABRIC_CUDA_IPC_KERNEL_BYTES");
      return v && *v ? std::strtoull(v, nullptr, 10) : uint64_t{256} * 1024;
    }();
    if (cudaError_t err = cudaSetDevice(device_); err != cudaSuccess) {
      return cuda_error("cudaSetDevice", err);
    }
    std::vector<CopyRange> batch;
    batch.reserve(std::min<size_t>(copies.size(), kMaxBatchRanges));
    auto flush = [&]() -> Status {
      if (batch.empty()) return Status::ok();
      cudaError_t err =
          launch_batch_copy(batch.data(), static_cast<uint32_t>(batch.size()), stream_);
      batch.clear();
      return err == cudaSuccess ? Status::ok() : cuda_error("the batch copy kernel", err);
    };
    for (const DeviceCopy& c : copies) {
      if (c.bytes > kernel_max_bytes) {
        if (Status s = copy_device(c.dst, c.src, c.bytes); !s) return s;
        continue;
      }
      batch.push_back({c.dst, c.src, c.bytes});
      if (batch.size() == kMaxBatchRanges) {
        if (Status s = flush(); !s) return s;
      }
    }
    return flush();
  }

  Status fence(uint64_t token) override {
    cudaEvent_t e = nullptr;
    if (!free_events_.empty()) {
      e = free_events_.back();
      free_events_.pop_back();
    } else if (cudaError_t err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
               err != cudaSuccess) {
      return cuda_error("cudaEventCreateWithFlags", err);
    }
    if (cudaError_t err = cudaEventRecord(e, stream_); err != cudaSuccess) {
      free_events_.push_back(e);
      return cuda_error("cudaEventRecord", err);
    }
    fences_.push_back({token, e});
    return Status::ok();
  }

  size_t poll(std::vector<Done>& done) override {
    size_t n = 0;
    while (!fences_.empty()) {
      cudaError_t err = cudaEventQuery(fences_.front().event);
      if (err == cudaErrorNotReady) break;
      done.push_back({fences_.front().token,
                      err == cudaSuccess ? Status::ok() : cuda_error("a staged copy", err)});
      free_events_.push_back(fences_.front().event);
      fences_.pop_front();
      ++n;
    }
    return n;
  }

  size_t outstanding() const override { return fences_.size(); }

  void drain() override {
    if (stream_ != nullptr && cudaSetDevice(device_) == cudaSuccess) {
      cudaStreamSynchronize(stream_);
    }
    for (auto& f : fences_) free_events_.push_back(f.event);
    fences_.clear();
  }

 private:
  struct Fence {
    uint64_t token;
    cudaEvent_t event;
  };
  const int device_;
  cudaStream_t stream_ = nullptr;
  std::deque<Fence> fences_;
  std::vector<cudaEvent_t> free_events_;
};

}  // namespace

bool cuda_available() {
  return probe_cuda();
}

Result<PointerInfo> classify_cuda(const void* ptr, uint64_t length) {
  if (!probe_cuda()) return PointerInfo{};
  auto first = attributes(ptr);
  if (!first || first->kind == MemoryKind::kHost) return first;
  auto last = attributes(static_cast<const std::byte*>(ptr) + length - 1);
  if (!last || last->kind != MemoryKind::kCuda || last->device != first->device) {
    return Status(ErrorCode::kOutOfRange,
                  fmt::format("{} bytes at {} start in memory of CUDA device {} but do not end "
                              "there",
                              length, ptr, first->device));
  }
  return first;
}

Result<std::byte*> cuda_host_alloc(uint64_t bytes) {
  void* p = nullptr;
  if (cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocPortable); err != cudaSuccess) {
    return cuda_error(fmt::format("cudaHostAlloc of {} bytes", bytes), err);
  }
  return static_cast<std::byte*>(p);
}

void cuda_host_free(std::byte* p) {
  cudaFreeHost(p);
}

namespace {

// Host ranges this process page-locked for gpu_copies registrations, by first byte.
struct Pin {
  uint64_t length;
  uint32_t users;
};
std::mutex& pins_mu() {
  static std::mutex mu;
  return mu;
}
std::map<uintptr_t, Pin>& pins_by_start() {
  static std::map<uintptr_t, Pin> pins;
  return pins;
}

}  // namespace

Result<PointerInfo> cuda_pin_for_copies(void* ptr, uint64_t length) {
  if (!probe_cuda()) {
    return Status(ErrorCode::kUnsupported, "no CUDA device in this process");
  }
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) {
    return cuda_error("cudaGetDevice", err);
  }
  // The owner's copy kernels store small ranges through the host address itself.
  int host_pointers = 0;
  if (cudaError_t err = cudaDeviceGetAttribute(
          &host_pointers, cudaDevAttrCanUseHostPointerForRegisteredMem, device);
      err != cudaSuccess) {
    return cuda_error("cudaDeviceGetAttribute", err);
  }
  if (host_pointers == 0) {
    return Status(ErrorCode::kUnsupported,
                  fmt::format("CUDA device {} cannot use the host address of registered memory "
                              "in kernels",
                              device));
  }
  // The same range registered again shares the first page-lock (counted); a range that
  // overlaps another one this process locked is refused (CUDA would refuse it, and unlocking
  // one would unlock part of the other); memory CUDA already holds page-locked (cudaHostAlloc,
  // torch's pin_memory, someone else's cudaHostRegister) is used as it is and never unlocked
  // here: whoever locked it must keep it locked while it is registered.
  const auto start = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard lock(pins_mu());
  auto& pins = pins_by_start();
  if (auto it = pins.find(start); it != pins.end() && it->second.length == length) {
    ++it->second.users;
    return PointerInfo{MemoryKind::kCuda, device};
  }
  for (const auto& [s, pin] : pins) {
    if (s < start + length && start < s + pin.length) {
      return Status(ErrorCode::kInvalidArgument,
                    fmt::format("{} bytes at {} overlap {} bytes at {:#x} that another "
                                "gpu_copies registration page-locked: register the same range, "
                                "or ranges apart",
                                length, ptr, pin.length, s));
    }
  }
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, ptr) == cudaSuccess && attr.type == cudaMemoryTypeHost) {
    return PointerInfo{MemoryKind::kCuda, device};  // page-locked already, not by us
  }
  cudaGetLastError();
  if (cudaError_t err =
          cudaHostRegister(ptr, length, cudaHostRegisterPortable | cudaHostRegisterMapped);
      err != cudaSuccess) {
    return cuda_error(fmt::format("cudaHostRegister of {} bytes at {}", length, ptr), err);
  }
  pins.emplace(start, Pin{length, 1});
  return PointerInfo{MemoryKind::kCuda, device};
}

void cuda_unpin_for_copies(void* ptr) {
  std::lock_guard lock(pins_mu());
  auto& pins = pins_by_start();
  auto it = pins.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == pins.end() || --it->second.users > 0) return;  // not ours, or still used
  pins.erase(it);
  if (cudaError_t err = cudaHostUnregister(ptr); err != cudaSuccess) cudaGetLastError();
}

Result<void*> cuda_device_alloc(uint64_t bytes) {
  void* p = nullptr;
  if (cudaError_t err = cudaMalloc(&p, bytes); err != cudaSuccess) {
    return cuda_error("cudaMalloc", err);
  }
  return p;
}

void cuda_device_free(void* p) {
  cudaFree(p);
}

Result<std::unique_ptr<Copier>> make_cuda_copier(int device) {
  auto c = std::make_unique<CudaCopier>(device);
  if (Status s = c->init(); !s) return s;
  return std::unique_ptr<Copier>(std::move(c));
}

}  // namespace fabric::cuda
