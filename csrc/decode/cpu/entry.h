// Entry points of the CPU decode kernels (attention over a KV cache). No torch types: the
// binding (csrc/torch/decode_cpu.cpp) fills the params.
#pragma once

#include "common/decode_params.h"
#include "cpu/isa.h"

namespace attn {
namespace cpu {
ATTN_CPU_ISA_BEGIN

// out, lse <- softmax attention of q over the cache (common/decode_params.h). T = float for
// fp32 / fp16 / bf16 (dt), double for float64; instantiated for both.
template <typename T>
void decode_fwd(const DecodeParamsT<T>& p, DType dt);

// The key splits decode_fwd runs per batch (every kv head in each) for a cache of max_keys
// visible keys (p.num_splits > 0 asks for that many, bounded by the key chunks). With
// p.num_splits == 0 the count depends on the problem only, so the forward is bit-identical for
// any thread count.
template <typename T>
int decode_num_splits(const DecodeParamsT<T>& p, int max_keys);

ATTN_CPU_ISA_END
}  // namespace cpu
}  // namespace attn
