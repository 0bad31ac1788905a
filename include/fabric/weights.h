// fabric::weights: the static schedule of an RL weight push.
//
// After each training step, every training rank gathers the parameters it was assigned, projects
// them into the inference layout (identity, concatenation such as fused QKV, BF16 -> FP8 e4m3
// with 128x128 block scales) and writes byte ranges of the projected tensors straight into the
// inference ranks' registered parameter memory with one-sided writes and immediates. This header
// describes both sides (parameter layouts, training shards) and computes the schedule once from
// them: which training rank writes which bytes of which projected parameter to which inference
// rank and offset. The pipeline that runs it each step is fabric_lib.weights (Python,
// docs/weights.md); the projections' CPU reference is fabric/weights_projection.h.
//
// Tensors are row-major and contiguous. Everything here is pure computation: no call blocks,
// none touches the fabric, bad input is a Status naming the parameter (and the rank).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fabric/address.h"
#include "fabric/status.h"

namespace fabric::weights {

enum class DType : uint8_t {
  kUInt8 = 0,
  kBFloat16 = 1,
  kFloat16 = 2,
  kFloat32 = 3,
  kFloat8E4M3 = 4,  // OCP e4m3 ("fn": no infinities, max 448)
};

// Bytes of one element.
uint32_t element_bytes(DType dtype);
// "u8", "bf16", "f16", "f32", "fp8_e4m3".
std::string_view to_string(DType dtype);
// The names of to_string; kInvalidArgument for any other.
Result<DType> parse_dtype(std::string_view name);

using Shape = std::vector<uint64_t>;

// Elements of a shape (1 for a scalar, the empty shape).
uint64_t num_elements(const Shape& shape);

struct Range {
  uint64_t start = 0;
  uint64_t length = 0;
  friend bool operator==(const Range&, const Range&) = default;
};

// --- the training side ------------------------------------------------------------------------

// One training rank's piece of a training parameter: the box `box` (one Range per dimension; an
// empty box is the whole tensor) of the global tensor `shape`. FSDP dim-0 shards, TP column and
// row slices, EP expert slices of a stacked expert tensor and 2-D FSDP x TP tiles are all boxes.
// Shards with the same `replica` must tile the tensor exactly (no overlap, nothing missing);
// another replica (HSDP, DP copies) is a second, independent tiling.
struct Shard {
  std::string name;
  DType dtype = DType::kBFloat16;
  Shape shape;             // the global shape
  std::vector<Range> box;  // empty: the whole tensor
  uint32_t replica = 0;
  friend bool operator==(const Shard&, const Shard&) = default;
};

struct TrainerRank {
  uint32_t rank = 0;      // 0..N-1, each once
  uint32_t num_nics = 1;  // the schedule balances this rank's bytes over its NICs
  std::vector<Shard> shards;
  friend bool operator==(const TrainerRank&, const TrainerRank&) = default;
};

// --- the inference side -----------------------------------------------------------------------

enum class ProjectionKind : uint8_t {
  kIdentity = 0,     // the training parameter sources[0] as it is (same dtype, same shape)
  kConcat = 1,       // sources concatenated along `dim` (fused QKV, fused gate/up)
  kFp8Quantize = 2,  // a 2-D BF16 input as FP8 e4m3, one scale per block x block tile
  kFp8Scale = 3,     // the float32 scales of that quantisation: [ceil(rows/b), ceil(cols/b)]
};
// The FP8 kinds' input is sources[0], or with several sources their concatenation along `dim`
// (a fused FP8 gate/up: the fused BF16 tensor quantised, tiles straddling the seam included).
std::string_view to_string(ProjectionKind kind);

struct Projection {
  ProjectionKind kind = ProjectionKind::kIdentity;
  std::vector<std::string> sources;  // training parameter names; empty: the parameter's own name
  uint32_t dim = 0;                  // with several sources: the dimension they are joined on
  uint32_t block = 128;              // kFp8*: the tile's rows and columns
  friend bool operator==(const Projection&, const Projection&) = default;
};

// How an inference rank holds a parameter: all of it (dim < 0), or the range `range` of
// dimension `dim` (TP column style: dim 0 of a [out, in] weight; row style: dim 1; EP: dim 0 of
// a stacked [experts, ...] tensor). Its local tensor is that slice, contiguous.
struct Placement {
  int32_t dim = -1;
  Range range;
  friend bool operator==(const Placement&, const Placement&) = default;
};

// One parameter of an inference rank. `shape` is the global (projected) shape; several ranks
// holding the same name must agree on dtype, shape and projection.
struct InferenceParam {
  std::string name;
  DType dtype = DType::kBFloat16;
  Shape shape;
  Placement placement;
  Projection projection;
  friend bool operator==(const InferenceParam&, const InferenceParam&) = default;
};

struct InferenceRank {
  uint32_t rank = 0;  // 0..M-1, each once
  std::vector<InferenceParam> params;
  friend bool operator==(const InferenceRank&, const InferenceRank&) = default;
};

// Bytes of the rank's local tensor of `param` (its placement's slice).
uint64_t local_bytes(const InferenceParam& param);

// The global shape `projection` gives from its sources' shapes (as the schedule checks it).
// kInvalidArgument naming `name` when the sources cannot be projected so.
Result<Shape> projected_shape(std::string_view name, const Projection& projection,
                              const std::vector<Shape>& source_shapes);

// --- the schedule -----------------------------------------------------------------------------

// One strided write: `runs` runs of `length` bytes, the i-th from projected-tensor byte
// src_offset + i * src_stride into the inference rank's local tensor at dst_offset + i *
// dst_stride. Each run is one write carrying the push's immediate, so an inference rank expects
// writes_into(rank) immediates per version. A contiguous range is runs == 1.
struct Entry {
  uint32_t trainer = 0;
  uint32_t nic = 0;
  uint32_t param = 0;  // index into Schedule::params
  uint32_t inference = 0;
  uint64_t src_offset = 0;
  uint64_t length = 0;
  uint64_t runs = 1;
  uint64_t src_stride = 0;
  uint64_t dst_offset = 0;
  uint64_t dst_stride = 0;
  uint64_t bytes() const { return length * runs; }
  friend bool operator==(const Entry&, const Entry&) = default;
};

// A projected parameter: what the writes of its entries are cut from.
struct ScheduledParam {
  std::string name;  // the inference name
  DType dtype = DType::kBFloat16;
  Shape shape;  // projected, global
  Projection projection;
  std::vector<DType> source_dtypes;  // per projection source
  std::vector<Shape> source_shapes;
  std::vector<uint32_t> senders;  // training ranks that may send it (hold all its sources)
  friend bool operator==(const ScheduledParam&, const ScheduledParam&) = default;
};

struct ScheduleOptions {
  // Entries are cut to at most this many bytes (whole runs where a run fits) so that the load
  // can be spread; a write's temporary memory on the sender is bounded by the projected tensor.
  uint64_t chunk_bytes = uint64_t{64} << 20;
};

struct Schedule {
  uint32_t num_trainers = 0;
  uint32_t num_inference = 0;
  std::vector<ScheduledParam> params;  // sorted by name
  std::vector<Entry> entries;          // sorted by trainer, then param, inference, dst_offset

  // Bytes the trainer writes per push.
  uint64_t bytes_from(uint32_t trainer) const;
  // Writes (one immediate each) that land in the inference rank per push.
  uint64_t writes_into(uint32_t inference) const;
  // Index of `name` in params, or -1.
  int64_t find(std::string_view name) const;

  // Versioned little-endian bytes, for a controller that computes once and ships the result.
  Bytes encode() const;
  // kInvalidArgument naming the first field that does not parse.
  static Result<Schedule> decode(std::span<const std::byte> bytes);
  // What decode cannot see: every entry's writes lie inside its inference rank's local tensor
  // of its parameter (a schedule read from a registry, against the ranks' published layouts).
  // kInvalidArgument naming the parameter and the inference rank otherwise, or when a rank
  // does not hold a parameter an entry writes; `inference` indexed by rank.
  Status check_destinations(const std::vector<InferenceRank>& inference) const;
  friend bool operator==(const Schedule&, const Schedule&) = default;
};

// Checks both sides and computes the schedule: every byte of every inference rank's local
// tensor of every parameter is covered by exactly one entry; entries are cut to
// options.chunk_bytes and given, largest first, to the least-loaded training rank that holds a
// shard of every source (then to its least-loaded NIC), so with equal eligibility no rank
// carries more than the mean plus one chunk. Errors, each naming the parameter:
//   kNotFound         an inference source no training rank holds
//   kInvalidArgument  shape mismatch (after projection), a dtype pair with no projection,
//                     overlapping or incomplete shards, a box or placement outside its shape,
//                     ranks not numbered 0..N-1, a name twice on one rank, ranks disagreeing
//                     about a parameter, no rank holding all sources of a parameter
Result<Schedule> compute_schedule(const std::vector<TrainerRank>& trainers,
                                  const std::vector<InferenceRank>& inference,
                                  const ScheduleOptions& options = {});

// The same descriptions as bytes (what ranks publish in the membership registries).
Bytes encode(const TrainerRank& rank);
Bytes encode(const InferenceRank& rank);
Result<TrainerRank> decode_trainer(std::span<const std::byte> bytes);
Result<InferenceRank> decode_inference(std::span<const std::byte> bytes);

}  // namespace fabric::weights
