// The FP8 block quantiser's CUDA kernel against the CPU reference, bit for bit: odd shapes
// (partial tiles; rows the kernel loads 8 elements at a time and rows it takes one by one),
// all-zero tiles, values that saturate and values in the subnormal range.
// Skips with its reason in a build without CUDA or on a machine without a GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "fabric/weights_projection.h"

#ifdef FABRIC_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace fabric::weights {
namespace {

#ifdef FABRIC_WITH_CUDA
std::vector<uint16_t> random_bf16(uint64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> kind(0, 99);
  std::vector<uint16_t> out(n);
  for (auto& v : out) {
    float f = normal(rng);
    const int k = kind(rng);
    if (k == 0) f *= 1e4f;   // a large outlier: the tile's scale follows it
    if (k == 1) f *= 1e-6f;  // lands in e4m3's subnormals after scaling
    if (k == 2) f = 0.0f;
    if (k == 3) f = -0.0f;
    uint32_t u;
    std::memcpy(&u, &f, 4);
    v = static_cast<uint16_t>(u >> 16);
  }
  return out;
}
#endif

// Why the kernel cannot run here, or null.
const char* cannot_run() {
  if (!has_cuda_projections()) return "this build has no CUDA (FABRIC_WITH_CUDA off)";
#ifdef FABRIC_WITH_CUDA
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    return "no CUDA device here";
  }
#endif
  return nullptr;
}

TEST(WeightsFp8Cuda, KernelMatchesTheCpuReferenceBitForBit) {
  if (const char* why = cannot_run()) GTEST_SKIP() << why;
#ifdef FABRIC_WITH_CUDA
  struct Case {
    uint64_t rows, cols;
    uint32_t block;
  };
  for (const Case c : {Case{128, 128, 128}, Case{300, 517, 128}, Case{1, 7, 128},
                       Case{2048, 7168, 128}, Case{64, 96, 32}, Case{256, 264, 128}}) {
    SCOPED_TRACE(testing::Message() << c.rows << " x " << c.cols << " block " << c.block);
    const uint64_t n = c.rows * c.cols;
    auto host = random_bf16(n, c.rows * 31 + c.cols);
    if (c.rows >= 256) std::fill(host.begin(), host.begin() + c.cols, 0);  // a zero tile row
    const Shape tiles = fp8_scale_shape(c.rows, c.cols, c.block);
    const uint64_t nt = tiles[0] * tiles[1];
    std::vector<uint8_t> want(n), got(n);
    std::vector<float> want_scales(nt), got_scales(nt);
    ASSERT_TRUE(quantize_fp8_blocks_cpu(host, c.rows, c.cols, c.block, want, want_scales));
    void *d_in = nullptr, *d_out = nullptr, *d_scales = nullptr;
    ASSERT_EQ(cudaMalloc(&d_in, n * 2), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_out, n), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_scales, nt * 4), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_in, host.data(), n * 2, cudaMemcpyHostToDevice), cudaSuccess);
    Status s = quantize_fp8_blocks_cuda(d_in, c.rows, c.cols, c.block, d_out,
                                        static_cast<float*>(d_scales), nullptr);
    ASSERT_TRUE(s) << s.to_string();
    ASSERT_EQ(cudaMemcpy(got.data(), d_out, n, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(got_scales.data(), d_scales, nt * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    cudaFree(d_in);
    cudaFree(d_out);
    cudaFree(d_scales);
    EXPECT_EQ(std::memcmp(got_scales.data(), want_scales.data(), nt * 4), 0) << "scales differ";
    uint64_t differ = 0, first = n;
    for (uint64_t i = 0; i < n; ++i) {
      if (got[i] != want[i]) {
        if (first == n) first = i;
        ++differ;
      }
    }
    EXPECT_EQ(differ, 0u) << "first at " << first << ": gpu " << int(got[first]) << " cpu "
                          << int(want[first]);
  }
#endif
}

// quantize_fp8_blocks_cuda_many: 150 matrices of mixed shapes (three launches of at most 64,
// vectorised rows and element-by-element ones side by side, an empty one skipped) give the
// CPU reference's bytes and scales, each in its own place.
TEST(WeightsFp8Cuda, GroupedLaunchesMatchTheCpuReferenceForEveryMatrix) {
  if (const char* why = cannot_run()) GTEST_SKIP() << why;
#ifdef FABRIC_WITH_CUDA
  const uint64_t shapes[][2] = {{128, 128}, {300, 517}, {1, 7}, {256, 264}, {129, 8}, {0, 5}};
  constexpr uint32_t kBlock = 128;
  struct One {
    uint64_t rows, cols, tiles;
    std::vector<uint16_t> in;
    void *d_in = nullptr, *d_out = nullptr, *d_scales = nullptr;
  };
  std::vector<One> all(150);
  std::vector<Fp8Matrix> matrices;
  for (size_t i = 0; i < all.size(); ++i) {
    One& o = all[i];
    o.rows = shapes[i % 6][0];
    o.cols = shapes[i % 6][1];
    const Shape t = fp8_scale_shape(o.rows, o.cols, kBlock);
    o.tiles = t[0] * t[1];
    o.in = random_bf16(o.rows * o.cols, 1000 + i);
    ASSERT_EQ(cudaMalloc(&o.d_in, o.in.size() * 2 + 2), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&o.d_out, o.rows * o.cols + 1), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&o.d_scales, o.tiles * 4 + 4), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(o.d_in, o.in.data(), o.in.size() * 2, cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemset(o.d_out, 0xee, o.rows * o.cols + 1), cudaSuccess);
    matrices.push_back({o.d_in, o.rows, o.cols, o.d_out, static_cast<float*>(o.d_scales)});
  }
  Status s = quantize_fp8_blocks_cuda_many(matrices, kBlock, nullptr);
  ASSERT_TRUE(s) << s.to_string();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (size_t i = 0; i < all.size(); ++i) {
    One& o = all[i];
    SCOPED_TRACE(testing::Message() << "matrix " << i << ": " << o.rows << " x " << o.cols);
    const uint64_t n = o.rows * o.cols;
    std::vector<uint8_t> want(n), got(n + 1);
    std::vector<float> want_scales(o.tiles), got_scales(o.tiles);
    ASSERT_TRUE(quantize_fp8_blocks_cpu(o.in, o.rows, o.cols, kBlock, want, want_scales));
    ASSERT_EQ(cudaMemcpy(got.data(), o.d_out, n + 1, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(got_scales.data(), o.d_scales, o.tiles * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(got[n], 0xee) << "written past the matrix";
    EXPECT_EQ(std::memcmp(got.data(), want.data(), n), 0) << "bytes differ";
    EXPECT_EQ(std::memcmp(got_scales.data(), want_scales.data(), o.tiles * 4), 0)
        << "scales differ";
    cudaFree(o.d_in);
    cudaFree(o.d_out);
    cudaFree(o.d_scales);
  }
  EXPECT_EQ(quantize_fp8_blocks_cuda_many(matrices, 0, nullptr).code(),
            ErrorCode::kInvalidArgument);
#endif
}

}  // namespace
}  // namespace fabric::weights
