// The push's own bytes (fabric/weights/flow.h): the Ready message and an inference rank's
// endpoint. Little-endian; decode checks every length against what is left and names the field.
#include <fmt/format.h>

#include <cstring>

#include "common/codec.h"
#include "fabric/weights/flow.h"

namespace fabric::weights {
namespace {

using detail::ByteReader;
using detail::ByteWriter;

constexpr std::byte kReadyTag[4] = {std::byte{'F'}, std::byte{'W'}, std::byte{'R'}, std::byte{'D'}};
constexpr uint32_t kEndpointTag = 0x45574246;  // "FBWE"
constexpr uint32_t kEndpointVersion = 1;
constexpr uint32_t kMaxCopies = 2;
static_assert(kReadyBytes == 4 + 8 + 4 + 4 + 1);

Status bad(std::string_view field) {
  return Status(ErrorCode::kInvalidArgument,
                fmt::format("weights endpoint: bad bytes at field '{}'", field));
}

void put_blob(ByteWriter& w, const Bytes& b) {
  w.u32(static_cast<uint32_t>(b.size()));
  w.bytes(b);
}

bool get_blob(ByteReader& r, Bytes& out) {
  uint32_t n = 0;
  return r.u32(n) && r.bytes(n, out);
}

}  // namespace

Bytes encode(const Ready& ready) {
  ByteWriter w;
  w.bytes(kReadyTag);
  w.u64(ready.version);
  w.u32(ready.imm);
  w.u32(ready.inference);
  w.u8(ready.copy);
  return w.take();
}

Result<Ready> decode_ready(std::span<const std::byte> bytes) {
  if (bytes.size() != kReadyBytes || std::memcmp(bytes.data(), kReadyTag, 4) != 0) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("not a weights Ready message ({} bytes)", bytes.size()));
  }
  ByteReader r(bytes.subspan(4));
  Ready ready;
  (void)(r.u64(ready.version) && r.u32(ready.imm) && r.u32(ready.inference) && r.u8(ready.copy));
  return ready;
}

Bytes encode(const Endpoint& e) {
  ByteWriter w;
  w.u32(kEndpointTag);
  w.u32(kEndpointVersion);
  put_blob(w, encode(e.layout));
  w.u32(static_cast<uint32_t>(e.regions.size()));
  for (const RemoteMemory& m : e.regions) put_blob(w, m.encode());
  const uint32_t copies = e.places.empty() ? 0 : static_cast<uint32_t>(e.places[0].size());
  w.u32(copies);
  for (const auto& per_param : e.places) {
    for (const Place& p : per_param) {
      w.u32(p.region);
      w.u64(p.offset);
    }
  }
  return w.take();
}

Result<Endpoint> decode_endpoint(std::span<const std::byte> bytes) {
  ByteReader r(bytes);
  uint32_t tag = 0, version = 0;
  if (!r.u32(tag) || tag != kEndpointTag) return bad("tag");
  if (!r.u32(version) || version != kEndpointVersion) return bad("version");
  Endpoint e;
  Bytes blob;
  if (!get_blob(r, blob)) return bad("layout");
  auto layout = decode_inference(blob);
  if (!layout) return layout.status();
  e.layout = std::move(*layout);
  uint32_t regions = 0;
  if (!r.u32(regions) || regions > r.remaining() / 4) return bad("regions");
  for (uint32_t i = 0; i < regions; ++i) {
    if (!get_blob(r, blob)) return bad("region");
    auto m = RemoteMemory::decode(blob);
    if (!m) {
      return Status(ErrorCode::kInvalidArgument,
                    fmt::format("weights endpoint: region {}: {}", i, m.status().message()));
    }
    e.regions.push_back(std::move(*m));
  }
  uint32_t copies = 0;
  if (!r.u32(copies) || copies == 0 || copies > kMaxCopies) return bad("copies");
  if (r.remaining() != e.layout.params.size() * copies * 12) return bad("places");
  e.places.resize(e.layout.params.size());
  for (auto& per_param : e.places) {
    for (uint32_t c = 0; c < copies; ++c) {
      Place p;
      (void)(r.u32(p.region) && r.u64(p.offset));
      if (p.region >= regions) return bad("place.region");
      per_param.push_back(p);
    }
  }
  return e;
}

}  // namespace fabric::weights
