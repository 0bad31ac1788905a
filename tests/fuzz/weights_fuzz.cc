// Fuzz target: the byte forms of fabric::weights (src/weights/codec.cc) as they arrive from the
// membership registries or a controller: a training rank's description (decode_trainer), an
// inference rank's (decode_inference) and a computed schedule (Schedule::decode). Each input goes
// to all three (the 4-byte tag makes at most one of them read past the header). Properties:
// decoding never crashes, over-reads or allocates more than the input allows; a rejection is
// InvalidArgument with a message; an accepted value is within the bounds the decoder promises (at
// most 16 dimensions, one dtype and shape per projection source, senders and entries that index
// what the schedule holds), decodes again to itself and re-encodes to exactly the input.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include "fabric/weights.h"
#include "fuzz_check.h"

namespace weights = fabric::weights;

namespace {

constexpr size_t kMaxDims = 16;  // codec.cc's bound on the dimensions of a shape or a box

// Decodes `input`; a rejection must be InvalidArgument with a message, an accepted value must
// pass `check`, re-encode to exactly the input (every field is kept as read) and decode again to
// itself.
template <typename Decode, typename Encode, typename Check>
void check_decoder(std::span<const std::byte> input, Decode decode, Encode encode, Check check) {
  auto value = decode(input);
  if (!value) {
    FUZZ_CHECK(value.status().code() == fabric::ErrorCode::kInvalidArgument, "rejection code");
    FUZZ_CHECK(!value.status().message().empty(), "a rejection names what is wrong");
    return;
  }
  check(*value);
  const fabric::Bytes encoded = encode(*value);
  FUZZ_CHECK(
      encoded.size() == input.size() && std::equal(encoded.begin(), encoded.end(), input.begin()),
      "encode(decode(b)) == b");
  auto again = decode(encoded);
  FUZZ_CHECK(again.is_ok() && *again == *value, "decode(encode(v)) == v");
}

void check_projection(const weights::Projection& p) {
  FUZZ_CHECK(p.kind <= weights::ProjectionKind::kFp8Scale, "a known projection kind");
}

void check_trainer(const weights::TrainerRank& t) {
  for (const weights::Shard& s : t.shards) {
    FUZZ_CHECK(s.shape.size() <= kMaxDims, "shard shape bounded");
    FUZZ_CHECK(s.box.size() <= kMaxDims, "shard box bounded");
    FUZZ_CHECK(weights::element_bytes(s.dtype) != 0, "a known dtype");
  }
}

void check_inference(const weights::InferenceRank& r) {
  for (const weights::InferenceParam& p : r.params) {
    FUZZ_CHECK(p.shape.size() <= kMaxDims, "param shape bounded");
    FUZZ_CHECK(weights::element_bytes(p.dtype) != 0, "a known dtype");
    check_projection(p.projection);
  }
}

void check_schedule(const weights::Schedule& s) {
  for (const weights::ScheduledParam& p : s.params) {
    FUZZ_CHECK(p.shape.size() <= kMaxDims, "param shape bounded");
    FUZZ_CHECK(weights::element_bytes(p.dtype) != 0, "a known dtype");
    check_projection(p.projection);
    FUZZ_CHECK(p.source_dtypes.size() == p.source_shapes.size(), "a dtype per source shape");
    for (const weights::Shape& shape : p.source_shapes) {
      FUZZ_CHECK(shape.size() <= kMaxDims, "source shape bounded");
    }
    for (uint32_t sender : p.senders) FUZZ_CHECK(sender < s.num_trainers, "senders are trainers");
  }
  for (const weights::Entry& e : s.entries) {
    FUZZ_CHECK(e.trainer < s.num_trainers, "entry.trainer in range");
    FUZZ_CHECK(e.inference < s.num_inference, "entry.inference in range");
    FUZZ_CHECK(e.param < s.params.size(), "entry.param in range");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using Span = std::span<const std::byte>;
  const Span bytes = std::as_bytes(std::span(data, size));
  check_decoder(
      bytes, [](Span b) { return weights::decode_trainer(b); },
      [](const weights::TrainerRank& t) { return weights::encode(t); }, check_trainer);
  check_decoder(
      bytes, [](Span b) { return weights::decode_inference(b); },
      [](const weights::InferenceRank& r) { return weights::encode(r); }, check_inference);
  check_decoder(
      bytes, [](Span b) { return weights::Schedule::decode(b); },
      [](const weights::Schedule& s) { return s.encode(); }, check_schedule);
  return 0;
}
