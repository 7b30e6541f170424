// The delta rule's chunk-parallel backward with per-key gates (KDA, and GLA's plain write u = v:
// b = 1 in U, A = 0, W = 0, so T = I, Dm = 0 and no W term; bf16 or fp16): the schedule of
// delta_chunk_bwd_kernel.cuh with a decay per key channel, w_d(i, j) = prod_{j < t <= i} a_td.
// delta_chunk_prep_key_kernel (keeping T, A / b and the row factors) and the per-channel state walk
// recompute every chunk's entering state h0 and u; the reverse walk (its per-channel decay) leaves
// du and dh1 per chunk; then, per chunk:
//
//   delta_chunk_dlocal_key_kernel  grid (slots, H_v, value tiles): du_loc = P^T dO, P the prep's
//                                  stored scores.
//   delta_chunk_dscal_key_kernel   grid (slots, H_v): db = T^T du (dv = Diag(b) db), S1 = dO u^T
//                                  and S2 = db u^T summed over the value tiles, dbeta; stores
//                                  M1 = lower(S1) and Dm = -Diag(b) strictly-lower(S2), 16-bit.
//   delta_chunk_dzyx_kernel        grid (slots, H_v): Z = dO h0^T, Y = db h0^T and X = u dh1^T
//                                  (16-bit), and <h0, dh1> per key channel.
//   delta_chunk_dkey_kernel        grid (slots, H_v): per key channel d, with w_d(i, j) the decay:
//     dq^_i = w(i, -1) Z_i + sum_{j <= i} M1_ij w(i, j) k^_j
//     same_i = sum_{j < i} Dm_ij w(i, j) k^_j - b_i w(i, -1) Y_i
//     opp_j  = sum_{i >= j} (M1_ij q^_i + Dm_ij k^_i) w(i, j) + w(n-1, j) X_j,   dk^ = same + opp
//     dG_i   = q^_i dq^_i + k^_i (same_i - opp_i)
//              (+ on the last row: sum_j k^_j w(n-1, j) X_j + w(n-1, -1) <h0, dh1>)
//                                  the pairs across the chunk's 16-row blocks on the tensor cores
//                                  (the prep's split of the decay, below), each block's own pairs
//                                  per channel on the CUDA cores as running products (exact
//                                  through a zero factor); then the log-gates' gradient per
//                                  channel, dG summed from the chunk's end back to each row,
//                                  stopping at a zero factor (whose own gate gets 0: the
//                                  derivative of its exp in float32), and the L2 norm's chain
//                                  rule into float32 dq / dk (atomics: a GVA group).
//
// The decomposition, checked against autograd of the float64 recurrence, is
// tests/cuda_emu/delta_chunk_torch.py's _chunk_bwd_key.
#pragma once

#include "linear/cuda/delta_chunk_bwd_kernel.cuh"

namespace attn {
namespace delta_chunk {

// ------------------------------------------------------------------------------ du_loc
template <typename T>
__global__ void __launch_bounds__(kThreads) delta_chunk_dlocal_key_kernel(const DeltaBwdParams p,
                                                                          const DeltaChunkPlan plan) {
  ATTN_EXTERN_SMEM(smem);
  const uint32_t sb = tc::smem_u32(smem);
  const int64_t x = blockIdx.x;
  const int hv = blockIdx.y, c0 = blockIdx.z * kBV;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const ChunkAt at = chunk_at(p, plan, x);
  const int n = at.n;
  if (n == 0) return;
  const int vp = plan.vp();
  const int64_t hs = int64_t(hv) * plan.slots + x;
  const T* doh = head_rows<T>(p.dout, p.do_batch_stride, p.do_head_stride, at.b, hv) + at.row * p.do_row_stride;
  tc::load_tile_async<kC, kBV, kThreads, T>(sb, doh + c0, p.do_row_stride, n, p.dim_v - c0, tid);
  tc::cp_async_commit();
  // P^T: rows j (keys) of warp w, columns i, from the stored scores (masked there)
  const float* sc = plan.sc + hs * kC * kC;
  float s[kC / 8][4];
#pragma unroll
  for (int t = 0; t < kC / 8; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[t][e] = sc[acc_col(t, lane, e) * kC + acc_row(16 * warp, lane, e)];
  }
  tc::cp_async_wait<0>();
  __syncthreads();
  float acc[kBV / 8][4];
  linear_tc::zero(acc);
  mma_reg_split<T, kBV>(acc, s, sb, lane);  // P^T split hi + lo, as the outputs' P
  T* du = static_cast<T*>(plan.du) + hs * kC * vp + c0;
#pragma unroll
  for (int t = 0; t < kBV / 8; ++t) {
    const int j = acc_row(16 * warp, lane, 0), c = acc_col(t, lane, 0);
    st_pair(du + int64_t(j) * vp + c, acc[t][0], acc[t][1]);
    st_pair(du + int64_t(j + 8) * vp + c, acc[t][2], acc[t][3]);
  }
}

// ------------------------------------------------------------------------------ db, dv, dbeta
template <int kK>
struct DscalKeySmem {
  using KTile = tc::SmemTile<kC, kK>;   // K^ w(i, -1)
  using TTile = tc::SmemTile<kC, kC>;   // T
  using CTile = tc::SmemTile<kC, kBV>;  // u, du, dO, V
  using HTile = tc::SmemTile<kK, kBV>;  // h0, dh1
  static constexpr uint32_t kKB = 0, kT = KTile::kBytes, kH0 = kT + TTile::kBytes, kDH = kH0 + HTile::kBytes,
                            kU = kDH + HTile::kBytes, kDU = kU + CTile::kBytes, kDO = kDU + CTile::kBytes,
                            kV = kDO + CTile::kBytes, kF = kV + CTile::kBytes;
  static constexpr int kLd = kC + 1;
  // floats: NK, beta, dbeta's value-tile partials; S1, S2 (padded rows)
  static constexpr int kBytes = int(kF) + (3 * kC + 2 * kC * kLd) * 4;
};

template <typename T, int kK>
__global__ void __launch_bounds__(kThreads) delta_chunk_dscal_key_kernel(const DeltaBwdParams p,
                                                                         const DeltaChunkPlan plan) {
  using L = DscalKeySmem<kK>;
  using KTile = typename L::KTile;
  using TTile = typename L::TTile;
  using CTile = typename L::CTile;
  using HTile = typename L::HTile;
  constexpr int kLd = L::kLd;
  ATTN_EXTERN_SMEM(smem);
  const uint32_t sb = tc::smem_u32(smem);
  float* NK = reinterpret_cast<float*>(smem + L::kF);
  float* B = NK + kC;
  float* PB = B + kC;
  float* Sm = PB + kC;   // S1
  float* S2 = Sm + kC * kLd;

  const int64_t x = blockIdx.x;
  const int hv = blockIdx.y, hk = hv / (p.h_v / p.h_k);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const ChunkAt at = chunk_at(p, plan, x);
  const int n = at.n;
  if (n == 0) return;
  const int K = p.dim_k, V = p.dim_v, vp = plan.vp();
  const int64_t hs = int64_t(hv) * plan.slots + x;
  const int64_t side = (int64_t(at.b) * p.h_v + hv) * p.s + at.row;

  const T* kh = head_rows<T>(p.k, p.k_batch_stride, p.k_head_stride, at.b, hk) + at.row * p.k_row_stride;
  const T* vh = head_rows<T>(p.v, p.v_batch_stride, p.v_head_stride, at.b, hv) + at.row * p.v_row_stride;
  const T* doh = head_rows<T>(p.dout, p.do_batch_stride, p.do_head_stride, at.b, hv) + at.row * p.do_row_stride;
  T* dvh = static_cast<T*>(p.dv) + int64_t(at.b) * p.dv_batch_stride + int64_t(hv) * p.dv_head_stride +
           at.row * p.dv_row_stride;
  tc::load_tile_async<kC, kK, kThreads, T>(sb + L::kKB, kh, p.k_row_stride, n, K, tid);
  tc::load_tile_async<kC, kC, kThreads, T>(sb + L::kT, static_cast<const T*>(plan.t) + hs * kC * kC, kC, kC, kC, tid);
  tc::cp_async_commit();
  if (tid < kC) {  // b (1 for the plain write, whose U is V)
    NK[tid] = plan.scal[hs * kScalars + 2 * kC + tid];
    B[tid] = tid < n ? (p.plain ? 1.f : delta_cuda::load_side(p.beta_dt, p.beta, side + tid)) : 0.f;
  }
#pragma unroll
  for (int t = 0; t < kC / 8; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = acc_row(16 * warp, lane, e), j = acc_col(t, lane, e);
      Sm[i * kLd + j] = 0.f;
      S2[i * kLd + j] = 0.f;
    }
  }
  tc::cp_async_wait<0>();
  __syncthreads();
  // K^ w(i, -1) in place: thread d walks its channel's gate factors from the chunk's start
  if (tid < kK) {
    const int d = tid;
    float e = 1.f;
    for (int i = 0; i < kC; ++i) {
      e *= i < n && d < K ? expf(delta_cuda::load_side(p.gate_dt, p.gate, (side + i) * K + d)) : 1.f;
      const float kv = linear_tc::ld16<T>(smem, L::kKB + KTile::offset(i, d));
      linear_tc::st16<T>(smem, L::kKB + KTile::offset(i, d), kv * NK[i] * e);
    }
  }
  float pb[2] = {0.f, 0.f};
  const int r0 = acc_row(16 * warp, lane, 0);
  __syncthreads();

#pragma unroll 1
  for (int c0 = 0; c0 < vp; c0 += kBV) {
    const int lane = linear_tc::opaque(threadIdx.x % 32), tid = linear_tc::opaque(int(threadIdx.x));
    load_value_tiles<T, L, kK>(sb, plan, hs, c0, doh + c0, p.do_row_stride, n, V - c0, tid);
    tc::load_tile_async<kC, kBV, kThreads, T>(sb + L::kV, vh + c0, p.v_row_stride, n, V - c0, tid);
    tc::cp_async_commit();
    tc::cp_async_wait<0>();
    __syncthreads();
    {
      // (K^ w) h0 and db = T^T du: dbeta's -db . (K^ w h0) and db . v, dv, S2
      float y[kBV / 8][4];
      linear_tc::zero(y);
      linear_tc::mma_smem<T, KTile, HTile, kK, kBV, true>(y, sb + L::kKB, 16 * warp, sb + L::kH0, lane);
      float db[kBV / 8][4];
      t_transpose_du<T, TTile, CTile>(db, sb + L::kT, sb + L::kDU, warp, lane);
#pragma unroll
      for (int t = 0; t < kBV / 8; ++t) {
#pragma unroll
        for (int e = 0; e < 4; ++e) pb[e / 2] -= db[t][e] * y[t][e];
      }
      row_dots<T, CTile>(pb, db, smem, L::kV, r0, lane);
      store_dv<T, CTile>(db, B, sb + L::kV, dvh + c0, p.dv_row_stride, n, V - c0, warp, lane);
      add_db_ut<T, CTile>(S2, db, sb + L::kU, warp, lane);
    }
    add_do_ut<T, CTile>(Sm, sb + L::kDO, sb + L::kU, warp, lane);  // S1 += dO u^T
    __syncthreads();  // the next value tile's copies overwrite these tiles
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) pb[half] += __shfl_xor_sync(0xffffffffu, pb[half], o);
  }
  if (lane % 4 == 0) {
    PB[r0] = pb[0];
    PB[r0 + 8] = pb[1];
  }
  __syncthreads();

  // M1 = lower(S1) and Dm = -Diag(b) strictly-lower(S2), 16-bit, for the dkey kernel; dbeta's A
  // term (the plain write: no A, Dm = 0, and beta unused: dbeta = 0)
  T* mm = static_cast<T*>(plan.mm) + hs * 3 * kC * kC;
  const float dm = p.plain ? 0.f : -1.f;
  for (int e = tid; e < kC * kC; e += kThreads) {
    const int i = e / kC, j = e % kC;
    mm[e] = from_float<T>(j <= i && i < n ? Sm[i * kLd + j] : 0.f);
    mm[kC * kC + e] = from_float<T>(j < i && i < n ? dm * B[i] * S2[i * kLd + j] : 0.f);
  }
  if (tid < n && p.dbeta != nullptr) {
    const float* aa = plan.aa + hs * kC * kC + tid * kC;
    float acc = PB[tid];
    for (int j = 0; j < tid; ++j) acc -= S2[tid * kLd + j] * aa[j];
    store_side(p.beta_dt, p.dbeta, side + tid, p.plain ? 0.f : acc);
  }
}

// ------------------------------------------------------------------------------ Z, Y, X
template <int kK>
struct DzyxSmem {
  using TTile = tc::SmemTile<kC, kC>;   // T
  using CTile = tc::SmemTile<kC, kBV>;  // u, du, dO
  using HTile = tc::SmemTile<kK, kBV>;  // h0, dh1
  static constexpr uint32_t kT = 0, kH0 = TTile::kBytes, kDH = kH0 + HTile::kBytes, kU = kDH + HTile::kBytes,
                            kDU = kU + CTile::kBytes, kDO = kDU + CTile::kBytes;
  static constexpr int kBytes = int(kDO + CTile::kBytes);
};

// A warp's 16 rows of a (kC, kK) accumulator product, 16-bit to rows of dst (stride kK).
template <typename T, int kK>
__device__ __forceinline__ void store_rows(T* dst, const float (&acc)[kK / 8][4], int warp, int lane) {
#pragma unroll
  for (int t = 0; t < kK / 8; ++t) {
    const int i = acc_row(16 * warp, lane, 0), c = acc_col(t, lane, 0);
    st_pair(dst + i * kK + c, acc[t][0], acc[t][1]);
    st_pair(dst + (i + 8) * kK + c, acc[t][2], acc[t][3]);
  }
}

template <typename T, int kK>
__global__ void __launch_bounds__(kThreads) delta_chunk_dzyx_kernel(const DeltaBwdParams p, const DeltaChunkPlan plan) {
  using L = DzyxSmem<kK>;
  using TTile = typename L::TTile;
  using CTile = typename L::CTile;
  using HTile = typename L::HTile;
  ATTN_EXTERN_SMEM(smem);
  const uint32_t sb = tc::smem_u32(smem);
  const int64_t x = blockIdx.x;
  const int hv = blockIdx.y;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const ChunkAt at = chunk_at(p, plan, x);
  const int n = at.n;
  if (n == 0) return;
  const int V = p.dim_v, vp = plan.vp();
  const int64_t hs = int64_t(hv) * plan.slots + x;
  const T* doh = head_rows<T>(p.dout, p.do_batch_stride, p.do_head_stride, at.b, hv) + at.row * p.do_row_stride;
  T* zyx = static_cast<T*>(plan.zyx) + hs * 3 * kC * kK;
  tc::load_tile_async<kC, kC, kThreads, T>(sb + L::kT, static_cast<const T*>(plan.t) + hs * kC * kC, kC, kC, kC, tid);

  // Z = dO h0^T and X = u dh1^T, <h0, dh1> per key row
  float hd = 0.f;
  {
    float z[kK / 8][4], xx[kK / 8][4];
    linear_tc::zero(z);
    linear_tc::zero(xx);
#pragma unroll 1
    for (int c0 = 0; c0 < vp; c0 += kBV) {
      const int lane = linear_tc::opaque(threadIdx.x % 32), tid = linear_tc::opaque(int(threadIdx.x));
      load_value_tiles<T, L, kK>(sb, plan, hs, c0, doh + c0, p.do_row_stride, n, V - c0, tid);
      tc::cp_async_commit();
      tc::cp_async_wait<0>();
      __syncthreads();
      linear_tc::mma_smem<T, CTile, HTile, kBV, kK, false>(z, sb + L::kDO, 16 * warp, sb + L::kH0, lane);
      linear_tc::mma_smem<T, CTile, HTile, kBV, kK, false>(xx, sb + L::kU, 16 * warp, sb + L::kDH, lane);
      if (tid < kK) {
        for (int c = 0; c < kBV; ++c) {
          hd += linear_tc::ld16<T>(smem, L::kH0 + HTile::offset(tid, c)) *
                linear_tc::ld16<T>(smem, L::kDH + HTile::offset(tid, c));
        }
      }
      __syncthreads();
    }
    store_rows<T, kK>(zyx, z, warp, lane);
    store_rows<T, kK>(zyx + 2 * kC * kK, xx, warp, lane);
  }
  if (tid < kK) plan.scal[hs * kScalars + kKeyHd + tid] = hd;
  // Y = db h0^T, db = T^T du
  {
    float y[kK / 8][4];
    linear_tc::zero(y);
#pragma unroll 1
    for (int c0 = 0; c0 < vp; c0 += kBV) {
      const int lane = linear_tc::opaque(threadIdx.x % 32), tid = linear_tc::opaque(int(threadIdx.x));
      load_value_tiles<T, L, kK>(sb, plan, hs, c0, doh + c0, p.do_row_stride, n, V - c0, tid);
      tc::cp_async_commit();
      tc::cp_async_wait<0>();
      __syncthreads();
      float db[kBV / 8][4];
      t_transpose_du<T, TTile, CTile>(db, sb + L::kT, sb + L::kDU, warp, lane);
      linear_tc::mma_reg<T, HTile, kBV, kK, false>(y, db, sb + L::kH0, lane);
      __syncthreads();
    }
    store_rows<T, kK>(zyx + kC * kK, y, warp, lane);
  }
}

// ------------------------------------------------------------------------------ dq, dk, dgate
// The chunk's pairs split on its four 16-row blocks, as the per-key prep's scores are
// (delta_chunk_kernel.cuh): pairs across blocks on the tensor cores, each block's own pairs per
// key channel on the CUDA cores (a running product over the block, as before the split).
//   - rows i of block I >= 1 against columns j < r = 16 I: w_d(i, j) = w_d(i, r) w_d(r, j), so
//     sum_j M1_ij w(i, j) k^_j = w(i, r) (M1 (K^ ⊙ R^(I)))_i with R^(I)_jd = w_d(r, j): one product
//     per block for M1 (dq^) and one for Dm (same); their sums go to DQ / SM as they are, and the
//     channel's pass scales them by w(i, r) while it adds the block's own pairs;
//   - columns j of block J <= 2 against rows i > e = 16 J + 15: w_d(i, j) = w_d(i, e) w_d(e, j),
//     so opp's sums are w(e, j) (M1^T (Q^ ⊙ L^(J)) + Dm^T (K^ ⊙ L^(J)))_j with L^(J)_id =
//     w_d(i, e); the products' fp32 sums (16 x kK) reach the channel's pass through the operand
//     region, block by block from the chunk's end, the order of the log-gates' reverse sum.
// Every factor is a product of gates over a span, each in [0, 1]: nothing overflows and a reset
// (a zero factor) zeros exactly the pairs across it, per channel. The scaled operands are rounded
// to 16 bits, as the prep's R tiles are. One product's right operand (up to 48 rows) fits the
// operand region, so the products run in rounds: one per row block, two per column block.
template <int kK>
struct DkeySmem {
  using KTile = tc::SmemTile<kC, kK>;  // Q, K as given
  using CTile = tc::SmemTile<kC, kC>;  // M1, Dm
  using OTile = tc::SmemTile<48, kK>;  // a round's right operand
  static constexpr uint32_t kQ = 0, kK_ = KTile::kBytes, kM = 2 * KTile::kBytes, kDm = kM + CTile::kBytes,
                            kA = kDm + CTile::kBytes,  // a (fp32 (kC, kK))
      kDQ = kA + kC * kK * 4,                          // dq^ (fp32)
      kSM = kDQ + kC * kK * 4,                         // same, then dk^ (fp32)
      kOp = kSM + kC * kK * 4,                         // a round's operand, then a column block's sums
      kF = kOp + OTile::kBytes;
  static_assert(OTile::kBytes >= 16 * kK * 4, "the operand region holds a column block's fp32 sums");
  static constexpr int kBytes = int(kF) + 5 * kC * 4;  // nq, nk, b, the rows' dots of q and k
};

// acc (16 x kN) += A B: B the operand tile's rows [0, kDepth) x columns [c0, c0 + kN) (rows k);
// A 16 rows from m0 of the (kC, kC) tile at a and its columns from k0, or (kATrans) the tile's
// transpose: its rows from k0 and columns from m0.
template <typename T, int kK, int kDepth, int kN, bool kATrans>
__device__ __forceinline__ void dkey_mma(float (&acc)[kN / 8][4], uint32_t a, int m0, int k0, uint32_t b, int c0,
                                         int lane) {
  using CTile = typename DkeySmem<kK>::CTile;
  using OTile = typename DkeySmem<kK>::OTile;
  const uint32_t bo = OTile::lane_bt(c0, lane);
#pragma unroll
  for (int kk = 0; kk < kDepth / 16; ++kk) {
    uint32_t af[4];
    if constexpr (kATrans) {
      lda_trans<CTile>(af, a, k0 + 16 * kk, m0, lane);
    } else {
      tc::ldmatrix_x4(af, a + CTile::offset(m0 + (lane & 15), k0 + 16 * kk + (lane >> 4) * 8));
    }
#pragma unroll
    for (int np = 0; np < kN / 16; ++np) {
      uint32_t bf[4];
      tc::ldmatrix_x4_trans(bf, b + OTile::advance(bo, kk * 16, np * 16));
      tc::mma_n16<T>(acc[2 * np], af, bf);
    }
  }
}

// Row block kI's round: R^(I) = K^ rows j < 16 kI scaled by w_d(16 kI, j) (thread d the channel),
// then the warps' column slabs of M1 (K^ ⊙ R) and Dm (K^ ⊙ R), as they are, to DQ and SM.
template <typename T, int kK, int kI>
__device__ __forceinline__ void dkey_row_round(unsigned char* smem, float* DQ, float* SM, const float* Ga,
                                               const float* NK, int tid, int warp, int lane) {
  using L = DkeySmem<kK>;
  constexpr int kR = 16 * kI, kN = kK / 4;
  const uint32_t sb = tc::smem_u32(smem);
  if (tid < kK) {
    const int d = tid;
    float w = 1.f;
    for (int j = kR - 1; j >= 0; --j) {
      w *= Ga[(j + 1) * kK + d];
      const float kj = linear_tc::ld16<T>(smem, L::kK_ + L::KTile::offset(j, d)) * NK[j];
      linear_tc::st16<T>(smem, L::kOp + L::OTile::offset(j, d), kj * w);
    }
  }
  __syncthreads();
  float aq[kN / 8][4], as[kN / 8][4];
  linear_tc::zero(aq);
  linear_tc::zero(as);
  const int c0 = warp * kN;
  dkey_mma<T, kK, kR, kN, false>(aq, sb + L::kM, kR, 0, sb + L::kOp, c0, lane);
  dkey_mma<T, kK, kR, kN, false>(as, sb + L::kDm, kR, 0, sb + L::kOp, c0, lane);
#pragma unroll
  for (int t = 0; t < kN / 8; ++t) {
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const int i = acc_row(kR, lane, x), c = c0 + acc_col(t, lane, x);
      DQ[i * kK + c] = aq[t][x];
      SM[i * kK + c] = as[t][x];
    }
  }
  __syncthreads();  // the next round's operand overwrites this one
}

// Column block kJ's rounds: the rows i > e = 16 kJ + 15 of Q^ (then K^) scaled by w_d(i, e),
// M1^T (then Dm^T) times them, the block's 16 x kK sums (fp32) left in the operand region.
template <typename T, int kK, int kJ>
__device__ __forceinline__ void dkey_col_rounds(unsigned char* smem, const float* Ga, const float* NQ, const float* NK,
                                                int tid, int warp, int lane) {
  using L = DkeySmem<kK>;
  constexpr int kI0 = 16 * (kJ + 1), kDepth = kC - kI0, kN = kK / 4;
  const uint32_t sb = tc::smem_u32(smem);
  float acc[kN / 8][4];
  linear_tc::zero(acc);
  const int c0 = warp * kN;
#pragma unroll 1
  for (int m = 0; m < 2; ++m) {
    if (tid < kK) {
      const int d = tid;
      const uint32_t src = m == 0 ? L::kQ : L::kK_;
      const float* nrm = m == 0 ? NQ : NK;
      float l = 1.f;
      for (int i = kI0; i < kC; ++i) {
        l *= Ga[i * kK + d];
        const float x = linear_tc::ld16<T>(smem, src + L::KTile::offset(i, d)) * nrm[i];
        linear_tc::st16<T>(smem, L::kOp + L::OTile::offset(i - kI0, d), x * l);
      }
    }
    __syncthreads();
    dkey_mma<T, kK, kDepth, kN, true>(acc, sb + (m == 0 ? L::kM : L::kDm), 16 * kJ, kI0, sb + L::kOp, c0, lane);
    __syncthreads();  // the next operand, or the sums, overwrite this one
  }
  float* O = reinterpret_cast<float*>(smem + L::kOp);
#pragma unroll
  for (int t = 0; t < kN / 8; ++t) {
#pragma unroll
    for (int x = 0; x < 4; ++x) O[acc_row(0, lane, x) * kK + c0 + acc_col(t, lane, x)] = acc[t][x];
  }
  __syncthreads();
}

template <typename T, int kK>
__global__ void __launch_bounds__(kThreads) delta_chunk_dkey_kernel(const DeltaBwdParams p, const DeltaChunkPlan plan) {
  using L = DkeySmem<kK>;
  using KTile = typename L::KTile;
  using CTile = typename L::CTile;
  ATTN_EXTERN_SMEM(smem);
  const uint32_t sb = tc::smem_u32(smem);
  float* Ga = reinterpret_cast<float*>(smem + L::kA);
  float* DQ = reinterpret_cast<float*>(smem + L::kDQ);
  float* SM = reinterpret_cast<float*>(smem + L::kSM);
  const float* O = reinterpret_cast<const float*>(smem + L::kOp);
  float* NQ = reinterpret_cast<float*>(smem + L::kF);
  float* NK = NQ + kC;
  float* B = NK + kC;  // b, the W term's factor (0 for the plain write: W = 0)
  float* RQ = B + kC;
  float* RK = RQ + kC;

  const int64_t x = blockIdx.x;
  const int hv = blockIdx.y, hk = hv / (p.h_v / p.h_k);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const ChunkAt at = chunk_at(p, plan, x);
  const int n = at.n;
  if (n == 0) return;
  const int K = p.dim_k;
  const int64_t hs = int64_t(hv) * plan.slots + x;
  const int64_t side = (int64_t(at.b) * p.h_v + hv) * p.s + at.row;

  const T* qh = head_rows<T>(p.q, p.q_batch_stride, p.q_head_stride, at.b, hk) + at.row * p.q_row_stride;
  const T* kh = head_rows<T>(p.k, p.k_batch_stride, p.k_head_stride, at.b, hk) + at.row * p.k_row_stride;
  const T* mm = static_cast<const T*>(plan.mm) + hs * 3 * kC * kC;
  tc::load_tile_async<kC, kK, kThreads, T>(sb + L::kQ, qh, p.q_row_stride, n, K, tid);
  tc::load_tile_async<kC, kK, kThreads, T>(sb + L::kK_, kh, p.k_row_stride, n, K, tid);
  tc::load_tile_async<kC, kC, kThreads, T>(sb + L::kM, mm, kC, kC, kC, tid);
  tc::load_tile_async<kC, kC, kThreads, T>(sb + L::kDm, mm + kC * kC, kC, kC, kC, tid);
  tc::cp_async_commit();
  for (int e = tid; e < kC * kK; e += kThreads) {
    const int i = e / kK, d = e % kK;
    Ga[e] = i < n && d < K ? expf(delta_cuda::load_side(p.gate_dt, p.gate, (side + i) * K + d)) : 1.f;
  }
  for (int e = tid; e < 16 * kK; e += kThreads) DQ[e] = SM[e] = 0.f;  // block 0 has no earlier columns
  if (tid < kC) {
    NQ[tid] = plan.scal[hs * kScalars + 4 * kC + tid];
    NK[tid] = plan.scal[hs * kScalars + 2 * kC + tid];
    B[tid] = tid < n && !p.plain ? delta_cuda::load_side(p.beta_dt, p.beta, side + tid) : 0.f;
    RQ[tid] = RK[tid] = 0.f;
  }
  tc::cp_async_wait<0>();
  __syncthreads();

  // the rows' sums across blocks (blocks past the chunk's n rows are never read)
  if (16 < n) dkey_row_round<T, kK, 1>(smem, DQ, SM, Ga, NK, tid, warp, lane);
  if (32 < n) dkey_row_round<T, kK, 2>(smem, DQ, SM, Ga, NK, tid, warp, lane);
  if (48 < n) dkey_row_round<T, kK, 3>(smem, DQ, SM, Ga, NK, tid, warp, lane);

  const int d = tid;
  const bool live = d < K;
  const T* Z = static_cast<const T*>(plan.zyx) + hs * 3 * kC * kK;
  const T* Y = Z + kC * kK;
  const T* X = Y + kC * kK;
  auto qh_ = [&](int i) { return linear_tc::ld16<T>(smem, L::kQ + KTile::offset(i, d)) * NQ[i]; };
  auto kh_ = [&](int i) { return linear_tc::ld16<T>(smem, L::kK_ + KTile::offset(i, d)) * NK[i]; };
  auto m1_ = [&](int i, int j) { return linear_tc::ld16<T>(smem, L::kM + CTile::offset(i, j)); };
  auto dm_ = [&](int i, int j) { return linear_tc::ld16<T>(smem, L::kDm + CTile::offset(i, j)); };
  auto a_ = [&](int i) { return Ga[i * kK + d]; };
  float last_decay = 1.f, skx = 0.f;
  if (live) {
    // rows: dq^ and same, the products' sums scaled by w(i, 16 floor(i / 16)), plus the block's
    // own pairs, w(i, j) from j = i down
    float e = 1.f, l = 1.f;
    for (int i = 0; i < n; ++i) {
      const float a = a_(i);
      e *= a;
      l = i % 16 == 0 ? 1.f : l * a;
      float rq = 0.f, rk = 0.f, w = 1.f;
      for (int j = i; j >= (i & ~15); --j) {
        if (j < i) w *= a_(j + 1);
        const float kj = kh_(j) * w;
        rq = fmaf(m1_(i, j), kj, rq);
        rk = fmaf(dm_(i, j), kj, rk);  // Dm's diagonal is 0
      }
      DQ[i * kK + d] = fmaf(l, DQ[i * kK + d], fmaf(e, to_float(Z[i * kK + d]), rq));
      SM[i * kK + d] = fmaf(l, SM[i * kK + d], rk - B[i] * e * to_float(Y[i * kK + d]));
    }
    last_decay = e;  // w(n-1, -1)
    // sum_j k^_j w(n-1, j) X_j: the last row's K~ term
    float wl = 1.f;
    for (int j = n - 1; j >= 0; --j) {
      if (j < n - 1) wl *= a_(j + 1);
      skx = fmaf(kh_(j) * wl, to_float(X[j * kK + d]), skx);
    }
  }
  // columns, block by block from the chunk's end: dk^, dG and the log-gates' reverse sum
  float run = 0.f, wl = 1.f;
  auto col_pass = [&](int blk, bool across) {
    if (!live) return;
    const int j0 = 16 * blk, hi = min(j0 + 15, n - 1);
    float r = 1.f;  // w(16 blk + 15, j): 1 at hi (the gates past the chunk's rows are 1)
    for (int j = hi; j >= j0; --j) {
      if (j < hi) r *= a_(j + 1);
      if (j < n - 1) wl *= a_(j + 1);
      float cp = 0.f, ca = 0.f, w = 1.f;
      for (int i = j; i <= hi; ++i) {
        if (i > j) w *= a_(i);
        cp = fmaf(m1_(i, j), qh_(i) * w, cp);
        ca = fmaf(dm_(i, j), kh_(i) * w, ca);
      }
      const float off = across ? r * O[(j - j0) * kK + d] : 0.f;
      const float opp = cp + ca + off + wl * to_float(X[j * kK + d]);
      const float same = SM[j * kK + d];
      SM[j * kK + d] = same + opp;
      float dg = qh_(j) * DQ[j * kK + d] + kh_(j) * (same - opp);
      if (j == n - 1) dg += skx + last_decay * plan.scal[hs * kScalars + kKeyHd + d];
      run += dg;
      const bool zero = a_(j) == 0.f;
      store_side(p.gate_dt, p.dgate, (side + j) * K + d, zero ? 0.f : run);
      if (zero) run = 0.f;
    }
  };
  if (48 < n) col_pass(3, false);
  if (32 < n) {
    if (48 < n) dkey_col_rounds<T, kK, 2>(smem, Ga, NQ, NK, tid, warp, lane);
    col_pass(2, 48 < n);
    __syncthreads();  // the next block's operands overwrite these sums
  }
  if (16 < n) {
    if (32 < n) dkey_col_rounds<T, kK, 1>(smem, Ga, NQ, NK, tid, warp, lane);
    col_pass(1, 32 < n);
    __syncthreads();
  }
  if (16 < n) dkey_col_rounds<T, kK, 0>(smem, Ga, NQ, NK, tid, warp, lane);
  col_pass(0, 16 < n);
  __syncthreads();
  // the chain rule of q^ = scale q / ||q|| and k^ = k / ||k|| (or of the scale alone), added in
  if (p.qk_l2norm) {
    for (int i = 0; i < n; ++i) {
      float vq = live ? linear_tc::ld16<T>(smem, L::kQ + KTile::offset(i, d)) * DQ[i * kK + d] : 0.f;
      float vk = live ? linear_tc::ld16<T>(smem, L::kK_ + KTile::offset(i, d)) * SM[i * kK + d] : 0.f;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        vq += __shfl_xor_sync(0xffffffffu, vq, o);
        vk += __shfl_xor_sync(0xffffffffu, vk, o);
      }
      if (lane == 0) {
        atomicAdd(RQ + i, vq);
        atomicAdd(RK + i, vk);
      }
    }
    __syncthreads();
  }
  if (live) {
    const int64_t row = (int64_t(at.b) * p.h_k + hk) * p.s + at.row;
    for (int i = 0; i < n; ++i) {
      const float nq = NQ[i], nq2 = p.qk_l2norm ? (nq / p.scale) * (nq / p.scale) : 0.f;
      const float nk = NK[i], nk2 = p.qk_l2norm ? nk * nk : 0.f;
      const float qv = linear_tc::ld16<T>(smem, L::kQ + KTile::offset(i, d));
      const float kv = linear_tc::ld16<T>(smem, L::kK_ + KTile::offset(i, d));
      atomicAdd(plan.dq + (row + i) * K + d, nq * (DQ[i * kK + d] - nq2 * RQ[i] * qv));
      atomicAdd(plan.dk + (row + i) * K + d, nk * (SM[i * kK + d] - nk2 * RK[i] * kv));
    }
  }
}

}  // namespace delta_chunk
}  // namespace attn
