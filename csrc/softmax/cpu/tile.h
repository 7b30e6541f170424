// Row operations on one (rows, kBlockN) score tile, shared by the CPU forward and backward.
// They apply the common Policy; the fast path (no softcap, ALiBi or additive bias, tile wholly
// inside the window) is a vector multiply, everything else goes through Policy element-wise.
#pragma once

#include <cmath>
#include <limits>

#include "common/philox.h"
#include "common/policy.h"
#include "cpu/pack.h"
#include "cpu/simd.h"

namespace attn {
namespace cpu {

constexpr double kLog2e = 1.4426950408889634;

// T: the softmax type, float (fp32 / fp16 / bf16 inputs) or double (float64 inputs).
template <typename T>
struct TileSoftmax {
  using V = vec<T>;
  static constexpr int L = kLanes<T>;
  const FwdParamsT<T>& p;
  const PolicyT<T>& pol;
  int bh;       // b * H + h: the dropout stream of this (batch, head)
  bool plain;   // score = scale * x exactly, scale > 0: the scale is folded into the exp pass
  T post;       // the factor online_update() / probs() apply to the stored row: scale or 1

  TileSoftmax(const FwdParamsT<T>& p_, const PolicyT<T>& pol_, int bh_)
      : p(p_), pol(pol_), bh(bh_),
        plain(pol_.softcap == T(0) && pol_.slope == T(0) && pol_.bias_kind != BiasKind::kAdditive &&
              pol_.scale > T(0)),
        post(plain ? pol_.scale : T(1)) {}

  // every (i, j) of the tile rows [i0, i1) x keys [j0, j0 + kBlockN) allowed without a lookup
  bool tile_full(int i0, int i1, int j0) const {
    return pol.bias_kind != BiasKind::kBool && pol.tile_full(i0, i1, j0, j0 + kBlockN);
  }

  // srow: raw q.k of row i -> logits / post, -inf where not allowed. The plain path leaves
  // q.k unscaled: the exp pass multiplies by `post`, saving a pass over the row.
  void scores(T* srow, int i, int j0, bool full) const {
    if (!plain) {
      for (int jj = 0; jj < kBlockN; ++jj) srow[jj] = pol.score(srow[jj], i, j0 + jj);
    }
    if (full) return;
    const T ninf = -std::numeric_limits<T>::infinity();
    if (pol.bias_kind == BiasKind::kBool) {
      for (int jj = 0; jj < kBlockN; ++jj)
        if (!pol.allowed(i, j0 + jj)) srow[jj] = ninf;
      return;
    }
    // lengths, causal and windows allow one interval of keys per row: mask the rest in two runs
    int lo, hi;
    pol.key_range(i, i + 1, &lo, &hi);
    if (i >= pol.len_q) lo = hi = j0;
    lo = std::min(std::max(lo - j0, 0), kBlockN);
    hi = std::min(std::max(hi - j0, lo), kBlockN);
    std::fill(srow, srow + lo, ninf);
    std::fill(srow + hi, srow + kBlockN, ninf);
  }

  // srow: logits -> exp(s - m') in place, with m' = max(m_old, rowmax). Updates the running
  // sum *l and returns m' (m_old unchanged when the whole row is masked). NaN propagates.
  T online_update(T* srow, T m_old, T* l) const {
    V mx = vload(srow);
    for (int c = L; c < kBlockN; c += L) mx = vmax(mx, vload(srow + c));
    T m_new = std::max(m_old, hmax(mx) * post);  // post > 0 keeps the arg max
    if (std::isinf(m_new) && m_new < T(0)) {
      // nothing allowed so far; a NaN logit must still poison the row
      bool nan = false;
      for (int jj = 0; jj < kBlockN; ++jj) nan |= std::isnan(srow[jj]);
      if (!nan) {
        for (int c = 0; c < kBlockN; c += L) vstore(srow + c, V{});
        return m_old;
      }
      m_new = T(0);
    }
    V sum = V{};
    // exp(s * post - m') = 2^(s * post * log2 e - m' log2 e): one FMA, then the exp2
    const T post2 = post * T(kLog2e), m2 = m_new * T(kLog2e);
    for (int c = 0; c < kBlockN; c += L) {
      V e = vexp2_nonpos(vload(srow + c) * post2 - m2);
      vstore(srow + c, e);
      sum += e;
    }
    const T alpha = std::isinf(m_old) ? T(0) : std::exp(m_old - m_new);
    *l = *l * alpha + hsum(sum);
    return m_new;
  }

  // srow: logits -> probabilities exp(s - lse) (0 where masked or the row is empty)
  void probs(T* srow, T lse) const {
    if (std::isinf(lse) && lse < T(0)) {
      for (int c = 0; c < kBlockN; c += L) vstore(srow + c, V{});
      return;
    }
    const T post2 = post * T(kLog2e), lse2 = lse * T(kLog2e);
    for (int c = 0; c < kBlockN; c += L) vstore(srow + c, vexp2_nonpos(vload(srow + c) * post2 - lse2));
  }

  // zero the dropped entries of row i (keys j0 ..); the 1 / (1 - p) is applied by the caller
  void dropout(T* srow, int i, int j0) const {
    if (p.dropout_p <= 0.f) return;
    for (int jj = 0; jj < kBlockN; jj += 4) {
      const Philox4 r = dropout_bits4(p.seed, p.offset, bh, i, (j0 + jj) >> 2);
      for (int u = 0; u < 4; ++u)
        if (!dropout_keep_bits(r.x[u], p.dropout_p)) srow[jj + u] = T(0);
    }
  }
};

}  // namespace cpu
}  // namespace attn
