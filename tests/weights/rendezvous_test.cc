// fabric::weights' rendezvous (fabric/weights/rendezvous.h) through the real in-process and file
// registries: ranks publish their members, training rank 0 computes the schedule and publishes
// its header, the other ranks agree by digest; timeouts name what is missing, a rank reading
// other descriptions names both digests, a malformed header is refused naming it. No engine:
// the members carry hand-made addresses and descriptors.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <filesystem>

#include "fabric/weights/rendezvous.h"

namespace fabric::weights {
namespace {

using namespace std::chrono_literals;
using kv::FileRegistry;
using kv::LocalRegistry;
using kv::Registry;

Address fake_address(uint8_t id) {
  return Address("tcp", {NicAddress{Bytes{std::byte{id}, std::byte{7}}, 0x1000, 9}});
}

// Two training ranks holding the dim-0 halves of an [8, 8] bf16 `w`, two inference ranks each
// holding a dim-0 half (`block`: their FP8 tile, part of the layout and so of the schedule).
void publish_ranks(Registry& r, const std::string& group, uint32_t trainers, uint32_t inference,
                   uint32_t block = 128) {
  for (uint32_t t = 0; t < trainers; ++t) {
    TrainerRank rank{t, 1, {Shard{"w", DType::kBFloat16, {8, 8}, {{t * 4, 4}, {0, 8}}, 0}}};
    ASSERT_TRUE(publish_rank(r, group, Side::kTrainer, t, 2, fake_address(t), encode(rank)));
  }
  for (uint32_t i = 0; i < inference; ++i) {
    InferenceParam p{"w",
                     DType::kBFloat16,
                     {8, 8},
                     Placement{0, {i * 4, 4}},
                     Projection{ProjectionKind::kIdentity, {}, 0, block}};
    RemoteMemory region(fake_address(10 + i), 0x1000, 4096, {{0x1000, 5}});
    Endpoint e{InferenceRank{i, {p}}, {region}, {{Place{0, 0}, Place{0, 64}}}};
    ASSERT_TRUE(publish_rank(r, group, Side::kInference, i, 0, fake_address(10 + i), encode(e)));
  }
}

std::string message(const Status& s) {
  return s.message();
}

TEST(WeightsRendezvous, RankZeroPublishesTheHeaderAndAnotherRankAgrees) {
  auto shared = LocalRegistry::make_shared_state();
  LocalRegistry writer(shared), reader(shared);
  publish_ranks(writer, "g", 2, 2);
  auto published = publish_schedule(writer, "g", 2, 2, 1 << 20, 1s);
  ASSERT_TRUE(published) << published.status().to_string();
  EXPECT_EQ(published->schedule.num_trainers, 2u);
  EXPECT_EQ(published->endpoints.size(), 2u);
  EXPECT_EQ(published->inference_addresses[1], fake_address(11));
  EXPECT_EQ(published->trainers.size(), 2u);

  auto members = reader.members();
  ASSERT_TRUE(members);
  const auto header = std::find_if(members->begin(), members->end(),
                                   [](const auto& m) { return m.name == "g.schedule"; });
  ASSERT_NE(header, members->end());
  EXPECT_EQ(header->role, kScheduleRole);
  const Bytes bytes = published->schedule.encode();
  EXPECT_EQ(header->data, fmt::format("trainers=2 inference=2 chunk_bytes=1048576 bytes={} "
                                      "sha256={}",
                                      bytes.size(), sha256_hex(bytes)));

  auto agreed = agree_schedule(reader, "g", 1s);
  ASSERT_TRUE(agreed) << agreed.status().to_string();
  EXPECT_EQ(agreed->schedule, published->schedule);
  EXPECT_EQ(agreed->header, published->header);
  auto rank1 = connect_trainer(reader, "g", 1, 2, 2, 1 << 20, 1s);
  ASSERT_TRUE(rank1) << rank1.status().to_string();
  EXPECT_EQ(rank1->schedule, published->schedule);
  auto other_counts = connect_trainer(reader, "g", 1, 2, 3, 1 << 20, 1s);
  ASSERT_FALSE(other_counts);
  EXPECT_NE(message(other_counts.status())
                .find("schedule is for 2 training and 2 inference ranks, training rank 1 expects "
                      "2 and 3"),
            std::string::npos)
      << other_counts.status().to_string();

  auto peers = trainer_peers(reader, "g", 2);
  ASSERT_TRUE(peers);
  ASSERT_EQ(peers->size(), 2u);
  EXPECT_EQ((*peers)[1].name, "g.t1");
  EXPECT_EQ((*peers)[1].address, fake_address(1));

  // Rank 0 withdraws its member and the header; withdrawing again is no error.
  ASSERT_TRUE(withdraw_rank(writer, "g", Side::kTrainer, 0));
  ASSERT_TRUE(withdraw_rank(writer, "g", Side::kTrainer, 0));
  auto left = trainer_peers(reader, "g", 2);
  ASSERT_FALSE(left);
  EXPECT_EQ(left.status().code(), ErrorCode::kPeerUnreachable);
  EXPECT_EQ(message(left.status()), "1 of 2 training ranks are in the registry");
  auto gone = agree_schedule(reader, "g", 50ms);
  ASSERT_FALSE(gone);
  EXPECT_EQ(gone.status().code(), ErrorCode::kTimeout);
}

TEST(WeightsRendezvous, TimeoutsNameTheMissingHeaderOrRanks) {
  auto shared = LocalRegistry::make_shared_state();
  LocalRegistry r(shared);
  publish_ranks(r, "g", 2, 1);

  const auto started = std::chrono::steady_clock::now();
  auto no_header = agree_schedule(r, "g", 200ms);
  ASSERT_FALSE(no_header);
  EXPECT_GE(std::chrono::steady_clock::now() - started, 200ms) << "gave up before the timeout";
  EXPECT_EQ(no_header.status().code(), ErrorCode::kTimeout);
  EXPECT_EQ(message(no_header.status()),
            "weights: the schedule header (g.schedule) not in the registry after 0.2 s");

  auto rank0 = publish_schedule(r, "g", 2, 2, 1 << 20, 100ms);
  ASSERT_FALSE(rank0);
  EXPECT_EQ(rank0.status().code(), ErrorCode::kTimeout);
  EXPECT_EQ(message(rank0.status()),
            "weights: 2 training and 2 inference ranks (found 2 and 1) not in the registry after "
            "0.1 s");

  // The header names two inference ranks; one is missing.
  publish_ranks(r, "g", 2, 2);
  ASSERT_TRUE(publish_schedule(r, "g", 2, 2, 1 << 20, 1s));
  ASSERT_TRUE(r.leave("g.i1"));
  auto reader = agree_schedule(r, "g", 100ms);
  ASSERT_FALSE(reader);
  EXPECT_EQ(message(reader.status()),
            "weights: 2 training and 2 inference ranks (found 2 and 1) not in the registry after "
            "0.1 s");
  // Another group's members are not counted.
  publish_ranks(r, "other", 2, 2);
  EXPECT_FALSE(agree_schedule(r, "g", 50ms));
}

TEST(WeightsRendezvous, ARankReadingOtherDescriptionsNamesBothDigests) {
  auto shared = LocalRegistry::make_shared_state();
  LocalRegistry writer(shared), reader(shared);
  publish_ranks(writer, "g", 2, 2);
  auto published = publish_schedule(writer, "g", 2, 2, 1 << 20, 1s);
  ASSERT_TRUE(published);
  // The inference ranks publish again with another FP8 block: a rank computing now disagrees.
  publish_ranks(writer, "g", 2, 2, 64);
  auto agreed = agree_schedule(reader, "g", 1s);
  ASSERT_FALSE(agreed);
  EXPECT_EQ(agreed.status().code(), ErrorCode::kInvalidArgument);
  const ScheduleHeader& want = published->header;
  const Bytes now = compute_agreement(*reader.members(), "g", 2, 2, 1 << 20)->schedule.encode();
  EXPECT_EQ(message(agreed.status()),
            fmt::format("weights: the schedule computed here ({} bytes, sha256 {}...) differs "
                        "from training rank 0's ({} bytes, sha256 {}...): the ranks read "
                        "different descriptions from the registry",
                        now.size(), sha256_hex(now).substr(0, 16), want.bytes,
                        want.sha256.substr(0, 16)));
  EXPECT_NE(sha256_hex(now), want.sha256);
}

TEST(WeightsRendezvous, AMalformedHeaderIsRefusedNamingIt) {
  auto shared = LocalRegistry::make_shared_state();
  LocalRegistry r(shared);
  publish_ranks(r, "g", 2, 2);
  auto published = publish_schedule(r, "g", 2, 2, 1 << 20, 1s);
  ASSERT_TRUE(published);
  const std::string good = published->header.encode();
  kv::Member header{"g.schedule", std::string(kScheduleRole), "g", 1, 0, "", good};
  for (const std::string& bad :
       {std::string("trainers=2 inference=2 chunk_bytes=1048576 length=5 sha256=ab"),
        good.substr(0, good.size() - 1),                               // a digest one digit short
        "trainers=x " + good.substr(good.find("inference")),           // not a number
        "trainers=4294967296 " + good.substr(good.find("inference")),  // out of range
        good + " stray"}) {
    header.data = bad;
    ASSERT_TRUE(r.join(header));
    auto agreed = agree_schedule(r, "g", 1s);
    ASSERT_FALSE(agreed) << bad;
    EXPECT_EQ(agreed.status().code(), ErrorCode::kInvalidArgument);
    EXPECT_EQ(message(agreed.status()),
              "weights: the schedule header g.schedule is malformed: '" + bad.substr(0, 100) + "'");
  }
  header.data = good;
  ASSERT_TRUE(r.join(header));
  EXPECT_TRUE(agree_schedule(r, "g", 1s));
  auto decoded = ScheduleHeader::decode(header);
  ASSERT_TRUE(decoded);
  EXPECT_EQ(*decoded, published->header);
}

TEST(WeightsRendezvous, AgreedThroughFileRegistriesOfOneDirectory) {
  std::string dir = (std::filesystem::is_directory("/dev/shm") ? "/dev/shm" : "/tmp") +
                    std::string("/fabric-rendezvous-XXXXXX");
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  {
    kv::FileOptions o;
    o.directory = dir;
    o.poll_interval = 20ms;
    auto writer = FileRegistry::open(o);
    auto reader = FileRegistry::open(o);
    ASSERT_TRUE(writer && reader);
    publish_ranks(**writer, "g", 2, 2);
    auto published = publish_schedule(**writer, "g", 2, 2, 64, 1s);
    ASSERT_TRUE(published) << published.status().to_string();
    auto agreed = agree_schedule(**reader, "g", 1s);
    ASSERT_TRUE(agreed) << agreed.status().to_string();
    EXPECT_EQ(agreed->schedule, published->schedule);
    EXPECT_EQ(agreed->schedule.entries.size(), published->schedule.entries.size());
    // A member whose data is not hex is refused naming it.
    kv::Member broken{"g.i1", std::string(kInferenceRole), "g", 1,
                      1,      fake_address(3).to_hex(),    "zz"};
    ASSERT_TRUE((*writer)->join(broken));
    auto refused = agree_schedule(**reader, "g", 1s);
    ASSERT_FALSE(refused);
    EXPECT_EQ(refused.status().code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(message(refused.status()).find("weights: member g.i1: "), std::string::npos)
        << refused.status().to_string();
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace fabric::weights
