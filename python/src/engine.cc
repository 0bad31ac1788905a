// TransferEngine for Python: registrations of Python memory, every submission returning a
// Transfer (a concurrent.futures.Future that asyncio can await), callbacks, immediates and
// messages.
//
// Ownership. A TransferEngine (Python) owns an EngineCore; each Registration shares it, so a
// registration dropped after its engine still finds it (closed). Each submission owns a
// Completion (its future, callbacks and the source registration), shared by the C++ callbacks;
// the callback thread clears it under the GIL when the transfer completes. A submission with a
// counter= has no Completion: its C++ callbacks own the counter, and the engine core holds its
// source registration until a Python thread sees the transfer's callbacks gone.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>

#include "bindings.h"

namespace fabric::python {
namespace {

using namespace std::chrono_literals;

// fabric_lib._futures.Transfer and .Expectation, imported on first use (the package imports
// this module first). Leaked: they outlive every engine.
const py::object& futures_class(const char* name) {
  static py::object* transfer = nullptr;
  static py::object* expectation = nullptr;
  py::object*& slot = std::string_view(name) == "Transfer" ? transfer : expectation;
  if (slot == nullptr) {
    slot = new py::object(py::module_::import("fabric_lib._futures").attr(name));
  }
  return *slot;
}

}  // namespace

namespace {

// Runs fn(), reporting what it throws through sys.unraisablehook as raised by `where`: a C++
// exception (a failed conversion) as a RuntimeError. Holding the GIL.
template <typename Fn>
void reported(py::handle where, Fn&& fn) {
  try {
    fn();
  } catch (py::error_already_set& e) {
    report_callback_error(e, where);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    PyErr_WriteUnraisable(where.ptr());
  }
}

}  // namespace

void call_user(const PyRef& fn, py::args args) {
  if (!fn) return;
  py::object f = fn.get();  // alive through the call, even if the callback replaces itself
  reported(f, [&] { f(*args); });
}

void resolve(const PyRef& future, const char* method, py::handle value) {
  if (!future) return;
  reported(future.get(), [&] {
    py::module_::import("concurrent.futures").attr("Future").attr(method)(future.get(), value);
  });
}

namespace {

// The Python side of one submission or expectation.
struct Completion {
  PyRef future;
  PyRef on_done;
  PyRef on_error;
  PyRef keepalive;  // the source registration, valid until the transfer completes

  // On the callback thread. Neither throws: whatever the callback or a conversion raises is
  // reported, and the future resolves in any case.
  void done() {
    if (interpreter_finalizing()) return;
    py::gil_scoped_acquire gil;
    InCallback in;
    call_user(on_done);
    resolve(future, "set_result", py::none());
    clear();
  }
  void failed(const Status& s) {
    if (interpreter_finalizing()) return;
    py::gil_scoped_acquire gil;
    InCallback in;
    py::object exc = make_exception(s);  // never raises
    if (on_error) reported(on_error.get(), [&] { call_user(on_error, py::make_tuple(exc)); });
    resolve(future, "set_exception", exc);
    clear();
  }
  // Holding the GIL.
  void clear() {
    future.reset();
    on_done.reset();
    on_error.reset();
    keepalive.reset();
  }
};

Callbacks callbacks_for(const std::shared_ptr<Completion>& c) {
  return Callbacks{[c] { c->done(); }, [c](const Status& s) { c->failed(s); }};
}

// What a submission with counter= gives its C++ callbacks to own: the counter, so that dropping
// the Python CompletionCounter while the transfer runs frees nothing the worker still counts
// into. No Python object: the callbacks are destroyed on whichever thread ends the transfer,
// without the GIL. While they live, the transfer may still use its source memory.
struct CountedTransfer {
  std::shared_ptr<CompletionCounter> counter;
};

Callbacks counted_callbacks(std::shared_ptr<CountedTransfer> t) {
  Callbacks cb;
  cb.counter = t->counter.get();
  // on_done stays empty: a transfer that succeeds then queues no job for the callback thread,
  // and its callbacks (with `t`) are destroyed by the worker when it retires the transfer. A
  // failure queues this no-op, which only carries `t` to the callback thread.
  cb.on_error = [t = std::move(t)](const Status&) {};
  return cb;
}

// A user handler the engine calls with an argument (unexpected immediates).
struct HandlerSlot {
  PyRef fn;
  void call(uint32_t imm) {
    if (interpreter_finalizing()) return;
    py::gil_scoped_acquire gil;
    if (!fn) return;  // replaced or closed meanwhile
    InCallback in;
    call_user(fn, py::make_tuple(imm));
  }
};

// The receive pool of one group: messages go to a Python handler, or to a queue read by recv().
struct Receiver {
  PyRef handler;     // set at creation, cleared at close
  bool has_handler;  // immutable: whether messages go to the handler
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::string> queue;
  bool closed = false;

  explicit Receiver(py::object fn)
      : handler(fn.is_none() ? py::object() : std::move(fn)), has_handler(bool(handler)) {}

  // On the callback thread.
  void on_message(std::span<const std::byte> m) {
    if (!has_handler) {
      {
        std::lock_guard lock(mu);
        queue.emplace_back(reinterpret_cast<const char*>(m.data()), m.size());
      }
      cv.notify_all();
      return;
    }
    if (interpreter_finalizing()) return;
    py::gil_scoped_acquire gil;
    if (!handler) return;
    InCallback in;
    call_user(handler,
              py::make_tuple(py::bytes(reinterpret_cast<const char*>(m.data()), m.size())));
  }
  void close() {
    {
      std::lock_guard lock(mu);
      closed = true;
    }
    cv.notify_all();
  }
};

struct EngineCore {
  std::unique_ptr<TransferEngine> engine;
  std::atomic<bool> closed{false};
  // Guards the maps below; taken holding the GIL, never held while waiting for it.
  std::mutex mu;
  std::map<uint32_t, std::shared_ptr<Completion>> expectations;
  std::shared_ptr<HandlerSlot> unexpected;
  std::map<uint32_t, std::shared_ptr<Receiver>> receivers;
  // The source registrations of counted transfers, in submission order. The thread that ends
  // such a transfer holds no GIL and cannot drop them; a Python thread does, at the engine's next
  // submission (release_ended) or at close, once the transfer's callbacks are gone.
  struct Held {
    Held(std::weak_ptr<const CountedTransfer> t, py::object obj)
        : transfer(std::move(t)), keepalive(std::move(obj)) {}
    std::weak_ptr<const CountedTransfer> transfer;
    PyRef keepalive;
  };
  std::deque<Held> held;

  // Holding the GIL. Drops the registrations held for counted transfers that ended, from the
  // oldest on: a transfer still running keeps those after it for a while longer, which keeps
  // this O(1) per submission however many are in flight. `all`: every one (the engine closed).
  void release_ended(bool all = false) {
    // Dropped after the lock: a registration's destructor runs Python and unregisters with the
    // GIL released, when another thread may take the GIL and then wait for `mu`.
    std::vector<py::object> ended;
    {
      std::lock_guard lock(mu);
      while (!held.empty() && (all || held.front().transfer.expired())) {
        ended.push_back(held.front().keepalive.get());
        held.pop_front();
      }
    }
  }

  // Holding the GIL, on no callback thread. Ends what Python holds, then closes the engine
  // with the GIL released.
  void close() {
    if (closed.exchange(true)) return;
    fail_expectations();
    {
      py::gil_scoped_release nogil;
      engine->close();
    }
    // No callback runs any more; an expectation added by another thread meanwhile never will.
    fail_expectations();
    release_ended(/*all=*/true);
    std::lock_guard lock(mu);
    if (unexpected) unexpected->fn.reset();
    for (auto& [g, r] : receivers) {
      r->handler.reset();
      r->close();
    }
  }

 private:
  // Expectations never run once the engine closes: their futures fail with Cancelled.
  void fail_expectations() {
    std::map<uint32_t, std::shared_ptr<Completion>> pending;
    {
      std::lock_guard lock(mu);
      pending.swap(expectations);
    }
    for (auto& [imm, c] : pending) {
      py::object exc = make_exception(
          Status(ErrorCode::kCancelled, "expect_imm(" + std::to_string(imm) +
                                            "): the engine closed before the count was reached"));
      resolve(c->future, "set_exception", exc);
      c->clear();
    }
  }
};

// Cancels the future of the expectation of `imm` the engine just forgot. Holding the GIL.
void cancel_expectation_future(EngineCore& core, uint32_t imm) {
  std::shared_ptr<Completion> c;
  {
    std::lock_guard lock(core.mu);
    auto it = core.expectations.find(imm);
    if (it == core.expectations.end()) return;
    c = std::move(it->second);
    core.expectations.erase(it);
  }
  if (c->future) {
    py::module_::import("concurrent.futures").attr("Future").attr("cancel")(c->future.get());
  }
  c->clear();
}

// Every live engine, for the interpreter-exit hook, and engines whose last reference went away
// on a callback thread (where they cannot close), closed there later. Leaked on purpose.
std::mutex& registry_mu() {
  static auto* mu = new std::mutex;
  return *mu;
}
std::vector<std::weak_ptr<EngineCore>>& registry() {
  static auto* v = new std::vector<std::weak_ptr<EngineCore>>;
  return *v;
}
std::vector<std::shared_ptr<EngineCore>>& parked() {
  static auto* v = new std::vector<std::shared_ptr<EngineCore>>;
  return *v;
}

// Holding the GIL.
void close_all() {
  std::vector<std::shared_ptr<EngineCore>> cores;
  {
    std::lock_guard lock(registry_mu());
    for (auto& w : registry()) {
      if (auto c = w.lock()) cores.push_back(std::move(c));
    }
    registry().clear();
    for (auto& c : parked()) cores.push_back(std::move(c));
    parked().clear();
  }
  for (auto& c : cores) c->close();
}

class PyRegistration;

class PyEngine {
 public:
  explicit PyEngine(const Config& config) : core_(std::make_shared<EngineCore>()) {
    Result<std::unique_ptr<TransferEngine>> created = [&] {
      py::gil_scoped_release nogil;
      return TransferEngine::create(config);
    }();
    core_->engine = check(std::move(created));
    std::lock_guard lock(registry_mu());
    auto& r = registry();
    std::erase_if(r, [](const auto& w) { return w.expired(); });
    r.push_back(core_);
  }
  ~PyEngine() {
    if (t_in_callback) {
      // Closing here would wait for this very thread: close at the next close_all().
      std::lock_guard lock(registry_mu());
      parked().push_back(std::move(core_));
      return;
    }
    core_->close();
  }
  PyEngine(const PyEngine&) = delete;
  PyEngine& operator=(const PyEngine&) = delete;

  const std::shared_ptr<EngineCore>& core() const { return core_; }
  TransferEngine& engine() const { return *core_->engine; }

  void close() {
    refuse_in_callback("TransferEngine.close()");
    core_->close();
  }
  bool closed() const { return core_->closed.load(); }

 private:
  std::shared_ptr<EngineCore> core_;
};

class PyRegistration {
 public:
  PyRegistration(std::shared_ptr<EngineCore> core, std::unique_ptr<PinnedMemory> memory,
                 Registration reg, uint32_t group)
      : core_(std::move(core)), memory_(std::move(memory)), reg_(std::move(reg)), group_(group) {}
  ~PyRegistration() {
    if (!registered_) return;
    if (interpreter_finalizing()) {
      core_->engine->unregister_memory(reg_.handle).ignore();  // waits for no Python thread
      return;
    }
    py::gil_scoped_release nogil;
    core_->engine->unregister_memory(reg_.handle).ignore();  // kClosed once the engine is
  }
  PyRegistration(const PyRegistration&) = delete;
  PyRegistration& operator=(const PyRegistration&) = delete;

  void unregister() {
    if (!registered_) {
      throw StatusError{Status(ErrorCode::kNotFound, "the registration was already unregistered")};
    }
    registered_ = false;
    Status s = [&] {
      py::gil_scoped_release nogil;
      return core_->engine->unregister_memory(reg_.handle);
    }();
    check(s);
  }

  const Registration& reg() const { return reg_; }
  const PinnedMemory& memory() const { return *memory_; }
  uint32_t group() const { return group_; }
  bool registered() const { return registered_; }
  const std::shared_ptr<EngineCore>& core() const { return core_; }

 private:
  std::shared_ptr<EngineCore> core_;
  std::unique_ptr<PinnedMemory> memory_;  // the memory stays valid while this lives
  Registration reg_;
  uint32_t group_;
  bool registered_ = true;
};

}  // namespace

TransferEngine& engine_of(py::handle engine) {
  if (!py::isinstance<PyEngine>(engine)) throw py::type_error("engine: expected a TransferEngine");
  auto& e = py::cast<PyEngine&>(engine);
  if (e.closed()) throw StatusError{Status(ErrorCode::kClosed, "the TransferEngine is closed")};
  return e.engine();
}

const Registration& registration_of(py::handle registration, py::handle engine) {
  if (!py::isinstance<PyRegistration>(registration)) {
    throw py::type_error("memory: expected a Registration");
  }
  auto& r = py::cast<PyRegistration&>(registration);
  if (!r.registered()) {
    throw StatusError{
        Status(ErrorCode::kInvalidArgument, "memory: the registration was unregistered")};
  }
  if (r.core() != py::cast<PyEngine&>(engine).core()) {
    throw StatusError{
        Status(ErrorCode::kInvalidArgument, "memory: the registration belongs to another engine")};
  }
  return r.reg();
}

namespace {

// A submission's source: a Registration (kept alive until completion) or a MemoryHandle.
struct Source {
  MemoryHandle handle;
  py::object keepalive;
  std::optional<uint64_t> length;  // known for a Registration
};

Source to_source(py::handle src) {
  if (py::isinstance<PyRegistration>(src)) {
    const auto& r = py::cast<const PyRegistration&>(src);
    return {r.reg().handle, py::reinterpret_borrow<py::object>(src), r.memory().length()};
  }
  if (py::isinstance<MemoryHandle>(src)) return {py::cast<MemoryHandle>(src), py::none(), {}};
  throw py::type_error("src: expected a Registration or a MemoryHandle");
}

std::optional<uint32_t> to_imm(const py::object& imm) {
  if (imm.is_none()) return std::nullopt;
  if (!PyLong_Check(imm.ptr())) throw py::type_error("imm: expected an int or None");
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(imm.ptr(), &overflow);
  if (overflow != 0 || v < 0 || v > 0xffffffffLL) {
    throw StatusError{Status(ErrorCode::kInvalidArgument,
                             "imm: an immediate is a 32-bit unsigned value (0 to 4294967295)")};
  }
  return static_cast<uint32_t>(v);
}

py::object callable_or_none(py::object fn, const char* what) {
  if (!fn.is_none() && !PyCallable_Check(fn.ptr())) {
    throw py::type_error(std::string(what) + ": not callable");
  }
  return fn;
}

std::shared_ptr<CompletionCounter> to_counter(py::handle counter) {
  if (!py::isinstance<CompletionCounter>(counter)) {
    throw py::type_error("counter: expected a CompletionCounter or None");
  }
  return py::cast<std::shared_ptr<CompletionCounter>>(counter);
}

// The completion arguments every submission takes.
struct Completions {
  py::object on_done;
  py::object on_error;
  py::object counter;
};

// Makes the Completion of a submission (or, with a counter, counted callbacks) and runs
// `post(callbacks)` with the GIL released; returns the submission's Transfer future (with a
// counter: its transfer id), or raises what the engine rejected.
template <typename Post>
py::object submit(EngineCore& core, Completions how, py::object keepalive, Post&& post) {
  core.release_ended();
  if (!how.counter.is_none()) {
    // Either way of completing, not both: a counted transfer runs no Python code when it ends.
    if (!how.on_done.is_none() || !how.on_error.is_none()) {
      throw StatusError{Status(ErrorCode::kInvalidArgument,
                               "counter: a counted transfer takes no on_done or on_error")};
    }
    auto t = std::make_shared<CountedTransfer>(CountedTransfer{to_counter(how.counter)});
    std::weak_ptr<const CountedTransfer> watch = t;
    Result<TransferId> id = [&] {
      py::gil_scoped_release nogil;
      return post(counted_callbacks(std::move(t)));
    }();
    if (!id) throw StatusError{id.status()};
    if (!keepalive.is_none()) {
      std::lock_guard lock(core.mu);
      core.held.emplace_back(std::move(watch), std::move(keepalive));
    }
    return py::int_(*id);
  }
  py::object on_done = std::move(how.on_done);
  py::object on_error = std::move(how.on_error);
  auto c = std::make_shared<Completion>();
  py::object future = futures_class("Transfer")();
  c->future = PyRef(future);
  if (!on_done.is_none()) c->on_done = PyRef(callable_or_none(std::move(on_done), "on_done"));
  if (!on_error.is_none()) c->on_error = PyRef(callable_or_none(std::move(on_error), "on_error"));
  if (!keepalive.is_none()) c->keepalive = PyRef(std::move(keepalive));
  Result<TransferId> id = [&] {
    py::gil_scoped_release nogil;
    return post(callbacks_for(c));
  }();
  if (!id) {
    c->clear();
    throw StatusError{id.status()};
  }
  future.attr("id") = *id;
  return future;
}

template <typename Request>
py::object submit(PyEngine& self, const Request& request, Completions how, py::object keepalive) {
  return submit(*self.core(), std::move(how), std::move(keepalive),
                [&](Callbacks cb) { return self.engine().submit(request, std::move(cb)); });
}

// Waits in slices so that Ctrl-C (a pending signal) interrupts a long wait. `step(timeout)`
// returns whether the wait is over; it runs with the GIL released.
template <typename Step>
bool wait_interruptibly(std::optional<double> timeout_s, Step&& step) {
  using Clock = std::chrono::steady_clock;
  const auto deadline =
      timeout_s ? Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(std::max(0.0, *timeout_s)))
                : Clock::time_point::max();
  for (;;) {
    auto left = deadline - Clock::now();
    auto slice = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::min<Clock::duration>(left, 100ms));
    if (slice < 0ms) slice = 0ms;
    bool over;
    {
      py::gil_scoped_release nogil;
      over = step(slice);
    }
    if (over) return true;
    if (Clock::now() >= deadline) return false;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

std::string duration_text(std::optional<double> s) {
  return s ? std::to_string(*s) + " s" : std::string("ever");
}

}  // namespace

void bind_engine(py::module_& m) {
  py::class_<CompletionCounter, std::shared_ptr<CompletionCounter>>(
      m, "CompletionCounter",
      "Completions as counts, for code that polls instead of taking callbacks: pass "
      "counter=it to any TransferEngine submission. The engine counts each such transfer here "
      "the moment it ends, on the thread that ends it (the group's worker), taking no GIL and "
      "running no Python code. One counter may serve any number of transfers on any engines; "
      "the transfers keep it alive, so dropping it early is safe. Thread-safe.")
      .def(py::init<>(), "A counter at zero.")
      .def_property_readonly("done", &CompletionCounter::done,
                             "Transfers that ended successfully. An atomic load.")
      .def_property_readonly("failed", &CompletionCounter::failed, "Transfers that failed.")
      .def_property_readonly("ended", &CompletionCounter::ended, "done + failed.")
      .def_property_readonly(
          "first_error",
          [](const CompletionCounter& c) -> py::object {
            Status s = c.first_error();
            if (s.is_ok()) return py::none();
            return make_exception(s);
          },
          "The exception of the first failure counted (the class and message a Transfer "
          "would raise: PeerUnreachable, Cancelled, ...), or None.")
      .def(
          "wait",
          [](const CompletionCounter& c, const IntArg& n_arg, std::optional<double> timeout) {
            const uint64_t n = u64(n_arg, "CompletionCounter.wait: n");
            return wait_interruptibly(
                timeout, [&](std::chrono::milliseconds slice) { return c.wait(n, slice); });
          },
          py::arg("n"), py::arg("timeout") = py::none(),
          "Waits until `ended` >= n or `timeout` seconds passed (None: forever); returns whether "
          "it got there. Polls (yielding, then napping 50 us); GIL released. It does not drive "
          "a caller-driven group: call progress() for that.")
      .def(
          "__repr__",
          [](const CompletionCounter& c) {
            return "CompletionCounter(done=" + std::to_string(c.done()) +
                   ", failed=" + std::to_string(c.failed()) + ")";
          },
          "CompletionCounter(done=..., failed=...).");

  py::class_<PyRegistration>(
      m, "Registration",
      "Memory registered with an engine: `handle` for local submissions, `descriptor` (bytes, "
      "picklable) for peers. Unpacks as (handle, descriptor). The registered object is kept "
      "alive, and its memory valid, while the Registration lives; it is unregistered by "
      "unregister(), on leaving a `with` block, or when garbage-collected. Transfers hold their "
      "source registration until they complete.")
      .def_property_readonly(
          "handle", [](const PyRegistration& r) { return r.reg().handle; },
          "The local MemoryHandle.")
      .def_property_readonly(
          "descriptor", [](const PyRegistration& r) { return r.reg().descriptor; },
          "The RemoteMemory that peers write into (bytes(descriptor) to send it).")
      .def_property_readonly(
          "ptr",
          [](const PyRegistration& r) { return reinterpret_cast<uintptr_t>(r.memory().ptr()); },
          "The address of the first registered byte.")
      .def_property_readonly(
          "length", [](const PyRegistration& r) { return r.memory().length(); },
          "The registered length in bytes.")
      .def_property_readonly("group", &PyRegistration::group, "The device group it is on.")
      .def_property_readonly(
          "device", [](const PyRegistration& r) { return r.memory().device(); },
          "Where the memory lives: 'cpu' (GPU memory comes with the CUDA build).")
      .def_property_readonly(
          "obj", [](const PyRegistration& r) { return r.memory().owner(); },
          "The registered object (None for register_ptr without an owner).")
      .def_property_readonly("registered", &PyRegistration::registered,
                             "False once unregister() ran.")
      .def("unregister", &PyRegistration::unregister,
           "Forgets the registration (transfers already accepted still complete). Raises "
           "NotFound when already unregistered. Blocking, GIL released.")
      .def(
          "__iter__",
          [](const PyRegistration& r) {
            return py::iter(py::make_tuple(r.reg().handle, r.reg().descriptor));
          },
          "Iterates (handle, descriptor).")
      .def(
          "__enter__", [](py::object self) { return self; }, "Returns the registration.")
      .def(
          "__exit__",
          [](PyRegistration& r, py::args) {
            if (r.registered()) r.unregister();
          },
          "Unregisters.")
      .def(
          "__repr__",
          [](const PyRegistration& r) {
            return "Registration(handle=" + std::to_string(r.reg().handle.id) +
                   ", length=" + std::to_string(r.memory().length()) +
                   ", group=" + std::to_string(r.group()) +
                   (r.registered() ? "" : ", unregistered") + ")";
          },
          "Registration(handle=..., length=..., group=...).");

  py::class_<PyEngine>(
      m, "TransferEngine",
      "Moves memory between processes over RDMA-style fabrics (libfabric tcp, shm, efa).\n\n"
      "Every submission returns at once with a Transfer: a concurrent.futures.Future that "
      "`await` also accepts. It completes exactly once, after every work request of every NIC "
      "it used has completed: on_done() or on_error(exc) runs first, on the engine's callback "
      "thread, then the future resolves. Invalid submissions raise at once (nothing is posted, "
      "no callback runs). Exceptions raised by callbacks go to sys.unraisablehook and never "
      "stop the engine. The GIL is released around every call that waits. Use as a context "
      "manager, or call close().\n\n"
      "Every submission also takes `counter=CompletionCounter()` instead of on_done/on_error "
      "(both: InvalidArgument): the transfer is then counted there by the thread that ends it, "
      "no Python code runs for it, and the submission returns the transfer id (an int). Its "
      "source Registration is released at a later submission to this engine or at close().")
      .def(py::init([](std::optional<Config> config) {
             return std::make_unique<PyEngine>(config ? *config : Config{});
           }),
           py::arg("config") = py::none(),
           "Opens the provider's domains for every group and starts the threads; raises the "
           "error of the provider or NIC that could not be opened (Unsupported when absent). "
           "Blocking, GIL released.")
      .def("close", &PyEngine::close,
           "Stops accepting submissions, lets posted work finish for up to "
           "Config.close_timeout, cancels the rest (their futures raise Cancelled), runs every "
           "pending callback and joins the threads. Pending expect_imm futures raise Cancelled. "
           "Idempotent; not allowed in a callback. Blocking, GIL released.")
      .def_property_readonly("closed", &PyEngine::closed, "True once close() ran.")
      .def(
          "__enter__", [](py::object self) { return self; }, "Returns the engine.")
      .def(
          "__exit__", [](PyEngine& e, py::args) { e.close(); }, "Closes the engine.")
      .def_property_readonly(
          "num_groups", [](const PyEngine& e) { return e.engine().num_groups(); },
          "The number of device groups.")
      .def(
          "group_info",
          [](const PyEngine& e, const IntArg& group_arg) {
            const uint32_t group = u32(group_arg, "group_info: group");
            if (group >= e.engine().num_groups()) {
              throw StatusError{
                  Status(ErrorCode::kNotFound,
                         "device group " + std::to_string(group) + " does not exist")};
            }
            return e.engine().group_info(group);
          },
          py::arg("group") = 0, "What device group `group` turned out to be. Raises NotFound.")
      .def(
          "nics_up",
          [](const PyEngine& e, const IntArg& group) {
            return e.engine().nics_up(u32(group, "nics_up: group"));
          },
          py::arg("group") = 0,
          "For each NIC of device group `group`, in rail order, whether it is up (failover, "
          "docs/failover.md); empty for a group that does not exist. Non-blocking.")
      .def(
          "stats", [](const PyEngine& e) { return e.engine().stats(); },
          "What the engine has done since it started (an EngineStats): transfers, bytes and "
          "messages per device group, immediates counted. Lock-free; fabric_lib.metrics "
          "exports it to Prometheus.")
      .def_property_readonly(
          "address", [](const PyEngine& e) { return e.engine().address(0); },
          "The Address of device group 0 (bytes(engine.address) to send it). Non-blocking.")
      .def(
          "group_address",
          [](const PyEngine& e, const IntArg& group_arg) {
            const uint32_t group = u32(group_arg, "group_address: group");
            if (group >= e.engine().num_groups()) {
              throw StatusError{
                  Status(ErrorCode::kNotFound,
                         "device group " + std::to_string(group) + " does not exist")};
            }
            return e.engine().address(group);
          },
          py::arg("group"), "The Address of device group `group`. Raises NotFound.")

      // --- memory ---
      .def(
          "register",
          [](PyEngine& e, py::handle memory, const IntArg& group_arg, bool host_mirror,
             bool gpu_copies, bool remote_read) {
            const uint32_t group = u32(group_arg, "register: group");
            auto pinned = PinnedMemory::from_object(memory);
            Result<Registration> r = [&] {
              py::gil_scoped_release nogil;
              return e.engine().register_memory(
                  pinned->ptr(), pinned->length(),
                  RegisterOptions{group, host_mirror, gpu_copies, remote_read});
            }();
            return std::make_unique<PyRegistration>(e.core(), std::move(pinned),
                                                    check(std::move(r)), group);
          },
          py::arg("memory"), py::arg("group") = 0, py::arg("host_mirror") = true,
          py::arg("gpu_copies") = false, py::arg("remote_read") = false,
          "Registers the memory of a NumPy array, a PyTorch tensor (CPU or CUDA), or any object "
          "with "
          "the buffer protocol or DLPack, on every NIC of `group`, for local reads and remote "
          "writes. The memory must be writable and contiguous (InvalidArgument otherwise). "
          "CUDA tensors (when HAS_CUDA) are staged through a pinned host mirror of the same size "
          "by the engine; with host_mirror=False there is none, and only same-host peers reach "
          "the tensor, over CUDA IPC (Unsupported where that path is impossible). Without CUDA "
          "they raise Unsupported. gpu_copies=True (host memory only): page-locked, and "
          "same-host writers' CUDA tensors are copied into it by this process's current GPU over "
          "CUDA IPC instead of the fabric (InvalidArgument for CUDA tensors, Unsupported without "
          "a GPU or with cuda_ipc off). remote_read=True: peers may also read the memory "
          "(read(), paged_read()); off, their reads fail with RemoteAccess. Returns a "
          "Registration, which keeps the object alive. Blocking, GIL released.")
      .def(
          "register_ptr",
          [](PyEngine& e, const IntArg& ptr, const IntArg& length, const IntArg& group_arg,
             py::object owner, bool host_mirror, bool gpu_copies, bool remote_read) {
            const uint32_t group = u32(group_arg, "register_ptr: group");
            auto pinned =
                PinnedMemory::from_pointer(unsigned_arg<uintptr_t>(ptr, "register_ptr: ptr"),
                                           u64(length, "register_ptr: length"), std::move(owner));
            Result<Registration> r = [&] {
              py::gil_scoped_release nogil;
              return e.engine().register_memory(
                  pinned->ptr(), pinned->length(),
                  RegisterOptions{group, host_mirror, gpu_copies, remote_read});
            }();
            return std::make_unique<PyRegistration>(e.core(), std::move(pinned),
                                                    check(std::move(r)), group);
          },
          py::arg("ptr"), py::arg("length"), py::arg("group") = 0, py::arg("owner") = py::none(),
          py::arg("host_mirror") = true, py::arg("gpu_copies") = false,
          py::arg("remote_read") = false,
          "Registers [ptr, ptr + length): raw memory the caller keeps valid (`owner` is kept "
          "alive with the registration); host_mirror, gpu_copies and remote_read as for "
          "register(). "
          "Blocking, GIL released.")
      .def(
          "unregister",
          [](PyEngine& e, py::handle what) {
            if (py::isinstance<PyRegistration>(what)) {
              auto& r = py::cast<PyRegistration&>(what);
              if (r.core() != e.core()) {
                throw StatusError{Status(ErrorCode::kNotFound,
                                         "unregister: the registration belongs to another engine")};
              }
              r.unregister();
              return;
            }
            if (!py::isinstance<MemoryHandle>(what)) {
              throw py::type_error("unregister: expected a Registration or a MemoryHandle");
            }
            auto handle = py::cast<MemoryHandle>(what);
            Status s = [&] {
              py::gil_scoped_release nogil;
              return e.engine().unregister_memory(handle);
            }();
            check(s);
          },
          py::arg("registration"),
          "Forgets a Registration (or a MemoryHandle). Transfers already accepted that use it "
          "still complete. Raises NotFound for an unknown handle. GIL released.")

      // --- peers ---
      .def(
          "add_peer_group",
          [](PyEngine& e, py::iterable peers) {
            std::vector<Address> addrs;
            for (py::handle p : peers) addrs.push_back(to_address(p, "add_peer_group"));
            Result<PeerGroup> g = [&] {
              py::gil_scoped_release nogil;
              return e.engine().add_peer_group(std::move(addrs));
            }();
            return check(std::move(g));
          },
          py::arg("peers"),
          "A PeerGroup of peer addresses (Address or bytes) for scatter() and barrier(). Raises "
          "InvalidArgument (empty, another provider's address, a duplicate). GIL released.")
      .def(
          "remove_peer_group",
          [](PyEngine& e, PeerGroup g) {
            Status s = [&] {
              py::gil_scoped_release nogil;
              return e.engine().remove_peer_group(g);
            }();
            check(s);
          },
          py::arg("group"), "Forgets a PeerGroup. Raises NotFound.")

      // --- one-sided writes ---
      .def(
          "write",
          [](PyEngine& e, py::handle src, py::handle dst, const std::optional<IntArg>& length_arg,
             const IntArg& src_offset_arg, const IntArg& dst_offset_arg, py::object imm,
             std::optional<Routing> routing, py::object on_done, py::object on_error,
             py::object counter) {
            std::optional<uint64_t> length = u64(length_arg, "write: length");
            const uint64_t src_offset = u64(src_offset_arg, "write: src_offset");
            const uint64_t dst_offset = u64(dst_offset_arg, "write: dst_offset");
            Source s = to_source(src);
            if (!length) {
              if (!s.length) {
                throw StatusError{Status(ErrorCode::kInvalidArgument,
                                         "write: length is required when src is a MemoryHandle")};
              }
              if (src_offset > *s.length) {
                throw StatusError{Status(ErrorCode::kOutOfRange,
                                         "write: src_offset " + std::to_string(src_offset) +
                                             " exceeds the source's " + std::to_string(*s.length) +
                                             " bytes")};
              }
              length = *s.length - src_offset;
            }
            SingleWrite w{s.handle, src_offset,  to_remote(dst, "write: dst"), dst_offset,
                          *length,  to_imm(imm), routing.value_or(Routing{})};
            return submit(e, w, {std::move(on_done), std::move(on_error), std::move(counter)},
                          std::move(s.keepalive));
          },
          py::arg("src"), py::arg("dst"), py::arg("length") = py::none(), py::kw_only(),
          py::arg("src_offset") = 0, py::arg("dst_offset") = 0, py::arg("imm") = py::none(),
          py::arg("routing") = py::none(), py::arg("on_done") = py::none(),
          py::arg("on_error") = py::none(), py::arg("counter") = py::none(),
          "Writes `length` bytes (default: the rest of the source registration) from `src` "
          "(Registration or MemoryHandle) at src_offset to `dst` (RemoteMemory or its bytes) at "
          "dst_offset. With `imm`, the receiver counts exactly one arrival, after all the data. "
          "`routing`: Routing.sharded(n) (default) or Routing.pinned(nic). Returns a Transfer "
          "(with `counter`, the transfer id); raises OutOfRange, NotFound, InvalidArgument, "
          "Closed for a rejected write.")
      .def(
          "paged_write",
          [](PyEngine& e, py::handle src, py::handle dst, const IntArg& page_bytes,
             py::handle src_pages, py::handle dst_pages, const std::optional<IntArg>& src_stride,
             const IntArg& src_offset, const std::optional<IntArg>& dst_stride,
             const IntArg& dst_offset, py::object imm, py::object on_done, py::object on_error,
             py::object counter) {
            PagedWrite w;
            w.page_bytes = u64(page_bytes, "paged_write: page_bytes");
            w.src_stride = u64(src_stride, "paged_write: src_stride").value_or(w.page_bytes);
            w.src_offset = u64(src_offset, "paged_write: src_offset");
            w.dst_stride = u64(dst_stride, "paged_write: dst_stride").value_or(w.page_bytes);
            w.dst_offset = u64(dst_offset, "paged_write: dst_offset");
            Source s = to_source(src);
            w.src = s.handle;
            w.dst = to_remote(dst, "paged_write: dst");
            w.src_pages = to_page_indices(src_pages, "src_pages");
            w.dst_pages = to_page_indices(dst_pages, "dst_pages");
            w.imm = to_imm(imm);
            return submit(e, w, {std::move(on_done), std::move(on_error), std::move(counter)},
                          std::move(s.keepalive));
          },
          py::arg("src"), py::arg("dst"), py::arg("page_bytes"), py::arg("src_pages"),
          py::arg("dst_pages"), py::kw_only(), py::arg("src_stride") = py::none(),
          py::arg("src_offset") = 0, py::arg("dst_stride") = py::none(), py::arg("dst_offset") = 0,
          py::arg("imm") = py::none(), py::arg("on_done") = py::none(),
          py::arg("on_error") = py::none(), py::arg("counter") = py::none(),
          "The KV-cache pattern: page i copies page_bytes from src_offset + src_pages[i] * "
          "src_stride to dst_offset + dst_pages[i] * dst_stride (strides default to page_bytes). "
          "Page lists: sequences of ints, integer NumPy arrays or integer CPU tensors. With "
          "`imm`, the receiver counts one arrival per page. Returns a Transfer (with `counter`, "
          "the transfer id).")

      // --- one-sided reads ---
      .def(
          "read",
          [](PyEngine& e, py::handle dst, py::handle src, const std::optional<IntArg>& length_arg,
             const IntArg& dst_offset_arg, const IntArg& src_offset_arg,
             std::optional<Routing> routing, py::object on_done, py::object on_error,
             py::object counter) {
            std::optional<uint64_t> length = u64(length_arg, "read: length");
            const uint64_t dst_offset = u64(dst_offset_arg, "read: dst_offset");
            const uint64_t src_offset = u64(src_offset_arg, "read: src_offset");
            Source local = to_source(dst);
            RemoteMemory remote = to_remote(src, "read: src");
            if (!length) {
              if (src_offset > remote.length()) {
                throw StatusError{Status(ErrorCode::kOutOfRange,
                                         "read: src_offset " + std::to_string(src_offset) +
                                             " exceeds the remote region's " +
                                             std::to_string(remote.length()) + " bytes")};
              }
              length = remote.length() - src_offset;
            }
            SingleRead r{local.handle, dst_offset, std::move(remote),
                         src_offset,   *length,    routing.value_or(Routing{})};
            return submit(e, r, {std::move(on_done), std::move(on_error), std::move(counter)},
                          std::move(local.keepalive));
          },
          py::arg("dst"), py::arg("src"), py::arg("length") = py::none(), py::kw_only(),
          py::arg("dst_offset") = 0, py::arg("src_offset") = 0, py::arg("routing") = py::none(),
          py::arg("on_done") = py::none(), py::arg("on_error") = py::none(),
          py::arg("counter") = py::none(),
          "Reads `length` bytes (default: the rest of the remote region) of a peer's region "
          "`src` (RemoteMemory or its bytes, registered with remote_read=True) at src_offset into "
          "`dst` (Registration or MemoryHandle) at dst_offset. The transfer is done once every "
          "byte is in `dst`; the peer is told nothing. Returns a Transfer (with `counter`, the "
          "transfer id); raises RemoteAccess (not readable), OutOfRange, NotFound, "
          "InvalidArgument, Unsupported, Closed for a rejected read.")
      .def(
          "paged_read",
          [](PyEngine& e, py::handle dst, py::handle src, const IntArg& page_bytes,
             py::handle src_pages, py::handle dst_pages, const std::optional<IntArg>& src_stride,
             const IntArg& src_offset, const std::optional<IntArg>& dst_stride,
             const IntArg& dst_offset, py::object on_done, py::object on_error,
             py::object counter) {
            PagedRead r;
            r.page_bytes = u64(page_bytes, "paged_read: page_bytes");
            r.src_stride = u64(src_stride, "paged_read: src_stride").value_or(r.page_bytes);
            r.src_offset = u64(src_offset, "paged_read: src_offset");
            r.dst_stride = u64(dst_stride, "paged_read: dst_stride").value_or(r.page_bytes);
            r.dst_offset = u64(dst_offset, "paged_read: dst_offset");
            Source local = to_source(dst);
            r.dst = local.handle;
            r.src = to_remote(src, "paged_read: src");
            r.src_pages = to_page_indices(src_pages, "src_pages");
            r.dst_pages = to_page_indices(dst_pages, "dst_pages");
            return submit(e, r, {std::move(on_done), std::move(on_error), std::move(counter)},
                          std::move(local.keepalive));
          },
          py::arg("dst"), py::arg("src"), py::arg("page_bytes"), py::arg("src_pages"),
          py::arg("dst_pages"), py::kw_only(), py::arg("src_stride") = py::none(),
          py::arg("src_offset") = 0, py::arg("dst_stride") = py::none(), py::arg("dst_offset") = 0,
          py::arg("on_done") = py::none(), py::arg("on_error") = py::none(),
          py::arg("counter") = py::none(),
          "Pulls pages: page i copies page_bytes of the peer's region `src` at src_offset + "
          "src_pages[i] * src_stride into `dst` at dst_offset + dst_pages[i] * dst_stride "
          "(strides default to page_bytes). Page lists as for paged_write. Returns a Transfer "
          "(with `counter`, the transfer id).")
      .def(
          "scatter",
          [](PyEngine& e, py::handle src, PeerGroup group, py::iterable targets, py::object imm,
             Scatter::Sharding sharding, py::object on_done, py::object on_error,
             py::object counter) {
            Source s = to_source(src);
            Scatter sc;
            sc.src = s.handle;
            sc.group = group;
            for (py::handle t : targets) {
              if (py::isinstance<ScatterTarget>(t)) {
                sc.targets.push_back(py::cast<ScatterTarget>(t));
                continue;
              }
              py::tuple tup = py::cast<py::tuple>(t);
              if (tup.size() < 2 || tup.size() > 4) {
                throw py::type_error(
                    "scatter: a target is a ScatterTarget or (dst, length[, src_offset[, "
                    "dst_offset]])");
              }
              auto field = [&](size_t i, const char* what) -> uint64_t {
                if (i >= tup.size()) return 0;
                py::detail::make_caster<IntArg> v;
                if (!v.load(tup[i], true)) throw py::type_error(std::string(what) + ": not an int");
                return u64(py::detail::cast_op<const IntArg&>(v), what);
              };
              sc.targets.push_back(ScatterTarget{
                  to_remote(tup[0], "scatter: target dst"), field(1, "scatter: target length"),
                  field(2, "scatter: target src_offset"), field(3, "scatter: target dst_offset")});
            }
            sc.imm = to_imm(imm);
            sc.sharding = sharding;
            return submit(e, sc, {std::move(on_done), std::move(on_error), std::move(counter)},
                          std::move(s.keepalive));
          },
          py::arg("src"), py::arg("group"), py::arg("targets"), py::kw_only(),
          py::arg("imm") = py::none(), py::arg("sharding") = Scatter::Sharding::kByPeer,
          py::arg("on_done") = py::none(), py::arg("on_error") = py::none(),
          py::arg("counter") = py::none(),
          "The MoE pattern: one source to many peers of a PeerGroup. `targets`: ScatterTarget "
          "or (dst, length, src_offset, dst_offset) tuples, each dst owned by a member. With "
          "`imm`, each receiver counts one arrival per target addressed to it. Returns a "
          "Transfer (with `counter`, the transfer id).")
      .def(
          "barrier",
          [](PyEngine& e, PeerGroup group, const IntArg& imm, const IntArg& nic,
             const IntArg& local_group, py::object on_done, py::object on_error,
             py::object counter) {
            return submit(e,
                          Barrier{group, u32(imm, "barrier: imm"), u32(nic, "barrier: nic"),
                                  u32(local_group, "barrier: local_group")},
                          {std::move(on_done), std::move(on_error), std::move(counter)},
                          py::none());
          },
          py::arg("group"), py::arg("imm"), py::kw_only(), py::arg("nic") = 0,
          py::arg("local_group") = 0, py::arg("on_done") = py::none(),
          py::arg("on_error") = py::none(), py::arg("counter") = py::none(),
          "A zero-byte write with immediate `imm` to every member of `group`: each counts one "
          "arrival. Sent from local NIC `nic` of device group `local_group`. Returns a Transfer "
          "(with `counter`, the transfer id).")
      .def(
          "imm_write",
          [](PyEngine& e, py::handle peer, const IntArg& imm, const IntArg& nic,
             const IntArg& local_group, py::object on_done, py::object on_error,
             py::object counter) {
            return submit(
                e,
                ImmWrite{to_address(peer, "imm_write: peer"), u32(imm, "imm_write: imm"),
                         u32(nic, "imm_write: nic"), u32(local_group, "imm_write: local_group")},
                {std::move(on_done), std::move(on_error), std::move(counter)}, py::none());
          },
          py::arg("peer"), py::arg("imm"), py::kw_only(), py::arg("nic") = 0,
          py::arg("local_group") = 0, py::arg("on_done") = py::none(),
          py::arg("on_error") = py::none(), py::arg("counter") = py::none(),
          "One zero-byte write with immediate `imm` to `peer` (Address or bytes), from local NIC "
          "`nic` to the peer's NIC on that rail. Returns a Transfer (with `counter`, the transfer "
          "id).")

      // --- two-sided messages ---
      .def(
          "send",
          [](PyEngine& e, py::handle peer, py::handle message, const IntArg& group_arg,
             py::object on_done, py::object on_error, py::object counter) {
            const uint32_t group = u32(group_arg, "send: group");
            Address a = to_address(peer, "send: peer");
            Py_buffer view;
            if (PyObject_GetBuffer(message.ptr(), &view, PyBUF_C_CONTIGUOUS) != 0) {
              PyErr_Clear();
              throw py::type_error("send: the message must be a contiguous bytes-like object");
            }
            std::unique_ptr<Py_buffer, void (*)(Py_buffer*)> guard(&view, PyBuffer_Release);
            auto bytes = std::span<const std::byte>(static_cast<const std::byte*>(view.buf),
                                                    static_cast<size_t>(view.len));
            return submit(*e.core(), {std::move(on_done), std::move(on_error), std::move(counter)},
                          py::none(), [&](Callbacks cb) {
                            return e.engine().submit_send(a, bytes, std::move(cb), group);
                          });
          },
          py::arg("peer"), py::arg("message"), py::kw_only(), py::arg("group") = 0,
          py::arg("on_done") = py::none(), py::arg("on_error") = py::none(),
          py::arg("counter") = py::none(),
          "Sends `message` (bytes-like, copied before return, at most Config.max_message_bytes: "
          "OutOfRange otherwise) to the peer, which must receive "
          "(set_receive_handler). Messages are not flow-controlled: a peer without a free "
          "receive buffer may fail or drop. Returns a Transfer (with `counter`, the transfer "
          "id).")
      .def(
          "set_receive_handler",
          [](PyEngine& e, py::object handler, const IntArg& buffer_bytes_arg,
             const IntArg& count_arg, const IntArg& group_arg) {
            const uint64_t buffer_bytes =
                u64(buffer_bytes_arg, "set_receive_handler: buffer_bytes");
            const uint32_t count = u32(count_arg, "set_receive_handler: count");
            const uint32_t group = u32(group_arg, "set_receive_handler: group");
            auto r = std::make_shared<Receiver>(callable_or_none(std::move(handler), "handler"));
            Status s = [&] {
              py::gil_scoped_release nogil;
              return e.engine().set_receive_handler(
                  [r](std::span<const std::byte> m) { r->on_message(m); }, buffer_bytes, count,
                  group);
            }();
            if (!s) {
              r->handler.reset();
              check(s);
            }
            std::lock_guard lock(e.core()->mu);
            e.core()->receivers[group] = std::move(r);
          },
          py::arg("handler") = py::none(), py::kw_only(), py::arg("buffer_bytes") = 64 * 1024,
          py::arg("count") = 64, py::arg("group") = 0,
          "Posts `count` receive buffers of `buffer_bytes` on every NIC of the group and keeps "
          "them posted. Each message is passed as bytes to handler(message) on the callback "
          "thread, or, with no handler, queued for recv(). Once per group: AlreadyExists on a "
          "second call. Blocking, GIL released.")
      .def(
          "recv",
          [](PyEngine& e, std::optional<double> timeout, const IntArg& group_arg) {
            const uint32_t group = u32(group_arg, "recv: group");
            std::shared_ptr<Receiver> r;
            {
              std::lock_guard lock(e.core()->mu);
              auto it = e.core()->receivers.find(group);
              if (it != e.core()->receivers.end()) r = it->second;
            }
            if (!r || r->has_handler) {
              throw StatusError{
                  Status(ErrorCode::kNotFound,
                         "recv: group " + std::to_string(group) +
                             (r ? " passes messages to its handler" : " does not receive") +
                             "; call set_receive_handler() without a handler first")};
            }
            std::string message;
            bool closed = false;
            bool got = wait_interruptibly(timeout, [&](std::chrono::milliseconds slice) {
              std::unique_lock lock(r->mu);
              r->cv.wait_for(lock, slice, [&] { return !r->queue.empty() || r->closed; });
              if (!r->queue.empty()) {
                message = std::move(r->queue.front());
                r->queue.pop_front();
                return true;
              }
              closed = r->closed;
              return closed;
            });
            if (closed) throw StatusError{Status(ErrorCode::kClosed, "recv: the engine is closed")};
            if (!got) {
              throw StatusError{
                  Status(ErrorCode::kTimeout, "recv: no message within " + duration_text(timeout))};
            }
            return py::bytes(message);
          },
          py::arg("timeout") = py::none(), py::kw_only(), py::arg("group") = 0,
          "The next message queued on `group` (set_receive_handler() without a handler). Waits "
          "up to `timeout` seconds (None: forever): Timeout when none came, Closed when the "
          "engine closed. GIL released while waiting.")

      // --- immediates ---
      .def(
          "expect_imm",
          [](py::object self, const IntArg& imm_arg, const IntArg& count_arg,
             py::object on_reached) {
            const uint32_t imm = u32(imm_arg, "expect_imm: imm");
            const uint64_t count = u64(count_arg, "expect_imm: count");
            auto& e = py::cast<PyEngine&>(self);
            auto c = std::make_shared<Completion>();
            py::object future = futures_class("Expectation")(
                imm, count, py::module_::import("weakref").attr("ref")(self));
            c->future = PyRef(future);
            if (!on_reached.is_none()) {
              c->on_done = PyRef(callable_or_none(std::move(on_reached), "on_reached"));
            }
            std::weak_ptr<EngineCore> weak = e.core();
            auto on_reached_cb = [c, weak, imm] {
              if (interpreter_finalizing()) return;
              py::gil_scoped_acquire gil;
              if (auto core = weak.lock()) {
                std::lock_guard lock(core->mu);
                auto it = core->expectations.find(imm);
                if (it != core->expectations.end() && it->second == c) core->expectations.erase(it);
              }
              InCallback in;
              call_user(c->on_done);
              resolve(c->future, "set_result", py::none());
              c->clear();
            };
            // Registered before the engine can run it; a stale entry (reached, its callback
            // not yet run) is replaced, and put back if the engine refuses this one.
            std::shared_ptr<Completion> previous;
            {
              std::lock_guard lock(e.core()->mu);
              previous = std::exchange(e.core()->expectations[imm], c);
            }
            Status s = [&] {
              py::gil_scoped_release nogil;
              return e.engine().expect_imm(imm, count, on_reached_cb);
            }();
            if (!s) {
              {
                std::lock_guard lock(e.core()->mu);
                auto it = e.core()->expectations.find(imm);
                if (it != e.core()->expectations.end() && it->second == c) {
                  if (previous) {
                    it->second = std::move(previous);
                  } else {
                    e.core()->expectations.erase(it);
                  }
                }
              }
              c->clear();
              check(s);
            }
            return future;
          },
          py::arg("imm"), py::arg("count"), py::arg("on_reached") = py::none(),
          "Expects `count` arrivals of immediate `imm` not claimed by an earlier expectation "
          "(arrivals before this call count). Returns an Expectation future that resolves, "
          "after on_reached() ran on the callback thread, once they are here; the arrivals are "
          "then claimed. Expectation.cancel() withdraws it. Raises InvalidArgument (count 0), "
          "AlreadyExists (one is pending for imm).")
      .def(
          "cancel_expect_imm",
          [](PyEngine& e, const IntArg& imm_arg) {
            const uint32_t imm = u32(imm_arg, "cancel_expect_imm: imm");
            Status s = [&] {
              py::gil_scoped_release nogil;
              return e.engine().cancel_expect_imm(imm);
            }();
            check(s);
            cancel_expectation_future(*e.core(), imm);
          },
          py::arg("imm"),
          "Withdraws the pending expectation of `imm`: its callback will not run and its future "
          "is cancelled. Raises NotFound when none is pending.")
      .def(
          "_withdraw_expectation",
          [](PyEngine& e, uint32_t imm, py::handle future) {
            {
              std::lock_guard lock(e.core()->mu);
              auto it = e.core()->expectations.find(imm);
              if (it == e.core()->expectations.end() || !it->second->future ||
                  !it->second->future.get().is(future)) {
                return false;  // resolved, or no longer the pending expectation of imm
              }
            }
            Status s = [&] {
              py::gil_scoped_release nogil;
              return e.engine().cancel_expect_imm(imm);
            }();
            if (!s) return false;
            cancel_expectation_future(*e.core(), imm);
            return true;
          },
          py::arg("imm"), py::arg("future"),
          "Expectation.cancel(): withdraws the expectation of `imm` if `future` is still its "
          "pending one.")
      .def(
          "set_unexpected_imm_handler",
          [](PyEngine& e, py::object handler) {
            std::shared_ptr<HandlerSlot> slot;
            if (!handler.is_none()) {
              slot = std::make_shared<HandlerSlot>();
              slot->fn = PyRef(callable_or_none(std::move(handler), "handler"));
            }
            {
              py::gil_scoped_release nogil;
              if (slot) {
                e.engine().set_unexpected_imm_handler([slot](uint32_t imm) { slot->call(imm); });
              } else {
                e.engine().set_unexpected_imm_handler(nullptr);
              }
            }
            std::shared_ptr<HandlerSlot> old;
            {
              std::lock_guard lock(e.core()->mu);
              old = std::exchange(e.core()->unexpected, slot);
            }
            if (old) old->fn.reset();
          },
          py::arg("handler"),
          "handler(imm) runs on the callback thread for each arrival of an immediate that has no "
          "pending expectation (it is still counted). Replaces any previous handler; None "
          "removes it.")
      .def(
          "progress",
          [](PyEngine& e, const IntArg& group_arg) {
            const uint32_t group = u32(group_arg, "progress: group");
            py::gil_scoped_release nogil;  // the callbacks it runs take the GIL themselves
            return e.engine().progress(group);
          },
          py::arg("group") = 0,
          "For a group created with GroupConfig(caller_progress=True), which has no worker "
          "thread: one pass of its loop on this thread (posts, polls, counts arrivals, runs the "
          "callbacks due, here). Returns whether it did anything; False for a group that is not "
          "caller-driven or once the engine is closing. Futures of such a group complete only "
          "while some thread calls it; wait_imm, register and unregister drive it themselves.")
      .def(
          "imm_count",
          [](const PyEngine& e, const IntArg& imm) {
            return e.engine().imm_count(u32(imm, "imm_count: imm"));
          },
          py::arg("imm"),
          "Arrivals of `imm` since the engine started (or reset_imm). Non-blocking.")
      .def(
          "wait_imm",
          [](const PyEngine& e, const IntArg& imm_arg, const IntArg& total_arg,
             std::optional<double> timeout) {
            const uint32_t imm = u32(imm_arg, "wait_imm: imm");
            const uint64_t total = u64(total_arg, "wait_imm: total");
            return wait_interruptibly(timeout, [&](std::chrono::milliseconds slice) {
              return e.engine().wait_imm(imm, total, slice);
            });
          },
          py::arg("imm"), py::arg("total"), py::arg("timeout") = py::none(),
          "Waits until imm_count(imm) >= total or `timeout` seconds passed (None: forever); "
          "returns whether it was reached. GIL released while waiting.")
      .def(
          "reset_imm",
          [](PyEngine& e, const IntArg& imm_arg) {
            const uint32_t imm = u32(imm_arg, "reset_imm: imm");
            {
              py::gil_scoped_release nogil;
              e.engine().reset_imm(imm);
            }
            cancel_expectation_future(*e.core(), imm);
          },
          py::arg("imm"),
          "Forgets the tally and any expectation of `imm` (its future is cancelled).");

  m.def(
      "_fail_transfer_for_test",
      [](ErrorCode code, const py::bytes& message, py::object on_error, bool break_exception) {
        if (code == ErrorCode::kOk) {
          throw StatusError{Status(ErrorCode::kInvalidArgument, "code: OK is not a failure")};
        }
        auto c = std::make_shared<Completion>();
        py::object future = futures_class("Transfer")();
        c->future = PyRef(future);
        if (!on_error.is_none()) {
          c->on_error = PyRef(callable_or_none(std::move(on_error), "on_error"));
        }
        struct Restore {
          ~Restore() { t_break_exception_for_test = false; }
        } restore;
        t_break_exception_for_test = break_exception;
        c->failed(Status(code, std::string(message)));
        return future;
      },
      py::arg("code"), py::arg("message"), py::kw_only(), py::arg("on_error") = py::none(),
      py::arg("break_exception") = false,
      "Tests only: a Transfer failed with (code, message: bytes, which may be foreign to "
      "UTF-8) through the path the engine's callback thread takes, on_error included; with "
      "break_exception, building the exception object fails as a conversion would. Returns "
      "the resolved Transfer.");
  m.def("_close_all", &close_all,
        "Closes every engine still open (registered with atexit by the package, so that no "
        "engine thread outlives the interpreter).");
}

bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

void PyRef::reset() {
  if (!obj_) return;
  if (interpreter_finalizing()) {
    obj_.release();  // leaked: the interpreter is going away
    return;
  }
  if (PyGILState_Check() != 0) {
    obj_ = py::object();
    return;
  }
  py::gil_scoped_acquire gil;
  obj_ = py::object();
}

}  // namespace fabric::python
