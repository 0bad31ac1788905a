// fabric::ep's inter-node proxy (ep/proxy.h): the proxy thread's loop over its peers (the
// schedule's pure functions are in schedule.cc). docs/moe.md ("Between nodes") describes the
// protocol.
#include "ep/proxy.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>

#include "common/codec.h"
#include "fabric/engine.h"

namespace fabric::ep {

namespace {

constexpr uint32_t kHandleMagic = 0x58504546;  // "FEPX"
// 3: a combine's slot ids travel behind its counts (2: in writes of their own; 2 and 3: the
// control and data regions; 1: one area).
constexpr uint16_t kHandleVersion = 3;

// Wrap-safe: round `a` is at or past round `b`.
bool reached(uint32_t a, uint32_t b) {
  return static_cast<int32_t>(a - b) >= 0;
}

uint64_t elapsed_ns(std::chrono::steady_clock::time_point from,
                    std::chrono::steady_clock::time_point to = std::chrono::steady_clock::now()) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(to - from).count());
}

const char* kind_name(bool combine) {
  return combine ? "combine" : "dispatch";
}

ImmKind counts_kind(bool combine) {
  return combine ? ImmKind::kCombineCounts : ImmKind::kDispatchCounts;
}
ImmKind data_kind(bool combine) {
  return combine ? ImmKind::kCombineData : ImmKind::kDispatchData;
}
ImmKind ack_kind(bool combine) {
  return combine ? ImmKind::kCombineAck : ImmKind::kDispatchAck;
}

}  // namespace

// --- the proxy ---------------------------------------------------------------------------------

// One remote peer, as the proxy thread tracks it. Index [k] of each pair: 0 dispatch, 1 combine.
struct Proxy::Peer {
  int rank = 0;
  int remote = 0;             // its index among this rank's remote peers (its areas here)
  int index_there = 0;        // this rank's index among its remote peers (this rank's areas there)
  RemoteMemory control;       // its control region
  RemoteMemory data;          // its data region
  uint32_t sent[2] = {0, 0};  // the last round posted to it
  // Writes of the round `sent` not complete yet (callbacks may run on the engine's callback
  // thread at close, hence atomic).
  std::atomic<uint32_t> outstanding[2] = {0, 0};
  uint32_t received[2] = {0, 0};  // the last round of it raised to this GPU
  bool have_counts[2] = {false, false};
  Counts counts[2];
  uint64_t chunks[2] = {0, 0};  // data immediates the round of counts[] brings
  std::chrono::steady_clock::time_point posted_at[2];       // the round `sent` was posted
  std::chrono::steady_clock::time_point counts_seen_at[2];  // counts[] were read
  uint32_t acks_sent[2] = {0, 0};   // the last round this rank acknowledged to it
  uint32_t acks_taken[2] = {0, 0};  // the last acknowledgement of it handed to this GPU
};

Proxy::Proxy(const AllToAllConfig& config, const Layout& layout, const ProxyLayout& proxy_layout,
             const ProxyOptions& options)
    : config_(config), a2a_(layout), layout_(proxy_layout), options_(options) {}

namespace {

Status check_region(const char* name, std::span<std::byte> region, uint64_t need) {
  if (region.size() < need) {
    return Status(
        ErrorCode::kInvalidArgument,
        fmt::format("proxy {} region of {} bytes, the layout needs {}", name, region.size(), need));
  }
  if (reinterpret_cast<uintptr_t>(region.data()) % 16 != 0) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("proxy {} region is not 16-byte aligned", name));
  }
  return Status::ok();
}

}  // namespace

Result<std::unique_ptr<Proxy>> Proxy::create(const AllToAllConfig& config, const Layout& layout,
                                             const ProxyOptions& options,
                                             const ProxyAllocator& allocate) {
  auto pl = ProxyLayout::of(config, layout);
  if (!pl) return pl.status();
  std::unique_ptr<Proxy> p(new Proxy(config, layout, *pl, options));
  Config c;
  c.provider = options.provider;
  GroupConfig g;
  g.nics = options.nics;
  g.caller_progress = true;
  g.cpu = GroupConfig::kCpuNone;
  c.groups = {g};
  // Completions run on the proxy thread, in its progress() passes.
  c.callbacks_on_worker = true;
  c.peer_timeout = options.timeout;
  // Its peers are the ranks of other nodes, reached over the fabric even when they share this
  // host (every GPU its own node): the engine's same-host CUDA IPC path is not for them.
  c.cuda_ipc = Config::CudaIpc::kOff;
  c.close_timeout = std::min(options.timeout, std::chrono::milliseconds(2000));
  auto engine = TransferEngine::create(c);
  if (!engine) return engine.status();
  p->engine_ = std::move(*engine);
  auto areas = allocate(*pl, p->engine_->group_info(0).gpu_memory.starts_with("direct"));
  if (!areas) return areas.status();
  if (Status s = check_region("control", areas->control, pl->control_bytes); !s) return s;
  if (Status s = check_region("data", areas->data, pl->data_bytes); !s) return s;
  p->areas_ = {areas->control.first(pl->control_bytes), areas->data.first(pl->data_bytes)};
  detail::ByteWriter w;
  w.u32(kHandleMagic);
  w.u16(kHandleVersion);
  w.u16(0);
  w.u64(pl->control_bytes);
  w.u64(pl->data_bytes);
  const std::span<std::byte> regions[] = {p->areas_.control, p->areas_.data};
  MemoryHandle* const handles[] = {&p->control_handle_, &p->data_handle_};
  for (int i = 0; i < 2; ++i) {
    auto reg = p->engine_->register_memory(regions[i].data(), regions[i].size());
    if (!reg) return reg.status();
    *handles[i] = reg->handle;
    const Bytes desc = reg->descriptor.encode();
    w.u32(static_cast<uint32_t>(desc.size()));
    w.bytes(desc);
  }
  p->descriptor_ = w.take();
  return p;
}

Proxy::~Proxy() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
  // close() drives the caller-driven group itself, bounded by close_timeout; cancelled writes'
  // callbacks run before it returns (they touch peers_ and failure_, destroyed after).
  if (engine_) engine_->close();
  engine_.reset();
}

Bytes Proxy::handle() const {
  return descriptor_;
}

Status Proxy::connect(const std::vector<Bytes>& handles) {
  if (!peers_.empty() || thread_.joinable()) {
    return Status(ErrorCode::kAlreadyExists, "proxy: connected already");
  }
  if (handles.size() != static_cast<size_t>(config_.world_size)) {
    return Status(ErrorCode::kInvalidArgument, fmt::format("proxy: {} handles for world_size {}",
                                                           handles.size(), config_.world_size));
  }
  const int per_node = config_.gpus_per_node == 0 ? config_.world_size : config_.gpus_per_node;
  std::vector<std::unique_ptr<Peer>> peers;
  for (int r : remote_peers(config_.rank, config_.world_size, per_node)) {
    detail::ByteReader rd(handles[r]);
    uint32_t magic = 0, control_len = 0, data_len = 0;
    uint16_t version = 0, reserved = 0;
    uint64_t control_bytes = 0, data_bytes = 0;
    std::vector<std::byte> control, data;
    if (!rd.u32(magic) || magic != kHandleMagic || !rd.u16(version) || version != kHandleVersion ||
        !rd.u16(reserved) || !rd.u64(control_bytes) || !rd.u64(data_bytes) ||
        !rd.u32(control_len) || !rd.bytes(control_len, control) || !rd.u32(data_len) ||
        !rd.bytes(data_len, data) || rd.remaining() != 0) {
      return Status(ErrorCode::kInvalidArgument,
                    fmt::format("proxy: rank {}'s handle ({} bytes) is not a proxy handle of "
                                "version {}",
                                r, handles[r].size(), kHandleVersion));
    }
    if (control_bytes != areas_.control.size() || data_bytes != areas_.data.size()) {
      return Status(
          ErrorCode::kInvalidArgument,
          fmt::format("proxy: rank {}'s regions have {} and {} bytes, this rank's {} "
                      "and {}",
                      r, control_bytes, data_bytes, areas_.control.size(), areas_.data.size()));
    }
    auto control_rm = RemoteMemory::decode(control);
    auto data_rm = control_rm ? RemoteMemory::decode(data) : control_rm;
    if (!data_rm) {
      return Status(data_rm.status().code(),
                    fmt::format("proxy: rank {}'s descriptor: {}", r, data_rm.status().message()));
    }
    if (!(control_rm->owner() == data_rm->owner())) {
      return Status(ErrorCode::kInvalidArgument,
                    fmt::format("proxy: rank {}'s two regions belong to different engines", r));
    }
    auto p = std::make_unique<Peer>();
    p->rank = r;
    p->remote = remote_index(config_.rank, r, per_node);
    p->index_there = remote_index(r, config_.rank, per_node);
    p->control = *control_rm;
    p->data = *data_rm;
    peers.push_back(std::move(p));
  }
  std::vector<Address> owners;
  for (const auto& p : peers) owners.push_back(p->control.owner());
  if (!owners.empty()) {
    auto group = engine_->add_peer_group(std::move(owners));
    if (!group) {
      return Status(group.status().code(),
                    fmt::format("proxy: the group of remote peers: {}", group.status().message()));
    }
    remote_group_ = *group;
  }
  peers_ = std::move(peers);
  thread_ = std::thread([this] { run(); });
  return Status::ok();
}

Status Proxy::status() const {
  if (!failed_.load(std::memory_order_acquire)) return Status::ok();
  std::lock_guard lock(failure_mu_);
  return failure_;
}

ProxyStats Proxy::stats() const {
  ProxyStats out;
  const auto get = [](const std::atomic<uint64_t>& v) { return v.load(std::memory_order_relaxed); };
  for (int k = 0; k < 2; ++k) {
    out.rounds_sent[k] = get(counters_.rounds_sent[k]);
    out.writes_sent[k] = get(counters_.writes_sent[k]);
    out.bytes_sent[k] = get(counters_.bytes_sent[k]);
    out.post_ns[k] = get(counters_.post_ns[k]);
    out.complete_ns[k] = get(counters_.complete_ns[k]);
    out.rounds_received[k] = get(counters_.rounds_received[k]);
    out.receive_ns[k] = get(counters_.receive_ns[k]);
  }
  out.passes = get(counters_.passes);
  out.naps = get(counters_.naps);
  return out;
}

void Proxy::fail(Status s) {
  std::lock_guard lock(failure_mu_);
  if (failed_.load(std::memory_order_relaxed)) return;
  failure_ = std::move(s);
  failed_.store(true, std::memory_order_release);
}

void Proxy::run() {
  uint32_t idle = 0;
  while (!stop_.load(std::memory_order_relaxed) && !failed_.load(std::memory_order_relaxed)) {
    bool busy = engine_->progress(0);
    busy = pass() || busy;
    counters_.passes.fetch_add(1, std::memory_order_relaxed);
    if (busy) {
      idle = 0;
    } else if (++idle >= options_.idle_spins) {
      counters_.naps.fetch_add(1, std::memory_order_relaxed);
      std::this_thread::sleep_for(options_.idle_sleep);
    }
  }
}

bool Proxy::pass() {
  bool busy = send_rounds(false);
  busy = send_rounds(true) || busy;
  for (auto& p : peers_) {
    for (bool combine : {false, true}) {
      busy = receive_round(*p, combine) || busy;
      busy = forward_acks(*p, combine) || busy;
      busy = take_acks(*p, combine) || busy;
      if (failed_.load(std::memory_order_relaxed)) return false;
    }
  }
  return busy;
}

// This GPU staged rounds for peers (their ready words moved): each round goes out as one
// posting for all of them (post_rounds). A peer is at most one round ahead of another (its
// staging waits for its own acknowledgement), so a pass posts one round, rarely two.
bool Proxy::send_rounds(bool combine) {
  const int k = combine ? 1 : 0;
  const ProxyLayout::Word word = combine ? ProxyLayout::kCombineReady : ProxyLayout::kDispatchReady;
  ready_.clear();
  std::chrono::steady_clock::time_point seen;
  for (auto& peer : peers_) {
    Peer& p = *peer;
    const uint64_t v = load_word(areas_.control.data(), word, p.rank);
    const uint32_t round = static_cast<uint32_t>(v >> 32);
    if (round == p.sent[k]) continue;
    if (ready_.empty()) seen = std::chrono::steady_clock::now();
    if (round != p.sent[k] + 1) {
      fail(Status(ErrorCode::kInternal,
                  fmt::format("rank {}'s GPU staged {} round {} for rank {} after round {}",
                              config_.rank, kind_name(combine), round, p.rank, p.sent[k])));
      return false;
    }
    const uint32_t value = static_cast<uint32_t>(v);
    if (value > most(combine)) {
      fail(Status(ErrorCode::kInternal,
                  fmt::format("rank {}'s GPU staged {} {} for rank {} in {} round {}, more than "
                              "the {} an area holds",
                              config_.rank, value, combine ? "rows" : "entries", p.rank,
                              kind_name(combine), round, most(combine))));
      return false;
    }
    ready_.push_back(Ready{&p, round, value});
    if (!reached(local_round_[k], round)) {
      local_round_[k] = round;
      local_seen_at_[k] = seen;
    }
  }
  if (ready_.empty()) return false;
  const uint32_t first = ready_.front().round;
  post_rounds(combine, first, seen);
  for (const Ready& r : ready_) {
    if (r.round != first && !failed_.load(std::memory_order_relaxed)) {
      post_rounds(combine, r.round, seen);
      break;
    }
  }
  return true;
}

// Round `round` of every peer in ready_ that staged it: their counts writes (a combine's with
// its slot ids) and their bytes, each part one scatter with its immediate, so that posting costs
// a submission per part rather than a write per peer and part. Each receiver counts one counts
// immediate and one data immediate per chunk, as round_chunks says.
void Proxy::post_rounds(bool combine, uint32_t round, std::chrono::steady_clock::time_point seen) {
  const int k = combine ? 1 : 0;
  // One record per part, taken from the free list: their callbacks capture only the record.
  Posting* parts[2] = {take_posting(combine, round), take_posting(combine, round)};
  Posting& counts = *parts[0];
  Posting& data = *parts[1];
  uint64_t writes = 0, bytes = 0;
  for (const Ready& r : ready_) {
    if (r.round != round) continue;
    Peer& p = *r.peer;
    p.sent[k] = round;
    // The counts slot (and, for a combine, the slot ids the GPU staged right behind it).
    const uint64_t slot = layout_.counts_slot(false, combine, p.remote);
    store_counts(areas_.control.data() + slot, Counts{round, r.value});
    const uint64_t counts_bytes = counts_write_bytes(combine, r.value);
    counts.targets.push_back(ScatterTarget{p.control, counts_bytes, slot,
                                           layout_.counts_slot(true, combine, p.index_there)});
    counts.peers.push_back(&p);
    const uint64_t src = combine ? layout_.combine_send(p.remote) : layout_.dispatch_send(p.remote);
    const uint64_t dst =
        combine ? layout_.combine_recv(p.index_there) : layout_.dispatch_recv(p.index_there);
    chunks_.clear();
    append_chunks(chunks_, round_bytes(a2a_, combine, r.value), options_.chunk_bytes);
    if (!chunks_.empty()) data.peers.push_back(&p);
    for (const Chunk& c : chunks_) {
      data.targets.push_back(ScatterTarget{p.data, c.length, src + c.offset, dst + c.offset});
      bytes += c.length;
    }
    writes += 1 + chunks_.size();
    bytes += counts_bytes;
  }
  // Every part's peers are counted outstanding before the first is posted.
  for (Posting* part : parts) {
    for (Peer* p : part->peers) p->outstanding[k].fetch_add(1, std::memory_order_relaxed);
  }
  const uint64_t peers = counts.peers.size();
  counters_.writes_sent[k].fetch_add(writes, std::memory_order_relaxed);
  counters_.bytes_sent[k].fetch_add(bytes, std::memory_order_relaxed);
  post(counts, true, encode_imm(counts_kind(combine), config_.rank, round),
       Scatter::Sharding::kByPeer);
  post(data, false, encode_imm(data_kind(combine), config_.rank, round),
       Scatter::Sharding::kByBytes);
  const auto posted = std::chrono::steady_clock::now();
  for (const Ready& r : ready_) {
    if (r.round == round) r.peer->posted_at[k] = posted;
  }
  // One posting for `peers` rounds: post_ns / rounds_sent stays the cost per peer and round.
  counters_.post_ns[k].fetch_add(elapsed_ns(seen, posted), std::memory_order_relaxed);
  counters_.rounds_sent[k].fetch_add(peers, std::memory_order_relaxed);
}

Proxy::Posting* Proxy::take_posting(bool combine, uint32_t round) {
  Posting* p = nullptr;
  if (free_postings_.empty()) {
    postings_.push_back(std::make_unique<Posting>());
    p = postings_.back().get();
  } else {
    p = free_postings_.back();
    free_postings_.pop_back();
  }
  p->combine = combine;
  p->round = round;
  return p;
}

void Proxy::give_back(Posting* p) {
  p->targets.clear();
  p->peers.clear();
  free_postings_.push_back(p);
}

// A part's scatter completed: each of its peers has one write fewer outstanding, and a peer's
// round is complete with its last (all of a round's parts are posted before the proxy thread,
// which runs these, drives the engine again).
void Proxy::posted_done(Posting* p) {
  const int k = p->combine ? 1 : 0;
  for (Peer* peer : p->peers) {
    if (peer->outstanding[k].fetch_sub(1, std::memory_order_acq_rel) == 1) {
      counters_.complete_ns[k].fetch_add(elapsed_ns(peer->posted_at[k]), std::memory_order_relaxed);
    }
  }
  give_back(p);
}

namespace {
std::string rank_list(const std::vector<int>& ranks) {
  return fmt::format("{} {}", ranks.size() == 1 ? "rank" : "ranks", fmt::join(ranks, ", "));
}
}  // namespace

std::string Proxy::Posting::to() const {
  std::vector<int> ranks;
  for (const Peer* p : peers) ranks.push_back(p->rank);
  return rank_list(ranks);
}

void Proxy::posted_failed(Posting* p, const Status& s) {
  fail(Status(
      s.code() == ErrorCode::kCancelled ? ErrorCode::kCancelled : ErrorCode::kPeerUnreachable,
      fmt::format("rank {}'s proxy could not write its {} of round {} to {}: {}", config_.rank,
                  kind_name(p->combine), p->round, p->to(), s.to_string())));
  give_back(p);
}

// Posts `part` as one scatter (nothing for no targets): its completion calls posted_done or
// posted_failed, which give the record back.
void Proxy::post(Posting& part, bool control, uint32_t imm, Scatter::Sharding sharding) {
  if (part.targets.empty()) {
    give_back(&part);
    return;
  }
  Scatter sc;
  sc.src = control ? control_handle_ : data_handle_;
  sc.group = remote_group_;
  sc.targets = std::move(part.targets);
  sc.imm = imm;
  sc.sharding = sharding;
  Posting* p = &part;
  auto id = engine_->submit(sc, Callbacks{[this, p] { posted_done(p); },
                                          [this, p](const Status& s) { posted_failed(p, s); }});
  part.targets = std::move(sc.targets);  // its memory, for the record's next use
  if (!id) {
    const int k = part.combine ? 1 : 0;
    for (Peer* peer : part.peers) peer->outstanding[k].fetch_sub(1, std::memory_order_relaxed);
    fail(Status(
        id.status().code() == ErrorCode::kClosed ? ErrorCode::kClosed : ErrorCode::kPeerUnreachable,
        fmt::format("rank {}'s proxy could not post its {} of round {} to {}: {}", config_.rank,
                    kind_name(part.combine), part.round, part.to(), id.status().to_string())));
    give_back(&part);
  }
}

// `p`'s next round: its counts slot, then every chunk the counts announce; then this GPU's flag.
bool Proxy::receive_round(Peer& p, bool combine) {
  const int k = combine ? 1 : 0;
  const uint32_t want = p.received[k] + 1;
  const uint32_t counts_imm = encode_imm(counts_kind(combine), p.rank, want);
  const uint32_t data_imm = encode_imm(data_kind(combine), p.rank, want);
  if (!p.have_counts[k]) {
    if (engine_->imm_count(counts_imm) == 0) {
      if (reached(local_round_[k], want) &&
          std::chrono::steady_clock::now() - local_seen_at_[k] > options_.timeout) {
        fail(Status(
            ErrorCode::kTimeout,
            fmt::format("rank {}'s proxy waited more than {} ms for rank {}'s {} of "
                        "round {} (nothing of it arrived): that rank stopped, is stuck, "
                        "or is unreachable",
                        config_.rank, options_.timeout.count(), p.rank, kind_name(combine), want)));
      }
      return false;
    }
    const Counts c =
        load_counts(areas_.control.data() + layout_.counts_slot(true, combine, p.remote));
    if (c.round != want) {
      fail(Status(ErrorCode::kInternal,
                  fmt::format("rank {}'s {} counts say round {}, rank {} expected round {}", p.rank,
                              kind_name(combine), c.round, config_.rank, want)));
      return false;
    }
    if (c.value > most(combine)) {
      fail(Status(ErrorCode::kInternal,
                  fmt::format("rank {}'s {} counts of round {} announce {} {}, more than the {} "
                              "an area holds",
                              p.rank, kind_name(combine), want, c.value,
                              combine ? "rows" : "entries", most(combine))));
      return false;
    }
    p.counts[k] = c;
    p.have_counts[k] = true;
    p.counts_seen_at[k] = std::chrono::steady_clock::now();
    p.chunks[k] = chunk_count(round_bytes(a2a_, combine, c.value), options_.chunk_bytes);
  }
  const uint64_t need = p.chunks[k];
  if (need > 0 && engine_->imm_count(data_imm) < need) {
    if (std::chrono::steady_clock::now() - local_seen_at_[k] > options_.timeout &&
        reached(local_round_[k], want)) {
      fail(Status(ErrorCode::kTimeout,
                  fmt::format("rank {}'s proxy waited more than {} ms for rank {}'s {} bytes of "
                              "round {} ({} of {} chunks arrived)",
                              config_.rank, options_.timeout.count(), p.rank, kind_name(combine),
                              want, engine_->imm_count(data_imm), need)));
    }
    return false;
  }
  if (combine && !map_rows(p, want)) return false;
  if (options_.before_flag) {
    if (Status s = options_.before_flag(p.rank, combine, want); !s) {
      fail(Status(s.code(),
                  fmt::format("rank {}'s proxy, before raising rank {}'s {} flag of "
                              "round {}: {}",
                              config_.rank, p.rank, kind_name(combine), want, s.message())));
      return false;
    }
  }
  engine_->reset_imm(counts_imm);
  if (need > 0) engine_->reset_imm(data_imm);
  p.have_counts[k] = false;
  p.received[k] = want;
  store_word(areas_.control.data(),
             combine ? ProxyLayout::kCombineFlag : ProxyLayout::kDispatchFlag, p.rank,
             (static_cast<uint64_t>(want) << 32) | p.counts[k].value);
  counters_.receive_ns[k].fetch_add(elapsed_ns(p.counts_seen_at[k]), std::memory_order_relaxed);
  counters_.rounds_received[k].fetch_add(1, std::memory_order_relaxed);
  return true;
}

// `p`'s combine rows of round `round` have all arrived: the map gets each one's place, so that
// combine_recv finds the row of slot (t, k) without a search. Every id is checked: a row the map
// points at is always inside `p`'s receive area.
bool Proxy::map_rows(const Peer& p, uint32_t round) {
  const std::byte* ids = areas_.control.data() + layout_.combine_ids_recv(p.remote);
  auto* map = reinterpret_cast<uint32_t*>(areas_.control.data() + layout_.combine_map_offset);
  for (uint32_t row = 0; row < p.counts[1].value; ++row) {
    uint32_t slot = 0;
    std::memcpy(&slot, ids + 4ull * row, 4);
    if (slot >= layout_.combine_slots) {
      fail(Status(ErrorCode::kInternal,
                  fmt::format("rank {}'s combine of round {} names slot {} for its row {}: this "
                              "rank's tokens have {} slots (max_tokens_per_rank x top_k)",
                              p.rank, round, slot, row, layout_.combine_slots)));
      return false;
    }
    map[slot] = row;
  }
  return true;
}

uint32_t Proxy::most(bool combine) const {
  return combine ? layout_.combine_slots : config_.max_tokens_per_rank;
}

// This GPU has read `p`'s round (its done word moved): tell `p`, whose staging is then free.
bool Proxy::forward_acks(Peer& p, bool combine) {
  const int k = combine ? 1 : 0;
  const uint32_t done = static_cast<uint32_t>(
      load_word(areas_.control.data(),
                combine ? ProxyLayout::kCombineDone : ProxyLayout::kDispatchDone, p.rank));
  if (done == p.acks_sent[k]) return false;
  while (p.acks_sent[k] != done && !failed_.load(std::memory_order_relaxed)) {
    const uint32_t round = p.acks_sent[k] + 1;
    ImmWrite w;
    w.peer = p.control.owner();
    w.imm = encode_imm(ack_kind(combine), config_.rank, round);
    const int rank = config_.rank, to = p.rank;
    auto id = engine_->submit(
        w,
        Callbacks{{}, [this, to, combine, rank, round](const Status& s) {
                    fail(Status(s.code() == ErrorCode::kCancelled ? ErrorCode::kCancelled
                                                                  : ErrorCode::kPeerUnreachable,
                                fmt::format("rank {}'s proxy could not acknowledge rank {}'s "
                                            "{} of round {}: {}",
                                            rank, to, kind_name(combine), round, s.to_string())));
                  }});
    if (!id) {
      fail(Status(ErrorCode::kPeerUnreachable,
                  fmt::format("rank {}'s proxy could not post an acknowledgement to rank {}: {}",
                              config_.rank, p.rank, id.status().to_string())));
    }
    p.acks_sent[k] = round;
  }
  return true;
}

// `p` has read this rank's round and the writes of it have completed here: this GPU may
// overwrite the staging (its ack word moves).
bool Proxy::take_acks(Peer& p, bool combine) {
  const int k = combine ? 1 : 0;
  const uint32_t want = p.acks_taken[k] + 1;
  if (!reached(p.sent[k], want)) return false;
  if (p.sent[k] == want && p.outstanding[k].load(std::memory_order_acquire) != 0) return false;
  const uint32_t imm = encode_imm(ack_kind(combine), p.rank, want);
  if (engine_->imm_count(imm) == 0) return false;
  engine_->reset_imm(imm);
  p.acks_taken[k] = want;
  store_word(areas_.control.data(), combine ? ProxyLayout::kCombineAck : ProxyLayout::kDispatchAck,
             p.rank, want);
  return true;
}

}  // namespace fabric::ep
