// fabric::ep's host side, without a GPU: configuration checks, the buffer layout, the halves'
// argument checks, the handle codec and the peer checks of connect(). Creation on a machine
// without a CUDA device (or a build without CUDA) is refused with kUnsupported.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "ep/handle.h"
#include "fabric/ep.h"

namespace fabric::ep {
namespace {

// The decode shape of the benchmark: 2 ranks, 256 experts, hidden 7168, top-8, fp8.
AllToAllConfig decode_config() {
  AllToAllConfig c;
  c.rank = 1;
  c.world_size = 2;
  c.num_experts = 256;
  c.hidden = 7168;
  c.top_k = 8;
  c.max_tokens_per_rank = 128;
  c.dtype = TokenDtype::kFp8E4m3;
  return c;
}

// Expects `s` to fail with `code` and a message containing every one of `words`.
void expect_error(const Status& s, ErrorCode code, std::initializer_list<const char*> words) {
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), code) << s.to_string();
  for (const char* w : words) EXPECT_NE(s.message().find(w), std::string::npos) << s.to_string();
}

TEST(EpConfig, TheDecodeShapeIsValid) {
  EXPECT_TRUE(validate(decode_config()).is_ok());
}

TEST(EpConfig, EachBadFieldIsNamed) {
  struct Case {
    const char* field;
    void (*bend)(AllToAllConfig&);
    std::initializer_list<const char*> words;
    ErrorCode code = ErrorCode::kInvalidArgument;
  };
  const Case cases[] = {
      {"world_size", [](AllToAllConfig& c) { c.world_size = 0; }, {"world_size 0"}},
      {"world_size", [](AllToAllConfig& c) { c.world_size = kMaxRanks + 1; }, {"world_size 33"}},
      {"rank", [](AllToAllConfig& c) { c.rank = 2; }, {"rank 2", "world_size 2"}},
      {"rank", [](AllToAllConfig& c) { c.rank = -1; }, {"rank -1"}},
      {"gpus_per_node", [](AllToAllConfig& c) { c.gpus_per_node = -1; }, {"gpus_per_node -1"}},
      {"gpus_per_node",
       [](AllToAllConfig& c) {
         c.world_size = 12;
         c.num_experts = 264;
         c.gpus_per_node = 8;
       },
       {"gpus_per_node 8", "world_size 12", "divide"}},
      {"num_experts", [](AllToAllConfig& c) { c.num_experts = 255; }, {"num_experts 255"}},
      {"num_experts", [](AllToAllConfig& c) { c.num_experts = 0; }, {"num_experts 0"}},
      {"num_experts", [](AllToAllConfig& c) { c.num_experts = 4096; }, {"2048 experts per rank"}},
      {"hidden", [](AllToAllConfig& c) { c.hidden = 7000; }, {"hidden 7000", "128", "fp8"}},
      {"hidden",
       [](AllToAllConfig& c) {
         c.dtype = TokenDtype::kBf16;
         c.hidden = 7004;
       },
       {"hidden 7004", "of 8", "bf16"}},
      {"top_k", [](AllToAllConfig& c) { c.top_k = 0; }, {"top_k 0"}},
      {"top_k", [](AllToAllConfig& c) { c.top_k = 33; }, {"top_k 33"}},
      {"max_tokens", [](AllToAllConfig& c) { c.max_tokens_per_rank = 0; }, {"max_tokens_per_rank"}},
      {"max_tokens",
       [](AllToAllConfig& c) { c.max_tokens_per_rank = 1u << 28; },
       {"rows", "max_tokens_per_rank 268435456"}},
      {"dtype", [](AllToAllConfig& c) { c.dtype = static_cast<TokenDtype>(7); }, {"dtype 7"}},
      {"timeout",
       [](AllToAllConfig& c) { c.timeout = std::chrono::milliseconds(0); },
       {"timeout 0 ms"}},
      {"cuda_device", [](AllToAllConfig& c) { c.cuda_device = -2; }, {"cuda_device -2"}},
      {"proxy_memory",
       [](AllToAllConfig& c) { c.proxy_memory = "cpu"; },
       {"proxy_memory 'cpu'", "'auto', 'host' and 'gpu'"}},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.field);
    AllToAllConfig c = decode_config();
    k.bend(c);
    expect_error(validate(c), k.code, k.words);
    expect_error(Layout::of(c).status(), k.code, k.words);
  }
}

TEST(EpConfig, OneNodeOfExactlyItsGpusIsValid) {
  AllToAllConfig c = decode_config();
  c.world_size = 8;
  c.gpus_per_node = 8;
  c.rank = 7;
  EXPECT_TRUE(validate(c).is_ok());
}

// The inter-node path: several nodes of gpus_per_node ranks each, one GPU per node included.
TEST(EpConfig, SeveralNodesAreValid) {
  AllToAllConfig c = decode_config();
  c.world_size = 16;
  c.gpus_per_node = 8;
  c.rank = 9;
  EXPECT_TRUE(validate(c).is_ok());
  c.world_size = 2;
  c.gpus_per_node = 1;
  c.rank = 1;
  EXPECT_TRUE(validate(c).is_ok());
}

TEST(EpLayout, Fp8DecodeShape) {
  auto l = Layout::of(decode_config());
  ASSERT_TRUE(l) << l.status().to_string();
  EXPECT_EQ(l->num_local_experts, 128u);
  EXPECT_EQ(l->scale_columns, 56u);
  EXPECT_EQ(l->token_bytes, 7168u);
  EXPECT_EQ(l->scale_bytes, 224u);
  // Metadata: token index (4) + 8 indices (32) + 8 weights (32) = 68, rounded to 80.
  EXPECT_EQ(l->entry_meta_bytes, 80u);
  EXPECT_EQ(l->entry_token_offset, 80u);
  EXPECT_EQ(l->entry_scale_offset, 80u + 7168u);
  EXPECT_EQ(l->entry_bytes, 80u + 7168u + 224u);
  EXPECT_EQ(l->signal_bytes, 4u * 32u * 8u);
  EXPECT_EQ(l->dispatch_offset, 4096u);
  EXPECT_EQ(l->dispatch_area_bytes, 128u * l->entry_bytes);
  EXPECT_EQ(l->dispatch_entry(1, 3), 4096u + l->dispatch_area_bytes + 3 * l->entry_bytes);
  EXPECT_EQ(l->combine_offset % 4096, 0u);
  EXPECT_GE(l->combine_offset, l->dispatch_offset + 2 * l->dispatch_area_bytes);
  EXPECT_EQ(l->combine_bytes, 128u * 8u * 7168u * 2u);
  EXPECT_EQ(l->buffer_bytes % 4096, 0u);
  EXPECT_GE(l->buffer_bytes, l->combine_offset + l->combine_bytes);
  EXPECT_EQ(l->max_recv_rows, 2u * 128u * 8u);
}

TEST(EpLayout, Bf16HasNoScalesAndEveryPartIsAlignedTo16) {
  AllToAllConfig c = decode_config();
  c.dtype = TokenDtype::kBf16;
  c.hidden = 2056;  // 4112 bytes: a multiple of 16; top_k 3: metadata 28 bytes
  c.top_k = 3;
  auto l = Layout::of(c);
  ASSERT_TRUE(l) << l.status().to_string();
  EXPECT_EQ(l->scale_columns, 0u);
  EXPECT_EQ(l->scale_bytes, 0u);
  EXPECT_EQ(l->token_bytes, 4112u);
  EXPECT_EQ(l->entry_meta_bytes, 32u);
  EXPECT_EQ(l->entry_bytes, 32u + 4112u);
  for (uint64_t v : {l->entry_meta_bytes, l->entry_token_offset, l->entry_scale_offset,
                     l->entry_bytes, l->dispatch_offset, l->combine_offset}) {
    EXPECT_EQ(v % 16, 0u) << v;
  }
}

TEST(EpLayout, Fp8ScalesOfAnOddBlockCountAreRoundedUp) {
  AllToAllConfig c = decode_config();
  c.hidden = 3 * kScaleBlock;  // 3 scales: 12 bytes
  auto l = Layout::of(c);
  ASSERT_TRUE(l);
  EXPECT_EQ(l->scale_bytes, 12u);
  EXPECT_EQ(l->entry_bytes, l->entry_scale_offset + 16u);
}

// Device pointers for the argument checks: only their values matter.
const void* at(uintptr_t v) {
  return reinterpret_cast<const void*>(v);
}

TEST(EpArgs, DispatchSend) {
  const AllToAllConfig c = decode_config();
  DispatchSendArgs a;
  a.tokens = at(0x10000);
  a.scales = static_cast<const float*>(at(0x20000));
  a.topk_idx = static_cast<const int64_t*>(at(0x30000));
  a.num_tokens = 128;
  EXPECT_TRUE(check_dispatch_send(c, a).is_ok());

  DispatchSendArgs b = a;
  b.num_tokens = 129;
  expect_error(check_dispatch_send(c, b), ErrorCode::kInvalidArgument,
               {"dispatch_send", "num_tokens 129", "max_tokens_per_rank 128"});
  b = a;
  b.tokens = at(0x10008);
  expect_error(check_dispatch_send(c, b), ErrorCode::kInvalidArgument,
               {"tokens", "16-byte aligned"});
  b = a;
  b.topk_idx = nullptr;
  expect_error(check_dispatch_send(c, b), ErrorCode::kInvalidArgument, {"topk_idx is null"});
  b = a;
  b.scales = nullptr;
  expect_error(check_dispatch_send(c, b), ErrorCode::kInvalidArgument, {"scales is null", "fp8"});
  b = a;
  b.topk_weights = static_cast<const float*>(at(0x40002));
  expect_error(check_dispatch_send(c, b), ErrorCode::kInvalidArgument,
               {"topk_weights", "4-byte aligned"});

  AllToAllConfig bf16 = c;
  bf16.dtype = TokenDtype::kBf16;
  expect_error(check_dispatch_send(bf16, a), ErrorCode::kInvalidArgument, {"scales given", "bf16"});
  b = a;
  b.scales = nullptr;
  EXPECT_TRUE(check_dispatch_send(bf16, b).is_ok());

  // No tokens: the (empty) tensors are not read, so null is fine.
  DispatchSendArgs empty;
  EXPECT_TRUE(check_dispatch_send(c, empty).is_ok());
  empty.scales = a.scales;
  EXPECT_TRUE(check_dispatch_send(c, empty).is_ok());
  expect_error(check_dispatch_send(bf16, empty), ErrorCode::kInvalidArgument,
               {"scales given", "bf16"});
}

TEST(EpArgs, DispatchRecv) {
  const AllToAllConfig c = decode_config();
  DispatchRecvArgs a;
  a.out_tokens = const_cast<void*>(at(0x10000));
  a.out_scales = static_cast<float*>(const_cast<void*>(at(0x20000)));
  a.expert_counts = static_cast<int32_t*>(const_cast<void*>(at(0x30000)));
  EXPECT_TRUE(check_dispatch_recv(c, a).is_ok());
  DispatchRecvArgs b = a;
  b.expert_counts = nullptr;
  expect_error(check_dispatch_recv(c, b), ErrorCode::kInvalidArgument, {"expert_counts is null"});
  b = a;
  b.out_scales = nullptr;
  expect_error(check_dispatch_recv(c, b), ErrorCode::kInvalidArgument, {"out_scales is null"});
  b = a;
  b.out_source = static_cast<int32_t*>(const_cast<void*>(at(0x40001)));
  expect_error(check_dispatch_recv(c, b), ErrorCode::kInvalidArgument, {"out_source"});
  b = a;
  b.out_tokens = nullptr;
  expect_error(check_dispatch_recv(c, b), ErrorCode::kInvalidArgument, {"out_tokens is null"});
}

TEST(EpArgs, Combine) {
  const AllToAllConfig c = decode_config();
  EXPECT_TRUE(check_combine_send(c, CombineSendArgs{at(0x10000)}).is_ok());
  expect_error(check_combine_send(c, CombineSendArgs{}), ErrorCode::kInvalidArgument,
               {"combine_send", "expert_out is null"});
  expect_error(check_combine_send(c, CombineSendArgs{at(0x10004)}), ErrorCode::kInvalidArgument,
               {"expert_out", "16-byte aligned"});

  CombineRecvArgs a;
  a.topk_idx = static_cast<const int64_t*>(at(0x30000));
  a.topk_weights = static_cast<const float*>(at(0x40000));
  a.out = const_cast<void*>(at(0x50000));
  a.num_tokens = 5;
  EXPECT_TRUE(check_combine_recv(c, a).is_ok());
  CombineRecvArgs b = a;
  b.topk_weights = nullptr;
  expect_error(check_combine_recv(c, b), ErrorCode::kInvalidArgument,
               {"combine_recv", "topk_weights is null"});
  b = a;
  b.num_tokens = 1000;
  expect_error(check_combine_recv(c, b), ErrorCode::kInvalidArgument, {"num_tokens 1000"});
}

PeerHandle handle_of(const AllToAllConfig& c, uint64_t pid) {
  PeerHandle h = make_handle(c, *Layout::of(c));
  h.pid = pid;
  for (size_t i = 0; i < h.ipc.size(); ++i) h.ipc[i] = std::byte(i);
  h.device[3] = std::byte{0x7f};
  return h;
}

TEST(EpHandle, RoundTrips) {
  AllToAllConfig c = decode_config();
  c.gpus_per_node = 0;  // resolved to world_size in the handle
  const PeerHandle h = handle_of(c, 4242);
  EXPECT_EQ(h.gpus_per_node, 2);
  EXPECT_EQ(h.buffer_bytes, Layout::of(c)->buffer_bytes);
  auto back = decode_handle(encode(h));
  ASSERT_TRUE(back) << back.status().to_string();
  EXPECT_EQ(*back, h);
}

TEST(EpHandle, CarriesTheProxyHandle) {
  AllToAllConfig c = decode_config();
  c.gpus_per_node = 1;
  PeerHandle h = handle_of(c, 4242);
  h.proxy = Bytes(37, std::byte{0x5a});
  auto back = decode_handle(encode(h));
  ASSERT_TRUE(back) << back.status().to_string();
  EXPECT_EQ(*back, h);
  EXPECT_EQ(back->proxy.size(), 37u);
}

// Ranks of other nodes are reached through the proxy, not CUDA IPC: one process may hold them.
TEST(EpHandle, RanksOfOtherNodesMayShareAProcess) {
  AllToAllConfig c = decode_config();
  c.gpus_per_node = 1;
  c.rank = 0;
  const PeerHandle mine = handle_of(c, 100);
  c.rank = 1;
  EXPECT_TRUE(check_peer(mine, handle_of(c, 100), 1).is_ok());
}

TEST(EpHandle, MalformedBytesAreRefused) {
  const Bytes good = encode(handle_of(decode_config(), 1));
  expect_error(decode_handle(Bytes{}).status(), ErrorCode::kInvalidArgument,
               {"not an all-to-all handle"});
  Bytes bad = good;
  bad[0] = std::byte{0};
  expect_error(decode_handle(bad).status(), ErrorCode::kInvalidArgument, {"magic"});
  bad = good;
  bad[4] = std::byte{9};
  expect_error(decode_handle(bad).status(), ErrorCode::kInvalidArgument, {"version 9"});
  bad.assign(good.begin(), good.end() - 1);
  expect_error(decode_handle(bad).status(), ErrorCode::kInvalidArgument, {"truncated"});
  // Cut inside the version: truncated (it was reported as "version 0").
  bad.assign(good.begin(), good.begin() + 5);
  expect_error(decode_handle(bad).status(), ErrorCode::kInvalidArgument, {"truncated at 5 bytes"});
  bad = good;
  bad.push_back(std::byte{0});
  expect_error(decode_handle(bad).status(), ErrorCode::kInvalidArgument, {"1 bytes too many"});
}

TEST(EpHandle, PeersMustMatchAndStayInRankOrder) {
  AllToAllConfig mine_cfg = decode_config();
  mine_cfg.rank = 0;
  const PeerHandle mine = handle_of(mine_cfg, 100);
  const PeerHandle peer = handle_of(decode_config(), 101);  // rank 1, another process
  EXPECT_TRUE(check_peer(mine, peer, 1).is_ok());
  EXPECT_TRUE(check_peer(mine, mine, 0).is_ok());  // its own handle, in its place
  expect_error(check_peer(mine, peer, 0), ErrorCode::kInvalidArgument,
               {"handle 0 is rank 1's", "rank order"});

  PeerHandle same_process = peer;
  same_process.pid = 100;
  expect_error(check_peer(mine, same_process, 1), ErrorCode::kUnsupported,
               {"rank 1 runs in this process", "process of its own"});

  AllToAllConfig other = decode_config();
  other.hidden = 4096;
  expect_error(check_peer(mine, handle_of(other, 101), 1), ErrorCode::kInvalidArgument,
               {"rank 1 has hidden 4096", "this rank (rank 0) has 7168"});
  other = decode_config();
  other.dtype = TokenDtype::kBf16;
  expect_error(check_peer(mine, handle_of(other, 101), 1), ErrorCode::kInvalidArgument,
               {"dtype bf16", "has fp8_e4m3"});
  other = decode_config();
  other.top_k = 4;
  expect_error(check_peer(mine, handle_of(other, 101), 1), ErrorCode::kInvalidArgument,
               {"top_k 4"});
  other = decode_config();
  other.max_tokens_per_rank = 64;
  expect_error(check_peer(mine, handle_of(other, 101), 1), ErrorCode::kInvalidArgument,
               {"max_tokens_per_rank 64"});
  other = decode_config();
  other.num_experts = 128;
  expect_error(check_peer(mine, handle_of(other, 101), 1), ErrorCode::kInvalidArgument,
               {"num_experts 128"});
}

// Here (CI: no GPU, and maybe no CUDA build) creation is refused with kUnsupported; a bad
// configuration is refused first, with its own error, everywhere.
TEST(EpAllToAll, CreationChecksTheConfigurationFirst) {
  AllToAllConfig c = decode_config();
  c.top_k = 0;
  expect_error(AllToAll::create(c).status(), ErrorCode::kInvalidArgument, {"top_k 0"});
}

TEST(EpAllToAll, CreationWithoutACudaDeviceIsUnsupported) {
  auto a = AllToAll::create(decode_config());
  if (a) GTEST_SKIP() << "this machine has a CUDA device (tests/python/test_ep.py covers it)";
  EXPECT_EQ(a.status().code(), ErrorCode::kUnsupported) << a.status().to_string();
}

}  // namespace
}  // namespace fabric::ep
