// Entry points of the softmax family's CPU kernels. No torch types: the bindings
// (csrc/torch/softmax_cpu.cpp) fill the params. Each entry point is a DispatchStub
// (cpu/dispatch.h): every ISA level's build of fwd.cpp / bwd.cpp registers its kernel in the
// stub, and a binding calls the stub.
#pragma once

#include <cstdint>

#include "common/softmax_params.h"
#include "cpu/dispatch.h"

namespace attn {
namespace cpu {

// T = float for fp32 / fp16 / bf16 inputs (dt), double for float64 ones.
// out, lse <- softmax attention of q, k, v (see attention_ext/reference.py for the math)
template <typename T>
inline DispatchStub<void (*)(const SoftmaxParamsT<T>&, DType)> softmax_fwd_stub;
// dq, dk, dv (and dbias, dsinks when set) <- gradients given dout, out, lse
template <typename T>
inline DispatchStub<void (*)(const SoftmaxBwdParamsT<T>&, DType)> softmax_bwd_stub;
// keep (B, H, Sq, Sk) uint8 <- the dropout keep mask the kernels draw for (seed, offset)
inline DispatchStub<void (*)(uint8_t* keep, int b, int h, int sq, int sk, float p, uint64_t seed, uint64_t offset)>
    dropout_mask_stub;

#if defined(ATTN_CPU_ISA)
inline namespace ATTN_CPU_ISA {  // this level's kernels
template <typename T>
void softmax_fwd(const SoftmaxParamsT<T>& p, DType dt);
template <typename T>
void softmax_bwd(const SoftmaxBwdParamsT<T>& p, DType dt);
void dropout_mask(uint8_t* keep, int b, int h, int sq, int sk, float p, uint64_t seed, uint64_t offset);
}  // namespace ATTN_CPU_ISA
#endif

}  // namespace cpu
}  // namespace attn
