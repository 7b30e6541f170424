// The chunk-state backward of the tensor-core linear attention (fp16 / bf16, M <= 128): the
// forward's schedule (chunk_fwd_kernel.cuh) applied to the gradients, as flash-linear-attention's
// chunked backward does it. Launches (dispatch.cu):
//
//   chunk_prep_kernel       (normalize only) per row 1 / den and dn = -(dout . out) / den;
//   chunk_state_bwd_kernel  the forward's state walk again: S entering every chunk (and
//                           dG_T += <dS_T, S_T> for ddecay);
//   chunk_rev_kernel        the reverse walk: D at every chunk's end, D <- e^{gC} D + (wq Q~)^T dO'
//                           from dS_T, descending, in registers; D_0 is dinitial_state;
//   chunk_grad_kernel       every chunk at once, from S entering it and D at its end:
//     dQ~ = e^{g_i} (dO' S^T + dn z^T) + P K~,        P  = mask_{j<=i}(dO' V^T + dn) e^{g_i - g_j}
//     dK~ = e^{gC - g_j} (V D^T + Dz^T) + P1 Q~,      P1 = the transpose of P
//     dV  = e^{gC - g_j} K~ D + P2 dO',               P2 = mask_{i>=j}(K~ Q~^T) e^{g_i - g_j}
//   then the sequential backward's finalize_kernel (the feature map's derivative, the conversions)
//   and ddecay_kernel (dG's reverse running sum), on the same fp32 scratch the other backwards
//   add into with atomics (value tiles and GQA heads add up), with dG_i = Q~_i . dQ~_i -
//   K~_i . dK~_i per tile.
//
// The math is mma_bwd_kernel.cuh's, product for product; what changes is the schedule (no state
// update inside the gradient CTAs, no per-chunk 16-bit refresh of a slab in shared memory) and
// that every per-element weight (feature map, scale, key mask, 1 / den, decay) is applied to the
// fragments. Same 16-byte row requirement as the forward.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "common/linear_params.h"
#include "cuda/mma.cuh"
#include "linear/cuda/chunk_fwd_kernel.cuh"
#include "linear/cuda/mma_bwd_kernel.cuh"  // quad_sum

namespace attn {
namespace linear_tc {

// grid (plan.nt, H, B), kThreads threads: rows of sequence b's chunks c, c + nt, ...; two threads
// per row. inv / dn indexed like den.
template <typename T>
__global__ void __launch_bounds__(kThreads) chunk_prep_kernel(const BwdParams p, const ChunkPlan plan, float* inv,
                                                              float* dn) {
  const int h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x, half = tid % 2;
  const linear_simt::Seq s(p, b);
  for (int c = blockIdx.x; int64_t(c) * kChunk < s.len; c += plan.nt) {
    const int i = c * kChunk + tid / 2;
    float dot = 0.f;
    if (i < s.len) {
      const T* orow = static_cast<const T*>(p.o) + s.off(p.o_batch_stride, h, p.o_head_stride, i, p.o_row_stride);
      const T* drow = static_cast<const T*>(p.dout) + s.off(p.do_batch_stride, h, p.do_head_stride, i, p.do_row_stride);
      for (int col = half; col < p.dim_v; col += 2) dot += to_float(drow[col]) * to_float(orow[col]);
    }
    dot += __shfl_xor_sync(0xffffffffu, dot, 1);
    if (i < s.len && half == 0) {
      const int64_t row = s.row(p, p.h, h, i);
      const float r = 1.f / p.den[row];
      inv[row] = r;
      dn[row] = -dot * r;
    }
  }
}

template <int kM>
struct GradSmem {
  static_assert(kM == 64 || kM == 128, "feature-width buckets");
  using QTile = tc::SmemTile<kChunk, kM>;  // Q, K (kChunk, kM)
  using VTile = tc::SmemTile<kChunk, kN>;  // V, dout (kChunk, kN)
  using HTile = tc::SmemTile<kM, kN>;      // S entering the chunk, D at its end (kM, kN)
  static constexpr int kQ = 0, kK = kQ + QTile::kBytes, kV = kK + QTile::kBytes, kD = kV + VTile::kBytes;
  static constexpr int kS = kD + VTile::kBytes, kU = kS + HTile::kBytes;
  static constexpr int kZ = kU + HTile::kBytes;   // fp32 z (kM), then Dz (kM)
  static constexpr int kScal = kZ + 2 * kM * 4;
  static constexpr int kPart = kScal + int(sizeof(ChunkScalars));
  static constexpr int kBytes = kPart + int(sizeof(ScanPart));
};

// acc (16 x kCols) += A B: A the warp's 16-row fragments (kK / 16 k-steps), B (kK x kCols) from
// the tile at b starting at tile row brow0 (a multiple of 16), stored rows n / columns k (kTrans
// false: ldmatrix) or rows k / columns n (kTrans: ldmatrix.trans). xf(bf, kb, nb) may rewrite a B
// fragment: register r holds (k, k + 1) at column n with k = kb + 8 (r % 2), n = nb + 8 (r / 2),
// both counted in the tile (brow0 included).
template <typename T, typename BTile, int kK, int kCols, bool kTrans, typename Xf>
__device__ __forceinline__ void mma_ab(float (&acc)[kCols / 8][4], const uint32_t (&a)[kK / 16][4], uint32_t b, int lane,
                                       Xf&& xf, int brow0 = 0) {
  const uint32_t bo = kTrans ? BTile::lane_bt(0, lane) : BTile::lane_b(0, lane);
  const int k0 = kTrans ? brow0 : 0, n0 = kTrans ? 0 : brow0;
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
#pragma unroll
    for (int np = 0; np < kCols / 16; ++np) {
      uint32_t bf[4];
      if constexpr (kTrans) {
        tc::ldmatrix_x4_trans(bf, b + BTile::advance(bo, k0 + kk * 16, np * 16));
      } else {
        tc::ldmatrix_x4(bf, b + BTile::advance(bo, n0 + np * 16, kk * 16));
      }
      xf(bf, k0 + kk * 16 + 2 * (lane % 4), n0 + np * 16 + lane / 4);
      tc::mma_n16<T>(acc[2 * np], a[kk], bf);
    }
  }
}

// The same with A = P, the fp32 accumulators of an earlier (16 x kK) product, rounded to T.
template <typename T, typename BTile, int kK, int kCols, bool kTrans, typename Xf>
__device__ __forceinline__ void mma_pb(float (&acc)[kCols / 8][4], const float (&pm)[kK / 8][4], uint32_t b, int lane,
                                       Xf&& xf, int brow0 = 0) {
  using Ops = tc::TypeOps<T>;
  uint32_t a[kK / 16][4];
#pragma unroll
  for (int kb = 0; kb < kK / 16; ++kb) {
    a[kb][0] = Ops::pack(pm[2 * kb][0], pm[2 * kb][1]);
    a[kb][1] = Ops::pack(pm[2 * kb][2], pm[2 * kb][3]);
    a[kb][2] = Ops::pack(pm[2 * kb + 1][0], pm[2 * kb + 1][1]);
    a[kb][3] = Ops::pack(pm[2 * kb + 1][2], pm[2 * kb + 1][3]);
  }
  mma_ab<T, BTile, kK, kCols, kTrans>(acc, a, b, lane, xf, brow0);
}

// The warp's 16-row A fragments of a tile (kK columns): a[kk][0] (row g, columns kk 16 + 2c, + 1),
// [1] (row g + 8), [2] (row g, columns + 8), [3] (row g + 8, columns + 8); then xf(a, f) with f
// = kk 16 + 2c, the first column.
template <typename ATile, int kK, typename Xf>
__device__ __forceinline__ void load_a(uint32_t (&a)[kK / 16][4], uint32_t base, int row0, int lane, Xf&& xf) {
  const uint32_t ao = ATile::lane_a(row0, lane);
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    tc::ldmatrix_x4(a[kk], base + ATile::advance(ao, 0, kk * 16));
    xf(a[kk], kk * 16 + 2 * (lane % 4));
  }
}

// Which gradients a chunk_grad_kernel launch computes: dQ~ (with its dG share), or dK~ and dV
// (with theirs). Two launches, not one kernel doing all three: the three products' accumulators
// and operand fragments in one kernel spilled (255 registers, 272 bytes at M = 128).
enum class GradPart : int { kDq = 0, kDkv = 1 };

// grid (value tiles x plan.nt, H, B), kThreads threads, GradSmem<kM>::kBytes bytes; sp: the
// forward states, up: the reverse ones (same nt, tiles, slots; inv / dn in sp). Scratch zeroed.
template <typename T, int kM, GradPart kPart>
__global__ void __launch_bounds__(kThreads, 1) chunk_grad_kernel(const BwdParams p, const ChunkPlan sp, const ChunkPlan up,
                                                              const linear_simt::BwdScratch scr) {
  constexpr bool kDq = kPart == GradPart::kDq;
  using L = GradSmem<kM>;
  using QT = typename L::QTile;
  using VT = typename L::VTile;
  using HT = typename L::HTile;
  const int tile = int(blockIdx.x) % sp.tiles, c_first = int(blockIdx.x) / sp.tiles;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (p.h / p.h_k);
  const int tid = threadIdx.x, warp = tid / 32, row_a = 16 * warp;
  int lane = tid % 32;
  const int m = p.d, c0 = tile * kN, nv = min(kN, p.dim_v - c0);
  const linear_simt::Seq s(p, b);
  ATTN_EXTERN_SMEM(smem);
  const uint32_t sbase = tc::smem_u32(smem);
  float* z = reinterpret_cast<float*>(smem + L::kZ);
  float* uz = z + kM;
  ChunkScalars* sc = reinterpret_cast<ChunkScalars*>(smem + L::kScal);
  ScanPart* part = reinterpret_cast<ScanPart*>(smem + L::kPart);
  const bool causal = p.causal, decay = p.decay != nullptr, masked = p.key_mask != nullptr;
  const bool has_norm = p.normalize && tile == 0, want_dg = decay && p.ddecay != nullptr;
  const FeatureMap fm = p.feature_map;
  const int64_t q_rows = (int64_t(s.bt) * p.h + h) * p.seq_head_stride + s.row0;     // dQ~, dG rows
  const int64_t kv_rows = (int64_t(s.bt) * p.h_k + hk) * p.seq_head_stride + s.row0;  // dK~, dV rows

#pragma unroll 1
  for (int c = c_first; int64_t(c) * kChunk < s.len; c += sp.nt) {
    const int r0 = c * kChunk, n = min(kChunk, s.len - r0);
    lane = opaque(lane);
    const int ra = row_a + lane / 4, rb = ra + 8;  // this thread's two accumulator rows
    const T* qh = static_cast<const T*>(p.q) + s.off(p.q_batch_stride, h, p.q_head_stride, r0, p.q_row_stride);
    const T* kh = static_cast<const T*>(p.k) + s.off(p.k_batch_stride, hk, p.k_head_stride, r0, p.k_row_stride);
    const T* vh = static_cast<const T*>(p.v) + s.off(p.v_batch_stride, hk, p.v_head_stride, r0, p.v_row_stride) + c0;
    const T* dh =
        static_cast<const T*>(p.dout) + s.off(p.do_batch_stride, h, p.do_head_stride, r0, p.do_row_stride) + c0;
    const int64_t s_slot = causal ? sp.slot(p, s, b, h, c) : sp.final_slot(p, b, h);
    const int64_t u_slot = causal ? up.slot(p, s, b, h, c) : up.final_slot(p, b, h);

    // operands: Q (dQ~: for dG only), dout and the part's state (dQ~: S, dK~ dV: D) at once; K
    // and V too unless a key mask decides which rows to read
    if (!kDq || want_dg) copy_rows<kM>(sbase + L::kQ, qh, p.q_row_stride, n, m, nullptr, tid);
    copy_rows<kN>(sbase + L::kD, dh, p.do_row_stride, n, nv, nullptr, tid);
    {
      const ChunkPlan& pl = kDq ? sp : up;
      const T* hs = static_cast<const T*>(pl.h) + ((kDq ? s_slot : u_slot) * pl.tiles + tile) * (kM * kN);
      constexpr int kVecs = kM * kN / 8;
#pragma unroll
      for (int j = 0; j < kVecs / kThreads; ++j) {
        const int idx = tid + j * kThreads, r = idx / (kN / 8), cc = idx % (kN / 8) * 8;
        tc::cp_async16(sbase + (kDq ? L::kS : L::kU) + HT::offset(r, cc), hs + r * kN + cc, true);
      }
    }
    if (has_norm) {
      for (int r = tid; r < kM; r += kThreads) {
        if (kDq) z[r] = sp.z[s_slot * kM + r];
        if (!kDq) uz[r] = up.z[u_slot * kM + r];
      }
    }
    if (!masked) {
      copy_rows<kM>(sbase + L::kK, kh, p.k_row_stride, n, m, nullptr, tid);
      copy_rows<kN>(sbase + L::kV, vh, p.v_row_stride, n, nv, nullptr, tid);
    }
    const RowIn in = row_inputs(p, sp, s, h, r0, n, tid);
    chunk_scalars(p, n, in, sc, part, tid);
    if (masked) {
      copy_rows<kM>(sbase + L::kK, kh, p.k_row_stride, n, m, sc->kmul, tid);
      copy_rows<kN>(sbase + L::kV, vh, p.v_row_stride, n, nv, sc->kmul, tid);
    }
    tc::cp_async_commit();
    const float sigma_s = kDq ? sp.sigma[s_slot * sp.tiles + tile] : 1.f;
    const float sigma_u = kDq ? 1.f : up.sigma[u_slot * up.tiles + tile];
    tc::cp_async_wait<0>();
    __syncthreads();

    const float* inv = sc->inv;
    const float* kmul = sc->kmul;
    const float* dn = sc->dn;
    // fragment transforms (mma_ab's (k, n) of register r: k = kb + 8 (r % 2), n = nb + 8 (r / 2))
    auto xf_none = [](uint32_t(&)[4], int, int) {};
    // K~ (k = key, n = feature): phi(k) * kmul, 0 past M
    auto xf_k = [&](uint32_t(&bf)[4], int kb, int nb) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int k = kb + 8 * (r % 2), f = nb + 8 * (r / 2);
        const float in_f = f < m ? 1.f : 0.f;
        bf[r] = feature_pair<T>(bf[r], fm, kmul[k] * in_f, kmul[k + 1] * in_f);
      }
    };
    // Q~ (k = row, n = feature): scale * phi(q), 0 past M
    auto xf_q = [&](uint32_t(&bf)[4], int, int nb) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float w = nb + 8 * (r / 2) < m ? p.scale : 0.f;
        bf[r] = feature_pair<T>(bf[r], fm, w, w);
      }
    };
    // Q~^T (k = feature, n = row): the same elements, the feature index on k
    auto xf_qt = [&](uint32_t(&bf)[4], int kb, int) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float w = kb + 8 * (r % 2) < m ? p.scale : 0.f;
        bf[r] = feature_pair<T>(bf[r], fm, w, w);
      }
    };
    // dO' (k = row, n = value column): dout / den
    auto xf_d = [&](uint32_t(&bf)[4], int kb, int) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int k = kb + 8 * (r % 2);
        bf[r] = feature_pair<T>(bf[r], FeatureMap::kIdentity, inv[k], inv[k + 1]);
      }
    };
    // dO'^T (k = value column, n = row)
    auto xf_dt = [&](uint32_t(&bf)[4], int, int nb) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float w = inv[nb + 8 * (r / 2)];
        bf[r] = feature_pair<T>(bf[r], FeatureMap::kIdentity, w, w);
      }
    };
    // a (16, kHalf) slice, columns [col0, col0 + kHalf), of the (C, C) product of the warp's rows,
    // masked to j <= i (lower: row i, column j) or i >= j (row j, column i), + dn of the query
    // index (add_dn), times e^{g_i - g_j}; 0 past n. The (C, C) products go by halves: a whole
    // one live beside the (16, M) accumulator spilled at M = 128.
    constexpr int kHalf = kChunk / 2;
    auto mask_cc = [&](float (&acc)[kHalf / 8][4], int col0, bool lower, bool add_dn) {
      const float g_a = sc->g[ra], g_b = sc->g[rb], e_a = sc->ep[ra], e_b = sc->ep[rb];
#pragma unroll
      for (int t = 0; t < kHalf / 8; ++t) {
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const int r = x < 2 ? ra : rb, cl = col0 + acc_col(t, lane, x);
          const int i = lower ? r : cl, j = lower ? cl : r;
          float val = 0.f;
          if (j <= i && i < n) {
            val = acc[t][x] + (add_dn ? dn[i] : 0.f);
            if (decay) {
              const float gr = x < 2 ? g_a : g_b, er = x < 2 ? e_a : e_b;
              val *= er == sc->ep[cl] ? expf(lower ? gr - sc->g[cl] : sc->g[cl] - gr) : 0.f;
            }
          }
          acc[t][x] = val;
        }
      }
    };
    // acc's rows < n, columns < ncols, added into dst + (rows + r0 + row) * ld + column
    auto scatter = [&](auto& acc, float* dst, int64_t rows, int64_t ld, int ncols) {
      constexpr int kT = std::extent_v<std::remove_reference_t<decltype(acc)>>;
#pragma unroll
      for (int t = 0; t < kT; ++t) {
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const int r = x < 2 ? ra : rb, cl = acc_col(t, lane, x);
          if (r < n && cl < ncols) atomicAdd(dst + (rows + r0 + r) * ld + cl, acc[t][x]);
        }
      }
    };
    // this thread's share of sum_f acc[row][f] X[row][f] for its two rows, X in A fragments of the
    // same rows (n-tile 2 kk + 1 of the accumulators is a[kk][2..3]), summed over the quad
    auto row_dots = [&](const float (&acc)[kM / 8][4], const uint32_t (&xa)[kM / 16][4], float& da, float& db) {
      using Ops = tc::TypeOps<T>;
      da = db = 0.f;
#pragma unroll
      for (int kk = 0; kk < kM / 16; ++kk) {
        const float2 a0 = Ops::unpack(xa[kk][0]), a1 = Ops::unpack(xa[kk][1]);
        const float2 a2 = Ops::unpack(xa[kk][2]), a3 = Ops::unpack(xa[kk][3]);
        da += acc[2 * kk][0] * a0.x + acc[2 * kk][1] * a0.y + acc[2 * kk + 1][0] * a2.x + acc[2 * kk + 1][1] * a2.y;
        db += acc[2 * kk][2] * a1.x + acc[2 * kk][3] * a1.y + acc[2 * kk + 1][2] * a3.x + acc[2 * kk + 1][3] * a3.y;
      }
      da = quad_sum(da);
      db = quad_sum(db);
    };
    auto add_dg = [&](float da, float db, float sign) {
      if (lane % 4 == 0) {
        if (ra < n) atomicAdd(scr.dg + q_rows + r0 + ra, sign * da);
        if (rb < n) atomicAdd(scr.dg + q_rows + r0 + rb, sign * db);
      }
    };
    const float ea = causal ? sc->wq[ra] : 1.f, eb = causal ? sc->wq[rb] : 1.f;  // rows as i
    const float fa = causal ? sc->wk[ra] : 1.f, fb = causal ? sc->wk[rb] : 1.f;  // rows as j

    // ------------------------------------------------ dQ~ (rows i)
    if constexpr (kDq) {
      uint32_t da_[kN / 16][4];  // dO' = dout / den of the warp's rows
      load_a<VT, kN>(da_, sbase + L::kD, row_a, lane, [&](uint32_t(&a)[4], int) {
        a[0] = feature_pair<T>(a[0], FeatureMap::kIdentity, inv[ra], inv[ra]);
        a[2] = feature_pair<T>(a[2], FeatureMap::kIdentity, inv[ra], inv[ra]);
        a[1] = feature_pair<T>(a[1], FeatureMap::kIdentity, inv[rb], inv[rb]);
        a[3] = feature_pair<T>(a[3], FeatureMap::kIdentity, inv[rb], inv[rb]);
      });
      float dq[kM / 8][4];
      zero(dq);
      mma_ab<T, HT, kN, kM, false>(dq, da_, sbase + L::kS, lane, xf_none);  // dO' S^T
      const float na = has_norm ? ea * dn[ra] : 0.f, nb_ = has_norm ? eb * dn[rb] : 0.f;
#pragma unroll
      for (int t = 0; t < kM / 8; ++t) {
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const float zc = has_norm ? z[acc_col(t, lane, x)] : 0.f;
          dq[t][x] = dq[t][x] * (x < 2 ? ea : eb) * sigma_s + (x < 2 ? na : nb_) * zc;
        }
      }
      if (causal) {
#pragma unroll 1
        for (int c1 = 0; c1 < kChunk; c1 += kHalf) {  // keys j in [c1, c1 + kHalf)
          lane = opaque(lane);
          float pm[kHalf / 8][4];
          zero(pm);
          mma_ab<T, VT, kN, kHalf, false>(pm, da_, sbase + L::kV, lane, xf_none, c1);  // dO' V^T
          mask_cc(pm, c1, true, has_norm);
          mma_pb<T, QT, kHalf, kM, true>(dq, pm, sbase + L::kK, lane, xf_k, c1);  // + P K~
        }
      }
      scatter(dq, scr.dq, q_rows, m, m);
      if (want_dg) {
        uint32_t qa[kM / 16][4];
        load_a<QT, kM>(qa, sbase + L::kQ, row_a, lane, [&](uint32_t(&a)[4], int f) {
          const float w0 = f < m ? p.scale : 0.f, w8 = f + 8 < m ? p.scale : 0.f;
          a[0] = feature_pair<T>(a[0], fm, w0, w0);
          a[1] = feature_pair<T>(a[1], fm, w0, w0);
          a[2] = feature_pair<T>(a[2], fm, w8, w8);
          a[3] = feature_pair<T>(a[3], fm, w8, w8);
        });
        float da, db;
        row_dots(dq, qa, da, db);
        add_dg(da, db, 1.f);
      }
    }
    // K~ = phi(k) * kmul of the warp's rows (as j), 0 past M: for dV's K~ D and K~ Q~^T, and
    // loaded again for dG's K~ . dK~ (kept live across dK~'s products it spilled)
    auto xf_ka = [&](uint32_t(&a)[4], int f) {
      const float in0 = f < m ? 1.f : 0.f, in8 = f + 8 < m ? 1.f : 0.f;
      a[0] = feature_pair<T>(a[0], fm, kmul[ra] * in0, kmul[ra] * in0);
      a[1] = feature_pair<T>(a[1], fm, kmul[rb] * in0, kmul[rb] * in0);
      a[2] = feature_pair<T>(a[2], fm, kmul[ra] * in8, kmul[ra] * in8);
      a[3] = feature_pair<T>(a[3], fm, kmul[rb] * in8, kmul[rb] * in8);
    };
    // ------------------------------------------------ dV (rows j)
    if constexpr (!kDq) {
      lane = opaque(lane);  // each product group derives its own addresses (fewer live registers)
      uint32_t ka[kM / 16][4];
      load_a<QT, kM>(ka, sbase + L::kK, row_a, lane, xf_ka);
      float dv[kN / 8][4];
      zero(dv);
      mma_ab<T, HT, kM, kN, true>(dv, ka, sbase + L::kU, lane, xf_none);  // K~ D
#pragma unroll
      for (int t = 0; t < kN / 8; ++t) {
#pragma unroll
        for (int x = 0; x < 4; ++x) dv[t][x] *= (x < 2 ? fa : fb) * sigma_u;
      }
      if (causal) {
#pragma unroll 1
        for (int c1 = 0; c1 < kChunk; c1 += kHalf) {  // queries i in [c1, c1 + kHalf)
          lane = opaque(lane);
          float pm[kHalf / 8][4];
          zero(pm);
          mma_ab<T, QT, kM, kHalf, false>(pm, ka, sbase + L::kQ, lane, xf_qt, c1);  // K~ Q~^T
          mask_cc(pm, c1, false, false);
          mma_pb<T, VT, kHalf, kN, true>(dv, pm, sbase + L::kD, lane, xf_d, c1);  // + P2 dO'
        }
      }
      scatter(dv, scr.dv + c0, kv_rows, p.dim_v, nv);
    }
    // ------------------------------------------------ dK~ (rows j)
    if constexpr (!kDq) {
      lane = opaque(lane);
      uint32_t va[kN / 16][4];
      load_a<VT, kN>(va, sbase + L::kV, row_a, lane, [](uint32_t(&)[4], int) {});
      float dk[kM / 8][4];
      zero(dk);
      mma_ab<T, HT, kN, kM, false>(dk, va, sbase + L::kU, lane, xf_none);  // V D^T
#pragma unroll
      for (int t = 0; t < kM / 8; ++t) {
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const float u = has_norm ? uz[acc_col(t, lane, x)] : 0.f;
          dk[t][x] = (dk[t][x] * sigma_u + u) * (x < 2 ? fa : fb);
        }
      }
      if (causal) {
#pragma unroll 1
        for (int c1 = 0; c1 < kChunk; c1 += kHalf) {  // queries i in [c1, c1 + kHalf)
          lane = opaque(lane);
          float pm[kHalf / 8][4];
          zero(pm);
          mma_ab<T, VT, kN, kHalf, false>(pm, va, sbase + L::kD, lane, xf_dt, c1);  // V dO'^T
          mask_cc(pm, c1, false, has_norm);
          mma_pb<T, QT, kHalf, kM, true>(dk, pm, sbase + L::kQ, lane, xf_q, c1);  // + P1 Q~
        }
      }
      scatter(dk, scr.dk, kv_rows, m, m);
      if (want_dg) {
        uint32_t ka[kM / 16][4];
        load_a<QT, kM>(ka, sbase + L::kK, row_a, lane, xf_ka);
        float da, db;
        row_dots(dk, ka, da, db);
        add_dg(da, db, -1.f);
      }
    }
    __syncthreads();  // the next chunk's copies overwrite the tiles and scalars
  }
}

}  // namespace linear_tc
}  // namespace attn
