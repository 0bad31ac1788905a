// Worker: its side of two-sided messages. The Messenger (messenger.h) owns the pools, stamps and
// dedup and says what arrived; this routes it to the parts of the worker it is for, and sends
// the worker's own (internal) messages.

#include <utility>

#include "engine/op_builder.h"
#include "engine/worker.h"

namespace fabric::engine {

void Worker::on_recv(const transport::Completion& c, uint32_t domain) {
  const Received r = messages_->on_recv(c, domain, stopping_);
  switch (r.kind) {
    case Received::Kind::kUser:
      jobs_.push_back(messages_->deliver(r.body));
      break;
    case Received::Kind::kCommit:
      staged_->on_commit(r.header, r.body, domain);
      run_staged_events();
      break;
    case Received::Kind::kAck:
      handle_ack(r.body);
      break;
    case Received::Kind::kFenceNote:
      handle_fence_note(r.header, r.body, domain);
      break;
    case Received::Kind::kDuplicateCommit:
      staged_->on_duplicate(r.header, domain);
      run_staged_events();
      break;
    case Received::Kind::kDropped:
      break;
  }
  messages_->done(r);
}

void Worker::send_internal(Address owner, uint32_t domain, Bytes message, bool urgent,
                           bool while_stopping) {
  TransferPtr t = pool_.take();
  t->id = kInternalTransfer | next_internal_++;
  t->while_stopping = while_stopping;
  t->peers.push_back(std::move(owner));
  t->message = std::move(message);
  t->ops.push_back(send_op(*t, domain, t->peers[0], t->message));
  t->ops.back().urgent = urgent;
  start_transfer(std::move(t));
}

}  // namespace fabric::engine
