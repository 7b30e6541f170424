// Fused softmax attention forward on the CPU: tiled online softmax (flash-style).
//
// One task = (batch, query head, block of kBlockM query rows). It walks the key blocks the
// policy allows (causal and sliding windows skip whole blocks), keeping the running max m,
// the running sum l and the unnormalized output O of its rows in T (float32; float64 for
// float64 inputs):
//   S = Q K^T (kBlockM, kBlockN); s = policy(S); m' = max(m, rowmax s); p = exp(s - m')
//   l = l e^{m - m'} + rowsum p;  O = O e^{m - m'} + p V
// and writes out = O / l and lse = m + log l. Each tile's rowsum p and p V are formed on their
// own and join l and O by compensated addition (simd.h's kahan_add, compensations lc and oc),
// so rows of tens of millions of keys keep float32 accuracy. Extra memory: the packed K/V plus O(kBlockM *
// (kBlockN + D)) per thread.
#include <cmath>
#include <limits>
#include <vector>

#include "common/philox.h"
#include "common/policy.h"
#include "cpu/amx.h"
#include "cpu/isa.h"
#include "cpu/pack.h"
#include "softmax/cpu/entry.h"
#include "softmax/cpu/tile.h"

namespace attn {
namespace cpu {
ATTN_CPU_ISA_BEGIN

namespace {

// Direct mode's q.k: key groups of one vector each, this many at a time (see direct_scores)
constexpr int kDirectGroups = 4;

template <typename T>
struct FwdWorker {
  static constexpr int L = kLanes<T>;
  const SoftmaxParamsT<T>& p;
  DType dt;
  const PackIndex& kidx;
  const T* kt;  // packed K, kTPanels (nullptr in direct mode and on the bf16 dot path)
  const T* vr;  // packed V, kPanels (idem)
  // the bf16 dot path (tile.h's bf16_dot): packed K as kTPairs, V as kPairs; else nullptr
  const uint16_t *ktb, *vrb;
  // the int8 Q K^T (qk_quant): packed int8 K, its block scales and means (pack.h's Q8Keys); the
  // task's Q in int8 (qi, rows of dp), its block scale, and per row 128 sum_c qi and q . mean
  // (q8dot.h's Q8Epilogue)
  Q8Keys q8;
  Buffer<int8_t> qi;
  Buffer<int32_t> qcorr;
  Buffer<float> qadd;
  float qscale = 0.f;
  int n_mblocks;
  // this thread's q, s, o tiles, m, l, one output row and one K / V row; o's compensation oc,
  // l's lc, and pb, one tile's p V before it joins o
  Scratch<T, 2> mem;
  T *q, *s, *o, *m, *l, *row, *kvrow, *kgrp, *ktr, *oc, *lc, *pb;
  uint16_t *qb, *sb;  // the bf16 dot path: the q tile and one tile's P, in bf16 (carved as T)
  uint64_t hidden[kBlockM * kMaskWords];  // the keys each tile row hides (tile.h's hidden_keys)
  // The task's Q rows as Q K^T reads them: the q tile (row stride dp), or q itself where it
  // already is T with rows of dp contiguous elements (no copy).
  const T* qa0;
  int64_t ldq;
  // Whether the task's O holds a tile's product yet, and whether oc holds compensations: the
  // first tile writes P V straight into O (no zero fill, rescale or compensated add), and oc is
  // zeroed only when a second tile comes. A call whose keys fit one tile (small calls) never
  // touches oc.
  bool o_ready, oc_ready;

  FwdWorker(const SoftmaxParamsT<T>& p_, DType dt_, const PackIndex& ki, const T* kt_, const T* vr_, int nmb,
            const uint16_t* ktb_ = nullptr, const uint16_t* vrb_ = nullptr, Q8Keys q8_ = {})
      : p(p_), dt(dt_), kidx(ki), kt(kt_), vr(vr_), ktb(ktb_), vrb(vrb_), q8(q8_), n_mblocks(nmb),
        mem(carved_size<T>(sizes(ki.dp))) {
    if (q8.keys != nullptr) {
      qi.resize(size_t(kBlockM) * ki.dp);
      qcorr.resize(kBlockM);
      qadd.resize(kBlockM);
    }
    T *qbt, *sbt;
    carve(mem.data(), sizes(ki.dp), {&q, &s, &o, &m, &l, &row, &kvrow, &kgrp, &ktr, &oc, &lc, &pb, &qbt, &sbt});
    qb = reinterpret_cast<uint16_t*>(qbt);
    sb = reinterpret_cast<uint16_t*>(sbt);
  }
  static std::array<size_t, 14> sizes(int dp) {
    const size_t per_t = sizeof(T) / sizeof(uint16_t);  // bf16 per T
    return {size_t(kBlockM) * dp, size_t(kBlockM) * kBlockN, size_t(kBlockM) * dp, size_t(kBlockM), size_t(kBlockM),
            size_t(dp), size_t(dp), size_t(L) * dp, size_t(kDirectGroups) * L * dp,
            size_t(kBlockM) * dp, size_t(kBlockM), size_t(kBlockM) * dp,
            size_t(kBlockM) * dp / per_t, size_t(kBlockM) * kBlockN / per_t};
  }

  // Direct mode reads a K / V row in place when it already is T (fp32, fp64), else converts it
  // into kvrow. Either way only d elements are valid: the loops below stop at d.
  const T* kv_row(const char* base, int64_t j, int64_t rstride, int d, int dp) {
    const char* src = base + dtype_size(dt) * j * rstride;
    if (dtype_size(dt) == sizeof(T)) return reinterpret_cast<const T*>(src);
    load_row(dt, src, kvrow, d, dp);
    return kvrow;
  }
  // Direct mode: (rows, n) raw scores q_r . k_j of keys [j0, j0 + n) into s (row stride
  // kBlockN); keys past the sequence get 0 (the policy masks them). Keys go in groups of L: the
  // group's rows are transposed into ktr (d, L), and each query row's L dots accumulate over
  // c = 0 .. d-1 in order, one multiply-add per step, in a vector of L keys: gemm's micro-kernel
  // order, so the backward's recomputed scores are the same q.k bit for bit (a row's logits
  // and its LSE agree exactly: one visible key gets P = 1 in the backward too).
  void direct_scores(const T* q, T* s, int rows, int j0, int n, int len_k, const char* kbase, int d, int dp) {
    const size_t es = dtype_size(dt);
    // kDirectGroups groups at a time: independent FMA chains (one chain is latency-bound)
    for (int jg = 0; jg < n; jg += kDirectGroups * L) {
      const int ng = std::min(kDirectGroups, (n - jg) / L);
      for (int g = 0; g < ng; ++g) {
        for (int u = 0; u < L; ++u) {
          const int jj = jg + g * L + u, j = j0 + jj;
          if (j < len_k) {
            load_row(dt, kbase + es * j * p.k_row_stride, kgrp + u * dp, d, dp);
          } else {
            std::fill(kgrp + u * dp, kgrp + (u + 1) * dp, T(0));
          }
        }
        transpose(kgrp, L, d, dp, ktr + size_t(g) * dp * L, L);
      }
      for (int r = 0; r < rows; ++r) {
        const T* qr = q + r * dp;
        vec<T> acc[kDirectGroups] = {};
        for (int c = 0; c < d; ++c) {
          const vec<T> a = vbcast_mem(qr + c);  // the micro-kernel's own expression: one FMA per step
          for (int g = 0; g < kDirectGroups; ++g) {
            if (g < ng) acc[g] += a * vload(ktr + size_t(g) * dp * L + c * L);
          }
        }
        for (int g = 0; g < ng; ++g) vstore(s + r * kBlockN + jg + g * L, acc[g]);
      }
    }
  }
  // Direct mode: O (rows, dp) += P (rows, n) @ V rows j0 ... Keys inside the sequence are
  // read; with hid (the tile's hidden keys, nullptr when it hides none) a row skips the keys it
  // hides, whose P is 0 (tile.h: so a NaN in such a V row stays out of it).
  void direct_pv(const T* s, T* o, int rows, int j0, int n, int len_k, const char* vbase, int d, int dp,
                 const uint64_t* hid) {
    const int dv = d / L * L;
    for (int jj = 0; jj < n && j0 + jj < len_k; ++jj) {
      const T* v = kv_row(vbase, j0 + jj, p.v_row_stride, d, dp);
      for (int r = 0; r < rows; ++r) {
        if (hid != nullptr && key_hidden(hid + r * kMaskWords, jj)) continue;
        const T pr = s[r * kBlockN + jj];
        T* orow = o + r * dp;
        const vec<T> prv = vbcast(pr);
        for (int c = 0; c < dv; c += L) vstore(orow + c, vload(orow + c) + prv * vload(v + c));
        for (int c = dv; c < d; ++c) orow[c] += pr * v[c];
      }
    }
  }

  // What one task's tiles share.
  struct Tile {
    const PolicyT<T>& pol;
    TileSoftmax<T> ts;
    int i0, len_k;          // the task's first row; the sequence's keys
    const T *kt_bh, *v_bh;  // packed K / V of the (batch, kv head); nullptr in direct mode
    const char *kbase, *vbase;
    const uint16_t *ktb_bh, *vb_bh;  // the bf16 dot path's packed K / V; else nullptr
    const uint8_t* ktq_bh = nullptr;  // the int8 Q K^T's packed K and its block scales; else nullptr
    const float* ksc_bh = nullptr;
  };
  // Rows [ra, rb) of the task (offsets from its first row) against keys [j0, j0 + n), of which
  // [lo, hi) may be seen: n <= kBlockN, j0 a multiple of kPanel, [j0, j0 + n) inside one packed
  // block (the dense walk: whole kBlockN blocks, lo = j0, hi = j0 + n).
  void tile(const Tile& t, int ra, int rb, int j0, int n, int lo, int hi) {
    const int d = kidx.d, dp = kidx.dp, rows = rb - ra;
    const T* qa = qa0 + ra * ldq;
    T* sa = s + ra * kBlockN;
    T* oa = o + ra * dp;
    T* oca = oc + ra * dp;
    T* pba = pb + ra * dp;
    // (rows, n) scores = Q (rows, d) @ K^T block (d, n)
    if (t.ktq_bh != nullptr) {
      if constexpr (std::is_same<T, float>::value) {  // float only
        // the tile lies in one key block: one K scale
        const Q8Epilogue e{qcorr.data() + ra, qscale * t.ksc_bh[j0 / kBlockN], qadd.data() + ra};
        gemm_q8(rows, n, dp, qi.data() + ra * dp, dp, t.ktq_bh + int64_t(j0) * dp, int64_t(dp) * kQ8Panel, sa,
                kBlockN, e);
      }
    } else if (t.ktb_bh != nullptr) {
      if constexpr (std::is_same<T, float>::value) {  // tile.h's bf16_dot: float only
        gemm_dp(rows, n, round_up(d, 2), qb + ra * dp, dp, t.ktb_bh + int64_t(j0) * dp, int64_t(dp) * kDotPanel, sa,
                kBlockN);
      }
    } else if (t.kt_bh == nullptr) {
      direct_scores(qa, sa, rows, j0, n, t.len_k, t.kbase, d, dp);
    } else {
      gemm<false>(rows, n, d, qa, ldq, t.kt_bh + int64_t(j0) * dp, kPanel<T>, int64_t(dp) * kPanel<T>, sa, kBlockN);
    }
    const int i_lo = t.i0 + ra;
    const bool full = t.ts.tile_full(i_lo, i_lo + rows, j0, n);
    if (t.pol.topk_thr != nullptr && p.dropout_p == 0.f && t.kt_bh != nullptr) {
      topk_rows(t, sa, oa, oca, pba, ra, rows, i_lo, j0, n, lo, hi, full);
      return;
    }
    // keys this tile may hide from some row (a full, unclipped tile without top-k hides none)
    const bool may_hide = !full || lo > j0 || hi < j0 + n || t.pol.topk_thr != nullptr;
    // the task's first tile: its P V is O (below), so there is nothing to rescale
    const bool fresh = !o_ready;
    uint64_t* hid = hidden + ra * kMaskWords;
    for (int r = 0; r < rows; ++r) {
      T* srow = sa + r * kBlockN;
      t.ts.scores(srow, i_lo + r, j0, full, n);
      if (lo > j0 || hi < j0 + n) mask_outside(srow, j0, n, lo, hi);
      if (may_hide) hidden_keys(srow, n, hid + r * kMaskWords);
      T& mr = m[ra + r];
      const T m_new = t.ts.online_update(srow, mr, &l[ra + r], &lc[ra + r], n);
      if (m_new != mr) {
        // rescale the running output by e^{m - m'} (0 when the row saw nothing before)
        if (!fresh) {
          const T alpha = std::isinf(mr) ? T(0) : std::exp(mr - m_new);
          T* orow = oa + r * dp;
          T* ocrow = oca + r * dp;
          for (int c = 0; c < dp; c += L) vstore(orow + c, vload(orow + c) * alpha);
          if (oc_ready) {
            for (int c = 0; c < dp; c += L) vstore(ocrow + c, vload(ocrow + c) * alpha);
          }
        }
        mr = m_new;
      }
      t.ts.dropout(srow, i_lo + r, j0, n);
      // the bf16 dot path's P row in bf16, while the row is in L1
      if constexpr (std::is_same<T, float>::value) {
        if (t.vb_bh != nullptr) rows_to_bf16(srow, kBlockN, sb + (ra + r) * kBlockN, kBlockN, 1, n);
      }
    }
    // the tile's P (rows, n) @ V block (n, dp), then O += it, compensated (the first tile's is O)
    if (fresh) pba = oa;
    if (t.vb_bh != nullptr) {
      if constexpr (std::is_same<T, float>::value) {
        if (!fresh && !may_hide && gemm_dp_adds()) {
          // AMX: the tiles add P V into O, uncompensated: the output is bf16, whose rounding
          // (2^-9) dwarfs float32 sums' over S / kBlockN tiles. A tile that may hide keys takes
          // the path below, whose NaN redo needs P V apart from O.
          gemm_dp_add(rows, dp, n, sb + ra * kBlockN, kBlockN, panel_row<uint16_t, kDotPanel>(t.vb_bh, j0, kBlockN, dp),
                      int64_t(kBlockN) * kDotPanel, oa, dp);
          return;
        }
        // P rounded to bf16 (above)
        const uint16_t* sba = sb + ra * kBlockN;
        const uint16_t* vb = panel_row<uint16_t, kDotPanel>(t.vb_bh, j0, kBlockN, dp);
        gemm_dp(rows, dp, n, sba, kBlockN, vb, int64_t(kBlockN) * kDotPanel, pba, dp);
        if (may_hide && any_nan(pba, int64_t(rows) * dp)) {
          gemm_dp_skipping(rows, dp, n, sba, kBlockN, vb, int64_t(kBlockN) * kDotPanel, pba, dp,
                           [&](int r, int jj) { return key_hidden(hid + r * kMaskWords, jj); });
        }
      }
    } else if (t.v_bh == nullptr) {
      std::fill(pba, pba + size_t(rows) * dp, T(0));
      direct_pv(sa, pba, rows, j0, n, t.len_k, t.vbase, d, dp, may_hide ? hid : nullptr);
    } else {
      const T* vb = panel_row(t.v_bh, j0, kBlockN, dp);
      gemm<false>(rows, dp, n, sa, kBlockN, vb, kPanel<T>, int64_t(kBlockN) * kPanel<T>, pba, dp);
      // NaN: a read NaN (kept by the redo) or a hidden key's non-finite V row (left out by it)
      if (may_hide && any_nan(pba, int64_t(rows) * dp)) {
        gemm_skipping(rows, dp, n, sa, kBlockN, vb, kPanel<T>, int64_t(kBlockN) * kPanel<T>, pba, dp,
                      [&](int r, int jj) { return key_hidden(hid + r * kMaskWords, jj); });
      }
    }
    if (!fresh) {
      if (!oc_ready) std::fill(oca, oca + size_t(rows) * dp, T(0));
      oc_ready = true;
      kahan_add(oa, oca, pba, rows * dp);
    }
    o_ready = true;
  }

  // Top-k rows: at most k keys of a row survive its threshold, so instead of exp over the tile
  // and a P V product, each survivor is folded into the row's online softmax on its own:
  // O(survivors * D) instead of O(n * D). Survivors are found by a vector compare.
  // The survivors' sums go to the row's pb and l_tile first and join O and l compensated at the
  // end of the tile, as in the dense path.
  void topk_rows(const Tile& t, T* sa, T* oa, T* oca, T* pba, int ra, int rows, int i_lo, int j0, int n, int lo,
                 int hi, bool full) {
    const int dp = kidx.dp;
    constexpr int P = kPanel<T>;
    const T ninf = -std::numeric_limits<T>::infinity();
    const vec<T> vninf = vbcast(ninf);
    const T post = t.ts.post;
    for (int r = 0; r < rows; ++r) {
      T* srow = sa + r * kBlockN;
      t.ts.scores(srow, i_lo + r, j0, full, n);
      if (lo > j0 || hi < j0 + n) mask_outside(srow, j0, n, lo, hi);
      T& mr = m[ra + r];
      T* orow = oa + r * dp;
      T* ocrow = oca + r * dp;
      T* prow = pba + r * dp;
      std::fill(prow, prow + dp, T(0));
      T l_tile = T(0);
      for (int c = 0; c < n; c += L) {
        for (uint32_t bits = lane_bits(vload(srow + c) != vninf); bits != 0; bits &= bits - 1) {
          const int jj = c + __builtin_ctz(bits);
          const T s = srow[jj] * post;
          if (s > mr || std::isnan(s)) {  // a new running max: rescale what the row holds
            const T alpha = std::isinf(mr) ? T(0) : std::exp(mr - s);
            l[ra + r] *= alpha;
            lc[ra + r] *= alpha;
            l_tile *= alpha;
            for (int cc = 0; cc < dp; cc += L) {
              vstore(orow + cc, vload(orow + cc) * alpha);
              vstore(ocrow + cc, vload(ocrow + cc) * alpha);
              vstore(prow + cc, vload(prow + cc) * alpha);
            }
            mr = s;
          }
          const T pr = std::exp(s - mr);
          l_tile += pr;
          // V row j0 + jj of the kPanels pack: dp / P panels of P contiguous values
          const T* vrow = panel_row(t.v_bh, j0 + jj, kBlockN, dp);
          const vec<T> pv = vbcast(pr);
          for (int c0 = 0; c0 < dp; c0 += P) {
            const T* src = vrow + int64_t(c0) * kBlockN;
            for (int u = 0; u < P; u += L) vstore(prow + c0 + u, vload(prow + c0 + u) + pv * vload(src + u));
          }
        }
      }
      kahan_add(l[ra + r], lc[ra + r], l_tile);
      kahan_add(orow, ocrow, prow, dp);
    }
  }

  // The task's Q rows (float, in q) to int8 with one scale for the block: rint(q 127 / amax),
  // amax over its rows and d channels (NaN when one is not finite: every score of the task is
  // then NaN), with each row's 128 sum_c qi and q . mean (the smoothing's part of q . k) for
  // q8dot.h's epilogue. Rounded as reference.qk_int8_scores rounds, float32 op for op.
  void quantize_q(int rows, const float* mean) {
    const int dp = kidx.dp;  // q's rows are dp wide, zero past d
    const float amax = q8_amax(q, int64_t(rows) * dp);
    qscale = q8_scale(amax);
    const float inv = q8_inv(amax);
    for (int r = 0; r < rows; ++r) {
      const float* qr = q + r * dp;
      qcorr[r] = kQ8Bias * q8_round(qr, dp, inv, qi.data() + r * dp);
      vf dm = vbcast(0.f);
      for (int c = 0; c < dp; c += L) dm += vload(qr + c) * vload(mean + c);
      qadd[r] = hsum_tree(dm);
    }
  }

  void operator()(int64_t task) {
    const AmxScope amx_tiles;  // cpu/amx.h: the products' tiles stay configured for the task
    const QueryTask qt(task, n_mblocks, p.h, true);
    const int b = qt.b, h = qt.h, i0 = qt.i0;
    const SeqInfo si(p, b);
    if (i0 >= si.len_q) return;
    const int i1 = std::min(i0 + kBlockM, si.len_q), rows = i1 - i0;
    const PolicyT<T> pol(p, si, b, h);
    const int hk = h / (p.h / p.h_k);
    const int d = kidx.d, dp = kidx.dp;
    const size_t es = dtype_size(dt);

    // (rows, d) tile of Q in T
    const char* qbase = elem(p.q, dt, si.q_offset(p, b, h, i0, p.q_batch_stride, p.q_head_stride, p.q_row_stride));
    const bool dot = ktb != nullptr;
    // T rows of dp elements are read in place by the packed path's Q K^T
    const bool q_in_place = !dot && kt != nullptr && es == sizeof(T) && d == dp;
    qa0 = q_in_place ? reinterpret_cast<const T*>(qbase) : q;
    ldq = q_in_place ? p.q_row_stride : dp;
    for (int r = 0; r < rows && !q_in_place; ++r) {
      if (dot && q8.keys == nullptr) {  // bf16 as it is
        std::memcpy(qb + r * dp, qbase + es * r * p.q_row_stride, sizeof(uint16_t) * d);
        std::fill(qb + r * dp + d, qb + (r + 1) * dp, uint16_t(0));
      } else {
        load_row(dt, qbase + es * r * p.q_row_stride, q + r * dp, d, dp);
      }
    }

    if constexpr (std::is_same<T, float>::value) {
      if (q8.keys != nullptr) quantize_q(rows, q8.mean + (int64_t(b) * p.h_k + hk) * dp);
    }

    // the dense walk's first tile writes O; the block-sparse walk (tiles of some of the rows)
    // and top-k's rows (which add into O) start from zeros
    o_ready = oc_ready = p.sparse.on() || pol.topk_thr != nullptr;
    if (o_ready) {
      std::fill(o, o + size_t(rows) * dp, T(0));
      std::fill(oc, oc + size_t(rows) * dp, T(0));
    }
    std::fill(m, m + kBlockM, -std::numeric_limits<T>::infinity());
    std::fill(l, l + kBlockM, T(0));
    std::fill(lc, lc + kBlockM, T(0));

    Tile t{pol, TileSoftmax<T>(p, pol, b * p.h + h), i0, si.len_k,
           kt == nullptr ? nullptr : kt + kidx.offset(b, hk), vr == nullptr ? nullptr : vr + kidx.offset(b, hk),
           elem(p.k, dt, si.k_offset(p, b, hk, 0, p.k_batch_stride, p.k_head_stride, p.k_row_stride)),
           elem(p.v, dt, si.k_offset(p, b, hk, 0, p.v_batch_stride, p.v_head_stride, p.v_row_stride)),
           ktb != nullptr ? ktb + kidx.offset(b, hk) : nullptr, vrb != nullptr ? vrb + kidx.offset(b, hk) : nullptr};
    if (q8.keys != nullptr) {
      t.ktq_bh = q8.keys + kidx.offset(b, hk);
      t.ksc_bh = q8.scale + kidx.offset(b, hk) / (int64_t(dp) * kBlockN);
    }
    if (!p.sparse.on()) {
      // the keys the task's rows may see, in tiles trimmed to the panels some row reaches
      // (tile.h's for_key_tiles): a causal or window edge tile skips its wholly masked panels
      int klo, khi;
      pol.key_range(i0, i1, &klo, &khi);
      klo = std::max(klo, 0);
      khi = std::min(khi, si.len_k);
      if (klo < khi) {
        for_key_tiles<T>(klo, khi, [&](int j0, int n, int lo, int hi) { tile(t, 0, rows, j0, n, lo, hi); },
                         kFwdKeyStep<T>);
      }
    } else {
      // block-sparse: per layout row under the task's rows, its on blocks (CSR at the layout's
      // own granularity), each cut into tiles the packed operands allow (tile.h)
      const int bs = p.sparse.block;
      for (int a = i0; a < i1;) {
        const int lr = a / bs, a1 = std::min(i1, (lr + 1) * bs);
        int beg, end, klo, khi;
        p.sparse.tiles(p.sparse.fwd, h, lr, &beg, &end);
        pol.key_range(a, a1, &klo, &khi);
        klo = std::max(klo, 0);
        khi = std::min(khi, si.len_k);
        for (int e = beg; e < end;) {
          // a run of adjacent on blocks is one key range: whole kBlockN tiles where it is long
          const int* idx = p.sparse.fwd.idx;
          int e1 = e + 1;
          while (e1 < end && idx[e1] == idx[e1 - 1] + 1) ++e1;
          const int c0 = std::max(idx[e] * bs, klo), c1 = std::min((idx[e1 - 1] + 1) * bs, khi);
          e = e1;
          if (c0 >= c1) continue;
          for_key_tiles<T>(c0, c1, [&](int j0, int n, int lo, int hi) { tile(t, a - i0, a1 - i0, j0, n, lo, hi); },
                           kFwdKeyStep<T>);
        }
        a = a1;
      }
    }

    char* obase = elem(p.o, dt, si.q_offset(p, b, h, i0, p.o_batch_stride, p.o_head_stride, p.o_row_stride));
    T* lse = p.lse + b * p.lse_batch_stride + h * p.lse_head_stride + si.row_q + i0;
    const T sink = p.sinks != nullptr ? p.sinks[h] : -std::numeric_limits<T>::infinity();
    const T keep_scale = p.dropout_p > 0.f ? T(1) / (T(1) - T(p.dropout_p)) : T(1);
    if (!o_ready) std::fill(o, o + size_t(rows) * dp, T(0));  // no key reached: 0 (not 0 x garbage)
    // T rows of dp elements are written in place
    const bool o_in_place = es == sizeof(T) && d == dp;
    for (int r = 0; r < rows; ++r) {
      const T inv = finish_row(m[r], l[r] - lc[r], p.sinks != nullptr, sink, keep_scale, &lse[r]);
      const T* orow = o + r * dp;
      const T* ocrow = oc + r * dp;
      T* dst = o_in_place ? reinterpret_cast<T*>(obase + es * r * p.o_row_stride) : row;
      if (oc_ready) {
        for (int c = 0; c < dp; c += L) vstore(dst + c, (vload(orow + c) - vload(ocrow + c)) * inv);
      } else {
        for (int c = 0; c < dp; c += L) vstore(dst + c, vload(orow + c) * inv);
      }
      if (!o_in_place) store_row(dt, row, obase + es * r * p.o_row_stride, d);
    }
  }
};

}  // namespace

template <typename T>
void softmax_fwd(const SoftmaxParamsT<T>& p, DType dt) {
  const PackIndex kidx(p);
  const int n_mblocks = (p.sq + kBlockM - 1) / kBlockM;
  const int64_t n_tasks = int64_t(p.b) * p.h * n_mblocks;
  if (direct_mode(p)) {
    parallel_tasks(n_tasks, p.num_threads, [&] { return FwdWorker<T>(p, dt, kidx, nullptr, nullptr, n_mblocks); });
    return;
  }
  if constexpr (std::is_same<T, float>::value) {
    if (p.qk_quant != 0) {
      // int8 Q K^T; P V as the call would take it (bf16 dot products or float32)
      const Scratch<uint8_t, 0> kq(kidx.total() + kQ8Overread);  // q8dot.h's AMX tiles read past a panel
      Buffer<float> ksc(q8_scale_count(kidx)), kmean(size_t(p.b) * p.h_k * kidx.dp);
      pack_keys_q8(p, dt, kidx, kq.data(), ksc.data(), kmean.data());
      const Q8Keys q8{kq.data(), ksc.data(), kmean.data()};
      if (bf16_dot(p, dt)) {
        const Scratch<uint16_t, 1> vr(kidx.total());
        pack_keys(p, dt, p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride, kidx, PackLayout::kPairs,
                  vr.data(), PackPad::kPanelRows);
        parallel_tasks(n_tasks, p.num_threads, [&] {
          return FwdWorker<T>(p, dt, kidx, nullptr, nullptr, n_mblocks, nullptr, vr.data(), q8);
        });
      } else {
        const Scratch<T, 1> vr(kidx.total());
        pack_keys(p, dt, p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride, kidx, PackLayout::kPanels,
                  vr.data(), PackPad::kPanelRows);
        parallel_tasks(n_tasks, p.num_threads,
                       [&] { return FwdWorker<T>(p, dt, kidx, nullptr, vr.data(), n_mblocks, nullptr, nullptr, q8); });
      }
      return;
    }
  }
  if (bf16_dot(p, dt)) {
    const Scratch<uint16_t, 0> kt(kidx.total());
    const Scratch<uint16_t, 1> vr(kidx.total());
    pack_keys(p, dt, p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride, kidx, PackLayout::kTPairs,
              kt.data(), PackPad::kPanelRows);
    pack_keys(p, dt, p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride, kidx, PackLayout::kPairs,
              vr.data(), PackPad::kPanelRows);
    parallel_tasks(n_tasks, p.num_threads, [&] {
      return FwdWorker<T>(p, dt, kidx, nullptr, nullptr, n_mblocks, kt.data(), vr.data());
    });
    return;
  }
  const Scratch<T, 0> kt(kidx.total());
  const Scratch<T, 1> vr(kidx.total());
  pack_keys(p, dt, p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride, kidx, PackLayout::kTPanels,
              kt.data(), PackPad::kPanelRows);
  pack_keys(p, dt, p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride, kidx, PackLayout::kPanels,
              vr.data(), PackPad::kPanelRows);
  parallel_tasks(n_tasks, p.num_threads, [&] { return FwdWorker<T>(p, dt, kidx, kt.data(), vr.data(), n_mblocks); });
}
template void softmax_fwd<float>(const SoftmaxParamsT<float>&, DType);
template void softmax_fwd<double>(const SoftmaxParamsT<double>&, DType);
ATTN_CPU_REGISTER(softmax_fwd_stub<float>, &softmax_fwd<float>);
ATTN_CPU_REGISTER(softmax_fwd_stub<double>, &softmax_fwd<double>);

void dropout_mask(uint8_t* keep, int b, int h, int sq, int sk, float prob, uint64_t seed, uint64_t offset) {
  pool_for(int64_t(b) * h * sq, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int bh = int(r / sq), i = int(r % sq);
      for (int j = 0; j < sk; ++j) keep[r * sk + j] = dropout_keep(seed, offset, bh, i, j, prob) ? 1 : 0;
    }
  });
}
ATTN_CPU_REGISTER(dropout_mask_stub, &dropout_mask);

ATTN_CPU_ISA_END
}  // namespace cpu
}  // namespace attn
