// Host entry points of the CUDA decode kernel (attention of a few query rows over a KV cache,
// common/decode_params.h). No torch here: csrc/torch/decode_cuda.cpp (and the CPU emulator,
// tests/cuda_emu/emu_decode_*.cpp) fill the params through csrc/torch/decode_params, allocate the
// split scratch sized below and call these on the current stream. Errors are thrown as
// std::runtime_error naming the cause. The kernel computes in float32 for fp32 / fp16 / bf16.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/decode_params.h"

namespace attn {

// Key splits per (batch, kv head) for caches of up to max_keys visible keys on a device of `sms`
// SMs; p.num_splits > 0 asks for that many (decode/cuda/heuristics.h).
int cuda_decode_num_splits(const DecodeParams& p, int64_t max_keys, int sms);

// Float32 elements of the split scratch: partial outputs (B, H, Sq, splits, D) and partial lse
// (B, H, Sq, splits). 0 when splits == 1 (the kernel writes out / lse directly).
size_t cuda_decode_part_o_floats(const DecodeParams& p, int splits);
size_t cuda_decode_part_lse_floats(const DecodeParams& p, int splits);

// out, lse <- decode attention. splits > 1: part_o / part_lse as sized above (every element is
// written before the combine reads it; no zeroing needed).
void cuda_decode_fwd(const DecodeParams& p, DType dt, int splits, float* part_o, float* part_lse,
                     cudaStream_t stream);

}  // namespace attn
