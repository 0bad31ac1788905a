// An unordered map that keeps the nodes of erased entries (C++17 node handles) and reuses them
// for the next insertions: once it has held its most entries, inserting and erasing take
// nothing from the heap (the buckets are reserved up front). For tables on a hot path whose
// entries come and go per operation: the worker's live transfers, the shm domain's pending
// writes. Not thread-safe.
#pragma once

#include <cstddef>
#include <iterator>
#include <unordered_map>
#include <utility>
#include <vector>

namespace fabric {

template <typename K, typename V>
class RecyclingMap {
  using Map = std::unordered_map<K, V>;

 public:
  using iterator = typename Map::iterator;
  using const_iterator = typename Map::const_iterator;

  // Buckets for `expected` entries, and at most that many nodes kept.
  explicit RecyclingMap(size_t expected) {
    map_.reserve(expected);
    spare_.reserve(expected);
  }

  // Inserts or replaces `key`'s value (one hash lookup either way).
  V& put(const K& key, V value) {
    if (spare_.empty()) {
      auto [it, inserted] = map_.try_emplace(key, std::move(value));  // takes nothing if present
      if (!inserted) it->second = std::move(value);
      return it->second;
    }
    typename Map::node_type node = std::move(spare_.back());
    spare_.pop_back();
    node.key() = key;
    node.mapped() = std::move(value);
    auto r = map_.insert(std::move(node));
    if (!r.inserted) {  // `key` was there: its value is replaced, the node goes back
      r.position->second = std::move(r.node.mapped());
      keep(std::move(r.node));
    }
    return r.position->second;
  }

  iterator find(const K& key) { return map_.find(key); }
  const_iterator find(const K& key) const { return map_.find(key); }
  iterator begin() { return map_.begin(); }
  iterator end() { return map_.end(); }
  const_iterator begin() const { return map_.begin(); }
  const_iterator end() const { return map_.end(); }
  size_t size() const { return map_.size(); }
  bool empty() const { return map_.empty(); }

  // Erases the entry at `it` (its value is destroyed here, by assignment of a fresh one) and
  // returns the one after it.
  iterator erase(iterator it) {
    iterator next = std::next(it);
    keep(map_.extract(it));
    return next;
  }
  // Erases `key`'s entry; false when there is none.
  bool erase(const K& key) {
    typename Map::node_type node = map_.extract(key);
    if (node.empty()) return false;
    keep(std::move(node));
    return true;
  }
  void clear() {
    map_.clear();
    spare_.clear();
  }

 private:
  void keep(typename Map::node_type node) {
    node.mapped() = V{};
    if (spare_.size() < spare_.capacity()) spare_.push_back(std::move(node));
  }

  Map map_;
  std::vector<typename Map::node_type> spare_;  // capacity: the most kept
};

}  // namespace fabric
