// TransferEngine and EngineImpl: creation and close, registration, peer groups, immediates and
// the facade. The submissions' validation and planning are in engine_submit.cc (writes) and
// engine_read.cc (reads).
#include <array>
#include <atomic>
#include <memory>
#include <thread>

#include "engine/engine_impl.h"

namespace fabric {

using engine_impl::invalid;
using engine_impl::kSeqMask;
using engine_impl::kTagShift;

namespace {

std::atomic<uint64_t> next_engine_serial{1};

// A submitting thread's recent source regions (EngineImpl::lookup_region), direct-mapped by the
// handle's low bits. A weak reference keeps no region alive (unregister_memory waits for the
// last strong one): only its control block, and the memory make_shared put the region in, stay
// allocated until the entry is replaced or the thread ends.
struct CachedRegion {
  uint64_t engine = 0;  // EngineImpl::serial_
  uint64_t handle = 0;
  std::weak_ptr<LocalRegion> region;
};
constexpr size_t kCachedRegions = 8;
thread_local std::array<CachedRegion, kCachedRegions> tls_regions;

}  // namespace

// --- creation and close ---------------------------------------------------------------------

Result<std::unique_ptr<EngineImpl>> EngineImpl::create(const Config& config) {
  if (config.groups.empty()) return invalid("config.groups is empty: an engine needs a group");
  if (config.cq_batch == 0 || config.post_budget == 0) {
    return invalid("config.cq_batch and config.post_budget must be at least 1");
  }
  if (config.shm_copy_threads > 64) {
    return invalid(
        fmt::format("config.shm_copy_threads is {}; at most 64", config.shm_copy_threads));
  }
  if (config.max_wr_bytes == 0 || config.peer_timeout.count() <= 0) {
    return invalid("config.max_wr_bytes and config.peer_timeout must be positive");
  }
  if (config.max_message_bytes == 0 || config.send_buffers == 0 || config.control_buffers == 0) {
    return invalid(
        "config.max_message_bytes, config.send_buffers and config.control_buffers must be at "
        "least 1");
  }
  if (config.submission_ring < 2 || config.submission_ring > (uint32_t{1} << 20)) {
    return invalid(fmt::format("config.submission_ring is {}: 2 to {} slots",
                               config.submission_ring, uint32_t{1} << 20));
  }
  if (config.staging_chunk_bytes == 0)
    return invalid("config.staging_chunk_bytes must be positive");
  if ((config.callback_spin && config.callback_spin->count() < 0) ||
      (config.wait_spin && config.wait_spin->count() < 0)) {
    return invalid("config.callback_spin and config.wait_spin must be 0 or more (or unset: auto)");
  }
  for (uint32_t g = 0; g < config.groups.size(); ++g) {
    const int cpu = config.groups[g].cpu;
    if (cpu < 0 && cpu != GroupConfig::kCpuAuto && cpu != GroupConfig::kCpuNone) {
      return invalid(fmt::format(
          "config.groups[{}].cpu is {}: a CPU number (0 or more), GroupConfig::kCpuAuto ({}) or "
          "GroupConfig::kCpuNone ({})",
          g, cpu, GroupConfig::kCpuAuto, GroupConfig::kCpuNone));
    }
  }
  std::unique_ptr<EngineImpl> e(new EngineImpl(config));
  e->tag_ = std::random_device{}() & 0xffffff;
  e->serial_ = next_engine_serial.fetch_add(1);
  const std::vector<int> allowed = topology::allowed_cpus();
  // Unset spins follow the CPUs this process may use (Config::auto_spin).
  e->callback_spin_ = config.callback_spin.value_or(Config::auto_spin(allowed.size()));
  e->wait_spin_ = config.wait_spin.value_or(Config::auto_spin(allowed.size()));
  e->callbacks_ = std::make_unique<engine::CallbackThread>(e->callback_spin_);
  e->imms_.set_wait_spin(e->wait_spin_);
  e->rotations_ = std::make_unique<std::atomic<uint32_t>[]>(config.groups.size());

  for (uint32_t g = 0; g < config.groups.size(); ++g) {
    auto group = engine::open_domain_group(config, g, allowed);
    if (!group) return group.status();
    GroupInfo info = std::move(group->info);
    const int cpu = group->cpu;
    std::vector<std::unique_ptr<transport::Domain>> domains = std::move(group->domains);
    e->direct_.push_back(group->direct);

    engine::WorkerServices services{
        e->callbacks_.get(), &e->imms_,
        [raw = e.get()](std::vector<uint32_t>& imms, bool here) { raw->on_unexpected(imms, here); },
        &e->regions_};
    auto w = engine::Worker::create(g, config, cpu, std::move(domains), std::move(services));
    if (!w) return w.status();
    std::vector<NicAddress> nic_addrs;
    for (uint32_t i = 0; i < (*w)->num_domains(); ++i) {
      nic_addrs.push_back(
          {(*w)->domain(i).endpoint_name(), (*w)->scratch_addr(i), (*w)->scratch_key(i)});
    }
    e->addresses_.emplace_back(
        info.provider, std::move(nic_addrs),
        Origin::of_this_process((uint64_t{std::random_device{}()} << 32) ^ std::random_device{}()));
    (*w)->set_address(e->addresses_.back());
    e->infos_.push_back(std::move(info));
    e->any_caller_driven_ |= (*w)->caller_driven();
    e->shard_params_.push_back(e->make_shard_params(**w));
    e->workers_.push_back(std::move(*w));
  }
  for (auto& w : e->workers_) w->start();
  for (uint32_t g = 0; g < e->workers_.size(); ++g) {
    detail::log().debug("engine group {} up: {} NIC(s) [{}], worker CPU {}, address {}", g,
                        e->infos_[g].nics.size(), fmt::join(e->infos_[g].nics, ", "),
                        e->infos_[g].cpu, e->addresses_[g].short_name());
  }
  return e;
}

void EngineImpl::close() {
  if (engine::on_worker_thread()) {
    detail::log().error(
        "TransferEngine::close() called from a callback on the worker thread; ignored (it would "
        "deadlock)");
    return;
  }
  if (callbacks_ && callbacks_->on_this_thread()) {
    detail::log().error(
        "TransferEngine::close() called from a callback; ignored (it would deadlock)");
    return;
  }
  closing_.store(true);
  {
    std::unique_lock lock(close_mu_);
    if (closed_) return;
    closed_ = true;
  }
  // Submissions that began before closing_ was set hand their transfers over first (none
  // blocks: a ring push, or the overflow list's lock).
  while (submitting_.load() != 0) std::this_thread::yield();
  for (auto& w : workers_) w->stop();
  imms_.clear_expectations();
  if (callbacks_) callbacks_->drain_and_stop();
}

std::shared_lock<std::shared_mutex> EngineImpl::enter() const {
  if (closing_.load()) return {};
  std::shared_lock lock(close_mu_);
  if (closed_) return {};
  return lock;
}

Status EngineImpl::closed() {
  return Status(ErrorCode::kClosed, "the engine is closed");
}

Status EngineImpl::check_group(uint32_t group) const {
  if (group >= workers_.size()) {
    return Status(
        ErrorCode::kNotFound,
        fmt::format("device group {} does not exist (the engine has {})", group, workers_.size()));
  }
  return Status::ok();
}

Status EngineImpl::check_peer(const Address& peer, uint32_t group, std::string_view what) const {
  if (peer.empty()) return invalid(fmt::format("{}: the peer address is empty", what));
  if (peer.provider() != infos_[group].provider) {
    return invalid(fmt::format("{}: the peer uses provider '{}', this engine '{}'", what,
                               peer.provider(), infos_[group].provider));
  }
  return Status::ok();
}

Status EngineImpl::check_remote(const RemoteMemory& dst, uint32_t group,
                                std::string_view what) const {
  if (dst.empty()) return invalid(fmt::format("{}: the remote memory descriptor is empty", what));
  // A descriptor made by hand (not decoded, which checks this) must still be rail-aligned:
  // the plan indexes rails by the owner's NICs.
  if (!dst.rails_fit_owner()) {
    return invalid(
        fmt::format("{}: the remote memory descriptor has {} rails for an owner with {} "
                    "NIC(s)",
                    what, dst.rails().size(), dst.owner().num_nics()));
  }
  return check_peer(dst.owner(), group, what);
}

std::shared_ptr<LocalRegion> EngineImpl::lookup_region(MemoryHandle handle) const {
  if ((handle.id >> kTagShift) != tag_) return nullptr;
  CachedRegion& cached = tls_regions[handle.id % kCachedRegions];
  if (cached.engine == serial_ && cached.handle == handle.id) {
    // Alive (some transfer may be all that holds it) and still registered: the flag is set
    // once it left the table, and is read after the reference is taken, so a region found
    // here is either still in the table or unregister_memory waits for this reference.
    std::shared_ptr<LocalRegion> region = cached.region.lock();
    if (region && !region->unregistered.load(std::memory_order_acquire)) return region;
  }
  std::shared_ptr<LocalRegion> region = regions_.find(handle.id);
  if (region) {
    cached.engine = serial_;
    cached.handle = handle.id;
    cached.region = region;
  }
  return region;
}

Status EngineImpl::region_missing(MemoryHandle handle) const {
  if ((handle.id >> kTagShift) != tag_) {
    return Status(ErrorCode::kNotFound,
                  fmt::format("memory handle {:#x} was not made by this engine", handle.id));
  }
  return Status(
      ErrorCode::kNotFound,
      fmt::format("memory handle {:#x} is not registered (it was unregistered)", handle.id));
}

engine::TransferPtr EngineImpl::new_transfer(uint32_t group, Callbacks&& cb) {
  engine::TransferPtr t = workers_[group]->take_transfer();
  t->id = next_transfer_.fetch_add(1);
  // A pooled transfer's callbacks are empty (Transfer::reset): swapping them in skips the
  // temporary that a std::function's move assignment builds and destroys.
  t->callbacks.on_done.swap(cb.on_done);
  t->callbacks.on_error.swap(cb.on_error);
  t->callbacks.counter = cb.counter;
  return t;
}

engine::ShardParams EngineImpl::make_shard_params(const engine::Worker& w) const {
  uint64_t max_wr = UINT64_MAX;
  for (uint32_t i = 0; i < w.num_domains(); ++i) {
    max_wr = std::min(max_wr, w.domain(i).info().max_write_bytes);
  }
  return {config_.shard_min_bytes, config_.shard_alignment, std::min(max_wr, config_.max_wr_bytes)};
}

TransferId EngineImpl::hand_over(uint32_t group, engine::TransferPtr t) {
  stats_.submitted(group, *t);
  t->submitted_at = std::chrono::steady_clock::now();
  TransferId id = t->id;
  for (const RemoteMemory& dst : t->dsts) {
    if (dst.staged_region() != 0) {
      t->staged.resize(t->dsts.size());
      break;
    }
  }
  workers_[group]->submit(std::move(t));
  return id;
}

// --- memory and peers -----------------------------------------------------------------------

namespace {
// Config::callbacks_on_worker: a callback running on a worker cannot wait for a worker.
Status refused_on_worker(const char* call) {
  return Status(ErrorCode::kInvalidArgument,
                fmt::format("{} called from a callback running on the worker thread "
                            "(Config::callbacks_on_worker): it would wait for that thread",
                            call));
}
}  // namespace

Result<Registration> EngineImpl::register_memory(void* ptr, uint64_t length,
                                                 const RegisterOptions& options) {
  if (engine::on_worker_thread()) return refused_on_worker("register_memory");
  auto lock = enter();
  if (!lock) return closed();
  const uint32_t group = options.group;
  if (Status s = check_group(group); !s) return s;
  if (ptr == nullptr) return invalid("register_memory: null pointer");
  if (length == 0) return invalid("register_memory: zero length");
  if (reinterpret_cast<uintptr_t>(ptr) + length < reinterpret_cast<uintptr_t>(ptr)) {
    return invalid("register_memory: the range wraps around the address space");
  }
  // GPU memory: registered as it is where the group's NICs reach it (FI_HMEM); otherwise staged
  // through a pinned host mirror of the same size, registered in its place, unless the caller
  // asked for none (then only the CUDA IPC path reaches it).
  auto memory = cuda::classify(ptr, length);
  if (!memory) {
    return Status(memory.status().code(),
                  fmt::format("register_memory: {}", memory.status().message()));
  }
  const bool direct = memory->kind == cuda::MemoryKind::kCuda && direct_[group];
  const bool wants_mirror = memory->kind != cuda::MemoryKind::kHost && !direct;
  const bool ipc_only = wants_mirror && !options.host_mirror;
  if (ipc_only && config_.cuda_ipc == Config::CudaIpc::kOff) {
    return Status(ErrorCode::kUnsupported,
                  "register_memory: host_mirror is false, but Config::cuda_ipc is off: the "
                  "memory would be unreachable (this group stages GPU memory through a mirror)");
  }
  if (options.gpu_copies && memory->kind != cuda::MemoryKind::kHost) {
    return invalid(
        "register_memory: gpu_copies is for host memory; GPU memory takes the CUDA IPC path "
        "without it");
  }
  if (options.gpu_copies && config_.cuda_ipc == Config::CudaIpc::kOff) {
    return Status(ErrorCode::kUnsupported,
                  "register_memory: gpu_copies needs the CUDA IPC path, and Config::cuda_ipc is "
                  "off");
  }
  std::unique_ptr<cuda::HostBuffer> mirror;
  if (wants_mirror && !ipc_only) {
    auto m = cuda::HostBuffer::allocate(*memory, length);
    if (!m) {
      return Status(m.status().code(),
                    fmt::format("register_memory: staging mirror for device memory: {}",
                                m.status().message()));
    }
    mirror = std::move(*m);
  }
  // The CUDA IPC path: device memory is exported for same-host peers (docs/cuda-ipc.md).
  std::optional<cuda::IpcExport> ipc;
  std::string ipc_why;
  if (memory->kind != cuda::MemoryKind::kHost && config_.cuda_ipc != Config::CudaIpc::kOff) {
    auto exported = cuda::ipc_export(*memory, ptr, length);
    if (exported) {
      ipc = std::move(*exported);
    } else {
      ipc_why = exported.status().message();
      detail::log().debug("register_memory: no CUDA IPC export: {}", ipc_why);
    }
  }
  if (ipc_only && !ipc) {
    return Status(ErrorCode::kUnsupported,
                  fmt::format("register_memory: host_mirror is false, but CUDA cannot export the "
                              "memory for the CUDA IPC path, so nothing could reach it: {}",
                              ipc_why));
  }
  // Host memory for the GPU's copy engines: page-locked, and named by its GPU's UUID.
  std::optional<cuda::PointerInfo> copy_engines;
  std::optional<cuda::DeviceUuid> copy_uuid;
  if (options.gpu_copies) {
    auto pinned = cuda::pin_for_copies(ptr, length);
    if (!pinned) {
      return Status(pinned.status().code(),
                    fmt::format("register_memory: gpu_copies: {}", pinned.status().message()));
    }
    auto uuid = cuda::device_uuid(*pinned);
    if (!uuid) {
      cuda::unpin_for_copies(*pinned, ptr);
      return Status(uuid.status().code(),
                    fmt::format("register_memory: gpu_copies: {}", uuid.status().message()));
    }
    copy_engines = *pinned;
    copy_uuid = *uuid;
  }
  std::byte* host = mirror ? mirror->data() : static_cast<std::byte*>(ptr);
  engine::Worker* w = workers_[group].get();
  std::vector<std::unique_ptr<transport::MemoryRegistration>> regs;
  if (!ipc_only) {
    auto r = w->call([&] { return w->register_on_all(host, length, options.remote_read); });
    if (!r) {
      if (copy_engines) cuda::unpin_for_copies(*copy_engines, ptr);
      return r.status();
    }
    regs = std::move(*r);
  }

  auto region = std::make_shared<LocalRegion>();
  region->id = (tag_ << kTagShift) | (next_region_.fetch_add(1) & kSeqMask);
  region->ptr = static_cast<std::byte*>(ptr);
  region->host = ipc_only ? nullptr : host;
  region->length = length;
  region->group = group;
  region->memory = *memory;
  region->worker = w;
  region->regs = std::move(regs);
  region->mirror = std::move(mirror);
  region->ipc = std::move(ipc);
  region->ipc_why = std::move(ipc_why);
  region->ipc_only = ipc_only;
  region->remote_read = options.remote_read;
  region->copy_engines = copy_engines;
  std::optional<RemoteMemory::CudaIpc> ipc_section;
  if (region->ipc) ipc_section = RemoteMemory::CudaIpc{region->ipc->device, region->id};
  if (copy_uuid) ipc_section = RemoteMemory::CudaIpc{*copy_uuid, region->id, /*host=*/true};
  std::vector<RemoteMemory::Rail> rails;
  for (const auto& r : region->regs) rails.push_back({r->remote_addr(), r->remote_key()});
  Registration out{
      MemoryHandle{region->id},
      RemoteMemory(addresses_[group], reinterpret_cast<uint64_t>(ptr), length, std::move(rails),
                   region->staged() ? region->id : 0, ipc_section, options.remote_read)};
  if (region->mirror) stats_.mirror(group, static_cast<int64_t>(length));
  regions_.add(std::move(region));
  return out;
}

Status EngineImpl::unregister_memory(MemoryHandle handle) {
  if (engine::on_worker_thread()) return refused_on_worker("unregister_memory");
  std::shared_ptr<LocalRegion> region;
  {
    auto found = find_region(handle);
    if (!found) return found.status();
    region = regions_.take(handle.id);
    if (!region) {  // another thread unregistered it meanwhile
      return Status(
          ErrorCode::kNotFound,
          fmt::format("memory handle {:#x} is not registered (it was unregistered)", handle.id));
    }
  }
  if (region->mirror) stats_.mirror(region->group, -static_cast<int64_t>(region->length));
  // Submitting threads' caches may still reach it (lookup_region): it is not theirs to take.
  region->unregistered.store(true, std::memory_order_release);
  // A barrier: the provider registrations are closed on the worker once no accepted transfer
  // holds the region any more (each completes or fails within its own bounds), then the
  // writers are fenced where the provider needs it (worker_fence.cc), and only then does this
  // return. From then on a peer's write to the region's keys is refused by the provider
  // (kRemoteAccess at the writer) and cannot land in the memory.
  std::promise<Status> released;
  std::future<Status> done = released.get_future();
  region->on_released = [&released](const Status& s) { released.set_value(s); };
  engine::Worker* worker = region->worker;
  region.reset();
  // A caller-driven group releases it in a pass: drive them (the holders complete there too).
  if (worker != nullptr) {
    worker->progress_until(
        [&done] { return done.wait_for(std::chrono::seconds(0)) == std::future_status::ready; });
  }
  return done.get();
}

Result<PeerGroup> EngineImpl::add_peer_group(std::vector<Address> peers) {
  auto lock = enter();
  if (!lock) return closed();
  if (peers.empty()) return invalid("add_peer_group: no peers");
  for (size_t i = 0; i < peers.size(); ++i) {
    if (Status s = check_peer(peers[i], 0, fmt::format("add_peer_group: peer {}", i)); !s) {
      return s;
    }
    for (size_t j = 0; j < i; ++j) {
      if (peers[i] == peers[j]) {
        return invalid(fmt::format("add_peer_group: peers {} and {} are the same address", j, i));
      }
    }
  }
  PeerGroup g{next_peer_group_.fetch_add(1)};
  std::lock_guard gl(groups_mu_);
  peer_groups_.emplace(g.id, std::make_shared<const engine::PeerGroupMembers>(std::move(peers)));
  return g;
}

Status EngineImpl::remove_peer_group(PeerGroup group) {
  std::lock_guard gl(groups_mu_);
  if (peer_groups_.erase(group.id) == 0) {
    return Status(ErrorCode::kNotFound, fmt::format("peer group {} does not exist", group.id));
  }
  return Status::ok();
}

// --- immediates -----------------------------------------------------------------------------

Status EngineImpl::expect_imm(uint32_t imm, uint64_t count, std::function<void()> on_reached) {
  auto lock = enter();
  if (!lock) return closed();
  std::vector<engine::CallbackThread::Job> due;
  Status s = imms_.expect(imm, count, std::move(on_reached), due);
  callbacks_->push(due);
  return s;
}

void EngineImpl::set_unexpected_imm_handler(std::function<void(uint32_t)> handler) {
  std::lock_guard lock(unexpected_mu_);
  has_unexpected_handler_.store(static_cast<bool>(handler));
  unexpected_handler_ =
      handler ? std::make_shared<const std::function<void(uint32_t)>>(std::move(handler)) : nullptr;
}

void EngineImpl::on_unexpected(std::vector<uint32_t>& imms, bool here) {
  if (!has_unexpected_handler_.load()) return;
  auto handler = [this] {
    std::lock_guard lock(unexpected_mu_);
    return unexpected_handler_;
  };
  if (here) {  // callbacks on the worker, or a caller-driven pass: no hop
    if (auto h = handler()) {
      for (uint32_t imm : imms) {
        engine::CallbackThread::Job job = [&h, imm] { (*h)(imm); };
        engine::CallbackThread::run_one(job);
      }
    }
    return;
  }
  callbacks_->push([handler, v = imms] {
    if (auto h = handler()) {
      for (uint32_t imm : v) (*h)(imm);
    }
  });
}

// --- TransferEngine -------------------------------------------------------------------------

Result<std::unique_ptr<TransferEngine>> TransferEngine::create(const Config& config) {
  auto impl = EngineImpl::create(config);
  if (!impl) return impl.status();
  return std::unique_ptr<TransferEngine>(new TransferEngine(std::move(*impl)));
}

TransferEngine::TransferEngine(std::unique_ptr<EngineImpl> impl) : impl_(std::move(impl)) {}
TransferEngine::~TransferEngine() = default;
void TransferEngine::close() {
  impl_->close();
}
size_t TransferEngine::num_groups() const {
  return impl_->num_groups();
}
std::vector<bool> TransferEngine::nics_up(uint32_t group) const {
  return impl_->nics_up(group);
}

const GroupInfo& TransferEngine::group_info(uint32_t group) const {
  return impl_->group_info(group);
}
const Address& TransferEngine::address(uint32_t group) const {
  return impl_->address(group);
}
Result<Registration> TransferEngine::register_memory(void* ptr, uint64_t length, uint32_t group) {
  return impl_->register_memory(ptr, length, RegisterOptions{.group = group});
}
Result<Registration> TransferEngine::register_memory(void* ptr, uint64_t length,
                                                     const RegisterOptions& options) {
  return impl_->register_memory(ptr, length, options);
}
Status TransferEngine::unregister_memory(MemoryHandle handle) {
  return impl_->unregister_memory(handle);
}
Result<PeerGroup> TransferEngine::add_peer_group(std::vector<Address> peers) {
  return impl_->add_peer_group(std::move(peers));
}
Status TransferEngine::remove_peer_group(PeerGroup group) {
  return impl_->remove_peer_group(group);
}
Result<TransferId> TransferEngine::submit(const SingleWrite& w, Callbacks cb) {
  return impl_->submit(w, std::move(cb));
}
Result<TransferId> TransferEngine::submit(const PagedWrite& w, Callbacks cb) {
  return impl_->submit(w, std::move(cb));
}
Result<TransferId> TransferEngine::submit(const Scatter& s, Callbacks cb) {
  return impl_->submit(s, std::move(cb));
}
Result<TransferId> TransferEngine::submit(const Barrier& b, Callbacks cb) {
  return impl_->submit(b, std::move(cb));
}
Result<TransferId> TransferEngine::submit(const ImmWrite& w, Callbacks cb) {
  return impl_->submit(w, std::move(cb));
}
Result<TransferId> TransferEngine::submit(const SingleRead& r, Callbacks cb) {
  return impl_->submit(r, std::move(cb));
}
Result<TransferId> TransferEngine::submit(const PagedRead& r, Callbacks cb) {
  return impl_->submit(r, std::move(cb));
}
Result<TransferId> TransferEngine::submit_send(const Address& peer,
                                               std::span<const std::byte> message,
                                               Callbacks callbacks, uint32_t group) {
  return impl_->submit_send(peer, message, std::move(callbacks), group);
}
Status TransferEngine::set_receive_handler(
    std::function<void(std::span<const std::byte>)> on_message, uint64_t buffer_bytes,
    uint32_t count, uint32_t group) {
  return impl_->set_receive_handler(std::move(on_message), buffer_bytes, count, group);
}
Status TransferEngine::expect_imm(uint32_t imm, uint64_t count, std::function<void()> on_reached) {
  return impl_->expect_imm(imm, count, std::move(on_reached));
}
Status TransferEngine::cancel_expect_imm(uint32_t imm) {
  return impl_->cancel_expect_imm(imm);
}
void TransferEngine::set_unexpected_imm_handler(std::function<void(uint32_t)> handler) {
  impl_->set_unexpected_imm_handler(std::move(handler));
}
uint64_t TransferEngine::imm_count(uint32_t imm) const {
  return impl_->imm_count(imm);
}
bool TransferEngine::wait_imm(uint32_t imm, uint64_t total,
                              std::chrono::milliseconds timeout) const {
  return impl_->wait_imm(imm, total, timeout);
}
bool TransferEngine::progress(uint32_t group) {
  return impl_->progress(group);
}
void TransferEngine::reset_imm(uint32_t imm) {
  impl_->reset_imm(imm);
}
EngineStats TransferEngine::stats() const {
  return impl_->stats();
}

}  // namespace fabric

namespace fabric {

bool CompletionCounter::wait(uint64_t n, std::chrono::milliseconds timeout) const {
  const auto start = std::chrono::steady_clock::now();
  for (int looks = 0; ended() < n; ++looks) {
    const auto waited = std::chrono::steady_clock::now() - start;
    if (waited >= timeout) return false;
    if (looks < 1000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  return true;
}

}  // namespace fabric
