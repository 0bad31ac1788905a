// The Messenger's reading of what arrives (read_message, src/engine/messenger.h), without a
// domain: header checks, dedup by (sender, sequence), and what the worker is told to do.
#include "engine/messenger.h"

#include <gtest/gtest.h>

#include "common/codec.h"
#include "engine/messages.h"

namespace fabric::engine {
namespace {

constexpr uint64_t kSender = 0xabcdef;

// A message of `kind` with `body`, stamped (sender, seq) as a worker sends it.
Bytes message(MessageKind kind, uint64_t seq, Bytes body = {std::byte{1}, std::byte{2}},
              uint64_t sender = kSender) {
  detail::ByteWriter w;
  put_header(w, kind);
  w.bytes(body);
  Bytes m = w.take();
  stamp_header(m, sender, seq);
  return m;
}

Received read(const Bytes& m, SeenWindows& seen, bool has_handler = true) {
  return read_message(m, seen, has_handler, 0, "nic0");
}

TEST(Messenger, EachKindIsToldToTheWorker) {
  SeenWindows seen;
  const Bytes body{std::byte{7}, std::byte{8}, std::byte{9}};
  const Bytes user = message(MessageKind::kUser, 1, body);
  Received r = read(user, seen);
  EXPECT_EQ(r.kind, Received::Kind::kUser);
  EXPECT_EQ(Bytes(r.body.begin(), r.body.end()), body);
  EXPECT_EQ(r.body.data(), user.data() + kMessageHeaderBytes) << "the body is not copied";
  EXPECT_EQ(r.header.sender, kSender);
  EXPECT_EQ(r.header.seq, 1u);
  EXPECT_EQ(r.slot, nullptr);

  EXPECT_EQ(read(message(MessageKind::kCommit, 2), seen).kind, Received::Kind::kCommit);
  EXPECT_EQ(read(message(MessageKind::kAck, 3), seen).kind, Received::Kind::kAck);
  uint64_t seq = 4;
  for (MessageKind k : {MessageKind::kHello, MessageKind::kHelloAck, MessageKind::kFence,
                        MessageKind::kFenceAck, MessageKind::kGoodbye}) {
    EXPECT_EQ(read(message(k, seq++), seen).kind, Received::Kind::kFenceNote)
        << static_cast<int>(k);
  }
  EXPECT_EQ(read(message(static_cast<MessageKind>(200), seq++), seen).kind,
            Received::Kind::kDropped)
      << "an unknown kind is dropped";
}

TEST(Messenger, AMessageIsDeliveredOncePerSender) {
  SeenWindows seen;
  EXPECT_EQ(read(message(MessageKind::kUser, 1), seen).kind, Received::Kind::kUser);
  EXPECT_EQ(read(message(MessageKind::kUser, 1), seen).kind, Received::Kind::kDropped);
  EXPECT_EQ(read(message(MessageKind::kUser, 1, {}, kSender + 1), seen).kind, Received::Kind::kUser)
      << "another sender's sequence numbers are its own";
  EXPECT_EQ(read(message(MessageKind::kAck, 2), seen).kind, Received::Kind::kAck);
  EXPECT_EQ(read(message(MessageKind::kAck, 2), seen).kind, Received::Kind::kDropped);
}

TEST(Messenger, ACommitSeenBeforeIsADuplicateForTheWorkerToAnswer) {
  SeenWindows seen;
  const Bytes commit = message(MessageKind::kCommit, 5);
  EXPECT_EQ(read(commit, seen).kind, Received::Kind::kCommit);
  const Received again = read(commit, seen);
  EXPECT_EQ(again.kind, Received::Kind::kDuplicateCommit);
  EXPECT_EQ(again.header.sender, kSender);
  EXPECT_EQ(again.header.seq, 5u);
}

TEST(Messenger, AShortOrCutMessageIsDroppedAndNotCountedAsSeen) {
  SeenWindows seen;
  const Bytes whole = message(MessageKind::kUser, 1, Bytes(10, std::byte{3}));
  EXPECT_EQ(read(Bytes(whole.begin(), whole.begin() + kMessageHeaderBytes - 1), seen).kind,
            Received::Kind::kDropped)
      << "shorter than its header";
  EXPECT_EQ(read(Bytes(whole.begin(), whole.end() - 1), seen).kind, Received::Kind::kDropped)
      << "cut short";
  EXPECT_TRUE(seen.empty()) << "a dropped message is not seen";
  EXPECT_EQ(read(whole, seen).kind, Received::Kind::kUser) << "its whole copy is delivered";
}

TEST(Messenger, BytesAfterAMessageAreLeftOff) {
  SeenWindows seen;
  const Bytes body{std::byte{4}, std::byte{5}};
  Bytes m = message(MessageKind::kUser, 1, body);
  m.insert(m.end(), 21, std::byte{0xee});
  const Received r = read(m, seen);
  ASSERT_EQ(r.kind, Received::Kind::kUser);
  EXPECT_EQ(Bytes(r.body.begin(), r.body.end()), body);
}

TEST(Messenger, AUserMessageWithNoHandlerIsDroppedButSeen) {
  SeenWindows seen;
  const Bytes m = message(MessageKind::kUser, 1);
  EXPECT_EQ(read(m, seen, false).kind, Received::Kind::kDropped);
  EXPECT_EQ(read(m, seen, true).kind, Received::Kind::kDropped) << "already seen";
}

}  // namespace
}  // namespace fabric::engine
