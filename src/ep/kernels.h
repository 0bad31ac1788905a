// fabric::ep's kernels: their launchers (host functions that enqueue each half's kernels on a
// stream). Device code is in ep/kernels.cu, the structures the kernels share with the host in
// ep/device.h; the protocol is described in docs/moe.md.
//
// Compiled by nvcc as C++17 and by the host compiler as C++20: no fabric/ headers here.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ep/device.h"

namespace fabric::ep::device {

// Launchers: enqueue the half's kernels on `stream`; the error is the launch's.
cudaError_t launch_dispatch_send(const Params& p, const void* tokens, const float* scales,
                                 const int64_t* topk_idx, const float* topk_weights,
                                 uint32_t num_tokens, cudaStream_t stream);
cudaError_t launch_dispatch_recv(const Params& p, void* out_tokens, float* out_scales,
                                 float* out_weights, int32_t* out_source, int32_t* expert_counts,
                                 int32_t* expert_offsets, cudaStream_t stream);
cudaError_t launch_combine_send(const Params& p, const void* expert_out, cudaStream_t stream);
cudaError_t launch_combine_recv(const Params& p, const int64_t* topk_idx, const float* topk_weights,
                                uint32_t num_tokens, void* out, cudaStream_t stream);

}  // namespace fabric::ep::device
