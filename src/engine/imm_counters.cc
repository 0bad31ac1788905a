#include "engine/imm_counters.h"

#include <fmt/format.h>

namespace fabric::engine {

void ImmCounters::check(Entry& e, std::vector<Callback>& due) {
  if (e.expected != 0 && e.arrived - e.claimed >= e.expected) {
    e.claimed += e.expected;
    e.expected = 0;
    due.push_back(std::move(e.callback));
    e.callback = nullptr;
  }
}

void ImmCounters::arrive(std::span<const uint32_t> imms, std::vector<Callback>& due,
                         std::vector<uint32_t>& unexpected) {
  if (imms.empty()) return;
  total_.fetch_add(imms.size(), std::memory_order_relaxed);
  bool notify = false;
  {
    std::lock_guard lock(mu_);
    for (uint32_t imm : imms) {
      Entry& e = entries_[imm];
      ++e.arrived;
      if (e.expected == 0) unexpected.push_back(imm);
      check(e, due);
    }
    notify = waiters_ > 0;
  }
  if (notify) cv_.notify_all();
}

Status ImmCounters::expect(uint32_t imm, uint64_t count, Callback cb, std::vector<Callback>& due) {
  if (count == 0) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("expect_imm({}): count must be at least 1", imm));
  }
  if (!cb) {
    return Status(
        ErrorCode::kInvalidArgument,
        fmt::format("expect_imm({}): the callback is empty (wait_imm blocks instead)", imm));
  }
  std::lock_guard lock(mu_);
  Entry& e = entries_[imm];
  if (e.expected != 0) {
    return Status(ErrorCode::kAlreadyExists,
                  fmt::format("immediate {} already has a pending expectation of {} arrivals", imm,
                              e.expected));
  }
  e.expected = count;
  e.callback = std::move(cb);
  check(e, due);
  return Status::ok();
}

Status ImmCounters::cancel(uint32_t imm) {
  std::lock_guard lock(mu_);
  auto it = entries_.find(imm);
  if (it == entries_.end() || it->second.expected == 0) {
    return Status(ErrorCode::kNotFound,
                  fmt::format("immediate {} has no pending expectation", imm));
  }
  it->second.expected = 0;
  it->second.callback = nullptr;
  return Status::ok();
}

uint64_t ImmCounters::count(uint32_t imm) const {
  std::lock_guard lock(mu_);
  auto it = entries_.find(imm);
  return it == entries_.end() ? 0 : it->second.arrived;
}

bool ImmCounters::wait(uint32_t imm, uint64_t total, std::chrono::milliseconds timeout) const {
  auto reached = [&] {
    auto it = entries_.find(imm);
    return (it == entries_.end() ? 0 : it->second.arrived) >= total;
  };
  const auto start = std::chrono::steady_clock::now();
  std::unique_lock lock(mu_);
  if (reached()) return true;
  if (wait_spin_.count() > 0) {
    // Look again only when some arrival was recorded (total_ moves before the lock is taken).
    uint64_t seen = total_.load(std::memory_order_acquire);
    const auto spin_until = start + std::min<std::chrono::microseconds>(wait_spin_, timeout);
    lock.unlock();
    while (std::chrono::steady_clock::now() < spin_until) {
      const uint64_t now_total = total_.load(std::memory_order_acquire);
      if (now_total == seen) continue;
      seen = now_total;
      lock.lock();
      if (reached()) return true;
      lock.unlock();
    }
    lock.lock();
  }
  const auto left = timeout - std::chrono::duration_cast<std::chrono::milliseconds>(
                                  std::chrono::steady_clock::now() - start);
  ++waiters_;
  bool ok = cv_.wait_for(lock, std::max(left, std::chrono::milliseconds(0)), reached);
  --waiters_;
  return ok;
}

void ImmCounters::reset(uint32_t imm) {
  std::lock_guard lock(mu_);
  entries_.erase(imm);
}

size_t ImmCounters::clear_expectations() {
  std::lock_guard lock(mu_);
  size_t n = 0;
  for (auto& [imm, e] : entries_) {
    if (e.expected != 0) ++n;
    e.expected = 0;
    e.callback = nullptr;
  }
  return n;
}

}  // namespace fabric::engine
