// Fuzz target: engine/group addresses as they arrive from another process. Properties:
// decoding never crashes, a rejection names what is wrong, an accepted address has 1..64 NICs
// with non-empty names, decodes again to itself, and re-encodes to exactly the input bytes when
// the input is of the current version (a version-1 address, without an origin, is written back
// as the current version).
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "fabric/address.h"
#include "fuzz_check.h"

using fabric::Address;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto bytes = std::as_bytes(std::span(data, size));
  auto addr = Address::decode(bytes);
  if (!addr) {
    FUZZ_CHECK(addr.status().code() == fabric::ErrorCode::kInvalidArgument, "rejection code");
    FUZZ_CHECK(!addr.status().message().empty(), "a rejection names what is wrong");
  } else {
    FUZZ_CHECK(addr->num_nics() >= 1 && addr->num_nics() <= 64, "1..64 NICs");
    for (const auto& nic : addr->nics()) FUZZ_CHECK(!nic.name.empty(), "non-empty NIC names");
    const auto encoded = addr->encode();
    auto again = Address::decode(encoded);
    FUZZ_CHECK(again.is_ok() && *again == *addr, "decode(encode(a)) == a");
    if (size > 4 && data[4] == Address::kVersion) {
      FUZZ_CHECK(
          encoded.size() == size && std::equal(encoded.begin(), encoded.end(), bytes.begin()),
          "encode(decode(b)) == b");
    }
    FUZZ_CHECK(!addr->short_name().empty(), "short_name");
    auto hex = Address::from_hex(addr->to_hex());
    FUZZ_CHECK(hex.is_ok() && *hex == *addr, "hex round trip");
  }
  auto from_text = Address::from_hex(std::string_view(reinterpret_cast<const char*>(data), size));
  if (!from_text) FUZZ_CHECK(!from_text.status().message().empty(), "hex rejection message");
  return 0;
}
