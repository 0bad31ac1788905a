// Writes the seed corpora of the fuzz targets, made by the real encoders, into DIR/<target>/:
//   fuzz_make_seeds tests/fuzz/corpus
// The seeds are checked in; rerun this after a wire format changes.
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "engine/messages.h"
#include "ep_configs.h"
#include "fabric/address.h"
#include "fabric/weights.h"
#include "transport/shm/shm_ring.h"

using namespace fabric;

namespace {

void write(const std::filesystem::path& dir, const std::string& name, const Bytes& bytes) {
  std::filesystem::create_directories(dir);
  std::ofstream out(dir / name, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

void write(const std::filesystem::path& dir, const std::string& name, const std::string& text) {
  write(dir, name,
        Bytes(reinterpret_cast<const std::byte*>(text.data()),
              reinterpret_cast<const std::byte*>(text.data()) + text.size()));
}

Bytes name_bytes(const std::string& s) {
  return Bytes(reinterpret_cast<const std::byte*>(s.data()),
               reinterpret_cast<const std::byte*>(s.data()) + s.size());
}

weights::Schedule schedule(const std::vector<weights::TrainerRank>& trainers,
                           const std::vector<weights::InferenceRank>& inference,
                           uint64_t chunk_bytes) {
  auto s = weights::compute_schedule(trainers, inference, {.chunk_bytes = chunk_bytes});
  if (!s) {
    std::fprintf(stderr, "fuzz_make_seeds: %s\n", s.status().to_string().c_str());
    std::exit(1);
  }
  return std::move(s).value();
}

// fabric::weights: the descriptions of two layouts (the second one of
// tests/weights/schedule_test.cc) and the schedules computed from them.
void write_weights(const std::filesystem::path& dir) {
  using namespace weights;
  auto shard = [](std::string name, Shape shape, std::vector<Range> box = {},
                  uint32_t replica = 0) {
    return Shard{std::move(name), DType::kBFloat16, std::move(shape), std::move(box), replica};
  };
  auto param = [](std::string name, Shape shape, Placement placement = {},
                  Projection projection = {}, DType d = DType::kBFloat16) {
    return InferenceParam{std::move(name), d, std::move(shape), placement, std::move(projection)};
  };
  // HSDP trainers, two replicas (ranks 0 and 1 hold dim-0 halves, rank 2 with two NICs holds
  // everything and the norm) into two TP ranks: column slices of w, row slices of o, the norm
  // whole on each.
  const std::vector<TrainerRank> hsdp = {
      {0, 1, {shard("w", {64, 32}, {{0, 32}, {0, 32}}), shard("o", {32, 64}, {{0, 16}, {0, 64}})}},
      {1,
       1,
       {shard("w", {64, 32}, {{32, 32}, {0, 32}}), shard("o", {32, 64}, {{16, 16}, {0, 64}})}},
      {2,
       2,
       {shard("w", {64, 32}, {}, 1), shard("o", {32, 64}, {}, 1), shard("norm", {32}, {}, 1)}}};
  std::vector<InferenceRank> tp(2);
  for (uint32_t r = 0; r < 2; ++r) {
    tp[r] = {r,
             {param("w", {64, 32}, {0, {r * 32, 32}}), param("o", {32, 64}, {1, {r * 32, 32}}),
              param("norm", {32})}};
  }
  write(dir, "trainer_hsdp_half", encode(hsdp[1]));
  write(dir, "trainer_hsdp_replica", encode(hsdp[2]));
  write(dir, "inference_tp", encode(tp[1]));
  write(dir, "schedule_hsdp_tp", schedule(hsdp, tp, 512).encode());
  // One trainer with two NICs into one rank with fused QKV and an FP8 weight with its scales.
  const TrainerRank t{
      0,
      2,
      {shard("q", {8, 16}), shard("k", {4, 16}), shard("v", {4, 16}), shard("up", {256, 200})}};
  const InferenceRank r{
      0,
      {param("qkv", {16, 16}, {}, {ProjectionKind::kConcat, {"q", "k", "v"}, 0, 128}),
       param("up", {256, 200}, {}, {ProjectionKind::kFp8Quantize, {}, 0, 128}, DType::kFloat8E4M3),
       param("up.scale", {2, 2}, {}, {ProjectionKind::kFp8Scale, {"up"}, 0, 128},
             DType::kFloat32)}};
  write(dir, "trainer_qkv_up", encode(t));
  write(dir, "inference_qkv_fp8", encode(r));
  write(dir, "schedule_qkv_fp8", schedule({t}, {r}, ScheduleOptions{}.chunk_bytes).encode());
}

// fabric::ep: rank handles of the configurations of ep_configs.h; those of two nodes carry a
// proxy handle (opaque to decode_handle: here an engine address), and one is from the process of
// the target's own rank 0 (pid 100).
void write_ep_handles(const std::filesystem::path& dir, const Bytes& proxy) {
  const auto configs = ep::fuzz::configs();
  write(dir, "one_node_rank1", ep::encode(ep::fuzz::handle(configs[0], 1, 101)));
  write(dir, "one_node_rank1_same_process", ep::encode(ep::fuzz::handle(configs[0], 1, 100)));
  for (int rank : {1, 2}) {
    ep::PeerHandle h = ep::fuzz::handle(configs[1], rank, 100 + static_cast<uint64_t>(rank));
    h.proxy = proxy;
    write(dir, "two_nodes_rank" + std::to_string(rank), ep::encode(h));
  }
}

// One slot of the shm transport as fuzz_shm_ring reads it: the head (u32), how far the tail is
// ahead of it (u32), then the ring's 4096 bytes, written by the real RingWriter starting at
// `start` (near the end: the records wrap, with a pad record).
void write_shm_ring(const std::filesystem::path& dir, const std::string& name, uint32_t start) {
  namespace shm = transport::shm;
  constexpr uint64_t kRing = 4096;
  alignas(64) std::array<std::byte, sizeof(shm::SlotHeader) + kRing> memory{};
  auto* slot = new (memory.data()) shm::SlotHeader{};
  slot->head = slot->tail = start;
  shm::RingWriter writer(slot, kRing);
  auto record = [](shm::RecordKind kind, uint8_t flags, uint64_t length) {
    shm::Record r{};
    r.kind = kind;
    r.flags = flags;
    r.token = 7;
    r.seq = 1;
    r.length = length;
    r.total = length;
    return r;
  };
  const std::array<char, 100> text{'h', 'i'};
  writer.push(record(shm::RecordKind::kSend, shm::kFirst | shm::kLast, 100), text.data(), 100);
  writer.push(record(shm::RecordKind::kWrite, shm::kFirst | shm::kHasImm, 64), text.data(), 64);
  writer.push(record(shm::RecordKind::kWrite, shm::kLast, 10), text.data(), 10);
  writer.push(record(shm::RecordKind::kWrite, shm::kCma | shm::kFirst | shm::kLast, 1 << 20),
              nullptr, 0);
  writer.push(record(shm::RecordKind::kAck, 0, 0), nullptr, 0);
  Bytes out(8 + kRing);
  const uint32_t ahead = static_cast<uint32_t>(slot->tail - start);
  std::memcpy(out.data(), &start, 4);
  std::memcpy(out.data() + 4, &ahead, 4);
  std::memcpy(out.data() + 8, shm::ring_of(slot), kRing);
  write(dir, name, out);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 || argv[1][0] == '-') {  // not an option taken for a directory
    std::fprintf(stderr, "usage: fuzz_make_seeds DIR\n");
    return 2;
  }
  const std::filesystem::path root = argv[1];
  // tcp names are sockaddr_in (16 bytes); shm names are strings.
  const Address tcp1("tcp;ofi_rxm", {{name_bytes(std::string("\x02\x00\x1f\x90\x7f\x00\x00\x01"
                                                             "\x00\x00\x00\x00\x00\x00\x00\x00",
                                                             16)),
                                      0x7f0000001000, 42}});
  const Address shm2("shm", {{name_bytes("fi_shm://1234:0"), 0x1000, 1},
                             {name_bytes("fi_shm://1234:1"), 0x2000, 2}});
  write(root / "address", "tcp_1nic", tcp1.encode());
  write(root / "address", "shm_2nic", shm2.encode());
  write(root / "address", "tcp_1nic_hex", tcp1.to_hex());

  const RemoteMemory m1(tcp1, 0x7f0000100000, 1 << 20, {{0x7f0000100000, 7}});
  const RemoteMemory m2(shm2, 0x1000, 4096, {{0x1000, 3}, {0x1000, 4}}, 9);
  write(root / "descriptor", "tcp_1rail", m1.encode());
  write(root / "descriptor", "shm_2rail_staged", m2.encode());
  write(root / "descriptor", "tcp_1rail_hex", m1.to_hex());
  Bytes v1 = m1.encode();  // version 1: no staged region
  v1[4] = std::byte{1};
  v1.resize(v1.size() - 8);
  write(root / "descriptor", "tcp_1rail_v1", v1);
  std::array<std::byte, 16> gpu{};
  gpu.fill(std::byte{0x5a});
  const RemoteMemory m3(shm2, 0x1000, 4096, {{0x1000, 3}, {0x1000, 4}}, 9,
                        RemoteMemory::CudaIpc{gpu, 0x1234});
  write(root / "descriptor", "shm_2rail_cuda_ipc", m3.encode());
  // Version 4: GPU memory registered without a host mirror, no rails.
  const RemoteMemory m4(shm2, 0x1000, 4096, {}, 0, RemoteMemory::CudaIpc{gpu, 0x1235});
  write(root / "descriptor", "shm_ipc_only", m4.encode());
  // Version 5: host memory registered with gpu_copies (rails, and the section's host flag).
  const RemoteMemory m5(shm2, 0x1000, 4096, {{0x1000, 3}, {0x1000, 4}}, 0,
                        RemoteMemory::CudaIpc{gpu, 0x1236, /*host=*/true});
  write(root / "descriptor", "shm_2rail_gpu_copies", m5.encode());
  // Version 6: readable by peers (the flags byte), with and without a CUDA IPC section.
  const RemoteMemory m6(tcp1, 0x7f0000100000, 1 << 20, {{0x7f0000100000, 7}}, 0, std::nullopt,
                        /*readable=*/true);
  write(root / "descriptor", "tcp_1rail_readable", m6.encode());
  const RemoteMemory m7(shm2, 0x1000, 4096, {{0x1000, 3}, {0x1000, 4}}, 0,
                        RemoteMemory::CudaIpc{gpu, 0x1237, /*host=*/true}, /*readable=*/true);
  write(root / "descriptor", "shm_2rail_gpu_copies_readable", m7.encode());

  engine::Commit commit;
  commit.transfer = 17;
  commit.reply_to = tcp1.encode();
  commit.region = 5;
  commit.has_imm = true;
  commit.imm = 99;
  commit.imm_times = 3;
  commit.ranges = {{0, 4096}, {8192, 100}};
  write(root / "messages", "commit", commit.encode());
  engine::IpcSource& ipc = commit.ipc.emplace();
  ipc.exported.kind = cuda::IpcExport::Kind::kCuda;
  ipc.exported.handle.assign(64, std::byte{0x11});
  ipc.exported.offset = 512;
  ipc.exported.device = gpu;
  ipc.region = 6;
  ipc.length = 1 << 20;
  ipc.offsets = {0, 4096};
  write(root / "messages", "commit_cuda_ipc", commit.encode());
  commit.ipc.reset();
  commit.ranges.clear();
  commit.region = 0;
  write(root / "messages", "commit_reliable_imm", commit.encode());
  write(root / "messages", "ack_ok", engine::Ack{17, 1, ErrorCode::kOk, ""}.encode());
  write(
      root / "messages", "ack_error",
      engine::Ack{17, 2, ErrorCode::kRemoteAccess, "staged region 0x5 is not registered"}.encode());
  write(root / "messages", "fence_ack",
        engine::FenceNote{engine::MessageKind::kFenceAck, 9, 1, commit.reply_to}.encode());
  Bytes user(engine::kMessageHeaderBytes);
  user[0] = std::byte{1};
  user.push_back(std::byte{'h'});
  user.push_back(std::byte{'i'});
  write(root / "messages", "user", user);

  write(root / "config", "all_set", std::string("tcp\nlo,eth0\n3\n200\n50"));
  write(root / "config", "provider_only", std::string("shm"));
  write(root / "config", "special_cpu", std::string("efa\nrdmap0s1-rdm\n-2\n0\n0"));

  write_weights(root / "weights");
  write_ep_handles(root / "ep_handle", tcp1.encode());
  write_shm_ring(root / "shm_ring", "records", 0);
  write_shm_ring(root / "shm_ring", "records_wrapping", 4096 - 192);
  return 0;
}
