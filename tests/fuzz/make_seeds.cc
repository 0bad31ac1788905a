// Writes the seed corpora of the fuzz targets, made by the real encoders, into DIR/<target>/:
//   fuzz_make_seeds tests/fuzz/corpus
// The seeds are checked in; rerun this after a wire format changes.
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "engine/messages.h"
#include "fabric/address.h"

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

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
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
  return 0;
}
