// EngineImpl, the engine behind TransferEngine: its members and methods. engine.cc holds
// creation and close, registration, peer groups, immediates and the TransferEngine facade;
// engine_submit.cc and engine_read.cc the validation and planning of submissions on the caller's
// thread.
#pragma once

#include "fabric/engine.h"

#include <fmt/format.h>
#include "common/invalid.h"
#include "common/log.h"

#include <atomic>
#include <deque>
#include <future>
#include <mutex>
#include <random>
#include <shared_mutex>
#include <string_view>
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

namespace engine_impl {

// A transfer id: the device group in the bits from kTagShift up, a sequence number below.
inline constexpr int kTagShift = 40;
inline constexpr uint64_t kSeqMask = (uint64_t{1} << kTagShift) - 1;

using fabric::invalid;  // common/invalid.h

}  // namespace engine_impl

namespace engine {
// A peer group's members, and an index of them, so that a scatter checks each target's owner
// in constant time (a scan compared every target with every member: about 2000 address
// comparisons for a scatter to 63 peers).
struct PeerGroupMembers {
  std::vector<Address> peers;
  // Indices into `peers` by the origin's random instance id (one per engine device group): a
  // check hashes a number, not a NIC name (which cost a third of a scatter's instructions), and
  // compares whole addresses only with the members of that engine (addresses without an origin,
  // wire version 1, share instance 0).
  std::unordered_multimap<uint64_t, size_t> by_instance;

  explicit PeerGroupMembers(std::vector<Address> members) : peers(std::move(members)) {
    by_instance.reserve(peers.size());
    for (size_t i = 0; i < peers.size(); ++i) by_instance.emplace(peers[i].origin().instance, i);
  }
  bool contains(const Address& a) const {
    if (a.empty()) return false;
    auto [lo, hi] = by_instance.equal_range(a.origin().instance);
    for (auto it = lo; it != hi; ++it) {
      if (peers[it->second] == a) return true;
    }
    return false;
  }
};
}  // namespace engine

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

  Result<Registration> register_memory(void* ptr, uint64_t length, const RegisterOptions& options);
  Status unregister_memory(MemoryHandle handle);
  Result<PeerGroup> add_peer_group(std::vector<Address> peers);
  Status remove_peer_group(PeerGroup group);

  Result<TransferId> submit(const SingleWrite& w, Callbacks&& cb);
  Result<TransferId> submit(const PagedWrite& w, Callbacks&& cb);
  Result<TransferId> submit(const Scatter& s, Callbacks&& cb);
  Result<TransferId> submit(const Barrier& b, Callbacks&& cb);
  Result<TransferId> submit(const ImmWrite& w, Callbacks&& cb);
  Result<TransferId> submit(const SingleRead& r, Callbacks&& cb);
  Result<TransferId> submit(const PagedRead& r, Callbacks&& cb);
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
  EngineStats stats() const {
    EngineStats s = stats_.snapshot(imms_.total());
    s.callback_spin = callback_spin_;
    s.wait_spin = wait_spin_;
    std::shared_lock lock(close_mu_);
    for (size_t g = 0; g < s.groups.size() && g < workers_.size(); ++g) {
      if (workers_[g]) workers_[g]->fill_stats(s.groups[g]);
    }
    return s;
  }

 private:
  explicit EngineImpl(const Config& config) : config_(config) {}

  // The shared hold of close_mu_ that calls needing the engine open take; empty (not owning)
  // once close() has begun, and then the call returns closed().
  std::shared_lock<std::shared_mutex> enter() const;
  // What a submission holds instead (the six kinds): it is counted in submitting_, which close()
  // waits to see at zero before it stops the workers; false once close() has begun, and then the
  // submission returns closed(). One atomic add and a load, where the shared lock took two
  // read-modify-writes of the lock word and about 70 instructions (callgrind,
  // docs/engine.md "A submission"). Sequentially consistent on both sides: either the
  // submission sees closing_, or close() sees it counted.
  class Submitting {
   public:
    explicit Submitting(const EngineImpl& e) : count_(&e.submitting_) {
      count_->fetch_add(1);
      if (e.closing_.load()) {
        count_->fetch_sub(1);
        count_ = nullptr;
      }
    }
    ~Submitting() {
      if (count_ != nullptr) count_->fetch_sub(1);
    }
    Submitting(const Submitting&) = delete;
    Submitting& operator=(const Submitting&) = delete;
    explicit operator bool() const { return count_ != nullptr; }

   private:
    std::atomic<uint32_t>* count_;
  };
  static Status closed();
  Status check_group(uint32_t group) const;
  Status check_peer(const Address& peer, uint32_t group, std::string_view what) const;
  Status check_remote(const RemoteMemory& dst, uint32_t group, std::string_view what) const;
  // A read of `remote` into `local`: the remote checks and readable (engine_read.cc).
  Status check_read(const RemoteMemory& remote, uint32_t group, std::string_view what) const;
  // What check_remote holds, without a Status or a call to memcmp: the common case, so that a
  // submission calls check_remote only to say what is wrong.
  bool remote_ok(const RemoteMemory& dst, uint32_t group) const {
    if (dst.empty()) return false;
    const Address& owner = dst.owner();
    if (owner.empty() || !dst.rails_fit_owner()) return false;
    const std::string& theirs = owner.provider();
    const std::string& ours = infos_[group].provider;
    if (theirs.size() != ours.size()) return false;
    for (size_t i = 0; i < ours.size(); ++i) {
      if (theirs[i] != ours[i]) return false;
    }
    return true;
  }
  // The region registered under `handle`, shared with the caller, or null (region_missing says
  // why). Looked up first in the calling thread's cache of recent regions (weak references, by
  // engine serial and handle: no mutex, one atomic add for the reference), then in the table
  // (regions_, under its mutex).
  std::shared_ptr<LocalRegion> lookup_region(MemoryHandle handle) const;
  Status region_missing(MemoryHandle handle) const;
  Result<std::shared_ptr<LocalRegion>> find_region(MemoryHandle handle) const {
    if (std::shared_ptr<LocalRegion> region = lookup_region(handle)) return region;
    return region_missing(handle);
  }
  // A transfer of `group`'s pool (engine/transfer_pool.h): no heap once the pool is warm.
  engine::TransferPtr new_transfer(uint32_t group, Callbacks&& cb);
  uint32_t next_rotation(uint32_t group) { return rotations_[group].fetch_add(1); }
  // The sharding parameters of a group's NICs (fixed once they are open).
  const engine::ShardParams& shard_params(uint32_t group) const { return shard_params_[group]; }
  engine::ShardParams make_shard_params(const engine::Worker& w) const;
  // The shard weights of a group's NICs (their measured rates), empty when
  // Config::weighted_sharding is off.
  // The NICs of `group` that are up, and their measured rates (none without weighted sharding,
  // or with one NIC), in buffers of the calling thread: a submission allocates nothing for them.
  // Each call refills its buffer: use the result before the next call of the same function.
  // The buffer is refilled only when the NICs' state has changed since this thread last filled
  // it, for any group of any engine (NicHealth::stamp: unique across them all).
  const std::vector<bool>& up(uint32_t group) const {
    thread_local std::vector<bool> buf;
    thread_local uint64_t filled_at = 0;
    const uint64_t stamp = workers_[group]->up_stamp();
    if (stamp != filled_at) {
      workers_[group]->up_nics(buf);
      filled_at = stamp;
    }
    return buf;
  }
  std::span<const uint64_t> weights(uint32_t group) const {
    thread_local std::vector<uint64_t> buf;
    buf.clear();
    if (config_.weighted_sharding && workers_[group]->num_domains() > 1) {
      workers_[group]->nic_rates(buf);
    }
    return buf;
  }
  // The calling thread's buffer for a shard plan (engine::plan_single_up's `out`).
  static std::vector<engine::Shard>& shard_buf() {
    thread_local std::vector<engine::Shard> buf;
    return buf;
  }
  static std::vector<engine::Run>& run_buf() {  // engine::split_even_up's
    thread_local std::vector<engine::Run> buf;
    return buf;
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
  TransferId hand_over(uint32_t group, engine::TransferPtr t);
  // The CUDA IPC path or the fabric for a write from `src` into `dst` (docs/cuda-ipc.md).
  // For a read (`read`), `src` is the local region the bytes go to and `dst` the peer's.
  engine::IpcRoute ipc_route(const LocalRegion& src, const RemoteMemory& dst, uint32_t group,
                             bool read = false) const {
    // Host memory to a host destination, what choose_route answers first: the fabric, without
    // building the reachability test (a std::function) it takes.
    if (src.memory.kind == cuda::MemoryKind::kHost && dst.staged_region() == 0 && !dst.cuda_ipc()) {
      return {engine::IpcRoute::Kind::kFabric, {}};
    }
    return engine::choose_route(
        config_.cuda_ipc, addresses_[group].origin(), src.memory, src.ipc ? &*src.ipc : nullptr,
        src.ipc_why, src.ipc_only, dst,
        [&src](const cuda::DeviceUuid& peer) { return cuda::ipc_reachable(src.memory, peer); },
        read);
  }
  static Status ipc_rejected(std::string_view what, const engine::IpcRoute& route) {
    return Status(ErrorCode::kUnsupported, fmt::format("{}: {}", what, route.why));
  }

  const Config config_;
  // Config::callback_spin and wait_spin in effect (an unset one resolved by Config::auto_spin).
  std::chrono::microseconds callback_spin_{0};
  std::chrono::microseconds wait_spin_{0};
  uint64_t tag_ = 0;     // distinguishes this engine's handles from another engine's
  uint64_t serial_ = 0;  // unique among the process's engines (lookup_region's thread caches)
  std::unique_ptr<engine::CallbackThread> callbacks_;
  engine::ImmCounters imms_;
  std::mutex unexpected_mu_;
  // Shared, so that each batch of arrivals takes a reference, not a copy of the handler.
  std::shared_ptr<const std::function<void(uint32_t)>> unexpected_handler_;
  std::atomic<bool> has_unexpected_handler_{false};
  // On a worker: immediates that arrived with no expectation, for the user's handler.
  // `here`: run the handler on this thread (callbacks on the worker, a caller-driven pass).
  void on_unexpected(std::vector<uint32_t>& imms, bool here);
  std::vector<std::unique_ptr<engine::Worker>> workers_;
  bool any_caller_driven_ = false;  // some group has GroupConfig::caller_progress
  std::vector<GroupInfo> infos_;
  std::vector<bool> direct_;  // per group: its NICs register CUDA memory themselves
  std::vector<Address> addresses_;
  std::vector<engine::ShardParams> shard_params_;  // per group
  std::unique_ptr<std::atomic<uint32_t>[]> rotations_;

  // Calls that need the engine open hold close_mu_ shared (enter()); close() exclusively.
  // close() sets closing_ before it asks for the lock, and enter() does not ask for it once
  // closing_ is set: threads that keep submitting cannot starve close(), and every call made
  // after close() began returns kClosed at once.
  mutable std::shared_mutex close_mu_;
  std::atomic<bool> closing_{false};
  bool closed_ = false;
  mutable std::atomic<uint32_t> submitting_{0};  // submissions under way (Submitting)

  // Declared after workers_, so destroyed before them: a LocalRegion's destructor hands its
  // registrations to its worker. The workers' threads have stopped by then (close()).
  engine::RegionTable regions_;
  mutable std::mutex groups_mu_;
  // Shared, so a scatter or barrier takes a reference, not a copy of every member.
  std::unordered_map<uint64_t, std::shared_ptr<const engine::PeerGroupMembers>> peer_groups_;
  std::atomic<uint64_t> next_region_{1};
  std::atomic<uint64_t> next_transfer_{1};
  std::atomic<uint64_t> next_peer_group_{1};

  // TransferEngine::stats(): counted in hand_over() and set_receive_handler().
  engine::StatsCounters stats_{config_.groups.size()};
};

}  // namespace fabric
