// Entry points of the sparse family's CPU kernels: top-k's threshold pass (block-sparse layouts
// run in the softmax kernels, common/block_sparse.h). No torch types: the binding
// (csrc/torch/sparse_cpu.cpp) fills the params. A DispatchStub per entry point (cpu/dispatch.h).
#pragma once

#include <cstdint>

#include "common/softmax_params.h"
#include "cpu/dispatch.h"

namespace attn {
namespace cpu {

// top-k's (B, H, Sq) thresholds and cut keys (common/block_sparse.h) of p's score rows
template <typename T>
inline DispatchStub<void (*)(const SoftmaxParamsT<T>&, DType, int k_top, T* thr, int32_t* jcut)> topk_threshold_stub;

#if defined(ATTN_CPU_ISA)
inline namespace ATTN_CPU_ISA {  // this level's kernels
template <typename T>
void topk_threshold(const SoftmaxParamsT<T>& p, DType dt, int k_top, T* thr, int32_t* jcut);
}  // namespace ATTN_CPU_ISA
#endif

}  // namespace cpu
}  // namespace attn
