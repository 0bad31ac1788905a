// Messenger: the two-sided messages of one worker, as a component (docs/engine.md, "Files").
//
// It owns the registered send buffers, the receive buffers (the engine's control pool on every
// NIC, posted from the start, and the user's once set_receive_handler has run), the user's
// handler, this worker's sender id and sequence numbers, and what it has seen from every sender.
// It calls nothing above it: it is given the domains it registers on and posts receives to, and
// what arrives goes back to the worker as a Received, which the worker routes (Commits, Acks and
// write-fence notes to their owners, user messages to the callback thread) and then hands back
// (done()) for its buffer to be posted again.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "engine/aligned_buffer.h"
#include "engine/callback_thread.h"
#include "engine/messages.h"
#include "engine/transfer_state.h"
#include "fabric/status.h"
#include "transport/domain.h"

namespace fabric::engine {

// One receive buffer, posted on NIC `domain`; its address is the receive's wr_id.
struct RecvSlot {
  std::byte* buf;
  uint64_t size;
  void* desc;
  uint32_t domain;
};

// What a message that arrived is, for the worker to route.
struct Received {
  enum class Kind : uint8_t {
    kDropped,          // nothing to route (a failed receive, a bad or unknown message: logged)
    kUser,             // for the user's handler: body
    kCommit,           // header, body
    kAck,              // body
    kFenceNote,        // a write-fence note (Hello, HelloAck, Fence, FenceAck, Goodbye)
    kDuplicateCommit,  // a Commit seen before: its writer may still wait for the Ack (header)
  };
  Kind kind = Kind::kDropped;
  MessageHeader header{};
  std::span<const std::byte> body;  // in the receive buffer: valid until done()
  RecvSlot* slot = nullptr;         // the buffer to post again once routed; null: none
};

using SeenWindows = std::unordered_map<uint64_t, SeenWindow>;

// Checks a message of `arrived` bytes (header and body), records its (sender, sequence) in
// `seen` and says what it is. Logs why one is dropped, and bytes after a message (dropped;
// the message is delivered). `has_handler`: a user message has somewhere to go. `group` and
// `nic` (the NIC it arrived on) name it in the log. Pure but for the log: unit-tested.
Received read_message(std::span<const std::byte> arrived, SeenWindows& seen, bool has_handler,
                      uint32_t group, std::string_view nic);

class Messenger {
 public:
  using Handler = std::function<void(std::span<const std::byte>)>;
  struct Sizes {
    uint64_t max_message_bytes = 0;  // Config::max_message_bytes
    uint32_t send_buffers = 0;       // Config::send_buffers: send slots per chunk (at least 1)
    uint32_t control_buffers = 0;    // Config::control_buffers: per NIC (at least 1)
  };

  // Registers the send buffers on every domain (rail order), and posts the engine's own
  // receive buffers on each, before anything can be sent here. The domains must outlive the
  // Messenger, and every call runs on the worker thread.
  static Result<std::unique_ptr<Messenger>> create(uint32_t group,
                                                   std::vector<transport::Domain*> domains,
                                                   const Sizes& sizes);

  // --- receiving
  // Posts the user's receive buffers on every NIC (kAlreadyExists once done).
  Status start_receives(Handler handler, uint64_t buffer_bytes, uint32_t count);
  // A receive completion on NIC `domain`: what arrived, to route, then to hand to done().
  // `stopping`: a failed receive is not posted again.
  Received on_recv(const transport::Completion& c, uint32_t domain, bool stopping);
  // Posts the buffer of `r` again, if it has one.
  void done(const Received& r) {
    if (r.slot != nullptr) repost(*r.slot);
  }
  // The callback-thread job that gives a user message (Received::kUser) to the handler.
  CallbackThread::Job deliver(std::span<const std::byte> body) const {
    return [h = user_handler_, m = Bytes(body.begin(), body.end())] { (*h)(m); };
  }

  // --- sending
  // Gives a message this worker's sender id and the next sequence number, which it returns.
  uint64_t stamp(Bytes& message) {
    const uint64_t seq = ++next_seq_;
    stamp_header(message, sender_id_, seq);
    return seq;
  }
  // Puts a send's message in a registered send buffer, unless it holds one already, and points
  // op.local and op.local_desc at it (op.domain's registration: the op may have moved NICs).
  // False when none is free: try again after completions. With `may_grow` (sends abandoned on
  // a dead NIC hold buffers its provider may keep for minutes), an empty pool grows by a chunk,
  // at most kMaxSendChunks, so that the copy on a live NIC can go out.
  bool fill_send(Op& op, bool may_grow);
  // Gives a send's registered buffer back to the pool, if it holds one.
  void release_send_slot(Op& op) {
    if (op.send_slot < 0) return;
    send_pool_.free.push_back(op.send_slot);
    op.send_slot = -1;
  }

 private:
  // Receive buffers of one NIC. Every NIC has the control pool and, once set, the user's, since
  // a message may come over any rail. Any message may land in either; its kind byte routes it.
  struct ReceivePool {
    AlignedBuffer storage;
    std::unique_ptr<transport::MemoryRegistration> reg;
    std::vector<RecvSlot> slots;
  };
  // Registered send buffers, in chunks of `per_chunk` slots, each chunk on every NIC.
  struct SendPool {
    struct Chunk {
      AlignedBuffer storage;
      std::vector<std::unique_ptr<transport::MemoryRegistration>> regs;  // one per NIC
    };
    std::vector<Chunk> chunks;
    std::vector<int32_t> free;
    uint64_t slot_bytes = 0;
    uint32_t per_chunk = 0;
    std::byte* at(int32_t slot) const {
      return chunks[slot / per_chunk].storage.get() + (slot % per_chunk) * slot_bytes;
    }
    void* desc(int32_t slot, uint32_t nic) const {
      return chunks[slot / per_chunk].regs[nic]->local_desc();
    }
  };
  static constexpr size_t kMaxSendChunks = 8;

  Messenger(uint32_t group, std::vector<transport::Domain*> domains, const Sizes& sizes)
      : group_(group), domains_(std::move(domains)), sizes_(sizes) {}
  Status add_send_chunk();
  Result<std::unique_ptr<ReceivePool>> make_pool(uint32_t domain, uint64_t buffer_bytes,
                                                 uint32_t count);
  void repost(RecvSlot& slot);

  const uint32_t group_;
  const std::vector<transport::Domain*> domains_;  // the worker's, in rail order
  const Sizes sizes_;
  // Registrations in creation order: destroyed in reverse, all before the domains.
  SendPool send_pool_;
  std::vector<std::unique_ptr<ReceivePool>> control_pools_;  // one per NIC
  std::vector<std::unique_ptr<ReceivePool>> recv_pools_;     // one per NIC; empty: no handler
  std::shared_ptr<Handler> user_handler_;                    // null until start_receives
  // This worker's sender id (random), its last sequence number, and what it has seen from every
  // sender.
  uint64_t sender_id_ = 0;
  uint64_t next_seq_ = 0;
  SeenWindows seen_;
};

}  // namespace fabric::engine
