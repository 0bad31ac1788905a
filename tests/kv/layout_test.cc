// KvLayout and plan_slices: geometry, validation, and the head mapping between TP sizes,
// checked byte for byte by applying the plan with memcpy to caches filled from one reference.
#include "fabric/kv/layout.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

namespace fabric::kv {
namespace {

KvLayout model(uint32_t tp, uint32_t rank, uint32_t heads = 4) {
  KvLayout l;
  l.num_layers = 3;
  l.num_pages = 6;
  l.tokens_per_page = 4;
  l.num_kv_heads = heads;
  l.head_bytes = 8;
  l.tp_size = tp;
  l.tp_rank = rank;
  return l;
}

// Byte b of token t of head h of part p of logical page k of layer l: the reference cache.
uint8_t ref(uint32_t l, uint32_t k, uint32_t p, uint32_t h, uint32_t t, uint32_t b) {
  return static_cast<uint8_t>(1 + (l * 131 + k * 71 + p * 37 + h * 17 + t * 5 + b) % 251);
}

void fill(const KvLayout& L, std::vector<uint8_t>& buf, const std::vector<uint32_t>& pages) {
  for (uint32_t l = 0; l < L.num_layers; ++l)
    for (uint32_t k = 0; k < pages.size(); ++k)
      for (uint32_t p = 0; p < L.parts(); ++p)
        for (uint32_t h = L.first_head(); h < L.first_head() + L.local_heads(); ++h)
          for (uint32_t t = 0; t < L.tokens_per_page; ++t)
            for (uint32_t b = 0; b < L.head_bytes; ++b)
              buf[L.page_offset(l, pages[k]) + L.head_offset(p, h) + t * L.head_bytes + b] =
                  ref(l, k, p, h, t, b);
}

// Moves logical pages (src_pages[k] -> dst_pages[k]) from TP sp to TP dp and checks every byte
// of every decode rank: the request's pages hold the reference, the others stay zero.
void check_mapping(const KvLayout& src_model, const KvLayout& dst_model, uint32_t sp, uint32_t dp) {
  SCOPED_TRACE(testing::Message() << "TP" << sp << " -> TP" << dp);
  const std::vector<uint32_t> src_pages = {5, 0, 3};
  const std::vector<uint32_t> dst_pages = {1, 4, 2};
  auto plan = plan_slices(src_model.with_rank(sp, 0), dst_model.with_rank(dp, 0));
  ASSERT_TRUE(plan) << plan.status().to_string();
  std::vector<KvLayout> S, D;
  std::vector<std::vector<uint8_t>> sbuf, dbuf;
  for (uint32_t r = 0; r < sp; ++r) {
    KvLayout l = src_model;
    l.tp_size = sp;
    l.tp_rank = r;
    ASSERT_TRUE(l.validate()) << l.validate().to_string();
    S.push_back(l);
    sbuf.emplace_back(l.region_bytes(), 0);
    fill(l, sbuf.back(), src_pages);
  }
  for (uint32_t r = 0; r < dp; ++r) {
    KvLayout l = dst_model;
    l.tp_size = dp;
    l.tp_rank = r;
    D.push_back(l);
    dbuf.emplace_back(l.region_bytes(), 0);
  }
  // Each byte of each decode rank is written exactly once.
  std::vector<std::vector<uint8_t>> writes(dp);
  for (uint32_t r = 0; r < dp; ++r) writes[r].assign(dbuf[r].size(), 0);
  for (const auto& c : *plan) {
    ASSERT_LT(c.src_rank, sp);
    ASSERT_LT(c.dst_rank, dp);
    ASSERT_LE(c.src_offset + c.length, S[c.src_rank].page_bytes());
    ASSERT_LE(c.dst_offset + c.length, D[c.dst_rank].page_bytes());
    for (uint32_t l = 0; l < S[0].num_layers; ++l)
      for (size_t k = 0; k < src_pages.size(); ++k) {
        uint64_t so = S[c.src_rank].page_offset(l, src_pages[k]) + c.src_offset;
        uint64_t dof = D[c.dst_rank].page_offset(l, dst_pages[k]) + c.dst_offset;
        std::memcpy(&dbuf[c.dst_rank][dof], &sbuf[c.src_rank][so], c.length);
        for (uint64_t i = 0; i < c.length; ++i) ++writes[c.dst_rank][dof + i];
      }
  }
  std::vector<uint8_t> expect;
  for (uint32_t r = 0; r < dp; ++r) {
    expect.assign(dbuf[r].size(), 0);
    fill(D[r], expect, dst_pages);
    ASSERT_EQ(dbuf[r], expect) << "decode rank " << r;
    for (size_t i = 0; i < expect.size(); ++i) {
      ASSERT_EQ(writes[r][i], expect[i] != 0 ? 1 : 0) << "decode rank " << r << " byte " << i;
    }
  }
}

TEST(KvLayout, Geometry) {
  KvLayout l = model(2, 1);
  ASSERT_TRUE(l.validate());
  EXPECT_EQ(l.first_head(), 2u);
  EXPECT_EQ(l.local_heads(), 2u);
  EXPECT_EQ(l.head_slice_bytes(), 32u);
  EXPECT_EQ(l.part_bytes(), 64u);
  EXPECT_EQ(l.page_bytes(), 128u);
  EXPECT_EQ(l.page_offset(1, 2), 6 * 128u + 2 * 128u);
  EXPECT_EQ(l.head_offset(1, 3), 64u + 32u);
  EXPECT_EQ(l.region_bytes(), 3 * 6 * 128u);
  KvLayout r = model(8, 5);  // 4 heads on 8 ranks: each head on two ranks
  EXPECT_EQ(r.first_head(), 2u);
  EXPECT_EQ(r.local_heads(), 1u);
}

TEST(KvLayout, RejectsBadInput) {
  KvLayout l = model(3, 0);
  EXPECT_EQ(l.validate().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(l.validate().message().find("tp_size"), std::string::npos);
  l = model(2, 2);
  EXPECT_NE(l.validate().message().find("tp_rank"), std::string::npos);
  l = model(2, 0);
  l.page_stride = 10;
  EXPECT_NE(l.validate().message().find("page_stride"), std::string::npos);
  l = model(2, 0);
  l.head_bytes = 0;
  EXPECT_NE(l.validate().message().find("head_bytes"), std::string::npos);
  KvLayout other = model(2, 0);
  other.tokens_per_page = 8;
  auto plan = plan_slices(model(2, 0), other);
  ASSERT_FALSE(plan);
  EXPECT_NE(plan.status().message().find("tokens_per_page"), std::string::npos);
}

TEST(KvLayout, SameTpIsOneWholePageSlicePerRank) {
  auto plan = plan_slices(model(4, 0), model(4, 0));
  ASSERT_TRUE(plan);
  ASSERT_EQ(plan->size(), 4u);
  for (uint32_t r = 0; r < 4; ++r) {
    EXPECT_EQ((*plan)[r], (SliceCopy{r, r, 0, 0, model(4, 0).page_bytes()}));
  }
}

TEST(KvLayout, Tp2IntoTp4SplitsKAndV) {
  auto plan = plan_slices(model(2, 0), model(4, 0));
  ASSERT_TRUE(plan);
  // Decode rank 1 holds head 1: from prefill rank 0, head 1 of K and head 1 of V.
  auto s = slices_between(*plan, 0, 1);
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0], (SliceCopy{0, 1, 32, 0, 32}));
  EXPECT_EQ(s[1], (SliceCopy{0, 1, 64 + 32, 32, 32}));
  EXPECT_EQ(slices_into(*plan, 1), 2u);
  EXPECT_EQ(sources_of(*plan, 3), std::vector<uint32_t>{1});
  EXPECT_EQ(targets_of(*plan, 1), (std::vector<uint32_t>{2, 3}));
}

TEST(KvLayout, MapsEveryTpPair) {
  for (uint32_t sp : {1u, 2u, 4u, 8u}) {
    for (uint32_t dp : {1u, 2u, 4u, 8u}) check_mapping(model(1, 0), model(1, 0), sp, dp);
  }
}

TEST(KvLayout, MapsWithStridesAndWithoutKvSplit) {
  KvLayout s = model(1, 0, 8);
  s.base_offset = 40;
  s.page_stride = 8 * 64 + 16;  // a page of TP1 is 2 * 8 heads * 32 bytes = 512 bytes
  s.layer_stride = 7 * s.page_stride;
  KvLayout d = model(1, 0, 8);
  d.split_kv = false;
  s.split_kv = false;
  check_mapping(s, d, 4, 8);
  check_mapping(s, d, 8, 2);
  KvLayout d2 = model(1, 0, 8);
  d2.base_offset = 8;
  check_mapping(model(1, 0, 8), d2, 2, 8);
}

}  // namespace
}  // namespace fabric::kv
