// Tensor-core (mma.sync m16n8k16, fp16 / bf16 operands, fp32 accumulators) backward of the
// linear attention family: simt_kernel.cuh's backward (same sweeps, same fp32 scratch, then its
// finalize_kernel and ddecay_kernel) with every chunk product on tensor cores, for fp16 / bf16
// inputs with M <= 128.
//
// One CTA (4 warps) per (value tile of kN columns, head, sequence), the forward's shape; warp w
// owns chunk rows [16w, 16w + 16) of every (C, .) product. dO' (C, kN) is staged as 16 bits
// (dout / den); the normalizer column's dO', dn_i = -(dout_i . out_i) / den_i, stays an fp32
// per-row scalar and its state columns z (forward) / Uz (reverse) fp32 vectors, all in tile 0
// only: it adds dn_i to the (C, C) products (v'_j = 1 there) and rank-1 terms in fp32.
//
// Ascending sweep (dQ~_i = S_i dO'_i), per chunk of rows i, keys j:
//   P  = dO' V^T (+ dn_i), masked j <= i, e^{g_i - g_j}    (C, C): B from V rows
//   dQ~ = e^{g_i} dO' S^T + P K~ (+ e^{g_i} dn_i z)       (C, kM): B from S16 rows, K~ .trans
//   S  <- e^{gC} S + (wk K~)^T V                           the forward's update (add_outer)
// Descending sweep with U the reverse state (U at the chunk's end while it is processed):
//   P1 = V dO'^T (+ dn_i), masked i >= j, e^{g_i - g_j}    dK~ = e^{gC - g_j} V U^T + P1 Q~ (+ wk Uz)
//   P2 = K~ Q~^T,          masked i >= j, e^{g_i - g_j}    dV  = e^{gC - g_j} K~ U + P2 dO'
//   U  <- e^{gC} U + (wq Q~)^T dO'                         add_outer again
// U has the forward state's slab, 16-bit copy and sigma (mma_common.cuh): its fp16 copy is
// scaled the same way. Non-causal: S, then U, over the whole sequence first (no decay there),
// and the chunk products are only the S / U terms. dQ~ / dK~ / dV rows go to the fp32 scratch
// with atomics (value tiles and GQA query heads add up); dG_i = Q~_i . dQ~_i - K~_i . dK~_i
// per tile from the accumulators and the 16-bit Q~ / K~ tiles the products used.
//
// Chunk-parallel (BwdMode; the forward's segments and scans, mma_fwd_kernel.cuh): after the
// forward's kSegState and scan have put the state entering each segment in the scratch,
//   kSegU:   per segment, the reverse state of its own rows from 0 (the descending sweep's U
//            updates only), then seg_scan_kernel in reverse gives U at each segment's end and
//            dS_0 (dinit_state);
//   kSegDq:  per segment, the ascending sweep from the segment's entering state (the last
//            segment also adds the <dS_T, S_T> term of dG);
//   kSegDkv: per segment, the descending sweep from U at the segment's end.
// The segment modes stage a chunk with 16-byte loads issued together where the rows allow it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "common/linear_params.h"
#include "cuda/mma.cuh"
#include "linear/cuda/mma_common.cuh"

namespace attn {
namespace linear_tc {

template <int kM>
struct BwdSmem {
  static_assert(kM == 64 || kM == 128, "feature-width buckets");
  using QTile = tc::SmemTile<kChunk, kM>;   // Q~, K~ (C, kM)
  using KtTile = tc::SmemTile<kM, kChunk>;  // (wk K~)^T ascending, (wq Q~)^T descending (kM, C)
  using VTile = tc::SmemTile<kChunk, kN>;   // V, dO' (C, kN)
  using STile = tc::SmemTile<kM, kN>;       // 16-bit S, then U (kM, kN)
  static constexpr int kQ = 0, kK = kQ + QTile::kBytes, kKt = kK + QTile::kBytes, kV = kKt + KtTile::kBytes,
                       kD = kV + VTile::kBytes, kS = kD + VTile::kBytes, kSf = kS + STile::kBytes;  // fp32 S / U
  static constexpr int kZ = kSf + kM * kN * 4;         // fp32 z, then Uz (kM)
  static constexpr int kScalars = kZ + kM * 4;         // g, wq, wk, kmul, dn, inv, ep (C each)
  static constexpr int kRed = kScalars + 7 * kChunk * 4;  // per-warp max |S|
  static constexpr int kBytes = kRed + kWarps * 4;
};

// Sum over the 4 lanes of a quad (one accumulator row's threads).
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

enum class BwdMode : int { kWhole = 0, kSegU = 1, kSegDq = 2, kSegDkv = 3 };

// kWhole: grid (ceil(Dv / kN), H, B); the segment modes: grid (ceil(Dv / kN) * plan.n_seg, H, B).
// kThreads threads, BwdSmem<kM>::kBytes bytes; scratch zeroed.
template <typename T, int kM, BwdMode kMode = BwdMode::kWhole>
__global__ void __launch_bounds__(kThreads, 1) bwd_kernel(const BwdParams p, const linear_simt::BwdScratch sc,
                                                          const SegPlan plan) {
  using L = BwdSmem<kM>;
  using QT = typename L::QTile;
  using VT = typename L::VTile;
  using ST = typename L::STile;
  constexpr bool kSeg = kMode != BwdMode::kWhole;
  const int ntiles = (p.dim_v + kN - 1) / kN;
  const int tile = kSeg ? int(blockIdx.x) % ntiles : int(blockIdx.x), seg = kSeg ? int(blockIdx.x) / ntiles : 0;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (p.h / p.h_k);
  const int tid = threadIdx.x, warp = tid / 32, row_a = 16 * warp;
  int lane = tid % 32;  // opaque() per chunk
  const int m = p.d, c0 = tile * kN, nv = min(kN, p.dim_v - c0);
  const linear_simt::Seq s(p, b);
  const bool decay = p.decay != nullptr, want_dg = decay && p.ddecay != nullptr;
  const bool has_norm = p.normalize && tile == 0;
  ATTN_EXTERN_SMEM(smem);
  const uint32_t sbase = tc::smem_u32(smem);
  float* Sf = reinterpret_cast<float*>(smem + L::kSf);
  float* z = reinterpret_cast<float*>(smem + L::kZ);
  float* g = reinterpret_cast<float*>(smem + L::kScalars);
  float* wq = g + kChunk;
  float* wk = wq + kChunk;
  float* kmul = wk + kChunk;
  float* dn = kmul + kChunk;
  float* inv_den = dn + kChunk;
  float* ep = inv_den + kChunk;
  float* red = reinterpret_cast<float*>(smem + L::kRed);
  const T* qh = static_cast<const T*>(p.q) + s.off(p.q_batch_stride, h, p.q_head_stride, 0, p.q_row_stride);
  const T* kh = static_cast<const T*>(p.k) + s.off(p.k_batch_stride, hk, p.k_head_stride, 0, p.k_row_stride);
  const T* vh = static_cast<const T*>(p.v) + s.off(p.v_batch_stride, hk, p.v_head_stride, 0, p.v_row_stride);
  const T* douth = static_cast<const T*>(p.dout) + s.off(p.do_batch_stride, h, p.do_head_stride, 0, p.do_row_stride);
  const T* outh = static_cast<const T*>(p.o) + s.off(p.o_batch_stride, h, p.o_head_stride, 0, p.o_row_stride);
  const int64_t q_rows = (int64_t(s.bt) * p.h + h) * p.seq_head_stride + s.row0;     // dQ~, dG rows
  const int64_t kv_rows = (int64_t(s.bt) * p.h_k + hk) * p.seq_head_stride + s.row0;  // dK~, dV rows
  const int ra = row_a + lane / 4, rb = ra + 8;  // this thread's two accumulator rows
  // this CTA's rows [r_begin, r_end): the whole sequence, or its segment
  // (the last segment takes every remaining row, as in the forward)
  const int r_begin = kSeg ? clamp_rows(seg, plan.seg_rows, s.len) : 0;
  const int r_end = !kSeg || seg == plan.n_seg - 1 ? s.len : clamp_rows(seg + 1, plan.seg_rows, s.len);
  // whole 16-byte vectors (stage_vec); evaluated per chunk, as a value kept across the loops
  // cost registers the dK~ / dV products spill without
  auto vec = [&] {
    return kSeg && m % 8 == 0 && nv % 8 == 0 && p.dim_v % 8 == 0 && p.q_row_stride % 8 == 0 &&
           p.k_row_stride % 8 == 0 && p.v_row_stride % 8 == 0 && p.do_row_stride % 8 == 0 && p.o_row_stride % 8 == 0 &&
           aligned16(qh) && aligned16(kh) && aligned16(vh + c0) && aligned16(douth) && aligned16(outh);
  };

  // The vector form of stage (below; vec), in two batches of loads issued together (one batch
  // spilled at kM = 128): Q~ and K~; then V, dO' and the rows' dout . out (two threads per row,
  // 16-byte loads).
  static_assert(kThreads == 2 * kChunk, "two threads per chunk row for the dout . out dots");
  auto stage_vec = [&](int r0, int n, bool q, bool qt, bool k, bool kt, bool v, bool d) {
    {
      RowVecs<kM> qv, kv;
      qv.load(qh, p.q_row_stride, r0, n, m, nullptr, q, tid);
      kv.load(kh, p.k_row_stride, r0, n, m, kmul, k, tid);  // a padded key (kmul 0): 0 without a read
      if (q) store_features<T, QT, typename L::KtTile, kM>(smem, L::kQ, L::kKt, qv, p, n, nullptr, wq, qt, tid);
      if (k) store_features<T, QT, typename L::KtTile, kM>(smem, L::kK, L::kKt, kv, p, n, kmul, wk, kt, tid);
    }
    RowVecs<kN> vv, dv;
    vv.load(vh + c0, p.v_row_stride, r0, n, nv, kmul, v, tid);
    dv.load(douth + c0, p.do_row_stride, r0, n, nv, nullptr, d, tid);
    if (d) {
      const int i = tid / 2, half = tid % 2;
      float dot = 0.f;
      if (i < n && p.normalize) {
        const T* dr = douth + int64_t(r0 + i) * p.do_row_stride;
        const T* orow = outh + int64_t(r0 + i) * p.o_row_stride;
#pragma unroll 4
        for (int c = 8 * half; c < p.dim_v; c += 16) {
          const uint4 a = *reinterpret_cast<const uint4*>(dr + c), o = *reinterpret_cast<const uint4*>(orow + c);
          const uint32_t aw[4] = {a.x, a.y, a.z, a.w}, ow[4] = {o.x, o.y, o.z, o.w};
#pragma unroll
          for (int t = 0; t < 4; ++t) {
            const float2 x = tc::TypeOps<T>::unpack(aw[t]), y = tc::TypeOps<T>::unpack(ow[t]);
            dot += x.x * y.x + x.y * y.y;
          }
        }
      }
      dot += __shfl_xor_sync(0xffffffffu, dot, 1);
      if (half == 0) {
        const float inv = i < n && p.normalize ? 1.f / p.den[s.row(p, p.h, h, r0 + i)] : 1.f;
        inv_den[i] = i < n ? inv : 0.f;
        dn[i] = i < n && has_norm ? -dot * inv : 0.f;
      }
    }
    __syncthreads();  // inv_den of every row
    if (v) store_rows<T, VT, kN>(smem, L::kV, vv, nullptr, tid);
    if (d) store_rows<T, VT, kN>(smem, L::kD, dv, inv_den, tid);
  };

  // Stage rows [r0, r0 + n) as 16-bit tiles (0 past n rows / m features / nv columns):
  //   q:  Q~ (C, kM), and (qt) (wq Q~)^T into the transposed tile
  //   k:  K~ (C, kM) with the key mask, and (kt) (wk K~)^T into the transposed tile
  //   v:  V (C, kN);   d: dO' (C, kN) and dn (C)
  // Row scalars must be loaded, and a barrier passed since the last read of these tiles.
  auto stage = [&](int r0, int n, bool q, bool qt, bool k, bool kt, bool v, bool d) {
    if (vec()) {
      stage_vec(r0, n, q, qt, k, kt, v, d);
      return;
    }
    for (int e = tid; e < kChunk * kM; e += kThreads) {
      const int i = e / kM, c = e % kM;
      const bool ok = i < n && c < m;
      if (q) {
        const float x = ok ? linear_simt::feature(p.feature_map, to_float(qh[int64_t(r0 + i) * p.q_row_stride + c])) * p.scale : 0.f;
        st16<T>(smem, L::kQ + QT::offset(i, c), x);
        if (qt) st16<T>(smem, L::kKt + L::KtTile::offset(c, i), x * wq[i]);
      }
      if (k) {
        // a padded key (kmul 0): 0 without a read, not 0 x its row (NaN where the row is)
        const float y = ok && kmul[i] != 0.f
                            ? linear_simt::feature(p.feature_map, to_float(kh[int64_t(r0 + i) * p.k_row_stride + c])) * kmul[i]
                            : 0.f;
        st16<T>(smem, L::kK + QT::offset(i, c), y);
        if (kt) st16<T>(smem, L::kKt + L::KtTile::offset(c, i), y * wk[i]);
      }
    }
    if (v) {
      for (int e = tid; e < kChunk * kN; e += kThreads) {
        const int i = e / kN, c = e % kN;
        const float x = i < n && c < nv && kmul[i] != 0.f ? to_float(vh[int64_t(r0 + i) * p.v_row_stride + c0 + c]) : 0.f;
        st16<T>(smem, L::kV + VT::offset(i, c), x);
      }
    }
    if (d) {  // one warp per row: the whole row's dout . out for dn
      for (int i = warp; i < kChunk; i += kWarps) {
        float dot = 0.f, inv = 1.f;
        if (i < n && p.normalize) {
          for (int c = lane; c < p.dim_v; c += 32) {
            dot += to_float(douth[int64_t(r0 + i) * p.do_row_stride + c]) *
                   to_float(outh[int64_t(r0 + i) * p.o_row_stride + c]);
          }
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
          inv = 1.f / p.den[s.row(p, p.h, h, r0 + i)];
        }
        for (int c = lane; c < kN; c += 32) {
          const float x = i < n && c < nv ? to_float(douth[int64_t(r0 + i) * p.do_row_stride + c0 + c]) * inv : 0.f;
          st16<T>(smem, L::kD + VT::offset(i, c), x);
        }
        if (lane == 0) dn[i] = i < n && has_norm ? -dot * inv : 0.f;
      }
    }
  };
  // The masked (C, C) product of the warp's rows: `lower` keeps j <= i (row i, column j; the
  // ascending sweep), else i >= j (row j, column i); + dn of the query index when add_dn, times
  // e^{g_i - g_j}; 0 past n.
  auto mask_cc = [&](float (&acc)[kChunk / 8][4], int n, bool lower, bool add_dn) {
    // the warp's two rows' g and epoch, read once (linear_simt::pair_weight, unrolled by hand)
    const float g_a = g[ra], g_b = g[rb], e_a = ep[ra], e_b = ep[rb];
#pragma unroll
    for (int t = 0; t < kChunk / 8; ++t) {
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const int r = x < 2 ? ra : rb, c = acc_col(t, lane, x);
        const int i = lower ? r : c, j = lower ? c : r;
        float val = 0.f;
        if (j <= i && i < n) {
          val = acc[t][x] + (add_dn ? dn[i] : 0.f);
          if (decay) {
            const float gr = x < 2 ? g_a : g_b, er = x < 2 ? e_a : e_b;
            val *= er == ep[c] ? expf(lower ? gr - g[c] : g[c] - gr) : 0.f;
          }
        }
        acc[t][x] = val;
      }
    }
  };
  // Scratch rows: acc (the warp's 16 rows x kCols) added at dst + (rows + r0 + r) * ld + col, for
  // rows < n and columns < ncols; returns this thread's share of sum_c acc * X[r][c] per row
  // (a, b) with X the 16-bit (C, kCols) tile at xoff (dG), when dot.
  auto scatter = [&](auto& acc, float* dst, int64_t rows, int ld, int n, int ncols, int r0, bool dot, uint32_t xoff,
                     auto tile_tag, float& da, float& db) {
    using XT = decltype(tile_tag);
    constexpr int kT = std::extent_v<std::remove_reference_t<decltype(acc)>>;
#pragma unroll
    for (int t = 0; t < kT; ++t) {
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const int r = x < 2 ? ra : rb, c = acc_col(t, lane, x);
        if (r < n && c < ncols) {
          atomicAdd(dst + (rows + r0 + r) * ld + c, acc[t][x]);
          if (dot) (x < 2 ? da : db) += acc[t][x] * ld16<T>(smem, xoff + XT::offset(r, c));
        }
      }
    }
  };
  auto add_dg = [&](int r0, int n, float da, float db, float sign) {
    da = quad_sum(da);
    db = quad_sum(db);
    if (lane % 4 == 0) {
      if (ra < n) atomicAdd(sc.dg + q_rows + r0 + ra, sign * da);
      if (rb < n) atomicAdd(sc.dg + q_rows + r0 + rb, sign * db);
    }
  };

  if constexpr (kMode == BwdMode::kWhole || kMode == BwdMode::kSegDq) {
  // the segment holding the sequence's last row adds the <dS_T, S_T> term of dG
  const bool last_seg = r_begin < r_end && r_end == s.len;
  // ---------------------------------------------------------------- dQ~_i = S_i dO'_i
  const float* s_in = state_at(p.init_state, p, b, h);
  if constexpr (kSeg) s_in = plan.state(p, b, h, p.causal ? seg : plan.n_seg);
  load_state<kM, kSeg>(Sf, z, s_in, p, c0, nv, has_norm);
  __syncthreads();
  float sigma = refresh_s16<T, L, kM>(smem, Sf, red);
  // pass 0 (kWhole, non-causal only): S, z over the whole sequence; pass 1: dQ~ (and, causal, S)
  for (int pass = p.causal || kSeg ? 1 : 0; pass < 2; ++pass) {
    for (int r0 = r_begin; r0 < r_end; r0 += kChunk) {
      const int n = min(kChunk, r_end - r0);
      // kSegDq: the state after the segment's last chunk is needed only for the dG_T term
      const bool want_dq = pass == 1;
      const bool want_update = pass == 0 || (p.causal && (!kSeg || r0 + kChunk < r_end || (last_seg && want_dg)));
      lane = opaque(lane);
      linear_simt::load_row_scalars(p, s, h, r0, n, g, wq, wk, kmul, ep);
      __syncthreads();
      const float egc = linear_simt::chunk_decay(wq, n);
      // K~ and V feed the causal dQ~ products and the update; (wk K~)^T only the update
      const bool kv = want_update || (want_dq && p.causal);
      stage(r0, n, want_dq && want_dg, false, kv, want_update, kv, want_dq);
      __syncthreads();
      if (want_dq) {
        float dq[kM / 8][4];
        zero(dq);
        mma_smem<T, VT, ST, kN, kM, false>(dq, sbase + L::kD, row_a, sbase + L::kS, lane);  // dO' S^T
        const float ea = p.causal ? wq[ra] : 1.f, eb = p.causal ? wq[rb] : 1.f;
        const float na = has_norm ? ea * dn[ra] : 0.f, nb = has_norm ? eb * dn[rb] : 0.f;
#pragma unroll
        for (int t = 0; t < kM / 8; ++t) {
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            const float zc = has_norm ? z[acc_col(t, lane, x)] : 0.f;
            dq[t][x] = dq[t][x] * (x < 2 ? ea : eb) * sigma + (x < 2 ? na : nb) * zc;
          }
        }
        if (p.causal) {
          float pm[kChunk / 8][4];
          zero(pm);
          mma_smem<T, VT, VT, kN, kChunk, false>(pm, sbase + L::kD, row_a, sbase + L::kV, lane);  // dO' V^T
          mask_cc(pm, n, true, has_norm);
          mma_reg<T, QT, kChunk, kM>(dq, pm, sbase + L::kK, lane);  // + P K~
        }
        float da = 0.f, db = 0.f;
        scatter(dq, sc.dq, q_rows, m, n, m, r0, want_dg, L::kQ, QT{}, da, db);
        if (want_dg) add_dg(r0, n, da, db, 1.f);
      }
      __syncthreads();  // every warp is done reading S16, z and the tiles
      if (want_update) {
        const float f = p.causal ? egc : 1.f;
        add_outer<T, L, kM>(Sf, sbase + L::kKt, sbase + L::kV, f, warp, lane);
        if (has_norm) {
          for (int c = tid; c < kM; c += kThreads) {  // z <- e^{gC} z + sum_j wk_j K~_j
            float acc = 0.f;
            for (int j = 0; j < n; ++j) acc += ld16<T>(smem, L::kKt + L::KtTile::offset(c, j));
            z[c] = f * z[c] + acc;
          }
        }
        __syncthreads();
        sigma = refresh_s16<T, L, kM>(smem, Sf, red);
      }
    }
  }
  // dG_T += <dS_T, S_T>: this tile's columns (and, tile 0, the normalizer column)
  if (want_dg && p.dfinal_state != nullptr && s.len > 0 && (!kSeg || last_seg)) {
    const int64_t base = (int64_t(b) * p.h + h) * int64_t(m) * p.dim_v_aug;
    float part = 0.f;
    for (int e = tid; e < m * nv; e += kThreads) {
      const int r = e / nv, c = e % nv;
      part += Sf[r * kN + c] * p.dfinal_state[base + int64_t(r) * p.dim_v_aug + c0 + c];
    }
    if (has_norm) {
      for (int r = tid; r < m; r += kThreads) part += z[r] * p.dfinal_state[base + int64_t(r) * p.dim_v_aug + p.dim_v];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
    if (lane == 0) atomicAdd(sc.dg + q_rows + s.len - 1, part);
  }
  __syncthreads();
  }  // the dQ~ sweep

  if constexpr (kMode != BwdMode::kSegDq) {
  // ---------------------------------------------------------------- dK~_j = U_j v'_j, dV_j = U_j^T K~_j
  float* U = Sf;
  float* uz = z;
  const float* u_in = state_at(p.dfinal_state, p, b, h);
  if constexpr (kMode == BwdMode::kSegU) u_in = nullptr;
  if constexpr (kMode == BwdMode::kSegDkv) u_in = plan.ustate(p, b, h, p.causal ? seg : plan.n_seg);
  load_state<kM, kSeg>(U, uz, u_in, p, c0, nv, has_norm);
  __syncthreads();
  float sigma_u = refresh_s16<T, L, kM>(smem, U, red);
  // the U update of rows [r0, r0 + n) with Q~, (wq Q~)^T, dO' and dn staged; f = e^{gC}
  auto update_u = [&](int n, float f) {
    add_outer<T, L, kM>(U, sbase + L::kKt, sbase + L::kD, f, warp, lane);
    if (has_norm) {
      for (int c = tid; c < kM; c += kThreads) {  // Uz <- e^{gC} Uz + sum_i wq_i Q~_i dn_i
        float acc = 0.f;
        for (int i = 0; i < n; ++i) acc += ld16<T>(smem, L::kKt + L::KtTile::offset(c, i)) * dn[i];
        uz[c] = f * uz[c] + acc;
      }
    }
    __syncthreads();
    // kSegU has no products with U: its 16-bit copy is never read
    if constexpr (kMode != BwdMode::kSegU) sigma_u = refresh_s16<T, L, kM>(smem, U, red);
  };
  // the first row of the last chunk of [r_begin, r_end) (below r_begin when it is empty)
  const int last = r_begin < r_end ? r_begin + (r_end - 1 - r_begin) / kChunk * kChunk : r_begin - kChunk;
  if constexpr (kMode == BwdMode::kSegU) {
    // the segment's own reverse state from 0: U <- e^{gC} U + (wq Q~)^T dO', descending
    // (non-causal: no decay, any order), then to the scratch for the reverse scan
    for (int r0 = last; r0 >= r_begin; r0 -= kChunk) {
      const int n = min(kChunk, r_end - r0);
      lane = opaque(lane);
      linear_simt::load_row_scalars(p, s, h, r0, n, g, wq, wk, kmul, ep);
      __syncthreads();
      stage(r0, n, true, true, false, false, false, true);
      __syncthreads();
      update_u(n, p.causal ? linear_simt::chunk_decay(wq, n) : 1.f);
    }
    store_state(plan.ustate(p, b, h, seg), U, uz, p, c0, nv, has_norm);
    return;
  }
  if (!kSeg && !p.causal) {  // U = dS_T + sum_i Q~_i dO'_i^T over the sequence
    for (int r0 = 0; r0 < s.len; r0 += kChunk) {
      const int n = min(kChunk, s.len - r0);
      lane = opaque(lane);
      linear_simt::load_row_scalars(p, s, h, r0, n, g, wq, wk, kmul, ep);
      __syncthreads();
      stage(r0, n, true, true, false, false, false, true);
      __syncthreads();
      update_u(n, 1.f);
    }
  }
  for (int r0 = last; r0 >= r_begin; r0 -= kChunk) {
    const int n = min(kChunk, r_end - r0);
    lane = opaque(lane);
    linear_simt::load_row_scalars(p, s, h, r0, n, g, wq, wk, kmul, ep);
    __syncthreads();
    stage(r0, n, p.causal, p.causal, true, false, true, p.causal);
    __syncthreads();
    const float fa = p.causal ? wk[ra] : 1.f, fb = p.causal ? wk[rb] : 1.f;
    {  // dK~ rows j
      float dk[kM / 8][4];
      zero(dk);
      mma_smem<T, VT, ST, kN, kM, false>(dk, sbase + L::kV, row_a, sbase + L::kS, lane);  // V U^T
#pragma unroll
      for (int t = 0; t < kM / 8; ++t) {
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const float u = has_norm ? uz[acc_col(t, lane, x)] : 0.f;
          dk[t][x] = (dk[t][x] * sigma_u + u) * (x < 2 ? fa : fb);
        }
      }
      if (p.causal) {
        float pm[kChunk / 8][4];
        zero(pm);
        mma_smem<T, VT, VT, kN, kChunk, false>(pm, sbase + L::kV, row_a, sbase + L::kD, lane);  // V dO'^T
        mask_cc(pm, n, false, has_norm);
        mma_reg<T, QT, kChunk, kM>(dk, pm, sbase + L::kQ, lane);  // + P1 Q~
      }
      float da = 0.f, db = 0.f;
      scatter(dk, sc.dk, kv_rows, m, n, m, r0, want_dg, L::kK, QT{}, da, db);
      if (want_dg) add_dg(r0, n, da, db, -1.f);
    }
    {  // dV rows j
      float dv[kN / 8][4];
      zero(dv);
      mma_smem<T, QT, ST, kM, kN, true>(dv, sbase + L::kK, row_a, sbase + L::kS, lane);  // K~ U
#pragma unroll
      for (int t = 0; t < kN / 8; ++t) {
#pragma unroll
        for (int x = 0; x < 4; ++x) dv[t][x] *= (x < 2 ? fa : fb) * sigma_u;
      }
      if (p.causal) {
        float pm[kChunk / 8][4];
        zero(pm);
        mma_smem<T, QT, QT, kM, kChunk, false>(pm, sbase + L::kK, row_a, sbase + L::kQ, lane);  // K~ Q~^T
        mask_cc(pm, n, false, false);
        mma_reg<T, VT, kChunk, kN>(dv, pm, sbase + L::kD, lane);  // + P2 dO'
      }
      float unused_a = 0.f, unused_b = 0.f;
      scatter(dv, sc.dv + c0, kv_rows, p.dim_v, n, nv, r0, false, 0u, VT{}, unused_a, unused_b);
    }
    __syncthreads();  // every warp is done reading U16, Uz and the tiles
    // kSegDkv: the reverse state past the segment's first chunk comes from the scan. The chunk's
    // decay is read here, not held across the products above (one register fewer: bf16 at
    // M = 128 spilled 8 bytes on sm_90a with it live)
    if (p.causal && (!kSeg || r0 > r_begin)) update_u(n, linear_simt::chunk_decay(wq, n));
  }
  __syncthreads();
  if (!kSeg && p.dinit_state != nullptr) store_state(state_at(p.dinit_state, p, b, h), U, uz, p, c0, nv, has_norm);
  }  // the dK~ / dV sweep
}

}  // namespace linear_tc
}  // namespace attn
