// Entry points of the CPU decode kernels (attention over a KV cache). No torch types: the
// binding (csrc/torch/decode_cpu.cpp) fills the params. A DispatchStub per entry point
// (cpu/dispatch.h).
#pragma once

#include "common/decode_params.h"
#include "cpu/dispatch.h"

namespace attn {
namespace cpu {

// out, lse <- softmax attention of q over the cache (common/decode_params.h). T = float for
// fp32 / fp16 / bf16 (dt), double for float64.
template <typename T>
inline DispatchStub<void (*)(const DecodeParamsT<T>&, DType)> decode_fwd_stub;

#if defined(ATTN_CPU_ISA)
inline namespace ATTN_CPU_ISA {  // this level's kernels
template <typename T>
void decode_fwd(const DecodeParamsT<T>& p, DType dt);

// The key splits decode_fwd runs per batch (every kv head in each) for a cache of max_keys
// visible keys (p.num_splits > 0 asks for that many, bounded by the key chunks). With
// p.num_splits == 0 the count depends on the problem only, so the forward is bit-identical for
// any thread count.
template <typename T>
int decode_num_splits(const DecodeParamsT<T>& p, int max_keys);
}  // namespace ATTN_CPU_ISA
#endif

}  // namespace cpu
}  // namespace attn
