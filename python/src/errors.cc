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

py::object make_exception(const Status& status) {
  py::object cls = py::reinterpret_borrow<py::object>(class_for(status.code()));
  py::object exc = cls(status.message());
  exc.attr("code") = py::cast(status.code());
  exc.attr("message") = py::str(status.message());
  return exc;
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
