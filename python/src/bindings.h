// Shared pieces of the fabric_lib Python module (fabric_lib._fabric_lib).
//
// GIL rules, which every file of the module follows:
//  - Every call into the engine that can wait (create, close, register, peer groups, receive
//    set-up, wait_imm) and every submission runs with the GIL released.
//  - User callbacks run on the engine's callback thread, which takes the GIL only for the
//    Python part of each callback; the worker threads never take it (fault hooks aside).
//  - A Python object held by C++ engine state lives in a PyRef, whose destructor takes the GIL
//    when needed, and which the module clears under the GIL as soon as it is done with it, so
//    that engine threads practically never drop the last reference.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "fabric/fabric.h"

namespace fabric::kv {
class Registry;
}  // namespace fabric::kv

// Config.groups is bound as a list-like view of the C++ vector, so that
// `config.groups[0].nics = [...]` changes the config and not a copy. Every file includes this.
PYBIND11_MAKE_OPAQUE(std::vector<fabric::GroupConfig>)

namespace fabric::python {
// An integer argument as Python passes it: an int, or any object with __index__ (NumPy
// integers). Its range is checked by the binding with unsigned_arg(), so that a negative or
// too large value raises InvalidArgument naming the argument (pybind11's own casters for
// unsigned types raise a TypeError that names nothing).
struct IntArg {
  pybind11::object value;  // a Python int
};
}  // namespace fabric::python

namespace pybind11::detail {

// std::string to str, for every conversion of the module (return values, tuples, lists,
// attributes): bytes that are not UTF-8 are written as backslash escapes ("\xff") instead of
// raising UnicodeDecodeError. Strings that reach Python from C++ may hold foreign bytes (a
// corrupt descriptor's names in an error message, an environment variable, a registry file),
// and a conversion that raises inside an engine callback would leave a future pending. Reading
// a str into std::string is pybind11's own. Every file of the module sees this before any
// conversion of a std::string (bindings.h is included by all of them), so there is one caster.
template <>
struct type_caster<std::string> : string_caster<std::string> {
  static handle cast(const std::string& s, return_value_policy, handle) {
    PyObject* out =
        PyUnicode_DecodeUTF8(s.data(), static_cast<ssize_t>(s.size()), "backslashreplace");
    if (out == nullptr) throw error_already_set();
    return out;
  }
};

template <>
struct type_caster<fabric::python::IntArg> {
  PYBIND11_TYPE_CASTER(fabric::python::IntArg, const_name("int"));
  bool load(handle src, bool /*convert*/) {
    if (!src || PyFloat_Check(src.ptr())) return false;
    PyObject* index = PyNumber_Index(src.ptr());
    if (index == nullptr) {
      PyErr_Clear();
      return false;
    }
    value.value = reinterpret_steal<object>(index);
    return true;
  }
  static handle cast(const fabric::python::IntArg& v, return_value_policy, handle) {
    return v.value.inc_ref();
  }
};

}  // namespace pybind11::detail

namespace fabric::python {

namespace py = pybind11;

// True while the interpreter is shutting down; Python objects are then leaked, not released.
bool interpreter_finalizing();

// A strong reference to a Python object that any thread may destroy.
class PyRef {
 public:
  PyRef() = default;
  explicit PyRef(py::object obj) : obj_(std::move(obj)) {}
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  // Holding the GIL.
  PyRef& operator=(PyRef&& other) noexcept {
    obj_ = std::move(other.obj_);
    return *this;
  }
  ~PyRef() { reset(); }

  // Holding the GIL.
  const py::object& get() const { return obj_; }
  explicit operator bool() const { return static_cast<bool>(obj_); }
  // Drops the reference; takes the GIL if this thread does not hold it.
  void reset();

 private:
  py::object obj_;
};

// True on a thread while it runs a user callback for the module: what waits for that thread
// (closing an engine, a KV object, a registry) must not run there.
inline thread_local bool t_in_callback = false;

struct InCallback {
  bool saved = t_in_callback;
  InCallback() { t_in_callback = true; }
  ~InCallback() { t_in_callback = saved; }
};

// Refuses `what` ("TransferEngine.close()"), a call that waits for the module's callbacks to
// end, on a thread that runs one of them: InvalidArgument (a ValueError) saying so, since it
// would wait for itself. Defined below StatusError.
inline void refuse_in_callback(const std::string& what);

// Calls a user callback, reporting (never propagating) what it raises. Holding the GIL.
void call_user(const PyRef& fn, py::args args = py::args());
// concurrent.futures.Future.<method>(future, value), reporting what it raises. Holding the GIL.
void resolve(const PyRef& future, const char* method, py::handle value);

// --- text and integers crossing into Python ----------------------------------------------

// `s` as a str, bytes that are not UTF-8 written as backslash escapes. Never raises but for
// MemoryError.
inline py::str text(std::string_view s) {
  PyObject* out =
      PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "backslashreplace");
  if (out == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(out);
}

// A Python str as UTF-8 bytes, lone surrogates written as backslash escapes (never raises but
// for MemoryError): for names of Python objects put into messages.
std::string utf8(py::handle str);

// The value of an integer argument, at most `max`: InvalidArgument naming `what` (e.g.
// "write: length") when it is negative or larger.
uint64_t unsigned_value(const IntArg& arg, const char* what, uint64_t max);
template <typename T>
T unsigned_arg(const IntArg& arg, const char* what) {
  static_assert(std::is_unsigned_v<T>);
  return static_cast<T>(unsigned_value(arg, what, std::numeric_limits<T>::max()));
}
inline uint32_t u32(const IntArg& arg, const char* what) {
  return unsigned_arg<uint32_t>(arg, what);
}
inline uint64_t u64(const IntArg& arg, const char* what) {
  return unsigned_arg<uint64_t>(arg, what);
}
inline std::optional<uint64_t> u64(const std::optional<IntArg>& arg, const char* what) {
  if (!arg) return std::nullopt;
  return u64(*arg, what);
}
// The value of a signed integer argument in [min, max] (InvalidArgument naming `what` when not).
int64_t signed_value(const IntArg& arg, const char* what, int64_t min, int64_t max);

// "Class.name", for messages about a field.
template <typename C>
std::string qualified(const py::class_<C>& cls, const char* name) {
  return utf8(cls.attr("__name__")) + "." + name;
}

// A property reading a field as it is.
template <typename C, typename T>
auto getter(T C::*field) {
  return [field](const C& c) { return c.*field; };
}

// A setter of an unsigned integer field: InvalidArgument naming `what` for a value out of range.
template <typename C, typename T>
auto unsigned_setter(T C::*field, std::string what) {
  return [field, what = std::move(what)](C& c, const IntArg& v) {
    c.*field = unsigned_arg<T>(v, what.c_str());
  };
}

// An unsigned integer field as a property named `name` (messages name it as "Class.name").
template <typename C, typename T>
void unsigned_property(py::class_<C>& cls, const char* name, T C::*field, const char* doc) {
  static_assert(std::is_unsigned_v<T>);
  cls.def_property(name, getter(field), unsigned_setter(field, qualified(cls, name)), doc);
}

// --- errors (errors.cc) ---------------------------------------------------------------------

// Carries a non-ok Status out of a binding; translated into the Python exception of its code.
struct StatusError {
  Status status;
};

// Throws StatusError unless `s` is ok.
inline void check(const Status& s) {
  if (!s) throw StatusError{s};
}
template <typename T>
T check(Result<T> r) {
  if (!r) throw StatusError{r.status()};
  return std::move(*r);
}

inline void refuse_in_callback(const std::string& what) {
  if (!t_in_callback) return;
  throw StatusError{Status(ErrorCode::kInvalidArgument,
                           what + " cannot be called from a callback: it waits for the callbacks "
                                  "to end (call it once the callback has returned)")};
}

// The Python exception instance for a non-ok status (holding the GIL). Never raises: when the
// instance cannot be built it returns one of the same class with the message as ASCII escapes
// (or, failing that too, MemoryError), so that a future failed with it still resolves.
py::object make_exception(const Status& status);
// Tests only: while set on a thread, make_exception there fails to build the instance as if a
// conversion had raised (_fail_transfer_for_test).
extern thread_local bool t_break_exception_for_test;
// Reports an exception that user callback `callback` raised on an engine thread through
// sys.unraisablehook ("Exception ignored in: <callback>"), and swallows it. Holding the GIL.
void report_callback_error(py::error_already_set& e, py::handle callback);

void bind_errors(py::module_& m);
// UvmWatchers and Watcher (watcher.cc).
void bind_watchers(py::module_& m);

// --- memory (memory.cc) ---------------------------------------------------------------------

// A contiguous range of memory taken from a Python object (buffer protocol or DLPack), kept
// valid while this object lives.
class PinnedMemory {
 public:
  // Takes `obj`'s memory. Raises InvalidArgument for read-only or non-contiguous memory, and
  // Unsupported for device memory this build cannot register. Holding the GIL.
  static std::unique_ptr<PinnedMemory> from_object(py::handle obj);
  // A raw pointer; `owner` (may be None) is kept alive with it.
  static std::unique_ptr<PinnedMemory> from_pointer(uintptr_t ptr, uint64_t length,
                                                    py::object owner);
  ~PinnedMemory();  // holding the GIL
  PinnedMemory(const PinnedMemory&) = delete;
  PinnedMemory& operator=(const PinnedMemory&) = delete;

  void* ptr() const { return ptr_; }
  uint64_t length() const { return length_; }
  // "cpu", or "cuda:N" for device memory (CUDA builds).
  const std::string& device() const { return device_; }
  const py::object& owner() const { return owner_; }

 private:
  PinnedMemory() = default;
  void* ptr_ = nullptr;
  uint64_t length_ = 0;
  std::string device_ = "cpu";
  py::object owner_;    // the registered object
  py::object capsule_;  // DLPack: the exported capsule; its destructor releases the export
  Py_buffer view_{};    // buffer protocol: the view, released in the destructor
  bool has_view_ = false;
};

// Page indices from a sequence of ints, a 1-D integer array (buffer protocol) or a 1-D integer
// tensor (DLPack, host memory). `what` names the argument in errors. Holding the GIL.
std::vector<uint32_t> to_page_indices(py::handle obj, const char* what);

// --- value types (types.cc) -----------------------------------------------------------------

// An Address from an Address or bytes-like encoding; raises InvalidArgument naming `what`.
Address to_address(py::handle obj, const char* what);
// A RemoteMemory from a RemoteMemory or bytes-like encoding.
RemoteMemory to_remote(py::handle obj, const char* what);

// --- the engine (engine.cc), for the KV bindings ---

// The C++ engine of a Python TransferEngine; raises TypeError, or Closed when it is closed.
TransferEngine& engine_of(py::handle engine);
// The Registration behind a Python Registration of `engine`; raises TypeError, or
// InvalidArgument when it was unregistered or belongs to another engine.
const Registration& registration_of(py::handle registration, py::handle engine);

// Durations: read as a datetime.timedelta or a number of seconds (InvalidArgument naming
// `what` when negative or not finite; TypeError for anything else).
template <typename Duration>
Duration to_duration(py::handle v, const char* what) {
  double seconds;
  if (py::isinstance(v, py::module_::import("datetime").attr("timedelta"))) {
    seconds = py::cast<double>(v.attr("total_seconds")());
  } else if (PyFloat_Check(v.ptr()) || PyLong_Check(v.ptr())) {
    seconds = py::cast<double>(v);
  } else {
    throw py::type_error(std::string(what) + ": expected a datetime.timedelta or seconds");
  }
  if (!std::isfinite(seconds) || seconds < 0) {
    throw StatusError{Status(ErrorCode::kInvalidArgument,
                             std::string(what) + ": must be a finite, non-negative duration")};
  }
  using Seconds = std::chrono::duration<double>;
  return std::chrono::round<Duration>(Seconds(seconds));
}

// --- the rest -------------------------------------------------------------------------------

void bind_config(py::module_& m);
void bind_types(py::module_& m);
void bind_engine(py::module_& m);
void bind_info(py::module_& m);
// fabric::kv: layouts, KvDecoder, KvPrefiller, members and registries (kv.cc).
void bind_kv(py::module_& m);
// The C++ registry behind a fabric_lib Registry (LocalRegistry, FileRegistry, EtcdRegistry);
// raises TypeError for another object, Closed when it is closed. Holding the GIL; drop the
// reference without it (it may be the last one, whose destructor joins threads).
std::shared_ptr<kv::Registry> registry_of(py::handle registry);
// fabric::ep: the MoE all-to-all on device addresses (ep.cc).
void bind_ep(py::module_& m);
// fabric::weights: rank descriptions, the schedule, the FP8 quantiser (weights.cc).
void bind_weights(py::module_& m);

}  // namespace fabric::python
