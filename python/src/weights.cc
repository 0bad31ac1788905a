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

using ShardTuple = std::tuple<std::string, std::string, Shape,
                              std::vector<std::pair<uint64_t, uint64_t>>, uint32_t>;
using ParamTuple = std::tuple<std::string, std::string, Shape, int32_t, uint64_t, uint64_t,
                              std::string, std::vector<std::string>, uint32_t, uint32_t>;

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

py::tuple entry_tuple(const Entry& e) {
  return py::make_tuple(e.trainer, e.nic, e.param, e.inference, e.src_offset, e.length, e.runs,
                        e.src_stride, e.dst_offset, e.dst_stride);
}

}  // namespace

void bind_weights(py::module_& m) {
  m.def(
      "_weights_encode_trainer",
      [](uint32_t rank, uint32_t num_nics, const std::vector<ShardTuple>& shards) {
        TrainerRank t{rank, num_nics, {}};
        for (const auto& [name, dtype, shape, box, replica] : shards) {
          Shard s{name, check(parse_dtype(dtype)), shape, {}, replica};
          for (const auto& [start, length] : box) s.box.push_back({start, length});
          t.shards.push_back(std::move(s));
        }
        return to_py(encode(t));
      },
      py::arg("rank"), py::arg("num_nics"), py::arg("shards"),
      "A training rank's shards as bytes: (name, dtype, shape, box, replica) each.");
  m.def(
      "_weights_encode_inference",
      [](uint32_t rank, const std::vector<ParamTuple>& params) {
        InferenceRank r{rank, {}};
        for (const auto& [name, dtype, shape, dim, start, length, kind, sources, cdim, block] :
             params) {
          r.params.push_back(InferenceParam{name, check(parse_dtype(dtype)), shape,
                                            Placement{dim, {start, length}},
                                            Projection{parse_kind(kind), sources, cdim, block}});
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
             uint64_t chunk_bytes) {
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
          [](const Schedule& s, std::optional<uint32_t> trainer) {
            py::list out;
            for (const Entry& e : s.entries) {
              if (!trainer || e.trainer == *trainer) out.append(entry_tuple(e));
            }
            return out;
          },
          py::arg("trainer") = py::none(),
          "(trainer, nic, param, inference, src_offset, length, runs, src_stride, dst_offset, "
          "dst_stride) per entry, of one trainer or all.")
      .def("bytes_from", &Schedule::bytes_from, py::arg("trainer"),
           "Bytes the trainer writes per push.")
      .def("writes_into", &Schedule::writes_into, py::arg("inference"),
           "Writes (immediates) landing in the inference rank per push.")
      .def("__len__", [](const Schedule& s) { return s.entries.size(); });

  m.def(
      "_weights_quantize_fp8",
      [](py::handle src, uint64_t rows, uint64_t cols, py::handle out, py::handle scales,
         uint32_t block, uintptr_t stream) {
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
      [](const std::vector<std::tuple<uintptr_t, uint64_t, uint64_t, uintptr_t, uintptr_t>>& jobs,
         uint32_t block, uintptr_t stream) {
        std::vector<Fp8Matrix> matrices;
        matrices.reserve(jobs.size());
        for (const auto& [in, rows, cols, out, scales] : jobs) {
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
