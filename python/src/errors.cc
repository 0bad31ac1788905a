// Status codes as typed Python exceptions: one class per ErrorCode, all derived from
// fabric_lib.FabricError, each also derived from the closest built-in exception so that
// generic handlers (`except TimeoutError`) work.
#include <array>

#include "bindings.h"

namespace fabric::python {
namespace {

struct ErrorClass {
  ErrorCode code;
  const char* name;
  PyObject* builtin;  // a second base, or null
  const char* doc;
};

// Filled in bind_errors; the classes live as long as the process (module attributes).
PyObject* g_base = nullptr;
std::array<PyObject*, static_cast<size_t>(ErrorCode::kInternal) + 1> g_classes{};

std::array<ErrorClass, 12> error_classes() {
  return {{
      {ErrorCode::kInvalidArgument, "InvalidArgument", PyExc_ValueError,
       "Malformed input: bad descriptor bytes, zero count, a read-only buffer, a wrong version."},
      {ErrorCode::kOutOfRange, "OutOfRange", PyExc_IndexError,
       "An offset, length or page index outside a registered range."},
      {ErrorCode::kNotFound, "NotFound", PyExc_LookupError,
       "An unknown memory handle, peer group, device group or immediate expectation."},
      {ErrorCode::kAlreadyExists, "AlreadyExists", nullptr,
       "A second expectation for the same immediate, a second receive pool on a group."},
      {ErrorCode::kClosed, "Closed", nullptr, "The engine is closed or closing."},
      {ErrorCode::kUnsupported, "Unsupported", PyExc_NotImplementedError,
       "The provider or this build cannot do this (an absent provider, GPU memory without "
       "CUDA)."},
      {ErrorCode::kCancelled, "Cancelled", nullptr,
       "The transfer or expectation was abandoned because the engine closed."},
      {ErrorCode::kTimeout, "Timeout", PyExc_TimeoutError, "A bounded wait ran out."},
      {ErrorCode::kPeerUnreachable, "PeerUnreachable", PyExc_ConnectionError,
       "The fabric could not reach the peer (refused, reset, unknown, or silent for longer "
       "than Config.peer_timeout)."},
      {ErrorCode::kRemoteAccess, "RemoteAccess", nullptr,
       "The peer rejected the access (a stale key, a range outside its region)."},
      {ErrorCode::kFabric, "ProviderError", nullptr,
       "Any other provider error (ErrorCode.FABRIC); the message carries the provider's text."},
      {ErrorCode::kInternal, "InternalError", PyExc_RuntimeError, "A bug in fabric-lib."},
  }};
}

PyObject* class_for(ErrorCode code) {
  auto i = static_cast<size_t>(code);
  if (i < g_classes.size() && g_classes[i] != nullptr) return g_classes[i];
  return g_base;
}

}  // namespace

thread_local bool t_break_exception_for_test = false;

namespace {

// `s` with every byte outside printable ASCII written as \xNN: text no conversion can refuse.
std::string ascii_escaped(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += ch;
    } else {
      constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 0xf];
    }
  }
  return out;
}

py::object build_exception(const Status& status) {
  if (t_break_exception_for_test) {
    PyErr_SetString(PyExc_UnicodeError, "make_exception: a failure simulated by a test");
    throw py::error_already_set();
  }
  py::object cls = py::reinterpret_borrow<py::object>(class_for(status.code()));
  py::str message = text(status.message());
  py::object exc = cls(message);
  exc.attr("code") = py::cast(status.code());
  exc.attr("message") = message;
  return exc;
}

}  // namespace

py::object make_exception(const Status& status) {
  try {
    return build_exception(status);
  } catch (py::error_already_set&) {
  } catch (const std::exception&) {
  }
  // The exception object could not be built (out of memory, a conversion that failed): the
  // same class with the message in plain ASCII, so that whoever waits for it still gets it;
  // failing that, MemoryError (the one class that always has an instance).
  PyErr_Clear();
  const std::string message = ascii_escaped(status.message());
  PyObject* text =
      PyUnicode_FromStringAndSize(message.data(), static_cast<Py_ssize_t>(message.size()));
  PyObject* exc = text != nullptr ? PyObject_CallOneArg(class_for(status.code()), text) : nullptr;
  Py_XDECREF(text);
  if (exc == nullptr) {
    PyErr_Clear();
    return py::reinterpret_borrow<py::object>(PyExc_MemoryError);
  }
  py::object out = py::reinterpret_steal<py::object>(exc);
  try {
    out.attr("message") = py::str(message);
    out.attr("code") = py::cast(status.code());
  } catch (...) {
    PyErr_Clear();
  }
  return out;
}

std::string utf8(py::handle str) {
  PyObject* bytes = PyUnicode_AsEncodedString(str.ptr(), "utf-8", "backslashreplace");
  if (bytes == nullptr) throw py::error_already_set();
  std::string out(PyBytes_AS_STRING(bytes), static_cast<size_t>(PyBytes_GET_SIZE(bytes)));
  Py_DECREF(bytes);
  return out;
}

namespace {

[[noreturn]] void out_of_range(const IntArg& arg, const char* what, const std::string& range) {
  std::string value = utf8(py::repr(arg.value));
  if (value.size() > 40) value = value.substr(0, 37) + "...";
  throw StatusError{
      Status(ErrorCode::kInvalidArgument, std::string(what) + ": " + value + " is not " + range)};
}

}  // namespace

uint64_t unsigned_value(const IntArg& arg, const char* what, uint64_t max) {
  const std::string range = "an integer from 0 to " + std::to_string(max);
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(arg.value.ptr(), &overflow);
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  if (overflow < 0 || (overflow == 0 && v < 0)) out_of_range(arg, what, range);
  uint64_t u = static_cast<uint64_t>(v);
  if (overflow > 0) {
    u = PyLong_AsUnsignedLongLong(arg.value.ptr());
    if (u == static_cast<uint64_t>(-1) && PyErr_Occurred()) {
      PyErr_Clear();
      out_of_range(arg, what, range);
    }
  }
  if (u > max) out_of_range(arg, what, range);
  return u;
}

int64_t signed_value(const IntArg& arg, const char* what, int64_t min, int64_t max) {
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(arg.value.ptr(), &overflow);
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  if (overflow != 0 || v < min || v > max) {
    out_of_range(arg, what,
                 "an integer from " + std::to_string(min) + " to " + std::to_string(max));
  }
  return v;
}

void report_callback_error(py::error_already_set& e, py::handle callback) {
  e.restore();
  PyErr_WriteUnraisable(callback.ptr());
}

void bind_errors(py::module_& m) {
  py::enum_<ErrorCode>(m, "ErrorCode", "The code of a fabric-lib status; FabricError.code.")
      .value("OK", ErrorCode::kOk)
      .value("INVALID_ARGUMENT", ErrorCode::kInvalidArgument)
      .value("OUT_OF_RANGE", ErrorCode::kOutOfRange)
      .value("NOT_FOUND", ErrorCode::kNotFound)
      .value("ALREADY_EXISTS", ErrorCode::kAlreadyExists)
      .value("CLOSED", ErrorCode::kClosed)
      .value("UNSUPPORTED", ErrorCode::kUnsupported)
      .value("CANCELLED", ErrorCode::kCancelled)
      .value("TIMEOUT", ErrorCode::kTimeout)
      .value("PEER_UNREACHABLE", ErrorCode::kPeerUnreachable)
      .value("REMOTE_ACCESS", ErrorCode::kRemoteAccess)
      .value("FABRIC", ErrorCode::kFabric)
      .value("INTERNAL", ErrorCode::kInternal);

  // Named fabric_lib.X: the package re-exports them, and pickled exceptions find them there.
  g_base = PyErr_NewExceptionWithDoc(
      "fabric_lib.FabricError",
      "Base of every fabric-lib error. `code` is the ErrorCode, `message` (also str(e)) the "
      "library's message.",
      PyExc_Exception, nullptr);
  if (g_base == nullptr) throw py::error_already_set();
  m.add_object("FabricError", py::reinterpret_borrow<py::object>(g_base));
  for (const ErrorClass& c : error_classes()) {
    std::string qualified = std::string("fabric_lib.") + c.name;
    // Two statements, not a conditional: pybind11 3 gives make_tuple typed results.
    py::tuple bases = py::make_tuple(py::handle(g_base));
    if (c.builtin != nullptr) bases = py::make_tuple(py::handle(g_base), py::handle(c.builtin));
    PyObject* cls = PyErr_NewExceptionWithDoc(qualified.c_str(), c.doc, bases.ptr(), nullptr);
    if (cls == nullptr) throw py::error_already_set();
    g_classes[static_cast<size_t>(c.code)] = cls;
    m.add_object(c.name, py::reinterpret_borrow<py::object>(cls));
  }

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      py::object exc = make_exception(e.status);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  m.def(
      "error_class",
      [](ErrorCode code) { return py::reinterpret_borrow<py::object>(class_for(code)); },
      py::arg("code"),
      "The exception class raised for `code` (FabricError for OK, which is never raised).");
}

}  // namespace fabric::python
