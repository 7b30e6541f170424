// Entry points of the CPU kernels. No torch types: the api/ layer fills the params.
#pragma once

#include <cstdint>

#include "common/params.h"
#include "cpu/isa.h"

namespace attn {
namespace cpu {
ATTN_CPU_ISA_BEGIN

// T = float for fp32 / fp16 / bf16 inputs (dt), double for float64 ones; instantiated for both.
// out, lse <- softmax attention of q, k, v (see attention_ext/reference.py for the math)
template <typename T>
void fwd(const FwdParamsT<T>& p, DType dt);
// dq, dk, dv (and dbias, dsinks when set) <- gradients given dout, out, lse
template <typename T>
void bwd(const BwdParamsT<T>& p, DType dt);

// float32 lanes of the SIMD vector this build uses
int simd_width();

// keep (B, H, Sq, Sk) uint8 <- the dropout keep mask the kernels draw for (seed, offset)
void dropout_mask(uint8_t* keep, int b, int h, int sq, int sk, float p, uint64_t seed, uint64_t offset);

ATTN_CPU_ISA_END
}  // namespace cpu
}  // namespace attn
