// Entry points of the CPU linear attention kernels. No torch types: csrc/torch fills the params.
#pragma once

#include "common/linear_params.h"
#include "cpu/isa.h"

namespace attn {
namespace cpu {
ATTN_CPU_ISA_BEGIN

// T = float for fp32 / fp16 / bf16 inputs (dt), double for float64 ones; instantiated for both.
// out, den, final_state <- linear attention of q, k, v (common/linear_params.h states the math)
template <typename T>
void linear_fwd(const LinearParamsT<T>& p, DType dt);
// dq, dk, dv (and ddecay, dinit_state when set) <- gradients given dout (and dfinal_state)
template <typename T>
void linear_bwd(const LinearBwdParamsT<T>& p, DType dt);
// out <- the recurrent step of T positions; state (and normalizer) advanced in place
template <typename T>
void linear_step(const LinearStepParamsT<T>& p, DType dt);

ATTN_CPU_ISA_END
}  // namespace cpu
}  // namespace attn
