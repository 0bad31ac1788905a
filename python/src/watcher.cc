// fabric_lib.UvmWatchers: GPU progress words whose changes run Python callbacks.
//
// The callback runs on the pool's polling thread, which takes the GIL only for the call. A
// callback that raises is reported through sys.unraisablehook and the word stays watched.
// Closing (or dropping) the pool releases the GIL while the polling thread stops, so a callback
// waiting for the GIL can finish.
#include "bindings.h"
#include "fabric/uvm_watcher.h"

namespace fabric::python {

namespace {

class PyWatchers {
 public:
  explicit PyWatchers(std::unique_ptr<UvmWatchers> w) : impl_(std::move(w)) {}
  ~PyWatchers() { close(); }

  void close() {
    if (!impl_) return;
    py::gil_scoped_release release;
    impl_.reset();
  }
  UvmWatchers& get() {
    if (!impl_) throw StatusError{Status(ErrorCode::kClosed, "the UvmWatchers pool is closed")};
    return *impl_;
  }

 private:
  std::unique_ptr<UvmWatchers> impl_;
};

// A CUDA stream from None, an int handle, or an object with .cuda_stream (torch.cuda.Stream).
void* stream_of(py::handle stream) {
  if (stream.is_none()) return nullptr;
  if (py::hasattr(stream, "cuda_stream")) stream = stream.attr("cuda_stream");
  return reinterpret_cast<void*>(py::cast<uintptr_t>(stream));
}

}  // namespace

void bind_watchers(py::module_& m) {
  py::class_<Watcher>(m, "Watcher", "One watched word of a UvmWatchers pool.")
      .def_readonly("slot", &Watcher::slot, "Its index in the pool.")
      .def_property_readonly(
          "device_ptr", [](const Watcher& w) { return reinterpret_cast<uintptr_t>(w.device_word); },
          "The word's device address (an int), for kernels that store into it themselves "
          "(a system-scope release store, as fabric::watcher_store does).")
      .def_property_readonly(
          "value", [](const Watcher& w) { return static_cast<uint64_t>(*w.host_word); },
          "The word's current value, read from the host.")
      .def("__repr__", [](const Watcher& w) {
        return "Watcher(slot=" + std::to_string(w.slot) +
               ", value=" + std::to_string(static_cast<uint64_t>(*w.host_word)) + ")";
      });

  py::class_<PyWatchers>(
      m, "UvmWatchers",
      "A pool of 64-bit words in pinned, device-mapped host memory, watched by one polling "
      "thread: when a GPU stream bumps a word (bump(), or a kernel's own store), the word's "
      "callback runs with (old, new) and typically submits the next transfer.")
      .def(py::init([](int cuda_device, uint32_t capacity, int cpu) {
             WatcherOptions o;
             o.cuda_device = cuda_device;
             o.capacity = capacity;
             o.cpu = cpu;
             Result<std::unique_ptr<UvmWatchers>> made = [&] {
               py::gil_scoped_release release;
               return UvmWatchers::create(o);
             }();
             return std::make_unique<PyWatchers>(check(std::move(made)));
           }),
           py::arg("cuda_device") = 0, py::arg("capacity") = 512, py::arg("cpu") = -1,
           "Allocates the pool on `cuda_device` and starts the polling thread (pinned to `cpu` "
           "when >= 0). Raises Unsupported without CUDA or without a device. Blocking, GIL "
           "released.")
      .def(
          "watch",
          [](PyWatchers& self, py::function callback, uint64_t initial) {
            auto ref = std::make_shared<PyRef>(callback);
            UvmWatchers::Callback cb = [ref](uint64_t old_value, uint64_t new_value) {
              py::gil_scoped_acquire gil;
              if (!*ref) return false;
              try {
                py::object keep = ref->get()(old_value, new_value);
                return keep.is_none() || py::cast<bool>(keep);
              } catch (py::error_already_set& e) {
                report_callback_error(e, ref->get());
                return true;
              }
            };
            return check(self.get().watch(std::move(cb), initial));
          },
          py::arg("callback"), py::arg("initial") = 0,
          "Takes a free word, sets it to `initial` and watches it: callback(old, new) runs on "
          "the polling thread for each change it sees (values stored faster than it polls "
          "coalesce) and returns whether to keep watching (None keeps it). Exceptions go to "
          "sys.unraisablehook and the word stays watched. Raises OutOfRange when the pool is "
          "full.")
      .def(
          "unwatch",
          [](PyWatchers& self, const Watcher& w) {
            UvmWatchers& pool = self.get();
            py::gil_scoped_release release;
            check(pool.unwatch(w));
          },
          py::arg("watcher"),
          "Stops watching; the callback does not start after this returns. Raises NotFound. "
          "GIL released.")
      .def(
          "bump",
          [](PyWatchers& self, const Watcher& w, uint64_t value, py::handle stream) {
            check(self.get().bump(w, value, stream_of(stream)));
          },
          py::arg("watcher"), py::arg("value"), py::arg("stream") = py::none(),
          "Enqueues on `stream` (a torch.cuda.Stream, an int cudaStream_t, or None for the "
          "default stream) a store of `value` into the watcher's word, after the stream's "
          "earlier work: the callback then sees it. Non-blocking.")
      .def_property_readonly(
          "live", [](PyWatchers& self) { return self.get().live(); }, "Words watched now.")
      .def("close", &PyWatchers::close,
           "Stops the polling thread (no callback runs after this returns) and frees the pool. "
           "Idempotent. GIL released.")
      .def(
          "__enter__", [](py::object self) { return self; }, "Returns the pool.")
      .def(
          "__exit__",
          [](PyWatchers& self, py::args) {
            self.close();
            return false;
          },
          "Closes the pool.");
}

}  // namespace fabric::python
