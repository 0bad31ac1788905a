// fabric::kv for Python: KvLayout and the TP slice plan, KvDecoder and KvPrefiller (each request
// a KvRequest future, callbacks on engine threads), Member and the registries.
//
// Ownership. A KvDecoder / KvPrefiller (Python) holds its TransferEngine and Registration
// (Python objects) and a Slot with the C++ object; the C++ object is always destroyed with the
// GIL released (its timer thread may be waiting for the GIL in a callback), before the engine.
// Registries likewise. An object whose last reference goes away inside one of the module's
// callbacks (which its own threads may run) is parked and destroyed by _kv_close_all, which
// the package runs at exit before the engines close.
//
// Each live request's Completion (future and callbacks) is in the object's pending map until
// its callback ran; close() fails what remains with Closed.
#include <pybind11/chrono.h>

#include <map>
#include <mutex>
#include <optional>

#include "bindings.h"
#include "fabric/kv/flow.h"
#include "fabric/kv/group.h"
#include "fabric/kv/layout.h"
#include "fabric/kv/registry.h"

namespace fabric::python {
namespace {

using kv::KvDecoder;
using kv::KvLayout;
using kv::KvPrefiller;
using kv::Member;
using kv::RequestId;
using kv::SliceCopy;

// A C++ object (KvDecoder, KvPrefiller, Registry) behind a Python one. Touched holding the GIL.
struct Slot {
  std::shared_ptr<void> impl;
  py::object keep;  // what impl needs alive (the engine, the registered memory), dropped after
};

// Every live slot, for _kv_close_all; and slots parked by a destruction in a callback. Leaked.
std::vector<std::weak_ptr<Slot>>& live_slots() {
  static auto* v = new std::vector<std::weak_ptr<Slot>>;
  return *v;
}
std::vector<std::shared_ptr<Slot>>& parked_slots() {
  static auto* v = new std::vector<std::shared_ptr<Slot>>;
  return *v;
}

std::shared_ptr<Slot> new_slot(std::shared_ptr<void> impl, py::object keep) {
  auto s = std::make_shared<Slot>(Slot{std::move(impl), std::move(keep)});
  auto& live = live_slots();
  std::erase_if(live, [](const auto& w) { return w.expired(); });
  live.push_back(s);
  return s;
}

// Destroys the slot's object with the GIL released, then what it kept. Holding the GIL.
void empty_slot(Slot& s) {
  std::shared_ptr<void> impl = std::move(s.impl);
  if (impl) {
    py::gil_scoped_release nogil;
    impl.reset();
  }
  s.keep = py::object();
}

// A Python object's destructor: park the slot in a callback, else empty it.
void drop_slot(std::shared_ptr<Slot>& s) {
  if (!s || !s->impl) return;
  if (t_in_callback) {
    parked_slots().push_back(std::move(s));
    return;
  }
  empty_slot(*s);
}

void kv_close_all() {
  std::vector<std::shared_ptr<Slot>> slots;
  for (auto& w : live_slots()) {
    if (auto s = w.lock()) slots.push_back(std::move(s));
  }
  live_slots().clear();
  for (auto& s : parked_slots()) slots.push_back(std::move(s));
  parked_slots().clear();
  for (auto& s : slots) empty_slot(*s);
}

[[noreturn]] void closed(const char* what) {
  throw StatusError{Status(ErrorCode::kClosed, std::string("the ") + what + " is closed")};
}

// Runs fn(object) with the GIL released; a close() meanwhile leaves the last reference here,
// also dropped without the GIL.
template <typename T, typename Fn>
auto with_object(const std::shared_ptr<Slot>& slot, const char* what, Fn&& fn) {
  std::shared_ptr<T> p = std::static_pointer_cast<T>(slot->impl);
  if (!p) closed(what);
  py::gil_scoped_release nogil;
  auto r = fn(*p);
  p.reset();
  return r;
}

// An engine address from an Address, its bytes, or its hex text (Member.address).
Address address_arg(py::handle obj, const char* what) {
  if (py::isinstance<py::str>(obj)) {
    auto a = Address::from_hex(utf8(obj));
    if (!a) {
      throw StatusError{
          Status(ErrorCode::kInvalidArgument, std::string(what) + ": " + a.status().message())};
    }
    return *a;
  }
  return to_address(obj, what);
}

py::object callable_arg(py::object fn, const char* what) {
  if (!fn.is_none() && !PyCallable_Check(fn.ptr())) {
    throw py::type_error(std::string(what) + ": not callable");
  }
  return fn;
}

const py::object& kv_request_class() {
  static py::object* cls = nullptr;
  if (cls == nullptr) {
    cls = new py::object(py::module_::import("fabric_lib._futures").attr("KvRequest"));
  }
  return *cls;
}

// The Python side of one request.
struct Completion {
  PyRef future;
  PyRef on_end;    // decoder: on_ready(id, pages); prefiller: on_finished(id, error or None)
  PyRef on_error;  // decoder: on_error(id, error)
  PyRef on_layer;  // prefiller: on_layer(id, decode_rank, layer)
  // Holding the GIL.
  void clear() {
    future.reset();
    on_end.reset();
    on_error.reset();
    on_layer.reset();
  }
};

// The live requests of one KvDecoder or KvPrefiller. mu is taken holding the GIL, never held
// while waiting for it.
struct Pending {
  std::mutex mu;
  std::map<RequestId, std::shared_ptr<Completion>> requests;

  // Removes `c` if it is still the completion of `id`. Holding the GIL.
  static void forget(const std::weak_ptr<Pending>& weak, RequestId id,
                     const std::shared_ptr<Completion>& c) {
    auto p = weak.lock();
    if (!p) return;
    std::lock_guard lock(p->mu);
    auto it = p->requests.find(id);
    if (it != p->requests.end() && it->second == c) p->requests.erase(it);
  }
  // Registers c for id before the C++ call that may run its callback; undone by restore().
  std::shared_ptr<Completion> add(RequestId id, std::shared_ptr<Completion> c) {
    std::lock_guard lock(mu);
    return std::exchange(requests[id], std::move(c));
  }
  void restore(RequestId id, const std::shared_ptr<Completion>& c,
               std::shared_ptr<Completion> previous) {
    std::lock_guard lock(mu);
    auto it = requests.find(id);
    if (it == requests.end() || it->second != c) return;
    if (previous) {
      it->second = std::move(previous);
    } else {
      requests.erase(it);
    }
  }
  // Fails every request still pending with Closed. Holding the GIL.
  void fail_all(const char* what) {
    std::map<RequestId, std::shared_ptr<Completion>> left;
    {
      std::lock_guard lock(mu);
      left.swap(requests);
    }
    for (auto& [id, c] : left) {
      py::object exc = make_exception(Status(
          ErrorCode::kClosed, "request " + std::to_string(id) + ": the " + what + " was closed"));
      resolve(c->future, "set_exception", exc);
      c->clear();
    }
  }
};

// Ends request `id` (holding the GIL): forgets it, calls the user's callback `user` with (id,
// value), then resolves the future: its result is `value` when ok, else `value` is the exception.
void settle(const std::shared_ptr<Completion>& c, const std::weak_ptr<Pending>& weak, RequestId id,
            const PyRef& user, py::object value, bool ok) {
  Pending::forget(weak, id, c);
  InCallback in;
  call_user(user, py::make_tuple(id, value));
  resolve(c->future, ok ? "set_result" : "set_exception", value);
  c->clear();
}

// A decoder's or a group's on_error: the user's on_error(id, exception), then the future fails.
std::function<void(RequestId, const Status&)> error_callback(std::shared_ptr<Completion> c,
                                                             std::weak_ptr<Pending> weak) {
  return [c = std::move(c), weak = std::move(weak)](RequestId id, const Status& s) {
    if (interpreter_finalizing()) return;
    py::gil_scoped_acquire gil;
    settle(c, weak, id, c->on_error, make_exception(s), false);
  };
}

// What KvDecoder and KvPrefiller share.
class PyKvBase {
 public:
  PyKvBase(const char* what) : what_(what), pending_(std::make_shared<Pending>()) {}
  ~PyKvBase() {
    if (slot_ && slot_->impl && !t_in_callback) pending_->fail_all(what_);
    drop_slot(slot_);
  }
  PyKvBase(const PyKvBase&) = delete;
  PyKvBase& operator=(const PyKvBase&) = delete;

  void close() {
    if (!slot_ || !slot_->impl) return;
    refuse_in_callback(std::string(what_) + ".close()");
    empty_slot(*slot_);
    pending_->fail_all(what_);
  }
  bool is_closed() const { return !slot_ || !slot_->impl; }
  std::shared_ptr<void> impl() const { return slot_ ? slot_->impl : nullptr; }

 protected:
  const char* what_;
  std::shared_ptr<Slot> slot_;
  std::shared_ptr<Pending> pending_;
};

class PyKvDecoder : public PyKvBase {
 public:
  PyKvDecoder(py::object engine, const KvLayout& layout, py::object memory,
              const kv::Options& options)
      : PyKvBase("KvDecoder") {
    TransferEngine& e = engine_of(engine);
    const Registration& reg = registration_of(memory, engine);
    auto made = [&] {
      py::gil_scoped_release nogil;
      return KvDecoder::create(e, layout, reg, options);
    }();
    std::shared_ptr<KvDecoder> d = check(std::move(made));
    slot_ = new_slot(std::move(d), py::make_tuple(engine, memory));
  }

  py::object submit(const IntArg& id_arg, py::iterable prefill_ranks, const IntArg& num_pages,
                    py::object pages, py::object on_ready, py::object on_error) {
    kv::DecodeRequest rq;
    const RequestId id = u64(id_arg, "KvDecoder.submit: request_id");
    rq.id = id;
    rq.num_pages = u32(num_pages, "KvDecoder.submit: num_pages");
    if (!pages.is_none()) rq.pages = to_page_indices(pages, "pages");
    for (py::handle a : prefill_ranks) rq.prefill_ranks.push_back(address_arg(a, "prefill_ranks"));
    auto c = std::make_shared<Completion>();
    py::object future = kv_request_class()(id);
    c->future = PyRef(future);
    if (!on_ready.is_none()) c->on_end = PyRef(callable_arg(std::move(on_ready), "on_ready"));
    if (!on_error.is_none()) c->on_error = PyRef(callable_arg(std::move(on_error), "on_error"));
    std::weak_ptr<Pending> weak = pending_;
    rq.on_ready = [c, weak](RequestId id, std::span<const uint32_t> pages) {
      if (interpreter_finalizing()) return;
      std::vector<uint32_t> copy(pages.begin(), pages.end());
      py::gil_scoped_acquire gil;
      settle(c, weak, id, c->on_end, py::cast(copy), true);
    };
    rq.on_error = error_callback(c, weak);
    auto previous = pending_->add(id, c);
    auto got =
        with_object<KvDecoder>(slot_, what_, [&](KvDecoder& d) { return d.submit(std::move(rq)); });
    if (!got) {
      pending_->restore(id, c, std::move(previous));
      c->clear();
      throw StatusError{got.status()};
    }
    future.attr("pages") = py::cast(*got);
    return future;
  }

  void cancel(const IntArg& id_arg) {
    const RequestId id = u64(id_arg, "KvDecoder.cancel: request_id");
    check(with_object<KvDecoder>(slot_, what_, [&](KvDecoder& d) { return d.cancel(id); }));
  }
  void release(const IntArg& id_arg) {
    const RequestId id = u64(id_arg, "KvDecoder.release: request_id");
    check(with_object<KvDecoder>(slot_, what_, [&](KvDecoder& d) { return d.release(id); }));
  }
  void fail_peer(py::handle peer) {
    Address a = address_arg(peer, "fail_peer: peer");
    with_object<KvDecoder>(slot_, what_, [&](KvDecoder& d) {
      d.fail_peer(a);
      return 0;
    });
  }
  uint32_t free_pages() {
    return with_object<KvDecoder>(slot_, what_, [](KvDecoder& d) { return d.free_pages(); });
  }
  size_t live_requests() {
    return with_object<KvDecoder>(slot_, what_, [](KvDecoder& d) { return d.live_requests(); });
  }
  KvLayout layout() {
    return with_object<KvDecoder>(slot_, what_, [](KvDecoder& d) { return d.layout(); });
  }
  // The C++ decoder, shared (a DecodeGroup keeps it alive). Holding the GIL.
  std::shared_ptr<KvDecoder> shared() const {
    auto p = std::static_pointer_cast<KvDecoder>(slot_->impl);
    if (!p) closed(what_);
    return p;
  }
};

// A DecodeGroup and the decoders it points into (destroyed after it).
struct GroupHolder {
  std::vector<std::shared_ptr<KvDecoder>> decoders;
  std::unique_ptr<kv::DecodeGroup> group;
  ~GroupHolder() { group.reset(); }
};

class PyKvDecodeGroup : public PyKvBase {
 public:
  explicit PyKvDecodeGroup(py::list decoders) : PyKvBase("KvDecodeGroup") {
    auto holder = std::make_shared<GroupHolder>();
    std::vector<KvDecoder*> raw;
    for (py::handle d : decoders) {
      if (!py::isinstance<PyKvDecoder>(d))
        throw py::type_error("decoders: expected KvDecoder objects");
      holder->decoders.push_back(py::cast<const PyKvDecoder&>(d).shared());
      raw.push_back(holder->decoders.back().get());
    }
    holder->group = check(kv::DecodeGroup::create(std::move(raw)));
    slot_ = new_slot(std::move(holder), py::tuple(decoders));
  }

  py::object submit(const IntArg& id_arg, py::iterable prefill_ranks, const IntArg& num_pages,
                    py::object on_ready, py::object on_error) {
    kv::GroupRequest rq;
    const RequestId id = u64(id_arg, "KvDecodeGroup.submit: request_id");
    rq.id = id;
    rq.num_pages = u32(num_pages, "KvDecodeGroup.submit: num_pages");
    for (py::handle a : prefill_ranks) rq.prefill_ranks.push_back(address_arg(a, "prefill_ranks"));
    auto c = std::make_shared<Completion>();
    py::object future = kv_request_class()(id);
    c->future = PyRef(future);
    if (!on_ready.is_none()) c->on_end = PyRef(callable_arg(std::move(on_ready), "on_ready"));
    if (!on_error.is_none()) c->on_error = PyRef(callable_arg(std::move(on_error), "on_error"));
    std::weak_ptr<Pending> weak = pending_;
    rq.on_ready = [c, weak](RequestId id, const std::vector<std::vector<uint32_t>>& pages) {
      if (interpreter_finalizing()) return;
      py::gil_scoped_acquire gil;
      settle(c, weak, id, c->on_end, py::cast(pages), true);
    };
    rq.on_error = error_callback(c, weak);
    auto previous = pending_->add(id, c);
    Status st = with_object<GroupHolder>(
        slot_, what_, [&](GroupHolder& g) { return g.group->submit(std::move(rq)); });
    if (!st) {
      pending_->restore(id, c, std::move(previous));
      c->clear();
      throw StatusError{st};
    }
    return future;
  }
  void cancel(const IntArg& id_arg) {
    const RequestId id = u64(id_arg, "KvDecodeGroup.cancel: request_id");
    check(with_object<GroupHolder>(slot_, what_,
                                   [&](GroupHolder& g) { return g.group->cancel(id); }));
  }
  void release(const IntArg& id_arg) {
    const RequestId id = u64(id_arg, "KvDecodeGroup.release: request_id");
    check(with_object<GroupHolder>(slot_, what_,
                                   [&](GroupHolder& g) { return g.group->release(id); }));
  }
  size_t live_requests() {
    return with_object<GroupHolder>(slot_, what_,
                                    [](GroupHolder& g) { return g.group->live_requests(); });
  }
  size_t size() {
    return with_object<GroupHolder>(slot_, what_, [](GroupHolder& g) { return g.group->size(); });
  }
};

class PyKvPrefiller : public PyKvBase {
 public:
  PyKvPrefiller(py::object engine, const KvLayout& layout, py::object memory,
                const kv::Options& options)
      : PyKvBase("KvPrefiller") {
    TransferEngine& e = engine_of(engine);
    const Registration& reg = registration_of(memory, engine);
    auto made = [&] {
      py::gil_scoped_release nogil;
      return KvPrefiller::create(e, layout, reg, options);
    }();
    std::shared_ptr<KvPrefiller> p = check(std::move(made));
    slot_ = new_slot(std::move(p), py::make_tuple(engine, memory));
  }

  py::object start(const IntArg& id_arg, py::handle pages, const IntArg& decode_tp_arg,
                   py::object on_finished, py::object on_layer) {
    const RequestId id = u64(id_arg, "KvPrefiller.start: request_id");
    const uint32_t decode_tp = u32(decode_tp_arg, "KvPrefiller.start: decode_tp");
    std::vector<uint32_t> page_list = to_page_indices(pages, "pages");
    auto c = std::make_shared<Completion>();
    py::object future = kv_request_class()(id);
    future.attr("pages") = py::cast(page_list);
    c->future = PyRef(future);
    if (!on_finished.is_none()) {
      c->on_end = PyRef(callable_arg(std::move(on_finished), "on_finished"));
    }
    KvPrefiller::LayerFn layer_fn;
    if (!on_layer.is_none()) {
      c->on_layer = PyRef(callable_arg(std::move(on_layer), "on_layer"));
      layer_fn = [c](RequestId id, uint32_t rank, uint32_t layer) {
        if (interpreter_finalizing()) return;
        py::gil_scoped_acquire gil;
        if (!c->on_layer) return;
        InCallback in;
        call_user(c->on_layer, py::make_tuple(id, rank, layer));
      };
    }
    std::weak_ptr<Pending> weak = pending_;
    KvPrefiller::FinishedFn finished_fn = [c, weak](RequestId id, const Status& s) {
      if (interpreter_finalizing()) return;
      py::gil_scoped_acquire gil;
      settle(c, weak, id, c->on_end, s ? py::object(py::none()) : make_exception(s), s.is_ok());
    };
    auto previous = pending_->add(id, c);
    Status st = with_object<KvPrefiller>(slot_, what_, [&](KvPrefiller& p) {
      return p.start(id, std::move(page_list), decode_tp, std::move(finished_fn),
                     std::move(layer_fn));
    });
    if (!st) {
      pending_->restore(id, c, std::move(previous));
      c->clear();
      throw StatusError{st};
    }
    return future;
  }

  void layer_done(const IntArg& id_arg, const IntArg& layer_arg) {
    const RequestId id = u64(id_arg, "KvPrefiller.layer_done: request_id");
    const uint32_t layer = u32(layer_arg, "KvPrefiller.layer_done: layer");
    check(with_object<KvPrefiller>(slot_, what_,
                                   [&](KvPrefiller& p) { return p.layer_done(id, layer); }));
  }
  void cancel(const IntArg& id_arg) {
    const RequestId id = u64(id_arg, "KvPrefiller.cancel: request_id");
    check(with_object<KvPrefiller>(slot_, what_, [&](KvPrefiller& p) { return p.cancel(id); }));
  }
  void fail_peer(py::handle peer) {
    Address a = address_arg(peer, "fail_peer: peer");
    with_object<KvPrefiller>(slot_, what_, [&](KvPrefiller& p) {
      p.fail_peer(a);
      return 0;
    });
  }
  size_t live_requests() {
    return with_object<KvPrefiller>(slot_, what_, [](KvPrefiller& p) { return p.live_requests(); });
  }
  KvLayout layout() {
    return with_object<KvPrefiller>(slot_, what_, [](KvPrefiller& p) { return p.layout(); });
  }
};

// --- registries ---------------------------------------------------------------------------

class PyRegistry {
 public:
  virtual ~PyRegistry() { drop_slot(slot_); }
  explicit PyRegistry(const char* what) : what_(what) {}
  PyRegistry(const PyRegistry&) = delete;
  PyRegistry& operator=(const PyRegistry&) = delete;

  void join(const Member& m) {
    check(with_object<kv::Registry>(slot_, "registry", [&](kv::Registry& r) { return r.join(m); }));
  }
  void leave(const std::string& name) {
    check(with_object<kv::Registry>(slot_, "registry",
                                    [&](kv::Registry& r) { return r.leave(name); }));
  }
  std::vector<Member> members() {
    return check(
        with_object<kv::Registry>(slot_, "registry", [](kv::Registry& r) { return r.members(); }));
  }
  void watch(py::object fn) {
    if (!PyCallable_Check(fn.ptr())) throw py::type_error("watch: fn is not callable");
    auto ref = std::make_shared<PyRef>(std::move(fn));
    kv::Registry::WatchFn w = [ref](bool joined, const Member& m) {
      if (interpreter_finalizing()) return;
      py::gil_scoped_acquire gil;
      if (!*ref) return;
      InCallback in;
      call_user(*ref, py::make_tuple(joined, m));
    };
    check(with_object<kv::Registry>(slot_, "registry",
                                    [&](kv::Registry& r) { return r.watch(std::move(w)); }));
  }
  void close() {
    if (!slot_ || !slot_->impl) return;
    refuse_in_callback(std::string(what_) + ".close()");
    empty_slot(*slot_);
  }
  bool is_closed() const { return !slot_ || !slot_->impl; }
  std::shared_ptr<void> impl() const { return slot_ ? slot_->impl : nullptr; }

 protected:
  void set(std::shared_ptr<kv::Registry> r) { slot_ = new_slot(std::move(r), py::none()); }
  const char* what_;  // the Python class, for messages
  std::shared_ptr<Slot> slot_;
};

// The shared state of LocalRegistry objects that see each other.
struct PyLocalState {
  std::shared_ptr<kv::LocalRegistry::Shared> shared = kv::LocalRegistry::make_shared_state();
};

class PyLocalRegistry : public PyRegistry {
 public:
  explicit PyLocalRegistry(const PyLocalState& state) : PyRegistry("LocalRegistry") {
    set(std::make_shared<kv::LocalRegistry>(state.shared));
  }
};

class PyFileRegistry : public PyRegistry {
 public:
  explicit PyFileRegistry(const kv::FileOptions& o)
      : PyRegistry("FileRegistry"), directory_(o.directory) {
    auto made = [&] {
      py::gil_scoped_release nogil;
      return kv::FileRegistry::open(o);
    }();
    set(std::shared_ptr<kv::Registry>(check(std::move(made))));
  }
  const std::string& directory() const { return directory_; }

 private:
  std::string directory_;
};

class PyEtcdRegistry : public PyRegistry {
 public:
  explicit PyEtcdRegistry(const kv::EtcdOptions& o) : PyRegistry("EtcdRegistry") {
    auto made = [&] {
      py::gil_scoped_release nogil;
      return kv::EtcdRegistry::connect(o);
    }();
    set(std::shared_ptr<kv::Registry>(check(std::move(made))));
  }
  uint64_t resyncs() {
    return with_object<kv::Registry>(slot_, "registry", [](kv::Registry& r) {
      return static_cast<kv::EtcdRegistry&>(r).resyncs();
    });
  }
};

py::object self_of(py::object self) {
  return self;
}

template <typename T>
void bind_context(py::class_<T>& cls, const char* what) {
  cls.def("__enter__", &self_of, (std::string("Returns the ") + what + ".").c_str())
      .def(
          "__exit__",
          [](T& self, py::args) {
            self.close();
            return false;
          },
          (std::string("Closes the ") + what + ".").c_str());
}

}  // namespace

std::shared_ptr<kv::Registry> registry_of(py::handle registry) {
  if (!py::isinstance<PyRegistry>(registry)) {
    throw py::type_error(
        "expected a fabric_lib registry (LocalRegistry, FileRegistry, "
        "EtcdRegistry), not " +
        py::cast<std::string>(py::str(py::type::of(registry).attr("__name__"))));
  }
  auto r = std::static_pointer_cast<kv::Registry>(py::cast<PyRegistry&>(registry).impl());
  if (!r) closed("registry");
  return r;
}

void bind_kv(py::module_& m) {
  // --- layout ---
  py::class_<KvLayout> layout_class(
      m, "KvLayout",
      "The geometry of one tensor-parallel rank's paged KV cache in one registered region: "
      "region + base_offset + layer * layer_step + page * page_step holds one page, laid out "
      "[part (K, V)][local head][token][head_bytes]. Rank r of a TP group of size tp <= "
      "num_kv_heads holds heads [r*H/tp, (r+1)*H/tp); with tp > num_kv_heads each head is "
      "replicated on tp/H ranks. Plain values: no engine, nothing blocks.");
  layout_class.def(
      py::init([](const IntArg& num_layers, const IntArg& num_pages, const IntArg& tokens_per_page,
                  const IntArg& num_kv_heads, const IntArg& head_bytes, bool split_kv,
                  const IntArg& tp_size, const IntArg& tp_rank, const IntArg& base_offset,
                  const IntArg& layer_stride, const IntArg& page_stride) {
        return KvLayout{u32(num_layers, "KvLayout: num_layers"),
                        u32(num_pages, "KvLayout: num_pages"),
                        u32(tokens_per_page, "KvLayout: tokens_per_page"),
                        u32(num_kv_heads, "KvLayout: num_kv_heads"),
                        u32(head_bytes, "KvLayout: head_bytes"),
                        split_kv,
                        u32(tp_size, "KvLayout: tp_size"),
                        u32(tp_rank, "KvLayout: tp_rank"),
                        u64(base_offset, "KvLayout: base_offset"),
                        u64(layer_stride, "KvLayout: layer_stride"),
                        u64(page_stride, "KvLayout: page_stride")};
      }),
      py::kw_only(), py::arg("num_layers") = 0, py::arg("num_pages") = 0,
      py::arg("tokens_per_page") = 0, py::arg("num_kv_heads") = 0, py::arg("head_bytes") = 0,
      py::arg("split_kv") = true, py::arg("tp_size") = 1, py::arg("tp_rank") = 0,
      py::arg("base_offset") = 0, py::arg("layer_stride") = 0, py::arg("page_stride") = 0,
      "Every field by keyword. layer_stride / page_stride 0: packed. Not validated here: "
      "validate(), or KvDecoder / KvPrefiller, raise InvalidArgument naming the field; "
      "a negative value, or one too large for its field (32 bits, 64 for base_offset and "
      "the strides), raises InvalidArgument naming it here.");
  unsigned_property(layout_class, "num_layers", &KvLayout::num_layers, "Layers of the model.");
  unsigned_property(layout_class, "num_pages", &KvLayout::num_pages,
                    "Pages per layer in this rank's pool.");
  unsigned_property(layout_class, "tokens_per_page", &KvLayout::tokens_per_page,
                    "Tokens in one page.");
  unsigned_property(layout_class, "num_kv_heads", &KvLayout::num_kv_heads,
                    "KV heads of one layer of the whole model (all TP ranks).");
  unsigned_property(layout_class, "head_bytes", &KvLayout::head_bytes,
                    "Bytes of one head of one token (head_dim * dtype size).");
  layout_class.def_readwrite("split_kv", &KvLayout::split_kv,
                             "K and V as two parts; False: one part (e.g. an MLA latent cache).");
  unsigned_property(layout_class, "tp_size", &KvLayout::tp_size,
                    "Tensor-parallel size of the group.");
  unsigned_property(layout_class, "tp_rank", &KvLayout::tp_rank, "This rank in the group.");
  unsigned_property(layout_class, "base_offset", &KvLayout::base_offset,
                    "Offset of layer 0, page 0 in the registered region.");
  unsigned_property(layout_class, "layer_stride", &KvLayout::layer_stride,
                    "Bytes between layers; 0: num_pages * page_step (packed).");
  unsigned_property(layout_class, "page_stride", &KvLayout::page_stride,
                    "Bytes between pages; 0: page_bytes (packed).");
  layout_class
      .def(
          "validate", [](const KvLayout& l) { check(l.validate()); },
          "Raises InvalidArgument naming the field at fault (a zero size, a TP size that neither "
          "divides nor is a multiple of num_kv_heads, a rank outside the group, short strides).")
      .def_property_readonly("parts", &KvLayout::parts, "2 with split_kv, else 1.")
      .def_property_readonly("first_head", &KvLayout::first_head,
                             "The first (global) head this rank holds.")
      .def_property_readonly("local_heads", &KvLayout::local_heads, "Heads this rank holds.")
      .def_property_readonly("head_slice_bytes", &KvLayout::head_slice_bytes,
                             "Bytes of one head in one page (tokens_per_page * head_bytes).")
      .def_property_readonly("part_bytes", &KvLayout::part_bytes, "Bytes of one part of a page.")
      .def_property_readonly("page_bytes", &KvLayout::page_bytes, "Bytes of one page.")
      .def_property_readonly("page_step", &KvLayout::page_step, "Bytes between pages.")
      .def_property_readonly("layer_step", &KvLayout::layer_step, "Bytes between layers.")
      .def_property_readonly(
          "region_bytes", &KvLayout::region_bytes,
          "Bytes the registered region must hold: the end of the last page of the last layer.")
      .def(
          "page_offset",
          [](const KvLayout& l, const IntArg& layer, const IntArg& page) {
            return l.page_offset(u32(layer, "KvLayout.page_offset: layer"),
                                 u32(page, "KvLayout.page_offset: page"));
          },
          py::arg("layer"), py::arg("page"), "Offset of (layer, page) in the region.")
      .def(
          "head_offset",
          [](const KvLayout& l, const IntArg& part, const IntArg& head) {
            return l.head_offset(u32(part, "KvLayout.head_offset: part"),
                                 u32(head, "KvLayout.head_offset: head"));
          },
          py::arg("part"), py::arg("head"),
          "Offset inside a page of global head `head` (one this rank holds) in `part`.")
      .def(
          "with_rank",
          [](const KvLayout& l, const IntArg& tp_size, const IntArg& tp_rank) {
            return l.with_rank(u32(tp_size, "KvLayout.with_rank: tp_size"),
                               u32(tp_rank, "KvLayout.with_rank: tp_rank"));
          },
          py::arg("tp_size"), py::arg("tp_rank"),
          "The same model on rank tp_rank of a TP group of tp_size (strides reset to packed).")
      .def(
          "__repr__",
          [](const KvLayout& l) {
            return "KvLayout(num_layers=" + std::to_string(l.num_layers) +
                   ", num_pages=" + std::to_string(l.num_pages) +
                   ", tokens_per_page=" + std::to_string(l.tokens_per_page) +
                   ", num_kv_heads=" + std::to_string(l.num_kv_heads) +
                   ", head_bytes=" + std::to_string(l.head_bytes) +
                   ", split_kv=" + (l.split_kv ? "True" : "False") +
                   ", tp_size=" + std::to_string(l.tp_size) +
                   ", tp_rank=" + std::to_string(l.tp_rank) +
                   ", base_offset=" + std::to_string(l.base_offset) +
                   ", layer_stride=" + std::to_string(l.layer_stride) +
                   ", page_stride=" + std::to_string(l.page_stride) + ")";
          },
          "KvLayout(...) with every field.")
      .def("__str__", &KvLayout::to_string, "The geometry in words.");

  py::class_<SliceCopy>(m, "SliceCopy",
                        "One contiguous run of bytes, the same in every page, that prefill rank "
                        "src_rank writes into decode rank dst_rank (offsets inside a page).")
      .def_readonly("src_rank", &SliceCopy::src_rank, "The prefill rank.")
      .def_readonly("dst_rank", &SliceCopy::dst_rank, "The decode rank.")
      .def_readonly("src_offset", &SliceCopy::src_offset, "Offset in a prefill page.")
      .def_readonly("dst_offset", &SliceCopy::dst_offset, "Offset in a decode page.")
      .def_readonly("length", &SliceCopy::length, "Bytes.")
      .def(
          "__eq__",
          [](const SliceCopy& a, py::object b) {
            return py::isinstance<SliceCopy>(b) && a == py::cast<const SliceCopy&>(b);
          },
          py::arg("other"), "Field-wise equality.")
      .def(
          "__repr__",
          [](const SliceCopy& s) {
            return "SliceCopy(src_rank=" + std::to_string(s.src_rank) +
                   ", dst_rank=" + std::to_string(s.dst_rank) +
                   ", src_offset=" + std::to_string(s.src_offset) +
                   ", dst_offset=" + std::to_string(s.dst_offset) +
                   ", length=" + std::to_string(s.length) + ")";
          },
          "SliceCopy(...).");

  m.def(
      "plan_slices",
      [](const KvLayout& src, const KvLayout& dst) { return check(kv::plan_slices(src, dst)); },
      py::arg("src"), py::arg("dst"),
      "Every SliceCopy filling every decode rank of layout `dst`'s TP group from the prefill TP "
      "group of layout `src` (tp_rank fields ignored); equal layouts give one whole-page slice "
      "per rank pair. Raises InvalidArgument when they disagree on the model.");
  using Plan = std::vector<SliceCopy>;
  m.def(
      "slices_between",
      [](const Plan& plan, const IntArg& src_rank, const IntArg& dst_rank) {
        return kv::slices_between(plan, u32(src_rank, "slices_between: src_rank"),
                                  u32(dst_rank, "slices_between: dst_rank"));
      },
      py::arg("plan"), py::arg("src_rank"), py::arg("dst_rank"),
      "The slices of `plan` from src_rank to dst_rank.");
  m.def(
      "slices_into",
      [](const Plan& plan, const IntArg& dst_rank) {
        return kv::slices_into(plan, u32(dst_rank, "slices_into: dst_rank"));
      },
      py::arg("plan"), py::arg("dst_rank"),
      "Paged writes per page per layer that decode rank dst_rank receives.");
  m.def(
      "sources_of",
      [](const Plan& plan, const IntArg& dst_rank) {
        return kv::sources_of(plan, u32(dst_rank, "sources_of: dst_rank"));
      },
      py::arg("plan"), py::arg("dst_rank"),
      "The prefill ranks writing into decode rank dst_rank, ascending.");
  m.def(
      "targets_of",
      [](const Plan& plan, const IntArg& src_rank) {
        return kv::targets_of(plan, u32(src_rank, "targets_of: src_rank"));
      },
      py::arg("plan"), py::arg("src_rank"),
      "The decode ranks prefill rank src_rank writes into, ascending.");

  // --- options ---
  using Ms = std::chrono::milliseconds;
  py::class_<kv::Options> options_class(m, "KvOptions", "Options of a KvDecoder or KvPrefiller.");
  options_class
      .def(py::init([](py::object heartbeat, py::object quarantine, py::object pull_timeout,
                       const IntArg& imm_first, const IntArg& imm_count) {
             kv::Options o;
             if (!heartbeat.is_none()) o.heartbeat = to_duration<Ms>(heartbeat, "heartbeat");
             if (!quarantine.is_none()) o.quarantine = to_duration<Ms>(quarantine, "quarantine");
             if (!pull_timeout.is_none()) {
               o.pull_timeout = to_duration<Ms>(pull_timeout, "pull_timeout");
             }
             o.imm_first = u32(imm_first, "KvOptions: imm_first");
             o.imm_count = u32(imm_count, "KvOptions: imm_count");
             return o;
           }),
           py::kw_only(), py::arg("heartbeat") = py::none(), py::arg("quarantine") = py::none(),
           py::arg("pull_timeout") = py::none(), py::arg("imm_first") = kv::Options{}.imm_first,
           py::arg("imm_count") = kv::Options{}.imm_count,
           "Durations as seconds or timedelta; None keeps the default (0.2 s, 0.5 s, 30 s).")
      .def_property(
          "heartbeat", [](const kv::Options& o) { return o.heartbeat; },
          [](kv::Options& o, py::handle v) { o.heartbeat = to_duration<Ms>(v, "heartbeat"); },
          "How often a side pings the peers it has live requests with.")
      .def_property(
          "quarantine", [](const kv::Options& o) { return o.quarantine; },
          [](kv::Options& o, py::handle v) { o.quarantine = to_duration<Ms>(v, "quarantine"); },
          "After a peer is declared dead, how long pages it may still write stay held.")
      .def_property(
          "pull_timeout", [](const kv::Options& o) { return o.pull_timeout; },
          [](kv::Options& o, py::handle v) { o.pull_timeout = to_duration<Ms>(v, "pull_timeout"); },
          "Prefiller: how long a started request waits for its pulls (and a pull for start()).");
  unsigned_property(options_class, "imm_first", &kv::Options::imm_first,
                    "Decoder: the first immediate it may use.");
  unsigned_property(options_class, "imm_count", &kv::Options::imm_count,
                    "Decoder: how many immediates it may use from imm_first.");

  // --- the flow ---
  py::class_<PyKvDecoder> decoder(
      m, "KvDecoder",
      "The decode side of one TP rank: reserves pages of its pool for a request, asks the "
      "prefill ranks for it, and reports the request ready once every page of every layer "
      "landed. It takes its engine's receive handler (group 0) and an immediate range "
      "(KvOptions.imm_first/imm_count). Callbacks run on the engine's callback thread or the "
      "decoder's timer thread, with the GIL taken for them; calls release the GIL.");
  decoder
      .def(py::init([](py::object engine, const KvLayout& layout, py::object memory,
                       std::optional<kv::Options> options) {
             return std::make_unique<PyKvDecoder>(std::move(engine), layout, std::move(memory),
                                                  options.value_or(kv::Options{}));
           }),
           py::arg("engine"), py::arg("layout"), py::arg("memory"), py::arg("options") = py::none(),
           "`memory`: the engine's Registration of this rank's cache, laid out as `layout`. "
           "Raises InvalidArgument (bad layout, a region smaller than layout.region_bytes), "
           "AlreadyExists (the engine already has a receive handler), Closed.")
      .def("submit", &PyKvDecoder::submit, py::arg("request_id"), py::arg("prefill_ranks"),
           py::kw_only(), py::arg("num_pages") = 0, py::arg("pages") = py::none(),
           py::arg("on_ready") = py::none(), py::arg("on_error") = py::none(),
           "Reserves `pages` (or num_pages free pages), arms the immediate and asks the prefill "
           "instance (the Address, bytes or hex of each of its TP ranks, in rank order). Returns "
           "a KvRequest whose .pages are the reserved pages; it resolves to them once every "
           "layer landed (after on_ready(id, pages) ran), or raises the request's error (after "
           "on_error(id, error)): Cancelled, PeerUnreachable, Timeout, ... Give ready pages back "
           "with release(id). Raises InvalidArgument, AlreadyExists (a live id, a taken page), "
           "OutOfRange (not enough free pages), Closed.")
      .def("cancel", &PyKvDecoder::cancel, py::arg("request_id"),
           "Cancels a request that is not ready: it fails with Cancelled once every prefill rank "
           "confirmed nothing is in flight. Raises NotFound.")
      .def("release", &PyKvDecoder::release, py::arg("request_id"),
           "Gives a ready request's pages back to the pool. Raises NotFound.")
      .def("fail_peer", &PyKvDecoder::fail_peer, py::arg("peer"),
           "Fails every live request that has `peer` (Address, bytes or hex) among its prefill "
           "ranks with PeerUnreachable (e.g. a registry watch saw it leave).")
      .def_property_readonly("free_pages", &PyKvDecoder::free_pages, "Free pages in the pool.")
      .def_property_readonly("live_requests", &PyKvDecoder::live_requests,
                             "Requests submitted, not yet ready or ended.")
      .def_property_readonly("layout", &PyKvDecoder::layout, "A copy of its layout.")
      .def_property_readonly("closed", &PyKvDecoder::is_closed, "Whether close() ran.")
      .def("close", &PyKvDecoder::close,
           "Stops the decoder: live requests fail with Closed, no callback starts afterwards. "
           "Idempotent; GIL released. The engine keeps its receive handler.");
  bind_context(decoder, "decoder");

  py::class_<PyKvDecodeGroup> group(
      m, "KvDecodeGroup",
      "The decode ranks of one TP group in this process, with one ready callback for the "
      "group: a request is submitted on every rank and reported once, when every rank's pages "
      "landed, or once every rank ended and one failed (the others are cancelled, the ready "
      "ones released). Its decoders stay alive (even when closed) until the group closes.");
  group
      .def(py::init([](py::list decoders) { return std::make_unique<PyKvDecodeGroup>(decoders); }),
           py::arg("decoders"),
           "decoders[r]: the KvDecoder of decode rank r. Raises InvalidArgument (none, ranks out "
           "of order, another TP size), Closed (a closed decoder).")
      .def("submit", &PyKvDecodeGroup::submit, py::arg("request_id"), py::arg("prefill_ranks"),
           py::kw_only(), py::arg("num_pages") = 0, py::arg("on_ready") = py::none(),
           py::arg("on_error") = py::none(),
           "Submits the request (num_pages pages on each rank) on every rank. Returns a "
           "KvRequest that resolves to every rank's pages (a list per rank, after "
           "on_ready(id, pages)) or raises the first error (after on_error(id, error)). A rank "
           "that refuses it is undone on the others, and its error raised here, naming the "
           "rank.")
      .def("cancel", &PyKvDecodeGroup::cancel, py::arg("request_id"),
           "Cancels a request not ready on every rank: it fails with Cancelled once every rank "
           "ended. Raises NotFound.")
      .def("release", &PyKvDecodeGroup::release, py::arg("request_id"),
           "Gives every rank's pages of a ready request back. Raises NotFound.")
      .def_property_readonly("live_requests", &PyKvDecodeGroup::live_requests,
                             "Requests submitted, not yet ready or ended.")
      .def_property_readonly("size", &PyKvDecodeGroup::size, "Decode ranks.")
      .def_property_readonly("closed", &PyKvDecodeGroup::is_closed, "Whether close() ran.")
      .def("close", &PyKvDecodeGroup::close,
           "Stops the group: its live requests fail with Closed (their ranks keep running). "
           "Idempotent; GIL released.");
  bind_context(group, "group");

  py::class_<PyKvPrefiller> prefiller(
      m, "KvPrefiller",
      "The prefill side of one TP rank: as each layer of a request is computed (layer_done), "
      "writes it into the pages of every decode rank that asked for it. It takes its engine's "
      "receive handler (group 0). Callbacks run on the engine's callback thread or the "
      "prefiller's timer thread, with the GIL taken for them; calls release the GIL.");
  prefiller
      .def(py::init([](py::object engine, const KvLayout& layout, py::object memory,
                       std::optional<kv::Options> options) {
             return std::make_unique<PyKvPrefiller>(std::move(engine), layout, std::move(memory),
                                                    options.value_or(kv::Options{}));
           }),
           py::arg("engine"), py::arg("layout"), py::arg("memory"), py::arg("options") = py::none(),
           "`memory`: the engine's Registration of this rank's cache, laid out as `layout`. "
           "Raises InvalidArgument, AlreadyExists (the engine already has a receive handler), "
           "Closed.")
      .def("start", &PyKvPrefiller::start, py::arg("request_id"), py::arg("pages"),
           py::arg("decode_tp"), py::kw_only(), py::arg("on_finished") = py::none(),
           py::arg("on_layer") = py::none(),
           "Declares a request computed here into `pages` (one per logical page, in order), for "
           "a decode instance of TP size decode_tp; its pulls may come before or after. Returns "
           "a KvRequest that resolves to None once every pull got every layer and no write is "
           "in flight (after on_finished(id, None)), or raises the first error (after "
           "on_finished(id, error)). on_layer(id, decode_rank, layer) runs when a layer's writes "
           "into one decode rank completed. Raises InvalidArgument, AlreadyExists, Closed.")
      .def("layer_done", &PyKvPrefiller::layer_done, py::arg("request_id"), py::arg("layer"),
           "Layer `layer` is computed: write it to every decode rank that pulled (and later to "
           "those that pull later). Raises NotFound, OutOfRange.")
      .def("cancel", &PyKvPrefiller::cancel, py::arg("request_id"),
           "Stops the request: no further layer is written; it ends with Cancelled once its "
           "writes are out of flight. Raises NotFound.")
      .def("fail_peer", &PyKvPrefiller::fail_peer, py::arg("peer"),
           "Ends every pull towards `peer` (Address, bytes or hex) with PeerUnreachable.")
      .def_property_readonly("live_requests", &PyKvPrefiller::live_requests,
                             "Requests started and not finished.")
      .def_property_readonly("layout", &PyKvPrefiller::layout, "A copy of its layout.")
      .def_property_readonly("closed", &PyKvPrefiller::is_closed, "Whether close() ran.")
      .def("close", &PyKvPrefiller::close,
           "Stops the prefiller: live requests fail with Closed, no callback starts afterwards. "
           "Idempotent; GIL released.");
  bind_context(prefiller, "prefiller");

  // --- membership ---
  py::class_<Member> member_class(
      m, "Member", "One member of a registry: who serves prefill or decode, and where.");
  member_class
      .def(py::init([](std::string name, std::string role, std::string instance,
                       const IntArg& tp_size, const IntArg& tp_rank, std::string address,
                       std::string data) {
             return Member{std::move(name),
                           std::move(role),
                           std::move(instance),
                           u32(tp_size, "Member: tp_size"),
                           u32(tp_rank, "Member: tp_rank"),
                           std::move(address),
                           std::move(data)};
           }),
           py::arg("name"), py::kw_only(), py::arg("role") = "", py::arg("instance") = "",
           py::arg("tp_size") = 1, py::arg("tp_rank") = 0, py::arg("address") = "",
           py::arg("data") = "", "Every field by keyword but the name.")
      .def_readwrite("name", &Member::name, "Unique in the registry.")
      .def_readwrite("role", &Member::role, "\"prefill\", \"decode\", \"router\", ...")
      .def_readwrite("instance", &Member::instance, "The TP group it belongs to.")
      .def_readwrite("address", &Member::address, "Its engine's Address, hex (Address.hex()).")
      .def_readwrite("data", &Member::data, "Free-form text (no newline).")
      .def("encode", &Member::encode, "The \"key=value\" lines the registries store.")
      .def_static(
          "decode", [](const std::string& text) { return check(Member::decode(text)); },
          py::arg("text"),
          "Parses encode()'s text; raises InvalidArgument naming the first bad line.")
      .def(
          "__eq__",
          [](const Member& a, py::object b) {
            return py::isinstance<Member>(b) && a == py::cast<const Member&>(b);
          },
          py::arg("other"), "Field-wise equality.")
      .def(
          "__repr__",
          [](const Member& mb) {
            return "Member(name='" + mb.name + "', role='" + mb.role + "', instance='" +
                   mb.instance + "', tp_size=" + std::to_string(mb.tp_size) +
                   ", tp_rank=" + std::to_string(mb.tp_rank) + ")";
          },
          "Member(...).");
  unsigned_property(member_class, "tp_size", &Member::tp_size, "Its group's TP size.");
  unsigned_property(member_class, "tp_rank", &Member::tp_rank, "Its rank in the group.");

  py::class_<PyRegistry> registry(
      m, "Registry",
      "Membership: join/leave this registry's members, list them, watch joins and leaves. "
      "Watch callbacks fn(joined, member) run on the registry's thread (LocalRegistry: on the "
      "thread that joins or leaves) with the GIL taken for them. Calls release the GIL.");
  registry
      .def("join", &PyRegistry::join, py::arg("member"),
           "Publishes (or replaces) a member owned by this registry. Raises InvalidArgument "
           "(a bad name), PeerUnreachable / Timeout (etcd), InternalError (a file not written).")
      .def("leave", &PyRegistry::leave, py::arg("name"),
           "Withdraws a member this registry published. Raises NotFound.")
      .def("members", &PyRegistry::members, "Every member now, by name.")
      .def("watch", &PyRegistry::watch, py::arg("fn"),
           "fn(joined: bool, member) first for every current member (joined=True), then for "
           "each change: a member appeared or changed (True) or left (False). Once per "
           "registry: AlreadyExists on a second call. Exceptions go to sys.unraisablehook.")
      .def_property_readonly("closed", &PyRegistry::is_closed, "Whether close() ran.")
      .def("close", &PyRegistry::close,
           "Withdraws this registry's members and stops its threads. Idempotent.");
  bind_context(registry, "registry");

  py::class_<PyLocalState>(m, "LocalRegistryState",
                           "What LocalRegistry objects that see each other share (one process).")
      .def(py::init<>(), "A new, empty membership.");
  py::class_<PyLocalRegistry, PyRegistry>(
      m, "LocalRegistry",
      "In-process membership, no server: registries made from one LocalRegistryState see each "
      "other; a registry that closes takes its members with it.")
      .def(py::init<const PyLocalState&>(), py::arg("state"), "A registry over `state`.");

  py::class_<PyFileRegistry, PyRegistry>(
      m, "FileRegistry",
      "Membership among the processes of one machine, no server: one file per member in "
      "`directory`, refreshed by its owner every lease_ttl/3. A member whose process died "
      "disappears at the next scan (poll_interval); one that stops refreshing once its lease "
      "runs out. The watch is woken by inotify and by poll_interval.")
      .def(py::init(
               [](const std::string& directory, py::handle lease_ttl, py::handle poll_interval) {
                 kv::FileOptions o;
                 o.directory = directory;
                 o.lease_ttl = to_duration<Ms>(lease_ttl, "lease_ttl");
                 o.poll_interval = to_duration<Ms>(poll_interval, "poll_interval");
                 return std::make_unique<PyFileRegistry>(o);
               }),
           py::arg("directory") = kv::FileOptions{}.directory, py::kw_only(),
           py::arg("lease_ttl") = 3.0, py::arg("poll_interval") = 0.1,
           "Creates the directory if needed. Durations in seconds or timedelta. Raises "
           "InvalidArgument naming the directory when it cannot be used.")
      .def_property_readonly("directory", &PyFileRegistry::directory, "The shared directory.");

  py::class_<PyEtcdRegistry, PyRegistry>(
      m, "EtcdRegistry",
      "Membership in etcd (v3 JSON gateway): members are keys under `prefix` attached to this "
      "registry's lease, so a crashed process's members go when its lease runs out; the watch "
      "re-syncs after etcd restarts.")
      .def(
          py::init([](const std::string& endpoint, const std::string& prefix, py::handle lease_ttl,
                      py::handle request_timeout, py::handle retry_interval) {
            kv::EtcdOptions o;
            o.endpoint = endpoint;
            o.prefix = prefix;
            o.lease_ttl = std::chrono::seconds(std::max<int64_t>(
                1, std::chrono::round<std::chrono::seconds>(to_duration<Ms>(lease_ttl, "lease_ttl"))
                       .count()));
            o.request_timeout = to_duration<Ms>(request_timeout, "request_timeout");
            o.retry_interval = to_duration<Ms>(retry_interval, "retry_interval");
            return std::make_unique<PyEtcdRegistry>(o);
          }),
          py::arg("endpoint") = kv::EtcdOptions{}.endpoint, py::kw_only(),
          py::arg("prefix") = kv::EtcdOptions{}.prefix, py::arg("lease_ttl") = 3.0,
          py::arg("request_timeout") = 2.0, py::arg("retry_interval") = 0.2,
          "Grants the lease (whole seconds, at least 1) and starts its keep-alive. Raises "
          "InvalidArgument, PeerUnreachable (no etcd there).")
      .def_property_readonly("resyncs", &PyEtcdRegistry::resyncs,
                             "Times the watch was re-established after a break.");

  m.def("_kv_close_all", &kv_close_all,
        "Closes every KvDecoder, KvPrefiller and registry still open (run at exit by the "
        "package, before the engines close).");
}

}  // namespace fabric::python
