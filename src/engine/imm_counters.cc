#include "engine/imm_counters.h"

#include <fmt/format.h>

#include <bit>
#include <thread>

namespace fabric::engine {

namespace {
size_t slot_count(size_t wanted) {
  return std::bit_ceil(std::max<size_t>(wanted, 64));
}
}  // namespace

ImmCounters::ImmCounters(size_t slots)
    : mask_(slot_count(slots) - 1), slots_(std::make_unique<Slot[]>(mask_ + 1)) {}

ImmCounters::~ImmCounters() = default;

ImmCounters::Slot* ImmCounters::find(uint32_t imm) const {
  const uint64_t key = uint64_t{imm} + 1;
  size_t i = static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> 20) & mask_;
  for (size_t probe = 0; probe < kMaxProbes && probe <= mask_; ++probe, i = (i + 1) & mask_) {
    const uint64_t k = slots_[i].key.load(std::memory_order_acquire);
    if (k == key) return &slots_[i];
    // Keys are never freed: a free slot in the probe run means `imm` was never added, here or
    // in the overflow map (which takes only immediates whose whole run was taken).
    if (k == 0) return nullptr;
  }
  std::lock_guard lock(overflow_mu_);
  auto it = overflow_.find(imm);
  return it == overflow_.end() ? nullptr : it->second.get();
}

ImmCounters::Slot* ImmCounters::find_or_add(uint32_t imm) const {
  const uint64_t key = uint64_t{imm} + 1;
  size_t i = static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> 20) & mask_;
  for (size_t probe = 0; probe < kMaxProbes && probe <= mask_; ++probe, i = (i + 1) & mask_) {
    uint64_t k = slots_[i].key.load(std::memory_order_acquire);
    if (k == 0 && slots_[i].key.compare_exchange_strong(k, key, std::memory_order_acq_rel)) {
      return &slots_[i];
    }
    if (k == key) return &slots_[i];  // ours, or another thread added it first
  }
  std::lock_guard lock(overflow_mu_);
  std::unique_ptr<Slot>& s = overflow_[imm];
  if (!s) {
    s = std::make_unique<Slot>();
    s->key.store(key);
  }
  return s.get();
}

void ImmCounters::try_fire(Slot& s, std::vector<Callback>& due) {
  uint64_t st = s.state.load();
  if (phase_of(st) != kPending || s.arrived.load() < target_of(st)) return;
  if (!s.state.compare_exchange_strong(st, make_state(target_of(st), kFiring))) return;
  due.push_back(std::move(s.callback));
  s.callback = nullptr;
  s.claimed.store(target_of(st));
  s.state.store(make_state(0, kIdle));
}

uint64_t ImmCounters::settled_state(const Slot& s) {
  uint64_t st = s.state.load();
  while (phase_of(st) == kFiring) {
    std::this_thread::yield();
    st = s.state.load();
  }
  return st;
}

void ImmCounters::arrive(std::span<const uint32_t> imms, std::vector<Callback>& due,
                         std::vector<uint32_t>& unexpected) {
  if (imms.empty()) return;
  total_.fetch_add(imms.size(), std::memory_order_relaxed);
  for (uint32_t imm : imms) {
    Slot& s = *find_or_add(imm);
    s.arrived.fetch_add(1);  // sequentially consistent: pairs with expect()'s store and load
    if (phase_of(s.state.load()) != kPending) {
      unexpected.push_back(imm);
      continue;
    }
    try_fire(s, due);
  }
  if (waiters_.load() > 0) {
    { std::lock_guard lock(wait_mu_); }  // a waiter between its check and its sleep sees us
    cv_.notify_all();
  }
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
  std::lock_guard lock(user_mu_);
  Slot& s = *find_or_add(imm);
  const uint64_t st = settled_state(s);
  if (phase_of(st) == kPending) {
    return Status(ErrorCode::kAlreadyExists,
                  fmt::format("immediate {} already has a pending expectation of {} arrivals", imm,
                              target_of(st) - s.claimed.load()));
  }
  s.callback = std::move(cb);  // idle: no arrival touches the callback
  s.state.store(make_state(s.claimed.load() + count, kPending));
  try_fire(s, due);  // met already, or by an arrival that saw the slot idle
  return Status::ok();
}

Status ImmCounters::cancel(uint32_t imm) {
  std::lock_guard lock(user_mu_);
  Slot* s = find(imm);
  uint64_t st = s == nullptr ? 0 : settled_state(*s);
  if (s == nullptr || phase_of(st) != kPending ||
      !s->state.compare_exchange_strong(st, make_state(0, kIdle))) {
    // Not pending, or fired between the look and the exchange.
    return Status(ErrorCode::kNotFound,
                  fmt::format("immediate {} has no pending expectation", imm));
  }
  s->callback = nullptr;
  return Status::ok();
}

uint64_t ImmCounters::count(uint32_t imm) const {
  const Slot* s = find(imm);
  return s == nullptr ? 0 : s->arrived.load(std::memory_order_acquire);
}

bool ImmCounters::wait(uint32_t imm, uint64_t total, std::chrono::milliseconds timeout) const {
  const Slot& s = *find_or_add(imm);
  auto reached = [&] { return s.arrived.load() >= total; };
  if (reached()) return true;
  const auto start = std::chrono::steady_clock::now();
  if (wait_spin_.count() > 0) {
    const auto spin_until = start + std::min<std::chrono::microseconds>(wait_spin_, timeout);
    while (std::chrono::steady_clock::now() < spin_until) {
      if (reached()) return true;
    }
  }
  const auto left = timeout - std::chrono::duration_cast<std::chrono::milliseconds>(
                                  std::chrono::steady_clock::now() - start);
  waiters_.fetch_add(1);
  bool ok = false;
  {
    std::unique_lock lock(wait_mu_);
    ok = cv_.wait_for(lock, std::max(left, std::chrono::milliseconds(0)), reached);
  }
  waiters_.fetch_sub(1);
  return ok;
}

void ImmCounters::reset(uint32_t imm) {
  std::lock_guard lock(user_mu_);
  Slot* s = find(imm);
  if (s == nullptr) return;
  uint64_t st = settled_state(*s);
  // A pending expectation goes with the counts (an arrival firing it meanwhile wins instead).
  if (phase_of(st) == kPending && s->state.compare_exchange_strong(st, make_state(0, kIdle))) {
    s->callback = nullptr;
  }
  settled_state(*s);
  s->arrived.store(0);
  s->claimed.store(0);
}

template <typename F>
void ImmCounters::for_each_slot(F&& f) {
  for (size_t i = 0; i <= mask_; ++i) {
    if (slots_[i].key.load() != 0) f(slots_[i]);
  }
  std::lock_guard lock(overflow_mu_);
  for (auto& [imm, s] : overflow_) f(*s);
}

size_t ImmCounters::clear_expectations() {
  std::lock_guard lock(user_mu_);
  size_t n = 0;
  for_each_slot([&n](Slot& s) {
    uint64_t st = settled_state(s);
    if (phase_of(st) == kPending && s.state.compare_exchange_strong(st, make_state(0, kIdle))) {
      s.callback = nullptr;
      ++n;
    }
  });
  return n;
}

}  // namespace fabric::engine
