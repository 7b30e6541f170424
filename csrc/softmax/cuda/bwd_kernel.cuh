// Tensor-core backward (sm_80+, fp16/bf16), FlashAttention-2 style.
//
// dkdv_kernel: one CTA per (key block, kv head, batch[, head-dim slice]). Each warp owns 16
// keys and computes the transposed scores S^T = K Q^T and dP^T = V dO^T, so that P^T and
// dS^T come out of the accumulators already in the A-operand layout of
//   dV += P^T dO      dK += dS^T Q
// (no shared-memory round trip). The CTA loops over the query blocks of every query head of
// its kv group (MQA/GQA reduce inside the CTA: deterministic, no dK/dV scratch). dQ = dS K
// needs dS with queries as rows: dS^T goes to shared memory once and is read back with
// ldmatrix.trans; the partial dQ is added to a float32 scratch with atomics (non-
// deterministic mode) or left to dq_kernel (deterministic mode).
//
// dq_kernel: one CTA per query block, warps own 16 query rows and loop over key blocks:
//   S = Q K^T, dP = dO V^T, dS, dQ += dS K, written straight to dq. No atomics.
#pragma once

#include "softmax/cuda/kernel_common.cuh"
#include "cuda/mma.cuh"
#include "softmax/cuda/fragment_softmax.cuh"
#include "softmax/cuda/nonfinite.cuh"
#include "softmax/cuda/traits.h"

namespace attn {
namespace tc {

// Compile-time schedule choices of the dK/dV kernel. The default build instantiates only
// BwdVariant<>; the others are candidates that the tuning build (-DATTN_TUNING, tuning.cuh
// BwdAlt) times against it.
//   kSUnroll:  unroll of the S^T / dP^T head-dim loop (1: rolled, the loop only moves addresses)
//   kPlain:    compile only the plain-policy path (no bias, ALiBi, softcap, dbias): the launcher
//              sends every other config to the default kernel
//   kSeq:      S^T first, P^T packed to 16 bits at once and dV += P^T dO, then dP^T and dS^T, so
//              that the S^T and dP^T fp32 accumulators (2 x kBlockM / 2 registers) are never live
//              together; needs kPlain and no dropout
//   kDqAtomic: bytes per dQ atomic on sm_90 (0: the default, 16; 8: one float2 per row pair and
//              n-tile, no shuffles; 4: scalar); sm_80 always uses 4 (vector atomics are sm_90+)
template <int kSUnroll_ = 1, bool kPlain_ = false, bool kSeq_ = false, int kDqAtomic_ = 0>
struct BwdVariant {
  static constexpr int kSUnroll = kSUnroll_, kDqAtomic = kDqAtomic_;
  static constexpr bool kPlain = kPlain_, kSeq = kSeq_;
  static_assert(!kSeq || kPlain, "the sequential schedule drops the score x that softcap needs");
  static_assert(kDqAtomic == 0 || kDqAtomic == 4 || kDqAtomic == 8 || kDqAtomic == 16, "dQ atomic width");
};

// kDropout is a template flag: the Philox rounds would otherwise push the 128 accumulator
// registers into spills on the common no-dropout path.
template <typename T, int kD, int kDAcc, int kBlockM, int kBlockN, int kNWarps, bool kDropout,
          typename Var = BwdVariant<>>
__global__ void __launch_bounds__(kNWarps * 32, 1) bwd_dkdv_kernel(const SoftmaxBwdParams p) {
  static_assert(!(Var::kSeq && kDropout), "the sequential schedule has no dropout path");
  constexpr int kSUnroll = Var::kSUnroll;
  using Ops = TypeOps<T>;
  constexpr int kThreads = kNWarps * 32;
  constexpr int kSlices = kD / kDAcc;
  constexpr int kQT = kBlockM / 8;     // 8-column n-tiles of S^T (queries)
  constexpr int kAT = kDAcc / 8;       // 8-column n-tiles of dK / dV
  static_assert(kBlockN == 16 * kNWarps, "warps own 16 keys each");
  using TileKV = SmemTile<kBlockN, kD>;
  using TileQ = SmemTile<kBlockM, kD>;
  using TileS = SmemTile<kBlockN, kBlockM>;

  // Q, dO, lse and dot(dO, O) are double-buffered: block m + 1 streams in during block m.
  ATTN_EXTERN_SMEM(smem);
  const uint32_t sK = smem_u32(smem);                   // (kBlockN, kD)
  const uint32_t sV = sK + TileKV::kBytes;              // (kBlockN, kD)
  const uint32_t sQ0 = sV + TileKV::kBytes;             // 2 x (kBlockM, kD)
  const uint32_t sdO0 = sQ0 + 2 * TileQ::kBytes;        // 2 x (kBlockM, kD)
  const uint32_t sdS = sdO0 + 2 * TileQ::kBytes;        // (kBlockN, kBlockM): dS^T
  float* sLse0 = reinterpret_cast<float*>(smem + 2 * TileKV::kBytes + 4 * TileQ::kBytes + TileS::kBytes);
  float* sDot0 = sLse0 + 2 * kBlockM;                   // 2 x (kBlockM)

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int n_block = blockIdx.x / kSlices, slice = blockIdx.x % kSlices;
  const int d_off = slice * kDAcc;
  const int hk = blockIdx.y, b = blockIdx.z;
  const int group = p.h / p.h_k;

  const SeqInfo si(p, b);
  const int n0 = n_block * kBlockN;
  // rows of dK/dV this CTA owns: the padded layout also zeroes keys past seqlens_k
  const int rows_store = min(kBlockN, (p.cu_seqlens_k != nullptr ? si.len_k : p.sk) - n0);
  if (rows_store <= 0) return;
  const int rows_k = min(kBlockN, si.len_k - n0);  // may be <= 0: then only zeros are stored
  const bool dq_atomic = !p.deterministic && p.dq_accum != nullptr;
  const bool write_dbias = !Var::kPlain && p.dbias != nullptr && !p.deterministic;
  constexpr bool dropout = kDropout;
  const float rdrop = dropout ? 1.f / (1.f - p.dropout_p) : 1.f;
  const int wn = warp * 16;
  // per-thread ldmatrix bases: A of K/V (own 16 keys), B of Q/dO non-transposed and
  // transposed (this head-dim slice)
  const uint32_t kv_a = TileKV::lane_a(wn, lane);
  const uint32_t q_b = TileQ::lane_b(0, lane);
  const uint32_t q_bt = TileQ::lane_bt(d_off, lane);

  const T* kp = k_ptr<T>(p, si, b, hk, n0);
  const T* vp = v_ptr<T>(p, si, b, hk, n0);

  float acc_dk[kAT][4], acc_dv[kAT][4];
#pragma unroll
  for (int t = 0; t < kAT; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dk[t][e] = acc_dv[t][e] = 0.f;

  if (rows_k > 0) {
    load_tile_async<kBlockN, kD, kThreads>(sK, kp, p.k_row_stride, rows_k, p.d, tid);
    load_tile_async<kBlockN, kD, kThreads>(sV, vp, p.v_row_stride, rows_k, p.d, tid);
    cp_async_commit();
  }

  // K with inf / NaN elements (k_fix, CTA-uniform, read from global memory while the tiles load;
  // only where dQ is added here): sK's are zeroed once, for dQ += dS K (a key's dS is 0 or NaN
  // in every row then), and fix_key_scores (nonfinite.cuh) restores S^T = K Q^T of this thread's
  // keys that held one (key_fix_bits: keys wn + g, wn + g + 8). Nothing in the loop but a
  // predicated select, unless this CTA holds an inf key.
  const bool k_fix =
      dq_atomic && __syncthreads_or(rows_k > 0 && has_nonfinite<T, kThreads>(kp, p.k_row_stride, rows_k, p.d, tid));
  uint32_t kfix = 0;
  if (k_fix) {
    kfix = key_fix_bits<T>(kp + int64_t(wn + g) * p.k_row_stride, p.k_row_stride, rows_k - (wn + g), p.d);
    wait_and_zero_nonfinite<T, TileKV, kBlockN, kThreads, false>(sK, tid);
  }
  auto fix_scores = [&](float (*acc)[4], uint32_t sq) {
    fix_key_scores<T, TileQ, kQT>(*reinterpret_cast<float(*)[kQT][4]>(acc), kfix, sq, kp, wn + g, p.k_row_stride,
                                  c, p.d);
  };
  for (int gi = 0; rows_k > 0 && gi < group; ++gi) {
    const int h = hk * group + gi;
    const Policy pol(p, si, b, h);
    const bool plain = Var::kPlain || policy_is_plain(pol);
    const int bh = b * p.h + h;
    int i0, i1;
    pol.query_range(n0, n0 + rows_k, &i0, &i1);
    i0 = max(i0, 0);
    i1 = min(i1, si.len_q);
    if (i0 >= i1) continue;
    // The query blocks to visit are steps [m_lo, m_hi): dense, step m is query block m;
    // block-sparse, step e is entry e of this key tile's column of the tile index (its query
    // block sp_idx[e], ascending), clipped to the visible blocks.
    int m_lo = i0 / kBlockM, m_hi = (i1 + kBlockM - 1) / kBlockM;
    const bool sparse = p.sparse.on();
    const int32_t* sp_idx = p.sparse.bwd.idx;
    const uint8_t* sp_full = p.sparse.bwd.full;
    if (sparse) {
      sparse_entries(p.sparse, p.sparse.bwd, h, n_block, m_lo, m_hi, &m_lo, &m_hi);
      if (m_lo >= m_hi) continue;
    }
    auto query_block = [&](int step) { return sparse ? int(sp_idx[step]) : step; };

    const T* qp = q_ptr<T>(p, si, b, h, 0);
    const T* dop = dout_ptr<T>(p, si, b, h, 0);
    const float* lse_p = p.lse + lse_index(p, si, b, h, 0);
    const float* dot_p = p.softmax_d + scratch_row(p, b, h, 0);

    // step's query block into buffer step & 1
    auto load_q_block = [&](int step) {
      const int m0 = query_block(step) * kBlockM, rows = min(kBlockM, si.len_q - m0);
      const int bi = step & 1;
      load_tile_async<kBlockM, kD, kThreads>(sQ0 + bi * TileQ::kBytes, qp + int64_t(m0) * p.q_row_stride,
                                             p.q_row_stride, rows, p.d, tid);
      load_tile_async<kBlockM, kD, kThreads>(sdO0 + bi * TileQ::kBytes, dop + int64_t(m0) * p.do_row_stride,
                                             p.do_row_stride, rows, p.d, tid);
      const uint32_t lse_u = smem_u32(sLse0 + bi * kBlockM), dot_u = smem_u32(sDot0 + bi * kBlockM);
      for (int r = tid; r < kBlockM; r += kThreads) {
        cp_async4(lse_u + r * 4, lse_p + m0 + (r < rows ? r : 0), r < rows);
        cp_async4(dot_u + r * 4, dot_p + m0 + (r < rows ? r : 0), r < rows);
      }
      cp_async_commit();
    };
    load_q_block(m_lo);

    for (int m = m_lo; m < m_hi; ++m) {
      const int m0 = query_block(m) * kBlockM;
      // a tile the index does not mark full checks the layout per element
      const bool tile_on = !sparse || sp_full[m] != 0;
      cp_async_wait<0>();
      __syncthreads();  // block m landed (K, V too on the first pass); every warp left block m - 1
      if (m + 1 < m_hi) load_q_block(m + 1);  // into the other buffer, behind this whole block
      const uint32_t sQ = sQ0 + (m & 1) * TileQ::kBytes, sdO = sdO0 + (m & 1) * TileQ::kBytes;
      const float* sLse = sLse0 + (m & 1) * kBlockM;
      const float* sDot = sDot0 + (m & 1) * kBlockM;
      // poisoned query rows (a NaN / inf in q or dO: nonfinite.cuh): their Q and dO rows are
      // zeroed and their lse set to NaN before anything reads them (CTA-uniform: every warp
      // votes on the same sDot)
      if (any_poisoned<kBlockM>(sDot, lane)) {
        zero_poisoned_rows<TileQ, kBlockM, kThreads>(sQ, sdO, sLse0 + (m & 1) * kBlockM, sDot, tid);
        __syncthreads();
      }
      // an inf in q under softcap (not poisoned: its logits are +-cap): the row's dS is 0 (or NaN)
      // at every key, so its inf elements of Q are zeroed for dK += dS^T Q once every warp's S
      // read them (q_inf, CTA-uniform; nonfinite.cuh)
      const bool q_inf = !Var::kPlain && p.softcap > 0.f &&
                         __syncthreads_or(any_nonfinite_smem<T, TileQ, kBlockM, kThreads>(sQ, tid));
      // ---- S^T = K Q^T and dP^T = V dO^T: (16 keys, kBlockM queries) per warp
      float acc_s[kQT][4], acc_dp[kQT][4];
#pragma unroll
      for (int t = 0; t < kQT; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_s[t][e] = acc_dp[t][e] = 0.f;
      const int kk_end = (p.d + 15) / 16;  // skip the head-dim padding of the bucket
      uint32_t pa[kBlockM / 16][4];           // kSeq: P^T as the A fragments of dV += P^T dO
      if constexpr (Var::kSeq) {
        // ---- S^T = K Q^T: (16 keys, kBlockM queries) per warp
#pragma unroll kSUnroll
        for (int kk = 0; kk < kk_end; ++kk) {
          uint32_t ak[4];
          ldmatrix_x4(ak, sK + TileKV::advance(kv_a, 0, kk * 16));
#pragma unroll
          for (int np = 0; np < kBlockM / 16; ++np) {
            uint32_t bq[4];
            ldmatrix_x4(bq, sQ + TileQ::advance(q_b, np * 16, kk * 16));
            mma_n16<T>(acc_s[2 * np], ak, bq);
          }
        }
        fix_scores(acc_s, sQ);
        // ---- P^T, packed to 16 bits at once: the fp32 S^T dies before dP^T is accumulated.
        // dS^T below multiplies by this 16-bit P. Error: P = P_exact (1 + d), |d| <= u (bf16
        // 2^-8, fp16 2^-11; fp16 P < 2^-14 is subnormal, off by <= 2^-25 absolute), so dS =
        // P (dP - D) carries u from P on top of the u of its own rounding to 16 bits (it feeds
        // dK and dQ as 16-bit A fragments either way): <= 2u per element instead of u, errors
        // that add in quadrature over the kBlockM-query sums of dK and dQ. reference.py in the
        // same dtype rounds P, dP, dP - D and the product each to 16 bits, so the tests' bound
        // (2x its error) keeps a margin; dV already used this 16-bit P in the default schedule.
        const bool check = !(tile_on && pol.tile_full(m0, m0 + kBlockM, n0 + wn, n0 + wn + 16));
        const float scale_log2 = p.scale * kLog2e;
        if (!check) {
#pragma unroll
          for (int t = 0; t < kQT; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              acc_s[t][e] = fast_exp2(acc_s[t][e] * scale_log2 - lse_to_log2(sLse[t * 8 + 2 * c + (e & 1)]));
        } else {
#pragma unroll
          for (int t = 0; t < kQT; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int il = t * 8 + 2 * c + (e & 1), jl = wn + g + (e >> 1) * 8;
              const float pr = fast_exp2(acc_s[t][e] * scale_log2 - lse_to_log2(sLse[il]));
              acc_s[t][e] = plain_allowed(pol, m0 + il, n0 + jl) ? pr : 0.f;
            }
        }
        pack_a_frags<T, kQT>(&acc_s[0][0], pa);

        // ---- dV += P^T dO over this slice of the head dim
#pragma unroll
        for (int kk = 0; kk < kBlockM / 16; ++kk)
#pragma unroll
          for (int dt = 0; dt < kDAcc / 16; ++dt) {
            uint32_t bo[4];
            ldmatrix_x4_trans(bo, sdO + TileQ::advance(q_bt, kk * 16, dt * 16));
            mma_n16<T>(acc_dv[2 * dt], pa[kk], bo);
          }

        // ---- dP^T = V dO^T, then dX^T = P^T (dP^T - D) * scale into acc_dp
#pragma unroll kSUnroll
        for (int kk = 0; kk < kk_end; ++kk) {
          uint32_t av[4];
          ldmatrix_x4(av, sV + TileKV::advance(kv_a, 0, kk * 16));
#pragma unroll
          for (int np = 0; np < kBlockM / 16; ++np) {
            uint32_t bo[4];
            ldmatrix_x4(bo, sdO + TileQ::advance(q_b, np * 16, kk * 16));
            mma_n16<T>(acc_dp[2 * np], av, bo);
          }
        }
#pragma unroll
        for (int t = 0; t < kQT; ++t)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            // acc_s[t][2 hf .. 2 hf + 1] went to pa[t / 2][2 (t % 2) + hf] (pack_a_frags)
            // dS = 0 for a hidden key (a selection, not a product: its dP may be NaN)
            const float2 pr = Ops::unpack(pa[t / 2][2 * (t & 1) + hf]);
            const int il = t * 8 + 2 * c, j = n0 + wn + g + hf * 8;
            const bool ok0 = !check || plain_allowed(pol, m0 + il, j);
            const bool ok1 = !check || plain_allowed(pol, m0 + il + 1, j);
            acc_dp[t][2 * hf] = ok0 ? pr.x * (acc_dp[t][2 * hf] - sDot[il]) * p.scale : 0.f;
            acc_dp[t][2 * hf + 1] = ok1 ? pr.y * (acc_dp[t][2 * hf + 1] - sDot[il + 1]) * p.scale : 0.f;
          }
      } else {
        // kk only moves addresses: a rolled loop keeps the prefetched fragments from
        // crowding out the dK/dV accumulators
#pragma unroll kSUnroll
        for (int kk = 0; kk < kk_end; ++kk) {
          {
            uint32_t ak[4], av[4];
            ldmatrix_x4(ak, sK + TileKV::advance(kv_a, 0, kk * 16));
            ldmatrix_x4(av, sV + TileKV::advance(kv_a, 0, kk * 16));
#pragma unroll
            for (int np = 0; np < kBlockM / 16; ++np) {
              uint32_t bq[4], bo[4];
              const uint32_t off = TileQ::advance(q_b, np * 16, kk * 16);
              ldmatrix_x4(bq, sQ + off);
              ldmatrix_x4(bo, sdO + off);
              mma_n16<T>(acc_s[2 * np], ak, bq);
              mma_n16<T>(acc_dp[2 * np], av, bo);
            }
          }
        }
        fix_scores(acc_s, sQ);

        // ---- elementwise: P^T (dropped, scaled) into acc_s, dX^T into acc_dp
        const bool check = !(plain && tile_on && pol.tile_full(m0, m0 + kBlockM, n0 + wn, n0 + wn + 16));
        if (!check && !dropout) {
          // full tile of a plain policy: branch-free (write_dbias implies a bias, so never here)
          const float scale_log2 = p.scale * kLog2e;
#pragma unroll
          for (int t = 0; t < kQT; ++t) {
#pragma unroll
            for (int e2 = 0; e2 < 2; ++e2) {
              const int il = t * 8 + 2 * c + e2;
              const float l2 = lse_to_log2(sLse[il]), dsum = sDot[il];
#pragma unroll
              for (int hf = 0; hf < 2; ++hf) {
                const int e = 2 * hf + e2;
                const float pr = fast_exp2(acc_s[t][e] * scale_log2 - l2);
                acc_dp[t][e] = pr * (acc_dp[t][e] - dsum) * p.scale;
                acc_s[t][e] = pr;
              }
            }
          }
        } else {
          // the dropout keep bits first (dropout_keep_mask: element 4 t + e) where the fragment
          // has 32 elements (D <= 128); D = 256's 16 draw inline (ahead, the sm_90a kernel spilled
          // 204 B against 104)
          constexpr bool kAhead = dropout && 4 * kQT == 32;
          uint32_t keep = ~0u;
          if constexpr (kAhead)
            keep = dropout_keep_mask<4 * kQT>(p, bh, [&](int x, int* i, int* j) {
              *i = m0 + 8 * (x >> 2) + 2 * c + (x & 1);
              *j = n0 + wn + g + ((x >> 1) & 1) * 8;
            });
#pragma unroll
          for (int t = 0; t < kQT; ++t) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int jl = wn + g + (e >> 1) * 8;
              const int il = t * 8 + 2 * c + (e & 1);
              const int i = m0 + il, j = n0 + jl;
              const float z = kAhead ? ((keep >> (4 * t + e)) & 1u ? rdrop : 0.f)
                              : dropout ? dropout_scale(p, bh, i, j, rdrop) : 1.f;
              const BwdPoint bp = bwd_point(pol, plain, check, p.scale, acc_s[t][e], acc_dp[t][e],
                                            lse_to_log2(sLse[il]), sDot[il], z, i, j);
              acc_s[t][e] = bp.pd;
              acc_dp[t][e] = bp.dx;
              if (write_dbias && slice == 0 && i < si.len_q && j < si.len_k) store_dbias(p, b, h, i, j, bp.ds);
            }
          }
        }
      }

      if (q_inf) {
        __syncthreads();  // every warp's S^T read sQ
        zero_nonfinite<T, TileQ, kBlockM, kThreads>(sQ, tid);
        __syncthreads();
      }

      // ---- dS^T to shared memory for dQ
      if (dq_atomic) {
#pragma unroll
        for (int t = 0; t < kQT; ++t)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const uint32_t val = Ops::pack(acc_dp[t][2 * hf], acc_dp[t][2 * hf + 1]);
            st_shared_b32(sdS + TileS::offset(wn + g + hf * 8, t * 8 + 2 * c), val);
          }
      }

      // ---- dV += P^T dO (kSeq: done above) and dK += dS^T Q over this slice of the head dim
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk) {
        uint32_t ap[4], as[4];
        if constexpr (!Var::kSeq) {
          ap[0] = Ops::pack(acc_s[2 * kk][0], acc_s[2 * kk][1]);
          ap[1] = Ops::pack(acc_s[2 * kk][2], acc_s[2 * kk][3]);
          ap[2] = Ops::pack(acc_s[2 * kk + 1][0], acc_s[2 * kk + 1][1]);
          ap[3] = Ops::pack(acc_s[2 * kk + 1][2], acc_s[2 * kk + 1][3]);
        }
        as[0] = Ops::pack(acc_dp[2 * kk][0], acc_dp[2 * kk][1]);
        as[1] = Ops::pack(acc_dp[2 * kk][2], acc_dp[2 * kk][3]);
        as[2] = Ops::pack(acc_dp[2 * kk + 1][0], acc_dp[2 * kk + 1][1]);
        as[3] = Ops::pack(acc_dp[2 * kk + 1][2], acc_dp[2 * kk + 1][3]);
#pragma unroll
        for (int dt = 0; dt < kDAcc / 16; ++dt) {
          {  // padding columns accumulate zeros; no guard keeps the loop schedulable
            const uint32_t off = TileQ::advance(q_bt, kk * 16, dt * 16);
            uint32_t bo[4], bq[4];
            if constexpr (!Var::kSeq) ldmatrix_x4_trans(bo, sdO + off);
            ldmatrix_x4_trans(bq, sQ + off);
            if constexpr (!Var::kSeq) mma_n16<T>(acc_dv[2 * dt], ap, bo);
            mma_n16<T>(acc_dk[2 * dt], as, bq);
          }
        }
      }
      __syncthreads();  // dS^T complete

      // ---- dQ[m] += dS K: warps tile (kBlockM, kDAcc) as kBlockM / 16 row tiles x column splits
      if (dq_atomic) {
        constexpr int kRowTiles = kBlockM / 16;
        static_assert(kNWarps % kRowTiles == 0, "warps tile dQ evenly");
        constexpr int kSplit = kNWarps / kRowTiles;
        constexpr int kCols = kDAcc / kSplit;
        static_assert(kCols % 16 == 0, "dQ column split must be whole k-steps");
        const int wq = (warp % kRowTiles) * 16;
        const int wd = d_off + (warp / kRowTiles) * kCols;
        // spelled out rather than lane_b() / lane_bt(): through the helpers nvcc orders this
        // block's address arithmetic differently
        const uint32_t s_at = TileS::offset((lane & 7) + (lane >> 4) * 8, wq + ((lane >> 3) & 1) * 8);
        const uint32_t k_bt = TileKV::offset((lane & 7) + ((lane >> 3) & 1) * 8, wd + (lane >> 4) * 8);
        float acc_dq[kCols / 8][4];
#pragma unroll
        for (int t = 0; t < kCols / 8; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_dq[t][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
          uint32_t a[4];
          ldmatrix_x4_trans(a, sdS + TileS::advance(s_at, kk * 16, 0));
#pragma unroll
          for (int dt = 0; dt < kCols / 16; ++dt) {
            {
              uint32_t bk[4];
              ldmatrix_x4_trans(bk, sK + TileKV::advance(k_bt, kk * 16, dt * 16));
              mma_n16<T>(acc_dq[2 * dt], a, bk);
            }
          }
        }
        const int dp_cols = kD;  // dq_accum row length: the bucket
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        if constexpr (Var::kDqAtomic == 0 || Var::kDqAtomic == 16) {
          // sm_90 vector atomics: lanes c and c ^ 1 swap halves so that each lane owns 4
          // consecutive columns of one row (even c: row g, odd c: row g + 8), one 16-byte
          // reduction per n-tile instead of four 4-byte ones.
          const bool even = (c & 1) == 0;
          const int i = m0 + wq + g + (even ? 0 : 8);
          float* dst = p.dq_accum + scratch_row(p, b, h, i) * dp_cols;
#pragma unroll
          for (int t = 0; t < kCols / 8; ++t) {
            const float s0 = even ? acc_dq[t][2] : acc_dq[t][0];
            const float s1 = even ? acc_dq[t][3] : acc_dq[t][1];
            const float r0 = __shfl_xor_sync(0xffffffffu, s0, 1);
            const float r1 = __shfl_xor_sync(0xffffffffu, s1, 1);
            const int col = wd + t * 8 + 2 * (c & ~1);
            if (i < si.len_q && col < p.d) {
              const float4 val = even ? make_float4(acc_dq[t][0], acc_dq[t][1], r0, r1)
                                      : make_float4(r0, r1, acc_dq[t][2], acc_dq[t][3]);
              atomicAdd(reinterpret_cast<float4*>(dst + col), val);
            }
          }
        } else
#endif
        {  // sm_80, or kDqAtomic 4 / 8 on sm_90
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const int i = m0 + wq + g + hf * 8;
            if (i < si.len_q) {
              float* dst = p.dq_accum + scratch_row(p, b, h, i) * dp_cols;
#pragma unroll
              for (int t = 0; t < kCols / 8; ++t) {
                const int col = wd + t * 8 + 2 * c;
                if (col < p.d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
                  if constexpr (Var::kDqAtomic == 8) {
                    atomicAdd(reinterpret_cast<float2*>(dst + col),
                              make_float2(acc_dq[t][2 * hf], acc_dq[t][2 * hf + 1]));
                  } else
#endif
                  {
                    atomicAdd(dst + col, acc_dq[t][2 * hf]);
                    atomicAdd(dst + col + 1, acc_dq[t][2 * hf + 1]);
                  }
                }
              }
            }
          }
        }
      }
    }
  }

  // ---- epilogue: dK, dV (zeros for keys no query sees) straight from registers
  T* dk = dk_ptr<T>(p, si, b, hk, n0);
  T* dv = dv_ptr<T>(p, si, b, hk, n0);
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = wn + g + hf * 8;
    if (r < rows_store) {
#pragma unroll
      for (int t = 0; t < kAT; ++t) {
        const int col = d_off + t * 8 + 2 * c;
        if (col < p.d) {
          *reinterpret_cast<uint32_t*>(dk + int64_t(r) * p.dk_row_stride + col) =
              Ops::pack(acc_dk[t][2 * hf], acc_dk[t][2 * hf + 1]);
          *reinterpret_cast<uint32_t*>(dv + int64_t(r) * p.dv_row_stride + col) =
              Ops::pack(acc_dv[t][2 * hf], acc_dv[t][2 * hf + 1]);
        }
      }
    }
  }
}

template <typename T, int kD, int kDAcc, int kBlockM, int kBlockN, int kNWarps, bool kDropout>
__global__ void __launch_bounds__(kNWarps * 32, 1) bwd_dq_kernel(const SoftmaxBwdParams p) {
  using Ops = TypeOps<T>;
  constexpr int kThreads = kNWarps * 32;
  constexpr int kSlices = kD / kDAcc;
  constexpr int kNT = kBlockN / 8;
  constexpr int kAT = kDAcc / 8;
  static_assert(kBlockM == 16 * kNWarps, "warps own 16 query rows each");
  using TileQ = SmemTile<kBlockM, kD>;
  using TileKV = SmemTile<kBlockN, kD>;

  ATTN_EXTERN_SMEM(smem);
  const uint32_t sQ = smem_u32(smem);
  const uint32_t sdO = sQ + TileQ::kBytes;
  const uint32_t sK = sdO + TileQ::kBytes;
  const uint32_t sV = sK + TileKV::kBytes;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int m_block = blockIdx.x / kSlices, slice = blockIdx.x % kSlices;
  const int d_off = slice * kDAcc;
  const int h = blockIdx.y, b = blockIdx.z;
  const SeqInfo si(p, b);
  const int m0 = m_block * kBlockM;
  if (m0 >= si.len_q) return;
  const int rows_q = min(kBlockM, si.len_q - m0);
  const Policy pol(p, si, b, h);
  const bool plain = policy_is_plain(pol);
  const int hk = h / (p.h / p.h_k);
  const int bh = b * p.h + h;
  constexpr bool dropout = kDropout;
  const float rdrop = dropout ? 1.f / (1.f - p.dropout_p) : 1.f;
  const bool write_dbias = p.dbias != nullptr && slice == 0;
  const int wm = warp * 16;
  const uint32_t q_a = TileQ::lane_a(wm, lane);
  const uint32_t kv_b = TileKV::lane_b(0, lane);
  const uint32_t k_bt = TileKV::lane_bt(d_off, lane);

  const T* qp = q_ptr<T>(p, si, b, h, m0);
  const T* dop = dout_ptr<T>(p, si, b, h, m0);
  const T* kp = k_ptr<T>(p, si, b, hk, 0);
  const T* vp = v_ptr<T>(p, si, b, hk, 0);

  int n_lo, n_hi;
  pol.key_blocks(m0, m0 + rows_q, kBlockN, &n_lo, &n_hi);

  float lse2[2], dsum[2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int il = wm + g + hf * 8;
    const bool ok = il < rows_q;
    lse2[hf] = ok ? lse_to_log2(p.lse[lse_index(p, si, b, h, m0 + il)]) : INFINITY;
    dsum[hf] = ok ? p.softmax_d[scratch_row(p, b, h, m0 + il)] : 0.f;
  }

  float acc_dq[kAT][4];
#pragma unroll
  for (int t = 0; t < kAT; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dq[t][e] = 0.f;

  if (n_lo < n_hi) {
    load_tile_async<kBlockM, kD, kThreads>(sQ, qp, p.q_row_stride, rows_q, p.d, tid);
    load_tile_async<kBlockM, kD, kThreads>(sdO, dop, p.do_row_stride, rows_q, p.d, tid);
  }
  for (int n = n_lo; n < n_hi; ++n) {
    const int n0 = n * kBlockN;
    // block-sparse: this kernel reads the layout under its tile (no index at its tiles); the
    // test is CTA-uniform, so skipping is safe here
    const int layout_state = layout_tile_state(pol, m0, m0 + rows_q, n0, min(n0 + kBlockN, si.len_k));
    if (layout_state == 0) continue;
    load_tile_async<kBlockN, kD, kThreads>(sK, kp + int64_t(n0) * p.k_row_stride, p.k_row_stride,
                                           si.len_k - n0, p.d, tid);
    load_tile_async<kBlockN, kD, kThreads>(sV, vp + int64_t(n0) * p.v_row_stride, p.v_row_stride,
                                           si.len_k - n0, p.d, tid);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    // ---- S = Q K^T, dP = dO V^T: (16, kBlockN) per warp
    float acc_s[kNT][4], acc_dp[kNT][4];
#pragma unroll
    for (int t = 0; t < kNT; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_s[t][e] = acc_dp[t][e] = 0.f;
    const int kk_end = (p.d + 15) / 16;
#pragma unroll 1
    for (int kk = 0; kk < kk_end; ++kk) {
      {
        uint32_t aq[4], ao[4];
        ldmatrix_x4(aq, sQ + TileQ::advance(q_a, 0, kk * 16));
        ldmatrix_x4(ao, sdO + TileQ::advance(q_a, 0, kk * 16));
#pragma unroll
        for (int np = 0; np < kBlockN / 16; ++np) {
          const uint32_t off = TileKV::advance(kv_b, np * 16, kk * 16);
          uint32_t bk[4], bv[4];
          ldmatrix_x4(bk, sK + off);
          ldmatrix_x4(bv, sV + off);
          mma_n16<T>(acc_s[2 * np], aq, bk);
          mma_n16<T>(acc_dp[2 * np], ao, bv);
        }
      }
    }

    const bool check = !(plain && layout_state == 2 && pol.tile_full(m0 + wm, m0 + wm + 16, n0, n0 + kBlockN));
    if (!check && !dropout) {
      const float scale_log2 = p.scale * kLog2e;
#pragma unroll
      for (int t = 0; t < kNT; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int hf = e >> 1;
          const float pr = fast_exp2(acc_s[t][e] * scale_log2 - lse2[hf]);
          acc_dp[t][e] = pr * (acc_dp[t][e] - dsum[hf]) * p.scale;
        }
    } else {
    // the dropout keep bits first (dropout_keep_mask: element 4 t + e)
    using Keep = std::conditional_t<(4 * kNT <= 32), uint32_t, uint64_t>;
    Keep keep = ~Keep(0);
    if constexpr (dropout)
      keep = dropout_keep_mask<4 * kNT>(p, bh, [&](int x, int* i, int* j) {
        *i = m0 + wm + g + ((x >> 1) & 1) * 8;
        *j = n0 + 8 * (x >> 2) + 2 * c + (x & 1);
      });
#pragma unroll
    for (int t = 0; t < kNT; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int hf = e >> 1;
        const int i = m0 + wm + g + hf * 8, j = n0 + t * 8 + 2 * c + (e & 1);
        const float z = dropout ? ((keep >> (4 * t + e)) & 1u ? rdrop : 0.f) : 1.f;
        const BwdPoint bp = bwd_point(pol, plain, check, p.scale, acc_s[t][e], acc_dp[t][e],
                                      lse2[hf], dsum[hf], z, i, j);
        acc_dp[t][e] = bp.dx;
        if (write_dbias && i < si.len_q && j < si.len_k) store_dbias(p, b, h, i, j, bp.ds);
      }
    }
    }

    // dQ reads K: its inf / NaN elements are zeroed once S and dP were computed from it
    // (nonfinite.cuh), in every tile: a key whose k holds one has dS = 0 or NaN in every row
    // (hidden, P = 0, or softcap's zero derivative at +-inf; NaN where it was read), so the
    // zeros give the CPU's result, never 0 x inf. The vote is the barrier after every warp's S.
    if (__syncthreads_or(scan_nonfinite<T, TileKV, kBlockN, kThreads, false>(sK, tid))) {
      scan_nonfinite<T, TileKV, kBlockN, kThreads, true>(sK, tid);
      __syncthreads();
    }

    // ---- dQ += dS K over this slice
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t a[4];
      a[0] = Ops::pack(acc_dp[2 * kk][0], acc_dp[2 * kk][1]);
      a[1] = Ops::pack(acc_dp[2 * kk][2], acc_dp[2 * kk][3]);
      a[2] = Ops::pack(acc_dp[2 * kk + 1][0], acc_dp[2 * kk + 1][1]);
      a[3] = Ops::pack(acc_dp[2 * kk + 1][2], acc_dp[2 * kk + 1][3]);
#pragma unroll
      for (int dt = 0; dt < kDAcc / 16; ++dt) {
        {
          uint32_t bk[4];
          ldmatrix_x4_trans(bk, sK + TileKV::advance(k_bt, kk * 16, dt * 16));
          mma_n16<T>(acc_dq[2 * dt], a, bk);
        }
      }
    }
    __syncthreads();  // every warp finished reading K[n], V[n]
  }
  // a block-sparse row of tiles may skip every K / V load: Q and dO were still issued
  cp_async_commit();
  cp_async_wait<0>();

  T* dq = dq_ptr<T>(p, si, b, h, m0);
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = wm + g + hf * 8;
    if (r < rows_q) {
#pragma unroll
      for (int t = 0; t < kAT; ++t) {
        const int col = d_off + t * 8 + 2 * c;
        if (col < p.d)
          *reinterpret_cast<uint32_t*>(dq + int64_t(r) * p.dq_row_stride + col) =
              Ops::pack(acc_dq[t][2 * hf], acc_dq[t][2 * hf + 1]);
      }
    }
  }
}

}  // namespace tc
}  // namespace attn
