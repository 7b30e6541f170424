// Device helpers shared by the softmax family's tensor-core and SIMT kernels: the logit in the
// log2 domain and the per-element backward math (where rows live: cuda/param_rows.cuh). The semantics themselves (masking, the
// logit) come from csrc/common/policy.h, the same code the CPU kernel runs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/softmax_params.h"
#include "common/philox.h"
#include "common/policy.h"
#include "cuda/param_rows.cuh"

namespace attn {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// No per-element work beyond the window and the block layout: no softcap, ALiBi, bias or bool
// mask, and no top-k (whose rule needs the logit exactly as pol.score computes it).
__device__ __forceinline__ bool policy_is_plain(const Policy& pol) {
  return pol.softcap <= 0.f && pol.slope == 0.f && pol.bias_kind == BiasKind::kNone && pol.topk_thr == nullptr;
}

// The structural rules of a plain policy: the window and the block layout (one null test when
// the call is dense).
__device__ __forceinline__ bool plain_allowed(const Policy& pol, int i, int j) {
  return pol.in_window(i, j) && pol.in_layout(i, j);
}

// The forward logit in the log2 domain, -inf where (i, j) is not allowed. The log2 e product is
// __fmul_rn (never contracted): the backward's exp2f(s2 - lse2) must see the same rounded s2 as
// the forward's max, not an FMA that keeps the product's rounding residual (a row with one
// visible key must get P = 1 exactly; the CPU's online_softmax.h exp2_arg has the same rule).
//   check = false: the caller proved the tile is inside the window and the layout, and the
//   policy is plain.
__device__ __forceinline__ float logit2(const Policy& pol, bool plain, bool check, float scale_log2,
                                        float x, int i, int j) {
  if (plain) {
    if (check && !plain_allowed(pol, i, j)) return -INFINITY;
    return __fmul_rn(x, scale_log2);
  }
  if (!pol.allowed(i, j)) return -INFINITY;
  return __fmul_rn(pol.score(x, i, j), kLog2e);
}

// logit2 with top-k's rule too, for the SIMT kernels (the only ones top-k calls reach; the
// mma.sync kernels keep its registers out): the logit s = pol.score(x, i, j) is the one the
// threshold pass ranked, and kept iff pol.topk_keep(s, i, j).
__device__ __forceinline__ float logit2_topk(const Policy& pol, bool plain, float scale_log2, float x, int i,
                                             int j) {
  if (pol.topk_thr == nullptr) return logit2(pol, plain, true, scale_log2, x, i, j);
  if (!pol.allowed(i, j)) return -INFINITY;
  const float s = pol.score(x, i, j);
  return pol.topk_keep(s, i, j) ? __fmul_rn(s, kLog2e) : -INFINITY;
}

// Block-sparse helpers for kernels that do not walk a tile index (the SIMT kernels, the
// deterministic dQ kernel).
// The end of the run of positions [a, end) that share a's layout block, capped at hi; hi when
// the call is dense. Rows and keys use the same block size.
__device__ __forceinline__ int layout_run_end(const Policy& pol, int a, int hi) {
  return pol.layout == nullptr ? hi : min(hi, (a / pol.block + 1) * pol.block);
}
// The layout under the tile [i0, i1) x [j0, j1) (non-empty, inside the sequence): 0 = no block
// on, 1 = some, 2 = every block on (or dense). Reads (tile / block)^2 bytes of the layout.
__device__ __forceinline__ int layout_tile_state(const Policy& pol, int i0, int i1, int j0, int j1) {
  if (pol.layout == nullptr) return 2;
  int on = 0, n = 0;
  for (int r = i0 / pol.block; r <= (i1 - 1) / pol.block; ++r)
    for (int c = j0 / pol.block; c <= (j1 - 1) / pol.block; ++c) {
      on += pol.layout[int64_t(r) * pol.n_kb + c] != 0;
      ++n;
    }
  return on == 0 ? 0 : (on == n ? 2 : 1);
}

// The tile index entries [*e_lo, *e_hi) of outer tile t of query head h (block_sparse.h) whose
// inner tiles lie in [lo, hi): the index lists inner tiles in ascending order.
__device__ __forceinline__ void sparse_entries(const BlockSparseParams& sp, const TileIndex& ix, int h, int t,
                                               int lo, int hi, int* e_lo, int* e_hi) {
  int a, z;
  sp.tiles(ix, h, t, &a, &z);
  while (a < z && ix.idx[a] < lo) ++a;
  while (z > a && ix.idx[z - 1] >= hi) --z;
  *e_lo = a;
  *e_hi = z;
}

// The backward of one (i, j), given x = q.k, dp = dO.v, lse2 = lse * log2(e) (+inf for a row
// with nothing allowed, so that P = 0), dsum = dot(dO, O) and the dropout factor z (0 for a
// dropped element, 1 / (1 - p) for a kept one, 1 without dropout):
//   P  = exp(s - lse);   pd = P * z              (the probabilities that multiplied V)
//   ds = P * (dp * z - dsum)                      (d loss / d logit, = d loss / d bias)
//   dx = ds * d s / d x                           (feeds dQ = dx K and dK = dx^T Q)
// kTopk: apply top-k's rule too (the SIMT kernels; see logit2_topk).
struct BwdPoint {
  float pd, ds, dx;
};
template <bool kTopk = false>
__device__ __forceinline__ BwdPoint bwd_point(const Policy& pol, bool plain, bool check,
                                              float scale, float x, float dp, float lse2,
                                              float dsum, float z, int i, int j) {
  BwdPoint r;
  float s2;
  if (plain) {
    if (check && !plain_allowed(pol, i, j)) {
      r.pd = r.ds = r.dx = 0.f;
      return r;
    }
    s2 = __fmul_rn(x, scale * kLog2e);
  } else {
    if (!pol.allowed(i, j)) {
      r.pd = r.ds = r.dx = 0.f;
      return r;
    }
    const float s = pol.score(x, i, j);
    if (kTopk && !pol.topk_keep(s, i, j)) {
      r.pd = r.ds = r.dx = 0.f;
      return r;
    }
    s2 = __fmul_rn(s, kLog2e);
  }
  float pr = exp2f(s2 - lse2);
  r.pd = pr * z;
  r.ds = pr * (dp * z - dsum);
  r.dx = r.ds * (plain ? scale : pol.dscore_dx(x));
  return r;
}

// The dropout factor z of element (i, j) of (batch, head) bh from the Philox stream of the
// tensor-core kernels (4 keys per draw): 0 for a dropped element, rdrop = 1 / (1 - p) for a kept one.
// Under global dropout coordinates (a piece of a larger problem) the draw is at those.
__device__ __forceinline__ float dropout_scale(const SoftmaxParams& p, int bh, int i, int j, float rdrop) {
  if (!p.dropout_coords.identity())
    return dropout_keep_at(p.seed, p.offset, p.dropout_coords, bh, i, j, p.dropout_p) ? rdrop : 0.f;
  const Philox4 r = dropout_bits4(p.seed, p.offset, bh, i, j >> 2);
  return dropout_keep_bits(philox_word(r, j & 3), p.dropout_p) ? rdrop : 0.f;
}

// The forward's dropout keep bits of kN elements of one thread's fragment: bit x for element x
// at (query i, key j) = coord(x, &i, &j) (dropout_scale's draw). Drawn in a rolled loop ahead of
// the elementwise pass that reads them: drawn inside that unrolled pass, ptxas interleaved the
// Philox rounds of many elements with the live accumulators and spilled (the sm_90a wgmma
// backward's dropout / dbias instance at D = 128: 1.75 KB of spill stores, 124 B after).
template <int kN, typename Coord>
__device__ __forceinline__ auto dropout_keep_mask(const SoftmaxParams& p, int bh, Coord coord) {
  using Mask = std::conditional_t<(kN <= 32), uint32_t, uint64_t>;
  static_assert(kN <= 64, "one bit per element in a 64-bit word");
  Mask keep = 0;
#pragma unroll 1
  for (int x = 0; x < kN; ++x) {
    int i, j;
    coord(x, &i, &j);
    keep |= Mask(dropout_scale(p, bh, i, j, 1.f) != 0.f) << x;
  }
  return keep;
}

// d bias (i, j) of (b, h) = ds. A bias broadcast over the query rows (row stride 0) sums the
// rows' contributions with atomics (skipping zeros: masked elements are the common case).
__device__ __forceinline__ void store_dbias(const SoftmaxBwdParams& p, int b, int h, int i, int j, float ds) {
  float* db = p.dbias + int64_t(b) * p.dbias_batch_stride + int64_t(h) * p.dbias_head_stride +
              int64_t(i) * p.dbias_row_stride + j;
  if (p.dbias_row_stride == 0) {
    if (ds != 0.f) atomicAdd(db, ds);
  } else {
    *db = ds;
  }
}

// The end of the forward's online softmax for one row, given its running max m2 (log2 domain)
// and its sum l of 2^(s - m2): the row's lse (natural log, with the sink logit merged in when
// has_sink) and the factor that turns the unnormalized O row into the output (times the dropout
// rescale rdrop). A row with nothing allowed (l = 0) gets lse = sink (-inf without sinks) and
// O = 0; a row that read a NaN logit (l NaN) gets NaN for both, as on the CPU (online_softmax.h), never the
// empty row's answer.
__device__ __forceinline__ void finish_lse(float m2, float l, bool has_sink, float sink, float rdrop,
                                           float* lse, float* factor) {
  if (l != l) {
    *lse = *factor = l;
  } else if (l > 0.f) {
    float r = m2 * kLn2 + logf(l);
    if (has_sink) {
      const float hi = fmaxf(r, sink), lo = fminf(r, sink);
      r = hi + log1pf(expf(lo - hi));
    }
    *lse = r;
    *factor = exp2f(m2 - r * kLog2e) * rdrop;
  } else {
    *lse = sink;
    *factor = 0.f;
  }
}
// finish_lse for a row of an mma fragment: this lane's part of l, summed over the row's quad
__device__ __forceinline__ void finish_row(float m2, float l, bool has_sink, float sink,
                                           float rdrop, float* lse, float* factor) {
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  finish_lse(m2, l, has_sink, sink, rdrop, lse, factor);
}

// A poisoned query row (its dO holds a NaN or an inf, or its q a NaN): bwd_preprocess_kernel
// stores this NaN as its dsum in place of dot(dO, O) - dlse. No GPU arithmetic produces these
// bits (a NaN result is the canonical 0x7fffffff), so a row whose O is NaN because it read a NaN
// value is not poisoned, and none may touch them after they are stored. The tensor-core dK / dV
// kernel reads it (nonfinite.cuh).
constexpr uint32_t kPoisonedDsum = 0x7fc0dea1u;
__device__ __forceinline__ bool poisoned(float dsum) { return __float_as_uint(dsum) == kPoisonedDsum; }

// lse in the log2 domain with a fully masked row mapped to +inf (P = 2^(s - inf) = 0).
__device__ __forceinline__ float lse_to_log2(float lse) {
  return lse == -INFINITY ? INFINITY : lse * kLog2e;
}

}  // namespace attn
