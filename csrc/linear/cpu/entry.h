// Entry points of the CPU linear attention kernels. No torch types: the bindings
// (csrc/torch/linear_cpu.cpp) fill the params. A DispatchStub per entry point (cpu/dispatch.h).
#pragma once

#include "common/delta_params.h"
#include "common/linear_params.h"
#include "cpu/dispatch.h"

namespace attn {
namespace cpu {

// T = float for fp32 / fp16 / bf16 inputs (dt), double for float64 ones.
// out, den, final_state <- linear attention of q, k, v (common/linear_params.h states the math)
template <typename T>
inline DispatchStub<void (*)(const LinearParamsT<T>&, DType)> linear_fwd_stub;
// dq, dk, dv (and ddecay, dinit_state when set) <- gradients given dout (and dfinal_state)
template <typename T>
inline DispatchStub<void (*)(const LinearBwdParamsT<T>&, DType)> linear_bwd_stub;
// out <- the recurrent step of T positions; state (and normalizer) advanced in place
template <typename T>
inline DispatchStub<void (*)(const LinearStepParamsT<T>&, DType)> linear_step_stub;
// out, final_state <- the delta rule of q, k, v, beta, gate (common/delta_params.h states it)
template <typename T>
inline DispatchStub<void (*)(const DeltaParamsT<T>&)> delta_fwd_stub;
// dq, dk, dv, dbeta (and dgate, dinit_state when set) <- gradients given dout (and dfinal_state)
template <typename T>
inline DispatchStub<void (*)(const DeltaBwdParamsT<T>&)> delta_bwd_stub;

#if defined(ATTN_CPU_ISA)
inline namespace ATTN_CPU_ISA {  // this level's kernels
template <typename T>
void linear_fwd(const LinearParamsT<T>& p, DType dt);
template <typename T>
void linear_bwd(const LinearBwdParamsT<T>& p, DType dt);
template <typename T>
void linear_step(const LinearStepParamsT<T>& p, DType dt);
template <typename T>
void delta_fwd(const DeltaParamsT<T>& p);
template <typename T>
void delta_bwd(const DeltaBwdParamsT<T>& p);
}  // namespace ATTN_CPU_ISA
#endif

}  // namespace cpu
}  // namespace attn
