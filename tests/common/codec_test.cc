// Wire formats: round trips, and every malformed input rejected with a message, never a crash.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "engine/messages.h"
#include "fabric/address.h"

namespace fabric {
namespace {

Address sample_address(size_t nics = 2) {
  std::vector<NicAddress> v;
  for (size_t i = 0; i < nics; ++i) {
    Bytes name(16 + i);
    for (size_t j = 0; j < name.size(); ++j) name[j] = static_cast<std::byte>(i * 31 + j);
    v.push_back({name, 0x1000 * (i + 1), 0xabc0 + i});
  }
  return Address("tcp;ofi_rxm", v, Origin::of_this_process(0x1234));
}

TEST(Codec, HexRoundTripAndErrors) {
  Bytes b = {std::byte{0}, std::byte{0x7f}, std::byte{0xff}};
  EXPECT_EQ(to_hex(b), "007fff");
  EXPECT_EQ(*from_hex("007FfF"), b);
  EXPECT_EQ(from_hex("abc").status().code(), ErrorCode::kInvalidArgument);
  auto bad = from_hex("zz");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.status().message().find("position 0"), std::string::npos);
}

TEST(Codec, AddressRoundTrip) {
  Address a = sample_address(3);
  auto back = Address::decode(a.encode());
  ASSERT_TRUE(back) << back.status().to_string();
  EXPECT_EQ(*back, a);
  EXPECT_EQ(back->provider(), "tcp;ofi_rxm");
  EXPECT_EQ(back->num_nics(), 3u);
  auto via_hex = Address::from_hex(a.to_hex());
  ASSERT_TRUE(via_hex);
  EXPECT_EQ(*via_hex, a);
}

TEST(Codec, AddressCarriesItsOrigin) {
  Address a = sample_address(1);
  ASSERT_TRUE(a.origin().known());
  auto back = Address::decode(a.encode());
  ASSERT_TRUE(back) << back.status().to_string();
  EXPECT_EQ(back->origin(), a.origin());
  EXPECT_EQ(back->origin().instance, 0x1234u);
  EXPECT_TRUE(back->origin().same_process(Origin::of_this_process(7)));
  // Another instance of the same process differs as an address.
  Address other("tcp;ofi_rxm", a.nics(), Origin::of_this_process(0x1235));
  EXPECT_NE(other, a);
}

TEST(Origin, TellsALiveProcessFromAZombieADeadOneAndAReusedPid) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    Origin mine = Origin::of_this_process(1);
    ssize_t n = ::write(fds[1], &mine, sizeof mine);
    ::pause();
    ::_exit(n == sizeof mine ? 0 : 1);
  }
  Origin theirs;
  ASSERT_EQ(::read(fds[0], &theirs, sizeof theirs), static_cast<ssize_t>(sizeof theirs));
  ::close(fds[0]);
  ::close(fds[1]);
  EXPECT_EQ(theirs.pid, static_cast<uint32_t>(child));
  EXPECT_NE(theirs.start_time, 0u);
  EXPECT_TRUE(theirs.same_host(Origin::of_this_process(2)));
  EXPECT_FALSE(theirs.same_process(Origin::of_this_process(2)));
  EXPECT_TRUE(theirs.process_alive());
  Origin reused = theirs;
  reused.start_time += 1;  // the same PID, started at another time: another process
  EXPECT_FALSE(reused.process_alive());
  ASSERT_EQ(::kill(child, SIGKILL), 0);
  // Killed but not yet reaped: a zombie, which is not alive either.
  for (int i = 0; i < 200 && theirs.process_alive(); ++i) ::usleep(5000);
  EXPECT_FALSE(theirs.process_alive());
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_FALSE(theirs.process_alive());
  EXPECT_TRUE(Origin::of_this_process(3).process_alive());
  EXPECT_TRUE(Origin{}.process_alive());  // unknown: cannot be told
}

TEST(Codec, VersionOneAddressDecodesWithAnUnknownOrigin) {
  Address a = sample_address(2);
  Bytes v1 = a.encode();
  v1[4] = std::byte{1};
  v1.resize(v1.size() - (16 + 8 + 8 + 4 + 8 + 8));
  auto back = Address::decode(v1);
  ASSERT_TRUE(back) << back.status().to_string();
  EXPECT_FALSE(back->origin().known());
  EXPECT_EQ(back->nics(), a.nics());
  EXPECT_FALSE(back->origin().same_host(a.origin()));
}

TEST(Codec, EveryTruncationOfAnAddressIsRejected) {
  Bytes full = sample_address().encode();
  for (size_t n = 0; n < full.size(); ++n) {
    auto r = Address::decode(std::span(full).first(n));
    ASSERT_FALSE(r) << "accepted a " << n << "-byte prefix";
    EXPECT_EQ(r.status().code(), ErrorCode::kInvalidArgument);
  }
  full.push_back(std::byte{0});
  auto r = Address::decode(full);
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("trailing"), std::string::npos);
}

TEST(Codec, AddressVersionAndMagicAreChecked) {
  Bytes b = sample_address().encode();
  Bytes wrong_version = b;
  wrong_version[4] = std::byte{99};
  auto r = Address::decode(wrong_version);
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("version 99"), std::string::npos);
  Bytes wrong_magic = b;
  wrong_magic[0] = std::byte{0};
  EXPECT_FALSE(Address::decode(wrong_magic));
}

TEST(Codec, AProviderNameThatIsNotPrintableAsciiIsRejected) {
  // Shown and compared everywhere (Python's str included): a foreign byte there is bad input.
  for (unsigned char bad : {0x00, 0x1f, 0x7f, 0x80, 0xc9, 0xff}) {
    Bytes b = Address("tcp", {NicAddress{Bytes(16, std::byte{1}), 0, 0}}).encode();
    b[6] = static_cast<std::byte>(bad);  // magic, version, length, then the name
    auto r = Address::decode(b);
    ASSERT_FALSE(r) << "byte " << int(bad);
    EXPECT_EQ(r.status().code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("not printable ASCII"), std::string::npos)
        << r.status().to_string();
  }
  EXPECT_TRUE(Address::decode(Address("shm (fabric)", {NicAddress{Bytes(8, std::byte{1}), 0, 0}})
                                  .encode()));  // a space is printable
}

TEST(Codec, DescriptorRoundTripIsRailAligned) {
  Address owner = sample_address(2);
  RemoteMemory m(owner, 0x7f0000001000, 1 << 20, {{0x7f0000001000, 11}, {0, 22}});
  auto back = RemoteMemory::decode(m.encode());
  ASSERT_TRUE(back) << back.status().to_string();
  EXPECT_EQ(*back, m);
  EXPECT_EQ(back->rails()[1].key, 22u);
  EXPECT_EQ(back->owner(), owner);
}

TEST(Codec, AReadableDescriptorIsVersionSixAndOthersKeepTheirVersion) {
  const Address owner = sample_address(2);
  RemoteMemory plain(owner, 0x1000, 4096, {{0x1000, 1}, {0x1000, 2}});
  RemoteMemory readable(owner, 0x1000, 4096, {{0x1000, 1}, {0x1000, 2}}, 0, std::nullopt, true);
  EXPECT_EQ(plain.encode()[4], std::byte{2});  // engines built before reads still decode it
  const Bytes b = readable.encode();
  EXPECT_EQ(b[4], std::byte{6});
  auto back = RemoteMemory::decode(b);
  ASSERT_TRUE(back) << back.status().to_string();
  EXPECT_TRUE(back->readable());
  EXPECT_EQ(*back, readable);
  EXPECT_NE(*back, plain);
  EXPECT_FALSE(RemoteMemory::decode(plain.encode())->readable());
  // Unknown flags are refused; a missing flags byte is a truncation.
  Bytes unknown = b;
  unknown.back() = std::byte{0x03};
  auto r = RemoteMemory::decode(unknown);
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("unknown flags"), std::string::npos);
  Bytes cut = b;
  cut.pop_back();
  EXPECT_FALSE(RemoteMemory::decode(cut));
}

TEST(Codec, DescriptorWithRailCountUnlikeItsOwnerIsRejected) {
  RemoteMemory m(sample_address(2), 0, 100, {{0, 1}});
  auto r = RemoteMemory::decode(m.encode());
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("1 rails for an owner with 2 NICs"), std::string::npos);
}

// Bad-input table (docs/bad-input.md): a descriptor of a version this build does not read.
TEST(Codec, DescriptorVersionAndMagicAreChecked) {
  Bytes b = RemoteMemory(sample_address(1), 0, 100, {{0, 1}}).encode();
  // Version 6 is current (the flags byte: readable).
  for (uint8_t version : {0, 7, 255}) {
    Bytes wrong = b;
    wrong[4] = std::byte{version};
    auto r = RemoteMemory::decode(wrong);
    ASSERT_FALSE(r) << int{version};
    EXPECT_EQ(r.status().code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("version " + std::to_string(version)), std::string::npos)
        << r.status().to_string();
  }
  Bytes wrong_magic = b;
  wrong_magic[0] = std::byte{0};
  auto r = RemoteMemory::decode(wrong_magic);
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("bad magic"), std::string::npos);
  // An address where a descriptor is expected is named as such, not half-read.
  EXPECT_FALSE(RemoteMemory::decode(sample_address(1).encode()));
}

TEST(Codec, DescriptorThatWrapsTheAddressSpaceIsRejected) {
  RemoteMemory m(sample_address(1), UINT64_MAX - 10, 100, {{0, 1}});
  EXPECT_FALSE(RemoteMemory::decode(m.encode()));
}

TEST(Codec, EveryTruncationAndBitFlipOfADescriptorIsHandled) {
  Bytes full = RemoteMemory(sample_address(2), 4096, 8192, {{4096, 1}, {4096, 2}}).encode();
  for (size_t n = 0; n < full.size(); ++n) {
    EXPECT_FALSE(RemoteMemory::decode(std::span(full).first(n))) << n;
  }
  // Flipping any bit either fails cleanly or decodes to a different, self-consistent value.
  for (size_t i = 0; i < full.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      Bytes b = full;
      b[i] ^= static_cast<std::byte>(1 << bit);
      auto r = RemoteMemory::decode(b);
      if (r) {
        EXPECT_EQ(r->rails().size(), r->owner().num_nics());
        EXPECT_EQ(r->encode(), b);
      }
    }
  }
}

}  // namespace
}  // namespace fabric

namespace fabric::engine {
namespace {

// A Commit asking its owner to count more arrivals than one transfer can produce is dropped as
// malformed rather than making the owner's worker allocate and count for ever (found by the
// messages fuzz target's bound; docs/bad-input.md).
TEST(Codec, CommitWithTooManyArrivalsIsRejected) {
  Commit c;
  c.transfer = 1;
  c.reply_to = Bytes(16, std::byte{7});
  c.has_imm = true;
  c.imm_times = Commit::kMaxImmTimes;
  Bytes ok = c.encode();
  EXPECT_TRUE(Commit::decode(std::span(ok).subspan(kMessageHeaderBytes)));
  c.imm_times = Commit::kMaxImmTimes + 1;
  Bytes bad = c.encode();
  EXPECT_FALSE(Commit::decode(std::span(bad).subspan(kMessageHeaderBytes)));
  c.imm_times = UINT64_MAX;
  bad = c.encode();
  EXPECT_FALSE(Commit::decode(std::span(bad).subspan(kMessageHeaderBytes)));
}

// The receiver's record of message sequence numbers (messages.h): a copy failover sent again is
// recognised whatever the order, and an open gap cannot grow the record without bound.
TEST(SeenWindow, EachSequenceIsNewOnceInAnyOrder) {
  SeenWindow w;
  EXPECT_FALSE(w.insert(0)) << "no sender uses 0";
  for (uint64_t seq : {3, 1, 5, 2}) EXPECT_TRUE(w.insert(seq)) << seq;
  EXPECT_EQ(w.floor(), 3u);
  EXPECT_EQ(w.above(), 1u);  // 5, past the gap at 4
  for (uint64_t seq : {1, 2, 3, 5}) EXPECT_FALSE(w.insert(seq)) << seq;
  EXPECT_TRUE(w.insert(4));
  EXPECT_EQ(w.floor(), 5u);
  EXPECT_EQ(w.above(), 0u);
  EXPECT_FALSE(w.insert(4));
}

TEST(SeenWindow, AGapThatNeverClosesIsForgottenPastTheBound) {
  SeenWindow w;
  ASSERT_TRUE(w.insert(1));
  // 2 never arrives (its sender gave up on it); everything after it does.
  for (uint64_t seq = 3; seq < 3 + SeenWindow::kMaxAbove; ++seq) ASSERT_TRUE(w.insert(seq));
  EXPECT_EQ(w.floor(), 1u);
  EXPECT_EQ(w.above(), SeenWindow::kMaxAbove);
  ASSERT_TRUE(w.insert(3 + SeenWindow::kMaxAbove));
  EXPECT_EQ(w.floor(), 3 + SeenWindow::kMaxAbove) << "the floor moves over the gap";
  EXPECT_EQ(w.above(), 0u);
  EXPECT_FALSE(w.insert(2)) << "a copy older than the bound counts as seen";
  EXPECT_FALSE(w.insert(100));
  EXPECT_TRUE(w.insert(4 + SeenWindow::kMaxAbove));
}

TEST(MessageHeader, StampedSenderAndSequenceReadBack) {
  Ack a{7, 9, ErrorCode::kOk, ""};
  Bytes m = a.encode();
  ASSERT_GE(m.size(), kMessageHeaderBytes);
  stamp_header(m, 0x1122334455667788ull, 42);
  auto h = read_header(m);
  ASSERT_TRUE(h);
  EXPECT_EQ(h->kind, MessageKind::kAck);
  EXPECT_EQ(h->sender, 0x1122334455667788ull);
  EXPECT_EQ(h->seq, 42u);
  EXPECT_EQ(h->body_length, m.size() - kMessageHeaderBytes) << "the stamp records the body length";
  auto back = Ack::decode(std::span(m).subspan(kMessageHeaderBytes));
  ASSERT_TRUE(back);
  EXPECT_EQ(back->transfer, 7u);
  EXPECT_EQ(back->commit, 9u);
  EXPECT_FALSE(read_header(std::span(m).first(kMessageHeaderBytes - 1)));
}

}  // namespace
}  // namespace fabric::engine
