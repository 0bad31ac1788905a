// Test doubles that ship with the library, for what cannot run on every machine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "fabric/status.h"

namespace fabric::testing {

// TEST DOUBLE for GPU memory, for machines without a GPU. A FakeDeviceBuffer is memory that
// neither the CPU nor a NIC may touch at its own address (device_ptr() is mapped PROT_NONE:
// any direct access faults), exactly like GPU memory on a fabric without GPUDirect. The engine
// recognises it as device memory in register_memory() and moves it only through its staged
// path (pinned host bounce memory and asynchronous copies), the same code that serves CUDA
// memory on tcp and shm. Tests fill and check the contents through contents(), a second
// mapping of the same pages.
class FakeDeviceBuffer {
 public:
  // Errors: kInvalidArgument (zero bytes), kInternal (memfd or mmap refused).
  static Result<std::unique_ptr<FakeDeviceBuffer>> create(uint64_t bytes);
  ~FakeDeviceBuffer();
  FakeDeviceBuffer(const FakeDeviceBuffer&) = delete;
  FakeDeviceBuffer& operator=(const FakeDeviceBuffer&) = delete;

  // The "device" address to register and to name in transfers. Never dereference it.
  void* device_ptr() const { return device_; }
  uint64_t size() const { return size_; }
  // The same bytes, readable and writable by the test.
  std::span<std::byte> contents() const { return {backing_, size_}; }

 private:
  FakeDeviceBuffer(std::byte* device, std::byte* backing, uint64_t size)
      : device_(device), backing_(backing), size_(size) {}
  std::byte* device_;
  std::byte* backing_;
  uint64_t size_;
};

// TEST DOUBLE for a GPU's copy engines filling host memory (RegisterOptions::gpu_copies), for
// processes without a GPU. While one is alive, host memory registered with gpu_copies in a
// process without a CUDA device is accepted as if this process's GPU were the double's: its
// descriptor names the double's GPU, and writes from FakeDeviceBuffer memory of a same-host
// peer are copied into it by the double's copier (memcpy, once the copies' fence completes)
// instead of travelling over the fabric. Nothing is page-locked.
class FakeCopyEngines {
 public:
  FakeCopyEngines();
  ~FakeCopyEngines();
  FakeCopyEngines(const FakeCopyEngines&) = delete;
  FakeCopyEngines& operator=(const FakeCopyEngines&) = delete;
};

}  // namespace fabric::testing
