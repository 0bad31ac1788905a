// Shared helpers for the engine's tests: backends present on this machine, engine configs,
// callback probes that count how often they ran, and data patterns.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "fabric/fabric.h"
#include "fabric/testing.h"
#include "slowdown.h"

namespace fabric::testing {

using namespace std::chrono_literals;

struct Backend {
  std::string name;      // test-name suffix
  std::string provider;  // libfabric provider
  bool reorder;          // wrap every domain in the fault-injection (reordering) domain
};

// Names the parameter in test listings instead of dumping its bytes.
inline void PrintTo(const Backend& b, std::ostream* os) {
  *os << b.name;
}

inline std::vector<Backend> all_backends() {
  return {{"tcp", "tcp", false},
          {"tcp_reorder", "tcp", true},
          {"shm", "shm", false},
          {"shm_reorder", "shm", true},
          // The verbs backend: skipped (provider not available) where no verbs device exists;
          // run on Soft-RoCE by the rxe tests (tests/rxe).
          {"verbs", "verbs", false}};
}

inline std::string backend_name(const ::testing::TestParamInfo<Backend>& info) {
  return info.param.name;
}

// A config for tests on this machine: loopback NICs only, short idle spin (two cores).
inline Config make_config(const Backend& b, int nics = 1) {
  Config c;
  c.provider = b.provider;
  c.groups = {GroupConfig{}};
  if (b.provider == "tcp") c.groups[0].nics.assign(static_cast<size_t>(nics), "lo");
  if (b.provider == "shm") c.groups[0].nics.assign(static_cast<size_t>(nics), "shm");
  // verbs: the machine's first device with an active port, or those FABRIC_TEST_VERBS_NIC names.
  if (b.provider == "verbs") {
    const char* nic = std::getenv("FABRIC_TEST_VERBS_NIC");
    c.groups[0].nics.assign(static_cast<size_t>(nics), nic ? nic : "");
  }
  c.groups[0].cpu = GroupConfig::kCpuNone;
  c.spin_time = std::chrono::microseconds(50);
  c.idle_sleep = std::chrono::microseconds(50);
  c.faults.enabled = b.reorder;
  c.faults.seed = 12345;
  c.faults.max_hold_polls = 16;
  c.close_timeout = std::chrono::milliseconds(3000);
  c.peer_timeout = std::chrono::milliseconds(3000);
  // Soft-RoCE under qemu's emulation moves a few hundred Mbit/s: a 40 MiB work request alone
  // can take seconds there.
  if (b.provider == "verbs") c.peer_timeout = std::chrono::milliseconds(20000);
  return c;
}

// make_config with its group in caller-driven progress and the callbacks on the thread that
// drives it, as fabric::ep's proxy runs its engine.
inline Config make_caller_driven_config(const Backend& b) {
  Config c = make_config(b);
  c.groups[0].caller_progress = true;
  c.callbacks_on_worker = true;
  return c;
}

// Two engines of one config in this process (both null, with a test failure, when either does
// not open).
struct EnginePair {
  std::unique_ptr<TransferEngine> a, b;
};
inline EnginePair make_engine_pair(const Config& config) {
  auto a = TransferEngine::create(config);
  EXPECT_TRUE(a) << a.status().to_string();
  auto b = TransferEngine::create(config);
  EXPECT_TRUE(b) << b.status().to_string();
  if (!a || !b) return {};
  return {std::move(*a), std::move(*b)};
}

// What drive_write saw.
struct DrivenWrite {
  Status submitted;    // submit()'s own result
  bool done = false;   // on_done ran
  std::string failed;  // on_error's status, or empty
  uint64_t imms = 0;   // b's count of the write's immediate at the end
};
// Submits `w` (with an immediate) on `a` and drives the caller-driven engines `a` and `b` on
// this thread until the write is done and `b` counted its immediate, it failed, or `timeout`.
inline DrivenWrite drive_write(TransferEngine& a, TransferEngine& b, const SingleWrite& w,
                               std::chrono::milliseconds timeout) {
  DrivenWrite out;
  auto id = a.submit(
      w, Callbacks{[&] { out.done = true; }, [&](const Status& s) { out.failed = s.to_string(); }});
  if (!id) {
    out.submitted = id.status();
    return out;
  }
  const auto until = std::chrono::steady_clock::now() + timeout;
  while ((!out.done || b.imm_count(*w.imm) == 0) && out.failed.empty() &&
         std::chrono::steady_clock::now() < until) {
    a.progress(0);
    b.progress(0);
  }
  out.imms = b.imm_count(*w.imm);
  return out;
}

// Creates an engine or skips the test when the provider is absent here.
#define FABRIC_ENGINE_OR_SKIP(var, config)                                              \
  std::unique_ptr<::fabric::TransferEngine> var;                                        \
  {                                                                                     \
    auto created_ = ::fabric::TransferEngine::create(config);                           \
    if (!created_ && created_.status().code() == ::fabric::ErrorCode::kUnsupported) {   \
      GTEST_SKIP() << "provider not available here: " << created_.status().to_string(); \
    }                                                                                   \
    ASSERT_TRUE(created_) << created_.status().to_string();                             \
    var = std::move(*created_);                                                         \
  }

// Records how a transfer completed; fails the test if it completes twice.
class Probe {
 public:
  Callbacks callbacks() {
    auto st = state_;
    return Callbacks{[st] { st->finish(Status::ok()); }, [st](const Status& s) { st->finish(s); }};
  }
  // Waits for the completion; returns it, or a kTimeout status.
  Status wait(std::chrono::milliseconds timeout = 20s) const {
    std::unique_lock lock(state_->mu);
    if (!state_->cv.wait_for(lock, timeout, [&] { return state_->calls > 0; })) {
      return Status(ErrorCode::kTimeout, "no completion callback within the timeout");
    }
    return state_->status;
  }
  int calls() const {
    std::lock_guard lock(state_->mu);
    return state_->calls;
  }

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    int calls = 0;
    Status status;
    void finish(const Status& s) {
      {
        std::lock_guard lock(mu);
        ++calls;
        status = s;
        EXPECT_EQ(calls, 1) << "a transfer completed more than once";
      }
      cv.notify_all();
    }
  };
  std::shared_ptr<State> state_ = std::make_shared<State>();
};

// Counts callbacks of many transfers.
class Counter {
 public:
  Callbacks callbacks() {
    auto st = state_;
    return Callbacks{[st] { st->add(true, Status::ok()); },
                     [st](const Status& s) { st->add(false, s); }};
  }
  bool wait_total(int n, std::chrono::milliseconds timeout = 30s) const {
    std::unique_lock lock(state_->mu);
    return state_->cv.wait_for(lock, timeout, [&] { return state_->done + state_->failed >= n; });
  }
  int done() const {
    std::lock_guard lock(state_->mu);
    return state_->done;
  }
  int failed() const {
    std::lock_guard lock(state_->mu);
    return state_->failed;
  }
  Status first_error() const {
    std::lock_guard lock(state_->mu);
    return state_->first_error;
  }

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    int done = 0;
    int failed = 0;
    Status first_error;
    void add(bool ok, const Status& s) {
      {
        std::lock_guard lock(mu);
        if (ok) {
          ++done;
        } else {
          if (failed++ == 0) first_error = s;
          if (std::getenv("FABRIC_TEST_VERBOSE"))
            fprintf(stderr, "error: %s\n", s.to_string().c_str());
        }
      }
      cv.notify_all();
    }
  };
  std::shared_ptr<State> state_ = std::make_shared<State>();
};

// Byte i of a pattern seeded by `seed`.
inline std::byte pattern_byte(uint64_t seed, uint64_t i) {
  uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed * 0xD1B54A32D192ED03ull;
  x ^= x >> 29;
  return static_cast<std::byte>(x & 0xff);
}

inline void fill_pattern(std::byte* p, uint64_t n, uint64_t seed) {
  // Word at a time: fast enough for hundreds of MiB under sanitizers.
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed * 0xD1B54A32D192ED03ull;
    std::memcpy(p + i, &w, 8);
  }
  for (; i < n; ++i) p[i] = pattern_byte(seed, i);
}

// FNV-1a of a byte range: what the tests compare across processes.
inline uint64_t fnv1a(const std::byte* p, uint64_t n) {
  uint64_t h = 1469598103934665603ull;
  for (uint64_t i = 0; i < n; ++i) h = (h ^ static_cast<uint64_t>(p[i])) * 1099511628211ull;
  return h;
}

// Opens engines `a` with `ca` and `b` with `cb`. Returns why not when the provider is missing
// here (kUnsupported: the test skips with it), else "" (other failures fail the test).
inline std::string open_pair(const Config& ca, const Config& cb, std::unique_ptr<TransferEngine>& a,
                             std::unique_ptr<TransferEngine>& b) {
  auto ea = TransferEngine::create(ca);
  if (!ea && ea.status().code() == ErrorCode::kUnsupported) return ea.status().to_string();
  EXPECT_TRUE(ea) << ea.status().to_string();
  auto eb = TransferEngine::create(cb);
  EXPECT_TRUE(eb) << eb.status().to_string();
  if (!ea || !eb) return {};
  a = std::move(*ea);
  b = std::move(*eb);
  return {};
}

// A registered buffer, freed after the engine lets go of it.
struct Buffer {
  std::vector<std::byte> bytes;
  Registration reg;
};

inline std::unique_ptr<Buffer> make_buffer(TransferEngine& e, uint64_t n, uint32_t group = 0) {
  auto b = std::make_unique<Buffer>();
  b->bytes.assign(n == 0 ? 1 : n, std::byte{0});
  auto r = e.register_memory(b->bytes.data(), b->bytes.size(), group);
  EXPECT_TRUE(r) << r.status().to_string();
  if (r) b->reg = *r;
  return b;
}

// GPU memory on the test double (FakeDeviceBuffer: its device address faults on any direct
// access), registered with `options`; tests fill and check it through bytes().
struct DeviceBuffer {
  std::unique_ptr<FakeDeviceBuffer> memory;
  Registration reg;
  std::span<std::byte> bytes() const { return memory->contents(); }
};

inline std::unique_ptr<DeviceBuffer> make_device_buffer(TransferEngine& e, uint64_t n,
                                                        RegisterOptions options = {}) {
  auto b = std::make_unique<DeviceBuffer>();
  auto m = FakeDeviceBuffer::create(n);
  EXPECT_TRUE(m) << m.status().to_string();
  if (!m) return b;
  b->memory = std::move(*m);
  auto r = e.register_memory(b->memory->device_ptr(), n, options);
  EXPECT_TRUE(r) << r.status().to_string();
  if (r) b->reg = *r;
  return b;
}

}  // namespace fabric::testing
