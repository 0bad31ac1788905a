// fabric::weights for Python: rank descriptions as bytes, the schedule, and the FP8 quantiser
// (CPU reference or CUDA kernel). fabric_lib/weights.py builds the push on these.
//
// Descriptions cross as plain tuples so that the Python side stays in torch terms:
//   shard:  (name, dtype, shape, box, replica)  box: [(start, length), ...] or [] (whole)
//   param:  (name, dtype, shape, dim, start, length, kind, sources, concat_dim, block)
//           dim -1: held whole; kind: "identity", "concat", "fp8_quantize", "fp8_scale"
// dtypes are fabric's names ("bf16", "f32", "fp8_e4m3", ...).
#include <pybind11/numpy.h>

#include "bindings.h"
#include "fabric/weights.h"
#include "fabric/weights_projection.h"

namespace fabric::python {
namespace {

using namespace fabric::weights;

using ParamTuple = std::tuple<std::string, std::string, Shape, int32_t, uint64_t, uint64_t,
                              std::string, std::vector<std::string>, uint32_t, uint32_t>;
// The tuples as they come from Python: every integer an IntArg, its range checked where the
// tuple is read (InvalidArgument naming it, e.g. "shards[2].box[0]"), as for the calls' own
// integer arguments.
using ShardIn = std::tuple<std::string, std::string, std::vector<IntArg>,
                           std::vector<std::pair<IntArg, IntArg>>, IntArg>;
using ParamIn = std::tuple<std::string, std::string, std::vector<IntArg>, IntArg, IntArg, IntArg,
                           std::string, std::vector<std::string>, IntArg, IntArg>;

ProjectionKind parse_kind(const std::string& name) {
  for (auto k : {ProjectionKind::kIdentity, ProjectionKind::kConcat, ProjectionKind::kFp8Quantize,
                 ProjectionKind::kFp8Scale}) {
    if (to_string(k) == name) return k;
  }
  throw StatusError{
      Status(ErrorCode::kInvalidArgument,
             "unknown projection '" + name + "' (identity, concat, fp8_quantize, fp8_scale)")};
}

py::bytes to_py(const Bytes& b) {
  return py::bytes(reinterpret_cast<const char*>(b.data()), b.size());
}

std::span<const std::byte> view(const std::string& s) {
  return std::as_bytes(std::span(s.data(), s.size()));
}

// A shape from Python; `what` names it ("_weights_encode_trainer: shards[0].shape").
Shape shape_of(const std::vector<IntArg>& dims, const std::string& what) {
  Shape out;
  out.reserve(dims.size());
  for (size_t d = 0; d < dims.size(); ++d) {
    out.push_back(u64(dims[d], (what + "[" + std::to_string(d) + "]").c_str()));
  }
  return out;
}

py::tuple entry_tuple(const Entry& e) {
  return py::make_tuple(e.trainer, e.nic, e.param, e.inference, e.src_offset, e.length, e.runs,
                        e.src_stride, e.dst_offset, e.dst_stride);
}

}  // namespace

void bind_weights(py::module_& m) {
  m.def(
      "_weights_encode_trainer",
      [](const IntArg& rank, const IntArg& num_nics, const std::vector<ShardIn>& shards) {
        TrainerRank t{u32(rank, "_weights_encode_trainer: rank"),
                      u32(num_nics, "_weights_encode_trainer: num_nics"),
                      {}};
        for (size_t i = 0; i < shards.size(); ++i) {
          const auto& [name, dtype, shape, box, replica] = shards[i];
          const std::string what = "_weights_encode_trainer: shards[" + std::to_string(i) + "].";
          Shard s{name,
                  check(parse_dtype(dtype)),
                  shape_of(shape, what + "shape"),
                  {},
                  u32(replica, (what + "replica").c_str())};
          for (size_t d = 0; d < box.size(); ++d) {
            const std::string range = what + "box[" + std::to_string(d) + "]";
            s.box.push_back({u64(box[d].first, (range + " start").c_str()),
                             u64(box[d].second, (range + " length").c_str())});
          }
          t.shards.push_back(std::move(s));
        }
        return to_py(encode(t));
      },
      py::arg("rank"), py::arg("num_nics"), py::arg("shards"),
      "A training rank's shards as bytes: (name, dtype, shape, box, replica) each.");
  m.def(
      "_weights_encode_inference",
      [](const IntArg& rank, const std::vector<ParamIn>& params) {
        InferenceRank r{u32(rank, "_weights_encode_inference: rank"), {}};
        for (size_t i = 0; i < params.size(); ++i) {
          const auto& [name, dtype, shape, dim, start, length, kind, sources, cdim, block] =
              params[i];
          const std::string what = "_weights_encode_inference: params[" + std::to_string(i) + "].";
          // dim: a dimension, or -1 (any negative value) for a parameter held whole.
          const auto placement_dim = static_cast<int32_t>(
              signed_value(dim, (what + "dim").c_str(), std::numeric_limits<int32_t>::min(),
                           std::numeric_limits<int32_t>::max()));
          Shape param_shape = shape_of(shape, what + "shape");
          const Range range{u64(start, (what + "start").c_str()),
                            u64(length, (what + "length").c_str())};
          const uint32_t concat_dim = u32(cdim, (what + "concat_dim").c_str());
          const uint32_t tile = u32(block, (what + "block").c_str());
          r.params.push_back(
              InferenceParam{name, check(parse_dtype(dtype)), std::move(param_shape),
                             Placement{placement_dim, range},
                             Projection{parse_kind(kind), sources, concat_dim, tile}});
        }
        return to_py(encode(r));
      },
      py::arg("rank"), py::arg("params"),
      "An inference rank's parameters as bytes: (name, dtype, shape, dim, start, length, kind, "
      "sources, concat_dim, block) each.");

  m.def(
      "_weights_decode_inference",
      [](const py::bytes& data) {
        const InferenceRank r = check(decode_inference(view(data)));
        std::vector<ParamTuple> out;
        for (const InferenceParam& p : r.params) {
          out.emplace_back(p.name, std::string(to_string(p.dtype)), p.shape, p.placement.dim,
                           p.placement.range.start, p.placement.range.length,
                           std::string(to_string(p.projection.kind)), p.projection.sources,
                           p.projection.dim, p.projection.block);
        }
        return out;
      },
      py::arg("data"), "_weights_encode_inference's bytes back as its parameter tuples.");

  py::class_<Schedule>(m, "WeightSchedule",
                       "The static schedule of a weight push (fabric/weights.h).")
      .def_static(
          "compute",
          [](const std::vector<std::string>& trainers, const std::vector<std::string>& inference,
             const IntArg& chunk_bytes_arg) {
            const uint64_t chunk_bytes =
                u64(chunk_bytes_arg, "WeightSchedule.compute: chunk_bytes");
            std::vector<TrainerRank> t;
            std::vector<InferenceRank> r;
            for (const auto& b : trainers) t.push_back(check(decode_trainer(view(b))));
            for (const auto& b : inference) r.push_back(check(decode_inference(view(b))));
            py::gil_scoped_release nogil;
            return check(compute_schedule(t, r, ScheduleOptions{chunk_bytes}));
          },
          py::arg("trainers"), py::arg("inference"), py::arg("chunk_bytes") = uint64_t{64} << 20,
          "Computes the schedule from every rank's encoded description; raises NotFound or "
          "InvalidArgument naming the parameter.")
      .def_static(
          "decode", [](const py::bytes& b) { return check(Schedule::decode(view(b))); },
          py::arg("data"), "A schedule from Schedule.encode()'s bytes.")
      .def(
          "encode", [](const Schedule& s) { return to_py(s.encode()); },
          "Versioned bytes, for shipping the schedule.")
      .def(
          "check_destinations",
          [](const Schedule& s, const std::vector<std::string>& inference) {
            std::vector<InferenceRank> r;
            for (const auto& b : inference) r.push_back(check(decode_inference(view(b))));
            check(s.check_destinations(r));
          },
          py::arg("inference"),
          "Raises InvalidArgument, naming the parameter and rank, when an entry would write past "
          "the end of an inference rank's tensor (as described by its encoded layout), or into a "
          "rank that does not hold its parameter.")
      .def_readonly("num_trainers", &Schedule::num_trainers, "Training ranks it was computed for.")
      .def_readonly("num_inference", &Schedule::num_inference,
                    "Inference ranks it was computed for.")
      .def_property_readonly(
          "params",
          [](const Schedule& s) {
            py::list out;
            for (const ScheduledParam& p : s.params) {
              std::vector<std::string> dtypes;
              for (DType d : p.source_dtypes) dtypes.emplace_back(to_string(d));
              out.append(py::make_tuple(p.name, std::string(to_string(p.dtype)), p.shape,
                                        std::string(to_string(p.projection.kind)),
                                        p.projection.sources, p.projection.dim, p.projection.block,
                                        p.source_shapes, dtypes, p.senders));
            }
            return out;
          },
          "(name, dtype, shape, kind, sources, concat_dim, block, source_shapes, source_dtypes, "
          "senders) per parameter, by name; entries refer to them by index.")
      .def(
          "entries",
          [](const Schedule& s, const std::optional<IntArg>& trainer_arg) {
            std::optional<uint32_t> trainer;
            if (trainer_arg) trainer = u32(*trainer_arg, "WeightSchedule.entries: trainer");
            py::list out;
            for (const Entry& e : s.entries) {
              if (!trainer || e.trainer == *trainer) out.append(entry_tuple(e));
            }
            return out;
          },
          py::arg("trainer") = py::none(),
          "(trainer, nic, param, inference, src_offset, length, runs, src_stride, dst_offset, "
          "dst_stride) per entry, of one trainer or all.")
      .def(
          "bytes_from",
          [](const Schedule& s, const IntArg& trainer) {
            return s.bytes_from(u32(trainer, "WeightSchedule.bytes_from: trainer"));
          },
          py::arg("trainer"), "Bytes the trainer writes per push.")
      .def(
          "writes_into",
          [](const Schedule& s, const IntArg& inference) {
            return s.writes_into(u32(inference, "WeightSchedule.writes_into: inference"));
          },
          py::arg("inference"), "Writes (immediates) landing in the inference rank per push.")
      .def("__len__", [](const Schedule& s) { return s.entries.size(); });

  m.def(
      "_weights_quantize_fp8",
      [](py::handle src, const IntArg& rows_arg, const IntArg& cols_arg, py::handle out,
         py::handle scales, const IntArg& block_arg, const IntArg& stream_arg) {
        const uint64_t rows = u64(rows_arg, "quantize_fp8: rows");
        const uint64_t cols = u64(cols_arg, "quantize_fp8: cols");
        const uint32_t block = u32(block_arg, "quantize_fp8: block");
        const uint64_t stream = u64(stream_arg, "quantize_fp8: stream");
        auto in = PinnedMemory::from_object(src);
        auto q = PinnedMemory::from_object(out);
        auto sc = PinnedMemory::from_object(scales);
        const bool on_gpu = in->device() != "cpu";
        if (on_gpu != (q->device() != "cpu") || on_gpu != (sc->device() != "cpu")) {
          throw StatusError{Status(ErrorCode::kInvalidArgument,
                                   "quantize_fp8: src, out and scales must all be on "
                                   "the CPU or all on a GPU")};
        }
        const Shape tiles = fp8_scale_shape(rows, cols, block);
        if (in->length() != rows * cols * 2 || q->length() != rows * cols ||
            sc->length() != tiles[0] * tiles[1] * 4) {
          throw StatusError{Status(ErrorCode::kInvalidArgument,
                                   "quantize_fp8: sizes do not match rows x cols "
                                   "(bf16 in, one byte out, one f32 scale per tile)")};
        }
        py::gil_scoped_release nogil;
        if (on_gpu) {
          check(quantize_fp8_blocks_cuda(in->ptr(), rows, cols, block, q->ptr(),
                                         static_cast<float*>(sc->ptr()),
                                         reinterpret_cast<void*>(stream)));
          return;
        }
        check(quantize_fp8_blocks_cpu(
            std::span(static_cast<const uint16_t*>(in->ptr()), rows * cols), rows, cols, block,
            std::span(static_cast<uint8_t*>(q->ptr()), rows * cols),
            std::span(static_cast<float*>(sc->ptr()), tiles[0] * tiles[1])));
      },
      py::arg("src"), py::arg("rows"), py::arg("cols"), py::arg("out"), py::arg("scales"),
      py::arg("block") = 128, py::arg("stream") = 0,
      "BF16 -> FP8 e4m3 with one f32 scale per block x block tile (DeepSeek-V3 format): the CPU "
      "reference for host memory, the CUDA kernel (enqueued on `stream`) for device memory.");
  m.def(
      "_weights_quantize_fp8_many",
      [](const std::vector<std::tuple<IntArg, IntArg, IntArg, IntArg, IntArg>>& job_args,
         const IntArg& block_arg, const IntArg& stream_arg) {
        const uint32_t block = u32(block_arg, "quantize_fp8_many: block");
        const uint64_t stream = u64(stream_arg, "quantize_fp8_many: stream");
        std::vector<Fp8Matrix> matrices;
        matrices.reserve(job_args.size());
        for (size_t i = 0; i < job_args.size(); ++i) {
          const std::string what = "quantize_fp8_many: jobs[" + std::to_string(i) + "] ";
          const auto& [in_arg, rows_arg, cols_arg, out_arg, scales_arg] = job_args[i];
          const uint64_t in = u64(in_arg, (what + "bf16 pointer").c_str());
          const uint64_t rows = u64(rows_arg, (what + "rows").c_str());
          const uint64_t cols = u64(cols_arg, (what + "cols").c_str());
          const uint64_t out = u64(out_arg, (what + "e4m3 pointer").c_str());
          const uint64_t scales = u64(scales_arg, (what + "scales pointer").c_str());
          if (in == 0 || out == 0 || scales == 0) {
            throw StatusError{
                Status(ErrorCode::kInvalidArgument, "quantize_fp8_many: a null pointer")};
          }
          matrices.push_back({reinterpret_cast<const void*>(in), rows, cols,
                              reinterpret_cast<void*>(out), reinterpret_cast<float*>(scales)});
        }
        py::gil_scoped_release nogil;
        check(quantize_fp8_blocks_cuda_many(matrices, block, reinterpret_cast<void*>(stream)));
      },
      py::arg("jobs"), py::arg("block"), py::arg("stream"),
      "Internal: the FP8 kernel over many CUDA matrices in few launches. `jobs`: (bf16 pointer, "
      "rows, cols, e4m3 pointer, f32 scales pointer) of device memory the caller checked "
      "(fabric_lib.weights.quantize_fp8_many does).");
  m.attr("_WEIGHTS_HAS_CUDA") = has_cuda_projections();
}

}  // namespace fabric::python
