// Entry points of the CPU kernels. No torch types: the api/ layer fills the params.
#pragma once

#include <cstdint>

#include "../common/params.h"

namespace attn {
namespace cpu {

// out, lse <- softmax attention of q, k, v (see attention_ext/reference.py for the math)
void fwd(const FwdParams& p, DType dt);
// dq, dk, dv (and dbias, dsinks when set) <- gradients given dout, out, lse
void bwd(const BwdParams& p, DType dt);
// keep (B, H, Sq, Sk) uint8 <- the dropout keep mask the kernels draw for (seed, offset)
// float32 lanes of the SIMD vector this build uses
int simd_width();

void dropout_mask(uint8_t* keep, int b, int h, int sq, int sk, float p, uint64_t seed, uint64_t offset);

}  // namespace cpu
}  // namespace attn
