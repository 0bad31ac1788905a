// TransferEngine: validation and planning of submissions (on the caller's thread), handed to
// the device group's Worker for posting.
#include "fabric/engine.h"

#include <fmt/format.h>
#include "common/log.h"

#include <atomic>
#include <deque>
#include <future>
#include <mutex>
#include <random>
#include <shared_mutex>
#include <unordered_map>

#include "cuda/device_memory.h"
#include "engine/callback_thread.h"
#include "engine/domain_group.h"
#include "engine/imm_counters.h"
#include "engine/ipc_select.h"
#include "engine/messages.h"
#include "engine/op_builder.h"
#include "engine/plan.h"
#include "engine/stats_counters.h"
#include "engine/transfer_state.h"
#include "engine/worker.h"
#include "topology/topology.h"

namespace fabric {

using engine::LocalRegion;
using engine::Op;
using engine::Transfer;

namespace {

constexpr int kTagShift = 40;
constexpr uint64_t kSeqMask = (uint64_t{1} << kTagShift) - 1;

Status invalid(std::string message) {
  return Status(ErrorCode::kInvalidArgument, std::move(message));
}

}  // namespace

class EngineImpl {
 public:
  static Result<std::unique_ptr<EngineImpl>> create(const Config& config);
  ~EngineImpl() { close(); }

  void close();
  size_t num_groups() const { return workers_.size(); }
  std::vector<bool> nics_up(uint32_t g) const {
    std::shared_lock lock(close_mu_);
    if (closed_ || g >= workers_.size()) return {};
    return workers_[g]->up_nics();
  }
  const GroupInfo& group_info(uint32_t g) const {
    static const GroupInfo kNone;
    return g < infos_.size() ? infos_[g] : kNone;
  }
  const Address& address(uint32_t g) const {
    static const Address kNone;
    return g < addresses_.size() ? addresses_[g] : kNone;
  }

  Result<Registration> register_memory(void* ptr, uint64_t length, uint32_t group);
  Status unregister_memory(MemoryHandle handle);
  Result<PeerGroup> add_peer_group(std::vector<Address> peers);
  Status remove_peer_group(PeerGroup group);

  Result<TransferId> submit(const SingleWrite& w, Callbacks cb);
  Result<TransferId> submit(const PagedWrite& w, Callbacks cb);
  Result<TransferId> submit(const Scatter& s, Callbacks cb);
  Result<TransferId> submit(const Barrier& b, Callbacks cb);
  Result<TransferId> submit(const ImmWrite& w, Callbacks cb);
  Result<TransferId> submit_send(const Address& peer, std::span<const std::byte> message,
                                 Callbacks cb, uint32_t group);
  Status set_receive_handler(std::function<void(std::span<const std::byte>)> on_message,
                             uint64_t buffer_bytes, uint32_t count, uint32_t group);

  Status expect_imm(uint32_t imm, uint64_t count, std::function<void()> on_reached);
  Status cancel_expect_imm(uint32_t imm) { return imms_.cancel(imm); }
  void set_unexpected_imm_handler(std::function<void(uint32_t)> handler);
  uint64_t imm_count(uint32_t imm) const { return imms_.count(imm); }
  bool wait_imm(uint32_t imm, uint64_t total, std::chrono::milliseconds timeout) const {
    // On a worker (Config::callbacks_on_worker) no arrival can be counted while it waits.
    if (engine::on_worker_thread()) return imms_.count(imm) >= total;
    if (!any_caller_driven_) return imms_.wait(imm, total, timeout);
    // Caller-driven groups count arrivals only in passes: drive them while waiting.
    const auto until = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      if (imms_.count(imm) >= total) return true;
      if (std::chrono::steady_clock::now() >= until) return false;
      bool active = false;
      for (const auto& w : workers_) active |= w->progress();
      if (!active) std::this_thread::yield();
    }
  }
  bool progress(uint32_t group) {
    if (group >= workers_.size() || closing_.load()) return false;
    return workers_[group]->progress();
  }
  void reset_imm(uint32_t imm) { imms_.reset(imm); }
  EngineStats stats() const { return stats_.snapshot(imms_.total()); }

 private:
  explicit EngineImpl(const Config& config) : config_(config) {}

  // The shared hold of close_mu_ that calls needing the engine open take; empty (not owning)
  // once close() has begun, and then the call returns closed().
  std::shared_lock<std::shared_mutex> enter() const;
  static Status closed();
  Status check_group(uint32_t group) const;
  Status check_peer(const Address& peer, uint32_t group, std::string_view what) const;
  Status check_remote(const RemoteMemory& dst, uint32_t group, std::string_view what) const;
  Result<std::shared_ptr<LocalRegion>> find_region(MemoryHandle handle) const;
  std::unique_ptr<Transfer> new_transfer(Callbacks cb);
  uint32_t next_rotation(uint32_t group) { return rotations_[group].fetch_add(1); }
  engine::ShardParams shard_params(uint32_t group) const;
  // The shard weights of a group's NICs (their measured rates), empty when
  // Config::weighted_sharding is off.
  std::vector<uint64_t> weights(uint32_t group) const {
    return config_.weighted_sharding ? workers_[group]->nic_rates() : std::vector<uint64_t>{};
  }
  // Appends the ops writing `shards` of one source range to one destination; with an
  // immediate, it rides on the only shard or follows all of them as a deferred zero-byte write.
  void add_writes(Transfer& t, const LocalRegion& src, uint64_t src_offset, uint32_t dst_index,
                  uint64_t dst_offset, const std::vector<engine::Shard>& shards,
                  std::optional<uint32_t> imm, uint32_t group);
  // A staged destination's immediate: counted `times` by its owner after the copies.
  static void stage_imm(Transfer& t, uint32_t dst_index, uint32_t imm, uint64_t times) {
    t.staged.resize(t.dsts.size());
    engine::StagedDst& sd = t.staged[dst_index];
    sd.has_imm = true;
    sd.imm = imm;
    sd.imm_times += times;
  }
  Op zero_byte_imm(Transfer& t, uint32_t group, uint32_t domain, const Address& peer, uint32_t imm);
  TransferId hand_over(uint32_t group, std::unique_ptr<Transfer> t);
  // The CUDA IPC path or the fabric for a write from `src` into `dst` (docs/cuda-ipc.md).
  engine::IpcRoute ipc_route(const LocalRegion& src, const RemoteMemory& dst,
                             uint32_t group) const {
    return engine::choose_route(
        config_.cuda_ipc, addresses_[group].origin(), src.memory, src.ipc ? &*src.ipc : nullptr,
        src.ipc_why, dst,
        [&src](const cuda::DeviceUuid& peer) { return cuda::ipc_reachable(src.memory, peer); });
  }
  static Status ipc_rejected(std::string_view what, const engine::IpcRoute& route) {
    return Status(ErrorCode::kUnsupported,
                  fmt::format("{}: Config::cuda_ipc is on, but the CUDA IPC path is impossible: {}",
                              what, route.why));
  }

  const Config config_;
  uint64_t tag_ = 0;  // distinguishes this engine's handles from another engine's
  std::unique_ptr<engine::CallbackThread> callbacks_;
  engine::ImmCounters imms_;
  std::mutex unexpected_mu_;
  // Shared, so that each batch of arrivals takes a reference, not a copy of the handler.
  std::shared_ptr<const std::function<void(uint32_t)>> unexpected_handler_;
  std::atomic<bool> has_unexpected_handler_{false};
  // On a worker: immediates that arrived with no expectation, for the user's handler.
  void on_unexpected(std::vector<uint32_t>& imms);
  std::vector<std::unique_ptr<engine::Worker>> workers_;
  bool any_caller_driven_ = false;  // some group has GroupConfig::caller_progress
  std::vector<GroupInfo> infos_;
  std::vector<bool> direct_;  // per group: its NICs register CUDA memory themselves
  std::vector<Address> addresses_;
  std::unique_ptr<std::atomic<uint32_t>[]> rotations_;

  // Calls that need the engine open hold close_mu_ shared (enter()); close() exclusively.
  // close() sets closing_ before it asks for the lock, and enter() does not ask for it once
  // closing_ is set: threads that keep submitting cannot starve close(), and every call made
  // after close() began returns kClosed at once.
  mutable std::shared_mutex close_mu_;
  std::atomic<bool> closing_{false};
  bool closed_ = false;

  // Declared after workers_, so destroyed before them: a LocalRegion's destructor hands its
  // registrations to its worker. The workers' threads have stopped by then (close()).
  engine::RegionTable regions_;
  mutable std::mutex groups_mu_;
  // Shared, so a scatter or barrier takes a reference, not a copy of every member.
  std::unordered_map<uint64_t, std::shared_ptr<const std::vector<Address>>> peer_groups_;
  std::atomic<uint64_t> next_region_{1};
  std::atomic<uint64_t> next_transfer_{1};
  std::atomic<uint64_t> next_peer_group_{1};

  // TransferEngine::stats(): counted in hand_over() and set_receive_handler().
  engine::StatsCounters stats_{config_.groups.size()};
};

// --- creation and close ---------------------------------------------------------------------

Result<std::unique_ptr<EngineImpl>> EngineImpl::create(const Config& config) {
  if (config.groups.empty()) return invalid("config.groups is empty: an engine needs a group");
  if (config.cq_batch == 0 || config.post_budget == 0) {
    return invalid("config.cq_batch and config.post_budget must be at least 1");
  }
  if (config.max_wr_bytes == 0 || config.peer_timeout.count() <= 0) {
    return invalid("config.max_wr_bytes and config.peer_timeout must be positive");
  }
  if (config.max_message_bytes == 0 || config.send_buffers == 0 || config.control_buffers == 0) {
    return invalid(
        "config.max_message_bytes, config.send_buffers and config.control_buffers must be at "
        "least 1");
  }
  if (config.staging_chunk_bytes == 0)
    return invalid("config.staging_chunk_bytes must be positive");
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
  e->callbacks_ = std::make_unique<engine::CallbackThread>(config.callback_spin);
  e->imms_.set_wait_spin(config.wait_spin);
  e->rotations_ = std::make_unique<std::atomic<uint32_t>[]>(config.groups.size());

  const std::vector<int> allowed = topology::allowed_cpus();
  for (uint32_t g = 0; g < config.groups.size(); ++g) {
    auto group = engine::open_domain_group(config, g, allowed);
    if (!group) return group.status();
    GroupInfo info = std::move(group->info);
    const int cpu = group->cpu;
    std::vector<std::unique_ptr<transport::Domain>> domains = std::move(group->domains);
    e->direct_.push_back(group->direct);

    engine::WorkerServices services{
        e->callbacks_.get(), &e->imms_,
        [raw = e.get()](std::vector<uint32_t>& imms) { raw->on_unexpected(imms); }, &e->regions_};
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
  if (dst.rails().size() != dst.owner().num_nics()) {
    return invalid(
        fmt::format("{}: the remote memory descriptor has {} rails for an owner with {} "
                    "NIC(s)",
                    what, dst.rails().size(), dst.owner().num_nics()));
  }
  return check_peer(dst.owner(), group, what);
}

Result<std::shared_ptr<LocalRegion>> EngineImpl::find_region(MemoryHandle handle) const {
  if ((handle.id >> kTagShift) != tag_) {
    return Status(ErrorCode::kNotFound,
                  fmt::format("memory handle {:#x} was not made by this engine", handle.id));
  }
  std::shared_ptr<LocalRegion> region = regions_.find(handle.id);
  if (!region) {
    return Status(
        ErrorCode::kNotFound,
        fmt::format("memory handle {:#x} is not registered (it was unregistered)", handle.id));
  }
  return region;
}

std::unique_ptr<Transfer> EngineImpl::new_transfer(Callbacks cb) {
  auto t = std::make_unique<Transfer>();
  t->id = next_transfer_.fetch_add(1);
  t->callbacks = std::move(cb);
  return t;
}

engine::ShardParams EngineImpl::shard_params(uint32_t group) const {
  uint64_t max_wr = UINT64_MAX;
  for (uint32_t i = 0; i < workers_[group]->num_domains(); ++i) {
    max_wr = std::min(max_wr, workers_[group]->domain(i).info().max_write_bytes);
  }
  return {config_.shard_min_bytes, config_.shard_alignment, std::min(max_wr, config_.max_wr_bytes)};
}

TransferId EngineImpl::hand_over(uint32_t group, std::unique_ptr<Transfer> t) {
  stats_.submitted(group, *t);
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

Result<Registration> EngineImpl::register_memory(void* ptr, uint64_t length, uint32_t group) {
  if (engine::on_worker_thread()) return refused_on_worker("register_memory");
  auto lock = enter();
  if (!lock) return closed();
  if (Status s = check_group(group); !s) return s;
  if (ptr == nullptr) return invalid("register_memory: null pointer");
  if (length == 0) return invalid("register_memory: zero length");
  if (reinterpret_cast<uintptr_t>(ptr) + length < reinterpret_cast<uintptr_t>(ptr)) {
    return invalid("register_memory: the range wraps around the address space");
  }
  // GPU memory: registered as it is where the group's NICs reach it (FI_HMEM); otherwise staged
  // through a pinned host mirror of the same size, registered in its place.
  auto memory = cuda::classify(ptr, length);
  if (!memory) {
    return Status(memory.status().code(),
                  fmt::format("register_memory: {}", memory.status().message()));
  }
  std::unique_ptr<cuda::HostBuffer> mirror;
  const bool direct = memory->kind == cuda::MemoryKind::kCuda && direct_[group];
  if (memory->kind != cuda::MemoryKind::kHost && !direct) {
    auto m = cuda::HostBuffer::allocate(*memory, length);
    if (!m) {
      return Status(m.status().code(),
                    fmt::format("register_memory: staging mirror for device memory: {}",
                                m.status().message()));
    }
    mirror = std::move(*m);
  }
  std::byte* host = mirror ? mirror->data() : static_cast<std::byte*>(ptr);
  engine::Worker* w = workers_[group].get();
  auto regs = w->call([&] { return w->register_on_all(host, length); });
  if (!regs) return regs.status();

  auto region = std::make_shared<LocalRegion>();
  region->id = (tag_ << kTagShift) | (next_region_.fetch_add(1) & kSeqMask);
  region->ptr = static_cast<std::byte*>(ptr);
  region->host = host;
  region->length = length;
  region->group = group;
  region->memory = *memory;
  region->worker = w;
  region->regs = std::move(*regs);
  region->mirror = std::move(mirror);
  // The CUDA IPC path: device memory is exported for same-host peers (docs/cuda-ipc.md).
  std::optional<RemoteMemory::CudaIpc> ipc_section;
  if (memory->kind != cuda::MemoryKind::kHost && config_.cuda_ipc != Config::CudaIpc::kOff) {
    auto exported = cuda::ipc_export(*memory, ptr, length);
    if (exported) {
      region->ipc = std::move(*exported);
      ipc_section = RemoteMemory::CudaIpc{region->ipc->device, region->id};
    } else {
      region->ipc_why = exported.status().message();
      detail::log().debug("register_memory: no CUDA IPC export: {}", region->ipc_why);
    }
  }
  std::vector<RemoteMemory::Rail> rails;
  for (const auto& r : region->regs) rails.push_back({r->remote_addr(), r->remote_key()});
  Registration out{MemoryHandle{region->id},
                   RemoteMemory(addresses_[group], reinterpret_cast<uint64_t>(ptr), length,
                                std::move(rails), region->staged() ? region->id : 0, ipc_section)};
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
  // A barrier: the provider registrations are closed on the worker once no accepted transfer
  // holds the region any more (each completes or fails within its own bounds), then the
  // writers are fenced where the provider needs it (write_fence.cc), and only then does this
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
  peer_groups_.emplace(g.id, std::make_shared<const std::vector<Address>>(std::move(peers)));
  return g;
}

Status EngineImpl::remove_peer_group(PeerGroup group) {
  std::lock_guard gl(groups_mu_);
  if (peer_groups_.erase(group.id) == 0) {
    return Status(ErrorCode::kNotFound, fmt::format("peer group {} does not exist", group.id));
  }
  return Status::ok();
}

// --- planning helpers -----------------------------------------------------------------------

void EngineImpl::add_writes(Transfer& t, const LocalRegion& src, uint64_t src_offset,
                            uint32_t dst_index, uint64_t dst_offset,
                            const std::vector<engine::Shard>& shards, std::optional<uint32_t> imm,
                            uint32_t group) {
  const RemoteMemory& dst = t.dsts[dst_index];
  const bool staged_dst = dst.staged_region() != 0;
  // Staged memory on either side moves in chunks, so that copies and writes overlap.
  const uint64_t chunk = src.staged() || staged_dst ? config_.staging_chunk_bytes : UINT64_MAX;
  size_t pieces = 0;
  for (const engine::Shard& s : shards) {
    uint64_t done = 0;
    do {
      const uint64_t offset = s.offset + done;
      const uint64_t length = std::min(chunk, s.length - done);
      Op op = engine::write_op(t, s.domain, dst, dst_offset + offset,
                               src.host + src_offset + offset, src.regs[s.domain]->local_desc(),
                               length, workers_[group]->scratch(s.domain));
      if (staged_dst) {
        op.dst_index = dst_index;
        op.dst_offset = dst_offset + offset;
      }
      t.ops.push_back(op);
      ++pieces;
      done += length;
    } while (done < s.length);
  }
  if (!imm) return;
  // Staged: counted by the owner once the data is in its GPU. Reliable immediates: counted by
  // the owner when the Commit that follows the data arrives, exactly once.
  if (staged_dst || config_.reliable_imm) {
    stage_imm(t, dst_index, *imm, 1);
    return;
  }
  if (pieces == 1) {
    t.ops.back().has_imm = true;
    t.ops.back().imm = *imm;
    return;
  }
  // Several pieces: the immediate follows them all, on the first piece's rail.
  Op op = t.ops[t.ops.size() - pieces];
  const engine::Scratch scratch = workers_[group]->scratch(op.domain);
  op.length = 0;
  op.dst_index = Op::kNoDst;
  op.local = scratch.local;
  op.local_desc = scratch.desc;
  op.has_imm = true;
  op.imm = *imm;
  t.deferred.push_back(op);
}

Op EngineImpl::zero_byte_imm(Transfer& t, uint32_t group, uint32_t domain, const Address& peer,
                             uint32_t imm) {
  Op op = engine::scratch_op(t, domain, peer, workers_[group]->scratch(domain));
  op.has_imm = true;
  op.imm = imm;
  return op;
}

// --- submissions ----------------------------------------------------------------------------

Result<TransferId> EngineImpl::submit(const SingleWrite& w, Callbacks cb) {
  auto lock = enter();
  if (!lock) return closed();
  auto src = find_region(w.src);
  if (!src) return src.status();
  const uint32_t group = (*src)->group;
  const uint32_t nics = workers_[group]->num_domains();
  if (Status s = check_remote(w.dst, group, "single write"); !s) return s;
  if (Status s = engine::check_range("single write source", w.src_offset, w.length, (*src)->length);
      !s) {
    return s;
  }
  if (Status s =
          engine::check_range("single write destination", w.dst_offset, w.length, w.dst.length());
      !s) {
    return s;
  }
  if (w.routing.kind == Routing::Kind::kPinned && w.routing.nic >= nics) {
    return invalid(fmt::format("single write pinned to NIC {}, but the group has {} NIC(s)",
                               w.routing.nic, nics));
  }
  auto shards = engine::plan_single_up(w.length, workers_[group]->up_nics(), w.routing,
                                       next_rotation(group), shard_params(group), weights(group));
  auto t = new_transfer(std::move(cb));
  t->src = std::move(*src);
  t->dsts.push_back(w.dst);
  const engine::IpcRoute route = ipc_route(*t->src, w.dst, group);
  if (route.kind == engine::IpcRoute::Kind::kRejected) return ipc_rejected("single write", route);
  if (route.kind == engine::IpcRoute::Kind::kIpc) {
    engine::add_ipc_range(*t, 0, w.src_offset, w.dst_offset, w.length);
    if (w.imm) engine::add_ipc_imm(*t, 0, *w.imm, 1);
    return hand_over(group, std::move(t));
  }
  add_writes(*t, *t->src, w.src_offset, 0, w.dst_offset, shards, w.imm, group);
  return hand_over(group, std::move(t));
}

Result<TransferId> EngineImpl::submit(const PagedWrite& w, Callbacks cb) {
  auto lock = enter();
  if (!lock) return closed();
  auto src = find_region(w.src);
  if (!src) return src.status();
  const uint32_t group = (*src)->group;
  if (Status s = check_remote(w.dst, group, "paged write"); !s) return s;
  if (w.page_bytes == 0) return invalid("paged write: page_bytes is 0");
  if (w.src_pages.size() != w.dst_pages.size()) {
    return invalid(fmt::format("paged write: {} source pages but {} destination pages",
                               w.src_pages.size(), w.dst_pages.size()));
  }
  if (w.src_pages.empty()) return invalid("paged write: no pages");
  if (w.imm && (w.dst.staged_region() != 0 || config_.reliable_imm) &&
      w.src_pages.size() > engine::Commit::kMaxImmTimes) {
    return Status(ErrorCode::kOutOfRange,
                  fmt::format("paged write: {} pages with an immediate counted by a commit "
                              "message (at most {})",
                              w.src_pages.size(), engine::Commit::kMaxImmTimes));
  }
  const engine::ShardParams params = shard_params(group);
  if (w.page_bytes > params.max_wr_bytes) {
    return Status(ErrorCode::kUnsupported,
                  fmt::format("paged write: pages of {} bytes exceed the NIC's largest work "
                              "request ({} bytes)",
                              w.page_bytes, params.max_wr_bytes));
  }
  // Every page must lie inside both regions; offsets computed without overflow.
  auto page_offset = [&](const char* side, size_t i, uint32_t index, uint64_t stride, uint64_t base,
                         uint64_t region, uint64_t& out) -> Status {
    uint64_t scaled = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(index), stride, &scaled) ||
        __builtin_add_overflow(scaled, base, &out)) {
      return Status(
          ErrorCode::kOutOfRange,
          fmt::format("paged write: {}_pages[{}] = {} overflows the offset", side, i, index));
    }
    if (out <= region && w.page_bytes <= region - out) return Status::ok();  // no formatting
    return engine::check_range(fmt::format("paged write: {}_pages[{}] = {}", side, i, index), out,
                               w.page_bytes, region);
  };
  auto t = new_transfer(std::move(cb));
  t->src = std::move(*src);
  t->dsts.push_back(w.dst);
  const RemoteMemory& dst = t->dsts.back();
  const engine::IpcRoute route = ipc_route(*t->src, dst, group);
  if (route.kind == engine::IpcRoute::Kind::kRejected) return ipc_rejected("paged write", route);
  // Page i's offsets in the source and in the destination, checked.
  auto page_offsets = [&](size_t i, uint64_t& so, uint64_t& d_off) -> Status {
    if (Status s =
            page_offset("src", i, w.src_pages[i], w.src_stride, w.src_offset, t->src->length, so);
        !s) {
      return s;
    }
    return page_offset("dst", i, w.dst_pages[i], w.dst_stride, w.dst_offset, dst.length(), d_off);
  };
  if (route.kind == engine::IpcRoute::Kind::kIpc) {
    if (w.imm && w.src_pages.size() > engine::Commit::kMaxImmTimes) {
      return Status(
          ErrorCode::kOutOfRange,
          fmt::format("paged write: {} pages with an immediate over CUDA IPC (at most {})",
                      w.src_pages.size(), engine::Commit::kMaxImmTimes));
    }
    for (size_t i = 0; i < w.src_pages.size(); ++i) {
      uint64_t so = 0, d_off = 0;
      if (Status s = page_offsets(i, so, d_off); !s) return s;
      engine::add_ipc_range(*t, 0, so, d_off, w.page_bytes);
    }
    if (w.imm) engine::add_ipc_imm(*t, 0, *w.imm, w.src_pages.size());
    return hand_over(group, std::move(t));
  }
  t->ops.resize(w.src_pages.size());
  for (const engine::Run& run : engine::split_even_up(
           w.src_pages.size(), workers_[group]->up_nics(), next_rotation(group), weights(group))) {
    void* const local_desc = t->src->regs[run.domain]->local_desc();
    for (size_t i = run.begin; i < run.end; ++i) {
      uint64_t so = 0, d_off = 0;
      if (Status s = page_offsets(i, so, d_off); !s) return s;
      // page_bytes > 0: no scratch buffer needed.
      Op& op = t->ops[i] = engine::write_op(*t, run.domain, dst, d_off, t->src->host + so,
                                            local_desc, w.page_bytes, engine::Scratch{});
      if (dst.staged_region() != 0) {  // the owner counts one arrival per page after its copy
        op.dst_index = 0;
        op.dst_offset = d_off;
      } else if (!config_.reliable_imm) {
        op.has_imm = w.imm.has_value();
        op.imm = w.imm.value_or(0);
      }
    }
  }
  if ((dst.staged_region() != 0 || config_.reliable_imm) && w.imm) {
    stage_imm(*t, 0, *w.imm, w.src_pages.size());
  }
  return hand_over(group, std::move(t));
}

Result<TransferId> EngineImpl::submit(const Scatter& sc, Callbacks cb) {
  auto lock = enter();
  if (!lock) return closed();
  auto src = find_region(sc.src);
  if (!src) return src.status();
  const uint32_t group = (*src)->group;
  if (sc.targets.empty()) return invalid("scatter: no targets");
  std::shared_ptr<const std::vector<Address>> group_members;
  {
    std::lock_guard gl(groups_mu_);
    auto it = peer_groups_.find(sc.group.id);
    if (it == peer_groups_.end()) {
      return Status(ErrorCode::kNotFound,
                    fmt::format("scatter: peer group {} does not exist", sc.group.id));
    }
    group_members = it->second;
  }
  const std::vector<Address>& members = *group_members;
  auto in_range = [](uint64_t offset, uint64_t length, uint64_t region) {
    return offset <= region && length <= region - offset;
  };
  for (size_t i = 0; i < sc.targets.size(); ++i) {
    const ScatterTarget& tg = sc.targets[i];
    // The common case without formatting a message; the checks below say what is wrong.
    if (!tg.dst.empty() && tg.dst.owner().provider() == infos_[group].provider &&
        std::find(members.begin(), members.end(), tg.dst.owner()) != members.end() &&
        in_range(tg.src_offset, tg.length, (*src)->length) &&
        in_range(tg.dst_offset, tg.length, tg.dst.length())) {
      continue;
    }
    const std::string what = fmt::format("scatter target {}", i);
    if (Status s = check_remote(tg.dst, group, what); !s) return s;
    if (std::find(members.begin(), members.end(), tg.dst.owner()) == members.end()) {
      return Status(ErrorCode::kNotFound,
                    fmt::format("{}: its owner {} is not a member of peer group {}", what,
                                tg.dst.owner().short_name(), sc.group.id));
    }
    if (Status s = engine::check_range(what + " source", tg.src_offset, tg.length, (*src)->length);
        !s) {
      return s;
    }
    if (Status s =
            engine::check_range(what + " destination", tg.dst_offset, tg.length, tg.dst.length());
        !s) {
      return s;
    }
  }
  const uint32_t nics = workers_[group]->num_domains();
  const uint32_t rotation = next_rotation(group);
  const engine::ShardParams params = shard_params(group);
  const std::vector<bool> up = workers_[group]->up_nics();
  const std::vector<uint64_t> rates = weights(group);
  auto t = new_transfer(std::move(cb));
  t->src = std::move(*src);
  t->dsts.reserve(sc.targets.size());
  t->ops.reserve(sc.targets.size());  // one op per target when pinned; more when sharded
  for (size_t i = 0; i < sc.targets.size(); ++i) {
    const ScatterTarget& tg = sc.targets[i];
    t->dsts.push_back(tg.dst);
    const uint32_t dst_index = static_cast<uint32_t>(t->dsts.size() - 1);
    const engine::IpcRoute route = ipc_route(*t->src, tg.dst, group);
    if (route.kind == engine::IpcRoute::Kind::kRejected) {
      return ipc_rejected(fmt::format("scatter target {}", i), route);
    }
    if (route.kind == engine::IpcRoute::Kind::kIpc) {
      engine::add_ipc_range(*t, dst_index, tg.src_offset, tg.dst_offset, tg.length);
      if (sc.imm) engine::add_ipc_imm(*t, dst_index, *sc.imm, 1);
      continue;
    }
    const Routing routing = sc.sharding == Scatter::Sharding::kByBytes
                                ? Routing::sharded(0)
                                : Routing::pinned(static_cast<uint32_t>((rotation + i) % nics));
    auto shards = engine::plan_single_up(tg.length, up, routing,
                                         rotation + static_cast<uint32_t>(i), params, rates);
    add_writes(*t, *t->src, tg.src_offset, dst_index, tg.dst_offset, shards, sc.imm, group);
  }
  return hand_over(group, std::move(t));
}

Result<TransferId> EngineImpl::submit(const Barrier& b, Callbacks cb) {
  auto lock = enter();
  if (!lock) return closed();
  if (Status s = check_group(b.local_group); !s) return s;
  const uint32_t nics = workers_[b.local_group]->num_domains();
  if (b.nic >= nics) {
    return invalid(fmt::format("barrier on NIC {}, but the group has {} NIC(s)", b.nic, nics));
  }
  auto t = new_transfer(std::move(cb));
  {
    std::lock_guard gl(groups_mu_);
    auto it = peer_groups_.find(b.group.id);
    if (it == peer_groups_.end()) {
      return Status(ErrorCode::kNotFound,
                    fmt::format("barrier: peer group {} does not exist", b.group.id));
    }
    t->peers = *it->second;
  }
  // A barrier on a NIC that is down goes over a surviving one.
  const uint32_t nic = engine::failover_nic(b.nic, workers_[b.local_group]->up_nics(), 0);
  t->ops.reserve(t->peers.size());
  for (const Address& peer : t->peers) {
    if (Status s = check_peer(peer, b.local_group, "barrier"); !s) return s;
    t->ops.push_back(zero_byte_imm(*t, b.local_group, nic, peer, b.imm));
  }
  return hand_over(b.local_group, std::move(t));
}

Result<TransferId> EngineImpl::submit(const ImmWrite& w, Callbacks cb) {
  auto lock = enter();
  if (!lock) return closed();
  if (Status s = check_group(w.local_group); !s) return s;
  if (Status s = check_peer(w.peer, w.local_group, "imm write"); !s) return s;
  const uint32_t nics = workers_[w.local_group]->num_domains();
  if (w.nic >= nics) {
    return invalid(fmt::format("imm write on NIC {}, but the group has {} NIC(s)", w.nic, nics));
  }
  auto t = new_transfer(std::move(cb));
  t->peers.push_back(w.peer);
  const uint32_t nic = engine::failover_nic(w.nic, workers_[w.local_group]->up_nics(), 0);
  t->ops.push_back(zero_byte_imm(*t, w.local_group, nic, t->peers[0], w.imm));
  return hand_over(w.local_group, std::move(t));
}

Result<TransferId> EngineImpl::submit_send(const Address& peer, std::span<const std::byte> message,
                                           Callbacks cb, uint32_t group) {
  auto lock = enter();
  if (!lock) return closed();
  if (Status s = check_group(group); !s) return s;
  if (Status s = check_peer(peer, group, "send"); !s) return s;
  if (message.size() > config_.max_message_bytes) {
    return Status(ErrorCode::kOutOfRange,
                  fmt::format("send: message of {} bytes exceeds max_message_bytes ({})",
                              message.size(), config_.max_message_bytes));
  }
  auto t = new_transfer(std::move(cb));
  t->peers.push_back(peer);
  t->message.reserve(engine::kMessageHeaderBytes + message.size());
  t->message.resize(engine::kMessageHeaderBytes);  // sender and sequence: stamped by the worker
  t->message[0] = static_cast<std::byte>(engine::MessageKind::kUser);
  t->message.insert(t->message.end(), message.begin(), message.end());
  // Over the first NIC that is up; every NIC of the peer has receive buffers.
  const uint32_t nic = engine::failover_nic(0, workers_[group]->up_nics(), 0);
  t->ops.push_back(engine::send_op(*t, nic, t->peers[0], t->message));
  return hand_over(group, std::move(t));
}

Status EngineImpl::set_receive_handler(std::function<void(std::span<const std::byte>)> on_message,
                                       uint64_t buffer_bytes, uint32_t count, uint32_t group) {
  auto lock = enter();
  if (!lock) return closed();
  if (Status s = check_group(group); !s) return s;
  if (!on_message) return invalid("set_receive_handler: the handler is empty");
  if (buffer_bytes == 0 || count == 0) {
    return invalid("set_receive_handler: buffer_bytes and count must be at least 1");
  }
  on_message = stats_.receiving(group, std::move(on_message));
  engine::Worker* w = workers_[group].get();
  return w->call([&] { return w->start_receives(std::move(on_message), buffer_bytes, count); });
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

void EngineImpl::on_unexpected(std::vector<uint32_t>& imms) {
  if (!has_unexpected_handler_.load()) return;
  auto handler = [this] {
    std::lock_guard lock(unexpected_mu_);
    return unexpected_handler_;
  };
  if (config_.callbacks_on_worker) {
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
  return impl_->register_memory(ptr, length, group);
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
