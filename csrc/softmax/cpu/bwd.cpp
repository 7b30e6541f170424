// Fused softmax attention backward on the CPU, recomputing the probabilities from the LSE.
//
// One task = (batch, kv head): it owns dK and dV of that head, every query head of its GQA
// group, and their dQ, so no two threads ever write the same gradient element (no atomics,
// deterministic). Per (key block, query block) tile, with D_i = dO_i . O_i - dlse_i:
//   P  = exp(policy(Q K^T) - lse)           (rows, kBlockN)
//   dP = dO V^T                             gradient of the (dropped) probabilities
//   dS = P * (dP * keep / (1 - p) - D_i)    gradient of the logits
//   dX = dS * dscore/dx                     (scale, and the softcap's 1 - tanh^2)
//   dV += (P * keep / (1 - p))^T dO;  dK += dX^T Q;  dQ += dX K
// On AMX (the avx512amx variant) all five products run on the tiles (tile_amx). Key blocks are
// the outer loop so the dK / dV block accumulators stay in cache. dQ sums a term per
// key block over the whole row: each tile's dX K is formed on its own and joins dQ by compensated
// addition (simd.h's kahan_add, compensation dqc), as the forward's O does.
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

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

template <typename T>
struct BwdWorker {
  using V = vec<T>;
  static constexpr int L = kLanes<T>;
  const SoftmaxBwdParamsT<T>& p;
  DType dt;
  int dp;
  Scratch<T, 3> mem;  // this thread's buffers, carved below
  // per kv head: K and V as kTPanels, K as kPanels (pack.h); dK and dV accumulators (rows)
  T *kt, *vt, *kr, *dk, *dv;
  // per query head: Q and dO as rows (A operands) and as kPanels (B operands), the dQ
  // accumulator, D_i and lse
  T *q, *dout, *qpn, *dopn, *dq, *dvec, *lse;
  // per tile
  T *s, *x, *dpt, *keep_row, *row;
  T *dqc, *dqt;  // dQ's compensation (rows); one tile's dX K (kBlockM, dp)
  // the bf16 dot path (tile.h's bf16_dot): K and V as kTPairs, Q and dO as bf16 rows, for the
  // logits (the forward's, bit for bit) and dP; empty otherwise
  bool dot;
  uint16_t *ktb, *vtb, *qb, *dob;
  // per query block of the current head: whether its Q (dO) rows hold a NaN or an inf; per key
  // block of the current kv head: whether its K rows do
  std::vector<uint8_t> q_bad, do_bad, k_bad;
  // AMX (the avx512amx variant, on the bf16 dot path): the tiles run dV, dK and dQ too. dV^T and
  // dK^T of one key block (dp rows of kBlockN) take dO^T P and Q^T dS (A: dO^T and Q^T of the
  // head, dp rows of ldq with zero columns past its rows; B: the tile's P and dS in pairs over its
  // rows, pp and dsp) and join dV and dK when the head's walk leaves the block (flush_amx); dQ's
  // tile is dS (bf16 rows, dsb) @ K (kPairs, kpb). P
  // and dS are rounded to bf16 for them, as PyTorch's bf16 math rounds every intermediate. Blocks
  // whose Q or dO rows hold a NaN or an inf run those rows apart (tile_amx), so that every other
  // bit is the clean call's.
  bool amx_t = false;
  int64_t ldq = 0;
  Buffer<float> dvT, dkT;
  Buffer<uint16_t> kpb, qT, doT, pp, dsp, dsb, at;

  BwdWorker(const SoftmaxBwdParamsT<T>& p_, DType dt_)
      : p(p_), dt(dt_), dp(padded_head_dim(p_.d)), mem(carved_size<T>(sizes(p_, dp, bf16_dot(p_, dt_)))),
        dot(bf16_dot(p_, dt_)) {
    T *ktbt, *vtbt, *qbt, *dobt;
    carve(mem.data(), sizes(p, dp, dot),
          {&kt, &vt, &kr, &dk, &dv, &q, &dout, &qpn, &dopn, &dq, &dvec, &lse, &s, &x, &dpt, &keep_row, &row, &dqc,
           &dqt, &ktbt, &vtbt, &qbt, &dobt});
    ktb = reinterpret_cast<uint16_t*>(ktbt);
    vtb = reinterpret_cast<uint16_t*>(vtbt);
    qb = reinterpret_cast<uint16_t*>(qbt);
    dob = reinterpret_cast<uint16_t*>(dobt);
#if defined(ATTN_AMX)
    amx_t = dot && gemm_dp_adds();
    if (amx_t) {
      ldq = round_up(p.sq, kBlockM) + kAmxDpK;
      dvT.resize(size_t(dp) * kBlockN);
      dkT.resize(size_t(dp) * kBlockN);
      kpb.resize(size_t(round_up(p.sk, kBlockN)) * dp);
      qT.resize(size_t(dp) * ldq);
      doT.resize(size_t(dp) * ldq);
      pp.resize(size_t(kBlockM) * kBlockN);
      dsp.resize(size_t(kBlockM) * kBlockN);
      dsb.resize(size_t(kBlockM) * kBlockN);
      at.resize(size_t(dp) * 2 * kAmxDpK);
    }
#endif
  }
  static std::array<size_t, 23> sizes(const SoftmaxBwdParamsT<T>& p, int dp, bool dot) {
    const size_t kpad = size_t(round_up(p.sk, kBlockN)) * dp, qpad = size_t(round_up(p.sq, kBlockM)) * dp;
    const size_t rows = round_up(p.sq, kBlockM), tile = size_t(kBlockM) * kBlockN;
    const size_t kb = dot ? kpad * sizeof(uint16_t) / sizeof(T) : 0, qb = dot ? qpad * sizeof(uint16_t) / sizeof(T) : 0;
    // the dot path forms the logits and dP from the bf16 copies: no float32 K^T, V^T or Q rows
    const size_t kt = dot ? 0 : kpad, qr = dot ? 0 : qpad;
    return {kt, kt, kpad, kpad, kpad, qr, qpad, qpad, qpad, qpad, rows, rows, tile, tile, tile, kBlockN,
            size_t(dp), qpad, size_t(kBlockM) * dp, kb, kb, qb, qb};
  }

  // T rows -> a (len, d) slice of a gradient tensor
  void store_rows(const T* src, int len, void* dst, int64_t rstride) {
    const size_t es = dtype_size(dt);
    for (int r = 0; r < len; ++r) store_row(dt, src + int64_t(r) * dp, static_cast<char*>(dst) + es * r * rstride, p.d);
  }

  void operator()(int64_t task) {
    const AmxScope amx_tiles;  // cpu/amx.h: the products' tiles stay configured for the task
    const int hk = int(task % p.h_k), b = int(task / p.h_k);
    const SeqInfo si(p, b);
    const int d = p.d, group = p.h / p.h_k;
    const int len_k = si.len_k, len_q = si.len_q;
    const int kpad = round_up(std::max(len_k, 0), kBlockN), qpad = round_up(std::max(len_q, 0), kBlockM);

    // dK, dV of a query-less or key-less sequence are zero: still write them
    std::fill(dk, dk + int64_t(kpad) * dp, T(0));
    std::fill(dv, dv + int64_t(kpad) * dp, T(0));
    const void* ksrc = elem(p.k, dt, si.k_offset(p, b, hk, 0, p.k_batch_stride, p.k_head_stride, p.k_row_stride));
    const void* vsrc = elem(p.v, dt, si.k_offset(p, b, hk, 0, p.v_batch_stride, p.v_head_stride, p.v_row_stride));
    pack_one(dt, ksrc, p.k_row_stride, len_k, kpad, d, dp, PackLayout::kPanels, kBlockN, kr, row);
    k_bad.assign(kpad / kBlockN, 0);
    for (int j0 = 0; j0 < kpad; j0 += kBlockN)
      k_bad[j0 / kBlockN] = any_nonfinite(panel_row(kr, j0, kBlockN, dp), int64_t(kBlockN) * dp);
    if (amx_t) {  // dV^T and dK^T are zero between key blocks (flush_amx)
      std::fill(dvT.begin(), dvT.end(), 0.f);
      std::fill(dkT.begin(), dkT.end(), 0.f);
      pack_one_pairs(ksrc, p.k_row_stride, len_k, kpad, d, dp, PackLayout::kPairs, kBlockN, kpb.data());
    }
    if (!dot) {  // K^T and V^T in float32 feed only the logits and dP, which the dot path forms in bf16
      pack_one(dt, ksrc, p.k_row_stride, len_k, kpad, d, dp, PackLayout::kTPanels, kBlockN, kt, row);
      pack_one(dt, vsrc, p.v_row_stride, len_k, kpad, d, dp, PackLayout::kTPanels, kBlockN, vt, row);
    } else {
      pack_one_pairs(ksrc, p.k_row_stride, len_k, kpad, d, dp, PackLayout::kTPairs, kBlockN, ktb);
      pack_one_pairs(vsrc, p.v_row_stride, len_k, kpad, d, dp, PackLayout::kTPairs, kBlockN, vtb);
    }

    for (int h = hk * group; h < (hk + 1) * group; ++h) head(b, h, si, len_q, len_k, qpad);

    store_rows(dk, len_k,
               elem(p.dk, dt, si.k_offset(p, b, hk, 0, p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride)),
               p.dk_row_stride);
    store_rows(dv, len_k,
               elem(p.dv, dt, si.k_offset(p, b, hk, 0, p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride)),
               p.dv_row_stride);
  }

  // What one query head's tiles share.
  struct Head {
    const PolicyT<T>& pol;
    const TileSoftmax<T>& ts;
    T keep_scale;
    T* dbias_bh;
    int len_q;
  };
  // Query rows [i0, i0 + rows) against keys [j0, j0 + n), of which [lo, hi) may be seen: n <=
  // kBlockN, j0 a multiple of kPanel, neither range crossing a packed block (kBlockM query rows,
  // kBlockN keys). The dense walk passes whole blocks with lo = j0, hi = j0 + n.
  void tile(const Head& hd, int i0, int rows, int j0, int n, int lo, int hi) {
    const PolicyT<T>& pol = hd.pol;
    const TileSoftmax<T>& ts = hd.ts;
    const int d = p.d;
    constexpr int P = kPanel<T>;
    // K^T and V^T (kTPanels) start at j0 * dp for any j0 on a panel boundary; K, Q and dO as
    // kPanels at their row's panel (tile.h)
    const T* kt_blk = kt + int64_t(j0) * dp;
    const T* vt_blk = vt + int64_t(j0) * dp;
    const T* kr_blk = panel_row(kr, j0, kBlockN, dp);
    const T* q_blk = q + int64_t(i0) * dp;
    const T* do_blk = dout + int64_t(i0) * dp;
    // (rows, n) raw scores and dP of the dropped probabilities
    if (dot) {
      if constexpr (std::is_same<T, float>::value) {  // tile.h's bf16_dot: float only
        const int kd = round_up(d, 2);
        gemm_dp(rows, n, kd, qb + int64_t(i0) * dp, dp, ktb + int64_t(j0) * dp, int64_t(dp) * kDotPanel, s, kBlockN);
        gemm_dp(rows, n, kd, dob + int64_t(i0) * dp, dp, vtb + int64_t(j0) * dp, int64_t(dp) * kDotPanel, dpt,
                kBlockN);
      }
    } else {
      gemm<false>(rows, n, d, q_blk, dp, kt_blk, P, int64_t(dp) * P, s, kBlockN);
      gemm<false>(rows, n, d, do_blk, dp, vt_blk, P, int64_t(dp) * P, dpt, kBlockN);
    }
    if (pol.softcap > T(0)) std::copy(s, s + rows * kBlockN, x);
    const bool full = ts.tile_full(i0, i0 + rows, j0, n);
    const bool partial = lo > j0 || hi < j0 + n;
    for (int r = 0; r < rows; ++r) {
      const int i = i0 + r;
      T* srow = s + r * kBlockN;
      T* dprow = dpt + r * kBlockN;
      ts.scores(srow, i, j0, full, n);
      if (partial) mask_outside(srow, j0, n, lo, hi);
      ts.probs(srow, lse[i], n);
      // keep / (1 - p) per key: a row of that constant run through the same dropout
      T* keep = keep_row;
      if (p.dropout_p > 0.f) {
        std::fill(keep, keep + n, hd.keep_scale);
        ts.dropout(keep, i, j0, n);
      }
      const T di = dvec[i];
      if (p.dropout_p == 0.f && hd.dbias_bh == nullptr && pol.softcap == 0.f) {
        // the common case in vectors: dX = P * (dP - D_i) * scale; P stays as it is
        // a key with P = 0 gets dS = 0 whatever its dP: a hidden key's dP is NaN when its V row is
        const V dv_i = vbcast(di), zero = V{};
        for (int c = 0; c < n; c += L) {
          const V pr = vload(srow + c);
          vstore(dprow + c, pr == zero ? zero : pr * (vload(dprow + c) - dv_i) * pol.scale);
        }
        continue;
      }
      for (int jj = 0; jj < n; ++jj) {
        const T kp = p.dropout_p > 0.f ? keep[jj] : T(1);
        const T pr = srow[jj];
        // dS = 0 where P is (a selection: a hidden key's dP, or the row's D_i, may be NaN)
        T ds = pr == T(0) ? T(0) : pr * (dprow[jj] * kp - di);
        if (hd.dbias_bh != nullptr && j0 + jj < pol.len_k)
          hd.dbias_bh[int64_t(i) * p.dbias_row_stride + j0 + jj] += ds;
        if (pol.softcap > T(0)) {
          ds *= pol.dscore_dx(x[r * kBlockN + jj]);
        } else {
          ds *= pol.scale;
        }
        dprow[jj] = pr == T(0) ? T(0) : ds;  // dX (rows, n); 0 where P is, as above
        srow[jj] = pr * kp;  // dropped, rescaled P
      }
    }
    // dV (n, dp) += P^T dO and dK += dX^T Q, reading P and dX transposed in place. A row whose dO
    // (Q) holds a NaN or an inf would put 0 x NaN into a key hidden from it (P = 0, dX = 0), and
    // 0 x inf into a key whose dX is 0 (softcap saturated by an inf): where the query block holds
    // one, the products leave out the terms with P = 0 (dX = 0), in every tile, as dQ's redo below
    // does (probs() keeps P = 0 at hidden keys even when the row's lse is NaN)
    const bool may_hide = !full || partial || pol.topk_thr != nullptr;
    T* dv_blk = dv + int64_t(j0) * dp;
    T* dk_blk = dk + int64_t(j0) * dp;
    const T* dopn_blk = panel_row(dopn, i0, kBlockM, dp);
    const T* qpn_blk = panel_row(qpn, i0, kBlockM, dp);
#if defined(ATTN_AMX)
    if constexpr (std::is_same<T, float>::value) {
      // an odd row count reads one more column of dO^T / Q^T (times a zero row of P / dS): past
      // the head's rows it is zero; elsewhere (a sparse or causal edge tile) it could be an inf
      if (amx_t && (rows % 2 == 0 || i0 + rows >= hd.len_q)) {
        tile_amx(i0, rows, j0, n, may_hide);
        return;
      }
    }
#endif
    if (do_bad[i0 / kBlockM]) {
      gemm_skipping<true, true>(n, dp, rows, s, kBlockN, dopn_blk, P, int64_t(kBlockM) * P, dv_blk, dp,
                                [&](int jj, int r) { return s[r * kBlockN + jj] == T(0); });
    } else {
      gemm<true, true>(n, dp, rows, s, kBlockN, dopn_blk, P, int64_t(kBlockM) * P, dv_blk, dp);
    }
    if (q_bad[i0 / kBlockM]) {
      gemm_skipping<true, true>(n, dp, rows, dpt, kBlockN, qpn_blk, P, int64_t(kBlockM) * P, dk_blk, dp,
                                [&](int jj, int r) { return dpt[r * kBlockN + jj] == T(0); });
    } else {
      gemm<true, true>(n, dp, rows, dpt, kBlockN, qpn_blk, P, int64_t(kBlockM) * P, dk_blk, dp);
    }
    // dQ (rows, dp) += dX (rows, n) @ K rows (n, dp), compensated
    gemm<false>(rows, dp, n, dpt, kBlockN, kr_blk, P, int64_t(kBlockN) * P, dqt, dp);
    // NaN: read from K, or a hidden key's non-finite K row times its dS = 0 (tile.h's hidden
    // keys), or an inf in K times a dX of 0 (softcap saturated); the redo leaves out the terms
    // with dX = 0 (a NaN K row makes a reading row's logit, P and dS NaN, so those stay)
    if ((may_hide || k_bad[j0 / kBlockN]) && any_nan(dqt, int64_t(rows) * dp)) {
      gemm_skipping(rows, dp, n, dpt, kBlockN, kr_blk, P, int64_t(kBlockN) * P, dqt, dp,
                    [&](int r, int jj) { return dpt[r * kBlockN + jj] == T(0); });
    }
    kahan_add(dq + int64_t(i0) * dp, dqc + int64_t(i0) * dp, dqt, rows * dp);
  }

#if defined(ATTN_AMX)
  // tile()'s products on AMX tiles (amx_t): dV^T (dp, n) += dO^T P, dK^T += Q^T dS, over the
  // tile's rows (an odd count pairs with a zero row of P / dS and a zero column of dO^T / Q^T);
  // dQ's tile dS K as in tile(), its NaN redo and compensated add included. A row whose dO (Q)
  // holds a NaN or an inf is a zero column of the tiles' dO^T (Q^T), which changes no other
  // key's sum, and adds its own terms in float32, leaving out those with P = 0 (dS = 0): only the
  // keys it reaches see it, as in tile()'s float32 products. dQ's NaN redo runs on the tiles
  // (bf16dot.h's gemm_dp_skipping): the rows without a NaN come out as they were.
  void tile_amx(int i0, int rows, int j0, int n, bool may_hide) {
    if constexpr (std::is_same<T, float>::value) {
      static_assert(kBlockM <= 64, "a block's bad rows are one 64-bit mask");
      const int kk = round_up(rows, 2);
      rows_to_pairs(s, kBlockN, rows, n, pp.data(), kBlockM);
      rows_to_pairs(dpt, kBlockN, rows, n, dsp.data(), kBlockM);
      const bool block_bad[2] = {bool(do_bad[i0 / kBlockM]), bool(q_bad[i0 / kBlockM])};
      const uint16_t* rows_b[2] = {dob, qb};  // dO and Q rows in bf16 (kRows)
      const uint16_t* tr[2] = {doT.data(), qT.data()};
      const uint16_t* pairs[2] = {pp.data(), dsp.data()};
      const T* terms[2] = {s, dpt};  // P and dS (the zero terms are left out)
      T* acc_t[2] = {dvT.data(), dkT.data()};
      T* acc[2] = {dv, dk};
      for (int w = 0; w < 2; ++w) {
        const uint16_t* a = tr[w] + i0;
        int64_t lda = ldq;
        uint64_t bad_rows = 0;  // rows (< kBlockM <= 64) of the block with a NaN or an inf
        if (block_bad[w]) {
          for (int r = 0; r < rows; ++r) {
            const uint16_t* x = rows_b[w] + int64_t(i0 + r) * dp;
            bool bad = false;
            for (int c = 0; c < dp; ++c) bad |= (x[c] & 0x7f80u) == 0x7f80u;
            bad_rows |= uint64_t(bad) << r;
          }
          // the block's columns of dO^T / Q^T, the bad rows' zero
          for (int c = 0; c < dp; ++c) {
            for (int r = 0; r < kk; ++r) at[size_t(c) * 2 * kAmxDpK + r] = (bad_rows >> r) & 1 ? 0 : a[c * ldq + r];
          }
          a = at.data();
          lda = 2 * kAmxDpK;
        }
        for (int m0 = 0; m0 < dp; m0 += 64) {
          gemm_dp_add(std::min(64, dp - m0), n, kk, a + int64_t(m0) * lda, lda, pairs[w], int64_t(kBlockM) * kDotPanel,
                      acc_t[w] + int64_t(m0) * kBlockN + j0 % kBlockN, kBlockN);
        }
        for (uint64_t bits = bad_rows; bits != 0; bits &= bits - 1) {
          const int r = __builtin_ctzll(bits);
          const uint16_t* x = rows_b[w] + int64_t(i0 + r) * dp;
          for (int jj = 0; jj < n; ++jj) {
            const T t = terms[w][r * kBlockN + jj];
            if (t == T(0)) continue;
            T* out = acc[w] + int64_t(j0 + jj) * dp;
            for (int c = 0; c < dp; ++c) out[c] += t * bf16_to_f32(x[c]);
          }
        }
      }
      rows_to_bf16(dpt, kBlockN, dsb.data(), kBlockN, rows, n);
      const uint16_t* kb = panel_row<uint16_t, kDotPanel>(kpb.data(), j0, kBlockN, dp);
      gemm_dp(rows, dp, n, dsb.data(), kBlockN, kb, int64_t(kBlockN) * kDotPanel, dqt, dp);
      if ((may_hide || k_bad[j0 / kBlockN]) && any_nan(dqt, int64_t(rows) * dp)) {
        gemm_dp_skipping(rows, dp, n, dsb.data(), kBlockN, kb, int64_t(kBlockN) * kDotPanel, dqt, dp,
                         [&](int r, int jj) { return dpt[r * kBlockN + jj] == T(0); });
      }
      kahan_add(dq + int64_t(i0) * dp, dqc + int64_t(i0) * dp, dqt, rows * dp);
    }
  }
#endif
  // Keys [j0, j0 + n) of dV^T and dK^T (inside one key block) into dV and dK, then zero: the
  // head's walk is done with them
  void flush_amx(int j0, int n) {
    if (!amx_t) return;
    for (int jj = 0; jj < n; ++jj) {
      T* v = dv + int64_t(j0 + jj) * dp;
      T* k = dk + int64_t(j0 + jj) * dp;
      const int64_t col = j0 % kBlockN + jj;
      for (int c = 0; c < dp; ++c) {
        v[c] += std::exchange(dvT[int64_t(c) * kBlockN + col], 0.f);
        k[c] += std::exchange(dkT[int64_t(c) * kBlockN + col], 0.f);
      }
    }
  }

  void head(int b, int h, const SeqInfo& si, int len_q, int len_k, int qpad) {
    const int d = p.d;
    const size_t es = dtype_size(dt);
    const PolicyT<T> pol(p, si, b, h);
    const TileSoftmax<T> ts(p, pol, b * p.h + h);
    const T keep_scale = p.dropout_p > 0.f ? T(1) / (T(1) - T(p.dropout_p)) : T(1);

    auto qside = [&](const void* base, int64_t bs, int64_t hs, int64_t rs) {
      return elem(base, dt, si.q_offset(p, b, h, 0, bs, hs, rs));
    };
    const void* qsrc = qside(p.q, p.q_batch_stride, p.q_head_stride, p.q_row_stride);
    const void* dosrc = qside(p.dout, p.do_batch_stride, p.do_head_stride, p.do_row_stride);
    if (!dot) pack_one(dt, qsrc, p.q_row_stride, len_q, qpad, d, dp, PackLayout::kRows, kBlockM, q, row);
    pack_one(dt, qsrc, p.q_row_stride, len_q, qpad, d, dp, PackLayout::kPanels, kBlockM, qpn, row);
    pack_one(dt, dosrc, p.do_row_stride, len_q, qpad, d, dp, PackLayout::kRows, kBlockM, dout, row);
    pack_one(dt, dosrc, p.do_row_stride, len_q, qpad, d, dp, PackLayout::kPanels, kBlockM, dopn, row);
    if (dot) {
      pack_one_pairs(qsrc, p.q_row_stride, len_q, qpad, d, dp, PackLayout::kRows, kBlockM, qb);
      pack_one_pairs(dosrc, p.do_row_stride, len_q, qpad, d, dp, PackLayout::kRows, kBlockM, dob);
    }
    if (amx_t) {  // Q^T and dO^T for tile_amx, zero past the head's rows
      for (int c = 0; c < dp; ++c) {
        uint16_t* qt = qT.data() + int64_t(c) * ldq;
        uint16_t* dt_ = doT.data() + int64_t(c) * ldq;
        for (int i = 0; i < qpad; ++i) {
          qt[i] = qb[int64_t(i) * dp + c];
          dt_[i] = dob[int64_t(i) * dp + c];
        }
        std::fill(qt + qpad, qt + ldq, uint16_t(0));
        std::fill(dt_ + qpad, dt_ + ldq, uint16_t(0));
      }
    }
    std::fill(dq, dq + int64_t(qpad) * dp, T(0));
    std::fill(dqc, dqc + int64_t(qpad) * dp, T(0));
    q_bad.assign(qpad / kBlockM, 0);
    do_bad.assign(qpad / kBlockM, 0);
    for (int i0 = 0; i0 < qpad; i0 += kBlockM) {
      q_bad[i0 / kBlockM] = any_nonfinite(panel_row(qpn, i0, kBlockM, dp), int64_t(kBlockM) * dp);
      do_bad[i0 / kBlockM] = any_nonfinite(dout + int64_t(i0) * dp, int64_t(kBlockM) * dp);
    }
    // D_i = dO_i . O_i (O read in its own dtype, as the forward wrote it)
    const char* obase = qside(p.o, p.o_batch_stride, p.o_head_stride, p.o_row_stride);
    const int64_t lse_off = b * p.lse_batch_stride + h * p.lse_head_stride + si.row_q;
    const T* lse_bh = p.lse + lse_off;
    const T* dlse_bh = p.dlse != nullptr ? p.dlse + lse_off : nullptr;
    T dsink = T(0);
    const T sink = p.sinks != nullptr ? p.sinks[h] : T(0);
    for (int i = 0; i < len_q; ++i) {
      load_row(dt, obase + es * i * p.o_row_stride, row, d, dp);
      V acc = V{};
      for (int c = 0; c < dp; c += L) acc += vload(row + c) * vload(dout + int64_t(i) * dp + c);
      dvec[i] = hsum(acc) - (p.dlse != nullptr ? dlse_bh[i] : T(0));
      lse[i] = lse_bh[i];
      // d loss / d sink = -sum_i P_sink,i D_i, P_sink,i = exp(sink - lse_i)
      if (p.sinks != nullptr && !std::isinf(lse[i])) dsink -= std::exp(sink - lse[i]) * dvec[i];
    }
    if (p.dsinks != nullptr) p.dsinks[b * p.h + h] = dsink;
    T* dbias_bh = p.dbias != nullptr ? p.dbias + b * p.dbias_batch_stride + h * p.dbias_head_stride : nullptr;

    const Head hd{pol, ts, keep_scale, dbias_bh, len_q};
    constexpr int P = kPanel<T>;
    if (!p.sparse.on()) {
      for (int j0 = 0; j0 < len_k; j0 += kBlockN) {
        int q_lo, q_hi;
        pol.query_range(j0, j0 + kBlockN, &q_lo, &q_hi);
        for (int i0 = std::max(q_lo, 0) / kBlockM * kBlockM; i0 < q_hi; i0 += kBlockM) {
          const int rows = std::min(kBlockM, len_q - i0);
          if (rows <= 0) break;
          // the block's keys these rows may see, trimmed to whole panels (a causal or window
          // edge tile skips its wholly masked panels, as the forward's walk does)
          int klo, khi;
          pol.key_range(i0, i0 + rows, &klo, &khi);
          klo = std::max(klo, j0);
          khi = std::min(khi, std::min(j0 + kBlockN, len_k));
          if (klo >= khi) continue;
          const int a = klo / P * P;
          tile(hd, i0, rows, a, round_up(khi, P) - a, klo, khi);
        }
        flush_amx(j0, std::min(kBlockN, round_up(len_k - j0, P)));
      }
    } else {
      // block-sparse: per layout column, its on blocks (CSC at the layout's own granularity);
      // key and query tiles cut where the packed operands need (tile.h)
      const int bs = p.sparse.block;
      const int n_cols = (len_k + bs - 1) / bs;
      for (int c = 0; c < n_cols; ++c) {
        int beg, end;
        p.sparse.tiles(p.sparse.bwd, h, c, &beg, &end);
        if (beg == end) continue;
        for_key_tiles<T>(c * bs, std::min((c + 1) * bs, len_k), [&](int j0, int n, int lo, int hi) {
          int q_lo, q_hi;
          pol.query_range(lo, hi, &q_lo, &q_hi);
          q_lo = std::max(q_lo, 0);
          q_hi = std::min(q_hi, len_q);
          const int* idx = p.sparse.bwd.idx;
          for (int e = beg; e < end;) {
            // a run of adjacent on blocks is one query range: whole kBlockM tiles where it is long
            int e1 = e + 1;
            while (e1 < end && idx[e1] == idx[e1 - 1] + 1) ++e1;
            const int r0 = std::max(idx[e] * bs, q_lo), r1 = std::min((idx[e1 - 1] + 1) * bs, q_hi);
            e = e1;
            if (r0 < r1) for_query_tiles(r0, r1, [&](int i0, int rows) { tile(hd, i0, rows, j0, n, lo, hi); });
          }
          flush_amx(j0, n);
        });
      }
    }
    char* dqbase = elem(p.dq, dt, si.q_offset(p, b, h, 0, p.dq_batch_stride, p.dq_head_stride, p.dq_row_stride));
    for (int64_t c = 0; c < int64_t(len_q) * dp; c += L) vstore(dq + c, vload(dq + c) - vload(dqc + c));
    store_rows(dq, len_q, dqbase, p.dq_row_stride);
  }
};

}  // namespace

template <typename T>
void softmax_bwd(const SoftmaxBwdParamsT<T>& p, DType dt) {
  parallel_tasks(int64_t(p.b) * p.h_k, p.num_threads, [&] { return BwdWorker<T>(p, dt); });
}
template void softmax_bwd<float>(const SoftmaxBwdParamsT<float>&, DType);
template void softmax_bwd<double>(const SoftmaxBwdParamsT<double>&, DType);
ATTN_CPU_REGISTER(softmax_bwd_stub<float>, &softmax_bwd<float>);
ATTN_CPU_REGISTER(softmax_bwd_stub<double>, &softmax_bwd<double>);

ATTN_CPU_ISA_END
}  // namespace cpu
}  // namespace attn
