// The delta rule's chunk-parallel backward on the tensor cores (bf16 or fp16; DeltaNet and Gated DeltaNet,
// the forward's calls: delta_chunk_kernel.cuh states the forward and its notation). After the
// forward's prep (with T kept) and state walk recompute every chunk's entering state h0 and u,
// four kernels, per chunk with dO its output gradient and dh1 the gradient of the state it leaves:
//
//   delta_chunk_dlocal_kernel  grid (slots, H_v, value tiles): du_loc = P^T dO, P_ij = w(i, j)
//                              (q^_i . k^_j) for j <= i; value tile 0 also stores w(i, -1) q^_i
//                              (the walk's operand) and q's factor.
//   delta_chunk_rev_kernel     grid (value tiles, H_v, N), the only sequential walk, backwards over
//                              the chunks with dh (K, 64) in mma accumulators: stores dh1, forms
//                              du = du_loc + K~ dh1 (stored over du_loc), and
//                              dh0 = w(n-1, -1) dh1 + (w q^)^T dO - W^T du; the gradient leaving
//                              chunk 0 is the initial state's.
//   delta_chunk_dscal_kernel   grid (slots, H_v): db = T^T du (dv = Diag(b) db, written), the
//                              score-sized products S1 = dO u^T and S2 = db u^T summed over the
//                              value tiles, the row scalars (dbeta, the decays' gradients, and the
//                              log-gates' by a reverse sum within the chunk that stops at resets),
//                              and the three (kC, kC) matrices the dq / dk kernel multiplies by.
//   delta_chunk_dqk_kernel     grid (slots, H_v): dq^ = Diag(w(., -1)) dO h0^T + M1 K^ and
//                              dk^ = M1^T Q^ + (D + D^T) K^ + Diag(w(n-1, .)) u dh1^T
//                                    - Diag(b w(., -1)) db h0^T,
//                              then the L2 norm's and scale's chain rule, added into float32 dq / dk
//                              (atomics: a GVA group's value heads share q and k).
//
// with M1 = S1 * w (lower, the diagonal included), dA = -S2 (strictly lower), D = dA * w * b_i;
// the math, checked against autograd of the recurrence in float64, is in the kernels' test
// (tests/cuda_emu/test_delta_chunk_bwd_emulated.py's prototype). Gates' gradients never subtract
// cumulative sums either: each term is a decay times its coefficient, and a reset row's gate gets
// 0 (its exp is 0 in float32, so its derivative is).
#pragma once

#include "linear/cuda/delta_chunk_kernel.cuh"

namespace attn {
namespace delta_chunk {

using DeltaBwdParams = DeltaBwdParamsT<float>;

// Row i's scalars of a slot into shared arrays (threads tid < kC): G', F, nk, w(i, -1), nq.
__device__ __forceinline__ void load_scalars(const DeltaChunkPlan& plan, int64_t hs, float* G, float* F, float* NK,
                                             float* E, float* NQ, int tid) {
  if (tid < kC) {
    const float* sc = plan.scal + hs * kScalars;
    G[tid] = sc[tid];
    F[tid] = sc[kC + tid];
    NK[tid] = sc[2 * kC + tid];
    E[tid] = sc[3 * kC + tid];
    if (NQ != nullptr) NQ[tid] = sc[4 * kC + tid];
  }
}

// A side input (beta or the gradient's dtype) written as its dtype.
__device__ __forceinline__ void store_side(DType dt, void* base, int64_t i, float x) {
  switch (dt) {
    case DType::kF32: static_cast<float*>(base)[i] = x; break;
    case DType::kF16: static_cast<__half*>(base)[i] = __float2half_rn(x); break;
    default: static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(x); break;
  }
}

// db = T^T du for the warp's 16 rows: T (kC, kC) at t (A = T^T by ldmatrix.trans), du (kC, kBV) at du.
template <typename T, typename TTile, typename CTile>
__device__ __forceinline__ void t_transpose_du(float (&db)[kBV / 8][4], uint32_t t, uint32_t du, int warp, int lane) {
  linear_tc::zero(db);
  const uint32_t bo = CTile::lane_bt(0, lane);
#pragma unroll
  for (int kb = 0; kb < kC / 16; ++kb) {
    uint32_t af[4];
    lda_trans<TTile>(af, t, 16 * kb, 16 * warp, lane);
#pragma unroll
    for (int np = 0; np < kBV / 16; ++np) {
      uint32_t bf[4];
      tc::ldmatrix_x4_trans(bf, du + CTile::advance(bo, kb * 16, np * 16));
      tc::mma_n16<T>(db[2 * np], af, bf);
    }
  }
}

// Per row of the warp's 16 (this lane's rows r0 and r0 + 8): the dot product of the accumulator
// rows y (16 x kBV) with the same rows of a (kC, kBV) 16-bit shared tile at byte `tile` of smem,
// this lane's part (the caller sums the lane quad).
template <typename T, typename Tile>
__device__ __forceinline__ void row_dots(float (&dot)[2], const float (&y)[kBV / 8][4], const unsigned char* smem,
                                         uint32_t tile, int r0, int lane) {
#pragma unroll
  for (int t = 0; t < kBV / 8; ++t) {
    const int c = acc_col(t, lane, 0);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float2 x =
          tc::TypeOps<T>::unpack(*reinterpret_cast<const uint32_t*>(smem + tile + Tile::offset(r0 + 8 * half, c)));
      dot[half] += x.x * y[t][2 * half] + x.y * y[t][2 * half + 1];
    }
  }
}

// dv = Diag(b) db for the warp's 16 rows, out through the warp's own rows of the (kC, kBV) 16-bit
// tile at vt (V's, read before) as 16-byte stores to dv's rows (dvh: the value tile's first
// column; rows < n and columns < cols written).
template <typename T, typename CTile>
__device__ __forceinline__ void store_dv(const float (&db)[kBV / 8][4], const float* B, uint32_t vt, T* dvh,
                                         int64_t ld, int n, int cols, int warp, int lane) {
  const int r0 = acc_row(16 * warp, lane, 0);
  __syncwarp();
#pragma unroll
  for (int t = 0; t < kBV / 8; ++t) {
    const int c = acc_col(t, lane, 0);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = r0 + 8 * half;
      tc::st_shared_b32(vt + CTile::offset(i, c),
                        tc::TypeOps<T>::pack(B[i] * db[t][2 * half], B[i] * db[t][2 * half + 1]));
    }
  }
  __syncwarp();
#pragma unroll
  for (int e = lane; e < 16 * kBV / 8; e += 32) {
    const int i = 16 * warp + e / (kBV / 8), c = e % (kBV / 8) * 8;
    if (i < n && c < cols) {
      *reinterpret_cast<uint4*>(dvh + int64_t(i) * ld + c) = tc::ld_shared_v4(vt + CTile::offset(i, c));
    }
  }
}

// The score-sized sums of the dscal kernels over the value tiles, into M (kC rows of kC + 1
// floats; each element by the thread whose fragment holds it): M += db u^T (db from registers)
// and M += dO u^T (dO's tile at d), u's (kC, kBV) tile at u.
__device__ __forceinline__ void add_rows(float* M, const float (&a)[kC / 8][4], int warp, int lane) {
#pragma unroll
  for (int t = 0; t < kC / 8; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) M[acc_row(16 * warp, lane, e) * (kC + 1) + acc_col(t, lane, e)] += a[t][e];
  }
}
template <typename T, typename CTile>
__device__ __forceinline__ void add_db_ut(float* M, const float (&db)[kBV / 8][4], uint32_t u, int warp, int lane) {
  float sp[kC / 8][4];
  linear_tc::zero(sp);
  linear_tc::mma_reg<T, CTile, kBV, kC, false>(sp, db, u, lane);
  add_rows(M, sp, warp, lane);
}
template <typename T, typename CTile>
__device__ __forceinline__ void add_do_ut(float* M, uint32_t d, uint32_t u, int warp, int lane) {
  float sp[kC / 8][4];
  linear_tc::zero(sp);
  linear_tc::mma_smem<T, CTile, CTile, kBV, kC, false>(sp, d, 16 * warp, u, lane);
  add_rows(M, sp, warp, lane);
}

// ------------------------------------------------------------------------------ du_loc
template <int kK>
struct DlocalSmem {
  using KTile = tc::SmemTile<kC, kK>;
  using CTile = tc::SmemTile<kC, kBV>;
  static constexpr uint32_t kQ = 0, kK_ = KTile::kBytes, kDO = 2 * KTile::kBytes, kF = kDO + CTile::kBytes;
  static constexpr int kBytes = int(kF) + 5 * kC * 4;
};

template <typename T, int kK>
__global__ void __launch_bounds__(kThreads) delta_chunk_dlocal_kernel(const DeltaBwdParams p, const DeltaChunkPlan plan) {
  using L = DlocalSmem<kK>;
  using KTile = typename L::KTile;
  using CTile = typename L::CTile;
  ATTN_EXTERN_SMEM(smem);
  const uint32_t sb = tc::smem_u32(smem);
  float* G = reinterpret_cast<float*>(smem + L::kF);
  float* F = G + kC;
  float* NK = F + kC;
  float* E = NK + kC;
  float* NQ = E + kC;
  const int64_t x = blockIdx.x;
  const int hv = blockIdx.y, hk = hv / (p.h_v / p.h_k), c0 = blockIdx.z * kBV;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const ChunkAt at = chunk_at(p, plan, x);
  const int n = at.n;
  if (n == 0) return;
  const int K = p.dim_k, vp = plan.vp();
  const int64_t hs = int64_t(hv) * plan.slots + x;

  const T* qh = head_rows<T>(p.q, p.q_batch_stride, p.q_head_stride, at.b, hk) + at.row * p.q_row_stride;
  const T* kh = head_rows<T>(p.k, p.k_batch_stride, p.k_head_stride, at.b, hk) + at.row * p.k_row_stride;
  const T* doh = head_rows<T>(p.dout, p.do_batch_stride, p.do_head_stride, at.b, hv) + at.row * p.do_row_stride;
  tc::load_tile_async<kC, kK, kThreads, T>(sb + L::kQ, qh, p.q_row_stride, n, K, tid);
  tc::load_tile_async<kC, kK, kThreads, T>(sb + L::kK_, kh, p.k_row_stride, n, K, tid);
  tc::load_tile_async<kC, kBV, kThreads, T>(sb + L::kDO, doh + c0, p.do_row_stride, n, p.dim_v - c0, tid);
  tc::cp_async_commit();
  load_scalars(plan, hs, G, F, NK, E, nullptr, tid);
  tc::cp_async_wait<0>();
  __syncthreads();
  if (tid < kC) {
    NQ[tid] = tid < n ? (p.qk_l2norm ? p.scale * inv_norm<T, KTile, kK>(smem, L::kQ, tid, K, p.l2_eps) : p.scale) : 0.f;
  }
  __syncthreads();
  if (blockIdx.z == 0) {  // q's factor and w(i, -1) q^_i for the walk
    if (tid < kC) plan.scal[hs * kScalars + 4 * kC + tid] = NQ[tid];
    T* qg = static_cast<T*>(plan.qg) + hs * kC * kK;
    for (int e = tid; e < kC * kK / 2; e += kThreads) {
      const int i = e / (kK / 2), c = 2 * (e % (kK / 2));
      const float f = NQ[i] * E[i];
      st_pair(qg + i * kK + c, linear_tc::ld16<T>(smem, L::kQ + KTile::offset(i, c)) * f,
              linear_tc::ld16<T>(smem, L::kQ + KTile::offset(i, c + 1)) * f);
    }
  }
  // P^T: rows j (keys) of warp w, columns i (queries)
  float s[kC / 8][4];
  linear_tc::zero(s);
  linear_tc::mma_smem<T, KTile, KTile, kK, kC, false>(s, sb + L::kK_, 16 * warp, sb + L::kQ, lane);
#pragma unroll
  for (int t = 0; t < kC / 8; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = acc_row(16 * warp, lane, e), i = acc_col(t, lane, e);
      s[t][e] = i >= j && i < n ? NK[j] * NQ[i] * decay(G, F, i, j) * s[t][e] : 0.f;
    }
  }
  float acc[kBV / 8][4];
  linear_tc::zero(acc);
  mma_reg_split<T, kBV>(acc, s, sb + L::kDO, lane);  // P^T split hi + lo, as the outputs' P
  T* du = static_cast<T*>(plan.du) + hs * kC * vp + c0;
#pragma unroll
  for (int t = 0; t < kBV / 8; ++t) {
    const int j = acc_row(16 * warp, lane, 0), c = acc_col(t, lane, 0);
    st_pair(du + int64_t(j) * vp + c, acc[t][0], acc[t][1]);
    st_pair(du + int64_t(j + 8) * vp + c, acc[t][2], acc[t][3]);
  }
}

// ------------------------------------------------------------------------------ reverse walk
template <int kK>
struct RevSmem {
  using KTile = tc::SmemTile<kC, kK>;   // K~, w q^, W
  using CTile = tc::SmemTile<kC, kBV>;  // du_loc, dO, du, -du
  using HTile = tc::SmemTile<kK, kBV>;  // dh, rounded
  static constexpr uint32_t kStage = 3 * KTile::kBytes + 2 * CTile::kBytes;
  static constexpr uint32_t kDH = 2 * kStage, kDU = kDH + HTile::kBytes, kNDU = kDU + CTile::kBytes;
  static constexpr int kBytes = int(kNDU + CTile::kBytes);
  __device__ static uint32_t kt(int s) { return s * kStage; }
  __device__ static uint32_t qg(int s) { return s * kStage + KTile::kBytes; }
  __device__ static uint32_t w(int s) { return s * kStage + 2 * KTile::kBytes; }
  __device__ static uint32_t dul(int s) { return s * kStage + 3 * KTile::kBytes; }
  __device__ static uint32_t dout(int s) { return s * kStage + 3 * KTile::kBytes + CTile::kBytes; }
};

// kPerKey: the state's decay across a chunk per key channel (the per-key prep's).
template <typename T, int kK, bool kPerKey>
__global__ void __launch_bounds__(kThreads, 1) delta_chunk_rev_kernel(const DeltaBwdParams p, const DeltaChunkPlan plan) {
  using L = RevSmem<kK>;
  using KTile = typename L::KTile;
  using CTile = typename L::CTile;
  using HTile = typename L::HTile;
  using Ops = tc::TypeOps<T>;
  constexpr int kMT = kK / 64;
  ATTN_EXTERN_SMEM(smem);
  const uint32_t sb = tc::smem_u32(smem);
  const int tile = blockIdx.x, hv = blockIdx.y, seq = blockIdx.z, c0 = tile * kBV;
  const int tid = threadIdx.x, warp = tid / 32;
  const int K = p.dim_k, V = p.dim_v, vp = plan.vp();
  int len = p.s, b = seq;
  int64_t row0 = 0;
  if (p.cu_seqlens != nullptr) {
    row0 = p.cu_seqlens[seq];
    len = p.cu_seqlens[seq + 1] - p.cu_seqlens[seq];
    b = 0;
  }
  const int nc = (len + kC - 1) / kC;
  const int64_t hs0 = int64_t(hv) * plan.slots + seq_base(p, plan, seq);
  const int64_t st0 = (int64_t(seq) * p.h_v + hv) * K * V;
  const T* doh = head_rows<T>(p.dout, p.do_batch_stride, p.do_head_stride, b, hv) + row0 * p.do_row_stride + c0;

  float dh[kMT][kBV / 8][4];
  load_slab<kK>(dh, p.dfinal_state != nullptr ? p.dfinal_state + st0 : nullptr, K, V, c0, warp, threadIdx.x % 32);

  auto load_chunk = [&](int it, int tid) {  // walk step it: chunk nc - 1 - it
    const int c = nc - 1 - it, s = it & 1;
    const int64_t hs = hs0 + c;
    tc::load_tile_async<kC, kK, kThreads, T>(sb + L::kt(s), static_cast<const T*>(plan.kt) + hs * kC * kK, kK, kC, kK,
                                             tid);
    tc::load_tile_async<kC, kK, kThreads, T>(sb + L::qg(s), static_cast<const T*>(plan.qg) + hs * kC * kK, kK, kC, kK,
                                             tid);
    tc::load_tile_async<kC, kK, kThreads, T>(sb + L::w(s), static_cast<const T*>(plan.w) + hs * kC * kK, kK, kC, kK, tid);
    tc::load_tile_async<kC, kBV, kThreads, T>(sb + L::dul(s), static_cast<const T*>(plan.du) + hs * kC * vp + c0, vp,
                                              kC, kBV, tid);
    tc::load_tile_async<kC, kBV, kThreads, T>(sb + L::dout(s), doh + int64_t(c) * kC * p.do_row_stride,
                                              p.do_row_stride, min(kC, len - c * kC), V - c0, tid);
  };
  if (nc > 0) load_chunk(0, tid);
  tc::cp_async_commit();

#pragma unroll 1
  for (int it = 0; it < nc; ++it) {
    const int c = nc - 1 - it, s = it & 1;
    const int64_t hs = hs0 + c;
    const int lane = linear_tc::opaque(threadIdx.x % 32);
    if (it + 1 < nc) load_chunk(it + 1, linear_tc::opaque(tid));
    tc::cp_async_commit();
    slab_to_tile<T, HTile, kK>(dh, sb + L::kDH, warp, lane);
    tc::cp_async_wait<1>();
    __syncthreads();
    store_tile<T, HTile, kK>(static_cast<T*>(plan.dhc) + hs * kK * vp + c0, vp, sb + L::kDH, linear_tc::opaque(tid));

    // du = du_loc + K~ dh1, into du's tile and its negation's
    {
      float acc[kBV / 8][4];
      linear_tc::zero(acc);
      linear_tc::mma_smem<T, KTile, HTile, kK, kBV, true>(acc, sb + L::kt(s), 16 * warp, sb + L::kDH, lane);
#pragma unroll
      for (int t = 0; t < kBV / 8; ++t) {
        const int i = acc_row(16 * warp, lane, 0), cc = acc_col(t, lane, 0);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = i + 8 * half;
          const float2 x = Ops::unpack(*reinterpret_cast<const uint32_t*>(smem + L::dul(s) + CTile::offset(r, cc)));
          const float a = x.x + acc[t][2 * half], bb = x.y + acc[t][2 * half + 1];
          tc::st_shared_b32(sb + L::kDU + CTile::offset(r, cc), Ops::pack(a, bb));
          tc::st_shared_b32(sb + L::kNDU + CTile::offset(r, cc), Ops::pack(-a, -bb));
        }
      }
    }
    __syncthreads();
    store_tile<T, CTile, kC>(static_cast<T*>(plan.du) + hs * kC * vp + c0, vp, sb + L::kDU, linear_tc::opaque(tid));

    // dh <- w(n-1, -1) dh + (w q^)^T dO - W^T du
    if constexpr (kPerKey) {
      scale_slab_rows<kK>(dh, plan.scal + hs * kScalars + kKeyDecay, warp, lane);
    } else {
      scale_slab(dh, chunk_decay(plan, hs, len, c));
    }
    add_xt_y<T, KTile, CTile, kK>(dh, sb + L::qg(s), sb + L::dout(s), warp, lane);
    add_xt_y<T, KTile, CTile, kK>(dh, sb + L::w(s), sb + L::kNDU, warp, lane);
    __syncthreads();
  }

  store_slab<kK>(dh, p.dinit_state != nullptr ? p.dinit_state + st0 : nullptr, K, V, c0, warp, threadIdx.x % 32);
}

// A value tile's operands of the dscal / dqk kernels (layout L names kH0, kDH, kU, kDU, kDO):
// h0 and dh1 (kK, kBV), u and du (kC, kBV) from the scratch, dO's rows from `dout`.
template <typename T, typename L, int kK>
__device__ __forceinline__ void load_value_tiles(uint32_t sb, const DeltaChunkPlan& plan, int64_t hs, int c0,
                                                 const T* dout, int64_t do_stride, int n, int cols, int tid) {
  const int vp = plan.vp();
  tc::load_tile_async<kK, kBV, kThreads, T>(sb + L::kH0, static_cast<const T*>(plan.hc) + hs * kK * vp + c0, vp, kK,
                                            kBV, tid);
  tc::load_tile_async<kK, kBV, kThreads, T>(sb + L::kDH, static_cast<const T*>(plan.dhc) + hs * kK * vp + c0, vp, kK,
                                            kBV, tid);
  tc::load_tile_async<kC, kBV, kThreads, T>(sb + L::kU, static_cast<const T*>(plan.u) + hs * kC * vp + c0, vp, kC, kBV,
                                            tid);
  tc::load_tile_async<kC, kBV, kThreads, T>(sb + L::kDU, static_cast<const T*>(plan.du) + hs * kC * vp + c0, vp, kC,
                                            kBV, tid);
  tc::load_tile_async<kC, kBV, kThreads, T>(sb + L::kDO, dout, do_stride, n, cols, tid);
}

// ------------------------------------------------------------------------------ row scalars, dv
template <int kK>
struct DscalSmem {
  using KTile = tc::SmemTile<kC, kK>;   // Q, K
  using TTile = tc::SmemTile<kC, kC>;   // T
  using CTile = tc::SmemTile<kC, kBV>;  // u, du, dO, V
  using HTile = tc::SmemTile<kK, kBV>;  // h0, dh1
  static constexpr uint32_t kQ = 0, kK_ = KTile::kBytes, kT = 2 * KTile::kBytes, kH0 = kT + TTile::kBytes,
                            kDH = kH0 + HTile::kBytes, kU = kDH + HTile::kBytes, kDU = kU + CTile::kBytes,
                            kDO = kDU + CTile::kBytes, kV = kDO + CTile::kBytes, kF = kV + CTile::kBytes;
  static constexpr int kMat = kC * (kC + 1);  // a padded (kC, kC) float matrix
  // floats: G, F, NK, E, NQ, beta, X (k^_i . dh1 u_i), dgamma, row sums, col sums, red; the
  // decay gradients, S2, S1
  static constexpr int kBytes = int(kF) + (11 * kC + 3 * kMat) * 4;
};

template <typename T, int kK>
__global__ void __launch_bounds__(kThreads) delta_chunk_dscal_kernel(const DeltaBwdParams p, const DeltaChunkPlan plan) {
  using L = DscalSmem<kK>;
  using KTile = typename L::KTile;
  using TTile = typename L::TTile;
  using CTile = typename L::CTile;
  using HTile = typename L::HTile;
  ATTN_EXTERN_SMEM(smem);
  const uint32_t sb = tc::smem_u32(smem);
  float* G = reinterpret_cast<float*>(smem + L::kF);
  float* F = G + kC;
  float* NK = F + kC;
  float* E = NK + kC;
  float* NQ = E + kC;
  float* B = NQ + kC;
  float* X = B + kC;
  float* DGAM = X + kC;
  float* RS = DGAM + kC;
  float* CS = RS + kC;
  float* RED = CS + kC;
  float* Em = RED + kC;      // (kC, kC + 1): dw(i, j) w(i, j)
  float* Dm = Em + L::kMat;  // (kC, kC + 1): S2
  float* Sm = Dm + L::kMat;  // (kC, kC + 1): S1
  constexpr int kLd = kC + 1;

  const int64_t x = blockIdx.x;
  const int hv = blockIdx.y, hk = hv / (p.h_v / p.h_k);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const ChunkAt at = chunk_at(p, plan, x);
  const int n = at.n;
  if (n == 0) return;
  const int K = p.dim_k, V = p.dim_v, vp = plan.vp(), last = n - 1;
  const int64_t hs = int64_t(hv) * plan.slots + x;
  const int64_t side = (int64_t(at.b) * p.h_v + hv) * p.s + at.row;

  const T* qh = head_rows<T>(p.q, p.q_batch_stride, p.q_head_stride, at.b, hk) + at.row * p.q_row_stride;
  const T* kh = head_rows<T>(p.k, p.k_batch_stride, p.k_head_stride, at.b, hk) + at.row * p.k_row_stride;
  const T* vh = head_rows<T>(p.v, p.v_batch_stride, p.v_head_stride, at.b, hv) + at.row * p.v_row_stride;
  const T* doh = head_rows<T>(p.dout, p.do_batch_stride, p.do_head_stride, at.b, hv) + at.row * p.do_row_stride;
  T* dvh = static_cast<T*>(p.dv) + int64_t(at.b) * p.dv_batch_stride + int64_t(hv) * p.dv_head_stride +
           at.row * p.dv_row_stride;
  tc::load_tile_async<kC, kK, kThreads, T>(sb + L::kQ, qh, p.q_row_stride, n, K, tid);
  tc::load_tile_async<kC, kK, kThreads, T>(sb + L::kK_, kh, p.k_row_stride, n, K, tid);
  tc::load_tile_async<kC, kC, kThreads, T>(sb + L::kT, static_cast<const T*>(plan.t) + hs * kC * kC, kC, kC, kC, tid);
  tc::cp_async_commit();
  load_scalars(plan, hs, G, F, NK, E, NQ, tid);
  if (tid < kC) {
    B[tid] = tid < n ? delta_cuda::load_side(p.beta_dt, p.beta, side + tid) : 0.f;
    CS[tid] = 0.f;
  }

  // S1 and S2 sum over the value tiles in Sm and Dm (each element by the thread whose fragment
  // holds it, so no barrier until the sums are read by others), which keeps 64 registers free
#pragma unroll
  for (int t = 0; t < kC / 8; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = acc_row(16 * warp, lane, e), j = acc_col(t, lane, e);
      Sm[i * kLd + j] = 0.f;
      Dm[i * kLd + j] = 0.f;
    }
  }
  float pb[2] = {0.f, 0.f}, pg[2] = {0.f, 0.f}, pl[2] = {0.f, 0.f}, hd = 0.f;
  const int r0 = acc_row(16 * warp, lane, 0);  // this lane's rows r0 and r0 + 8

#pragma unroll 1
  for (int c0 = 0; c0 < vp; c0 += kBV) {
    const int lane = linear_tc::opaque(threadIdx.x % 32), tid = linear_tc::opaque(int(threadIdx.x));
    load_value_tiles<T, L, kK>(sb, plan, hs, c0, doh + c0, p.do_row_stride, n, V - c0, tid);
    tc::load_tile_async<kC, kBV, kThreads, T>(sb + L::kV, vh + c0, p.v_row_stride, n, V - c0, tid);
    tc::cp_async_commit();
    tc::cp_async_wait<0>();
    __syncthreads();

    // K^ h0 and db = T^T du: dbeta's and dgamma's b-terms, dv, S2
    {
      float y[kBV / 8][4];
      linear_tc::zero(y);
      linear_tc::mma_smem<T, KTile, HTile, kK, kBV, true>(y, sb + L::kK_, 16 * warp, sb + L::kH0, lane);
      float db[kBV / 8][4];
      t_transpose_du<T, TTile, CTile>(db, sb + L::kT, sb + L::kDU, warp, lane);
      float dot[2] = {0.f, 0.f};
#pragma unroll
      for (int t = 0; t < kBV / 8; ++t) {
#pragma unroll
        for (int e = 0; e < 4; ++e) dot[e / 2] += db[t][e] * y[t][e];
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = r0 + 8 * half;
        pb[half] -= E[i] * NK[i] * dot[half];
        pg[half] -= B[i] * NK[i] * dot[half];
      }
      // dv goes out through the warp's own rows of V's tile (read here first): 16-byte stores
      row_dots<T, CTile>(pb, db, smem, L::kV, r0, lane);
      store_dv<T, CTile>(db, B, sb + L::kV, dvh + c0, p.dv_row_stride, n, V - c0, warp, lane);
      add_db_ut<T, CTile>(Dm, db, sb + L::kU, warp, lane);  // S2 += db u^T (db's last use)
    }
    {  // Q^ h0: dgamma's output term; K^ dh1: the K~ term
      float y[kBV / 8][4];
      linear_tc::zero(y);
      linear_tc::mma_smem<T, KTile, HTile, kK, kBV, true>(y, sb + L::kQ, 16 * warp, sb + L::kH0, lane);
      float dot[2] = {0.f, 0.f};
      row_dots<T, CTile>(dot, y, smem, L::kDO, r0, lane);
      pg[0] += NQ[r0] * dot[0];
      pg[1] += NQ[r0 + 8] * dot[1];
      linear_tc::zero(y);
      linear_tc::mma_smem<T, KTile, HTile, kK, kBV, true>(y, sb + L::kK_, 16 * warp, sb + L::kDH, lane);
      dot[0] = dot[1] = 0.f;
      row_dots<T, CTile>(dot, y, smem, L::kU, r0, lane);
      pl[0] += NK[r0] * dot[0];
      pl[1] += NK[r0 + 8] * dot[1];
    }
    add_do_ut<T, CTile>(Sm, sb + L::kDO, sb + L::kU, warp, lane);  // S1 += dO u^T
    // <h0, dh1> (the last row's decay gradient)
    for (int e = tid; e < kK * kBV; e += kThreads) {
      const int r = e / kBV, c = e % kBV;
      hd += linear_tc::ld16<T>(smem, L::kH0 + HTile::offset(r, c)) * linear_tc::ld16<T>(smem, L::kDH + HTile::offset(r, c));
    }
    __syncthreads();  // the next value tile's copies overwrite these tiles
  }

  // the row partials of the lane quad, then shared (dbeta's after its last term, below)
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
      pg[half] += __shfl_xor_sync(0xffffffffu, pg[half], o);
      pl[half] += __shfl_xor_sync(0xffffffffu, pl[half], o);
    }
  }
  if (lane % 4 == 0) {
    X[r0] = pl[0];
    X[r0 + 8] = pl[1];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) hd += __shfl_xor_sync(0xffffffffu, hd, o);
  if (lane == 0) RED[warp] = hd;
  __syncthreads();

  // K^ K^^T, then Q^ K^^T, with the scores (one score-sized accumulator live at a time): the
  // matrices, dbeta's A term, the decay gradients (their dA part in Em first)
  float re[2] = {0.f, 0.f};
  T* mm = static_cast<T*>(plan.mm) + hs * 3 * kC * kC;
  {
    float kk[kC / 8][4];
    linear_tc::zero(kk);
    linear_tc::mma_smem<T, KTile, KTile, kK, kC, false>(kk, sb + L::kK_, 16 * warp, sb + L::kK_, lane);
#pragma unroll
    for (int t = 0; t < kC / 8; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = acc_row(16 * warp, lane, e), j = acc_col(t, lane, e), half = e / 2;
        const bool live = i < n && j < n;
        const float w = live && j <= i ? decay(G, F, i, j) : 0.f;
        const float da = live && j < i ? -Dm[i * kLd + j] : 0.f;
        const float kkij = NK[i] * NK[j] * kk[t][e];
        pb[half] += da * w * kkij;
        Em[i * kLd + j] = da * B[i] * kkij;
      }
    }
  }
  {
    float qk[kC / 8][4];
    linear_tc::zero(qk);
    linear_tc::mma_smem<T, KTile, KTile, kK, kC, false>(qk, sb + L::kQ, 16 * warp, sb + L::kK_, lane);
#pragma unroll
    for (int t = 0; t < kC / 8; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = acc_row(16 * warp, lane, e), j = acc_col(t, lane, e), half = e / 2;
        const bool live = i < n && j < n;
        const float w = live && j <= i ? decay(G, F, i, j) : 0.f;
        const float s1 = Sm[i * kLd + j];
        const float m1 = j <= i ? s1 * w : 0.f;
        float dw = Em[i * kLd + j] + (j <= i ? NQ[i] * NK[j] * qk[t][e] * s1 : 0.f);
        if (i == last && j <= i) dw += X[j];
        const float ew = live ? dw * w : 0.f;
        re[half] += ew;
        Em[i * kLd + j] = ew;
        mm[i * kC + j] = from_float<T>(m1 * NK[j]);            // dq^ += (M1 Diag(nk)) K
        mm[kC * kC + i * kC + j] = from_float<T>(m1 * NQ[i]);  // dk^ += (Diag(nq) M1)^T Q
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int o = 1; o < 4; o <<= 1) {
        re[half] += __shfl_xor_sync(0xffffffffu, re[half], o);
        pb[half] += __shfl_xor_sync(0xffffffffu, pb[half], o);
      }
    }
    if (lane % 4 == 0) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = r0 + 8 * half;
        RS[i] = re[half];
        DGAM[i] = pg[half];
        if (i < n) store_side(p.beta_dt, p.dbeta, side + i, pb[half]);
      }
    }
  }
  __syncthreads();
  // (D + D^T) Diag(nk) for dk^; the column sums of the decay gradients
  {
    T* mm = static_cast<T*>(plan.mm) + hs * 3 * kC * kC + 2 * kC * kC;
    auto dmat = [&](int i, int j) {  // D = dA w(i, j) b_i, dA = -S2 (strictly lower)
      return i < n && j < i ? -Dm[i * kLd + j] * decay(G, F, i, j) * B[i] : 0.f;
    };
    for (int e = tid; e < kC * kC; e += kThreads) {
      const int i = e / kC, j = e % kC;
      mm[e] = from_float<T>((dmat(i, j) + dmat(j, i)) * NK[j]);
    }
    if (tid < kC) {
      float cs = 0.f;
      for (int i = 0; i < kC; ++i) cs += Em[i * kLd + tid];
      CS[tid] = cs;
    }
  }
  __syncthreads();
  // dG_i = rows - columns + dgamma_i w(i, -1); the log-gates': their sum from row t to the next
  // reset (a reset row's own gate gets 0)
  if (p.gate != nullptr && tid < n) {
    float hdl = 0.f;
    for (int w = 0; w < kWarps; ++w) hdl += RED[w];
    float acc = 0.f;
    const bool reset = F[tid] == float(tid);
    if (!reset) {
      for (int t = tid; t < n; ++t) {
        if (t > tid && F[t] == float(t)) break;
        const float dgam = DGAM[t] + (t == last ? hdl : 0.f);
        acc += RS[t] - CS[t] + dgam * E[t];
      }
    }
    store_side(p.gate_dt, p.dgate, side + tid, acc);
  }
}

// ------------------------------------------------------------------------------ dq, dk
template <int kK>
struct DqkSmem {
  using KTile = tc::SmemTile<kC, kK>;   // Q, K
  using TTile = tc::SmemTile<kC, kC>;   // T, the three matrices
  using CTile = tc::SmemTile<kC, kBV>;  // u, du, dO
  using HTile = tc::SmemTile<kK, kBV>;  // h0, dh1
  static constexpr uint32_t kQ = 0, kK_ = KTile::kBytes, kT = 2 * KTile::kBytes, kM = kT + TTile::kBytes,
                            kH0 = kM + 3 * TTile::kBytes, kDH = kH0 + HTile::kBytes, kU = kDH + HTile::kBytes,
                            kDU = kU + CTile::kBytes, kDO = kDU + CTile::kBytes, kF = kDO + CTile::kBytes;
  static constexpr int kBytes = int(kF) + 6 * kC * 4;
};

template <typename T, int kK>
__global__ void __launch_bounds__(kThreads) delta_chunk_dqk_kernel(const DeltaBwdParams p, const DeltaChunkPlan plan) {
  using L = DqkSmem<kK>;
  using KTile = typename L::KTile;
  using TTile = typename L::TTile;
  using CTile = typename L::CTile;
  using HTile = typename L::HTile;
  using Ops = tc::TypeOps<T>;
  ATTN_EXTERN_SMEM(smem);
  const uint32_t sb = tc::smem_u32(smem);
  float* G = reinterpret_cast<float*>(smem + L::kF);
  float* F = G + kC;
  float* NK = F + kC;
  float* E = NK + kC;
  float* NQ = E + kC;
  float* WL = NQ + kC;  // w(n-1, i): K~'s decay

  const int64_t x = blockIdx.x;
  const int hv = blockIdx.y, hk = hv / (p.h_v / p.h_k);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const ChunkAt at = chunk_at(p, plan, x);
  const int n = at.n;
  if (n == 0) return;
  const int K = p.dim_k, V = p.dim_v, vp = plan.vp();
  const int64_t hs = int64_t(hv) * plan.slots + x;
  const int64_t side = (int64_t(at.b) * p.h_v + hv) * p.s + at.row;

  const T* qh = head_rows<T>(p.q, p.q_batch_stride, p.q_head_stride, at.b, hk) + at.row * p.q_row_stride;
  const T* kh = head_rows<T>(p.k, p.k_batch_stride, p.k_head_stride, at.b, hk) + at.row * p.k_row_stride;
  const T* doh = head_rows<T>(p.dout, p.do_batch_stride, p.do_head_stride, at.b, hv) + at.row * p.do_row_stride;
  tc::load_tile_async<kC, kK, kThreads, T>(sb + L::kQ, qh, p.q_row_stride, n, K, tid);
  tc::load_tile_async<kC, kK, kThreads, T>(sb + L::kK_, kh, p.k_row_stride, n, K, tid);
  tc::load_tile_async<kC, kC, kThreads, T>(sb + L::kT, static_cast<const T*>(plan.t) + hs * kC * kC, kC, kC, kC, tid);
  for (int m = 0; m < 3; ++m) {
    tc::load_tile_async<kC, kC, kThreads, T>(sb + L::kM + m * TTile::kBytes,
                                             static_cast<const T*>(plan.mm) + (hs * 3 + m) * kC * kC, kC, kC, kC, tid);
  }
  tc::cp_async_commit();
  load_scalars(plan, hs, G, F, NK, E, NQ, tid);
  float* Bt = WL + kC;  // beta
  __syncthreads();  // G, F for WL
  if (tid < kC) {
    WL[tid] = tid < n ? decay(G, F, n - 1, tid) : 0.f;
    Bt[tid] = tid < n ? delta_cuda::load_side(p.beta_dt, p.beta, side + tid) : 0.f;
  }

  float aq[kK / 8][4], ak[kK / 8][4];
  linear_tc::zero(aq);
  linear_tc::zero(ak);
  const int r0 = acc_row(16 * warp, lane, 0);
#pragma unroll 1
  for (int c0 = 0; c0 < vp; c0 += kBV) {
    const int lane = linear_tc::opaque(threadIdx.x % 32), tid = linear_tc::opaque(int(threadIdx.x));
    load_value_tiles<T, L, kK>(sb, plan, hs, c0, doh + c0, p.do_row_stride, n, V - c0, tid);
    tc::cp_async_commit();
    tc::cp_async_wait<0>();
    __syncthreads();
    // dq^ += dO h0^T (the row decays at the end)
    linear_tc::mma_smem<T, CTile, HTile, kBV, kK, false>(aq, sb + L::kDO, 16 * warp, sb + L::kH0, lane);
    // dk^ -= Diag(b w(., -1)) (T^T du) h0^T
    {
      float db[kBV / 8][4];
      t_transpose_du<T, TTile, CTile>(db, sb + L::kT, sb + L::kDU, warp, lane);
      const float f0 = -Bt[r0] * E[r0], f1 = -Bt[r0 + 8] * E[r0 + 8];
#pragma unroll
      for (int t = 0; t < kBV / 8; ++t) {
        db[t][0] *= f0;
        db[t][1] *= f0;
        db[t][2] *= f1;
        db[t][3] *= f1;
      }
      linear_tc::mma_reg<T, HTile, kBV, kK, false>(ak, db, sb + L::kH0, lane);
    }
    // dk^ += Diag(w(n-1, .)) u dh1^T: u's A fragments scaled per row
    {
      const float f0 = WL[r0], f1 = WL[r0 + 8];
      const uint32_t ao = CTile::lane_a(16 * warp, lane), bo = HTile::lane_b(0, lane);
#pragma unroll
      for (int kb = 0; kb < kBV / 16; ++kb) {
        uint32_t af[4];
        tc::ldmatrix_x4(af, sb + L::kU + CTile::advance(ao, 0, kb * 16));
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float2 v = Ops::unpack(af[r]);
          const float f = r % 2 == 0 ? f0 : f1;
          af[r] = Ops::pack(v.x * f, v.y * f);
        }
#pragma unroll
        for (int np = 0; np < kK / 16; ++np) {
          uint32_t bf[4];
          tc::ldmatrix_x4(bf, sb + L::kDH + HTile::advance(bo, np * 16, kb * 16));
          tc::mma_n16<T>(ak[2 * np], af, bf);
        }
      }
    }
    __syncthreads();
  }
  // the row decays of dO h0^T, then the score-sized matrices' products
#pragma unroll
  for (int t = 0; t < kK / 8; ++t) {
    aq[t][0] *= E[r0];
    aq[t][1] *= E[r0];
    aq[t][2] *= E[r0 + 8];
    aq[t][3] *= E[r0 + 8];
  }
  linear_tc::mma_smem<T, TTile, KTile, kC, kK, true>(aq, sb + L::kM, 16 * warp, sb + L::kK_, lane);
  linear_tc::mma_smem<T, TTile, KTile, kC, kK, true>(ak, sb + L::kM + 2 * TTile::kBytes, 16 * warp, sb + L::kK_, lane);
  {
    const uint32_t bo = KTile::lane_bt(0, lane);
#pragma unroll
    for (int kb = 0; kb < kC / 16; ++kb) {
      uint32_t af[4];
      lda_trans<TTile>(af, sb + L::kM + TTile::kBytes, 16 * kb, 16 * warp, lane);
#pragma unroll
      for (int np = 0; np < kK / 16; ++np) {
        uint32_t bf[4];
        tc::ldmatrix_x4_trans(bf, sb + L::kQ + KTile::advance(bo, kb * 16, np * 16));
        tc::mma_n16<T>(ak[2 * np], af, bf);
      }
    }
  }
  // the chain rule of q^ = scale q / ||q|| and k^ = k / ||k|| (or of the scale alone), added in
  float dq_dot[2] = {0.f, 0.f}, dk_dot[2] = {0.f, 0.f};
  if (p.qk_l2norm) {
#pragma unroll
    for (int t = 0; t < kK / 8; ++t) {
      const int c = acc_col(t, lane, 0);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = r0 + 8 * half;
        dq_dot[half] += linear_tc::ld16<T>(smem, L::kQ + KTile::offset(i, c)) * aq[t][2 * half] +
                        linear_tc::ld16<T>(smem, L::kQ + KTile::offset(i, c + 1)) * aq[t][2 * half + 1];
        dk_dot[half] += linear_tc::ld16<T>(smem, L::kK_ + KTile::offset(i, c)) * ak[t][2 * half] +
                        linear_tc::ld16<T>(smem, L::kK_ + KTile::offset(i, c + 1)) * ak[t][2 * half + 1];
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int o = 1; o < 4; o <<= 1) {
        dq_dot[half] += __shfl_xor_sync(0xffffffffu, dq_dot[half], o);
        dk_dot[half] += __shfl_xor_sync(0xffffffffu, dk_dot[half], o);
      }
    }
  }
  const int64_t row = (int64_t(at.b) * p.h_k + hk) * p.s + at.row;  // dq / dk rows of this chunk
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int i = r0 + 8 * half;
    if (i >= n) continue;
    const float nq = NQ[i], nq2 = p.qk_l2norm ? (nq / p.scale) * (nq / p.scale) : 0.f;
    const float nk = NK[i], nk2 = p.qk_l2norm ? nk * nk : 0.f;
    float* dqr = plan.dq + (row + i) * K;
    float* dkr = plan.dk + (row + i) * K;
#pragma unroll
    for (int t = 0; t < kK / 8; ++t) {
      const int c = acc_col(t, lane, 0);
      if (c >= K) continue;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float qv = linear_tc::ld16<T>(smem, L::kQ + KTile::offset(i, c + e));
        const float kv = linear_tc::ld16<T>(smem, L::kK_ + KTile::offset(i, c + e));
        atomicAdd(dqr + c + e, nq * (aq[t][2 * half + e] - nq2 * dq_dot[half] * qv));
        atomicAdd(dkr + c + e, nk * (ak[t][2 * half + e] - nk2 * dk_dot[half] * kv));
      }
    }
  }
}

}  // namespace delta_chunk
}  // namespace attn
