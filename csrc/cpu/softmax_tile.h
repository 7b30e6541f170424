// Row operations on one (rows, kBlockN) score tile, shared by the CPU forward and backward.
// They apply the common Policy; the fast path (no softcap, ALiBi or additive bias, tile wholly
// inside the window) is a vector multiply, everything else goes through Policy element-wise.
#pragma once

#include <cmath>
#include <limits>

#include "../common/philox.h"
#include "../common/policy.h"
#include "pack.h"
#include "simd.h"

namespace attn {
namespace cpu {

struct TileSoftmax {
  const FwdParams& p;
  const Policy& pol;
  int bh;       // b * H + h: the dropout stream of this (batch, head)
  bool plain;   // score = scale * x exactly

  TileSoftmax(const FwdParams& p_, const Policy& pol_, int bh_)
      : p(p_), pol(pol_), bh(bh_),
        plain(pol_.softcap == 0.f && pol_.slope == 0.f && pol_.bias_kind != BiasKind::kAdditive) {}

  // every (i, j) of the tile rows [i0, i1) x keys [j0, j0 + kBlockN) allowed without a lookup
  bool tile_full(int i0, int i1, int j0) const {
    return pol.bias_kind != BiasKind::kBool && pol.tile_full(i0, i1, j0, j0 + kBlockN);
  }

  // srow: raw q.k of row i -> logits, -inf where not allowed
  void scores(float* srow, int i, int j0, bool full) const {
    if (plain) {
      for (int c = 0; c < kBlockN; c += W) vstore(srow + c, vload(srow + c) * pol.scale);
    } else {
      for (int jj = 0; jj < kBlockN; ++jj) srow[jj] = pol.score(srow[jj], i, j0 + jj);
    }
    if (!full) {
      for (int jj = 0; jj < kBlockN; ++jj)
        if (!pol.allowed(i, j0 + jj)) srow[jj] = -std::numeric_limits<float>::infinity();
    }
  }

  // srow: logits -> exp(s - m') in place, with m' = max(m_old, rowmax). Updates the running
  // sum *l and returns m' (m_old unchanged when the whole row is masked). NaN propagates.
  float online_update(float* srow, float m_old, float* l) const {
    vf mx = vload(srow);
    for (int c = W; c < kBlockN; c += W) mx = vmax(mx, vload(srow + c));
    float m_new = std::max(m_old, hmax(mx));
    if (std::isinf(m_new) && m_new < 0.f) {
      // nothing allowed so far; a NaN logit must still poison the row
      bool nan = false;
      for (int jj = 0; jj < kBlockN; ++jj) nan |= std::isnan(srow[jj]);
      if (!nan) {
        for (int c = 0; c < kBlockN; c += W) vstore(srow + c, vf{});
        return m_old;
      }
      m_new = 0.f;
    }
    vf sum = vf{};
    for (int c = 0; c < kBlockN; c += W) {
      vf e = vexp(vload(srow + c) - m_new);
      vstore(srow + c, e);
      sum += e;
    }
    const float alpha = std::isinf(m_old) ? 0.f : std::exp(m_old - m_new);
    *l = *l * alpha + hsum(sum);
    return m_new;
  }

  // srow: logits -> probabilities exp(s - lse) (0 where masked or the row is empty)
  void probs(float* srow, float lse) const {
    if (std::isinf(lse) && lse < 0.f) {
      for (int c = 0; c < kBlockN; c += W) vstore(srow + c, vf{});
      return;
    }
    for (int c = 0; c < kBlockN; c += W) vstore(srow + c, vexp(vload(srow + c) - lse));
  }

  // zero the dropped entries of row i (keys j0 ..); the 1 / (1 - p) is applied by the caller
  void dropout(float* srow, int i, int j0) const {
    if (p.dropout_p <= 0.f) return;
    for (int jj = 0; jj < kBlockN; jj += 4) {
      const Philox4 r = dropout_bits4(p.seed, p.offset, bh, i, (j0 + jj) >> 2);
      for (int u = 0; u < 4; ++u)
        if (!dropout_keep_bits(r.x[u], p.dropout_p)) srow[jj + u] = 0.f;
    }
  }
};

}  // namespace cpu
}  // namespace attn
