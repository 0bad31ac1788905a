// The worker's accepted transfers, by id, from start to end. Adopting and retiring one takes no
// heap once warm (common/recycling_map.h keeps the table's nodes), and a retired transfer goes
// back to its pool (transfer_pool.h) through its pointer's deleter. Worker thread only.
#pragma once

#include <cstddef>

#include "common/recycling_map.h"
#include "engine/transfer_pool.h"

namespace fabric::engine {

class LiveTransfers {
 public:
  explicit LiveTransfers(size_t expected) : map_(expected) {}

  // Takes ownership; the transfer stays where it is until retired.
  Transfer& adopt(TransferPtr t) {
    Transfer& ref = *t;
    map_.put(ref.id, std::move(t));
    return ref;
  }

  // The live transfer `id`, or null (ended, or never here).
  Transfer* find(TransferId id) const {
    auto it = map_.find(id);
    return it == map_.end() ? nullptr : it->second.get();
  }

  // Ends `id`'s life here: the transfer goes back to its pool (references to it dangle).
  void retire(TransferId id) { map_.erase(id); }

  template <typename F>
  void for_each(F&& f) const {
    for (const auto& [id, t] : map_) f(*t);
  }
  void clear() { map_.clear(); }
  size_t size() const { return map_.size(); }

 private:
  RecyclingMap<TransferId, TransferPtr> map_;
};

}  // namespace fabric::engine
