// fabric::ep's kernels as the host sets them up (ep/params.h): their parameters, the routes to
// every peer rank, the scratch's layout and the error report's reading. No CUDA: built and
// unit-tested everywhere.
#include "ep/params.h"

#include <fmt/format.h>

#include <chrono>
#include <iterator>

#include "common/align.h"

namespace fabric::ep {

static_assert(device::kMaxRanks == kMaxRanks && device::kMaxTopK == kMaxTopK &&
              device::kMaxLocalExperts == kMaxLocalExperts);
// Kernel parameters are limited to 4 KiB (Params is passed by value to every launch).
static_assert(sizeof(device::Params) <= 4096);

namespace {

// A half as errors name it (device::Half order), and what its wait waits for.
struct HalfText {
  const char* name;
  const char* awaited;
};
constexpr HalfText kHalves[] = {
    {"dispatch_send", "acknowledgement of the previous round's dispatch"},
    {"dispatch_recv", "dispatched tokens"},
    {"combine_send", "acknowledgement of the previous round's combine"},
    {"combine_recv", "expert outputs"},
};
static_assert(device::kDispatchSend == 0 && device::kDispatchRecv == 1 &&
              device::kCombineSend == 2 && device::kCombineRecv == 3);

HalfText half_text(uint32_t half) {
  return half < std::size(kHalves) ? kHalves[half] : HalfText{"an unknown half", "signal"};
}

int per_node(const AllToAllConfig& c) {
  return c.gpus_per_node == 0 ? c.world_size : c.gpus_per_node;
}

}  // namespace

ScratchLayout ScratchLayout::of(const Layout& layout) {
  ScratchLayout s;
  s.rows_offset = round_up(sizeof(device::State), 256);
  s.experts_offset = s.rows_offset + layout.max_recv_rows * sizeof(device::RowSource);
  s.bytes = s.experts_offset + 2ull * layout.num_local_experts * sizeof(uint32_t);
  return s;
}

device::Params kernel_params(const AllToAllConfig& config, const Layout& layout,
                             const ProxyLayout& proxy_layout, const KernelMemory& memory,
                             uint32_t num_sms) {
  device::Params p{};
  p.rank = config.rank;
  p.world = config.world_size;
  p.num_experts = config.num_experts;
  p.num_local_experts = layout.num_local_experts;
  p.hidden = config.hidden;
  p.top_k = config.top_k;
  p.scale_columns = layout.scale_columns;
  p.num_sms = num_sms;
  p.token_bytes = layout.token_bytes;
  p.entry_bytes = layout.entry_bytes;
  p.entry_token_offset = layout.entry_token_offset;
  p.entry_scale_offset = layout.entry_scale_offset;
  p.max_recv_rows = layout.max_recv_rows;
  p.timeout_ns = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(config.timeout).count());
  if (memory.scratch != nullptr) {
    const ScratchLayout s = ScratchLayout::of(layout);
    p.state = reinterpret_cast<device::State*>(memory.scratch);
    p.rows = reinterpret_cast<device::RowSource*>(memory.scratch + s.rows_offset);
    p.expert_offset = reinterpret_cast<uint32_t*>(memory.scratch + s.experts_offset);
    p.expert_cursor = p.expert_offset + layout.num_local_experts;
  }
  p.report = memory.report;
  p.remote_mask = 0;
  for (int r = 0; r < config.world_size; ++r) {
    if (on_other_nodes(config.rank, r, per_node(config))) p.remote_mask |= 1u << r;
  }
  p.combine_map = memory.proxy_control == nullptr
                      ? nullptr
                      : reinterpret_cast<const uint32_t*>(memory.proxy_control +
                                                          proxy_layout.combine_map_offset);
  return p;
}

namespace {

// Rank r of this node: its buffer as mapped here (`theirs`) and this rank's own.
void route_local(device::Params& p, const Layout& layout, int me, int r, uint8_t* own_buffer,
                 uint8_t* theirs) {
  auto* const own = reinterpret_cast<device::Signals*>(own_buffer);
  auto* const sig = reinterpret_cast<device::Signals*>(theirs);
  p.dispatch_dst[r] = theirs + layout.dispatch_entry(me, 0);
  p.dispatch_flag_out[r] = &sig->dispatch_flag[me];
  p.dispatch_src[r] = own_buffer + layout.dispatch_entry(r, 0);
  p.dispatch_flag_in[r] = &own->dispatch_flag[r];
  p.dispatch_ack_out[r] = &sig->dispatch_ack[me];
  p.dispatch_ack_in[r] = &own->dispatch_ack[r];
  p.combine_dst[r] = theirs + layout.combine_offset;
  p.combine_flag_out[r] = &sig->combine_flag[me];
  p.combine_src[r] = own_buffer + layout.combine_offset;
  p.combine_flag_in[r] = &own->combine_flag[r];
  p.combine_ack_out[r] = &sig->combine_ack[me];
  p.combine_ack_in[r] = &own->combine_ack[r];
}

// Rank r of another node, this rank's remote peer `i`: the proxy's areas and words for it.
void route_remote(device::Params& p, const ProxyLayout& pl, int r, int i, uint8_t* control,
                  uint8_t* data) {
  auto word = [&](ProxyLayout::Word w) {
    return reinterpret_cast<uint64_t*>(control + ProxyLayout::word_offset(w, r));
  };
  p.dispatch_dst[r] = data + pl.dispatch_send(i);
  p.dispatch_flag_out[r] = word(ProxyLayout::kDispatchReady);
  p.dispatch_src[r] = data + pl.dispatch_recv(i);
  p.dispatch_flag_in[r] = word(ProxyLayout::kDispatchFlag);
  p.dispatch_ack_out[r] = word(ProxyLayout::kDispatchDone);
  p.dispatch_ack_in[r] = word(ProxyLayout::kDispatchAck);
  p.combine_dst[r] = data + pl.combine_send(i);
  p.combine_ids_dst[r] = reinterpret_cast<uint32_t*>(control + pl.combine_ids_send(i));
  p.combine_flag_out[r] = word(ProxyLayout::kCombineReady);
  p.combine_src[r] = data + pl.combine_recv(i);
  p.combine_flag_in[r] = word(ProxyLayout::kCombineFlag);
  p.combine_ack_out[r] = word(ProxyLayout::kCombineDone);
  p.combine_ack_in[r] = word(ProxyLayout::kCombineAck);
}

}  // namespace

void route_peers(device::Params& params, const AllToAllConfig& config, const Layout& layout,
                 const ProxyLayout& proxy_layout, const KernelMemory& memory) {
  const int me = config.rank;
  for (int r = 0; r < config.world_size; ++r) {
    if (on_other_nodes(me, r, per_node(config))) {
      if (memory.proxy_control == nullptr || memory.proxy_data == nullptr) continue;
      route_remote(params, proxy_layout, r, remote_index(me, r, per_node(config)),
                   memory.proxy_control, memory.proxy_data);
      continue;
    }
    uint8_t* const theirs =
        r == me ? memory.buffer
                : (static_cast<size_t>(r) < memory.peers.size() ? memory.peers[r] : nullptr);
    if (memory.buffer == nullptr || theirs == nullptr) continue;
    route_local(params, layout, me, r, memory.buffer, theirs);
  }
}

Status gpu_failure(const device::ErrorReport& r, const AllToAllConfig& config) {
  if (r.kind == device::kNoError) return Status::ok();
  if (r.kind == device::kTimedOut) {
    const uint32_t shift =
        r.half == device::kDispatchRecv || r.half == device::kCombineRecv ? 32 : 0;
    return Status(
        ErrorCode::kTimeout,
        fmt::format("{} on rank {} waited more than {} ms for rank {}'s {} of round {} (its "
                    "signal is at round {}): that rank stopped, is stuck, or calls the "
                    "halves out of step; this all-to-all cannot be used again",
                    half_text(r.half).name, config.rank, config.timeout.count(), r.peer,
                    half_text(r.half).awaited, r.round, static_cast<uint32_t>(r.seen >> shift)));
  }
  if (r.kind == device::kBadExpert) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("{} on rank {}, round {}: expert index {} of token {}, top-k "
                              "slot {} is not below num_experts {} (the pair was dropped); "
                              "this all-to-all cannot be used again",
                              half_text(r.half).name, config.rank, r.round,
                              static_cast<int64_t>(r.seen), r.peer, r.detail, config.num_experts));
  }
  return Status(ErrorCode::kInternal, fmt::format("unknown GPU error kind {}", r.kind));
}

}  // namespace fabric::ep
