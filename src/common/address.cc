// Wire formats of Address and RemoteMemory (little-endian, versioned, no trailing bytes):
//
//   Address:      u32 magic "FBLA" | u8 version | u8 len + provider | u8 nics (1..64)
//                 | per NIC: u16 len (1..1024) + name | u64 scratch addr | u64 scratch key
//                 | (version 2) 16 bytes boot id | u64 netns | u64 pidns | u32 pid
//                 | u64 start time | u64 instance
//   RemoteMemory: u32 magic "FBLM" | u8 version | u64 base | u64 length
//                 | u32 len + Address | u8 rails (= the address's NICs; from version 4 also 0
//                 when the descriptor has a CUDA IPC section) | per rail: u64 addr, u64 key
//                 | (version 2) u64 staged region | (version 3) u8 has CUDA IPC (0 or 1;
//                 from version 5 also 2: host memory the owner's GPU copies into)
//                 | (when 1 or 2) 16 bytes GPU UUID | u64 IPC region (non-zero)
//                 | (version 6) u8 flags: bit 0 readable, the others 0
#include "fabric/address.h"

#include <cstring>

#include <fmt/format.h>

#include <algorithm>
#include <tuple>

#include "common/codec.h"

namespace fabric {
namespace {

constexpr uint32_t kAddressMagic = 0x414C4246;  // "FBLA"
constexpr uint32_t kMemoryMagic = 0x4D4C4246;   // "FBLM"
constexpr size_t kMaxNics = 64;
constexpr size_t kMaxNameBytes = 1024;
constexpr uint8_t kReadable = 1;  // RemoteMemory flags (version 6)

Status malformed(std::string_view what, std::string_view detail) {
  return Status(ErrorCode::kInvalidArgument, fmt::format("malformed {}: {}", what, detail));
}

}  // namespace

std::string to_hex(std::span<const std::byte> bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (std::byte b : bytes) {
    auto v = static_cast<unsigned>(b);
    out.push_back(kDigits[v >> 4]);
    out.push_back(kDigits[v & 0xf]);
  }
  return out;
}

Result<Bytes> from_hex(std::string_view hex) {
  if (hex.size() % 2 != 0) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("hex string has an odd length ({} characters)", hex.size()));
  }
  auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  Bytes out(hex.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) {
    int hi = digit(hex[2 * i]);
    int lo = digit(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) {
      return Status(ErrorCode::kInvalidArgument,
                    fmt::format("hex string has a non-hex character at position {}",
                                hi < 0 ? 2 * i : 2 * i + 1));
    }
    out[i] = static_cast<std::byte>(hi << 4 | lo);
  }
  return out;
}

// --- Address --------------------------------------------------------------------------------

Address::Address(std::string provider, std::vector<NicAddress> nics, Origin origin)
    : data_(std::make_shared<const Data>(
          Data{std::move(provider), std::move(nics), std::move(origin)})) {}

const Address::Data& Address::no_data() {
  static const Data kEmpty;
  return kEmpty;
}

bool operator==(const Address& a, const Address& b) {
  if (a.data_ == b.data_) return true;
  if (!a.data_ || !b.data_) {  // a default address equals one made of empty parts
    return a.provider() == b.provider() && a.nics() == b.nics() && a.origin() == b.origin();
  }
  const Address::Data& x = *a.data_;
  const Address::Data& y = *b.data_;
  // The origin's random instance first: it tells different engines apart in one compare. The
  // NIC names by memcmp (std::byte vectors compare element by element otherwise).
  if (x.origin.instance != y.origin.instance || x.nics.size() != y.nics.size()) return false;
  for (size_t i = 0; i < x.nics.size(); ++i) {
    const NicAddress& p = x.nics[i];
    const NicAddress& q = y.nics[i];
    if (p.scratch_addr != q.scratch_addr || p.scratch_key != q.scratch_key ||
        p.name.size() != q.name.size() ||
        (!p.name.empty() && std::memcmp(p.name.data(), q.name.data(), p.name.size()) != 0)) {
      return false;
    }
  }
  return x.origin == y.origin && x.provider == y.provider;
}

Bytes Address::encode() const {
  detail::ByteWriter w;
  w.u32(kAddressMagic);
  w.u8(kVersion);
  w.u8(static_cast<uint8_t>(provider().size()));
  w.bytes(std::as_bytes(std::span(provider())));
  w.u8(static_cast<uint8_t>(nics().size()));
  for (const NicAddress& nic : nics()) {
    w.u16(static_cast<uint16_t>(nic.name.size()));
    w.bytes(nic.name);
    w.u64(nic.scratch_addr);
    w.u64(nic.scratch_key);
  }
  const Origin& o = origin();
  w.bytes(o.boot_id);
  w.u64(o.netns);
  w.u64(o.pidns);
  w.u32(o.pid);
  w.u64(o.start_time);
  w.u64(o.instance);
  return w.take();
}

std::string Address::to_hex() const {
  return fabric::to_hex(encode());
}

std::string Address::short_name() const {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the encoding
  for (std::byte b : encode()) h = (h ^ static_cast<uint64_t>(b)) * 1099511628211ull;
  return fmt::format("{}/{}nic/{:08x}", provider(), num_nics(), static_cast<uint32_t>(h));
}

Result<Address> Address::decode(std::span<const std::byte> bytes) {
  constexpr std::string_view kWhat = "engine address";
  detail::ByteReader r(bytes);
  uint32_t magic = 0;
  uint8_t version = 0;
  if (!r.u32(magic) || magic != kAddressMagic) return malformed(kWhat, "bad magic");
  if (!r.u8(version)) return malformed(kWhat, "truncated before version");
  if (version != 1 && version != kVersion) {
    return malformed(kWhat,
                     fmt::format("version {} (this build reads 1 to {})", version, kVersion));
  }
  uint8_t provider_len = 0;
  Bytes provider;
  if (!r.u8(provider_len) || !r.bytes(provider_len, provider)) {
    return malformed(kWhat, "truncated provider name");
  }
  // A provider name is what a user typed in Config ("tcp", "efa", "verbs", ...): printable
  // ASCII, so that it can be shown and compared without surprises anywhere (Python included).
  for (std::byte b : provider) {
    const auto c = static_cast<unsigned char>(b);
    if (c < 0x20 || c >= 0x7f) {
      return malformed(kWhat,
                       fmt::format("provider name has byte {:#04x} (not printable ASCII)", c));
    }
  }
  uint8_t count = 0;
  if (!r.u8(count)) return malformed(kWhat, "truncated before NIC count");
  if (count == 0 || count > kMaxNics) {
    return malformed(kWhat, fmt::format("{} NICs (must be 1..{})", count, kMaxNics));
  }
  std::vector<NicAddress> nics(count);
  for (size_t i = 0; i < count; ++i) {
    uint16_t len = 0;
    if (!r.u16(len)) return malformed(kWhat, fmt::format("truncated at NIC {}", i));
    if (len == 0 || len > kMaxNameBytes) {
      return malformed(
          kWhat, fmt::format("NIC {} name of {} bytes (must be 1..{})", i, len, kMaxNameBytes));
    }
    if (!r.bytes(len, nics[i].name) || !r.u64(nics[i].scratch_addr) ||
        !r.u64(nics[i].scratch_key)) {
      return malformed(kWhat, fmt::format("truncated at NIC {}", i));
    }
  }
  Origin origin;
  if (version >= 2) {
    Bytes boot;
    if (!r.bytes(origin.boot_id.size(), boot) || !r.u64(origin.netns) || !r.u64(origin.pidns) ||
        !r.u32(origin.pid) || !r.u64(origin.start_time) || !r.u64(origin.instance)) {
      return malformed(kWhat, "truncated origin");
    }
    std::copy(boot.begin(), boot.end(), origin.boot_id.begin());
  }
  if (r.remaining() != 0) {
    return malformed(kWhat, fmt::format("{} trailing bytes", r.remaining()));
  }
  std::string prov(reinterpret_cast<const char*>(provider.data()), provider.size());
  return Address(std::move(prov), std::move(nics), origin);
}

Result<Address> Address::from_hex(std::string_view hex) {
  auto bytes = fabric::from_hex(hex);
  if (!bytes) return bytes.status();
  return decode(*bytes);
}

// --- RemoteMemory ---------------------------------------------------------------------------

RemoteMemory::RemoteMemory(Address owner, uint64_t base, uint64_t length, std::vector<Rail> rails,
                           uint64_t staged_region, std::optional<CudaIpc> cuda_ipc, bool readable)
    : data_(std::make_shared<const Data>(Data{std::move(owner), base, length, std::move(rails),
                                              staged_region, cuda_ipc, readable})) {}

const RemoteMemory::Data& RemoteMemory::no_data() {
  static const Data kEmpty;
  return kEmpty;
}

bool operator==(const RemoteMemory& a, const RemoteMemory& b) {
  if (a.data_ == b.data_) return true;
  return a.owner() == b.owner() && a.base() == b.base() && a.length() == b.length() &&
         a.rails() == b.rails() && a.staged_region() == b.staged_region() &&
         a.cuda_ipc() == b.cuda_ipc() && a.readable() == b.readable();
}

Bytes RemoteMemory::encode() const {
  detail::ByteWriter w;
  w.u32(kMemoryMagic);
  const uint8_t version = readable()         ? 6
                          : !cuda_ipc()      ? 2
                          : cuda_ipc()->host ? 5
                          : ipc_only()       ? 4
                                             : 3;
  w.u8(version);
  w.u64(base());
  w.u64(length());
  Bytes addr = owner().encode();
  w.u32(static_cast<uint32_t>(addr.size()));
  w.bytes(addr);
  w.u8(static_cast<uint8_t>(rails().size()));
  for (const Rail& rail : rails()) {
    w.u64(rail.addr);
    w.u64(rail.key);
  }
  w.u64(staged_region());
  if (version >= 3) w.u8(!cuda_ipc() ? 0 : cuda_ipc()->host ? 2 : 1);
  if (cuda_ipc()) {
    w.bytes(cuda_ipc()->device);
    w.u64(cuda_ipc()->region);
  }
  if (version >= 6) w.u8(kReadable);
  return w.take();
}

Result<RemoteMemory> RemoteMemory::decode(std::span<const std::byte> bytes) {
  constexpr std::string_view kWhat = "memory descriptor";
  detail::ByteReader r(bytes);
  uint32_t magic = 0;
  uint8_t version = 0;
  if (!r.u32(magic) || magic != kMemoryMagic) return malformed(kWhat, "bad magic");
  if (!r.u8(version)) return malformed(kWhat, "truncated before version");
  if (version < 1 || version > kVersion) {
    return malformed(kWhat,
                     fmt::format("version {} (this build reads 1 to {})", version, kVersion));
  }
  uint64_t base = 0, length = 0;
  if (!r.u64(base) || !r.u64(length)) return malformed(kWhat, "truncated before length");
  if (base + length < base) return malformed(kWhat, "region wraps around the address space");
  uint32_t addr_len = 0;
  Bytes addr_bytes;
  if (!r.u32(addr_len) || !r.bytes(addr_len, addr_bytes)) {
    return malformed(kWhat, "truncated owner address");
  }
  auto owner = Address::decode(addr_bytes);
  if (!owner) return malformed(kWhat, owner.status().message());
  uint8_t count = 0;
  if (!r.u8(count)) return malformed(kWhat, "truncated before rail count");
  // Version 4: no rails at all for memory only CUDA IPC reaches (checked below).
  if (count != owner->num_nics() && !(count == 0 && version >= 4)) {
    return malformed(kWhat,
                     fmt::format("{} rails for an owner with {} NICs", count, owner->num_nics()));
  }
  std::vector<Rail> rails(count);
  for (size_t i = 0; i < count; ++i) {
    if (!r.u64(rails[i].addr) || !r.u64(rails[i].key)) {
      return malformed(kWhat, fmt::format("truncated at rail {}", i));
    }
  }
  uint64_t staged = 0;
  if (version >= 2 && !r.u64(staged)) return malformed(kWhat, "truncated before staged region");
  std::optional<CudaIpc> ipc;
  if (version >= 3) {
    uint8_t has_ipc = 0;
    if (!r.u8(has_ipc) || has_ipc > (version >= 5 ? 2 : 1)) {
      return malformed(kWhat, "bad CUDA IPC flag");
    }
    if (has_ipc != 0) {
      CudaIpc c;
      c.host = has_ipc == 2;
      Bytes uuid;
      if (!r.bytes(c.device.size(), uuid) || !r.u64(c.region)) {
        return malformed(kWhat, "truncated CUDA IPC section");
      }
      if (c.region == 0) return malformed(kWhat, "CUDA IPC section names region 0");
      std::copy(uuid.begin(), uuid.end(), c.device.begin());
      ipc = c;
    }
  }
  uint8_t flags = 0;
  if (version >= 6) {
    if (!r.u8(flags)) return malformed(kWhat, "truncated before flags");
    if ((flags & ~kReadable) != 0)
      return malformed(kWhat, fmt::format("unknown flags {:#04x}", flags));
  }
  if (r.remaining() != 0) {
    return malformed(kWhat, fmt::format("{} trailing bytes", r.remaining()));
  }
  if (count == 0 && !ipc) {
    return malformed(kWhat, "no rails and no CUDA IPC section: nothing could reach the region");
  }
  if (count == 0 && staged != 0) {
    return malformed(kWhat, "no rails for a staged region (its mirror has none)");
  }
  if (ipc && ipc->host && (count == 0 || staged != 0)) {
    return malformed(kWhat, "a CUDA IPC section of host memory needs rails and no staged region");
  }
  return RemoteMemory(std::move(*owner), base, length, std::move(rails), staged, ipc,
                      (flags & kReadable) != 0);
}

Result<RemoteMemory> RemoteMemory::from_hex(std::string_view hex) {
  auto bytes = fabric::from_hex(hex);
  if (!bytes) return bytes.status();
  return decode(*bytes);
}

std::string RemoteMemory::to_hex() const {
  return fabric::to_hex(encode());
}

}  // namespace fabric
