// Fuzz target: RemoteMemory descriptors as they arrive from another process (raw bytes and
// their hex form). Properties: decoding never crashes, a rejection names what is wrong, and an
// accepted descriptor is consistent (rails = the owner's NICs, or none for memory only CUDA IPC
// reaches; no wrap-around) and re-encodes to bytes that decode to the same descriptor.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "fabric/address.h"
#include "fuzz_check.h"

using fabric::RemoteMemory;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto bytes = std::as_bytes(std::span(data, size));
  auto desc = RemoteMemory::decode(bytes);
  if (!desc) {
    FUZZ_CHECK(desc.status().code() == fabric::ErrorCode::kInvalidArgument, "rejection code");
    FUZZ_CHECK(!desc.status().message().empty(), "a rejection names what is wrong");
  } else {
    FUZZ_CHECK(desc->rails_fit_owner() && (!desc->ipc_only() || desc->staged_region() == 0),
               "one rail per owner NIC, or none with a CUDA IPC section and no staged region");
    FUZZ_CHECK(!desc->cuda_ipc() || !desc->cuda_ipc()->host ||
                   (!desc->rails().empty() && desc->staged_region() == 0),
               "a host memory section comes with rails and no staged region");
    FUZZ_CHECK(desc->base() + desc->length() >= desc->base(), "region does not wrap");
    FUZZ_CHECK(!desc->owner().empty(), "an owner with NICs");
    auto again = RemoteMemory::decode(desc->encode());
    FUZZ_CHECK(again.is_ok(), "an accepted descriptor re-encodes to valid bytes");
    FUZZ_CHECK(*again == *desc, "decode(encode(d)) == d");
    auto hex = RemoteMemory::from_hex(desc->to_hex());
    FUZZ_CHECK(hex.is_ok() && *hex == *desc, "hex round trip");
  }
  // The same bytes as a hex string (what a side channel such as a pipe or etcd carries).
  auto from_text =
      RemoteMemory::from_hex(std::string_view(reinterpret_cast<const char*>(data), size));
  if (!from_text) FUZZ_CHECK(!from_text.status().message().empty(), "hex rejection message");
  return 0;
}
