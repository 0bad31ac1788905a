// Every byte of a memory descriptor corrupted: each of its bits flipped, and every truncation.
// A corrupted descriptor either fails to decode (InvalidArgument) or decodes into a
// self-consistent value, and a write to that value ends exactly once, as a success or an error
// with its code: never a crash, a hang or a second callback. Afterwards the engine still writes
// to the peer it knew and to a peer it never met, every byte checked.
//
// A flipped bit in a socket address turns it into another host's address, and a write to it
// would go out on the machine's network. So over tcp the sweep runs in a network namespace of its
// own with only loopback up (the test re-executes itself there; as root, or it is skipped with
// the reason): every address outside 127.0.0.0/8 is unreachable there. shm has no network, and
// verbs runs in the rxe lab's guest, whose only links are its own dummy interfaces.
#include <net/if.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <numeric>
#include <thread>

#include "rerun.h"
#include "tally.h"
#include "test_support.h"

namespace fabric::testing {
namespace {

constexpr uint64_t kBytes = 4096;
constexpr uint64_t kWriteBytes = 64;
constexpr const char* kInPrivateNetns = "FABRIC_TEST_IN_PRIVATE_NETNS";

bool loopback_up() {
  const int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  ifreq req{};
  std::strncpy(req.ifr_name, "lo", IFNAMSIZ - 1);
  bool ok = ioctl(fd, SIOCGIFFLAGS, &req) == 0;
  req.ifr_flags = static_cast<short>(req.ifr_flags | IFF_UP);
  ok = ok && ioctl(fd, SIOCSIFFLAGS, &req) == 0;
  close(fd);
  return ok;
}

// The corrupted forms of `bytes`: each bit flipped, then each proper prefix.
std::vector<Bytes> corruptions(const Bytes& bytes) {
  std::vector<Bytes> out;
  for (size_t i = 0; i < bytes.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      Bytes b = bytes;
      b[i] ^= static_cast<std::byte>(1 << bit);
      out.push_back(std::move(b));
    }
  }
  for (size_t len = 0; len < bytes.size(); ++len)
    out.emplace_back(bytes.begin(), bytes.begin() + len);
  return out;
}

// Writes kWriteBytes of a fresh pattern to `dst` and checks that they landed.
void expect_write_lands(TransferEngine& a, Buffer& src, Buffer& dst, uint64_t seed,
                        const char* what) {
  fill_pattern(src.bytes.data(), kWriteBytes, seed);
  std::fill(dst.bytes.begin(), dst.bytes.end(), std::byte{0});
  CompletionCounter counter;
  auto id = a.submit(SingleWrite{src.reg.handle, 0, dst.reg.descriptor, 0, kWriteBytes, {}, {}},
                     counter.callbacks());
  ASSERT_TRUE(id) << what << ": " << id.status().to_string();
  ASSERT_TRUE(counter.wait(1, std::chrono::seconds(20))) << what << ": the write never ended";
  ASSERT_EQ(counter.done(), 1u) << what << ": " << counter.first_error().to_string();
  EXPECT_EQ(std::memcmp(src.bytes.data(), dst.bytes.data(), kWriteBytes), 0)
      << what << ": the bytes differ";
}

class CorruptDescriptor : public ::testing::TestWithParam<Backend> {};

TEST_P(CorruptDescriptor, EveryFlippedBitAndTruncationEndsOnceAndPeersStayReachable) {
  const Backend& backend = GetParam();
  if (backend.provider == "tcp" && std::getenv(kInPrivateNetns) == nullptr) {
    const int rc = rerun_this_test(kInPrivateNetns, true, std::chrono::seconds(240));
    if (rc == kNoNamespace) {
      GTEST_SKIP() << "no network namespace of its own could be made (needs root): a flipped "
                      "address would reach the machine's network";
    }
    ASSERT_EQ(rc, 0) << "the sweep in its own network namespace failed (its output is above)"
                     << (rc == kRanTooLong ? ": it ran past 240 s" : "");
    return;
  }
  if (std::getenv(kInPrivateNetns) != nullptr) {
    ASSERT_TRUE(loopback_up()) << std::strerror(errno);
  }

  Config config = make_config(backend);
  config.peer_timeout = std::chrono::milliseconds(1500);
  FABRIC_ENGINE_OR_SKIP(a, config);
  FABRIC_ENGINE_OR_SKIP(b, config);
  auto src = make_buffer(*a, kBytes);
  auto dst = make_buffer(*b, kBytes);
  fill_pattern(src->bytes.data(), kBytes, 7);
  expect_write_lands(*a, *src, *dst, 1, "before the sweep");

  const Bytes good = dst->reg.descriptor.encode();
  std::map<ErrorCode, int> decode_codes, submit_codes;
  std::string first_submit_error;
  int undecodable = 0, submitted = 0;
  Tally tally;
  for (const Bytes& bytes : corruptions(good)) {
    auto d = RemoteMemory::decode(bytes);
    if (!d) {
      ++undecodable;
      ++decode_codes[d.status().code()];
      continue;
    }
    auto id =
        a->submit(SingleWrite{src->reg.handle, 0, *d, 0, kWriteBytes, {}, {}}, tally.callbacks());
    if (!id) {
      if (submit_codes.empty()) first_submit_error = id.status().to_string();
      ++submit_codes[id.status().code()];
      continue;
    }
    ++submitted;
  }
  EXPECT_TRUE(tally.wait_total(submitted, std::chrono::seconds(60)))
      << "writes to corrupted descriptors never ended: " << tally.summary() << " of " << submitted;
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // room for a second callback
  EXPECT_EQ(tally.twice(), 0) << "a transfer ended twice";
  EXPECT_EQ(tally.done() + tally.failed(), submitted) << tally.summary();
  // A descriptor that does not decode says so as bad input, nothing else.
  for (auto [code, count] : decode_codes) {
    EXPECT_EQ(code, ErrorCode::kInvalidArgument) << count << " decodes failed otherwise";
  }
  for (auto [code, count] : submit_codes) {
    EXPECT_NE(code, ErrorCode::kInternal) << count << " submissions failed as internal errors";
  }
  EXPECT_EQ(tally.codes().count(ErrorCode::kInternal), 0u) << tally.summary();
  std::cout << "[ sweep    ] " << backend.name << ": " << good.size() << "-byte descriptor, "
            << undecodable << " corruptions not decoded, "
            << std::accumulate(submit_codes.begin(), submit_codes.end(), 0,
                               [](int n, const auto& kv) { return n + kv.second; })
            << " refused at submission (first: " << first_submit_error << "), " << submitted
            << " written: " << tally.summary() << "\n";

  expect_write_lands(*a, *src, *dst, 2, "to the peer it knew, after the sweep");
  FABRIC_ENGINE_OR_SKIP(c, config);
  auto fresh = make_buffer(*c, kBytes);
  expect_write_lands(*a, *src, *fresh, 3, "to a peer it never met, after the sweep");
  c.reset();
  b.reset();
  a.reset();
}

INSTANTIATE_TEST_SUITE_P(Backends, CorruptDescriptor,
                         ::testing::Values(Backend{"tcp", "tcp", false},
                                           Backend{"shm", "shm", false},
                                           Backend{"verbs", "verbs", false}),
                         backend_name);

}  // namespace
}  // namespace fabric::testing
