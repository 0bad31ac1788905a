#include "peer.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

namespace fabric::bench {

namespace {

void reply(const std::string& line) {
  std::fputs(line.c_str(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

// Whom a peer answers, and with what. Set by the command loop, read by the engine's callback
// thread (the unexpected-immediate handler).
class Answerer {
 public:
  void set_client(Address a) {
    std::lock_guard lock(mu_);
    client_ = std::move(a);
  }
  void set(uint32_t in, uint32_t out) {
    std::lock_guard lock(mu_);
    in_ = in;
    out_ = out;
  }
  // The answer to an arrival of `imm`, if it gets one.
  std::optional<ImmWrite> answer_to(uint32_t imm) const {
    std::lock_guard lock(mu_);
    if (in_ == 0 || imm != in_ || client_.empty()) return std::nullopt;
    ImmWrite w;
    w.peer = client_;
    w.imm = out_;
    return w;
  }

 private:
  mutable std::mutex mu_;
  Address client_;
  uint32_t in_ = 0;
  uint32_t out_ = 0;
};

}  // namespace

int run_peer(const Config& config) {
  // Declared before the engine, so that they outlive it (its callbacks use the answerer).
  PageBuffer buf;
  PageBuffer src_buf;  // what the client reads (`source`)
  Answerer answerer;
  auto created = TransferEngine::create(config);
  if (!created) {
    reply("error " + created.status().to_string());
    return 1;
  }
  TransferEngine& engine = **created;
  engine.set_unexpected_imm_handler([&engine, &answerer](uint32_t imm) {
    std::optional<ImmWrite> w = answerer.answer_to(imm);
    if (!w) return;
    auto id =
        engine.submit(*w, Callbacks{nullptr, [](const Status& s) {
                                      spdlog::warn("peer: an answer failed: {}", s.to_string());
                                    }});
    if (!id) spdlog::warn("peer: cannot answer: {}", id.status().to_string());
  });
  std::optional<Registration> reg;
  std::optional<Registration> src_reg;
  // A caller-driven group (--mode progress): a thread of the peer's drives it until quit;
  // the command loop's blocking calls drive it too while they wait (one at a time).
  std::atomic<bool> quit{false};
  // Set by `serving 1` around the client's read passes: the driver never naps then.
  std::atomic<bool> serving{false};
  std::thread driver;
  if (config.groups[0].caller_progress) {
    driver = std::thread([&] {
      // Spins while there is work; after 2 ms without any it naps 100 us between passes, after
      // 50 ms 2 ms, so that an idle peer leaves the cores to the baselines run between our
      // passes (their first work request waits for the nap to end: warm-up absorbs it).
      // While serving reads it spins: a read makes no completion at its owner, so progress()
      // may report nothing while it answers one, and a nap would hold up every read.
      auto last_work = std::chrono::steady_clock::now();
      while (!quit.load(std::memory_order_relaxed)) {
        if (engine.progress(0) || serving.load(std::memory_order_relaxed)) {
          last_work = std::chrono::steady_clock::now();
          continue;
        }
        const auto idle = std::chrono::steady_clock::now() - last_work;
        if (idle > std::chrono::milliseconds(50)) {
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
        } else if (idle > std::chrono::milliseconds(2)) {
          std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
      }
    });
  }
  reply("address " + engine.address().to_hex());
  reply("ready");

  auto in_buffer = [&](uint64_t off, uint64_t len) {
    return off <= buf.size() && len <= buf.size() - off;
  };
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "alloc") {
      uint64_t bytes = 0;
      in >> bytes;
      if (!in || bytes == 0) {
        reply("error usage: alloc BYTES");
        continue;
      }
      if (reg) {
        if (Status s = engine.unregister_memory(reg->handle); !s) {
          reply("error " + s.to_string());
          continue;
        }
        reg.reset();
      }
      buf = PageBuffer();  // the old buffer goes before the new one comes
      buf = PageBuffer(bytes);
      if (buf.data() == nullptr) {
        reply(fmt::format("error cannot allocate {} bytes", bytes));
        continue;
      }
      std::memset(buf.data(), static_cast<int>(kPoison), buf.size());
      auto r = engine.register_memory(buf.data(), buf.size());
      if (!r) {
        reply("error " + r.status().to_string());
        continue;
      }
      reg = *r;
      reply("memory " + to_hex(reg->descriptor.encode()));
    } else if (cmd == "source") {
      uint64_t bytes = 0, seed = 0;
      in >> bytes >> seed;
      if (!in || bytes == 0) {
        reply("error usage: source BYTES SEED");
        continue;
      }
      if (src_reg) {
        if (Status s = engine.unregister_memory(src_reg->handle); !s) {
          reply("error " + s.to_string());
          continue;
        }
        src_reg.reset();
      }
      src_buf = PageBuffer();
      src_buf = PageBuffer(bytes);
      if (src_buf.data() == nullptr) {
        reply(fmt::format("error cannot allocate {} bytes", bytes));
        continue;
      }
      fill_pattern(src_buf.data(), src_buf.size(), seed);
      RegisterOptions options;
      options.remote_read = true;
      auto r = engine.register_memory(src_buf.data(), src_buf.size(), options);
      if (!r) {
        reply("error " + r.status().to_string());
        continue;
      }
      src_reg = *r;
      reply(fmt::format("source {} {:016x}", to_hex(src_reg->descriptor.encode()),
                        hash_bytes(src_buf.data(), src_buf.size())));
    } else if (cmd == "poison") {
      uint64_t off = 0, len = 0;
      in >> off >> len;
      if (!in || !in_buffer(off, len)) {
        reply(fmt::format("error poison range outside the {}-byte buffer", buf.size()));
        continue;
      }
      std::memset(buf.data() + off, static_cast<int>(kPoison), len);
      reply("ok");
    } else if (cmd == "hash") {
      uint64_t len = 0, first = 0, step = 0, count = 0;
      in >> len >> first >> step >> count;
      uint64_t last = 0;
      const bool fits = in && count > 0 && !__builtin_mul_overflow(count - 1, step, &last) &&
                        !__builtin_add_overflow(last, first, &last) && in_buffer(last, len) &&
                        first <= last;
      if (!fits) {
        reply(fmt::format("error hash ranges outside the {}-byte buffer", buf.size()));
        continue;
      }
      reply(fmt::format("hash {:016x}", hash_ranges(buf.data(), len, first, step, count)));
    } else if (cmd == "client") {
      std::string hex;
      in >> hex;
      auto a = Address::from_hex(hex);
      if (!a) {
        reply("error " + a.status().to_string());
        continue;
      }
      answerer.set_client(*a);
      reply("ok");
    } else if (cmd == "answer") {
      uint32_t from = 0, to = 0;
      in >> from >> to;
      if (!in) {
        reply("error usage: answer IN OUT");
        continue;
      }
      answerer.set(from, to);
      reply("ok");
    } else if (cmd == "expect") {
      uint32_t imm = 0;
      uint64_t count = 0, timeout_ms = 0;
      in >> imm >> count >> timeout_ms;
      if (!in) {
        reply("error usage: expect IMM COUNT TIMEOUT_MS");
        continue;
      }
      bool reached = engine.wait_imm(imm, count, milliseconds(timeout_ms));
      reply(fmt::format("{} {} {}", reached ? "got" : "timeout", imm, engine.imm_count(imm)));
    } else if (cmd == "serving") {
      int on = 0;
      in >> on;
      if (!in) {
        reply("error usage: serving 0|1");
        continue;
      }
      serving.store(on != 0);
      reply("ok");
    } else if (cmd == "cpu") {
      reply(fmt::format("cpu {:.6f}", cpu_seconds()));
    } else if (cmd == "quit") {
      break;
    } else if (!cmd.empty()) {
      reply(fmt::format("error unknown command '{}'", cmd));
    }
  }
  answerer.set(0, 0);
  quit.store(true);
  if (driver.joinable()) driver.join();
  engine.close();
  return 0;
}

// --- the client side ---------------------------------------------------------------------------

Result<std::unique_ptr<PeerClient>> PeerClient::start(const std::string& path,
                                                      const std::vector<std::string>& args,
                                                      const Address& client) {
  auto process = ChildProcess::spawn(path, args);
  if (!process) return process.status();
  std::unique_ptr<PeerClient> p(new PeerClient(std::move(*process)));
  auto first = p->process_->read_line(kReplyTimeout);
  if (!first) return first.status();
  if (first->rfind("address ", 0) != 0) {
    return Status(ErrorCode::kInternal, fmt::format("the peer did not start: '{}'", *first));
  }
  auto address = Address::from_hex(first->substr(8));
  if (!address) return address.status();
  p->address_ = *address;
  auto ready = p->process_->read_line(kReplyTimeout);
  if (!ready) return ready.status();
  if (*ready != "ready") {
    return Status(ErrorCode::kInternal, fmt::format("expected 'ready', got '{}'", *ready));
  }
  if (auto r = p->request("client " + client.to_hex()); !r) return r.status();
  return p;
}

Status PeerClient::ensure_buffer(uint64_t bytes) {
  if (!memory_.empty() && memory_bytes_ >= bytes && memory_bytes_ / 4 <= bytes) {
    return Status::ok();
  }
  auto r = request(fmt::format("alloc {}", bytes));
  if (!r) return r.status();
  if (r->rfind("memory ", 0) != 0) {
    return Status(ErrorCode::kInternal, fmt::format("unexpected peer reply '{}'", *r));
  }
  auto bytes_hex = from_hex(r->substr(7));
  if (!bytes_hex) return bytes_hex.status();
  auto m = RemoteMemory::decode(*bytes_hex);
  if (!m) return m.status();
  memory_ = *m;
  memory_bytes_ = bytes;
  return Status::ok();
}

Status PeerClient::ensure_source(uint64_t bytes, uint64_t seed) {
  if (!source_.empty() && source_bytes_ == bytes && source_seed_ == seed) return Status::ok();
  auto r = request(fmt::format("source {} {}", bytes, seed));
  if (!r) return r.status();
  std::istringstream words(*r);
  std::string word, hex, hash;
  words >> word >> hex >> hash;
  unsigned long long h = 0;
  if (word != "source" || std::sscanf(hash.c_str(), "%llx", &h) != 1) {
    return Status(ErrorCode::kInternal,
                  fmt::format("unexpected peer reply '{}'", r->substr(0, 80)));
  }
  auto bytes_hex = from_hex(hex);
  if (!bytes_hex) return bytes_hex.status();
  auto m = RemoteMemory::decode(*bytes_hex);
  if (!m) return m.status();
  source_ = *m;
  source_bytes_ = bytes;
  source_seed_ = seed;
  source_hash_ = static_cast<uint64_t>(h);
  return Status::ok();
}

Status PeerClient::poison(uint64_t offset, uint64_t length) {
  auto r = request(fmt::format("poison {} {}", offset, length));
  return r ? Status::ok() : r.status();
}

Result<uint64_t> PeerClient::hash(uint64_t len, uint64_t first, uint64_t step, uint64_t count) {
  auto r = request(fmt::format("hash {} {} {} {}", len, first, step, count));
  if (!r) return r.status();
  unsigned long long h = 0;
  if (std::sscanf(r->c_str(), "hash %llx", &h) != 1) {
    return Status(ErrorCode::kInternal, fmt::format("unexpected peer reply '{}'", *r));
  }
  return static_cast<uint64_t>(h);
}

Status PeerClient::serving(bool on) {
  auto r = request(fmt::format("serving {}", on ? 1 : 0));
  return r ? Status::ok() : r.status();
}

Status PeerClient::answer(uint32_t in, uint32_t out) {
  auto r = request(fmt::format("answer {} {}", in, out));
  return r ? Status::ok() : r.status();
}

Status PeerClient::expect(uint32_t imm, uint64_t count, milliseconds timeout) {
  auto r = request(fmt::format("expect {} {} {}", imm, count, timeout.count()));
  if (!r) return r.status();
  char word[16] = {};
  unsigned got_imm = 0;
  unsigned long long got = 0;
  if (std::sscanf(r->c_str(), "%15s %u %llu", word, &got_imm, &got) != 3 || got_imm != imm) {
    return Status(ErrorCode::kInternal, fmt::format("unexpected peer reply '{}'", *r));
  }
  if (std::string_view(word) != "got" || got != count) {
    return Status(ErrorCode::kTimeout,
                  fmt::format("peer {} counted {} of {} immediates {}", pid(), got, count, imm));
  }
  return Status::ok();
}

Result<double> PeerClient::cpu() {
  auto r = request("cpu");
  if (!r) return r.status();
  double s = 0;
  if (std::sscanf(r->c_str(), "cpu %lf", &s) != 1) {
    return Status(ErrorCode::kInternal, fmt::format("unexpected peer reply '{}'", *r));
  }
  return s;
}

}  // namespace fabric::bench
