// The one place a work request (Op) is filled in or moved to another NIC. It knows the two rules
// that decide where an Op lands: local NIC i writes to the peer's rail remote_rail(i, rails),
// and a write of zero bytes names the local NIC's scratch buffer (EFA wants a valid buffer even
// then). Both halves of the engine use it: the caller thread when it plans a submission, the
// worker when it sends internal messages, probes a NIC or moves work off a NIC that went down.
#pragma once

#include <cstdint>

#include "engine/plan.h"
#include "engine/transfer_state.h"

namespace fabric::engine {

// A local NIC's scratch buffer and its descriptor: the local side of every zero-byte write.
struct Scratch {
  const void* local = nullptr;
  void* desc = nullptr;
};

// What a write into `dst` from local NIC `domain` takes from the destination: the rail that faces
// the NIC (its endpoint name, base address and key). The same for every write of that NIC, so a
// paged write reads it once per NIC (fill_page), not per page.
struct RailTarget {
  const Bytes* peer = nullptr;
  uint64_t addr = 0;
  uint64_t key = 0;
};
inline RailTarget rail_target(const RemoteMemory& dst, uint32_t domain) {
  // Each accessor of a descriptor is a call (its data is private to address.cc): read once.
  const std::vector<RemoteMemory::Rail>& rails = dst.rails();
  const uint32_t rail = remote_rail(domain, rails.size());
  return {&dst.owner().nics()[rail].name, rails[rail].addr, rails[rail].key};
}

// The fields of a write that depend on its NIC and its bytes, into an op whose other fields
// (transfer, owner, dst_mem, length, immediate) are set already: a paged write's pages, copies of
// one prototype op.
inline void fill_page(Op& op, uint32_t domain, const RailTarget& rail, uint64_t offset,
                      const void* local, void* local_desc) {
  op.domain = domain;
  op.peer = rail.peer;
  op.local = local;
  op.local_desc = local_desc;
  op.remote_addr = rail.addr + offset;
  op.remote_key = rail.key;
}

// A write of `length` bytes at `local` (registered with `local_desc` on NIC `domain`) into
// region `dst`, `offset` bytes from its start, through the rail of dst's owner that faces
// `domain`. A write of zero bytes goes from `scratch`. fill_write fills `op` (default-constructed:
// a fresh element of the transfer's ops) in place, which spares a submission the copy of an Op
// into the vector.
inline void fill_write(Op& op, Transfer& t, uint32_t domain, const RemoteMemory& dst,
                       uint64_t offset, const void* local, void* local_desc, uint64_t length,
                       Scratch scratch) {
  const RailTarget rail = rail_target(dst, domain);
  op.transfer = &t;
  op.domain = domain;
  op.peer = rail.peer;
  op.owner = &dst.owner();
  op.dst_mem = &dst;
  op.length = length;
  op.local = length == 0 ? scratch.local : local;
  op.local_desc = length == 0 ? scratch.desc : local_desc;
  op.remote_addr = rail.addr + offset;
  op.remote_key = rail.key;
}

inline Op write_op(Transfer& t, uint32_t domain, const RemoteMemory& dst, uint64_t offset,
                   const void* local, void* local_desc, uint64_t length, Scratch scratch) {
  Op op;
  fill_write(op, t, domain, dst, offset, local, local_desc, length, scratch);
  return op;
}

// A zero-byte write from `scratch` into the scratch buffer of `peer`'s NIC `nic` (immediates
// with no data, NIC probes, isolation checks).
inline Op scratch_op(Transfer& t, uint32_t domain, const Address& peer, const NicAddress& nic,
                     Scratch scratch) {
  Op op;
  op.transfer = &t;
  op.domain = domain;
  op.peer = &nic.name;
  op.owner = &peer;
  op.length = 0;
  op.local = scratch.local;
  op.local_desc = scratch.desc;
  op.remote_addr = nic.scratch_addr;
  op.remote_key = nic.scratch_key;
  return op;
}

// The same, into the scratch buffer of the peer's rail that faces `domain`.
inline Op scratch_op(Transfer& t, uint32_t domain, const Address& peer, Scratch scratch) {
  return scratch_op(t, domain, peer, peer.nics()[remote_rail(domain, peer.num_nics())], scratch);
}

// A two-sided send of `message` (kept alive by the transfer) to `peer`'s rail facing `domain`.
// Its send buffer, and that buffer's descriptor, are taken when it is posted.
inline Op send_op(Transfer& t, uint32_t domain, const Address& peer, const Bytes& message) {
  Op op;
  op.transfer = &t;
  op.kind = Op::Kind::kSend;
  op.domain = domain;
  op.owner = &peer;
  op.peer = &peer.nics()[remote_rail(domain, peer.num_nics())].name;
  op.message = &message;
  op.length = message.size();
  return op;
}

// Moves `op` to local NIC `to` (failover): the peer's rail facing `to`, the same bytes of the
// destination region on that rail, and the local buffer's registration on `to` (`scratch` is
// `to`'s, for zero-byte writes). A send keeps its message; a Commit it carries follows it.
inline void retarget(Op& op, uint32_t to, Scratch scratch) {
  if (to == op.domain) return;
  const Address& owner = *op.owner;
  if (op.kind == Op::Kind::kSend) {
    op.peer = &owner.nics()[remote_rail(to, owner.num_nics())].name;
    op.domain = to;
    if (op.commit != nullptr) op.commit->domain = to;
    return;
  }
  if (op.dst_mem != nullptr) {
    const auto& rails = op.dst_mem->rails();
    const uint32_t from = remote_rail(op.domain, rails.size());
    const uint32_t rail = remote_rail(to, rails.size());
    op.remote_addr = op.remote_addr - rails[from].addr + rails[rail].addr;
    op.remote_key = rails[rail].key;
    op.peer = &op.dst_mem->owner().nics()[rail].name;
  } else {
    const NicAddress& nic = owner.nics()[remote_rail(to, owner.num_nics())];
    op.remote_addr = nic.scratch_addr;
    op.remote_key = nic.scratch_key;
    op.peer = &nic.name;
  }
  if (op.length == 0) {
    op.local = scratch.local;
    op.local_desc = scratch.desc;
  } else {
    op.local_desc = op.transfer->src->regs[to]->local_desc();
  }
  op.domain = to;
}

}  // namespace fabric::engine
