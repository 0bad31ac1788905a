// Engine addresses and remote memory descriptors: plain, versioned bytes that any side channel
// (a pipe, a socket, etcd, torch.distributed) can carry between processes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fabric/status.h"

namespace fabric {

using Bytes = std::vector<std::byte>;

// Lower-case hex of bytes, and back. from_hex rejects odd lengths and non-hex characters.
std::string to_hex(std::span<const std::byte> bytes);
Result<Bytes> from_hex(std::string_view hex);

// One NIC of a device group, as its peers see it.
struct NicAddress {
  Bytes name;             // the endpoint's fabric address (fi_getname)
  uint64_t scratch_addr;  // target of zero-byte writes (imm-only, barrier) on this NIC
  uint64_t scratch_key;
  friend bool operator==(const NicAddress&, const NicAddress&) = default;
};

// The address of one device group of an engine: one entry per NIC, in rail order.
// Cheap to copy (the entries are shared) and comparable.
class Address {
 public:
  static constexpr uint8_t kVersion = 1;

  Address() = default;
  Address(std::string provider, std::vector<NicAddress> nics);

  // Decodes bytes made by encode(); names what is wrong on failure (magic, version, length).
  static Result<Address> decode(std::span<const std::byte> bytes);
  static Result<Address> from_hex(std::string_view hex);

  Bytes encode() const;
  std::string to_hex() const;

  bool empty() const { return nics().empty(); }
  const std::string& provider() const;
  const std::vector<NicAddress>& nics() const;
  size_t num_nics() const { return nics().size(); }
  // A short human-readable form for logs: "tcp;ofi_rxm/2nic/3f9a1c2e" (provider, NIC count,
  // a hash of the encoding).
  std::string short_name() const;

  friend bool operator==(const Address& a, const Address& b);

 private:
  struct Data;
  std::shared_ptr<const Data> data_;
};

// Local registration handle: names one registration of one engine. Handles are never reused,
// so a handle kept after unregister_memory() is reported as unknown, not confused with a newer
// registration of the same pointer.
struct MemoryHandle {
  uint64_t id = 0;
  friend bool operator==(const MemoryHandle&, const MemoryHandle&) = default;
};

// What a peer needs to write into a registered region: the owner's group address and one
// (address, key) per NIC, rail-aligned with the address's NICs. Cheap to copy.
class RemoteMemory {
 public:
  // Version 2 added staged_region(); version 1 descriptors still decode (not staged).
  static constexpr uint8_t kVersion = 2;

  struct Rail {
    uint64_t addr;  // the fabric address of byte 0 of the region on this NIC
    uint64_t key;
    friend bool operator==(const Rail&, const Rail&) = default;
  };

  RemoteMemory() = default;
  RemoteMemory(Address owner, uint64_t base, uint64_t length, std::vector<Rail> rails,
               uint64_t staged_region = 0);

  static Result<RemoteMemory> decode(std::span<const std::byte> bytes);
  static Result<RemoteMemory> from_hex(std::string_view hex);
  Bytes encode() const;
  std::string to_hex() const;

  bool empty() const { return data_ == nullptr; }
  const Address& owner() const;
  uint64_t base() const;  // the owner's virtual address of the region (informational)
  uint64_t length() const;
  const std::vector<Rail>& rails() const;
  // Non-zero when the region is GPU memory that the owner's NICs cannot reach: the rails then
  // name a pinned host mirror, and a writer asks the owner (by this id) to copy what it wrote
  // into the GPU before the write's immediate is counted (the staged path).
  uint64_t staged_region() const;

  friend bool operator==(const RemoteMemory& a, const RemoteMemory& b);

 private:
  struct Data;
  std::shared_ptr<const Data> data_;
};

}  // namespace fabric
