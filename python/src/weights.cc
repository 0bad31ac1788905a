// fabric::weights for Python: rank descriptions as bytes, the schedule (its parameters and
// entries as WeightParam / WeightEntry), the push's sender and receiver (WeightSender,
// WeightReceiver: fabric/weights/flow.h), and the FP8 quantiser (CPU reference or CUDA kernel).
// fabric_lib/weights.py builds the push on these, keeping what is torch's (tensors, gathers).
//
// Descriptions go in as plain tuples so that the Python side stays in torch terms:
//   shard:  (name, dtype, shape, box, replica)  box: [(start, length), ...] or [] (whole)
//   param:  (name, dtype, shape, dim, start, length, kind, sources, concat_dim, block)
//           dim -1: held whole; kind: "identity", "concat", "fp8_quantize", "fp8_scale"
// dtypes are fabric's names ("bf16", "f32", "fp8_e4m3", ...) or torch's ("torch.bfloat16").
// The rendezvous through a registry (fabric/weights/rendezvous.h) is bound as methods of the
// sender and the receiver: publish, connect_registry / prepare_version, withdraw.
#include <pybind11/numpy.h>

#include <map>

#include "bindings.h"
#include "fabric/weights.h"
#include "fabric/weights/flow.h"
#include "fabric/weights/rendezvous.h"
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

// A dtype by fabric's name or torch's (str(tensor.dtype)); `what` names the parameter.
DType dtype_arg(const std::string& name, const std::string& what) {
  static const std::pair<const char*, DType> kTorch[] = {
      {"torch.uint8", DType::kUInt8},
      {"torch.bfloat16", DType::kBFloat16},
      {"torch.float16", DType::kFloat16},
      {"torch.float32", DType::kFloat32},
      {"torch.float8_e4m3fn", DType::kFloat8E4M3}};
  if (name.starts_with("torch.")) {
    for (const auto& [torch_name, d] : kTorch) {
      if (name == torch_name) return d;
    }
    throw StatusError{Status(ErrorCode::kInvalidArgument,
                             "parameter '" + what + "': dtype " + name + " has no fabric name")};
  }
  return check(parse_dtype(name));
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

TrainerRank trainer_of(uint32_t rank, uint32_t num_nics, const std::vector<ShardIn>& shards,
                       const std::string& call) {
  TrainerRank t{rank, num_nics, {}};
  for (size_t i = 0; i < shards.size(); ++i) {
    const auto& [name, dtype, shape, box, replica] = shards[i];
    const std::string what = call + ": shards[" + std::to_string(i) + "].";
    Shard s{name,
            dtype_arg(dtype, name),
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
  return t;
}

// One parameter tuple; `what` prefixes the fields' names ("...: params[3].").
InferenceParam param_of(const ParamIn& param, const std::string& what) {
  const auto& [name, dtype, shape, dim, start, length, kind, sources, cdim, block] = param;
  // dim: a dimension, or -1 (any negative value) for a parameter held whole.
  const auto placement_dim = static_cast<int32_t>(
      signed_value(dim, (what + "dim").c_str(), std::numeric_limits<int32_t>::min(),
                   std::numeric_limits<int32_t>::max()));
  Shape param_shape = shape_of(shape, what + "shape");
  const Range range{u64(start, (what + "start").c_str()), u64(length, (what + "length").c_str())};
  const uint32_t concat_dim = u32(cdim, (what + "concat_dim").c_str());
  const uint32_t tile = u32(block, (what + "block").c_str());
  return InferenceParam{name, dtype_arg(dtype, name), std::move(param_shape),
                        Placement{placement_dim, range},
                        Projection{parse_kind(kind), sources, concat_dim, tile}};
}

py::tuple entry_tuple(const Entry& e) {
  return py::make_tuple(e.trainer, e.nic, e.param, e.inference, e.src_offset, e.length, e.runs,
                        e.src_stride, e.dst_offset, e.dst_stride);
}

std::vector<std::string> dtype_names(const std::vector<DType>& dtypes) {
  std::vector<std::string> out;
  for (DType d : dtypes) out.emplace_back(to_string(d));
  return out;
}

py::tuple param_tuple(const ScheduledParam& p) {
  return py::make_tuple(p.name, std::string(to_string(p.dtype)), p.shape,
                        std::string(to_string(p.projection.kind)), p.projection.sources,
                        p.projection.dim, p.projection.block, p.source_shapes,
                        dtype_names(p.source_dtypes), p.senders);
}

// The tuple's item or slice `index`, as the tuple reads it: the classes below also read by
// position, in the order of the tuples they replace.
py::object item(const py::tuple& t, const py::object& index) {
  return t.attr("__getitem__")(index);
}

// Reading by position (and slices), length, equality, hash and repr of a class that replaces
// a tuple: `as_tuple` gives that tuple.
template <typename T, typename F>
void def_tuple_protocol(py::class_<T>& cls, const char* name, F as_tuple) {
  cls.def(
         "__getitem__",
         [as_tuple](const T& x, const py::object& i) { return item(as_tuple(x), i); },
         py::arg("index"))
      .def("__len__", [as_tuple](const T& x) { return as_tuple(x).size(); })
      .def(
          "__eq__", [](const T& a, const T& b) { return a == b; }, py::arg("other"),
          py::is_operator())
      .def("__hash__", [as_tuple](const T& x) { return py::hash(py::repr(as_tuple(x))); })
      .def("__repr__", [as_tuple, name](const T& x) {
        return std::string(name) + py::cast<std::string>(py::repr(as_tuple(x)));
      });
}

std::vector<Endpoint> endpoints_of(const std::vector<std::string>& data) {
  std::vector<Endpoint> out;
  for (size_t i = 0; i < data.size(); ++i) {
    auto e = decode_endpoint(view(data[i]));
    if (!e) {
      throw StatusError{Status(e.status().code(), "inference endpoint " + std::to_string(i) + ": " +
                                                      e.status().message())};
    }
    out.push_back(std::move(*e));
  }
  return out;
}

py::dict stats_dict(const PushStats& s) {
  py::dict d;
  d["wait_ready"] = s.wait_ready;
  d["project"] = s.project;
  d["post"] = s.post;
  d["wait_ring"] = s.wait_ring;
  d["drain"] = s.drain;
  d["bytes"] = s.bytes;
  d["writes"] = s.writes;
  d["temp_high_water"] = s.temp_high_water;
  return d;
}

// Sources as (data pointer, bytes, on_gpu) tuples, read without a conversion per field.
std::vector<Source> sources_of(const py::sequence& seq, const char* what) {
  std::vector<Source> out;
  out.reserve(seq.size());
  for (py::handle h : seq) {
    auto t = py::reinterpret_borrow<py::tuple>(h);
    if (!PyTuple_Check(h.ptr()) || t.size() != 3) {
      throw py::type_error(std::string(what) + ": expected (data_ptr, bytes, on_gpu) tuples");
    }
    out.push_back(Source{reinterpret_cast<const void*>(py::cast<uintptr_t>(t[0])),
                         py::cast<uint64_t>(t[1]), py::cast<bool>(t[2])});
  }
  return out;
}

std::chrono::milliseconds millis(double seconds, const char* what) {
  if (!(seconds >= 0) || seconds > 1e9) {
    throw StatusError{Status(ErrorCode::kInvalidArgument,
                             std::string(what) + ": must be a finite, non-negative duration")};
  }
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

// An endpoint from a layout, the regions' descriptors and (region, offset) per parameter and
// copy; what a reader would refuse is refused here.
Endpoint endpoint_of(InferenceRank layout, const py::sequence& regions,
                     const std::vector<std::vector<std::pair<IntArg, IntArg>>>& places) {
  Endpoint e;
  e.layout = std::move(layout);
  for (py::handle r : regions) e.regions.push_back(to_remote(r, "endpoint: region"));
  for (size_t i = 0; i < places.size(); ++i) {
    auto& out = e.places.emplace_back();
    for (const auto& [region, offset] : places[i]) {
      out.push_back(
          Place{u32(region, "endpoint: place region"), u64(offset, "endpoint: place offset")});
    }
  }
  check(decode_endpoint(encode(e)).status());
  return e;
}

// A torch tensor's memory and form, as quantize_fp8 checks them.
struct TensorArg {
  uintptr_t ptr = 0;
  uint64_t bytes = 0;
  std::string device;  // "cpu", "cuda:0", ...
  std::string dtype;   // "torch.bfloat16", ...
  std::vector<uint64_t> shape;
  bool contiguous = false;
};

TensorArg tensor_arg(py::handle t) {
  return TensorArg{
      py::cast<uintptr_t>(t.attr("data_ptr")()),
      py::cast<uint64_t>(t.attr("numel")()) * py::cast<uint64_t>(t.attr("element_size")()),
      py::str(t.attr("device")),
      py::str(t.attr("dtype")),
      py::cast<std::vector<uint64_t>>(t.attr("shape")),
      py::cast<bool>(t.attr("is_contiguous")())};
}

// The CPU reference on one matrix of host memory.
Status quantize_cpu(const Fp8Matrix& m, uint32_t block) {
  const Shape tiles = fp8_scale_shape(m.rows, m.cols, block);
  return quantize_fp8_blocks_cpu(std::span(static_cast<const uint16_t*>(m.bf16), m.rows * m.cols),
                                 m.rows, m.cols, block,
                                 std::span(static_cast<uint8_t*>(m.out), m.rows * m.cols),
                                 std::span(m.scales, tiles[0] * tiles[1]));
}

// fn(registry) with the GIL released, on the C++ registry of a fabric_lib Registry.
template <typename Fn>
auto on_registry(py::handle registry, Fn&& fn) {
  std::shared_ptr<kv::Registry> r = registry_of(registry);
  py::gil_scoped_release nogil;
  auto out = fn(*r);
  r.reset();
  return out;
}

// WeightSender for Python: holds its engine (the C++ engine lives as long as it).
class PySender {
 public:
  PySender(py::object engine, const IntArg& rank, const IntArg& num_nics, double timeout)
      : engine_(std::move(engine)) {
    SenderOptions o;
    o.rank = u32(rank, "WeightSender: rank");
    o.num_nics = u32(num_nics, "WeightSender: num_nics");
    o.timeout = millis(timeout, "WeightSender: timeout");
    rank_ = o.rank;
    num_nics_ = o.num_nics;
    TransferEngine& e = engine_of(engine_);
    auto made = [&] {
      py::gil_scoped_release nogil;
      return WeightSender::create(e, o);
    }();
    sender_ = check(std::move(made));
  }
  // Waits (bounded) for writes of an interrupted push; at interpreter exit leaks it instead.
  ~PySender() {
    if (interpreter_finalizing()) {
      (void)sender_.release();
      return;
    }
    py::gil_scoped_release nogil;
    sender_.reset();
  }

  void connect(const Schedule& schedule, const std::vector<std::string>& endpoints,
               const py::sequence& addresses, py::handle ring, const IntArg& ring_ptr,
               const IntArg& ring_bytes, bool on_gpu) {
    std::vector<Address> addrs;
    for (py::handle a : addresses) addrs.push_back(to_address(a, "WeightSender.connect: address"));
    StagingRing r{registration_of(ring, engine_),
                  reinterpret_cast<void*>(u64(ring_ptr, "WeightSender.connect: ring_ptr")),
                  u64(ring_bytes, "WeightSender.connect: ring_bytes"), on_gpu};
    std::vector<Endpoint> eps = endpoints_of(endpoints);
    engine_of(engine_);  // Closed when it is
    py::gil_scoped_release nogil;
    check(sender_->connect(schedule, std::move(eps), std::move(addrs), r));
  }

  // Publishes this training rank's shards as its member of `group` (tp_size `world`).
  void publish(py::handle registry, const std::string& group, const IntArg& world,
               const std::vector<ShardIn>& shards) {
    const uint32_t w = u32(world, "WeightSender.publish: world");
    const Bytes description = encode(trainer_of(rank_, num_nics_, shards, "WeightSender.publish"));
    const Address address = engine_of(engine_).address();
    check(on_registry(registry, [&](kv::Registry& r) {
      return publish_rank(r, group, Side::kTrainer, rank_, w, address, description);
    }));
  }

  // connect_trainer (rank 0 publishes the schedule's header, the others check theirs against
  // it), then connect to the inference ranks it names and, with world > 1, plan the gathers.
  Schedule connect_registry(py::handle registry, const std::string& group, const IntArg& world,
                            const IntArg& num_inference, const IntArg& chunk_bytes, double timeout,
                            py::handle ring, const IntArg& ring_ptr, const IntArg& ring_bytes,
                            bool on_gpu) {
    const uint32_t w = u32(world, "WeightSender.connect_registry: world");
    const uint32_t n = u32(num_inference, "WeightSender.connect_registry: num_inference");
    const uint64_t chunk = u64(chunk_bytes, "WeightSender.connect_registry: chunk_bytes");
    const auto wait = millis(timeout, "WeightSender.connect_registry: timeout");
    StagingRing r{registration_of(ring, engine_),
                  reinterpret_cast<void*>(u64(ring_ptr, "WeightSender.connect_registry: ring_ptr")),
                  u64(ring_bytes, "WeightSender.connect_registry: ring_bytes"), on_gpu};
    Agreement a = check(on_registry(registry, [&](kv::Registry& reg) {
      return connect_trainer(reg, group, rank_, w, n, chunk, wait);
    }));
    engine_of(engine_);  // Closed when it is
    py::gil_scoped_release nogil;
    check(
        sender_->connect(a.schedule, std::move(a.endpoints), std::move(a.inference_addresses), r));
    if (w > 1) check(sender_->plan_gathers(std::move(a.trainers)));
    return std::move(a.schedule);
  }

  // Withdraws this rank's member (and on rank 0 the schedule's header).
  void withdraw(py::handle registry, const std::string& group) {
    check(on_registry(
        registry, [&](kv::Registry& r) { return withdraw_rank(r, group, Side::kTrainer, rank_); }));
  }

  void plan_gathers(const std::vector<std::string>& trainers) {
    std::vector<TrainerRank> t;
    for (const auto& b : trainers) t.push_back(check(decode_trainer(view(b))));
    check(sender_->plan_gathers(std::move(t)));
  }
  GatherStep gather(const IntArg& param, const IntArg& source) const {
    return sender_->gather(u32(param, "WeightSender.gather: param"),
                           u32(source, "WeightSender.gather: source"));
  }
  std::vector<uint32_t> order() const { return sender_->order(); }
  bool sends(const IntArg& param) const { return sender_->sends(u32(param, "sends: param")); }

  void begin(const IntArg& version, const IntArg& stream) {
    const uint64_t v = u64(version, "WeightSender.begin: version");
    void* st = reinterpret_cast<void*>(u64(stream, "WeightSender.begin: stream"));
    engine_of(engine_);
    py::gil_scoped_release nogil;
    check(sender_->begin(v, st));
  }

  void stage(const IntArg& param, const py::sequence& sources, bool persistent) {
    const uint32_t p = u32(param, "WeightSender.stage: param");
    std::vector<Source> in = sources_of(sources, "WeightSender.stage: sources");
    Status st;
    {
      py::gil_scoped_release nogil;
      st = sender_->stage(p, in, persistent);
    }
    rethrow_on_param();
    check(st);
  }

  py::dict finish() {
    Result<PushStats> r = Status(ErrorCode::kInternal, "unset");
    {
      py::gil_scoped_release nogil;
      r = sender_->finish();
    }
    rethrow_on_param();
    return stats_dict(check(std::move(r)));
  }

  // The training parameters push() reads: names, bytes and sides, kept until called again.
  void set_sources(std::vector<std::string> names, const std::vector<IntArg>& bytes,
                   const std::vector<bool>& on_gpu) {
    if (bytes.size() != names.size() || on_gpu.size() != names.size()) {
      throw StatusError{Status(ErrorCode::kInvalidArgument,
                               "WeightSender.set_sources: one size and one side per name")};
    }
    std::vector<Source> templates;
    for (size_t i = 0; i < names.size(); ++i) {
      templates.push_back(Source{nullptr, u64(bytes[i], "WeightSender.set_sources: bytes"),
                                 static_cast<bool>(on_gpu[i])});
    }
    names_ = std::move(names);
    templates_ = std::move(templates);
  }

  // The push of a rank holding every parameter whole: one data pointer per source of
  // set_sources, in its order (what changes between pushes), then WeightSender::push.
  py::dict push(const IntArg& version, const std::vector<uintptr_t>& pointers,
                const IntArg& stream) {
    const uint64_t v = u64(version, "WeightSender.push: version");
    void* st = reinterpret_cast<void*>(u64(stream, "WeightSender.push: stream"));
    if (pointers.size() != templates_.size()) {
      throw StatusError{Status(ErrorCode::kInvalidArgument,
                               "WeightSender.push: " + std::to_string(pointers.size()) +
                                   " pointers for " + std::to_string(templates_.size()) +
                                   " sources (set_sources)")};
    }
    for (size_t i = 0; i < pointers.size(); ++i) {
      templates_[i].data = reinterpret_cast<const void*>(pointers[i]);
    }
    engine_of(engine_);
    Result<PushStats> r = Status(ErrorCode::kInternal, "unset");
    {
      py::gil_scoped_release nogil;
      r = sender_->push(v, names_, templates_, st);
    }
    rethrow_on_param();
    return stats_dict(check(std::move(r)));
  }

  // on_param(name) after each parameter's writes are posted, on the pushing thread; what it
  // raises is raised by the call that posted (the push goes on meanwhile).
  void set_on_param(py::object fn) {
    on_param_ = std::move(fn);
    if (on_param_.is_none()) {
      sender_->set_on_posted(nullptr);
      return;
    }
    sender_->set_on_posted([this](uint32_t param) {
      py::gil_scoped_acquire gil;
      if (error_) return;
      try {
        on_param_(text(sender_->schedule().params[param].name));
      } catch (py::error_already_set& e) {
        error_ = std::make_unique<py::error_already_set>(std::move(e));
      }
    });
  }

 private:
  void rethrow_on_param() {
    if (!error_) return;
    auto e = std::move(error_);
    e->restore();
    throw py::error_already_set();
  }

  py::object engine_;
  uint32_t rank_ = 0;
  uint32_t num_nics_ = 1;
  std::unique_ptr<WeightSender> sender_;
  py::object on_param_ = py::none();
  std::unique_ptr<py::error_already_set> error_;
  std::vector<std::string> names_;  // set_sources
  std::vector<Source> templates_;
};

// WeightReceiver for Python: callbacks take the GIL for their Python part.
class PyReceiver {
 public:
  PyReceiver(py::object engine, const IntArg& rank, bool flip, const IntArg& imm_base,
             double timeout)
      : engine_(std::move(engine)) {
    ReceiverOptions o;
    o.rank = u32(rank, "WeightReceiver: rank");
    o.flip = flip;
    o.imm_base = u32(imm_base, "WeightReceiver: imm_base");
    o.timeout = millis(timeout, "WeightReceiver: timeout");
    rank_ = o.rank;
    timeout_ = o.timeout;
    receiver_ = check(WeightReceiver::create(engine_of(engine_), o));
  }
  ~PyReceiver() {
    if (interpreter_finalizing()) {
      // Its timer thread may wait for the GIL: leaked, not joined.
      (void)new std::shared_ptr<WeightReceiver>(std::move(receiver_));
      return;
    }
    close();
  }

  // Checks `tensor` (contiguous; its element size and count those of `dtype`, default its own,
  // and of its slice: all of `shape`, default its own, or tensor.shape[dim] from `start` along
  // `dim`) and records parameter `name`, published by publish(). InvalidArgument naming it.
  void add(const std::string& name, py::handle tensor,
           const std::optional<std::vector<IntArg>>& shape, const std::optional<IntArg>& dim,
           const IntArg& start, const std::string& projection,
           const std::vector<std::string>& sources, const IntArg& concat_dim, const IntArg& block,
           py::handle dtype) {
    auto bad = [&](const std::string& what) {
      return StatusError{Status(ErrorCode::kInvalidArgument, "parameter '" + name + "': " + what)};
    };
    if (!py::cast<bool>(tensor.attr("is_contiguous")())) throw bad("the tensor must be contiguous");
    const std::string own = py::str(tensor.attr("dtype"));
    const DType d = dtype_arg(dtype.is_none() ? own : std::string(py::str(dtype)), name);
    const auto dims = py::cast<std::vector<uint64_t>>(tensor.attr("shape"));
    Shape global = shape ? shape_of(*shape, "parameter '" + name + "': shape") : dims;
    Placement placement{-1, {u64(start, "WeightReceiver.add: start"), 0}};
    uint64_t local = num_elements(global);
    if (dim) {
      const uint32_t k = u32(*dim, "WeightReceiver.add: dim");
      if (k >= dims.size() || k >= global.size()) {
        throw bad("dim " + std::to_string(k) + " is not a dimension of the tensor and its shape");
      }
      placement = Placement{static_cast<int32_t>(k), {placement.range.start, dims[k]}};
      local = num_elements(global) / std::max<uint64_t>(1, global[k]) * dims[k];
    }
    if (py::cast<uint64_t>(tensor.attr("element_size")()) != element_bytes(d)) {
      throw bad("a " + own + " tensor cannot hold " + std::string(to_string(d)) + " elements");
    }
    if (const auto numel = py::cast<uint64_t>(tensor.attr("numel")()); numel != local) {
      std::string text;
      for (uint64_t n : global) text += (text.empty() ? "" : ", ") + std::to_string(n);
      throw bad("the tensor has " + std::to_string(numel) + " elements, its slice of [" + text +
                "] has " + std::to_string(local));
    }
    params_.push_back(InferenceParam{name, d, std::move(global), placement,
                                     Projection{parse_kind(projection), sources,
                                                u32(concat_dim, "WeightReceiver.add: concat_dim"),
                                                u32(block, "WeightReceiver.add: block")}});
  }

  // Publishes the endpoint (the parameters added, `regions`' descriptors, per parameter and
  // copy (region, offset)) as this rank's member of `group`, and fails a pending version when a
  // training rank of the group leaves the registry.
  void publish(py::object registry, const std::string& group, const py::sequence& regions,
               const std::vector<std::vector<std::pair<IntArg, IntArg>>>& places) {
    const Bytes endpoint = encode(endpoint_of(InferenceRank{rank_, params_}, regions, places));
    const Address address = engine_of(engine_).address();
    std::weak_ptr<WeightReceiver> weak = receiver_;
    const bool watch = registry_.is_none();
    check(on_registry(registry, [&](kv::Registry& r) {
      Status s = publish_rank(r, group, Side::kInference, rank_, 1, address, endpoint);
      return s && watch ? watch_trainers(r, group, weak) : s;
    }));
    registry_ = std::move(registry);
    group_ = group;
  }

  // The first call agrees on the schedule (agree_schedule, within the timeout); every call
  // arms `version` for this rank's writes and sends Ready to the group's training ranks in the
  // registry (PeerUnreachable naming the version when fewer than the schedule's).
  py::tuple prepare_version(const IntArg& version, py::object on_complete, py::object on_fail) {
    const uint64_t v = u64(version, "WeightReceiver.prepare_version: version");
    if (registry_.is_none()) {
      throw StatusError{
          Status(ErrorCode::kInvalidArgument, "WeightReceiver.prepare_version: publish first")};
    }
    if (!schedule_) {
      schedule_ = check(on_registry(registry_, [&](kv::Registry& r) {
                    return agree_schedule(r, group_, timeout_);
                  })).schedule;
    }
    auto peers = on_registry(registry_, [&](kv::Registry& r) {
      return trainer_peers(r, group_, schedule_->num_trainers);
    });
    if (!peers) {
      throw StatusError{Status(peers.status().code(),
                               "version " + std::to_string(v) + ": " + peers.status().message())};
    }
    return arm(v, schedule_->writes_into(rank_), std::move(*peers), std::move(on_complete),
               std::move(on_fail));
  }

  void withdraw(py::handle registry, const std::string& group) {
    check(on_registry(registry, [&](kv::Registry& r) {
      return withdraw_rank(r, group, Side::kInference, rank_);
    }));
  }

  const std::optional<Schedule>& schedule() const { return schedule_; }

  py::tuple prepare(const IntArg& version, const IntArg& expected, const py::sequence& trainers,
                    py::object on_complete, py::object on_fail) {
    const uint64_t v = u64(version, "WeightReceiver.prepare: version");
    const uint64_t n = u64(expected, "WeightReceiver.prepare: expected");
    std::vector<TrainerPeer> peers;
    for (py::handle t : trainers) {
      auto tup = py::cast<py::tuple>(t);
      if (tup.size() != 3) {
        throw py::type_error("WeightReceiver.prepare: trainers are (rank, name, address)");
      }
      peers.push_back(TrainerPeer{u32(py::cast<IntArg>(tup[0]), "trainers: rank"),
                                  py::cast<std::string>(tup[1]),
                                  to_address(tup[2], "WeightReceiver.prepare: trainer address")});
    }
    return arm(v, n, std::move(peers), std::move(on_complete), std::move(on_fail));
  }

 private:
  py::tuple arm(uint64_t v, uint64_t n, std::vector<TrainerPeer> peers, py::object on_complete,
                py::object on_fail) {
    engine_of(engine_);
    auto ok = std::make_shared<PyRef>(std::move(on_complete));
    auto bad = std::make_shared<PyRef>(std::move(on_fail));
    auto done = [ok, bad](uint64_t version) {
      if (interpreter_finalizing()) return;
      py::gil_scoped_acquire gil;
      call_user(*ok, py::make_tuple(version));
      ok->reset();
      bad->reset();
    };
    auto failed = [ok, bad](uint64_t version, const Status& error) {
      if (interpreter_finalizing()) return;
      py::gil_scoped_acquire gil;
      call_user(*bad, py::make_tuple(version, make_exception(error)));
      ok->reset();
      bad->reset();
    };
    Result<Ready> r = Status(ErrorCode::kInternal, "unset");
    {
      py::gil_scoped_release nogil;
      r = receiver_->prepare(v, n, std::move(peers), done, failed);
    }
    const Ready ready = check(std::move(r));
    return py::make_tuple(ready.imm, ready.copy);
  }

 public:
  void fail_trainer(const std::string& name) {
    py::gil_scoped_release nogil;
    receiver_->fail_trainer(name);
  }
  void close() {
    if (!receiver_) return;
    py::gil_scoped_release nogil;
    receiver_->close();
  }
  uint8_t active_copy() const { return receiver_->active_copy(); }
  std::optional<uint64_t> version() const { return receiver_->version(); }
  bool half_written() const { return receiver_->half_written(); }
  py::object progress() const {
    auto p = receiver_->progress();
    if (!p) return py::none();
    return py::make_tuple(p->version, p->landed, p->expected);
  }

 private:
  py::object engine_;
  uint32_t rank_ = 0;
  std::chrono::milliseconds timeout_{0};
  std::shared_ptr<WeightReceiver> receiver_;
  std::vector<InferenceParam> params_;  // add
  py::object registry_ = py::none();    // publish
  std::string group_;
  std::optional<Schedule> schedule_;  // agreed at the first prepare_version
};

}  // namespace

void bind_weights(py::module_& m) {
  m.def(
      "_weights_encode_trainer",
      [](const IntArg& rank, const IntArg& num_nics, const std::vector<ShardIn>& shards) {
        return to_py(encode(trainer_of(u32(rank, "_weights_encode_trainer: rank"),
                                       u32(num_nics, "_weights_encode_trainer: num_nics"), shards,
                                       "_weights_encode_trainer")));
      },
      py::arg("rank"), py::arg("num_nics"), py::arg("shards"),
      "A training rank's shards as bytes: (name, dtype, shape, box, replica) each.");
  m.def(
      "_weights_encode_inference",
      [](const IntArg& rank, const std::vector<ParamIn>& params) {
        InferenceRank r{u32(rank, "_weights_encode_inference: rank"), {}};
        for (size_t i = 0; i < params.size(); ++i) {
          r.params.push_back(
              param_of(params[i], "_weights_encode_inference: params[" + std::to_string(i) + "]."));
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

  py::class_<Entry> entry_class(
      m, "WeightEntry",
      "One entry of a WeightSchedule: `runs` runs of `length` bytes, the i-th from "
      "projected-tensor byte src_offset + i * src_stride into the inference rank's "
      "tensor at dst_offset + i * dst_stride. Also read by position, in the order "
      "of its fields.");
  entry_class.def_readonly("trainer", &Entry::trainer, "The training rank that writes it.")
      .def_readonly("nic", &Entry::nic, "Its NIC on that rank.")
      .def_readonly("param", &Entry::param, "Index into WeightSchedule.params.")
      .def_readonly("inference", &Entry::inference, "The inference rank written into.")
      .def_readonly("src_offset", &Entry::src_offset,
                    "Byte offset of the first run in the projected tensor.")
      .def_readonly("length", &Entry::length, "Bytes per run.")
      .def_readonly("runs", &Entry::runs, "Runs (writes, one immediate each).")
      .def_readonly("src_stride", &Entry::src_stride, "Bytes between runs in the projected tensor.")
      .def_readonly("dst_offset", &Entry::dst_offset,
                    "Byte offset of the first run in the inference rank's tensor.")
      .def_readonly("dst_stride", &Entry::dst_stride,
                    "Bytes between runs in the inference rank's tensor.")
      .def_property_readonly("bytes", &Entry::bytes, "length * runs.");
  def_tuple_protocol(entry_class, "WeightEntry", entry_tuple);
  py::class_<ScheduledParam> param_class(
      m, "WeightParam",
      "A projected parameter of a WeightSchedule. Also read by position: (name, dtype, shape, "
      "kind, sources, concat_dim, block, source_shapes, source_dtypes, senders).");
  param_class.def_readonly("name", &ScheduledParam::name, "The inference name.")
      .def_property_readonly(
          "dtype", [](const ScheduledParam& p) { return std::string(to_string(p.dtype)); },
          "Its dtype's fabric name (bf16, fp8_e4m3, ...).")
      .def_readonly("shape", &ScheduledParam::shape, "Projected, global.")
      .def_property_readonly(
          "kind", [](const ScheduledParam& p) { return std::string(to_string(p.projection.kind)); },
          "identity, concat, fp8_quantize or fp8_scale.")
      .def_property_readonly(
          "sources", [](const ScheduledParam& p) { return p.projection.sources; },
          "Training parameter names.")
      .def_property_readonly(
          "concat_dim", [](const ScheduledParam& p) { return p.projection.dim; },
          "With several sources, the dimension they are joined on.")
      .def_property_readonly(
          "block", [](const ScheduledParam& p) { return p.projection.block; },
          "FP8 kinds: the tile's rows and columns.")
      .def_readonly("source_shapes", &ScheduledParam::source_shapes, "Per source.")
      .def_property_readonly(
          "source_dtypes", [](const ScheduledParam& p) { return dtype_names(p.source_dtypes); },
          "Per source, fabric names.")
      .def_readonly("senders", &ScheduledParam::senders,
                    "Training ranks that may send it (they hold all its sources).");
  def_tuple_protocol(param_class, "WeightParam", param_tuple);

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
          "params", [](const Schedule& s) { return s.params; },
          "WeightParam per parameter, by name; entries refer to them by index.")
      .def(
          "entries",
          [](const Schedule& s, const std::optional<IntArg>& trainer_arg) {
            std::optional<uint32_t> trainer;
            if (trainer_arg) trainer = u32(*trainer_arg, "WeightSchedule.entries: trainer");
            std::vector<Entry> out;
            for (const Entry& e : s.entries) {
              if (!trainer || e.trainer == *trainer) out.push_back(e);
            }
            return out;
          },
          py::arg("trainer") = py::none(), "WeightEntry per entry, of one trainer or all.")
      .def_property_readonly(
          "push_order", [](const Schedule& s) { return push_order(s); },
          "Parameter indices in the order every training rank walks them: by sources, then by "
          "name (an FP8 weight and its scales, a fused gate/up and the up it holds, follow one "
          "another).")
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
      "_weights_encode_endpoint",
      [](const py::bytes& layout, const py::sequence& regions,
         const std::vector<std::vector<std::pair<IntArg, IntArg>>>& places) {
        return to_py(encode(endpoint_of(check(decode_inference(view(layout))), regions, places)));
      },
      py::arg("layout"), py::arg("regions"), py::arg("places"),
      "An inference rank's endpoint as bytes: its encoded layout, its regions' descriptors and "
      "per parameter, per copy, (region index, byte offset).");
  auto boxes = [](const std::vector<std::pair<uint32_t, std::vector<Range>>>& v) {
    std::vector<std::pair<uint32_t, std::vector<std::pair<uint64_t, uint64_t>>>> out;
    for (const auto& [rank, box] : v) {
      auto& o = out.emplace_back(rank, std::vector<std::pair<uint64_t, uint64_t>>{}).second;
      for (const Range& r : box) o.emplace_back(r.start, r.length);
    }
    return out;
  };
  py::class_<GatherStep>(m, "WeightGather",
                         "What a training rank does for one source of one parameter in a push "
                         "with gathers (WeightSender.gather).")
      .def_readonly("reuse", &GatherStep::reuse,
                    "It holds the source whole from the parameter before in push order.")
      .def_property_readonly(
          "sends", [boxes](const GatherStep& g) { return boxes(g.sends); },
          "(to rank, this rank's box) per shard it sends; a box is [(start, length)] per "
          "dimension, [] for the whole tensor.")
      .def_property_readonly(
          "recvs", [boxes](const GatherStep& g) { return boxes(g.recvs); },
          "(from rank, its box) per shard it receives.");

  py::class_<PySender>(m, "WeightSender",
                       "The training side of the push (fabric/weights/flow.h): takes the "
                       "engine's receive handler for Ready messages; projects into the staging "
                       "ring and posts the schedule's writes in batches.")
      .def(py::init<py::object, const IntArg&, const IntArg&, double>(), py::arg("engine"),
           py::arg("rank"), py::arg("num_nics") = 1, py::arg("timeout") = 30.0,
           "Training rank `rank` of `engine`, whose receive handler it takes (AlreadyExists "
           "when taken); `timeout` seconds bound every wait of a push.")
      .def("connect", &PySender::connect, py::arg("schedule"), py::arg("endpoints"),
           py::arg("addresses"), py::arg("ring"), py::arg("ring_ptr"), py::arg("ring_bytes"),
           py::arg("on_gpu"),
           "The schedule, the inference endpoints (bytes) and addresses by rank, the ring's "
           "Registration, address, size and side. Blocks briefly (a peer group).")
      .def("publish", &PySender::publish, py::arg("registry"), py::arg("group"), py::arg("world"),
           py::arg("shards"),
           "Publishes this training rank's (name, dtype, shape, box, replica) shards as its "
           "member <group>.t<rank> of `registry` (tp_size `world`).")
      .def("connect_registry", &PySender::connect_registry, py::arg("registry"), py::arg("group"),
           py::arg("world"), py::arg("num_inference"), py::arg("chunk_bytes"), py::arg("timeout"),
           py::arg("ring"), py::arg("ring_ptr"), py::arg("ring_bytes"), py::arg("on_gpu"),
           "Waits (up to `timeout` seconds) for the group's ranks in `registry`; rank 0 computes "
           "the schedule and publishes its header, the others compute it and check it against "
           "the header; then connect (the ring as there) and, with world > 1, plan_gathers. "
           "Returns the schedule. Timeout / InvalidArgument naming what is missing or differs.")
      .def("withdraw", &PySender::withdraw, py::arg("registry"), py::arg("group"),
           "Withdraws this rank's member (and on rank 0 the schedule's header); one already gone "
           "is no error.")
      .def("plan_gathers", &PySender::plan_gathers, py::arg("trainers"),
           "Plans the gathers of every push from every training rank's description (bytes).")
      .def("gather", &PySender::gather, py::arg("param"), py::arg("source"),
           "This rank's WeightGather for source `source` (an index) of parameter `param`.")
      .def_property_readonly("order", &PySender::order, "WeightSchedule.push_order.")
      .def("sends", &PySender::sends, py::arg("param"),
           "Whether this rank writes parameter `param`.")
      .def("begin", &PySender::begin, py::arg("version"), py::arg("stream") = 0,
           "Waits for the Ready of every inference rank written (Timeout naming the missing).")
      .def("stage", &PySender::stage, py::arg("param"), py::arg("sources"),
           py::arg("persistent") = false,
           "Projects parameter `param` from (data_ptr, bytes, on_gpu) sources into the ring; "
           "posts a batch when enough is staged. Blocks while the ring is full.")
      .def("finish", &PySender::finish,
           "Posts the rest and waits for every write; returns the stage times and counts.")
      .def("set_sources", &PySender::set_sources, py::arg("names"), py::arg("bytes"),
           py::arg("on_gpu"),
           "The training parameters push() reads: name, bytes and whether on a GPU, each.")
      .def("push", &PySender::push, py::arg("version"), py::arg("pointers"), py::arg("stream") = 0,
           "begin, stage of every parameter this rank sends (the data pointer of each source "
           "of set_sources, valid until it returns), finish. Returns the stage times and "
           "counts.")
      .def("set_on_param", &PySender::set_on_param, py::arg("fn"),
           "fn(name) after each parameter's writes are posted (None: none).");

  py::class_<PyReceiver>(m, "WeightReceiver",
                         "The inference side's version protocol (fabric/weights/flow.h).")
      .def(py::init<py::object, const IntArg&, bool, const IntArg&, double>(), py::arg("engine"),
           py::arg("rank"), py::arg("flip") = true, py::arg("imm_base") = 0xA0000000u,
           py::arg("timeout") = 30.0,
           "Inference rank `rank`: immediates imm_base + n (n counts prepares, 2^24 of them); "
           "flip: two copies; a version not complete within `timeout` seconds fails.")
      .def("prepare", &PyReceiver::prepare, py::arg("version"), py::arg("expected"),
           py::arg("trainers"), py::arg("on_complete"), py::arg("on_fail"),
           "Arms the next immediate for `expected` writes and sends Ready to each (rank, name, "
           "address) trainer; on_complete(version) or on_fail(version, exception) runs once. "
           "Returns (imm, copy).")
      .def("add", &PyReceiver::add, py::arg("name"), py::arg("tensor"), py::arg("shape"),
           py::arg("dim"), py::arg("start"), py::arg("projection"), py::arg("sources"),
           py::arg("concat_dim"), py::arg("block"), py::arg("dtype"),
           "Checks a torch tensor against the parameter it holds (contiguous, element size and "
           "count; InvalidArgument naming it) and records the parameter for publish.")
      .def("publish", &PyReceiver::publish, py::arg("registry"), py::arg("group"),
           py::arg("regions"), py::arg("places"),
           "Publishes the endpoint (the parameters added, the regions' descriptors, (region, "
           "offset) per parameter and copy) as member <group>.i<rank> of `registry`, and fails "
           "a pending version when one of the group's training ranks leaves it.")
      .def("prepare_version", &PyReceiver::prepare_version, py::arg("version"),
           py::arg("on_complete"), py::arg("on_fail"),
           "prepare() through the registry of publish: the first call agrees on the schedule "
           "with training rank 0's header (within the timeout); Ready goes to the group's "
           "training ranks in the registry. Returns (imm, copy).")
      .def("withdraw", &PyReceiver::withdraw, py::arg("registry"), py::arg("group"),
           "Withdraws this rank's member; one already gone is no error.")
      .def_property_readonly("schedule", &PyReceiver::schedule,
                             "The schedule agreed at the first prepare_version (None before).")
      .def("fail_trainer", &PyReceiver::fail_trainer, py::arg("name"),
           "A training rank's member left: fails the pending version it was part of.")
      .def("close", &PyReceiver::close, "Fails a pending version with Closed.")
      .def_property_readonly("active_copy", &PyReceiver::active_copy,
                             "The copy of the last complete version.")
      .def_property_readonly("version", &PyReceiver::version, "The last complete version.")
      .def_property_readonly("half_written", &PyReceiver::half_written,
                             "In place: a version failed and none completed since.")
      .def_property_readonly("progress", &PyReceiver::progress,
                             "(version, writes landed, writes expected) of the pending version.");

  m.def(
      "_weights_publish_schedule",
      [](py::handle registry, const std::string& group, const IntArg& trainers,
         const IntArg& inference, const IntArg& chunk_bytes, double timeout) {
        const uint32_t t = u32(trainers, "_weights_publish_schedule: trainers");
        const uint32_t i = u32(inference, "_weights_publish_schedule: inference");
        const uint64_t chunk = u64(chunk_bytes, "_weights_publish_schedule: chunk_bytes");
        const auto wait = millis(timeout, "_weights_publish_schedule: timeout");
        return check(on_registry(registry,
                                 [&](kv::Registry& r) {
                                   return publish_schedule(r, group, t, i, chunk, wait);
                                 }))
            .schedule;
      },
      py::arg("registry"), py::arg("group"), py::arg("trainers"), py::arg("inference"),
      py::arg("chunk_bytes"), py::arg("timeout"),
      "Training rank 0's part (fabric/weights/rendezvous.h): waits for the group's ranks, "
      "computes the schedule, publishes its header <group>.schedule; returns the schedule.");
  m.def(
      "_weights_agree_schedule",
      [](py::handle registry, const std::string& group, double timeout) {
        const auto wait = millis(timeout, "_weights_agree_schedule: timeout");
        return check(on_registry(registry,
                                 [&](kv::Registry& r) { return agree_schedule(r, group, wait); }))
            .schedule;
      },
      py::arg("registry"), py::arg("group"), py::arg("timeout"),
      "Any other rank's part: waits for the header and the ranks it names, computes the "
      "schedule and checks it against the header's length and sha256; returns it.");
  m.def(
      "_weights_quantize_fp8_tensors",
      [](const std::vector<py::tuple>& jobs, const IntArg& block_arg,
         const std::map<std::string, uintptr_t>& streams) {
        const uint32_t block = u32(block_arg, "quantize_fp8: block");
        if (block == 0) {
          throw StatusError{Status(ErrorCode::kInvalidArgument, "quantize_fp8: block is 0")};
        }
        std::vector<Fp8Matrix> cpu;
        std::map<std::string, std::vector<Fp8Matrix>> gpu;  // by device
        for (const py::tuple& job : jobs) {
          if (job.size() != 3) throw py::type_error("quantize_fp8: jobs are (src, out, scales)");
          const TensorArg src = tensor_arg(job[0]), out = tensor_arg(job[1]);
          const TensorArg scales = tensor_arg(job[2]);
          const bool two_d = src.shape.size() == 2;
          const uint64_t rows = two_d ? src.shape[0] : 0, cols = two_d ? src.shape[1] : 0;
          const Shape tiles = fp8_scale_shape(rows, cols, block);
          if (!two_d || src.dtype != "torch.bfloat16" || !src.contiguous || !out.contiguous ||
              !scales.contiguous || out.device != src.device || scales.device != src.device ||
              out.bytes != rows * cols || scales.bytes != tiles[0] * tiles[1] * 4) {
            throw StatusError{Status(ErrorCode::kInvalidArgument,
                                     "quantize_fp8: a bf16 source (2-D, contiguous) on the device "
                                     "of its out and scales, sized rows x cols bytes and one f32 "
                                     "per tile")};
          }
          const Fp8Matrix m{reinterpret_cast<const void*>(src.ptr), rows, cols,
                            reinterpret_cast<void*>(out.ptr), reinterpret_cast<float*>(scales.ptr)};
          if (src.device == "cpu") {
            cpu.push_back(m);
          } else {
            gpu[src.device].push_back(m);
          }
        }
        for (const auto& [device, matrices] : gpu) {
          if (!streams.contains(device)) {
            throw StatusError{Status(ErrorCode::kInvalidArgument,
                                     "quantize_fp8: no stream for device " + device)};
          }
        }
        py::gil_scoped_release nogil;
        for (const Fp8Matrix& m : cpu) check(quantize_cpu(m, block));
        for (const auto& [device, matrices] : gpu) {
          check(quantize_fp8_blocks_cuda_many(matrices, block,
                                              reinterpret_cast<void*>(streams.at(device))));
        }
      },
      py::arg("jobs"), py::arg("block"), py::arg("streams"),
      "Internal: (bf16 source, e4m3 out, f32 scales) torch tensors quantised, checked here: "
      "host ones by the CPU reference, CUDA ones grouped by device in few launches of the "
      "kernel, on streams[str(device)].");
  m.attr("_WEIGHTS_HAS_CUDA") = has_cuda_projections();
}

}  // namespace fabric::python
