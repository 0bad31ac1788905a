// A program outside fabric-lib's tree, built against an installed copy (tests/consumer/run.sh):
// two engines over tcp on the loopback interface, one 1 MiB write with an immediate, checked
// byte by byte. Exit status 0 when the bytes and the immediate arrived, 1 otherwise, 77 (skip)
// when tcp cannot be opened here.
#include <fabric/discovery.h>
#include <fabric/fabric.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <future>
#include <vector>

int main() {
  using namespace fabric;
  Config cfg;
  cfg.provider = "tcp";
  cfg.groups[0].nics = {"lo"};
  auto a = TransferEngine::create(cfg);
  auto b = TransferEngine::create(cfg);
  if (!a || !b) {
    std::printf("skip: no tcp engine here: %s\n",
                (a ? b.status() : a.status()).to_string().c_str());
    return 77;
  }
  constexpr size_t kBytes = 1 << 20;
  std::vector<unsigned char> src(kBytes), dst(kBytes, 0);
  for (size_t i = 0; i < kBytes; ++i) src[i] = static_cast<unsigned char>(i * 7 + 3);
  auto src_reg = (*a)->register_memory(src.data(), src.size());
  auto dst_reg = (*b)->register_memory(dst.data(), dst.size());
  if (!src_reg || !dst_reg) {
    std::printf("register_memory failed\n");
    return 1;
  }
  // The descriptor travels as bytes, as it would between processes.
  auto remote = RemoteMemory::decode(dst_reg->descriptor.encode());
  if (!remote) {
    std::printf("decode failed: %s\n", remote.status().to_string().c_str());
    return 1;
  }
  std::promise<Status> done;
  auto id = (*a)->submit(SingleWrite{src_reg->handle, 0, *remote, 0, kBytes, 42, {}},
                         Callbacks{[&] { done.set_value(Status::ok()); },
                                   [&](const Status& s) { done.set_value(s); }});
  if (!id) {
    std::printf("submit failed: %s\n", id.status().to_string().c_str());
    return 1;
  }
  const Status s = done.get_future().get();
  const bool imm = (*b)->wait_imm(42, 1, std::chrono::seconds(30));
  const bool same = std::memcmp(src.data(), dst.data(), kBytes) == 0;
  const EngineStats stats = (*a)->stats();
  std::printf(
      "write: %s, immediate %s, bytes %s, sender completed %llu transfer(s); %zu NIC(s) "
      "discovered\n",
      s.to_string().c_str(), imm ? "counted" : "missing", same ? "equal" : "DIFFERENT",
      static_cast<unsigned long long>(stats.groups.at(0).transfers_completed),
      discover().nics.size());
  return s.is_ok() && imm && same ? 0 : 1;
}
