// Value types: Address and RemoteMemory (bytes, picklable), handles, routing, scatter targets,
// group info, and the typed configuration.
#include <pybind11/chrono.h>
#include <pybind11/stl_bind.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string_view>
#include <type_traits>

#include "bindings.h"

namespace fabric::python {
namespace {

// Reads a bytes-like object (bytes, bytearray, memoryview, ...) and hands its bytes to `fn`.
template <typename Fn>
auto with_bytes(py::handle obj, const char* what, Fn&& fn) {
  Py_buffer view;
  if (PyObject_GetBuffer(obj.ptr(), &view, PyBUF_SIMPLE) != 0) {
    PyErr_Clear();
    throw py::type_error(std::string(what) + ": expected bytes, not " +
                         utf8(py::type::handle_of(obj).attr("__qualname__")));
  }
  std::unique_ptr<Py_buffer, void (*)(Py_buffer*)> guard(&view, PyBuffer_Release);
  return fn(std::span<const std::byte>(static_cast<const std::byte*>(view.buf),
                                       static_cast<size_t>(view.len)));
}

py::bytes to_pybytes(const Bytes& b) {
  return py::bytes(reinterpret_cast<const char*>(b.data()), b.size());
}

// A signed int field (a CPU or GID index with negative specials) as a property.
template <typename C>
void int_property(py::class_<C>& cls, const char* name, int C::*field, const char* doc) {
  cls.def_property(
      name, getter(field),
      [field, what = qualified(cls, name)](C& c, const IntArg& v) {
        c.*field = static_cast<int>(signed_value(v, what.c_str(), std::numeric_limits<int>::min(),
                                                 std::numeric_limits<int>::max()));
      },
      doc);
}

// A duration field: read as a timedelta, set with a timedelta or seconds.
template <typename C, typename Duration>
void duration_property(py::class_<C>& cls, const char* name, Duration C::*field, const char* doc) {
  cls.def_property(
      name, getter(field),
      [field, what = qualified(cls, name)](C& c, py::handle v) {
        c.*field = to_duration<Duration>(v, what.c_str());
      },
      doc);
}

// A duration that may be unset (None): the engine then picks it (Config::auto_spin).
template <typename C, typename Duration>
void optional_duration_property(py::class_<C>& cls, const char* name,
                                std::optional<Duration> C::*field, const char* doc) {
  cls.def_property(
      name,
      [field](const C& c) -> py::object {
        if (!(c.*field)) return py::none();
        return py::cast(*(c.*field));
      },
      [field, what = qualified(cls, name)](C& c, py::handle v) {
        if (v.is_none()) {
          (c.*field).reset();
        } else {
          c.*field = to_duration<Duration>(v, what.c_str());
        }
      },
      doc);
}

// FaultConfig.fail_write: a Python callable run on the worker thread for each work request.
struct FailWriteHook {
  std::shared_ptr<PyRef> fn;
  bool operator()(uint64_t sequence) const {
    if (interpreter_finalizing()) return false;
    py::gil_scoped_acquire gil;
    InCallback in;  // on the worker: what waits for it (close()) is refused here
    try {
      py::object r = fn->get()(sequence);
      int truth = PyObject_IsTrue(r.ptr());
      if (truth < 0) throw py::error_already_set();
      return truth == 1;
    } catch (py::error_already_set& e) {
      report_callback_error(e, fn->get());
      return false;
    }
  }
};

// FaultConfig.receive_length_delta: a Python callable run on the worker thread for each
// receive completion; its int result is added to the length the provider reported.
struct LengthDeltaHook {
  std::shared_ptr<PyRef> fn;
  int64_t operator()(uint64_t sequence) const {
    if (interpreter_finalizing()) return 0;
    py::gil_scoped_acquire gil;
    InCallback in;  // on the worker: what waits for it (close()) is refused here
    try {
      py::object r = fn->get()(sequence);
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(r.ptr(), &overflow);
      if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
      if (overflow != 0) {
        PyErr_SetString(PyExc_OverflowError, "receive_length_delta: the result is not an int64");
        throw py::error_already_set();
      }
      return v;
    } catch (py::error_already_set& e) {
      report_callback_error(e, fn->get());
      return 0;
    }
  }
};

// A hook field of FaultConfig (a std::function) as a property holding a Python callable.
template <typename Hook, typename Fn>
void hook_property(py::class_<FaultConfig>& cls, const char* name, Fn FaultConfig::*field,
                   const char* doc) {
  cls.def_property(
      name,
      [field](const FaultConfig& f) -> py::object {
        if (const auto* hook = (f.*field).template target<Hook>()) return hook->fn->get();
        return py::none();
      },
      [field, name](FaultConfig& f, py::object fn) {
        if (fn.is_none()) {
          f.*field = nullptr;
        } else {
          if (!PyCallable_Check(fn.ptr()))
            throw py::type_error(std::string(name) + ": not callable");
          f.*field = Hook{std::make_shared<PyRef>(std::move(fn))};
        }
      },
      doc);
}

template <typename T>
py::object not_implemented_unless(py::handle other) {
  if (!py::isinstance<T>(other)) return py::reinterpret_borrow<py::object>(Py_NotImplemented);
  return py::object();
}

}  // namespace

Address to_address(py::handle obj, const char* what) {
  if (py::isinstance<Address>(obj)) return py::cast<Address>(obj);
  return with_bytes(obj, what, [&](std::span<const std::byte> b) {
    auto r = Address::decode(b);
    if (!r)
      throw StatusError{Status(r.status().code(), std::string(what) + ": " + r.status().message())};
    return std::move(*r);
  });
}

RemoteMemory to_remote(py::handle obj, const char* what) {
  if (py::isinstance<RemoteMemory>(obj)) return py::cast<RemoteMemory>(obj);
  return with_bytes(obj, what, [&](std::span<const std::byte> b) {
    auto r = RemoteMemory::decode(b);
    if (!r)
      throw StatusError{Status(r.status().code(), std::string(what) + ": " + r.status().message())};
    return std::move(*r);
  });
}

void bind_types(py::module_& m) {
  py::class_<Address>(m, "Address",
                      "The address of one device group of an engine: what a peer needs to reach "
                      "it. Converts to and from versioned bytes (bytes(a), Address(data)); "
                      "picklable, hashable, comparable.")
      .def(py::init([](py::handle data) { return to_address(data, "Address"); }), py::arg("data"),
           "Decodes bytes made by bytes(address); raises InvalidArgument.")
      .def_static(
          "from_hex", [](const std::string& hex) { return check(Address::from_hex(hex)); },
          py::arg("text"), "Decodes the lower-case hex form made by hex().")
      .def(
          "to_bytes", [](const Address& a) { return to_pybytes(a.encode()); },
          "The versioned encoding, as bytes.")
      .def(
          "__bytes__", [](const Address& a) { return to_pybytes(a.encode()); },
          "The versioned encoding, as bytes.")
      .def("hex", &Address::to_hex, "The encoding as lower-case hex text.")
      .def_property_readonly(
          "provider", [](const Address& a) { return a.provider(); },
          "The provider of the group, e.g. 'tcp;ofi_rxm'.")
      .def_property_readonly("num_nics", &Address::num_nics, "The number of NICs (rails).")
      .def_property_readonly("short_name", &Address::short_name,
                             "A short form for logs: provider, NIC count, a hash of the bytes.")
      .def(
          "__eq__",
          [](const Address& a, py::handle other) -> py::object {
            if (auto ni = not_implemented_unless<Address>(other)) return ni;
            return py::bool_(a == py::cast<const Address&>(other));
          },
          py::arg("other"), "Equal when the encodings are equal.")
      .def(
          "__hash__", [](const Address& a) { return py::hash(to_pybytes(a.encode())); },
          "The hash of the encoding.")
      .def(
          "__repr__", [](const Address& a) { return "Address('" + a.short_name() + "')"; },
          "Address('<short name>').")
      .def(py::pickle([](const Address& a) { return to_pybytes(a.encode()); },
                      [](py::bytes b) { return to_address(b, "Address.__setstate__"); }));

  py::class_<RemoteMemory>(m, "RemoteMemory",
                           "A registered region of a peer, as its owner described it: what a "
                           "writer needs. Converts to and from versioned bytes (bytes(d), "
                           "RemoteMemory(data)); picklable, hashable, comparable.")
      .def(py::init([](py::handle data) { return to_remote(data, "RemoteMemory"); }),
           py::arg("data"), "Decodes bytes made by bytes(descriptor); raises InvalidArgument.")
      .def_static(
          "from_hex", [](const std::string& hex) { return check(RemoteMemory::from_hex(hex)); },
          py::arg("text"), "Decodes the lower-case hex form made by hex().")
      .def(
          "to_bytes", [](const RemoteMemory& r) { return to_pybytes(r.encode()); },
          "The versioned encoding, as bytes.")
      .def(
          "__bytes__", [](const RemoteMemory& r) { return to_pybytes(r.encode()); },
          "The versioned encoding, as bytes.")
      .def("hex", &RemoteMemory::to_hex, "The encoding as lower-case hex text.")
      .def_property_readonly(
          "owner", [](const RemoteMemory& r) { return r.owner(); },
          "The Address of the owner's device group.")
      .def_property_readonly("base", &RemoteMemory::base,
                             "The owner's virtual address of the region (informational).")
      .def_property_readonly("length", &RemoteMemory::length, "The region's length in bytes.")
      .def_property_readonly(
          "staged", [](const RemoteMemory& r) { return r.staged_region() != 0; },
          "Whether the region is GPU memory its owner stages through pinned "
          "host memory (writes into it are copied to the GPU before their "
          "immediate counts).")
      .def_property_readonly("ipc_only", &RemoteMemory::ipc_only,
                             "Whether the region is GPU memory registered with "
                             "host_mirror=False: no rails, only same-host peers reach it over "
                             "CUDA IPC.")
      .def_property_readonly("readable", &RemoteMemory::readable,
                             "Whether its owner registered the region with remote_read=True: "
                             "peers may read it.")
      .def_property_readonly(
          "gpu_copies", [](const RemoteMemory& r) { return r.cuda_ipc() && r.cuda_ipc()->host; },
          "Whether the region is host memory registered with gpu_copies=True: same-host "
          "writers' GPU memory is copied into it by its owner's GPU over CUDA IPC.")
      .def_property_readonly(
          "rails",
          [](const RemoteMemory& r) {
            py::list out;
            for (const auto& rail : r.rails()) out.append(py::make_tuple(rail.addr, rail.key));
            return out;
          },
          "One (fabric address, key) pair per NIC, rail-aligned with the owner's NICs (none when "
          "ipc_only).")
      .def(
          "__eq__",
          [](const RemoteMemory& a, py::handle other) -> py::object {
            if (auto ni = not_implemented_unless<RemoteMemory>(other)) return ni;
            return py::bool_(a == py::cast<const RemoteMemory&>(other));
          },
          py::arg("other"), "Equal when the encodings are equal.")
      .def(
          "__hash__", [](const RemoteMemory& r) { return py::hash(to_pybytes(r.encode())); },
          "The hash of the encoding.")
      .def(
          "__len__", [](const RemoteMemory& r) { return r.length(); },
          "The region's length in bytes.")
      .def(
          "__repr__",
          [](const RemoteMemory& r) {
            return "RemoteMemory(" + std::to_string(r.length()) + " bytes of '" +
                   r.owner().short_name() + "')";
          },
          "RemoteMemory(<length> bytes of '<owner>').")
      .def(py::pickle([](const RemoteMemory& r) { return to_pybytes(r.encode()); },
                      [](py::bytes b) { return to_remote(b, "RemoteMemory.__setstate__"); }));

  py::class_<MemoryHandle>(m, "MemoryHandle",
                           "A local registration handle of one engine (Registration.handle). "
                           "Never reused: a handle kept after unregister() is unknown.")
      .def(py::init([](const IntArg& id) { return MemoryHandle{u64(id, "MemoryHandle: id")}; }),
           py::arg("id"), "A handle from its id (for handles kept as integers).")
      .def_property_readonly(
          "id", [](const MemoryHandle& h) { return h.id; }, "The handle's id.")
      .def(
          "__int__", [](const MemoryHandle& h) { return h.id; }, "The handle's id.")
      .def(
          "__eq__",
          [](const MemoryHandle& a, py::handle other) -> py::object {
            if (auto ni = not_implemented_unless<MemoryHandle>(other)) return ni;
            return py::bool_(a == py::cast<const MemoryHandle&>(other));
          },
          py::arg("other"), "Equal when the ids are equal.")
      .def(
          "__hash__", [](const MemoryHandle& h) { return py::hash(py::int_(h.id)); },
          "The hash of the id.")
      .def(
          "__repr__",
          [](const MemoryHandle& h) { return "MemoryHandle(" + std::to_string(h.id) + ")"; },
          "MemoryHandle(<id>).");

  py::class_<PeerGroup>(m, "PeerGroup",
                        "A set of peer addresses that scatter() and barrier() address together "
                        "(TransferEngine.add_peer_group).")
      .def_property_readonly(
          "id", [](const PeerGroup& g) { return g.id; }, "The group's id.")
      .def(
          "__eq__",
          [](const PeerGroup& a, py::handle other) -> py::object {
            if (auto ni = not_implemented_unless<PeerGroup>(other)) return ni;
            return py::bool_(a == py::cast<const PeerGroup&>(other));
          },
          py::arg("other"), "Equal when the ids are equal.")
      .def(
          "__hash__", [](const PeerGroup& g) { return py::hash(py::int_(g.id)); },
          "The hash of the id.")
      .def(
          "__repr__", [](const PeerGroup& g) { return "PeerGroup(" + std::to_string(g.id) + ")"; },
          "PeerGroup(<id>).");

  py::class_<Routing> routing(m, "Routing",
                              "How a single write is spread over the NICs of the group: "
                              "Routing.sharded(shards) or Routing.pinned(nic).");
  py::enum_<Routing::Kind>(routing, "Kind", "Sharded across NICs, or pinned to one.")
      .value("SHARDED", Routing::Kind::kSharded)
      .value("PINNED", Routing::Kind::kPinned);
  routing
      .def_static(
          "sharded",
          [](const IntArg& shards) {
            return Routing::sharded(u32(shards, "Routing.sharded: shards"));
          },
          py::arg("shards") = 0,
          "Split into at most `shards` shards rotated across NICs (0: one per NIC). "
          "Writes below Config.shard_min_bytes are never split.")
      .def_static(
          "pinned",
          [](const IntArg& nic) { return Routing::pinned(u32(nic, "Routing.pinned: nic")); },
          py::arg("nic"), "Use local NIC (rail) `nic`; the peer's NIC of the same rail receives.")
      .def_property_readonly(
          "kind", [](const Routing& r) { return r.kind; }, "SHARDED or PINNED.")
      .def_property_readonly(
          "shards", [](const Routing& r) { return r.shards; }, "SHARDED: the most shards.")
      .def_property_readonly(
          "nic", [](const Routing& r) { return r.nic; }, "PINNED: the local NIC.")
      .def(
          "__repr__",
          [](const Routing& r) {
            return r.kind == Routing::Kind::kPinned
                       ? "Routing.pinned(" + std::to_string(r.nic) + ")"
                       : "Routing.sharded(" + std::to_string(r.shards) + ")";
          },
          "Routing.sharded(n) or Routing.pinned(nic).");

  py::enum_<Scatter::Sharding>(m, "Sharding", "How scatter() spreads its targets over NICs.")
      .value("BY_PEER", Scatter::Sharding::kByPeer,
             "Each target goes whole to one NIC, targets rotated across NICs.")
      .value("BY_BYTES", Scatter::Sharding::kByBytes,
             "Each target large enough is split across all NICs.");

  py::class_<ScatterTarget>(m, "ScatterTarget",
                            "One target of scatter(): `length` bytes from the source's "
                            "`src_offset` to `dst` at `dst_offset`. A (dst, length, src_offset, "
                            "dst_offset) tuple is accepted wherever a ScatterTarget is.")
      .def(py::init([](py::handle dst, const IntArg& length, const IntArg& src_offset,
                       const IntArg& dst_offset) {
             return ScatterTarget{to_remote(dst, "ScatterTarget.dst"),
                                  u64(length, "ScatterTarget: length"),
                                  u64(src_offset, "ScatterTarget: src_offset"),
                                  u64(dst_offset, "ScatterTarget: dst_offset")};
           }),
           py::arg("dst"), py::arg("length"), py::arg("src_offset") = 0, py::arg("dst_offset") = 0,
           "dst: a RemoteMemory (or its bytes) whose owner is a member of the peer group.")
      .def_property(
          "dst", [](const ScatterTarget& t) { return t.dst; },
          [](ScatterTarget& t, py::handle v) { t.dst = to_remote(v, "ScatterTarget.dst"); },
          "The destination region.")
      .def_property("length", getter(&ScatterTarget::length),
                    unsigned_setter(&ScatterTarget::length, "ScatterTarget.length"),
                    "Bytes to write.")
      .def_property("src_offset", getter(&ScatterTarget::src_offset),
                    unsigned_setter(&ScatterTarget::src_offset, "ScatterTarget.src_offset"),
                    "Offset in the source region.")
      .def_property("dst_offset", getter(&ScatterTarget::dst_offset),
                    unsigned_setter(&ScatterTarget::dst_offset, "ScatterTarget.dst_offset"),
                    "Offset in the destination region.")
      .def(
          "__repr__",
          [](const ScatterTarget& t) {
            return "ScatterTarget(" + std::to_string(t.length) +
                   " bytes, src_offset=" + std::to_string(t.src_offset) +
                   ", dst_offset=" + std::to_string(t.dst_offset) + ")";
          },
          "ScatterTarget(<length> bytes, src_offset=..., dst_offset=...).");

  py::class_<NicStats>(m, "NicStats",
                       "What one NIC of a device group has done (GroupStats.nics), the engine's "
                       "own messages included.")
      .def_readonly("work_requests_posted", &NicStats::work_requests_posted,
                    "Work requests the provider accepted.")
      .def_readonly("work_requests_completed", &NicStats::work_requests_completed,
                    "Of those, completed without error.")
      .def_readonly("work_requests_failed", &NicStats::work_requests_failed,
                    "Of those, completed with an error.")
      .def_readonly("post_retries", &NicStats::post_retries,
                    "Posts the provider answered 'try again' (EAGAIN).")
      .def("__repr__", [](const NicStats& n) {
        return "NicStats(work_requests_posted=" + std::to_string(n.work_requests_posted) +
               ", work_requests_completed=" + std::to_string(n.work_requests_completed) +
               ", work_requests_failed=" + std::to_string(n.work_requests_failed) +
               ", post_retries=" + std::to_string(n.post_retries) + ")";
      });
  py::class_<GroupStats>(m, "GroupStats",
                         "What one device group has done since the engine started "
                         "(TransferEngine.stats()).")
      .def_readonly("transfers_submitted", &GroupStats::transfers_submitted,
                    "One-sided transfers accepted (single, paged, scatter, barrier, imm-only).")
      .def_readonly("transfers_completed", &GroupStats::transfers_completed, "Of those, completed.")
      .def_readonly("transfers_failed", &GroupStats::transfers_failed, "Of those, failed.")
      .def_readonly("bytes_submitted", &GroupStats::bytes_submitted,
                    "Payload bytes of the accepted transfers.")
      .def_readonly("messages_sent", &GroupStats::messages_sent, "Messages accepted by send().")
      .def_readonly("messages_completed", &GroupStats::messages_completed, "Of those, delivered.")
      .def_readonly("messages_failed", &GroupStats::messages_failed, "Of those, failed.")
      .def_readonly("messages_received", &GroupStats::messages_received,
                    "Messages handed to the group's receive handler (or recv()).")
      .def_readonly("cuda_ipc_transfers", &GroupStats::cuda_ipc_transfers,
                    "Of the accepted transfers, those with a destination written over the CUDA "
                    "IPC path (same-host GPU peers).")
      .def_readonly("cuda_ipc_bytes", &GroupStats::cuda_ipc_bytes,
                    "Payload bytes the CUDA IPC path moved for them.")
      .def_readonly("host_mirror_bytes", &GroupStats::host_mirror_bytes,
                    "Pinned host memory now held by the staging mirrors of the group's "
                    "registrations of GPU memory (none for host_mirror=False).")
      .def_readonly("nics", &GroupStats::nics, "A NicStats per NIC of the group.")
      .def_readonly("internal_work_requests_posted", &GroupStats::internal_work_requests_posted,
                    "Work requests of the engine's own messages among those posted.")
      .def_property_readonly(
          "errors_by_code",
          [](const GroupStats& g) {
            py::dict out;
            for (size_t i = 1; i < g.errors_by_code.size(); ++i) {
              out[py::str(std::string(to_string(static_cast<ErrorCode>(i))))] = g.errors_by_code[i];
            }
            return out;
          },
          "Transfers and messages that failed, by error code name ('RemoteAccess': n, ...).")
      .def_readonly("worker_passes", &GroupStats::worker_passes, "Passes of the group's worker.")
      .def_readonly("worker_sleeps", &GroupStats::worker_sleeps,
                    "Times the worker blocked in the kernel with nothing to do.")
      .def_readonly("worker_wakeups", &GroupStats::worker_wakeups,
                    "Times a submitter woke the worker from a sleep (one eventfd write).")
      .def_readonly("submissions_ring_full", &GroupStats::submissions_ring_full,
                    "Submissions that found the submission ring full and took the locked "
                    "overflow list (nothing is lost; Config.submission_ring sizes the ring).")
      .def_readonly("in_flight", &GroupStats::in_flight,
                    "Transfers and messages accepted and not yet ended.")
      .def_property_readonly(
          "completion_latency_us",
          [](const GroupStats& g) {
            return std::vector<uint64_t>(g.completion_latency.counts.begin(),
                                         g.completion_latency.counts.end());
          },
          "Completion times, submit to end, by powers of two of microseconds: element 0 "
          "under 2 us, element i in [2**i, 2**(i+1)) us, the last from about 1 s on.")
      .def(
          "__repr__",
          [](const GroupStats& g) {
            return "GroupStats(transfers_submitted=" + std::to_string(g.transfers_submitted) +
                   ", transfers_completed=" + std::to_string(g.transfers_completed) +
                   ", transfers_failed=" + std::to_string(g.transfers_failed) +
                   ", bytes_submitted=" + std::to_string(g.bytes_submitted) +
                   ", messages_sent=" + std::to_string(g.messages_sent) +
                   ", messages_received=" + std::to_string(g.messages_received) + ")";
          },
          "GroupStats(transfers_submitted=..., ...).");
  py::class_<EngineStats>(m, "EngineStats",
                          "What an engine has done since it started: per device group, and the "
                          "immediates it counted.")
      .def_readonly("groups", &EngineStats::groups, "A GroupStats per device group.")
      .def_readonly("immediates_received", &EngineStats::immediates_received,
                    "Immediates counted (every group and NIC; one per arrival).")
      .def_readonly("callback_spin", &EngineStats::callback_spin,
                    "Config.callback_spin in effect (a timedelta; an unset one resolved).")
      .def_readonly("wait_spin", &EngineStats::wait_spin,
                    "Config.wait_spin in effect (a timedelta; an unset one resolved).")
      .def(
          "__repr__",
          [](const EngineStats& s) {
            return "EngineStats(groups=" + std::to_string(s.groups.size()) +
                   ", immediates_received=" + std::to_string(s.immediates_received) + ")";
          },
          "EngineStats(groups=..., immediates_received=...).");

  py::class_<GroupInfo>(m, "GroupInfo", "What a device group turned out to be, once opened.")
      .def_readonly("provider", &GroupInfo::provider, "The provider, e.g. 'tcp;ofi_rxm'.")
      .def_readonly("nics", &GroupInfo::nics, "Domain names, in rail order.")
      .def_readonly("cpu", &GroupInfo::cpu, "The worker's CPU, or -1 when unpinned.")
      .def_readonly("delivery_complete", &GroupInfo::delivery_complete,
                    "Whether writes complete only once visible at the target.")
      .def_readonly("gpu_memory", &GroupInfo::gpu_memory,
                    "How CUDA memory registered on the group moves: 'staged' or "
                    "'direct (FI_HMEM)'.")
      .def_readonly("cuda", &GroupInfo::cuda, "Whether a CUDA device is present.")
      .def_readonly("cuda_ipc", &GroupInfo::cuda_ipc,
                    "The CUDA IPC path for same-host GPU peers: 'auto', 'on' or 'off'.")
      .def(
          "__repr__",
          [](const GroupInfo& g) {
            std::string nics;
            for (const auto& n : g.nics) nics += (nics.empty() ? "" : ",") + n;
            return "GroupInfo(provider='" + g.provider + "', nics=[" + nics +
                   "], cpu=" + std::to_string(g.cpu) +
                   ", delivery_complete=" + (g.delivery_complete ? "True" : "False") + ")";
          },
          "GroupInfo(provider=..., nics=[...], cpu=..., delivery_complete=...).");
}

void bind_config(py::module_& m) {
  py::class_<GroupConfig> group_config(
      m, "GroupConfig",
      "One device group: the NICs that serve one GPU or host buffer pool, polled by one worker "
      "thread. CPU_AUTO: pin the worker next to the first NIC when it has a NUMA node; "
      "CPU_NONE: never pin.");
  group_config.attr("CPU_AUTO") = GroupConfig::kCpuAuto;
  group_config.attr("CPU_NONE") = GroupConfig::kCpuNone;
  group_config
      .def(py::init([](std::optional<std::vector<std::string>> nics, const IntArg& cpu,
                       bool caller_progress) {
             GroupConfig g;
             if (nics) g.nics = std::move(*nics);
             g.cpu = static_cast<int>(signed_value(cpu, "GroupConfig: cpu",
                                                   std::numeric_limits<int>::min(),
                                                   std::numeric_limits<int>::max()));
             g.caller_progress = caller_progress;
             return g;
           }),
           py::arg("nics") = py::none(), py::arg("cpu") = GroupConfig::kCpuAuto,
           py::arg("caller_progress") = false,
           "nics: domain names ('lo', 'shm', 'eth0', ...; none: the provider's first); cpu: "
           "CPU_AUTO, CPU_NONE or a CPU number for the worker thread; caller_progress: no "
           "worker thread, TransferEngine.progress() drives the group.")
      .def_readwrite("caller_progress", &GroupConfig::caller_progress,
                     "No worker thread: the caller's thread drives the group with "
                     "TransferEngine.progress(group), and its callbacks run there.")
      .def_readwrite("nics", &GroupConfig::nics,
                     "Domain names as libfabric reports them; empty: the provider's first. A NIC "
                     "may be listed twice. Assign a new list (in-place edits of the returned "
                     "list are lost).");
  int_property(group_config, "cpu", &GroupConfig::cpu,
               "CPU to pin the worker to: CPU_AUTO (a core near the first NIC), CPU_NONE "
               "(never pin) or a CPU number.");
  group_config.def(
      "__repr__",
      [](const GroupConfig& g) {
        std::string nics;
        for (const auto& n : g.nics) nics += (nics.empty() ? "'" : ", '") + n + "'";
        return "GroupConfig(nics=[" + nics + "], cpu=" + std::to_string(g.cpu) + ")";
      },
      "GroupConfig(nics=[...], cpu=...).");

  py::bind_vector<std::vector<GroupConfig>>(
      m, "GroupConfigList", "Config.groups: a list of GroupConfig that edits the config in place.");
  py::implicitly_convertible<py::list, std::vector<GroupConfig>>();
  py::implicitly_convertible<py::tuple, std::vector<GroupConfig>>();

  py::class_<FaultConfig> faults(m, "FaultConfig",
                                 "Fault injection for tests (Config.faults): reorders completions "
                                 "and immediates, fails chosen writes, changes received lengths. "
                                 "Off by default.");
  faults.def(py::init<>(), "Disabled fault injection.")
      .def_readwrite("enabled", &FaultConfig::enabled, "Wrap every domain in the fault domain.");
  unsigned_property(faults, "seed", &FaultConfig::seed, "Seed of the shuffling.");
  unsigned_property(faults, "max_hold_polls", &FaultConfig::max_hold_polls,
                    "A held completion is released after at most this many polls.");
  hook_property<FailWriteHook>(
      faults, "fail_write", &FaultConfig::fail_write,
      "Called as fail_write(sequence) on the worker thread (holding the GIL) before each "
      "write is posted; a true result fails that write with ProviderError. None: never "
      "fail.");
  hook_property<LengthDeltaHook>(
      faults, "receive_length_delta", &FaultConfig::receive_length_delta,
      "Called as receive_length_delta(sequence) on the worker thread (holding the GIL) for "
      "each receive completion carrying a message (`sequence` counts them per NIC from 0); the "
      "int it returns is added to the length the provider reported (at least 0 is kept): a "
      "provider handing over a message with bytes after it (> 0) or cut short (< 0). None: "
      "lengths unchanged.");

  py::class_<VerbsConfig> verbs(m, "VerbsConfig",
                                "The verbs backend (Config.verbs; provider 'verbs', "
                                "docs/verbs.md): GID, connection set-up, signalling, thread "
                                "domains. GID_AUTO: the RoCE v2 GID carrying the port's IPv4 "
                                "address.");
  verbs.attr("GID_AUTO") = VerbsConfig::kGidAuto;
  verbs.def(py::init([](const py::kwargs& fields) {
              VerbsConfig v;
              py::object obj = py::cast(v);
              py::object type = py::type::of(obj);
              py::object property = py::module_::import("builtins").attr("property");
              for (auto [key, value] : fields) {
                auto name = py::cast<std::string>(key);
                if (name.empty() || name[0] == '_' || !py::hasattr(type, name.c_str()) ||
                    !py::isinstance(type.attr(name.c_str()), property)) {
                  throw py::type_error("VerbsConfig has no field '" + name + "'");
                }
                py::setattr(obj, key, value);
              }
              return py::cast<VerbsConfig>(obj);
            }),
            "The defaults; any field can be given by name (VerbsConfig(gid_index=3)).");
  int_property(verbs, "gid_index", &VerbsConfig::gid_index,
               "GID index used on every NIC of the engine; GID_AUTO (-1): the RoCE v2 GID that "
               "carries the IPv4 address of the port's interface (the IB GID 0 on InfiniBand).");
  duration_property(verbs, "connect_retry", &VerbsConfig::connect_retry,
                    "A peer is connected on first use with a handshake datagram, resent after "
                    "this (doubling each time; timedelta or seconds).");
  unsigned_property(verbs, "connect_attempts", &VerbsConfig::connect_attempts,
                    "Handshake datagrams sent before the peer's queued work fails with "
                    "PeerUnreachable.");
  unsigned_property(verbs, "drop_handshakes", &VerbsConfig::drop_handshakes,
                    "Fault injection: the first this many handshake datagrams of each domain are "
                    "dropped.");
  unsigned_property(verbs, "delay_handshakes", &VerbsConfig::delay_handshakes,
                    "Fault injection: the next this many are sent only after handshake_delay.");
  duration_property(verbs, "handshake_delay", &VerbsConfig::handshake_delay,
                    "Fault injection: the delay of delay_handshakes (timedelta or seconds).");
  unsigned_property(verbs, "signal_every", &VerbsConfig::signal_every,
                    "Selective signalling: a send work request asks for a completion once in "
                    "this many on its queue pair (1: every one).");
  verbs.def_readwrite("thread_domain", &VerbsConfig::thread_domain,
                      "Queue pairs in a thread domain with a single-threaded completion queue "
                      "where the device offers them (the provider then leaves out its locks).");
  verbs.def(
      "__repr__",
      [](const VerbsConfig& v) {
        return "VerbsConfig(gid_index=" + std::to_string(v.gid_index) +
               ", connect_attempts=" + std::to_string(v.connect_attempts) +
               ", signal_every=" + std::to_string(v.signal_every) +
               ", thread_domain=" + (v.thread_domain ? "True" : "False") + ")";
      },
      "VerbsConfig(gid_index=..., ...).");

  py::class_<Config> config(m, "Config",
                            "The one typed configuration of a TransferEngine. Every field has a "
                            "working default.");
  config
      .def(py::init([](const std::string& provider, std::optional<std::vector<std::string>> nics,
                       const IntArg& cpu, const py::kwargs& fields) {
             Config c;
             c.provider = provider;
             if (nics) c.groups[0].nics = std::move(*nics);
             c.groups[0].cpu =
                 static_cast<int>(signed_value(cpu, "Config: cpu", std::numeric_limits<int>::min(),
                                               std::numeric_limits<int>::max()));
             if (fields.empty()) return c;
             // Any other field by name, through its property (same checks as assignment).
             py::object obj = py::cast(c);
             py::object type = py::type::of(obj);
             py::object property = py::module_::import("builtins").attr("property");
             for (auto [key, value] : fields) {
               auto name = py::cast<std::string>(key);
               if (name.empty() || name[0] == '_' || !py::hasattr(type, name.c_str()) ||
                   !py::isinstance(type.attr(name.c_str()), property)) {
                 throw py::type_error("Config has no field '" + name + "'");
               }
               py::setattr(obj, key, value);
             }
             return py::cast<Config>(obj);
           }),
           py::arg("provider") = "auto", py::arg("nics") = py::none(),
           py::arg("cpu") = GroupConfig::kCpuAuto,
           "provider, nics and cpu set up the one default group; any other field can be given "
           "by name (Config(provider='tcp', nics=['lo'], spin_time=0.0001)).")
      .def_readwrite("provider", &Config::provider,
                     "'auto' (efa when present, else tcp), 'tcp', 'shm', 'efa', 'verbs', or any "
                     "libfabric provider with RDM endpoints, RMA and remote CQ data.")
      .def_readwrite("groups", &Config::groups,
                     "One GroupConfig per device group (default: one group on the provider's "
                     "first domain).")
      .def_readwrite("weighted_sharding", &Config::weighted_sharding,
                     "Split sharded writes across NICs by each NIC's measured write rate.")
      .def_readwrite("gpu_direct", &Config::gpu_direct,
                     "Let providers that reach GPU memory themselves (FI_HMEM) register it "
                     "directly; otherwise GPU memory is staged.")
      .def_readwrite(
          "reliable_imm", &Config::reliable_imm,
          "Immediates of writes to host memory travel as one engine message (a Commit, which "
          "fails over like any message) after all of the transfer's data has completed, so that "
          "a NIC failure mid-write re-posts the data without any risk of double counting "
          "(docs/failover.md). Off (the default): an immediate rides on its write, one work "
          "request less, but a write carrying one that was in flight on a NIC that failed "
          "cannot be re-sent, and its transfer fails.")
      .def_property(
          "cuda_ipc",
          [](const Config& c) {
            return std::string(c.cuda_ipc == Config::CudaIpc::kOn    ? "on"
                               : c.cuda_ipc == Config::CudaIpc::kOff ? "off"
                                                                     : "auto");
          },
          [](Config& c, const std::string& mode) {
            if (mode == "auto") {
              c.cuda_ipc = Config::CudaIpc::kAuto;
            } else if (mode == "on") {
              c.cuda_ipc = Config::CudaIpc::kOn;
            } else if (mode == "off") {
              c.cuda_ipc = Config::CudaIpc::kOff;
            } else {
              throw StatusError{
                  Status(ErrorCode::kInvalidArgument,
                         "Config.cuda_ipc is 'auto', 'on' or 'off', not '" + mode + "'")};
            }
          },
          "Same-host GPU to GPU over CUDA IPC: 'auto' (wherever possible), 'on' (a GPU write "
          "that cannot take it raises Unsupported) or 'off'.")
      .def_readwrite(
          "callbacks_on_worker", &Config::callbacks_on_worker,
          "Run completion callbacks on the group's worker thread instead of the callback thread "
          "(no thread hop; a slow callback, or one waiting for the GIL, delays the group's "
          "transfers). There, register and unregister raise InvalidArgument, and wait_imm "
          "returns at once whether the count is reached.")
      .def_readwrite("faults", &Config::faults, "Fault injection (tests only; off by default).")
      .def_readwrite("verbs", &Config::verbs,
                     "The verbs backend's settings (a VerbsConfig; provider 'verbs' only).")
      .def(
          "apply_env_overrides", [](Config& c) { check(c.apply_env_overrides()); },
          "Applies FABRIC_PROVIDER, FABRIC_NICS (comma-separated, group 0), FABRIC_CPU, "
          "FABRIC_SPIN_US, FABRIC_IDLE_SLEEP_US, FABRIC_INFLIGHT_SPIN_US, "
          "FABRIC_CALLBACK_SPIN_US, FABRIC_WEIGHTED_SHARDING, FABRIC_CUDA_IPC and "
          "FABRIC_SHM_COPY_THREADS; raises InvalidArgument naming a malformed variable.")
      .def(
          "__repr__",
          [](const Config& c) {
            std::string groups;
            for (const auto& g : c.groups) {
              std::string nics;
              for (const auto& n : g.nics) nics += (nics.empty() ? "'" : ", '") + n + "'";
              groups += (groups.empty() ? "" : ", ") + std::string("GroupConfig(nics=[") + nics +
                        "], cpu=" + std::to_string(g.cpu) + ")";
            }
            return "Config(provider='" + c.provider + "', groups=[" + groups + "])";
          },
          "Config(provider=..., groups=[...]).");
  unsigned_property(config, "shard_min_bytes", &Config::shard_min_bytes,
                    "Single writes and byte-sharded scatter targets below this use one NIC.");
  unsigned_property(config, "shard_alignment", &Config::shard_alignment,
                    "Shard boundaries are aligned to this many bytes.");
  unsigned_property(config, "cq_batch", &Config::cq_batch,
                    "Most completions read from a CQ per call.");
  unsigned_property(config, "post_budget", &Config::post_budget,
                    "Most work requests posted per domain in one pass of the worker loop.");
  unsigned_property(config, "max_message_bytes", &Config::max_message_bytes,
                    "Largest message send() accepts.");
  unsigned_property(config, "send_buffers", &Config::send_buffers,
                    "Send buffers each group keeps registered.");
  unsigned_property(config, "control_buffers", &Config::control_buffers,
                    "Receive buffers each group keeps posted for the engine's own messages.");
  unsigned_property(config, "staging_chunk_bytes", &Config::staging_chunk_bytes,
                    "The staged GPU path's pipeline chunk.");
  unsigned_property(config, "shm_copy_threads", &Config::shm_copy_threads,
                    "shm transport: threads copying one large incoming write together (0: "
                    "half the CPUs, 1 to 8; 1: the worker alone).");
  unsigned_property(config, "cuda_ipc_streams", &Config::cuda_ipc_streams,
                    "CUDA streams the owner of a destination copies on over the CUDA IPC path "
                    "(jobs are spread over them in turn).");
  unsigned_property(config, "submission_ring", &Config::submission_ring,
                    "Slots of each group's lock-free submission ring (2 to 2**20); a full ring "
                    "sends submissions to a locked overflow list (nothing is refused).");
  unsigned_property(config, "max_wr_bytes", &Config::max_wr_bytes,
                    "Writes larger than this are split into several work requests.");
  duration_property(config, "spin_time", &Config::spin_time,
                    "How long an idle worker spins before sleeping (timedelta; set with a "
                    "timedelta or seconds).");
  duration_property(config, "idle_sleep", &Config::idle_sleep,
                    "The idle worker's sleep step (timedelta or seconds).");
  duration_property(
      config, "inflight_spin", &Config::inflight_spin,
      "With work in flight and nothing else to do, how long the worker polls before blocking "
      "on the NICs' completion descriptors (timedelta or seconds).");
  optional_duration_property(
      config, "callback_spin", &Config::callback_spin,
      "How long the callback thread polls for more callbacks before sleeping (timedelta or "
      "seconds; None, the default: 50 us on a host with 8 or more usable CPUs, else 0; "
      "EngineStats.callback_spin says what an engine uses).");
  optional_duration_property(
      config, "wait_spin", &Config::wait_spin,
      "How long wait_imm polls before it sleeps (timedelta or seconds; 0: sleep at once; None, "
      "the default: as callback_spin).");
  duration_property(
      config, "peer_timeout", &Config::peer_timeout,
      "A peer silent this long with work outstanding is declared unreachable (timedelta or "
      "seconds).");
  duration_property(
      config, "nic_timeout", &Config::nic_timeout,
      "NIC failover (docs/failover.md): a NIC whose work towards a peer makes no progress for "
      "this long while another NIC of the group completed work is marked down (timedelta or "
      "seconds; on only when non-zero and shorter than peer_timeout).");
  duration_property(config, "nic_probe_interval", &Config::nic_probe_interval,
                    "How often a NIC marked down is probed; the first probe that completes "
                    "brings it back (timedelta or seconds).");
  duration_property(
      config, "close_timeout", &Config::close_timeout,
      "How long close() lets posted work finish before cancelling it (timedelta or seconds).");
}

}  // namespace fabric::python
