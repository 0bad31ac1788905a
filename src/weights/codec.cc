// The byte forms of the schedule and of each rank's description: little-endian, a 4-byte tag
// and a version first, each string and list prefixed by its length. decode checks every length
// against what is left, so bad bytes are an error naming the field, never an overread; names
// (of parameters, shards and projection sources) must be UTF-8, an error naming the field and
// the parameter's (or shard's) index otherwise.
#include <fmt/format.h>

#include <cstring>
#include <map>
#include <string_view>

#include "common/codec.h"
#include "fabric/weights.h"

namespace fabric::weights {
namespace {

using detail::ByteReader;
using detail::ByteWriter;

constexpr uint32_t kVersion = 1;
constexpr uint32_t kScheduleTag = 0x53574246;   // "FBWS"
constexpr uint32_t kTrainerTag = 0x54574246;    // "FBWT"
constexpr uint32_t kInferenceTag = 0x49574246;  // "FBWI"
// Bounds on counts read from bytes, so a bad length cannot make decode allocate gigabytes.
constexpr uint64_t kMaxDims = 16;

// Whether `s` is well-formed UTF-8 (no overlong forms, no surrogates, at most U+10FFFF): names
// are text that Python and the registries read as such, so a name that is not is refused where
// the bytes are decoded, rather than wherever it is shown.
bool valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if (c >= 0xC2 && c <= 0xDF) {
      n = 1, cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      n = 2, cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      n = 3, cp = c & 0x07;
    } else {
      return false;
    }
    if (s.size() - i - 1 < n) return false;
    for (size_t k = 1; k <= n; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if ((n == 2 && cp < 0x800) || (n == 3 && (cp < 0x10000 || cp > 0x10FFFF)) ||
        (cp >= 0xD800 && cp <= 0xDFFF)) {
      return false;
    }
    i += n + 1;
  }
  return true;
}

void put_string(ByteWriter& w, const std::string& s) {
  w.u32(static_cast<uint32_t>(s.size()));
  w.bytes(std::as_bytes(std::span(s.data(), s.size())));
}
void put_shape(ByteWriter& w, const Shape& s) {
  w.u32(static_cast<uint32_t>(s.size()));
  for (uint64_t d : s) w.u64(d);
}
// The head of a shard, an inference parameter and a scheduled parameter.
void put_tensor(ByteWriter& w, const std::string& name, DType dtype, const Shape& shape) {
  put_string(w, name);
  w.u8(static_cast<uint8_t>(dtype));
  put_shape(w, shape);
}
void put_projection(ByteWriter& w, const Projection& p) {
  w.u8(static_cast<uint8_t>(p.kind));
  w.u32(static_cast<uint32_t>(p.sources.size()));
  for (const auto& s : p.sources) put_string(w, s);
  w.u32(p.dim);
  w.u32(p.block);
}

// Reads fields in order; the first that fails is remembered and every later read is a no-op.
class Fields {
 public:
  explicit Fields(std::span<const std::byte> in) : r_(in) {}
  bool ok() const { return failed_.empty(); }
  Status status(std::string_view what) const {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("weights {}: bad bytes at field '{}'", what, failed_));
  }
  void fail(const char* field) {
    if (ok()) failed_ = field;
  }
  uint8_t u8(const char* f) {
    uint8_t v = 0;
    if (ok() && !r_.u8(v)) fail(f);
    return v;
  }
  uint32_t u32(const char* f) {
    uint32_t v = 0;
    if (ok() && !r_.u32(v)) fail(f);
    return v;
  }
  uint64_t u64(const char* f) {
    uint64_t v = 0;
    if (ok() && !r_.u64(v)) fail(f);
    return v;
  }
  // A count of items of at least `min_item_bytes` each: no more than the bytes left allow.
  uint32_t count(const char* f, uint64_t min_item_bytes) {
    const uint32_t n = u32(f);
    if (ok() && n * min_item_bytes > r_.remaining()) fail(f);
    return ok() ? n : 0;
  }
  std::string str(const char* f) {
    const uint32_t n = count(f, 1);
    std::vector<std::byte> b;
    if (ok() && !r_.bytes(n, b)) fail(f);
    std::string s(b.size(), '\0');
    if (!b.empty()) std::memcpy(s.data(), b.data(), b.size());
    return s;
  }
  // A name: a string that must be UTF-8. `whose` says which one in an error ("parameter 3").
  std::string name(const char* f, const std::string& whose) {
    std::string s = str(f);
    if (ok() && !valid_utf8(s)) {
      field_ = fmt::format("{} ({}: not UTF-8)", f, whose);
      fail(field_.c_str());
    }
    return s;
  }
  Shape shape(const char* f) {
    const uint32_t n = count(f, 8);
    if (n > kMaxDims) fail(f);
    Shape s;
    for (uint32_t i = 0; ok() && i < n; ++i) s.push_back(u64(f));
    return s;
  }
  DType dtype(const char* f) {
    const uint8_t v = u8(f);
    if (v > static_cast<uint8_t>(DType::kFloat8E4M3)) fail(f);
    return static_cast<DType>(v);
  }
  // put_tensor's fields; `what` prefixes their names in errors ("shard.name"), `whose` says
  // which one it is ("parameter 3").
  void tensor(const std::string& what, const std::string& whose, std::string& name, DType& dtype,
              Shape& shape) {
    const std::string name_field = what + ".name";
    name = this->name(name_field.c_str(), whose);
    field_ = what + ".dtype";
    dtype = this->dtype(field_.c_str());
    field_ = what + ".shape";
    shape = this->shape(field_.c_str());
  }
  Projection projection(const std::string& whose) {
    Projection p;
    const uint8_t kind = u8("projection.kind");
    if (kind > static_cast<uint8_t>(ProjectionKind::kFp8Scale)) fail("projection.kind");
    p.kind = static_cast<ProjectionKind>(kind);
    const uint32_t n = count("projection.sources", 4);
    for (uint32_t i = 0; ok() && i < n; ++i) {
      p.sources.push_back(name("projection.source", fmt::format("{}, source {}", whose, i)));
    }
    p.dim = u32("projection.dim");
    p.block = u32("projection.block");
    return p;
  }
  void header(uint32_t tag) {
    if (u32("tag") != tag) fail("tag");
    if (u32("version") != kVersion) fail("version");
  }
  void end() {
    if (ok() && r_.remaining() != 0) fail("end (trailing bytes)");
  }

 private:
  ByteReader r_;
  std::string failed_;
  std::string field_;  // a field name made for an error; failed_ copies it
};

}  // namespace

Bytes encode(const TrainerRank& rank) {
  ByteWriter w;
  w.u32(kTrainerTag);
  w.u32(kVersion);
  w.u32(rank.rank);
  w.u32(rank.num_nics);
  w.u32(static_cast<uint32_t>(rank.shards.size()));
  for (const Shard& s : rank.shards) {
    put_tensor(w, s.name, s.dtype, s.shape);
    w.u32(static_cast<uint32_t>(s.box.size()));
    for (const Range& r : s.box) {
      w.u64(r.start);
      w.u64(r.length);
    }
    w.u32(s.replica);
  }
  return w.take();
}

Result<TrainerRank> decode_trainer(std::span<const std::byte> bytes) {
  Fields f(bytes);
  f.header(kTrainerTag);
  TrainerRank t;
  t.rank = f.u32("rank");
  t.num_nics = f.u32("num_nics");
  const uint32_t n = f.count("shards", 17);
  for (uint32_t i = 0; f.ok() && i < n; ++i) {
    Shard s;
    f.tensor("shard", fmt::format("shard {}", i), s.name, s.dtype, s.shape);
    const uint32_t dims = f.count("shard.box", 16);
    if (dims > kMaxDims) f.fail("shard.box");
    for (uint32_t d = 0; f.ok() && d < dims; ++d) {
      const uint64_t start = f.u64("shard.box");
      s.box.push_back({start, f.u64("shard.box")});
    }
    s.replica = f.u32("shard.replica");
    t.shards.push_back(std::move(s));
  }
  f.end();
  if (!f.ok()) return f.status("training rank");
  return t;
}

Bytes encode(const InferenceRank& rank) {
  ByteWriter w;
  w.u32(kInferenceTag);
  w.u32(kVersion);
  w.u32(rank.rank);
  w.u32(static_cast<uint32_t>(rank.params.size()));
  for (const InferenceParam& p : rank.params) {
    put_tensor(w, p.name, p.dtype, p.shape);
    w.u32(static_cast<uint32_t>(p.placement.dim));
    w.u64(p.placement.range.start);
    w.u64(p.placement.range.length);
    put_projection(w, p.projection);
  }
  return w.take();
}

Result<InferenceRank> decode_inference(std::span<const std::byte> bytes) {
  Fields f(bytes);
  f.header(kInferenceTag);
  InferenceRank r;
  r.rank = f.u32("rank");
  const uint32_t n = f.count("params", 38);
  for (uint32_t i = 0; f.ok() && i < n; ++i) {
    InferenceParam p;
    const std::string whose = fmt::format("parameter {}", i);
    f.tensor("param", whose, p.name, p.dtype, p.shape);
    p.placement.dim = static_cast<int32_t>(f.u32("param.placement"));
    p.placement.range.start = f.u64("param.placement");
    p.placement.range.length = f.u64("param.placement");
    p.projection = f.projection(whose);
    r.params.push_back(std::move(p));
  }
  f.end();
  if (!f.ok()) return f.status("inference rank");
  return r;
}

Bytes Schedule::encode() const {
  ByteWriter w;
  w.u32(kScheduleTag);
  w.u32(kVersion);
  w.u32(num_trainers);
  w.u32(num_inference);
  w.u32(static_cast<uint32_t>(params.size()));
  for (const ScheduledParam& p : params) {
    put_tensor(w, p.name, p.dtype, p.shape);
    put_projection(w, p.projection);
    w.u32(static_cast<uint32_t>(p.source_dtypes.size()));
    for (size_t i = 0; i < p.source_dtypes.size(); ++i) {
      w.u8(static_cast<uint8_t>(p.source_dtypes[i]));
      put_shape(w, p.source_shapes[i]);
    }
    w.u32(static_cast<uint32_t>(p.senders.size()));
    for (uint32_t s : p.senders) w.u32(s);
  }
  w.u64(entries.size());
  for (const Entry& e : entries) {
    w.u32(e.trainer);
    w.u32(e.nic);
    w.u32(e.param);
    w.u32(e.inference);
    w.u64(e.src_offset);
    w.u64(e.length);
    w.u64(e.runs);
    w.u64(e.src_stride);
    w.u64(e.dst_offset);
    w.u64(e.dst_stride);
  }
  return w.take();
}

Result<Schedule> Schedule::decode(std::span<const std::byte> bytes) {
  Fields f(bytes);
  f.header(kScheduleTag);
  Schedule s;
  s.num_trainers = f.u32("num_trainers");
  s.num_inference = f.u32("num_inference");
  const uint32_t n = f.count("params", 30);
  std::vector<uint64_t> param_bytes;
  for (uint32_t i = 0; f.ok() && i < n; ++i) {
    ScheduledParam p;
    const std::string whose = fmt::format("parameter {}", i);
    f.tensor("param", whose, p.name, p.dtype, p.shape);
    p.projection = f.projection(whose);
    const uint32_t sources = f.count("param.sources", 5);
    for (uint32_t k = 0; f.ok() && k < sources; ++k) {
      p.source_dtypes.push_back(f.dtype("param.source_dtype"));
      p.source_shapes.push_back(f.shape("param.source_shape"));
    }
    const uint32_t senders = f.count("param.senders", 4);
    for (uint32_t k = 0; f.ok() && k < senders; ++k) {
      p.senders.push_back(f.u32("param.sender"));
      if (p.senders.back() >= s.num_trainers) f.fail("param.sender");
    }
    // Schedule::find looks names up by bisection: sorted, each once.
    if (!s.params.empty() && !(s.params.back().name < p.name)) f.fail("param.name (order)");
    // The projected tensor's bytes, which its entries are cut from (checked below).
    uint64_t nbytes = element_bytes(p.dtype);
    for (uint64_t d : p.shape) {
      if (__builtin_mul_overflow(nbytes, d, &nbytes)) f.fail("param.shape (bytes overflow)");
    }
    param_bytes.push_back(nbytes);
    s.params.push_back(std::move(p));
  }
  constexpr uint64_t kEntryBytes = 4 * 4 + 6 * 8;
  const uint64_t entries = f.u64("entries");
  if (f.ok() && entries > bytes.size() / kEntryBytes) f.fail("entries");
  for (uint64_t i = 0; f.ok() && i < entries; ++i) {
    Entry e;
    e.trainer = f.u32("entry.trainer");
    e.nic = f.u32("entry.nic");
    e.param = f.u32("entry.param");
    e.inference = f.u32("entry.inference");
    e.src_offset = f.u64("entry.src_offset");
    e.length = f.u64("entry.length");
    e.runs = f.u64("entry.runs");
    e.src_stride = f.u64("entry.src_stride");
    e.dst_offset = f.u64("entry.dst_offset");
    e.dst_stride = f.u64("entry.dst_stride");
    if (e.trainer >= s.num_trainers) f.fail("entry.trainer");
    if (e.inference >= s.num_inference) f.fail("entry.inference");
    if (e.param >= s.params.size()) f.fail("entry.param");
    // Every byte an entry reads lies in its projected tensor: a write cut from past its end
    // would send the staging ring's next bytes (another parameter's) without an error.
    uint64_t end = 0;
    if (f.ok() && (e.runs == 0 || __builtin_mul_overflow(e.runs - 1, e.src_stride, &end) ||
                   __builtin_add_overflow(end, e.src_offset, &end) ||
                   __builtin_add_overflow(end, e.length, &end) || end > param_bytes[e.param])) {
      f.fail("entry.src_offset (past the end of its parameter)");
    }
    s.entries.push_back(e);
  }
  f.end();
  if (!f.ok()) return f.status("schedule");
  return s;
}

Status Schedule::check_destinations(const std::vector<InferenceRank>& inference) const {
  if (inference.size() != num_inference) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("schedule: {} inference ranks, the layouts of {}", num_inference,
                              inference.size()));
  }
  // Per rank, each parameter's local bytes by name.
  std::vector<std::map<std::string_view, uint64_t>> local(inference.size());
  for (const InferenceRank& r : inference) {
    if (r.rank >= local.size()) {
      return Status(ErrorCode::kInvalidArgument,
                    fmt::format("schedule: inference rank {} of {}", r.rank, local.size()));
    }
    for (const InferenceParam& p : r.params) local[r.rank][p.name] = local_bytes(p);
  }
  for (const Entry& e : entries) {
    const std::string& name = params[e.param].name;
    auto it = local[e.inference].find(name);
    if (it == local[e.inference].end()) {
      return Status(ErrorCode::kInvalidArgument,
                    fmt::format("schedule: parameter '{}' is written into inference rank {}, "
                                "which does not hold it",
                                name, e.inference));
    }
    uint64_t end = 0;
    if (e.runs == 0 || __builtin_mul_overflow(e.runs - 1, e.dst_stride, &end) ||
        __builtin_add_overflow(end, e.dst_offset, &end) ||
        __builtin_add_overflow(end, e.length, &end) || end > it->second) {
      return Status(ErrorCode::kInvalidArgument,
                    fmt::format("schedule: an entry of parameter '{}' writes past the end of "
                                "inference rank {}'s tensor ({} bytes)",
                                name, e.inference, it->second));
    }
  }
  return Status::ok();
}

}  // namespace fabric::weights
