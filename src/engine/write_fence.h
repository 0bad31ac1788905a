// The write fence of unregistration (docs/hardening.md, "Unregister is a barrier").
//
// libfabric tcp checks a write's remote key once, when the write's first bytes arrive, then
// streams the rest into the memory. Closing a registration therefore refuses writes that start
// later but not one already arriving, and no completion tells the owner about such a write.
// What the owner can rely on is the order of one connection: the provider reads a connection's
// bytes in sequence, so a message that arrives on it arrives after every write that was posted
// on it before the message was.
//
// So, on domains whose provider checks a key once per write (DomainInfo::key_checked_once):
//   - a writer announces itself to an owner (Hello) before its first write there, and posts
//     writes towards that owner only once the owner has recorded it (HelloAck);
//   - an owner that closes a registration sends a Fence to every writer it knows, and each
//     writer answers (FenceAck) from each of its NICs, over the connection that NIC's writes
//     take. When the answers from all NICs of all writers are in, every write posted before
//     them has arrived whole, and unregister_memory() returns;
//   - a writer that closes its engine says Goodbye to every owner it announced itself to, from
//     each NIC, behind the writes posted there: once all have come, the owner stops fencing it
//     (an owner unregistering after its writers exited cleanly waits for nobody);
//   - a writer that does not answer within the timeout (a stopped or overloaded process, or one
//     that died) is forgotten, and the round ends with kTimeout naming it: the registration is
//     closed and new writes are refused, but the rest of a write that writer had already started
//     may still land if it runs again (the owner cannot cut a libfabric tcp connection that the
//     writer opened). A forgotten writer that answers later, or announces itself again, is a
//     writer again: its late answer arrives after every byte it sent first.
//
// WriteFence is the state machine alone: it owns the announcements, the writers and the rounds,
// and calls nothing. What it has to send comes back as Notes (the worker sends them ahead of
// other queued work, Op::urgent: two engines that start writing to each other at once must not
// wait for each other's HelloAck behind their own held writes), and the rounds that ended come
// back from take_settled(), for the worker to run.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/messages.h"
#include "fabric/address.h"
#include "fabric/status.h"

namespace fabric::engine {

class WriteFence {
 public:
  using Clock = std::chrono::steady_clock;
  using Done = std::function<void(const Status&)>;

  // A message to send: `bytes` (an encoded FenceNote) to `to`, from this engine's NIC `nic`.
  struct Note {
    Address to;
    uint32_t nic = 0;
    Bytes bytes;
  };

  // `self`: this engine's group Address, encoded; `nics`: its number of NICs; `timeout`: how
  // long a round waits for a writer; `resend`: how often an unanswered Hello or Fence goes again.
  WriteFence(Bytes self, uint32_t nics, std::chrono::milliseconds timeout,
             std::chrono::milliseconds resend);

  // --- the writer's side
  // Whether a write from NIC `nic` towards `owner` may be posted now: true once the owner has
  // acknowledged this engine's Hello; otherwise the Hello is (re)sent through `out` when due.
  bool may_write(const Address& owner, uint32_t nic, Clock::time_point now, std::vector<Note>& out);
  // Moves on whenever an announcement is forgotten: a peer queue that found its owner
  // acknowledged at another epoch asks may_write() again.
  uint64_t epoch() const { return epoch_; }
  // The connection to `owner` (by its first NIC name) dropped, or the owner was declared dead:
  // this engine announces itself again before its next write there.
  void forget_owner(const Bytes& owner);
  // The engine stops: a Goodbye to every owner announced to, from each NIC.
  void goodbye(std::vector<Note>& out) const;

  // --- the owner's side
  // A registration was closed: a round asks every writer known to answer. With none, or while
  // stopping (the round then ends at end()), nothing is sent.
  void fence(Done done, uint32_t message_nic, Clock::time_point now, std::vector<Note>& out);
  // A note that arrived on this engine's NIC `arrived_on`, from `from` (the note's sender).
  void on_note(const FenceNote& note, const Address& from, uint32_t arrived_on,
               std::vector<Note>& out);
  // Timeouts and resends. Rounds past their deadline end with kTimeout.
  void tick(uint32_t message_nic, Clock::time_point now, std::vector<Note>& out);
  // Peer `first_nic` was declared dead: no round waits for it, and it is no owner announced to.
  void peer_dead(const Bytes& first_nic);
  // From now on rounds do not settle: they end in end(), once the domains are closed.
  void stop() { stopping_ = true; }
  // The domains are closed: every round is done (nothing can land any more).
  void end();

  bool has_rounds() const { return !rounds_.empty(); }
  size_t writers() const { return writers_.size(); }
  // The rounds that ended since the last call, with their outcome, in the order they ended.
  std::vector<std::pair<Done, Status>> take_settled();

 private:
  struct Announcement {
    Address owner;
    bool acked = false;
    Clock::time_point resend_at;
  };
  struct Writer {
    Address address;
    std::vector<bool> gone;  // per NIC of the writer: a Goodbye came over it
  };
  struct Round {
    uint64_t id = 0;
    Done done;
    Status outcome;
    // Per writer (by first NIC name): its NICs that have not answered yet.
    std::unordered_map<std::string, std::vector<bool>> waiting;
    Clock::time_point resend_at;
    Clock::time_point deadline;
  };

  // Writer `key`'s NIC `nic` answered (FenceAck of round `round`, or a Goodbye: any round).
  void answered(const std::string& key, uint32_t nic, const uint64_t* round);
  void settle();

  Bytes self_;
  uint32_t nics_;
  std::chrono::milliseconds timeout_;
  std::chrono::milliseconds resend_;
  bool stopping_ = false;
  std::unordered_map<std::string, Announcement> announced_;
  uint64_t epoch_ = 1;
  std::unordered_map<std::string, Writer> writers_;
  std::vector<Round> rounds_;
  uint64_t next_round_ = 0;
  std::vector<std::pair<Done, Status>> settled_;
};

}  // namespace fabric::engine
