// The online softmax on the CPU, on one (rows, n) score tile at a time, n <= kBlockN a multiple of
// the vector width (the row stride stays kBlockN): the score policy (common/policy.h) applied to a
// row, the running max / sum update, the probabilities, dropout, a row's end (LSE and sinks), and
// the query-row tasks of the kernels that split the queries. Shared by every family that computes
// a softmax over scores: the softmax forward and backward, top-k's threshold pass and the decode
// kernel. Dense calls use n = kBlockN; the block-sparse walk uses tiles the size of the layout's
// blocks. The fast path (no softcap, ALiBi or additive bias, tile wholly inside the window) is a
// vector multiply, everything else goes through Policy element-wise.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "common/philox.h"
#include "common/policy.h"
#include "cpu/isa.h"
#include "cpu/pack.h"
#include "cpu/simd.h"

namespace attn {
namespace cpu {
ATTN_CPU_ISA_BEGIN

constexpr double kLog2e = 1.4426950408889634;

// T: the softmax type, float (fp32 / fp16 / bf16 inputs) or double (float64 inputs).
template <typename T>
struct TileSoftmax {
  using V = vec<T>;
  static constexpr int L = kLanes<T>;
  const SoftmaxParamsT<T>& p;
  const PolicyT<T>& pol;
  int bh;       // b * H + h: the dropout stream of this (batch, head)
  bool plain;   // score = scale * x exactly, scale > 0: the scale is folded into the exp pass
  T post;       // the factor online_update() / probs() apply to the stored row: scale or 1

  TileSoftmax(const SoftmaxParamsT<T>& p_, const PolicyT<T>& pol_, int bh_)
      : p(p_), pol(pol_), bh(bh_),
        plain(pol_.softcap == T(0) && pol_.slope == T(0) && pol_.bias_kind != BiasKind::kAdditive &&
              pol_.scale > T(0)),
        post(plain ? pol_.scale : T(1)) {}

  // every (i, j) of the tile rows [i0, i1) x keys [j0, j0 + n) allowed without a lookup (the
  // block-sparse walk only hands over tiles inside on blocks, so the layout needs no check)
  bool tile_full(int i0, int i1, int j0, int n = kBlockN) const {
    return pol.bias_kind != BiasKind::kBool && pol.tile_full(i0, i1, j0, j0 + n);
  }

  // srow: raw q.k of row i -> logits / post, -inf where not allowed. The plain path leaves
  // q.k unscaled: the exp pass multiplies by `post`, saving a pass over the row.
  void scores(T* srow, int i, int j0, bool full, int n = kBlockN) const {
    if (!plain) {
      // only (i, j) inside the lengths: an additive bias has no entry past len_q / len_k (the
      // last, partial tile of a row; varlen), and a tile reaching there is not full, so the
      // masking below sets those columns to -inf whatever they hold
      const int n_in = i < pol.len_q ? std::min(n, std::max(pol.len_k - j0, 0)) : 0;
      for (int jj = 0; jj < n_in; ++jj) srow[jj] = pol.score(srow[jj], i, j0 + jj);
    }
    if (pol.topk_thr != nullptr) topk(srow, i, j0, n);
    if (full) return;
    const T ninf = -std::numeric_limits<T>::infinity();
    if (pol.bias_kind == BiasKind::kBool && pol.layout != nullptr) {  // every rule, element by element
      for (int jj = 0; jj < n; ++jj)
        if (!pol.allowed(i, j0 + jj)) srow[jj] = ninf;
      return;
    }
    // lengths, causal and windows allow one interval of keys per row: mask the rest in two runs
    int lo, hi;
    pol.key_range(i, i + 1, &lo, &hi);
    if (i >= pol.len_q) lo = hi = j0;
    lo = std::min(std::max(lo - j0, 0), n);
    hi = std::min(std::max(hi - j0, lo), n);
    std::fill(srow, srow + lo, ninf);
    std::fill(srow + hi, srow + n, ninf);
    if (pol.bias_kind == BiasKind::kBool) {
      // then the bool mask inside that interval (a key_padding_mask, or a row of a dense mask):
      // one byte per key, which vectorizes where the keys are contiguous; Policy::allowed()
      // element by element (its window checks and strided lookup per key) made a masked forward
      // half as fast as an unmasked one. Only keys inside the lengths are read.
      const int64_t cs = pol.bias_col_stride;
      const uint8_t* m = static_cast<const uint8_t*>(pol.bias) + int64_t(i) * pol.bias_row_stride + int64_t(j0) * cs;
      if (cs == 1) {
        for (int jj = lo; jj < hi; ++jj) srow[jj] = m[jj] != 0 ? srow[jj] : ninf;
      } else {
        for (int jj = lo; jj < hi; ++jj)
          if (m[jj * cs] == 0) srow[jj] = ninf;
      }
    }
  }

  // top-k's rule on row i (block_sparse.h): the logit is score(x) as the threshold pass
  // computed it, i.e. x * scale on the plain path, where the row still holds x
  // (policy.h's topk_keep in vectors: drop when logit < thr, or logit == thr past jcut; a NaN
  // stays). Key indices as T are exact: sequences are far below 2^24.
  void topk(T* srow, int i, int j0, int n) const {
    const V thr = vbcast(pol.topk_thr[i]);
    const V jcut = vbcast(T(std::min(pol.topk_jcut[i], 1 << 30)));
    const V mul = vbcast(plain ? pol.scale : T(1));  // x * 1 is x: the logit either way
    const V ninf = vbcast(-std::numeric_limits<T>::infinity());
    V jv = lane_index<T>() + T(j0);
    for (int c = 0; c < n; c += L) {
      const V x = vload(srow + c);
      const V logit = x * mul;
      const auto drop = (logit < thr) | ((logit == thr) & (jv > jcut));
      vstore(srow + c, drop ? ninf : x);
      jv += T(L);
    }
  }

  // The exponent of exp(s * post - m) in base 2, the one formula of the forward (m = the running
  // max) and the backward (m = lse): (s * post - m) log2 e, the difference taken first, so a
  // logit equal to m gives exactly 2^0 = 1 (simd.h's vexp2_nonpos(0) is 1): with one visible key
  // P = 1 and out = v, dV = dO bit for bit. The fused form s * post log2 e - m log2 e (one FMA)
  // leaves the FMA's rounding residual of the product instead of 0; the forward hides it (it
  // divides by l = that same 2^r) but the backward's P = 2^r does not. The plain path's product
  // s * post must be rounded before the subtraction, as the max m = round(max s * post) was: an
  // empty asm makes the compiler materialize it, so it cannot contract the two into an FMA. x86
  // without AVX has no FMA to contract into (and a 32-byte vector fits no SSE register, so "+v"
  // would not compile); on AArch64 the vector spans two NEON registers, so it goes through memory.
  V exp2_arg(V s, T m) const {
    if (plain) {
      s = s * vbcast(post);
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && defined(__AVX__)
      asm("" : "+v"(s));
#elif defined(__GNUC__) && defined(__aarch64__)
      asm("" : "+m"(s));
#endif
    }
    return (s - vbcast(m)) * vbcast(T(kLog2e));
  }

  // srow: logits -> exp(s - m') in place, with m' = max(m_old, rowmax). Adds the tile's sum to
  // the running sum *l with compensation *lc (simd.h's kahan_add: the row's l is *l - *lc) and
  // returns m' (m_old unchanged when the whole row is masked). NaN propagates.
  T online_update(T* srow, T m_old, T* l, T* lc, int n = kBlockN) const {
    V mx = vload(srow);
    for (int c = L; c < n; c += L) mx = vmax(mx, vload(srow + c));
    T m_new = new_max(m_old, mx);
    if (std::isinf(m_new) && m_new < T(0)) {
      // nothing allowed so far; a NaN logit must still poison the row
      bool nan = false;
      for (int jj = 0; jj < n; ++jj) nan |= std::isnan(srow[jj]);
      if (!nan) {
        for (int c = 0; c < n; c += L) vstore(srow + c, V{});
        return m_old;
      }
      m_new = T(0);
    }
    V sum = V{};
    for (int c = 0; c < n; c += L) {
      V e = vexp2_nonpos(exp2_arg(vload(srow + c), m_new));
      vstore(srow + c, e);
      sum += e;
    }
    add_sum(m_old, m_new, l, lc, hsum_tree(sum));
    return m_new;
  }
  // online_update's steps, for a caller that holds the tile in registers (the decode kernel's
  // fused pass): the running max after a tile whose logits / post have lane maxima mx ...
  T new_max(T m_old, V mx) const { return std::max(m_old, hmax(mx) * post); }  // post > 0 keeps the arg max
  // ... and the running sum (l, compensation lc) moved from max m_old to m_new, plus the tile's
  // sum of exp(s - m_new)
  static void add_sum(T m_old, T m_new, T* l, T* lc, T tile_sum) {
    // the row's max mostly stays put after its first tiles: exp(0) = 1 needs no call
    if (m_new != m_old || std::isinf(m_old)) {
      const T alpha = std::isinf(m_old) ? T(0) : std::exp(m_old - m_new);
      *l *= alpha;
      *lc *= alpha;
    }
    kahan_add(*l, *lc, tile_sum);
  }

  // srow: logits -> probabilities exp(s - lse) (0 where masked or the row is empty). A row that
  // read a NaN has a NaN lse: P is NaN at the keys it sees and still 0 at the keys hidden from it
  // (exp(-inf - NaN) would be NaN), so the NaN reaches the dK / dV of those keys only.
  void probs(T* srow, T lse, int n = kBlockN) const {
    if (std::isinf(lse) && lse < T(0)) {
      for (int c = 0; c < n; c += L) vstore(srow + c, V{});
      return;
    }
    if (lse != lse) {
      const V hidden = vbcast(-std::numeric_limits<T>::infinity()), nan = vbcast(lse);
      for (int c = 0; c < n; c += L) vstore(srow + c, vload(srow + c) == hidden ? V{} : nan);
      return;
    }
    for (int c = 0; c < n; c += L) vstore(srow + c, vexp2_nonpos(exp2_arg(vload(srow + c), lse)));
  }

  // zero the dropped entries of row i (keys j0 ..); the 1 / (1 - p) is applied by the caller
  void dropout(T* srow, int i, int j0, int n = kBlockN) const {
    if (p.dropout_p <= 0.f) return;
    const float drop = float(p.dropout_p);  // the mask is drawn in float32 for every T (philox.h)
    const DropoutCoords& c = p.dropout_coords;
    if (c.identity()) {  // one draw per 4 keys (j0 is a multiple of 4)
      for (int jj = 0; jj < n; jj += 4) {
        const Philox4 r = dropout_bits4(p.seed, p.offset, bh, i, (j0 + jj) >> 2);
        for (int u = 0; u < 4; ++u)
          if (!dropout_keep_bits(r.x[u], drop)) srow[jj + u] = T(0);
      }
      return;
    }
    // a piece of a larger problem: each key at its global column; runs of consecutive global
    // columns (every layout but stripe) still share one draw per 4
    const int gbh = c.global_bh(bh), gi = c.row(i);
    Philox4 r{};
    bool have = false;
    int last = 0;
    for (int jj = 0; jj < n; ++jj) {
      const int gj = c.col(j0 + jj);
      if (!have || (gj >> 2) != last) {
        r = dropout_bits4(p.seed, p.offset, gbh, gi, gj >> 2);
        last = gj >> 2;
        have = true;
      }
      if (!dropout_keep_bits(r.x[gj & 3], drop)) srow[jj] = T(0);
    }
  }
};

// ---------------------------------------------------------------- the end of a row
// A row's online softmax ends with running max m and sum l; the sink logit (has_sink) joins
// the denominator only. Sets *lse (-inf for a row that saw nothing and has no sink) and returns
// the factor turning the row's running output into its output, times `scale` (0 for such a
// row). Shared by the forward and the decode kernels.
template <typename T>
inline T finish_row(T m, T l, bool has_sink, T sink, T scale, T* lse) {
  T alpha = T(1);
  if (has_sink && sink > m) {  // rescale to the sink's max
    alpha = std::isinf(m) ? T(0) : std::exp(m - sink);
    l = l * alpha + T(1);
    m = sink;
  } else if (has_sink) {
    l += std::exp(sink - m);
  }
  const bool empty = !(l > T(0)) && !std::isnan(l);
  *lse = empty ? -std::numeric_limits<T>::infinity() : m + std::log(l);
  return empty ? T(0) : alpha * scale / l;
}

// ---------------------------------------------------------------- tasks over query rows
// One task of the kernels that split the queries (the forward, top-k's threshold pass): a
// (batch, query head, block of kBlockM rows). last_first: the last row blocks first (with a
// causal mask they see the most keys).
struct QueryTask {
  int b, h, i0;
  QueryTask(int64_t task, int n_mblocks, int heads, bool last_first) {
    const int m = int(task % n_mblocks);
    h = int((task / n_mblocks) % heads);
    b = int(task / (int64_t(n_mblocks) * heads));
    i0 = (last_first ? n_mblocks - 1 - m : m) * kBlockM;
  }
};

// Masks the keys of [j0, j0 + n) outside [lo, hi) on one score row, after scores(): before it,
// a softcap would map the -inf to a finite -softcap (softcap * tanh(-inf)) and let the keys in.
// (Found on AVX-512, where kPanel = 32 makes a block-sparse tile of 16-key blocks start before
// its block: with softcap 4 the keys before it were read, an error of 1e-2.)
template <typename T>
inline void mask_outside(T* srow, int j0, int n, int lo, int hi) {
  const T ninf = -std::numeric_limits<T>::infinity();
  std::fill(srow, srow + (lo - j0), ninf);
  std::fill(srow + (hi - j0), srow + n, ninf);
}

ATTN_CPU_ISA_END
}  // namespace cpu
}  // namespace attn
