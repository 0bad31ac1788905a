// Engine addresses and remote memory descriptors: plain, versioned bytes that any side channel
// (a pipe, a socket, etcd, torch.distributed) can carry between processes.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
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

// Where an engine runs. Two engines use it to tell whether they share a host (same boot, same
// network namespace), a process, or a process table (same PID namespace), and a same-host peer
// uses it to check that the process that published an address is still alive (a PID alone may
// be reused; PID and start time together are not).
struct Origin {
  std::array<std::byte, 16> boot_id{};  // /proc/sys/kernel/random/boot_id
  uint64_t netns = 0;                   // inode of /proc/self/ns/net
  uint64_t pidns = 0;                   // inode of /proc/self/ns/pid
  uint32_t pid = 0;
  uint64_t start_time = 0;  // the process's start, in clock ticks after boot (/proc/PID/stat)
  uint64_t instance = 0;    // random, one per engine device group

  // This process, with the given instance id. Fields the system does not show stay zero.
  static Origin of_this_process(uint64_t instance);
  // Known: made by of_this_process (an address of wire version 1 has no origin).
  bool known() const { return pid != 0; }
  bool same_host(const Origin& o) const;     // both known, same boot and network namespace
  bool same_process(const Origin& o) const;  // same host and PID namespace, same PID and start
  // Whether the process is still running (not exited, not a zombie, its PID not reused). Only
  // meaningful for an origin that shares this process's host and PID namespace; true when that
  // cannot be told.
  bool process_alive() const;
  // Field by field, the random instance first and the boot id as one block (a defaulted
  // comparison compares its 16 bytes one by one: a tenth of a scatter's instructions).
  friend bool operator==(const Origin& a, const Origin& b) {
    return a.instance == b.instance && a.pid == b.pid && a.start_time == b.start_time &&
           a.netns == b.netns && a.pidns == b.pidns &&
           std::memcmp(a.boot_id.data(), b.boot_id.data(), a.boot_id.size()) == 0;
  }
};

// The address of one device group of an engine: one entry per NIC, in rail order, and where the
// engine runs. Cheap to copy (the entries are shared) and comparable.
class Address {
 public:
  // Version 2 added origin(); version 1 addresses still decode (origin unknown).
  static constexpr uint8_t kVersion = 2;

  Address() = default;
  Address(std::string provider, std::vector<NicAddress> nics, Origin origin = {});

  // Decodes bytes made by encode(); names what is wrong on failure (magic, version, length).
  static Result<Address> decode(std::span<const std::byte> bytes);
  static Result<Address> from_hex(std::string_view hex);

  Bytes encode() const;
  std::string to_hex() const;

  bool empty() const { return nics().empty(); }
  // Inline: the submission path reads these for every target of a scatter.
  const std::string& provider() const { return data().provider; }
  const std::vector<NicAddress>& nics() const { return data().nics; }
  size_t num_nics() const { return nics().size(); }
  const Origin& origin() const { return data().origin; }
  // A short human-readable form for logs: "tcp;ofi_rxm/2nic/3f9a1c2e" (provider, NIC count,
  // a hash of the encoding).
  std::string short_name() const;

  friend bool operator==(const Address& a, const Address& b);

 private:
  struct Data {
    std::string provider;
    std::vector<NicAddress> nics;
    Origin origin;
  };
  static const Data& no_data();  // what a default Address reads
  const Data& data() const { return data_ ? *data_ : no_data(); }
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
// (address, key) per NIC, rail-aligned with the address's NICs (none for ipc_only()). Cheap to
// copy.
class RemoteMemory {
 public:
  // Version 2 added staged_region(), version 3 cuda_ipc(), version 4 descriptors without rails
  // (ipc_only()), version 5 the section of host memory (CudaIpc::host), version 6 a flags byte
  // (readable()); older versions still decode (not staged, no CUDA IPC section, rails, not
  // readable). A descriptor is encoded in the oldest version that holds it (2 without a CUDA
  // IPC section, 3 with rails, 4 without, 5 for host memory, 6 when readable), so that engines
  // built before keep reading it.
  static constexpr uint8_t kVersion = 6;

  // The CUDA IPC section: the region is CUDA memory whose owner accepts writes from same-host
  // peers over CUDA IPC (docs/cuda-ipc.md). The writer names the region by `region`; the owner
  // maps the writer's exported source and copies GPU to GPU. With `host`, the region is host
  // memory registered with RegisterOptions::gpu_copies: the owner copies a same-host writer's
  // GPU memory into it with the copy engines of GPU `device`.
  struct CudaIpc {
    std::array<std::byte, 16> device{};  // the owner's GPU (its UUID)
    uint64_t region = 0;                 // the owner's registration id (non-zero)
    bool host = false;                   // host memory the GPU's copy engines fill
    friend bool operator==(const CudaIpc&, const CudaIpc&) = default;
  };

  struct Rail {
    uint64_t addr;  // the fabric address of byte 0 of the region on this NIC
    uint64_t key;
    friend bool operator==(const Rail&, const Rail&) = default;
  };

  RemoteMemory() = default;
  RemoteMemory(Address owner, uint64_t base, uint64_t length, std::vector<Rail> rails,
               uint64_t staged_region = 0, std::optional<CudaIpc> cuda_ipc = std::nullopt,
               bool readable = false);

  static Result<RemoteMemory> decode(std::span<const std::byte> bytes);
  static Result<RemoteMemory> from_hex(std::string_view hex);
  Bytes encode() const;
  std::string to_hex() const;

  bool empty() const { return data_ == nullptr; }
  const Address& owner() const { return data().owner; }
  uint64_t base() const { return data().base; }  // the owner's virtual address (informational)
  uint64_t length() const { return data().length; }
  const std::vector<Rail>& rails() const { return data().rails; }
  // Non-zero when the region is GPU memory that the owner's NICs cannot reach: the rails then
  // name a pinned host mirror, and a writer asks the owner (by this id) to copy what it wrote
  // into the GPU before the write's immediate is counted (the staged path).
  uint64_t staged_region() const { return data().staged_region; }
  // Present when a same-host peer may write into the region over CUDA IPC.
  const std::optional<CudaIpc>& cuda_ipc() const { return data().cuda_ipc; }
  // GPU memory registered without a host mirror (RegisterOptions::host_mirror false) on a group
  // that would have staged it: no rails, and only the CUDA IPC path reaches it.
  bool ipc_only() const { return data().rails.empty() && data().cuda_ipc.has_value(); }
  // Its owner registered it readable (RegisterOptions::remote_read): peers may read it. A read
  // of a descriptor without it fails at the reader; the owner's fabric or transport refuses one
  // whose descriptor says so falsely.
  bool readable() const { return data().readable; }
  // One rail per NIC of the owner, or none for ipc_only(): what a writer's plan needs (decode
  // checks it; a descriptor made by hand may not hold it).
  bool rails_fit_owner() const { return data().rails.size() == owner().num_nics() || ipc_only(); }

  friend bool operator==(const RemoteMemory& a, const RemoteMemory& b);

 private:
  struct Data {
    Address owner;
    uint64_t base = 0;
    uint64_t length = 0;
    std::vector<Rail> rails;
    uint64_t staged_region = 0;
    std::optional<CudaIpc> cuda_ipc;
    bool readable = false;
  };
  static const Data& no_data();  // what an empty descriptor reads
  const Data& data() const { return data_ ? *data_ : no_data(); }
  std::shared_ptr<const Data> data_;
};

}  // namespace fabric
