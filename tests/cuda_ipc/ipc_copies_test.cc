// IpcCopies (src/engine/ipc_copies.h), the owner's copies of the CUDA IPC path, without a
// domain or a GPU: the Commits started in one pass batched per GPU and launched together, each
// batch ending with its own jobs; Commits refused, or failed by their copies, ending with the
// reason.
#include "engine/ipc_copies.h"

#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "copier_double.h"
#include "engine/messages.h"
#include "fabric/address.h"

namespace fabric::engine {
namespace {

using testing::CopierDoubles;
using Clock = IpcCopies::Clock;

// TEST DOUBLE for the CUDA mapper: the writer's allocation is `source`, in this process.
class MapperDouble final : public IpcImports::Mapper {
 public:
  explicit MapperDouble(std::byte* source, int* opens) : source_(source), opens_(opens) {}
  Result<std::byte*> open(const cuda::IpcExport& e, const cuda::PointerInfo&,
                          const Origin&) override {
    if (e.handle.empty()) return Status(ErrorCode::kRemoteAccess, "the exporter is gone");
    ++*opens_;
    return source_;
  }
  void close(const cuda::IpcExport&, const Origin&) override {}

 private:
  std::byte* source_;
  int* opens_;
};

Address writer_address() {
  std::vector<NicAddress> nics{{Bytes{std::byte{1}}, 0x1000, 7}};
  return Address("tcp;ofi_rxm", nics, Origin::of_this_process(1));
}

struct Owner {
  std::vector<std::byte> source = std::vector<std::byte>(1 << 16);  // the writer's, mapped
  std::vector<std::byte> gpu0 = std::vector<std::byte>(1 << 16);
  std::vector<std::byte> gpu1 = std::vector<std::byte>(1 << 16);
  RegionTable regions;
  CopierDoubles copiers;
  int opens = 0;
  std::unique_ptr<IpcCopies> ipc;

  Owner() {
    add_region(1, gpu0, 0);
    add_region(2, gpu1, 1);
    ipc = std::make_unique<IpcCopies>(&regions, nullptr, IpcCopies::Options{1},
                                      std::make_unique<MapperDouble>(source.data(), &opens),
                                      copiers.factory());
  }
  void add_region(uint64_t id, std::vector<std::byte>& memory, int device) {
    auto r = std::make_shared<LocalRegion>();
    r->id = id;
    r->ptr = memory.data();
    r->length = memory.size();
    r->memory = {cuda::MemoryKind::kCuda, device};
    r->ipc = cuda::IpcExport{};  // exported: the path is open
    regions.add(std::move(r));
  }
  // A Commit into region `region` of `ranges` (offset in it, length), read from the writer's
  // source at `src_offsets`.
  std::unique_ptr<CommitJob> job(uint64_t region, std::vector<Range> ranges,
                                 std::vector<uint64_t> src_offsets) {
    auto j = std::make_unique<CommitJob>();
    j->commit.region = region;
    j->commit.reply_to = writer_address().encode();
    j->commit.ranges = std::move(ranges);
    IpcSource& s = j->commit.ipc.emplace();
    s.exported.kind = cuda::IpcExport::Kind::kCuda;
    s.exported.handle = Bytes{std::byte{0xab}};
    s.exported.offset = 0x100;
    s.length = source.size() - 0x100;
    s.offsets = std::move(src_offsets);
    return j;
  }
  std::vector<CommitJob*> take() {
    std::vector<CommitJob*> out;
    out.swap(ipc->done());
    return out;
  }
};

TEST(IpcCopies, CommitsOfOnePassAreBatchedPerGpuAndEndWithTheirJobs) {
  Owner o;
  auto a = o.job(1, {{0, 64}, {128, 32}}, {0, 1000});
  auto b = o.job(2, {{256, 16}}, {2000});
  auto c = o.job(1, {{4096, 8}}, {3000});
  for (CommitJob* j : {a.get(), b.get(), c.get()}) o.ipc->start(*j, Clock::time_point{});
  EXPECT_TRUE(o.take().empty());
  EXPECT_TRUE(o.ipc->has_open());
  EXPECT_EQ(o.opens, 1) << "one mapping of the writer's allocation";
  ASSERT_EQ(o.copiers.made.size(), 2u) << "a copier per GPU";
  auto& gpu0 = *o.copiers.made[0];
  auto& gpu1 = *o.copiers.made[1];
  EXPECT_EQ(gpu0.device.device, 0);
  EXPECT_EQ(gpu1.device.device, 1);
  EXPECT_TRUE(gpu0.device_copies.empty()) << "launched at the end of the pass";

  o.ipc->flush();
  EXPECT_FALSE(o.ipc->has_open());
  ASSERT_EQ(gpu0.device_copies.size(), 3u);
  EXPECT_EQ(gpu0.fenced.size(), 1u) << "one event for the batch";
  EXPECT_EQ(gpu0.device_copies[1].dst, o.gpu0.data() + 128);
  EXPECT_EQ(gpu0.device_copies[1].src, o.source.data() + 0x100 + 1000);
  EXPECT_EQ(gpu0.device_copies[1].bytes, 32u);
  EXPECT_EQ(gpu0.device_copies[2].dst, o.gpu0.data() + 4096);
  ASSERT_EQ(gpu1.device_copies.size(), 1u);
  EXPECT_EQ(gpu1.fenced.size(), 1u);

  EXPECT_FALSE(o.ipc->poll());
  gpu1.ready = 1;
  EXPECT_TRUE(o.ipc->poll());
  EXPECT_EQ(o.take(), (std::vector<CommitJob*>{b.get()}));
  EXPECT_TRUE(o.ipc->copying());
  gpu0.ready = 1;
  EXPECT_TRUE(o.ipc->poll());
  EXPECT_EQ(o.take(), (std::vector<CommitJob*>{a.get(), c.get()}));
  for (CommitJob* j : {a.get(), b.get(), c.get()}) EXPECT_TRUE(j->status.is_ok());
  EXPECT_FALSE(o.ipc->copying());

  auto d = o.job(2, {{0, 8}}, {0});
  o.ipc->start(*d, Clock::time_point{});
  o.ipc->flush();
  EXPECT_EQ(o.copiers.made.size(), 2u) << "the next pass reuses the GPU's copier";
  EXPECT_EQ(gpu1.fenced.size(), 2u);
}

// Ranges that continue the one before on both sides, in one Commit or the next of the pass,
// are one copy; a gap on either side starts another.
TEST(IpcCopies, RangesAdjacentOnBothSidesAreOneCopy) {
  Owner o;
  auto a = o.job(1, {{0, 64}, {64, 32}, {96, 8}}, {0, 64, 96});
  auto b = o.job(1, {{104, 16}, {200, 8}}, {104, 120});
  auto c = o.job(1, {{208, 8}}, {500});
  for (CommitJob* j : {a.get(), b.get(), c.get()}) o.ipc->start(*j, Clock::time_point{});
  o.ipc->flush();
  ASSERT_EQ(o.copiers.made.size(), 1u);
  const auto& copies = o.copiers.made[0]->device_copies;
  ASSERT_EQ(copies.size(), 3u);
  EXPECT_EQ(copies[0].dst, o.gpu0.data());
  EXPECT_EQ(copies[0].src, o.source.data() + 0x100);
  EXPECT_EQ(copies[0].bytes, 120u) << "four ranges of two Commits, adjacent on both sides";
  EXPECT_EQ(copies[1].dst, o.gpu0.data() + 200) << "a gap in the destination";
  EXPECT_EQ(copies[1].bytes, 8u);
  EXPECT_EQ(copies[2].dst, o.gpu0.data() + 208) << "adjacent here, not in the source";
  EXPECT_EQ(copies[2].src, o.source.data() + 0x100 + 500);
  o.copiers.made[0]->ready = 1;
  EXPECT_TRUE(o.ipc->poll());
  EXPECT_EQ(o.take(), (std::vector<CommitJob*>{a.get(), b.get(), c.get()}));
}

TEST(IpcCopies, ACopyThatFailsFailsItsBatchsJobsOnly) {
  Owner o;
  auto a = o.job(1, {{0, 64}}, {0});
  auto b = o.job(1, {{64, 64}}, {64});
  auto c = o.job(2, {{0, 64}}, {0});
  for (CommitJob* j : {a.get(), b.get(), c.get()}) o.ipc->start(*j, Clock::time_point{});
  o.ipc->flush();
  o.copiers.made[0]->fail_fence = 0;
  o.copiers.made[0]->ready = 1;
  o.copiers.made[1]->ready = 1;
  EXPECT_TRUE(o.ipc->poll());
  EXPECT_EQ(o.take(), (std::vector<CommitJob*>{a.get(), b.get(), c.get()}));
  EXPECT_EQ(a->status.code(), ErrorCode::kInternal);
  EXPECT_EQ(b->status.code(), ErrorCode::kInternal);
  EXPECT_TRUE(c->status.is_ok());
}

TEST(IpcCopies, RefusedCommitsEndAtOnceWithTheReason) {
  Owner o;
  auto unknown = o.job(9, {{0, 8}}, {0});
  auto too_long = o.job(1, {{(1 << 16) - 4, 8}}, {0});
  auto past_source = o.job(1, {{0, 8}}, {1 << 16});
  auto imm_only = o.job(1, {}, {});
  auto gone = o.job(1, {{0, 8}}, {0});
  gone->commit.ipc->exported.handle.clear();  // the mapper cannot open it
  for (CommitJob* j :
       {unknown.get(), too_long.get(), past_source.get(), imm_only.get(), gone.get()}) {
    o.ipc->start(*j, Clock::time_point{});
  }
  EXPECT_EQ(o.take(), (std::vector<CommitJob*>{unknown.get(), too_long.get(), past_source.get(),
                                               imm_only.get(), gone.get()}));
  EXPECT_EQ(unknown->status.code(), ErrorCode::kRemoteAccess);
  EXPECT_EQ(too_long->status.code(), ErrorCode::kRemoteAccess);
  EXPECT_EQ(past_source->status.code(), ErrorCode::kRemoteAccess);
  EXPECT_TRUE(imm_only->status.is_ok()) << "an immediate after acknowledged ranges";
  EXPECT_EQ(gone->status.code(), ErrorCode::kRemoteAccess);
  EXPECT_NE(gone->status.message().find("mapping the writer's CUDA IPC export"), std::string::npos);
  EXPECT_FALSE(o.ipc->has_open());
  EXPECT_TRUE(o.copiers.made.empty()) << "nothing was copied";
}

}  // namespace
}  // namespace fabric::engine
