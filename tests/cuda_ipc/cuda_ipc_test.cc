// The CUDA IPC path's CPU-side logic (docs/cuda-ipc.md): which way a write goes, the wire
// formats (the descriptor's CUDA IPC section, a Commit's IPC source), the import cache and its
// invalidation, and the FABRIC_CUDA_IPC override. The path end to end runs in
// tests/conformance/cuda_ipc_test.cc (on the GPU-memory double) and tests/gpu (on CUDA).
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <map>
#include <random>

#include "cuda/ipc_fd_channel.h"

#include "engine/ipc_imports.h"
#include "engine/ipc_select.h"
#include "engine/messages.h"
#include "fabric/address.h"

namespace fabric {
namespace {

using engine::IpcImports;
using engine::IpcRoute;
using Kind = IpcRoute::Kind;

Origin origin(uint32_t pid, uint64_t instance) {
  Origin o = Origin::of_this_process(instance);
  o.pid = pid;
  o.start_time = 1000 + pid;
  return o;
}

cuda::DeviceUuid uuid(uint8_t b) {
  cuda::DeviceUuid u{};
  u.fill(std::byte{b});
  return u;
}

RemoteMemory descriptor(const Origin& owner, std::optional<RemoteMemory::CudaIpc> ipc,
                        uint64_t staged = 0) {
  Address a("shm", {{Bytes(8, std::byte{1}), 0x1000, 1}}, owner);
  return RemoteMemory(a, 0x7000, 1 << 20, {{0x7000, 5}}, staged, ipc);
}

// GPU memory registered without a host mirror: no rails, only the CUDA IPC section.
RemoteMemory ipc_only_descriptor(const Origin& owner) {
  Address a("shm", {{Bytes(8, std::byte{1}), 0x1000, 1}}, owner);
  return RemoteMemory(a, 0x7000, 1 << 20, {}, 0, RemoteMemory::CudaIpc{uuid(8), 42});
}

cuda::IpcExport cuda_export(uint8_t tag) {
  cuda::IpcExport e;
  e.kind = cuda::IpcExport::Kind::kCuda;
  e.handle.assign(64, std::byte{tag});
  e.offset = 256;
  e.device = uuid(7);
  return e;
}

struct RouteCase {
  const Origin self = origin(100, 1);
  const Origin peer = origin(200, 2);  // same host, another process
  cuda::PointerInfo gpu{cuda::MemoryKind::kCuda, 0};
  cuda::IpcExport exported = cuda_export(1);
  bool reachable = true;
  IpcRoute route(Config::CudaIpc mode, const cuda::PointerInfo& src, const cuda::IpcExport* e,
                 const RemoteMemory& dst, bool src_ipc_only = false) const {
    return engine::choose_route(mode, self, src, e, "CUDA refused it", src_ipc_only, dst,
                                [this](const cuda::DeviceUuid&) { return reachable; });
  }
};

TEST(CudaIpcRoute, SameHostReachableGpusTakeThePath) {
  RouteCase c;
  const RemoteMemory dst = descriptor(c.peer, RemoteMemory::CudaIpc{uuid(8), 42});
  EXPECT_EQ(c.route(Config::CudaIpc::kAuto, c.gpu, &c.exported, dst).kind, Kind::kIpc);
  EXPECT_EQ(c.route(Config::CudaIpc::kOn, c.gpu, &c.exported, dst).kind, Kind::kIpc);
  const IpcRoute off = c.route(Config::CudaIpc::kOff, c.gpu, &c.exported, dst);
  EXPECT_EQ(off.kind, Kind::kFabric);
  EXPECT_NE(off.why.find("off"), std::string::npos);
}

TEST(CudaIpcRoute, EachReasonAgainstThePathIsNamed) {
  RouteCase c;
  const cuda::PointerInfo host{};
  const RemoteMemory with_ipc = descriptor(c.peer, RemoteMemory::CudaIpc{uuid(8), 42});
  std::map<std::string, IpcRoute> got;
  // The source is host memory, into GPU memory of a peer.
  got["host source"] = c.route(Config::CudaIpc::kAuto, host, nullptr, with_ipc);
  // No export of the source.
  got["no export"] = c.route(Config::CudaIpc::kAuto, c.gpu, nullptr, with_ipc);
  // A staged destination without a CUDA IPC section.
  got["no section"] = c.route(Config::CudaIpc::kAuto, c.gpu, &c.exported,
                              descriptor(c.peer, std::nullopt, /*staged=*/9));
  // Another host: another boot id.
  Origin far = c.peer;
  far.boot_id[0] ^= std::byte{1};
  got["other host"] = c.route(Config::CudaIpc::kAuto, c.gpu, &c.exported,
                              descriptor(far, RemoteMemory::CudaIpc{uuid(8), 42}));
  // This very process (CUDA cannot map its own exports).
  got["same process"] = c.route(Config::CudaIpc::kAuto, c.gpu, &c.exported,
                                descriptor(c.self, RemoteMemory::CudaIpc{uuid(8), 42}));
  c.reachable = false;
  got["unreachable"] = c.route(Config::CudaIpc::kAuto, c.gpu, &c.exported, with_ipc);
  const std::map<std::string, std::string> expected_why = {
      {"host source", "host memory"},        {"no export", "CUDA refused it"},
      {"no section", "no CUDA IPC section"}, {"other host", "another host"},
      {"same process", "this process"},      {"unreachable", "peer access"}};
  for (const auto& [name, route] : got) {
    SCOPED_TRACE(name);
    EXPECT_EQ(route.kind, Kind::kFabric);
    EXPECT_NE(route.why.find(expected_why.at(name)), std::string::npos) << route.why;
  }
  // The same cases with the path forced on are rejected, with the same reasons.
  c.reachable = true;
  const IpcRoute forced = c.route(Config::CudaIpc::kOn, host, nullptr, with_ipc);
  EXPECT_EQ(forced.kind, Kind::kRejected);
  EXPECT_NE(forced.why.find("host memory"), std::string::npos);
  // Host to host never involves the path, even forced on.
  EXPECT_EQ(c.route(Config::CudaIpc::kOn, host, nullptr, descriptor(c.peer, std::nullopt)).kind,
            Kind::kFabric);
}

// Host memory registered with RegisterOptions::gpu_copies: a same-host GPU source takes the
// path (the owner's GPU copies into it), host sources keep the fabric in every mode.
TEST(CudaIpcRoute, HostMemoryWithGpuCopiesTakesThePathFromGpuSourcesOnly) {
  RouteCase c;
  const RemoteMemory dst = descriptor(c.peer, RemoteMemory::CudaIpc{uuid(8), 42, /*host=*/true});
  EXPECT_EQ(c.route(Config::CudaIpc::kAuto, c.gpu, &c.exported, dst).kind, Kind::kIpc);
  EXPECT_EQ(c.route(Config::CudaIpc::kOn, c.gpu, &c.exported, dst).kind, Kind::kIpc);
  const cuda::PointerInfo host{};
  for (auto mode : {Config::CudaIpc::kAuto, Config::CudaIpc::kOn, Config::CudaIpc::kOff}) {
    const IpcRoute r = c.route(mode, host, nullptr, dst);
    EXPECT_EQ(r.kind, Kind::kFabric);
    if (mode != Config::CudaIpc::kOff) {
      EXPECT_TRUE(r.why.empty()) << r.why;
    }
  }
  c.reachable = false;  // the owner's GPU is not the source's, nor reachable from it
  const IpcRoute far = c.route(Config::CudaIpc::kAuto, c.gpu, &c.exported, dst);
  EXPECT_EQ(far.kind, Kind::kFabric);
  EXPECT_NE(far.why.find("peer access"), std::string::npos) << far.why;
}

// Memory registered without a host mirror has no fabric way: where the path is impossible the
// write is rejected in every mode, naming the side without a mirror and the reason.
TEST(CudaIpcRoute, MemoryWithoutAHostMirrorTakesThePathOrIsRejected) {
  RouteCase c;
  const RemoteMemory dst = ipc_only_descriptor(c.peer);
  EXPECT_TRUE(dst.ipc_only());
  EXPECT_FALSE(descriptor(c.peer, RemoteMemory::CudaIpc{uuid(8), 42}).ipc_only());
  EXPECT_EQ(c.route(Config::CudaIpc::kAuto, c.gpu, &c.exported, dst).kind, Kind::kIpc);
  Origin far = c.peer;
  far.boot_id[0] ^= std::byte{1};
  const cuda::PointerInfo host{};
  struct Case {
    const char* name;
    IpcRoute route;
    const char* why;
  };
  const Case cases[] = {
      {"host source", c.route(Config::CudaIpc::kAuto, host, nullptr, dst), "host memory"},
      {"other host", c.route(Config::CudaIpc::kAuto, c.gpu, &c.exported, ipc_only_descriptor(far)),
       "another host"},
      {"path off here", c.route(Config::CudaIpc::kOff, c.gpu, &c.exported, dst), "off"},
      {"source without a mirror, destination staged",
       c.route(Config::CudaIpc::kAuto, c.gpu, &c.exported, descriptor(c.peer, std::nullopt, 9),
               /*src_ipc_only=*/true),
       "no CUDA IPC section"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    EXPECT_EQ(k.route.kind, Kind::kRejected);
    EXPECT_NE(k.route.why.find("without a host mirror"), std::string::npos) << k.route.why;
    EXPECT_NE(k.route.why.find(k.why), std::string::npos) << k.route.why;
  }
  EXPECT_NE(cases[3].route.why.find("the source was registered"), std::string::npos);
  EXPECT_NE(cases[0].route.why.find("the destination was registered"), std::string::npos);
}

TEST(CudaIpcRoute, TheDoubleMayStayInOneProcess) {
  RouteCase c;
  cuda::IpcExport fake;
  fake.kind = cuda::IpcExport::Kind::kFake;
  fake.handle.assign(8, std::byte{3});
  const cuda::PointerInfo fake_mem{cuda::MemoryKind::kFake, 0};
  EXPECT_EQ(c.route(Config::CudaIpc::kAuto, fake_mem, &fake,
                    descriptor(c.self, RemoteMemory::CudaIpc{cuda::DeviceUuid{}, 42}))
                .kind,
            Kind::kIpc);
}

TEST(CudaIpcRoute, PlannedRangesMergeWhenBothEndsContinue) {
  engine::Transfer t;
  engine::add_ipc_range(t, 0, 0, 4096, 100);
  engine::add_ipc_range(t, 0, 100, 4196, 50);  // continues both ends: merged
  engine::add_ipc_range(t, 0, 150, 8192, 10);  // a gap at the destination
  engine::add_ipc_range(t, 1, 0, 0, 0);        // zero bytes: no range, but the destination
  engine::add_ipc_imm(t, 1, 9, 2);
  ASSERT_EQ(t.ipc.size(), 2u);
  ASSERT_EQ(t.ipc[0].ranges.size(), 2u);
  EXPECT_EQ(t.ipc[0].ranges[0].length, 150u);
  EXPECT_EQ(t.ipc[0].src_offsets[1], 150u);
  EXPECT_TRUE(t.ipc[1].ranges.empty());
  EXPECT_TRUE(t.ipc[1].has_imm);
  EXPECT_EQ(t.ipc[1].imm_times, 2u);
}

TEST(CudaIpcWire, DescriptorSectionRoundTripsAndOldVersionsStillDecode) {
  const Origin o = origin(200, 2);
  const RemoteMemory with = descriptor(o, RemoteMemory::CudaIpc{uuid(8), 42}, 9);
  Bytes bytes = with.encode();
  EXPECT_EQ(static_cast<uint8_t>(bytes[4]), 3);
  auto back = RemoteMemory::decode(bytes);
  ASSERT_TRUE(back) << back.status().to_string();
  EXPECT_EQ(*back, with);
  ASSERT_TRUE(back->cuda_ipc());
  EXPECT_EQ(back->cuda_ipc()->region, 42u);
  EXPECT_EQ(back->cuda_ipc()->device, uuid(8));
  // Without the section the descriptor stays version 2, readable by older engines.
  const RemoteMemory without = descriptor(o, std::nullopt, 9);
  Bytes v2 = without.encode();
  EXPECT_EQ(static_cast<uint8_t>(v2[4]), 2);
  ASSERT_TRUE(RemoteMemory::decode(v2));
  EXPECT_FALSE(RemoteMemory::decode(v2)->cuda_ipc());
  // Version 3 with the flag 0 is the same descriptor.
  Bytes v3_none = v2;
  v3_none[4] = std::byte{3};
  v3_none.push_back(std::byte{0});
  auto none = RemoteMemory::decode(v3_none);
  ASSERT_TRUE(none) << none.status().to_string();
  EXPECT_EQ(*none, without);
  // Malformed sections: a bad flag, a truncated section, region 0, a version from the future.
  Bytes bad_flag = v3_none;
  bad_flag.back() = std::byte{2};
  Bytes truncated(bytes.begin(), bytes.end() - 3);
  Bytes region0 = bytes;
  std::fill(region0.end() - 8, region0.end(), std::byte{0});
  Bytes future = bytes;
  future[4] = std::byte{6};
  for (const Bytes* b : {&bad_flag, &truncated, &region0, &future}) {
    auto r = RemoteMemory::decode(*b);
    ASSERT_FALSE(r);
    EXPECT_EQ(r.status().code(), ErrorCode::kInvalidArgument);
    EXPECT_FALSE(r.status().message().empty());
  }
}

// Version 4: a descriptor of memory only CUDA IPC reaches has no rails; one with rails keeps
// version 3, and no rails without the section (or for a staged region) is malformed.
// Malformed descriptors by name: their bytes, and what the refusal must say.
using Refusals = std::map<std::string, std::pair<const Bytes*, std::string>>;

void expect_refused(const Refusals& bad) {
  for (const auto& [name, b] : bad) {
    SCOPED_TRACE(name);
    auto r = RemoteMemory::decode(*b.first);
    ASSERT_FALSE(r);
    EXPECT_EQ(r.status().code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(b.second), std::string::npos) << r.status().message();
  }
}

TEST(CudaIpcWire, DescriptorsWithoutRailsAreVersion4AndNeedTheSection) {
  const Origin o = origin(200, 2);
  const RemoteMemory only = ipc_only_descriptor(o);
  Bytes bytes = only.encode();
  EXPECT_EQ(static_cast<uint8_t>(bytes[4]), 4);
  auto back = RemoteMemory::decode(bytes);
  ASSERT_TRUE(back) << back.status().to_string();
  EXPECT_EQ(*back, only);
  EXPECT_TRUE(back->ipc_only());
  EXPECT_TRUE(back->rails().empty());
  // The same bytes claiming version 3: 0 rails for an owner with 1 NIC.
  Bytes as_v3 = bytes;
  as_v3[4] = std::byte{3};
  // No section (flag 0, UUID and region dropped).
  Bytes no_section(bytes.begin(), bytes.end() - 25);
  no_section.push_back(std::byte{0});
  // A staged region with no rails (the u64 before the flag).
  Bytes staged = bytes;
  staged[bytes.size() - 25 - 8] = std::byte{9};
  const Refusals bad = {{"version 3", {&as_v3, "0 rails"}},
                        {"no section", {&no_section, "no rails and no CUDA IPC section"}},
                        {"staged", {&staged, "staged region"}}};
  expect_refused(bad);
}

// Host memory registered with RegisterOptions::gpu_copies: rails, no staged region, and a
// section with the host flag (flag byte 2), which only version 5 holds.
TEST(CudaIpcWire, HostMemorySectionsAreVersion5AndNeedRails) {
  const Origin o = origin(200, 2);
  Address a("shm", {{Bytes(8, std::byte{1}), 0x1000, 1}}, o);
  const RemoteMemory host(a, 0x7000, 1 << 20, {{0x7000, 5}}, 0,
                          RemoteMemory::CudaIpc{uuid(8), 42, /*host=*/true});
  Bytes bytes = host.encode();
  EXPECT_EQ(static_cast<uint8_t>(bytes[4]), 5);
  EXPECT_EQ(static_cast<uint8_t>(bytes[bytes.size() - 25]), 2);  // the flag before UUID, region
  auto back = RemoteMemory::decode(bytes);
  ASSERT_TRUE(back) << back.status().to_string();
  EXPECT_EQ(*back, host);
  EXPECT_TRUE(back->cuda_ipc()->host);
  EXPECT_FALSE(back->ipc_only());
  // A GPU section with rails is still version 3, flag 1.
  const RemoteMemory gpu(a, 0x7000, 1 << 20, {{0x7000, 5}}, 0, RemoteMemory::CudaIpc{uuid(8), 42});
  EXPECT_EQ(static_cast<uint8_t>(gpu.encode()[4]), 3);
  // Flag 2 claimed by version 4; flag 3; a host section without rails; one with a staged region.
  Bytes as_v4 = bytes;
  as_v4[4] = std::byte{4};
  Bytes flag3 = bytes;
  flag3[bytes.size() - 25] = std::byte{3};
  Bytes no_rails =
      RemoteMemory(a, 0x7000, 1 << 20, {}, 0, RemoteMemory::CudaIpc{uuid(8), 42}).encode();
  no_rails[4] = std::byte{5};
  no_rails[no_rails.size() - 25] = std::byte{2};
  Bytes staged = bytes;
  staged[bytes.size() - 25 - 8] = std::byte{9};
  const Refusals bad = {{"version 4", {&as_v4, "bad CUDA IPC flag"}},
                        {"flag 3", {&flag3, "bad CUDA IPC flag"}},
                        {"no rails", {&no_rails, "host memory needs rails"}},
                        {"staged", {&staged, "host memory needs rails and no staged region"}}};
  expect_refused(bad);
}

engine::Commit ipc_commit() {
  engine::Commit c;
  c.transfer = 5;
  c.reply_to = Bytes(20, std::byte{9});
  c.region = 77;
  c.has_imm = true;
  c.imm = 3;
  c.imm_times = 2;
  c.ranges = {{0, 4096}, {8192, 64}};
  engine::IpcSource& s = c.ipc.emplace();
  s.exported = cuda_export(4);
  s.region = 12;
  s.length = 1 << 20;
  s.offsets = {100, 200};
  return c;
}

TEST(CudaIpcWire, CommitWithAnIpcSourceRoundTrips) {
  const engine::Commit c = ipc_commit();
  const Bytes m = c.encode();
  EXPECT_EQ(m.size(), engine::Commit::kFixedBytes + c.reply_to.size() +
                          2 * engine::Commit::kRangeBytes + engine::Commit::kIpcFixedBytes + 64 +
                          2 * engine::Commit::kIpcRangeBytes);
  auto back = engine::Commit::decode(std::span(m).subspan(engine::kMessageHeaderBytes));
  ASSERT_TRUE(back);
  ASSERT_TRUE(back->ipc);
  EXPECT_EQ(*back->ipc, *c.ipc);
  EXPECT_EQ(back->encode(), m);
  // A Commit without the trailer (the staged path) decodes as before.
  engine::Commit plain = c;
  plain.ipc.reset();
  const Bytes pm = plain.encode();
  auto pb = engine::Commit::decode(std::span(pm).subspan(engine::kMessageHeaderBytes));
  ASSERT_TRUE(pb);
  EXPECT_FALSE(pb->ipc);
}

TEST(CudaIpcWire, MalformedIpcTrailersAreRejected) {
  const Bytes m = ipc_commit().encode();
  const auto body = [](const Bytes& b) {
    return std::span(b).subspan(engine::kMessageHeaderBytes);
  };
  const size_t trailer = m.size() - (engine::Commit::kIpcFixedBytes + 64 + 16);
  Bytes short_offsets(m.begin(), m.end() - 8);  // one source offset missing
  Bytes extra = m;
  extra.push_back(std::byte{0});
  Bytes bad_flag = m;
  bad_flag[trailer] = std::byte{2};
  Bytes bad_kind = m;
  bad_kind[trailer + 1] = std::byte{9};
  Bytes long_handle = m;
  long_handle[trailer + 2] = std::byte{65};
  for (const Bytes* b : {&short_offsets, &extra, &bad_flag, &bad_kind, &long_handle}) {
    EXPECT_FALSE(engine::Commit::decode(body(*b)));
  }
}

// TEST DOUBLE for the CUDA mapper (no GPU here): hands out fake addresses and counts what is
// mapped, so the cache's invalidation can be checked.
class CountingMapperDouble final : public IpcImports::Mapper {
 public:
  struct Counts {
    int opens = 0;
    int closes = 0;
    std::map<Bytes, int> open_now;
  };
  explicit CountingMapperDouble(Counts* counts) : counts_(counts) {}
  Result<std::byte*> open(const cuda::IpcExport& e, const cuda::PointerInfo&,
                          const Origin&) override {
    if (e.handle.empty()) return Status(ErrorCode::kRemoteAccess, "the exporter is gone");
    ++counts_->opens;
    ++counts_->open_now[e.handle];
    return reinterpret_cast<std::byte*>(0x100000 * counts_->opens);
  }
  void close(const cuda::IpcExport& e, const Origin&) override {
    ++counts_->closes;
    if (--counts_->open_now[e.handle] == 0) counts_->open_now.erase(e.handle);
  }

 private:
  Counts* counts_;
};

TEST(CudaIpcImports, EachWriterAllocationIsMappedOnceAndReused) {
  CountingMapperDouble::Counts n;
  const auto t0 = IpcImports::Clock::now();
  {
    IpcImports imports(std::make_unique<CountingMapperDouble>(&n), std::chrono::seconds(10), 16);
    const cuda::PointerInfo into{cuda::MemoryKind::kCuda, 0};
    auto a = imports.map(origin(200, 1), cuda_export(1), into, t0);
    auto again = imports.map(origin(200, 1), cuda_export(1), into, t0);
    ASSERT_TRUE(a && again);
    EXPECT_EQ((*a)->base, (*again)->base);
    // Another allocation of the same writer, and the same handle from another process.
    ASSERT_TRUE(imports.map(origin(200, 1), cuda_export(2), into, t0));
    ASSERT_TRUE(imports.map(origin(300, 1), cuda_export(1), into, t0));
    EXPECT_EQ(n.opens, 3);
    EXPECT_EQ(imports.size(), 3u);
    // A refused mapping is an error, and nothing is cached.
    cuda::IpcExport gone = cuda_export(3);
    gone.handle.clear();
    auto refused = imports.map(origin(200, 1), gone, into, t0);
    ASSERT_FALSE(refused);
    EXPECT_EQ(refused.status().code(), ErrorCode::kRemoteAccess);
    EXPECT_EQ(imports.size(), 3u);
  }
  EXPECT_EQ(n.closes, 3);  // everything unmapped with the cache
  EXPECT_TRUE(n.open_now.empty());
}

TEST(CudaIpcImports, SweepDropsIdleAndOrphanedMappingsButNeverOneInUse) {
  CountingMapperDouble::Counts n;
  IpcImports imports(std::make_unique<CountingMapperDouble>(&n), std::chrono::seconds(10), 16);
  const cuda::PointerInfo into{cuda::MemoryKind::kCuda, 0};
  const auto t0 = IpcImports::Clock::now();
  auto held = imports.map(origin(200, 1), cuda_export(1), into, t0);  // a copy reads from it
  ASSERT_TRUE(held);
  ASSERT_TRUE(imports.map(origin(200, 1), cuda_export(2), into, t0));
  ASSERT_TRUE(imports.map(origin(300, 1), cuda_export(3), into, t0 + std::chrono::seconds(8)));
  auto all_alive = [](const Origin&) { return true; };
  EXPECT_EQ(imports.sweep(t0 + std::chrono::seconds(5), all_alive), 0u);
  // Past the idle timeout of the first two: the leased one stays.
  EXPECT_EQ(imports.sweep(t0 + std::chrono::seconds(11), all_alive), 1u);
  EXPECT_EQ(imports.size(), 2u);
  // Writer 300 died: its mapping goes although it is not idle yet.
  auto dead_300 = [](const Origin& o) { return o.pid != 300; };
  EXPECT_EQ(imports.sweep(t0 + std::chrono::seconds(11), dead_300), 1u);
  EXPECT_EQ(imports.size(), 1u);
  // Once the copy lets go, the idle one goes too.
  held->reset();
  EXPECT_EQ(imports.sweep(t0 + std::chrono::seconds(11), all_alive), 1u);
  EXPECT_EQ(imports.size(), 0u);
  EXPECT_EQ(n.opens, 3);
  EXPECT_EQ(n.closes, 3);
}

TEST(CudaIpcImports, TheBoundEvictsTheLeastRecentlyUsedMappingNotInUse) {
  CountingMapperDouble::Counts n;
  IpcImports imports(std::make_unique<CountingMapperDouble>(&n), std::chrono::seconds(10), 2);
  const cuda::PointerInfo into{cuda::MemoryKind::kCuda, 0};
  const auto t0 = IpcImports::Clock::now();
  auto oldest_held = imports.map(origin(200, 1), cuda_export(1), into, t0);
  ASSERT_TRUE(imports.map(origin(200, 1), cuda_export(2), into, t0 + std::chrono::seconds(1)));
  ASSERT_TRUE(imports.map(origin(200, 1), cuda_export(3), into, t0 + std::chrono::seconds(2)));
  EXPECT_EQ(imports.size(), 2u);
  EXPECT_EQ(n.open_now.count(cuda_export(1).handle), 1u);  // in use: kept
  EXPECT_EQ(n.open_now.count(cuda_export(2).handle), 0u);  // evicted
  // All in use: the bound is exceeded rather than a mapping pulled from under a copy.
  auto h3 = imports.map(origin(200, 1), cuda_export(3), into, t0 + std::chrono::seconds(3));
  auto h4 = imports.map(origin(200, 1), cuda_export(4), into, t0 + std::chrono::seconds(4));
  ASSERT_TRUE(h3 && h4);
  EXPECT_EQ(imports.size(), 3u);
}

// The fd socket with real sockets and a real descriptor (a memfd standing in for a VMM
// allocation's): another process of this user fetches it and reads the same bytes.
TEST(CudaIpcFdChannel, ADescriptorTravelsToAnotherProcess) {
  int memfd = memfd_create("fabric-fd-test", MFD_CLOEXEC);
  ASSERT_GE(memfd, 0);
  ASSERT_EQ(write(memfd, "fabric", 6), 6);
  const std::string name =
      "fabric-ipc-test." + std::to_string(getpid()) + "." + std::to_string(std::random_device{}());
  auto server = cuda::FdServer::start(name, [memfd](uint64_t id) -> Result<int> {
    if (id != 7) return Status(ErrorCode::kNotFound, "no export " + std::to_string(id));
    return dup(memfd);
  });
  ASSERT_TRUE(server) << server.status().to_string();
  // A second server cannot take the same name.
  EXPECT_FALSE(cuda::FdServer::start(name, [](uint64_t) -> Result<int> { return -1; }));
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto fd = cuda::fetch_fd(name, 7, std::chrono::milliseconds(2000));
    char buf[6] = {};
    const bool same =
        fd && pread(*fd, buf, 6, 0) == 6 && std::memcmp(buf, "fabric", 6) == 0 && *fd != memfd;
    _exit(same ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the child read another file";
  // An id the server does not know: its reason comes back.
  auto unknown = cuda::fetch_fd(name, 8, std::chrono::milliseconds(2000));
  ASSERT_FALSE(unknown);
  EXPECT_EQ(unknown.status().code(), ErrorCode::kRemoteAccess);
  EXPECT_NE(unknown.status().message().find("no export 8"), std::string::npos)
      << unknown.status().to_string();
  server->reset();
  // No server (its process gone): a clear error, at once.
  auto gone = cuda::fetch_fd(name, 7, std::chrono::milliseconds(2000));
  ASSERT_FALSE(gone);
  EXPECT_EQ(gone.status().code(), ErrorCode::kRemoteAccess);
  EXPECT_NE(gone.status().message().find("gone"), std::string::npos) << gone.status().to_string();
  close(memfd);
}

TEST(CudaIpcConfig, TheModeComesFromTheEnvironment) {
  Config c;
  EXPECT_EQ(c.cuda_ipc, Config::CudaIpc::kAuto);
  setenv("FABRIC_CUDA_IPC", "off", 1);
  ASSERT_TRUE(c.apply_env_overrides());
  EXPECT_EQ(c.cuda_ipc, Config::CudaIpc::kOff);
  setenv("FABRIC_CUDA_IPC", "on", 1);
  ASSERT_TRUE(c.apply_env_overrides());
  EXPECT_EQ(c.cuda_ipc, Config::CudaIpc::kOn);
  setenv("FABRIC_CUDA_IPC", "yes", 1);
  Status s = c.apply_env_overrides();
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("FABRIC_CUDA_IPC"), std::string::npos);
  unsetenv("FABRIC_CUDA_IPC");
  EXPECT_STREQ(engine::cuda_ipc_mode_name(Config::CudaIpc::kOn), "on");
}

}  // namespace
}  // namespace fabric
