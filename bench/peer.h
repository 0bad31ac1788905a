// The peer processes of fabric-bench: the targets of its writes and the owners of what it
// reads. The client (the process the
// user started) starts each peer as itself again (/proc/self/exe --server ...) and talks to it
// over its stdin/stdout. A peer opens an engine, prints
//   address HEX                      its engine address (Address::to_hex)
//   ready
// and then answers one line per command:
//   alloc BYTES                      -> memory HEX   a fresh registered buffer, every byte
//                                                    kPoison; the previous one is released
//   source BYTES SEED                -> source HEX HASH  a fresh buffer that peers may read
//                                                    (RegisterOptions::remote_read), filled with
//                                                    fill_pattern(SEED); HASH: hash_bytes of all
//                                                    of it; the previous one is released
//   poison OFFSET LENGTH             -> ok           fills a range with kPoison
//   hash LEN FIRST STEP COUNT        -> hash HEX     hash_ranges() over the buffer
//   client HEX                       -> ok           the client's address, for answers
//   answer IN OUT                    -> ok           from now on every arrival of immediate IN
//                                                    is answered by an imm-only write of OUT to
//                                                    the client (IN 0: stop answering)
//   expect IMM COUNT TIMEOUT_MS      -> got IMM N | timeout IMM N   (TransferEngine::wait_imm)
//   serving 0|1                      -> ok           1: the client is about to read; a
//                                                    caller-driven peer's driving thread stops
//                                                    napping when idle until `serving 0` (an
//                                                    owner must keep driving while it is read)
//   cpu                              -> cpu SECONDS  this process's CPU time so far
//   quit                             -> the peer closes its engine and exits 0
// Anything it cannot do is answered `error MESSAGE`.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fabric/fabric.h"
#include "harness.h"

namespace fabric::bench {

// How long one peer command may take (hashing or poisoning hundreds of MiB included).
constexpr milliseconds kReplyTimeout{90'000};

// The peer's main: runs until `quit` or EOF on stdin. Exit status 0 unless set-up failed.
int run_peer(const Config& config);

// A peer process, seen from the client.
class PeerClient {
 public:
  // Starts `path` with `args`, reads its greeting, tells it the client's address.
  static Result<std::unique_ptr<PeerClient>> start(const std::string& path,
                                                   const std::vector<std::string>& args,
                                                   const Address& client);

  const Address& address() const { return address_; }
  pid_t pid() const { return process_->pid(); }
  // The current buffer; empty until the first alloc.
  const RemoteMemory& memory() const { return memory_; }
  uint64_t memory_bytes() const { return memory_bytes_; }
  // The buffer reads come from, and the hash the peer reported of it; empty until the first
  // ensure_source.
  const RemoteMemory& source() const { return source_; }
  uint64_t source_hash() const { return source_hash_; }

  // A buffer of at least `bytes`: keeps the current one when it is large enough and not more
  // than four times too large, else asks for a fresh one.
  Status ensure_buffer(uint64_t bytes);
  // A readable source of exactly `bytes` holding fill_pattern(seed): keeps the current one
  // when it is that, else asks for a fresh one.
  Status ensure_source(uint64_t bytes, uint64_t seed);
  Status poison(uint64_t offset, uint64_t length);
  Result<uint64_t> hash(uint64_t len, uint64_t first, uint64_t step, uint64_t count);
  Status answer(uint32_t in, uint32_t out);
  // Around a read pass: whether the peer keeps driving its group without naps (`serving`).
  Status serving(bool on);
  // Waits (at the peer) for `count` arrivals of `imm` in all; kTimeout names how many came.
  Status expect(uint32_t imm, uint64_t count, milliseconds timeout);
  Result<double> cpu();
  Status quit() { return process_->quit(); }

 private:
  explicit PeerClient(std::unique_ptr<ChildProcess> p) : process_(std::move(p)) {}
  Result<std::string> request(const std::string& line) {
    return process_->request(line, kReplyTimeout);
  }

  std::unique_ptr<ChildProcess> process_;
  Address address_;
  RemoteMemory memory_;
  uint64_t memory_bytes_ = 0;
  RemoteMemory source_;
  uint64_t source_bytes_ = 0;
  uint64_t source_seed_ = 0;
  uint64_t source_hash_ = 0;
};

}  // namespace fabric::bench
