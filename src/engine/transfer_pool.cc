#include "engine/transfer_pool.h"

#include <utility>

namespace fabric::engine {

void TransferRecycler::operator()(Transfer* t) const {
  if (pool != nullptr) {
    pool->give_back(t);
  } else {
    delete t;
  }
}

TransferPool::~TransferPool() {
  Transfer* t = nullptr;
  while (idle_.try_pop(t)) delete t;
}

TransferPtr TransferPool::take() {
  Transfer* t = nullptr;
  if (idle_.try_pop(t)) return TransferPtr(t, TransferRecycler{this});
  return TransferPtr(new Transfer, TransferRecycler{this});
}

void Transfer::reset() {
  // Every field back to its default, by assignment from a fresh Transfer (so a field added
  // later is reset too), the vectors a submission fills keeping their buffers.
  std::vector<Op> kept_ops = std::move(ops);
  std::vector<Op> kept_deferred = std::move(deferred);
  std::vector<RemoteMemory> kept_dsts = std::move(dsts);
  std::vector<Address> kept_peers = std::move(peers);
  Bytes kept_message = std::move(message);
  *this = Transfer{};
  kept_ops.clear();
  kept_deferred.clear();
  kept_dsts.clear();
  kept_peers.clear();
  kept_message.clear();
  ops = std::move(kept_ops);
  deferred = std::move(kept_deferred);
  dsts = std::move(kept_dsts);
  peers = std::move(kept_peers);
  message = std::move(kept_message);
}

TransferPtr TransferPool::unpooled() {
  return TransferPtr(new Transfer, TransferRecycler{});
}

void TransferPool::give_back(Transfer* t) {
  t->reset();
  if (!idle_.try_push(t)) delete t;
}

}  // namespace fabric::engine
