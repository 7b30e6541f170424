// Compensated running sums on the device, for the SIMT kernels' per-lane sums over a row's keys
// (or a key's queries). The rule is the CPU kernels' (csrc/cpu/simd.h, "compensated running
// sums"): a float32 sum that takes one term per key loses the low bits of every term, and past
// 2^24 terms of 1 each + 1 rounds away entirely. So the terms first go to a block-local
// accumulator, and every kFoldTerms terms (and at the end) the block joins the running sum
// through Kahan's compensated addition: the error stays that of one block plus a few ulps,
// whatever the row length. NaN propagates; a sum that overflows turns into NaN (c = inf - inf),
// as on the CPU.
//
// The intrinsics (__fadd_rn, __fsub_rn) are never contracted into an FMA or reassociated, so
// c keeps the rounding error under any nvcc flags.
#pragma once

namespace attn {

// terms per block: the block's own error is that of a kFoldTerms-term float32 sum, and a fold
// (4 flops per element) costs a small fraction of the kFoldTerms terms' work
constexpr int kFoldTerms = 64;

__device__ __forceinline__ void kahan_add(float& s, float& c, float x) {
  const float y = __fsub_rn(x, c);
  const float t = __fadd_rn(s, y);
  c = __fsub_rn(__fsub_rn(t, s), y);
  s = t;
}

// (N) this lane's running sums s and their compensations c (the value is s - c); fold() adds a
// block-local accumulator x (N) into them and zeroes it.
template <int N>
struct CompensatedSum {
  float s[N], c[N];

  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int t = 0; t < N; ++t) s[t] = c[t] = 0.f;
  }
  // the online softmax's rescale, when the running max has moved since the last fold
  __device__ __forceinline__ void scale(float f) {
#pragma unroll
    for (int t = 0; t < N; ++t) {
      s[t] *= f;
      c[t] *= f;
    }
  }
  __device__ __forceinline__ void fold(float* x) {
#pragma unroll
    for (int t = 0; t < N; ++t) {
      kahan_add(s[t], c[t], x[t]);
      x[t] = 0.f;
    }
  }
  __device__ __forceinline__ float value(int t) const { return __fsub_rn(s[t], c[t]); }
};

}  // namespace attn
