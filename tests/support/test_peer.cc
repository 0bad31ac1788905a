// The other process of the two-process conformance tests and of the netlab tests. It opens an
// engine (on the NICs named by the optional fourth argument, comma-separated), registers one
// buffer, prints its address and descriptor, then obeys line commands on stdin:
//   fill SEED                          fill the buffer with the test pattern
//   expect IMM COUNT                   wait (30 s at most) for COUNT arrivals of IMM
//   checksum OFFSET LENGTH             FNV-1a of a range of the buffer
//   write DESC_HEX SRC DST LEN IMM     single write from the buffer into DESC, then report
//   messages COUNT                     wait (30 s at most) until COUNT distinct messages "msg K"
//                                      arrived; report distinct, duplicate and malformed ones
//   unregister                         unregister the buffer (its descriptor goes stale)
//   spam N DESC_HEX SRC DST LEN IMM    submit N single writes into DESC and report at once
//   quit
// With FABRIC_TEST_PEER_MEMORY=cuda (CUDA builds) the buffer is CUDA memory (cudaMalloc): the
// GPU tests of the CUDA IPC path (tests/gpu/cuda_ipc_cuda_test.cc).
#include <condition_variable>
#include <cstdio>
#include <iostream>
#include <mutex>
#include <set>
#include <sstream>
#include <string>

#include "fabric/fabric.h"
#include "test_support.h"
#ifdef FABRIC_WITH_CUDA
#include <cuda_runtime.h>
#endif

using namespace fabric;

int main(int argc, char** argv) {
  if (argc != 4 && argc != 5) {
    std::cerr << "usage: fabric_test_peer PROVIDER REORDER(0|1) BUFFER_BYTES [NIC,NIC,...]\n";
    return 2;
  }
  fabric::testing::Backend backend{"peer", argv[1], std::string(argv[2]) == "1"};
  const uint64_t size = std::stoull(argv[3]);
  Config config = fabric::testing::make_config(backend);
  if (argc == 5) {
    config.groups[0].nics.clear();
    std::istringstream nics(argv[4]);
    for (std::string nic; std::getline(nics, nic, ',');) config.groups[0].nics.push_back(nic);
  }
  auto created = TransferEngine::create(config);
  if (!created) {
    std::cout << "error " << created.status().to_string() << std::endl;
    return 1;
  }
  auto& engine = **created;
  std::vector<std::byte> buf(size);
  std::byte* mem = buf.data();  // what is registered: buf, or CUDA memory mirrored by buf
  const char* kind = std::getenv("FABRIC_TEST_PEER_MEMORY");
  const bool gpu = kind != nullptr && std::string(kind) == "cuda";
#ifdef FABRIC_WITH_CUDA
  void* device = nullptr;
  if (gpu) {
    if (cudaMalloc(&device, size) != cudaSuccess || cudaMemset(device, 0, size) != cudaSuccess) {
      std::cout << "error cudaMalloc of " << size << " bytes failed" << std::endl;
      return 1;
    }
    mem = static_cast<std::byte*>(device);
  }
  // buf <-> the CUDA memory, around fill and checksum.
  auto to_device = [&] {
    if (gpu) cudaMemcpy(mem, buf.data(), size, cudaMemcpyHostToDevice);
  };
  auto from_device = [&] {
    if (gpu) cudaMemcpy(buf.data(), mem, size, cudaMemcpyDeviceToHost);
  };
#else
  if (gpu) {
    std::cout << "error FABRIC_TEST_PEER_MEMORY=cuda in a build without CUDA" << std::endl;
    return 1;
  }
  auto to_device = [] {};
  auto from_device = [] {};
#endif
  // Readable: the read tests (conformance, the multi-NIC lab, the GPU tests of reads over the
  // staged and CUDA IPC paths) read what `fill` wrote.
  RegisterOptions options;
  options.remote_read = true;
  auto reg = engine.register_memory(mem, size, options);
  if (!reg) {
    std::cout << "error " << reg.status().to_string() << std::endl;
    return 1;
  }
  // Messages "msg K" (sent by the failover tests): which K arrived, and how often.
  std::mutex messages_mu;
  std::condition_variable messages_cv;
  std::set<uint64_t> distinct;
  uint64_t duplicates = 0, malformed = 0;
  Status handler = engine.set_receive_handler([&](std::span<const std::byte> m) {
    const std::string text(reinterpret_cast<const char*>(m.data()), m.size());
    std::lock_guard lock(messages_mu);
    if (text.rfind("msg ", 0) != 0) {
      ++malformed;
    } else if (!distinct.insert(std::stoull(text.substr(4))).second) {
      ++duplicates;
    }
    messages_cv.notify_all();
  });
  if (!handler) {
    std::cout << "error " << handler.to_string() << std::endl;
    return 1;
  }
  std::cout << "address " << engine.address().to_hex() << "\n"
            << "memory " << to_hex(reg->descriptor.encode()) << "\n"
            << "ready" << std::endl;

  // After this thread touched `buf`, a round trip through the worker's inbox: the worker then
  // happens-after those accesses, so TSan sees the order in which later remote writes (copied
  // into `buf` by the provider on the worker) follow them; before this thread reads `buf`, one
  // the other way. The real order runs through the other process and the network, which TSan
  // cannot see.
  std::byte sync_byte{};
  auto sync_with_worker = [&] {
    auto r = engine.register_memory(&sync_byte, 1);
    if (r) (void)engine.unregister_memory(r->handle);
  };
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "fill") {
      uint64_t seed = 0;
      in >> seed;
      fabric::testing::fill_pattern(buf.data(), size, seed);
      to_device();
      sync_with_worker();
      std::cout << "filled" << std::endl;
    } else if (cmd == "expect") {
      uint32_t imm = 0;
      uint64_t count = 0;
      in >> imm >> count;
      bool ok = engine.wait_imm(imm, count, std::chrono::seconds(30));
      std::cout << (ok ? "got " : "timeout ") << imm << " " << engine.imm_count(imm) << std::endl;
    } else if (cmd == "checksum") {
      uint64_t off = 0, len = 0;
      in >> off >> len;
      if (off > size || len > size - off) {
        std::cout << "error range" << std::endl;
        continue;
      }
      // Before the read as well: a transport whose worker copies the bytes in itself (shm)
      // wrote them on the worker thread.
      sync_with_worker();
      from_device();
      const uint64_t sum = fabric::testing::fnv1a(buf.data() + off, len);
      sync_with_worker();
      std::cout << "checksum " << sum << std::endl;
    } else if (cmd == "write") {
      std::string hex;
      uint64_t src = 0, dst = 0, len = 0;
      uint32_t imm = 0;
      in >> hex >> src >> dst >> len >> imm;
      auto bytes = from_hex(hex);
      auto desc = bytes ? RemoteMemory::decode(*bytes) : Result<RemoteMemory>(bytes.status());
      if (!desc) {
        std::cout << "error " << desc.status().to_string() << std::endl;
        continue;
      }
      fabric::testing::Probe done;
      auto id =
          engine.submit(SingleWrite{reg->handle, src, *desc, dst, len, imm, {}}, done.callbacks());
      Status s = id ? done.wait() : id.status();
      std::cout << (s ? std::string("done") : "error " + s.to_string()) << std::endl;
    } else if (cmd == "messages") {
      uint64_t count = 0;
      in >> count;
      std::unique_lock lock(messages_mu);
      messages_cv.wait_for(lock, std::chrono::seconds(30),
                           [&] { return distinct.size() >= count; });
      std::cout << "messages " << distinct.size() << " " << duplicates << " " << malformed
                << std::endl;
    } else if (cmd == "unregister") {
      Status s = engine.unregister_memory(reg->handle);
      std::cout << (s ? std::string("unregistered") : "error " + s.to_string()) << std::endl;
    } else if (cmd == "spam") {
      std::string hex;
      uint64_t n = 0, src = 0, dst = 0, len = 0;
      uint32_t imm = 0;
      in >> n >> hex >> src >> dst >> len >> imm;
      auto bytes = from_hex(hex);
      auto desc = bytes ? RemoteMemory::decode(*bytes) : Result<RemoteMemory>(bytes.status());
      if (!desc) {
        std::cout << "error " << desc.status().to_string() << std::endl;
        continue;
      }
      for (uint64_t i = 0; i < n; ++i) {
        (void)engine.submit(SingleWrite{reg->handle, src, *desc, dst, len, imm, {}}, {});
      }
      std::cout << "submitted" << std::endl;
    } else if (cmd == "quit") {
      break;
    } else {
      std::cout << "error unknown command '" << cmd << "'" << std::endl;
    }
  }
  engine.close();
  return 0;
}
