// The forward's online-softmax steps on mma.sync C fragments, shared by the mma.sync forward and
// the sm_90a wgmma forward (whose m64nNk16 accumulators are, per warp, the same fragments).
#pragma once

#include "cuda/mma.cuh"
#include "softmax/cuda/kernel_common.cuh"  // Policy, logit2

namespace attn {
namespace tc {

// ---------------------------------------------------------------- softmax on C fragments
// The forward's per-tile softmax work on one 16-row m-tile held as C fragments, shared by the
// mma.sync kernel and the sm_90a wgmma kernel (whose m64nNk16 accumulators are, per warp, the
// same fragments: warp w of a warpgroup holds rows 16 w .. 16 w + 15).
//   s: (16, 8 kNT) scores, s[4 nt + e] = row g + 8 (e / 2), column 8 nt + 2 c + e % 2
//   o: (16, 8 kDT) output accumulator, the same layout
// Rows g and g + 8 (hf = 0, 1) are spread over the 4 lanes of a quad.

// Logits in the log2 domain, in place. check = false: the caller proved the tile is inside the
// window and the policy is plain, so every element is only scaled. i0 / j0: the tile's first
// query row / key.
template <int kNT>
__device__ __forceinline__ void tile_logits(float* s, const Policy& pol, bool plain, bool check,
                                            float scale_log2, int i0, int j0, int lane) {
  if (!check) {
#pragma unroll
    for (int x = 0; x < 4 * kNT; ++x) s[x] *= scale_log2;
    return;
  }
  const int g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = i0 + g + (e >> 1) * 8;
      const int j = j0 + nt * 8 + 2 * c + (e & 1);
      s[4 * nt + e] = logit2(pol, plain, true, scale_log2, s[4 * nt + e], i, j);
    }
}

// One online-softmax step, in two halves so that a pipelined caller can rescale O later (after
// the product that still accumulates into it has retired): softmax_rows() folds the tile's row
// maxima into row_m[2], turns s into 2^(s - m) (unnormalized probabilities), adds their sums to
// row_l[2] (per lane; the quad is reduced at the end) and returns the rescale factors
// alpha[hf] = 2^(m_old - m_new); rescale_rows() multiplies o by them. A row with nothing allowed
// so far keeps m = -inf and uses 0 as its reference, so exp2(-inf) gives P = 0 rather than NaN.
template <int kNT>
__device__ __forceinline__ void softmax_rows(float* s, float* row_m, float* row_l, float* alpha) {
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) mx = fmaxf(mx, fmaxf(s[4 * nt + 2 * hf], s[4 * nt + 2 * hf + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(row_m[hf], mx);
    const float m_use = m_new == -INFINITY ? 0.f : m_new;
    alpha[hf] = fast_exp2(row_m[hf] - m_use);
    row_m[hf] = m_new;
    float lsum = 0.f;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      const float p0 = fast_exp2(s[4 * nt + 2 * hf] - m_use);
      const float p1 = fast_exp2(s[4 * nt + 2 * hf + 1] - m_use);
      lsum += p0 + p1;
      s[4 * nt + 2 * hf] = p0;
      s[4 * nt + 2 * hf + 1] = p1;
    }
    row_l[hf] = row_l[hf] * alpha[hf] + lsum;
  }
}

// Dropout on a (16, 8 kNT) tile of probabilities s (C fragments, as above; row i0 + g + 8 hf, key
// j0 + 8 nt + 2 c + e), after the row sums (the LSE is of the undropped probabilities): a dropped
// element becomes 0, a kept one keeps its value (the 1 / (1 - p) rescale comes at the end, with
// the normalization). The Philox stream of the tensor-core kernels (reference.dropout_mask): keys
// j, j + 1 (j even) share one draw; under global dropout coordinates, a draw per element at them.
template <int kNT>
__device__ __forceinline__ void dropout_tile(float* s, const SoftmaxParams& p, int bh, int i0, int j0, int lane) {
  const int g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf)
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      const int i = i0 + g + hf * 8;
      const int j = j0 + nt * 8 + 2 * c;
      float* e = s + 4 * nt + 2 * hf;
      if (p.dropout_coords.identity()) {
        const Philox4 r = dropout_bits4(p.seed, p.offset, bh, i, j >> 2);
        if (!dropout_keep_bits(philox_word(r, j & 3), p.dropout_p)) e[0] = 0.f;
        if (!dropout_keep_bits(philox_word(r, (j & 3) + 1), p.dropout_p)) e[1] = 0.f;
      } else {
        if (!dropout_keep_at(p.seed, p.offset, p.dropout_coords, bh, i, j, p.dropout_p)) e[0] = 0.f;
        if (!dropout_keep_at(p.seed, p.offset, p.dropout_coords, bh, i, j + 1, p.dropout_p)) e[1] = 0.f;
      }
    }
}

template <int kDT>
__device__ __forceinline__ void rescale_rows(float* o, const float* alpha) {
#pragma unroll
  for (int hf = 0; hf < 2; ++hf)
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      o[4 * dt + 2 * hf] *= alpha[hf];
      o[4 * dt + 2 * hf + 1] *= alpha[hf];
    }
}

template <int kNT, int kDT>
__device__ __forceinline__ void online_softmax(float* s, float* o, float* row_m, float* row_l) {
  float alpha[2];
  softmax_rows<kNT>(s, row_m, row_l, alpha);
  rescale_rows<kDT>(o, alpha);
}

// P as the A operand of the next product, packed to 16 bits: the C fragments of n-tiles 2 kk and
// 2 kk + 1 are exactly the A fragment of k-step kk (mma.m16n8k16 and wgmma with A in registers).
template <typename T, int kNT>
__device__ __forceinline__ void pack_a_frags(const float* s, uint32_t (*pa)[4]) {
  static_assert(kNT % 2 == 0, "k-steps are 16 keys");
#pragma unroll
  for (int kk = 0; kk < kNT / 2; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) pa[kk][r] = TypeOps<T>::pack(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
}

}  // namespace tc
}  // namespace attn
