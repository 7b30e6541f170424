// The fused feature maps phi of the linear family on the CPU (FeatureMap codes of
// common/linear_params.h), shared by the chunked kernels (linear.cpp) and the recurrent step
// (step.cpp), so both apply the same map to the same bits.
#pragma once

#include "common/linear_params.h"
#include "cpu/isa.h"
#include "cpu/simd.h"

namespace attn {
namespace cpu {
ATTN_CPU_ISA_BEGIN

// x <- feature(x) * mul over n values, vectorized; [n, n_pad) is reset to 0 (a feature of the
// zero padding would not be 0).
template <typename T>
inline void apply_feature(FeatureMap fm, T* x, int n, int n_pad, T mul) {
  constexpr int L = kLanes<T>;
  const T log2e = T(1.4426950408889634);
  for (int i = 0; i < n_pad; i += L) {
    vec<T> v = vload(x + i), r = v;
    if (fm == FeatureMap::kElu) {
      // the compares are written so that a NaN takes the branch that keeps it (elu(NaN) = NaN,
      // relu(NaN) = NaN, as torch's): a NaN input must reach the rows that read it
      const vec<T> neg = v > T(0) ? vbcast(T(0)) : v;
      r = v > T(0) ? v + T(1) : vexp2_nonpos(neg * log2e);
    } else if (fm == FeatureMap::kRelu) {
      r = v < T(0) ? vbcast(T(0)) : v;
    }
    vstore(x + i, r * mul);
  }
  for (int i = n; i < n_pad; ++i) x[i] = T(0);
}

ATTN_CPU_ISA_END
}  // namespace cpu
}  // namespace attn
