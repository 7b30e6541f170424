// Entry points of the sparse family's CPU kernels. No torch types: the torch layer fills the
// params. Block-sparse attention itself runs in the softmax kernels (common/block_sparse.h).
#pragma once

#include <cstdint>

#include "common/params.h"
#include "cpu/isa.h"

namespace attn {
namespace cpu {
ATTN_CPU_ISA_BEGIN

// Top-k's threshold pass (common/block_sparse.h): for every query row of p (q, k, the policy's
// options; v, out and the top-k fields unused), thr[row] = the k_top-th best logit among the
// keys the policy allows and jcut[row] = the last key kept among the logits equal to it (ties go
// to the lower key); rows with at most k_top such keys get thr = -inf, jcut = INT32_MAX (keep
// all). thr / jcut are (B, H, Sq) in p.lse's layout. T as the softmax kernels'.
template <typename T>
void topk_threshold(const FwdParamsT<T>& p, DType dt, int k_top, T* thr, int32_t* jcut);

ATTN_CPU_ISA_END
}  // namespace cpu
}  // namespace attn
