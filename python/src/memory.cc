// Memory from Python objects: the buffer protocol (NumPy arrays, bytearray, memoryview, mmap)
// and DLPack (PyTorch tensors, and any other producer), for registrations and page indices.
#include <cstring>
#include <limits>

#include "bindings.h"

namespace fabric::python {
namespace {

// DLPack's C ABI (dlpack.h, version 0.x "dltensor" capsules), declared here so that the module
// needs no DLPack headers. Producers keep this layout stable.
struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; null: compact row-major
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};
static_assert(sizeof(DLDevice) == 8 && sizeof(DLDataType) == 4);
static_assert(sizeof(DLTensor) == 48 && offsetof(DLTensor, byte_offset) == 40);
static_assert(sizeof(DLManagedTensor) == 64);

constexpr int32_t kDLCPU = 1;
constexpr int32_t kDLCUDA = 2;
constexpr int32_t kDLCUDAHost = 3;  // pinned host memory: host-addressable
constexpr int32_t kDLROCM = 10;
constexpr int32_t kDLCUDAManaged = 13;
constexpr uint8_t kDLInt = 0;
constexpr uint8_t kDLUInt = 1;

[[noreturn]] void fail(ErrorCode code, std::string message) {
  throw StatusError{Status(code, std::move(message))};
}

std::string type_name(py::handle obj) {
  return utf8(py::type::handle_of(obj).attr("__qualname__"));
}

std::string device_name(const DLDevice& d) {
  switch (d.device_type) {
    case kDLCPU:
      return "cpu";
    case kDLCUDA:
      return "cuda:" + std::to_string(d.device_id);
    case kDLCUDAHost:
      return "cuda_host";
    case kDLROCM:
      return "rocm:" + std::to_string(d.device_id);
    case kDLCUDAManaged:
      return "cuda_managed:" + std::to_string(d.device_id);
    default:
      return "dlpack device type " + std::to_string(d.device_type);
  }
}

bool host_addressable(const DLDevice& d) {
  return d.device_type == kDLCPU || d.device_type == kDLCUDAHost;
}

// Asks `obj` for its DLPack device first, so that device memory is refused before it is
// exported (a CUDA export may synchronise streams).
DLDevice dlpack_device(py::handle obj) {
  py::tuple dev = obj.attr("__dlpack_device__")();
  return DLDevice{py::cast<int32_t>(py::int_(dev[0])), py::cast<int32_t>(py::int_(dev[1]))};
}

// Exports obj through DLPack; the capsule keeps the export alive until it is destroyed.
std::pair<py::object, DLTensor*> dlpack_export(py::handle obj) {
  py::object capsule = obj.attr("__dlpack__")();
  if (!PyCapsule_IsValid(capsule.ptr(), "dltensor")) {
    fail(ErrorCode::kInvalidArgument,
         type_name(obj) + ".__dlpack__() did not return an unused \"dltensor\" capsule");
  }
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  if (managed == nullptr) throw py::error_already_set();
  return {std::move(capsule), &managed->dl_tensor};
}

uint64_t element_count(const DLTensor& t) {
  uint64_t n = 1;
  for (int32_t d = 0; d < t.ndim; ++d) n *= static_cast<uint64_t>(t.shape[d]);
  return n;
}

bool dl_contiguous(const DLTensor& t) {
  if (t.strides == nullptr) return true;
  int64_t expected = 1;
  for (int32_t d = t.ndim - 1; d >= 0; --d) {
    if (t.shape[d] == 0) return true;  // empty: nothing to address
    if (t.shape[d] != 1 && t.strides[d] != expected) return false;
    expected *= t.shape[d];
  }
  return true;
}

// Reads one integer of `size` bytes, signed or not, as int64 (uint64 above INT64_MAX saturates,
// which the range check then rejects).
int64_t read_int(const char* p, size_t size, bool is_signed) {
  switch (size) {
    case 1:
      return is_signed ? int64_t{*reinterpret_cast<const int8_t*>(p)}
                       : int64_t{*reinterpret_cast<const uint8_t*>(p)};
    case 2: {
      int16_t s;
      uint16_t u;
      std::memcpy(is_signed ? static_cast<void*>(&s) : static_cast<void*>(&u), p, 2);
      return is_signed ? int64_t{s} : int64_t{u};
    }
    case 4: {
      int32_t s;
      uint32_t u;
      std::memcpy(is_signed ? static_cast<void*>(&s) : static_cast<void*>(&u), p, 4);
      return is_signed ? int64_t{s} : int64_t{u};
    }
    default: {
      if (is_signed) {
        int64_t s;
        std::memcpy(&s, p, 8);
        return s;
      }
      uint64_t u;
      std::memcpy(&u, p, 8);
      return u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
                 ? std::numeric_limits<int64_t>::max()
                 : static_cast<int64_t>(u);
    }
  }
}

uint32_t checked_index(int64_t v, size_t i, const char* what) {
  if (v < 0 || v > int64_t{std::numeric_limits<uint32_t>::max()}) {
    fail(ErrorCode::kOutOfRange, std::string(what) + "[" + std::to_string(i) + "] = " +
                                     std::to_string(v) + " is not a page index (0 to 4294967295)");
  }
  return static_cast<uint32_t>(v);
}

// Gathers n integers of `size` bytes spaced `stride` bytes apart.
std::vector<uint32_t> gather(const char* base, size_t n, int64_t stride, size_t size,
                             bool is_signed, const char* what) {
  std::vector<uint32_t> out(n);
  for (size_t i = 0; i < n; ++i) {
    out[i] =
        checked_index(read_int(base + static_cast<int64_t>(i) * stride, size, is_signed), i, what);
  }
  return out;
}

std::vector<uint32_t> indices_from_buffer(py::handle obj, const char* what) {
  Py_buffer view;
  if (PyObject_GetBuffer(obj.ptr(), &view, PyBUF_FORMAT | PyBUF_STRIDES) != 0) {
    throw py::error_already_set();
  }
  // Released on every path.
  std::unique_ptr<Py_buffer, void (*)(Py_buffer*)> guard(&view, PyBuffer_Release);
  if (view.ndim != 1) {
    fail(ErrorCode::kInvalidArgument, std::string(what) + " must be one-dimensional, not " +
                                          std::to_string(view.ndim) + "-dimensional");
  }
  std::string format = view.format != nullptr ? view.format : "B";
  if (!format.empty() && (format[0] == '@' || format[0] == '=' || format[0] == '<')) {
    format.erase(0, 1);
  }
  static const std::string kSigned = "bhilqn", kUnsigned = "BHILQN";
  const bool is_signed = format.size() == 1 && kSigned.find(format[0]) != std::string::npos;
  const bool is_unsigned = format.size() == 1 && kUnsigned.find(format[0]) != std::string::npos;
  const auto size = static_cast<size_t>(view.itemsize);
  if ((!is_signed && !is_unsigned) || (size != 1 && size != 2 && size != 4 && size != 8)) {
    fail(ErrorCode::kInvalidArgument, std::string(what) + " has element format '" +
                                          (view.format != nullptr ? view.format : "B") +
                                          "': page indices must be native integers");
  }
  return gather(static_cast<const char*>(view.buf), static_cast<size_t>(view.shape[0]),
                view.strides[0], size, is_signed, what);
}

std::vector<uint32_t> indices_from_dlpack(py::handle obj, const char* what) {
  DLDevice dev = dlpack_device(obj);
  if (!host_addressable(dev)) {
    fail(ErrorCode::kUnsupported, std::string(what) + " lives on " + device_name(dev) +
                                      ": page indices must be in host memory (call .cpu())");
  }
  auto [capsule, t] = dlpack_export(obj);
  if (t->ndim != 1) {
    fail(ErrorCode::kInvalidArgument, std::string(what) + " must be one-dimensional, not " +
                                          std::to_string(t->ndim) + "-dimensional");
  }
  const uint8_t bits = t->dtype.bits;
  if ((t->dtype.code != kDLInt && t->dtype.code != kDLUInt) || t->dtype.lanes != 1 ||
      (bits != 8 && bits != 16 && bits != 32 && bits != 64)) {
    fail(ErrorCode::kInvalidArgument,
         std::string(what) + " has a non-integer dtype: page indices must be integers");
  }
  const size_t size = bits / 8;
  const int64_t stride = (t->strides != nullptr ? t->strides[0] : 1) * static_cast<int64_t>(size);
  const char* base = static_cast<const char*>(t->data) + t->byte_offset;
  return gather(base, static_cast<size_t>(t->shape[0]), stride, size, t->dtype.code == kDLInt,
                what);
}

std::vector<uint32_t> indices_from_iterable(py::handle obj, const char* what) {
  std::vector<uint32_t> out;
  if (PySequence_Check(obj.ptr())) {
    Py_ssize_t n = PySequence_Size(obj.ptr());
    if (n > 0) out.reserve(static_cast<size_t>(n));
  }
  size_t i = 0;
  for (py::handle item : py::iter(obj)) {
    PyObject* index = PyNumber_Index(item.ptr());
    if (index == nullptr) throw py::error_already_set();
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(index, &overflow);
    Py_DECREF(index);
    if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (overflow != 0) v = overflow > 0 ? std::numeric_limits<long long>::max() : -1;
    out.push_back(checked_index(v, i++, what));
  }
  return out;
}

}  // namespace

std::unique_ptr<PinnedMemory> PinnedMemory::from_object(py::handle obj) {
  std::unique_ptr<PinnedMemory> m(new PinnedMemory());
  m->owner_ = py::reinterpret_borrow<py::object>(obj);
  if (PyObject_CheckBuffer(obj.ptr())) {
    if (PyObject_GetBuffer(obj.ptr(), &m->view_, PyBUF_WRITABLE | PyBUF_ANY_CONTIGUOUS) == 0) {
      m->has_view_ = true;
      m->ptr_ = m->view_.buf;
      m->length_ = static_cast<uint64_t>(m->view_.len);
      return m;
    }
    PyErr_Clear();
    // Say why: read-only, or not contiguous.
    Py_buffer probe;
    if (PyObject_GetBuffer(obj.ptr(), &probe, PyBUF_ANY_CONTIGUOUS) == 0) {
      PyBuffer_Release(&probe);
      fail(ErrorCode::kInvalidArgument,
           "register: the " + type_name(obj) +
               " is read-only; peers write into registered memory, so register a writable "
               "buffer (e.g. bytearray(data), or numpy.array(data))");
    }
    PyErr_Clear();
    fail(ErrorCode::kInvalidArgument,
         "register: the " + type_name(obj) +
             " is not contiguous; register the contiguous array it views (or a contiguous copy)");
  }
  if (py::hasattr(obj, "__dlpack__") && py::hasattr(obj, "__dlpack_device__")) {
    DLDevice dev = dlpack_device(obj);
    const bool cuda = dev.device_type == kDLCUDA || dev.device_type == kDLCUDAManaged;
#ifndef FABRIC_WITH_CUDA
    if (cuda) {
      fail(ErrorCode::kUnsupported, "register: " + device_name(dev) +
                                        " memory needs fabric-lib built with CUDA (this build "
                                        "has none; fabric_lib.HAS_CUDA is False)");
    }
#endif
    // CUDA memory: the engine stages device memory through pinned host memory (managed
    // memory is reachable by the NICs as it is).
    if (!cuda && !host_addressable(dev)) {
      fail(ErrorCode::kUnsupported, "register: memory on " + device_name(dev) +
                                        " is not host-addressable and this build cannot "
                                        "register it");
    }
    auto [capsule, t] = dlpack_export(obj);
    if (!dl_contiguous(*t)) {
      fail(ErrorCode::kInvalidArgument,
           "register: the " + type_name(obj) +
               " is not contiguous; register the tensor it views (or .contiguous())");
    }
    const uint64_t element_bytes = (uint64_t{t->dtype.bits} * t->dtype.lanes + 7) / 8;
    m->capsule_ = std::move(capsule);
    m->ptr_ = static_cast<std::byte*>(t->data) + t->byte_offset;
    m->length_ = element_count(*t) * element_bytes;
    m->device_ = cuda ? device_name(dev) : "cpu";
    return m;
  }
  throw py::type_error("register: a " + type_name(obj) +
                       " supports neither the buffer protocol nor DLPack (__dlpack__); pass a "
                       "NumPy array, a PyTorch tensor, a bytearray or a memoryview");
}

std::unique_ptr<PinnedMemory> PinnedMemory::from_pointer(uintptr_t ptr, uint64_t length,
                                                         py::object owner) {
  std::unique_ptr<PinnedMemory> m(new PinnedMemory());
  m->ptr_ = reinterpret_cast<void*>(ptr);
  m->length_ = length;
  m->owner_ = std::move(owner);
  return m;
}

PinnedMemory::~PinnedMemory() {
  if (has_view_) PyBuffer_Release(&view_);
}

std::vector<uint32_t> to_page_indices(py::handle obj, const char* what) {
  if (PyObject_CheckBuffer(obj.ptr())) return indices_from_buffer(obj, what);
  if (py::hasattr(obj, "__dlpack__") && py::hasattr(obj, "__dlpack_device__")) {
    return indices_from_dlpack(obj, what);
  }
  if (PyLong_Check(obj.ptr()) || !py::isinstance<py::iterable>(obj)) {
    throw py::type_error(std::string(what) +
                         ": expected a sequence of page indices, an integer "
                         "array or an integer tensor, not a " +
                         type_name(obj));
  }
  return indices_from_iterable(obj, what);
}

}  // namespace fabric::python
