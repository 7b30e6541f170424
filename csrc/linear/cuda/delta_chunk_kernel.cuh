// The delta rule's chunk-parallel forward on the tensor cores (bf16 or fp16; DeltaNet and Gated
// DeltaNet: no gate or one log-gate per head; KDA's per-key gates and GLA's plain write in the
// kernels past "per-key gates" below; common/delta_params.h states the math): the WY form of the
// DeltaNet and Gated DeltaNet papers on flash-linear-attention's schedule, in three kernels.
//
// Per chunk of kC = 64 tokens entering with state h0 (K, V), with k^, q^ the normalized rows (q^
// times scale), b_i = beta_i and w(i, j) = prod_{j < t <= i} a_t the decay from token j to i:
//   A    = strictly lower (b_i w(i, j) k^_i . k^_j)           T = (I + A)^-1
//   W    = T Diag(b_j w(j, -1)) K^      U = T Diag(b) V       (u = U - W h0: the chunk's writes)
//   h1   = w(C-1, -1) h0 + K~^T u,      K~_j = w(C-1, j) k^_j
//   o_i  = w(i, -1) h0^T q^_i + sum_{j <= i} w(i, j) (q^_i . k^_j) u_j
//
//   delta_chunk_prep_kernel   grid (slots, H_v): every chunk at once. The decays within the chunk
//                             (below), A by one product, T by forward substitution in fp32
//                             (a thread pair per column of T, no barrier), then W, U and K~ by
//                             products; all three stored 16-bit to the scratch.
//   delta_chunk_state_kernel  grid (value tiles, H_v, N): the only sequential walk. A CTA keeps
//                             its (K, 64) slab of h in mma accumulators (fp32, never rounded),
//                             and per chunk stores h rounded to 16 bits (the outputs' operand),
//                             forms u = U - W h (stored over U) and adds K~^T u. Its operands
//                             for the next chunk arrive by cp.async while it computes.
//   delta_chunk_out_kernel    grid (slots, H_v, value tiles): every chunk's outputs at once from
//                             its entering state, the intra-chunk scores masked and weighted in
//                             the accumulators and fed to the u product from registers.
//
// Decays are exact for every gate. No cumulative log-gate over the sequence is ever formed; within
// a chunk G'_i sums the log-gates since the chunk start or the last reset before i (a gate <=
// kResetGate, whose e^g is 0 in float32, a -inf included), f_i is that reset's row (-1: none), and
// w(i, j) = f_i > j ? 0 : exp(G'_i - G'_j), w(i, -1) = f_i >= 0 ? 0 : exp(G'_i). So a -1e9 or -inf
// gate gives zeros where the recurrence has them, never NaN from -inf - -inf, and a chunk's
// rounding error is that of sums over at most 64 gates.
//
// The scratch (DeltaChunkPlan, dispatch in delta.cu) holds per (value head, chunk slot): the row
// scalars, W and K~ (64, kK), U then u (64, Vp) and the entering state (kK, Vp), 16-bit, Vp the
// value width rounded up to 64. Every element is written (zeros past K, V and a chunk's end), so
// the kernels read whole tiles with no bounds. Slots: sequence n's chunk c is slot n * nt + c for
// a batch, floor(row0_n / 64) + n + c for a varlen pack (as ChunkPlan in chunk_fwd_kernel.cuh).
//
// Needs (delta.cu checks): bf16 or fp16 (the scratch's tiles in the inputs' type: with fp16, a
// state entry past 65504 overflows at its per-chunk rounding, where the recurrent kernel's float32
// state does not; fp32 takes the recurrent kernel), K <= 128, K and V multiples of 8, 16-byte
// aligned rows.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/delta_params.h"
#include "cuda/mma.cuh"
#include "linear/cuda/delta_kernel.cuh"  // load_side
#include "common/linear_params.h"      // kResetGate
#include "linear/cuda/mma_products.cuh"  // mma_smem, mma_reg, fragment indexing, 16-bit smem access

namespace attn {
namespace delta_chunk {

using DeltaParams = DeltaParamsT<float>;
using linear_tc::acc_col;
using linear_tc::acc_row;

constexpr int kC = 64;  // tokens per chunk
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kBV = 64;  // value columns per CTA of the state and output kernels
// the per-slot scalars, float: per row (5, kC) G', f (as a float), the inverse key norm, w(i, -1)
// and (the backward) q's factor scale / ||q||; with per-key gates, from kKeyDecay, the state's
// decay across the chunk per key channel (up to 128), and from kKeyHd (the backward) the entering
// state's dot with the leaving state's gradient per key channel
constexpr int kKeyDecay = 5 * kC;
constexpr int kKeyHd = kKeyDecay + 128;
constexpr int kScalars = kKeyHd + 128;

struct DeltaChunkPlan {
  int nt = 1;         // chunks per sequence of a batch: ceil(S / 64)
  int tiles = 1;      // value tiles of kBV columns; Vp = tiles * kBV
  int kk = 64;        // K rounded up to the kernels' width (64 or 128)
  int64_t slots = 0;  // chunk slots per value head
  float* scal = nullptr;  // (H_v, slots, kScalars)
  void* w = nullptr;      // (H_v, slots, kC, kk)
  void* kt = nullptr;     // (H_v, slots, kC, kk): K~
  void* u = nullptr;      // (H_v, slots, kC, Vp): U, then u
  void* hc = nullptr;     // (H_v, slots, kk, Vp): the state entering the chunk
  // per-key gates only (delta_chunk_prep_key_kernel; null otherwise)
  void* qd = nullptr;     // (H_v, slots, kC, kk): w(i, -1) q^_i
  float* sc = nullptr;    // (H_v, slots, kC, kC): the intra-chunk output scores, masked and scaled
  float* aa = nullptr;    // the backward: (H_v, slots, kC, kC) A / b (strictly lower, fp32)
  void* zyx = nullptr;    // the backward: (H_v, slots, 3, kC, kk): dO h0^T, db h0^T, u dh1^T
  // the backward only (delta_chunk_bwd_kernel.cuh; null in the forward)
  void* t = nullptr;    // (H_v, slots, kC, kC): T
  void* qg = nullptr;   // (H_v, slots, kC, kk): w(i, -1) q^_i
  void* du = nullptr;   // (H_v, slots, kC, Vp): P^T dO, then du
  void* dhc = nullptr;  // (H_v, slots, kk, Vp): the gradient of the state leaving the chunk
  void* mm = nullptr;   // (H_v, slots, 3, kC, kC): M1 Diag(nk), Diag(nq) M1, (D + D^T) Diag(nk)
  float* dq = nullptr;  // (B, H_k, S, K) float32, zeroed: dq summed over a GVA group by atomics
  float* dk = nullptr;
  __host__ __device__ int vp() const { return tiles * kBV; }
};

// The chunk of slot x: its batch row b, first row (in the pack or the sequence), rows n (0: an
// empty slot) and chunk index c.
struct ChunkAt {
  int b = 0, n = 0, c = 0;
  int64_t row = 0;  // first row of the chunk: row0 of the sequence + 64 c
};
__device__ __forceinline__ int64_t seq_base(const DeltaParams& p, const DeltaChunkPlan& plan, int n) {
  return p.cu_seqlens != nullptr ? int64_t(p.cu_seqlens[n] / kC) + n : int64_t(n) * plan.nt;
}
__device__ __forceinline__ ChunkAt chunk_at(const DeltaParams& p, const DeltaChunkPlan& plan, int64_t x) {
  ChunkAt at;
  int seq = 0, len = p.s;
  int64_t row0 = 0;
  if (p.cu_seqlens != nullptr) {  // the last sequence whose first slot is <= x
    int lo = 0, hi = p.b - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (seq_base(p, plan, mid) <= x) lo = mid; else hi = mid - 1;
    }
    seq = lo;
    row0 = p.cu_seqlens[seq];
    len = p.cu_seqlens[seq + 1] - p.cu_seqlens[seq];
  } else {
    seq = int(x / plan.nt);
    at.b = seq;
  }
  at.c = int(x - seq_base(p, plan, seq));
  at.n = max(0, min(kC, len - at.c * kC));
  at.row = row0 + int64_t(at.c) * kC;
  return at;
}

// Scalars of rows i < kC from the raw log-gates gr (0 past the chunk): G'_i, f_i, w(i, -1). One
// thread per row, a loop over the rows before it (the prep kernel's only serial loop of the kind:
// 64 steps, off every sequential path).
__device__ __forceinline__ void chunk_decays(const float* gr, int i, float& g, float& f, float& e) {
  float s = 0.f;
  int last = -1;
  for (int t = 0; t <= i; ++t) {
    const float x = gr[t];
    if (x <= kResetGate) {
      s = 0.f;
      last = t;
    } else {
      s += x;
    }
  }
  g = s;
  f = float(last);
  e = last >= 0 ? 0.f : expf(s);
}
// w(i, j) for j <= i from the scalars
__device__ __forceinline__ float decay(const float* G, const float* F, int i, int j) {
  return F[i] > float(j) ? 0.f : expf(G[i] - G[j]);
}

template <typename T>
__device__ __forceinline__ const T* head_rows(const void* base, int64_t bs, int64_t hs, int b, int h) {
  return static_cast<const T*>(base) + int64_t(b) * bs + int64_t(h) * hs;
}

// 1 / ||row i|| (+ eps) of a (kC, kK) 16-bit tile at byte `tile` of smem: thread i < kC.
template <typename T, typename Tile, int kK>
__device__ __forceinline__ float inv_norm(const unsigned char* smem, uint32_t tile, int i, int cols, float eps) {
  float s = 0.f;
  for (int c = 0; c < cols; ++c) {
    const float x = linear_tc::ld16<T>(smem, tile + Tile::offset(i, c));
    s = fmaf(x, x, s);
  }
  return 1.f / sqrtf(s + eps);
}

// The A fragment (rows [m0, m0 + 16), columns [k0, k0 + 16)) of X^T, X a row-major 16-bit tile
// whose rows are the product's k index: ldmatrix.trans of X's 8 x 8 blocks (rows k0 / k0 + 8,
// columns m0 / m0 + 8), so that a transposed operand needs no transposed copy.
template <typename Tile>
__device__ __forceinline__ void lda_trans(uint32_t (&af)[4], uint32_t tile, int k0, int m0, int lane) {
  tc::ldmatrix_x4_trans(af, tile + Tile::offset(k0 + (lane & 7) + (lane >> 4) * 8, m0 + ((lane >> 3) & 1) * 8));
}

// A 16-bit pair (columns c, c + 1) of an accumulator row, stored to global memory.
template <typename T>
__device__ __forceinline__ void st_pair(T* dst, float a, float b) {
  *reinterpret_cast<uint32_t*>(dst) = tc::TypeOps<T>::pack(a, b);
}

// T = (I + A)^-1, lower unitriangular, into Tf (kC, kC) from A's rows Af (stride kStride): column
// c by threads 2c and 2c + 1, each summing the terms k = c + h (mod 2) and writing the rows
// i = c + h (mod 2), so that each reads only what it wrote; the pair's partial sums meet by one
// shuffle per row (every lane of the warp walks every row, so that the shuffle's lanes are all
// there).
template <int kStride>
__device__ __forceinline__ void t_solve(const float* Af, float* Tf, int tid) {
  const int c = tid / 2, h = tid % 2;
  for (int i = h; i < c; i += 2) Tf[i * kC + c] = 0.f;
  if (h == 0) Tf[c * kC + c] = 1.f;
  for (int i = 1; i < kC; ++i) {
    float s = 0.f;
    if (i > c) {
      for (int k = c + h; k < i; k += 2) s = fmaf(Af[i * kStride + k], Tf[k * kC + c], s);
    }
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    if (i > c && ((i - c) & 1) == h) Tf[i * kC + c] = -s;
  }
}

// W = (Tw) K' and U = (Tu) V, stored to (head, slot) hs of the scratch: Tw, Tu (kC, kC) 16-bit
// tiles at tw, tu, K' the (kC, kK) tile at kk, V by value tiles through the (kC, kBV) tile at vt
// (rows vh, n valid). Warp w's rows [16 w, 16 w + 16). The output pointers are formed where they
// are used (the products' registers are the kernels' peak).
template <typename T, int kK>
__device__ __forceinline__ void w_u_products(const DeltaParams& p, const DeltaChunkPlan& plan, int64_t hs,
                                             unsigned char* smem, uint32_t tw, uint32_t tu, uint32_t kk, uint32_t vt,
                                             const T* vh, int n, int warp, int lane, int tid) {
  const int V = p.dim_v, vp = plan.vp();
  using KTile = tc::SmemTile<kC, kK>;
  using CTile = tc::SmemTile<kC, kC>;
  const uint32_t sb = tc::smem_u32(smem);
  {
    float acc[kK / 8][4];
    linear_tc::zero(acc);
    linear_tc::mma_smem<T, CTile, KTile, kC, kK, true>(acc, sb + tw, 16 * warp, sb + kk, lane);
    T* w = static_cast<T*>(plan.w) + hs * kC * kK;
#pragma unroll
    for (int t = 0; t < kK / 8; ++t) {
      const int i = acc_row(16 * warp, lane, 0), c = acc_col(t, lane, 0);
      st_pair(w + i * kK + c, acc[t][0], acc[t][1]);
      st_pair(w + (i + 8) * kK + c, acc[t][2], acc[t][3]);
    }
  }
  for (int c0 = 0; c0 < vp; c0 += kBV) {
    tc::load_tile_async<kC, kBV, kThreads, T>(sb + vt, vh + c0, p.v_row_stride, n, V - c0, tid);
    tc::cp_async_commit();
    tc::cp_async_wait<0>();
    __syncthreads();
    float acc[kBV / 8][4];
    linear_tc::zero(acc);
    linear_tc::mma_smem<T, CTile, CTile, kC, kBV, true>(acc, sb + tu, 16 * warp, sb + vt, lane);
    T* u = static_cast<T*>(plan.u) + hs * kC * vp;
#pragma unroll
    for (int t = 0; t < kBV / 8; ++t) {
      const int i = acc_row(16 * warp, lane, 0), c = c0 + acc_col(t, lane, 0);
      st_pair(u + i * vp + c, acc[t][0], acc[t][1]);
      st_pair(u + (i + 8) * vp + c, acc[t][2], acc[t][3]);
    }
    __syncthreads();  // the next tile's copy overwrites V's tile
  }
}

// ------------------------------------------------------------------------------ prep
template <int kK>
struct PrepSmem {
  using KTile = tc::SmemTile<kC, kK>;
  using CTile = tc::SmemTile<kC, kC>;
  static constexpr uint32_t kK_ = 0, kV = kK_ + KTile::kBytes, kTw = kV + CTile::kBytes, kTu = kTw + CTile::kBytes,
                            kF = kTu + CTile::kBytes;  // then the floats
  static constexpr int kAStride = kC + 1;               // A's rows (fp32), padded: T's column walk reads A[i][k..]
  static constexpr int kFloats = kC * kAStride + kC * kC + 6 * kC;
  static constexpr int kBytes = int(kF) + kFloats * 4;
};

template <typename T, int kK>
__global__ void __launch_bounds__(kThreads) delta_chunk_prep_kernel(const DeltaParams p, const DeltaChunkPlan plan) {
  using L = PrepSmem<kK>;
  using KTile = typename L::KTile;
  using CTile = typename L::CTile;
  ATTN_EXTERN_SMEM(smem);
  const uint32_t sb = tc::smem_u32(smem);
  float* Af = reinterpret_cast<float*>(smem + L::kF);  // (kC, kAStride)
  float* Tf = Af + kC * L::kAStride;                    // (kC, kC): T, column c by thread pair c
  float* G = Tf + kC * kC;
  float* F = G + kC;
  float* NK = F + kC;
  float* E = NK + kC;
  float* B = E + kC;
  float* GR = B + kC;

  const int64_t x = blockIdx.x;
  const int hv = blockIdx.y, hk = hv / (p.h_v / p.h_k);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const ChunkAt at = chunk_at(p, plan, x);
  const int n = at.n;
  if (n == 0) return;  // a varlen pack's gap slot: no chunk, nothing reads it
  const int K = p.dim_k, V = p.dim_v, vp = plan.vp();
  const int64_t hs = int64_t(hv) * plan.slots + x;  // this (head, slot)

  const T* kh = head_rows<T>(p.k, p.k_batch_stride, p.k_head_stride, at.b, hk) + at.row * p.k_row_stride;
  const T* vh = head_rows<T>(p.v, p.v_batch_stride, p.v_head_stride, at.b, hv) + at.row * p.v_row_stride;
  tc::load_tile_async<kC, kK, kThreads, T>(sb + L::kK_, kh, p.k_row_stride, n, K, tid);
  tc::cp_async_commit();
  if (tid < kC) {
    const int64_t side = (int64_t(at.b) * p.h_v + hv) * p.s + at.row + tid;
    GR[tid] = p.gate != nullptr && tid < n ? delta_cuda::load_side(p.gate_dt, p.gate, side) : 0.f;
    B[tid] = tid < n ? delta_cuda::load_side(p.beta_dt, p.beta, side) : 0.f;
  }
  tc::cp_async_wait<0>();
  __syncthreads();
  if (tid < kC) {
    chunk_decays(GR, tid, G[tid], F[tid], E[tid]);
    NK[tid] = tid < n ? (p.qk_l2norm ? inv_norm<T, KTile, kK>(smem, L::kK_, tid, K, p.l2_eps) : 1.f) : 0.f;
    float* sc = plan.scal + hs * kScalars;
    sc[tid] = G[tid];
    sc[kC + tid] = F[tid];
    sc[2 * kC + tid] = NK[tid];
    sc[3 * kC + tid] = E[tid];
  }
  __syncthreads();

  // A: warp w's rows [16 w, 16 w + 16), every column
  {
    float acc[kC / 8][4];
    linear_tc::zero(acc);
    linear_tc::mma_smem<T, KTile, KTile, kK, kC, false>(acc, sb + L::kK_, 16 * warp, sb + L::kK_, lane);
#pragma unroll
    for (int t = 0; t < kC / 8; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = acc_row(16 * warp, lane, e), j = acc_col(t, lane, e);
        Af[i * L::kAStride + j] = j < i && i < n ? B[i] * NK[i] * NK[j] * decay(G, F, i, j) * acc[t][e] : 0.f;
      }
    }
  }
  __syncthreads();

  t_solve<L::kAStride>(Af, Tf, tid);
  __syncthreads();

  // T Diag(b_j w(j, -1) nk_j) and T Diag(b_j), 16-bit, for the W and U products (and T itself for
  // the backward)
  T* tg = plan.t != nullptr ? static_cast<T*>(plan.t) + hs * kC * kC : nullptr;
  for (int e = tid; e < kC * kC; e += kThreads) {
    const int i = e / kC, j = e % kC;
    const float t = Tf[e];
    if (tg != nullptr) tg[e] = from_float<T>(t);
    linear_tc::st16<T>(smem, L::kTw + CTile::offset(i, j), t * B[j] * E[j] * NK[j]);
    linear_tc::st16<T>(smem, L::kTu + CTile::offset(i, j), t * B[j]);
  }
  // K~ = w(n-1, j) nk_j k_j, the state update's operand
  T* kt = static_cast<T*>(plan.kt) + hs * kC * kK;
  for (int e = tid; e < kC * kK / 2; e += kThreads) {
    const int j = e / (kK / 2), c = 2 * (e % (kK / 2));
    const float f = j < n ? NK[j] * decay(G, F, n - 1, j) : 0.f;
    st_pair(kt + j * kK + c, linear_tc::ld16<T>(smem, L::kK_ + KTile::offset(j, c)) * f,
            linear_tc::ld16<T>(smem, L::kK_ + KTile::offset(j, c + 1)) * f);
  }
  __syncthreads();

  // W = (T Diag(..)) K^, U = (T Diag(b)) V
  w_u_products<T, kK>(p, plan, hs, smem, L::kTw, L::kTu, L::kK_, L::kV, vh, n, warp, lane, tid);
}

// ------------------------------------------------------------------------------ prep, per-key gates
// Per-key-channel gates (KDA; and GLA's plain write, u = v, A = 0): the decay from token j to i
// is a vector, w_d(i, j) = prod_{j < t <= i} a_td with a = e^g, so a score sum_d x_id k_jd w_d(i, j)
// is no product of scaled rows. Split on the chunk's four 16-row blocks:
//   - rows i of block I >= 1 against columns j < r = 16 I: w_d(i, j) = L_id R_jd with
//     L_id = w_d(i, r) and R_jd = w_d(r, j), products of gates over disjoint spans, each in [0, 1]
//     for log-gates <= 0: no overflow and no difference of sums, so (X ⊙ L) (K ⊙ R^(I))^T runs on
//     the tensor cores, one R tile per block (16 I rows);
//   - the four 16 x 16 diagonal blocks in fp32 on the CUDA cores: per (j, channel) a running
//     product over i (16 x 16 x K / 2 multiply-adds per block and matrix, beside 64 x 64 x K
//     per product on the tensor cores).
// Every decay is a product of gate factors, so a reset (a -inf or <= kResetGate log-gate, whose
// factor is 0) zeros exactly the products that span it, with no reset bookkeeping, and a -1e9
// gate is a 0 factor too. The same split gives the intra-chunk output scores S (q in place of
// k), computed here once for every value tile and stored in fp32; the out kernel then reads
// w(i, -1) q^_i (stored 16-bit) and S, and the state walk the per-channel decay across the chunk.
template <int kK>
struct PrepKeySmem {
  using KTile = tc::SmemTile<kC, kK>;
  using CTile = tc::SmemTile<kC, kC>;
  using R1 = tc::SmemTile<16, kK>;
  using R2 = tc::SmemTile<32, kK>;
  using R3 = tc::SmemTile<48, kK>;
  static constexpr int kAStride = kC + 1;
  static constexpr uint32_t cmax(uint32_t a, uint32_t b) { return a > b ? a : b; }
  // regions, each reused by a later phase (after the '/'):
  static constexpr uint32_t kK_ = 0;                                          // K / K^ w(i, -1)
  static constexpr uint32_t kQ = kK_ + KTile::kBytes;                         // Q / T (fp32)
  static constexpr uint32_t kGa = kQ + cmax(KTile::kBytes, kC * kC * 4);      // a (fp32) / A (fp32)
  static constexpr uint32_t kR = kGa + cmax(kC * kK * 4, kC * kAStride * 4);  // R tiles / T Diag(b), V
  static constexpr uint32_t kL = kR + cmax(R1::kBytes + R2::kBytes + R3::kBytes, 2 * CTile::kBytes);  // Q ⊙ L / K ⊙ L
  static constexpr uint32_t kDg = kL + KTile::kBytes;  // the diagonal blocks, fp32 (2, 4, 16, 16): A's, S's
  static constexpr uint32_t kF = kDg + 2 * 4 * 16 * 16 * 4;
  static constexpr int kBytes = int(kF) + 3 * kC * 4;  // b (or 1), 1 / ||k||, scale / ||q||
  __device__ static uint32_t r(int blk) {  // R^(blk)'s tile, blk = 1, 2, 3
    return kR + (blk == 1 ? 0u : blk == 2 ? uint32_t(R1::kBytes) : uint32_t(R1::kBytes + R2::kBytes));
  }
};

// The off-diagonal scores of block kI's 16 rows: (X ⊙ L) (K ⊙ R^(kI))^T, columns [0, 16 kI), each
// handed to emit(i, j, x).
template <typename T, int kK, int kI, typename Emit>
__device__ __forceinline__ void off_diagonal(uint32_t xl, uint32_t rt, int lane, Emit&& emit) {
  float acc[2 * kI][4];
  linear_tc::zero(acc);
  linear_tc::mma_smem<T, tc::SmemTile<kC, kK>, tc::SmemTile<16 * kI, kK>, kK, 16 * kI, false>(acc, xl, 16 * kI, rt,
                                                                                               lane);
#pragma unroll
  for (int t = 0; t < 2 * kI; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) emit(acc_row(16 * kI, lane, e), acc_col(t, lane, e), acc[t][e]);
  }
}
template <typename T, int kK, typename Emit>
__device__ __forceinline__ void off_diagonal_rows(uint32_t sb, int warp, int lane, Emit&& emit) {
  using L = PrepKeySmem<kK>;
  if (warp == 1) off_diagonal<T, kK, 1>(sb + L::kL, sb + L::r(1), lane, emit);
  if (warp == 2) off_diagonal<T, kK, 2>(sb + L::kL, sb + L::r(2), lane, emit);
  if (warp == 3) off_diagonal<T, kK, 3>(sb + L::kL, sb + L::r(3), lane, emit);
}

template <typename T, int kK>
__global__ void __launch_bounds__(kThreads) delta_chunk_prep_key_kernel(const DeltaParams p, const DeltaChunkPlan plan) {
  using L = PrepKeySmem<kK>;
  using KTile = typename L::KTile;
  using CTile = typename L::CTile;
  ATTN_EXTERN_SMEM(smem);
  const uint32_t sb = tc::smem_u32(smem);
  float* Ga = reinterpret_cast<float*>(smem + L::kGa);  // (kC, kK): a_td
  float* Af = Ga;                                       // (kC, kAStride), once a is spent
  float* Tf = reinterpret_cast<float*>(smem + L::kQ);   // (kC, kC), once Q is spent
  float* Dg = reinterpret_cast<float*>(smem + L::kDg);  // A's then S's diagonal blocks, (4, 16, 16) each
  float* B = reinterpret_cast<float*>(smem + L::kF);
  float* NK = B + kC;
  float* NQ = NK + kC;

  const int64_t x = blockIdx.x;
  const int hv = blockIdx.y, hk = hv / (p.h_v / p.h_k);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const ChunkAt at = chunk_at(p, plan, x);
  const int n = at.n;
  if (n == 0) return;
  const int K = p.dim_k, V = p.dim_v, vp = plan.vp();
  const int64_t hs = int64_t(hv) * plan.slots + x;

  const T* qh = head_rows<T>(p.q, p.q_batch_stride, p.q_head_stride, at.b, hk) + at.row * p.q_row_stride;
  const T* kh = head_rows<T>(p.k, p.k_batch_stride, p.k_head_stride, at.b, hk) + at.row * p.k_row_stride;
  const T* vh = head_rows<T>(p.v, p.v_batch_stride, p.v_head_stride, at.b, hv) + at.row * p.v_row_stride;
  tc::load_tile_async<kC, kK, kThreads, T>(sb + L::kK_, kh, p.k_row_stride, n, K, tid);
  tc::load_tile_async<kC, kK, kThreads, T>(sb + L::kQ, qh, p.q_row_stride, n, K, tid);
  tc::cp_async_commit();
  const int64_t side = (int64_t(at.b) * p.h_v + hv) * p.s + at.row;
  // a = e^g: 1 past the chunk and the key width, 0 where e^g is (a reset)
  for (int e = tid; e < kC * kK; e += kThreads) {
    const int i = e / kK, d = e % kK;
    Ga[e] = i < n && d < K ? expf(delta_cuda::load_side(p.gate_dt, p.gate, (side + i) * K + d)) : 1.f;
  }
  if (tid < kC) B[tid] = tid < n ? (p.plain ? 1.f : delta_cuda::load_side(p.beta_dt, p.beta, side + tid)) : 0.f;
  tc::cp_async_wait<0>();
  __syncthreads();
  if (tid < kC) {
    NK[tid] = tid < n ? (p.qk_l2norm ? inv_norm<T, KTile, kK>(smem, L::kK_, tid, K, p.l2_eps) : 1.f) : 0.f;
    NQ[tid] = tid < n ? (p.qk_l2norm ? p.scale * inv_norm<T, KTile, kK>(smem, L::kQ, tid, K, p.l2_eps) : p.scale)
                      : 0.f;
  }

  // The diagonal blocks: warp w the block of rows [16 w, 16 w + 16), lane pair (2 jj, 2 jj + 1)
  // its column j = 16 w + jj, each lane half the channels (the pair's sums meet by a shuffle).
  // Every lane of a warp reads the same row (or two channels of it): broadcasts.
  {
    const int r = 16 * warp, jj = lane / 2, j = r + jj;
    float da[16], ds[16];
#pragma unroll
    for (int ii = 0; ii < 16; ++ii) da[ii] = ds[ii] = 0.f;
    for (int d = lane % 2; d < K; d += 2) {
      const float kj = linear_tc::ld16<T>(smem, L::kK_ + KTile::offset(j, d));
      float w = 0.f;
#pragma unroll
      for (int ii = 0; ii < 16; ++ii) {
        w = ii < jj ? 0.f : ii == jj ? 1.f : w * Ga[(r + ii) * kK + d];  // w_d(i, j), 0 above the diagonal
        const float y = kj * w;
        ds[ii] = fmaf(linear_tc::ld16<T>(smem, L::kQ + KTile::offset(r + ii, d)), y, ds[ii]);
        da[ii] = fmaf(linear_tc::ld16<T>(smem, L::kK_ + KTile::offset(r + ii, d)), y, da[ii]);
      }
    }
#pragma unroll
    for (int ii = 0; ii < 16; ++ii) {
      da[ii] += __shfl_xor_sync(0xffffffffu, da[ii], 1);
      ds[ii] += __shfl_xor_sync(0xffffffffu, ds[ii], 1);
      if (lane % 2 == 0) {
        Dg[(r + ii) * 16 + jj] = da[ii];
        Dg[4 * 256 + (r + ii) * 16 + jj] = ds[ii];
      }
    }
  }
  __syncthreads();

  // Per channel d (thread d): the R tiles, K~ = w(n-1, j) k^_j (the state walk's operand, to the
  // scratch), Q ⊙ L (the S products' left operand), w(i, -1) q^_i (the out kernel's, to the
  // scratch) and w(n-1, -1) (the state's decay across the chunk, to the scalars).
  if (tid < kK) {
    const int d = tid;
#pragma unroll 1
    for (int blk = 1; blk < 4; ++blk) {
      const uint32_t rt = L::r(blk);
      float w = 1.f;
      for (int j = 16 * blk - 1; j >= 0; --j) {  // w_d(16 blk, j)
        w *= Ga[(j + 1) * kK + d];
        const float kj = linear_tc::ld16<T>(smem, L::kK_ + KTile::offset(j, d));
        linear_tc::st16<T>(smem, rt + tc::SmemTile<48, kK>::offset(j, d), kj * w);
      }
    }
    T* kt = static_cast<T*>(plan.kt) + hs * kC * kK;
    float w = 1.f;
    for (int j = kC - 1; j >= 0; --j) {  // w_d(n - 1, j), zeros past the chunk
      const float kj = j < n ? linear_tc::ld16<T>(smem, L::kK_ + KTile::offset(j, d)) * NK[j] * w : 0.f;
      kt[j * kK + d] = from_float<T>(kj);
      if (j < n) w *= Ga[j * kK + d];
    }
    T* qd = static_cast<T*>(plan.qd) + hs * kC * kK;
    float e = 1.f, l = 1.f;
    for (int i = 0; i < kC; ++i) {
      const float a = Ga[i * kK + d];
      e *= a;                          // w_d(i, -1)
      l = i % 16 == 0 ? 1.f : l * a;   // w_d(i, 16 floor(i / 16))
      const float qi = linear_tc::ld16<T>(smem, L::kQ + KTile::offset(i, d));
      linear_tc::st16<T>(smem, L::kL + KTile::offset(i, d), qi * l);
      qd[i * kK + d] = from_float<T>(qi * NQ[i] * e);
      if (i == n - 1) plan.scal[hs * kScalars + kKeyDecay + d] = e;
    }
  }
  __syncthreads();

  // S = the intra-chunk output scores, masked (j <= i < n) and scaled, fp32 to the scratch:
  // warp w's rows, columns before its block from the products, its block from Dg, zeros after
  float* sc = plan.sc + hs * kC * kC;
  off_diagonal_rows<T, kK>(sb, warp, lane, [&](int i, int j, float s) {
    sc[i * kC + j] = i < n ? NQ[i] * NK[j] * s : 0.f;
  });
  for (int e = lane; e < 16 * (kC - 16 * warp); e += 32) {
    const int w0 = 16 * warp, i = w0 + e / (kC - w0), j = w0 + e % (kC - w0);
    sc[i * kC + j] = j <= i && i < n ? NQ[i] * NK[j] * Dg[4 * 256 + i * 16 + (j - w0)] : 0.f;
  }
  __syncthreads();

  // K ⊙ L over Q ⊙ L, and K^ w(i, -1) (W's operand) over K in place (thread d reads and writes
  // channel d only)
  if (tid < kK) {
    const int d = tid;
    float e = 1.f, l = 1.f;
    for (int i = 0; i < kC; ++i) {
      const float a = Ga[i * kK + d];
      e *= a;
      l = i % 16 == 0 ? 1.f : l * a;
      const float ki = linear_tc::ld16<T>(smem, L::kK_ + KTile::offset(i, d));
      linear_tc::st16<T>(smem, L::kL + KTile::offset(i, d), ki * l);
      linear_tc::st16<T>(smem, L::kK_ + KTile::offset(i, d), ki * NK[i] * e);
    }
  }
  __syncthreads();

  // A = strictly lower (b_i k^_i . decayed k^_j) over a (spent): 0 for the plain write
  const float ab = p.plain ? 0.f : 1.f;
  // (the backward keeps A / b, its dbeta's term, and the row factors)
  float* aa = plan.aa != nullptr ? plan.aa + hs * kC * kC : nullptr;
  off_diagonal_rows<T, kK>(sb, warp, lane, [&](int i, int j, float s) {
    const float a = i < n ? NK[i] * NK[j] * s : 0.f;
    Af[i * L::kAStride + j] = ab * B[i] * a;
    if (aa != nullptr) aa[i * kC + j] = a;
  });
  for (int e = lane; e < 16 * (kC - 16 * warp); e += 32) {
    const int w0 = 16 * warp, i = w0 + e / (kC - w0), j = w0 + e % (kC - w0);
    const float a = j < i && i < n ? NK[i] * NK[j] * Dg[i * 16 + (j - w0)] : 0.f;
    Af[i * L::kAStride + j] = ab * B[i] * a;
    if (aa != nullptr) aa[i * kC + j] = a;
  }
  if (plan.t != nullptr && tid < kC) {
    plan.scal[hs * kScalars + 2 * kC + tid] = NK[tid];
    plan.scal[hs * kScalars + 4 * kC + tid] = NQ[tid];
  }
  __syncthreads();

  t_solve<L::kAStride>(Af, Tf, tid);
  __syncthreads();

  // T Diag(b) (T = I for the plain write), the W and U products' left operand, over the R tiles
  // (spent); W = 0 for the plain write (ab: T Diag(0))
  const uint32_t kTb = L::kR, kTw = L::kR + CTile::kBytes, kV = L::kL;
  T* tg = plan.t != nullptr ? static_cast<T*>(plan.t) + hs * kC * kC : nullptr;
  for (int e = tid; e < kC * kC; e += kThreads) {
    const int i = e / kC, j = e % kC;
    if (tg != nullptr) tg[e] = from_float<T>(Tf[e]);
    linear_tc::st16<T>(smem, kTb + CTile::offset(i, j), Tf[e] * B[j]);
    linear_tc::st16<T>(smem, kTw + CTile::offset(i, j), Tf[e] * B[j] * ab);
  }
  __syncthreads();
  w_u_products<T, kK>(p, plan, hs, smem, kTw, kTb, L::kK_, kV, vh, n, warp, lane, tid);
}

// A (kRows, kBV) 16-bit shared tile to global rows (stride ld) by 16-byte vectors.
template <typename T, typename Tile, int kRows>
__device__ __forceinline__ void store_tile(T* dst, int64_t ld, uint32_t tile, int tid) {
  constexpr int kVecs = kRows * kBV / 8;
#pragma unroll
  for (int e = tid; e < kVecs; e += kThreads) {
    const int r = e / (kBV / 8), c = e % (kBV / 8) * 8;
    *reinterpret_cast<uint4*>(dst + int64_t(r) * ld + c) = tc::ld_shared_v4(tile + Tile::offset(r, c));
  }
}

// ------------------------------------------------------------------------------ state slabs
// A walk's (kK, kBV) slab of a state (or of its gradient) in mma accumulators: warp w holds rows
// [w kK / 4, (w + 1) kK / 4) as kMT = kK / 64 row tiles of 16, all kBV columns. Its element e of
// n-tile t of row tile m is row slab_row(..), column acc_col(t, lane, e).
template <int kK>
__device__ __forceinline__ int slab_row(int warp, int m, int lane, int e) {
  return acc_row(warp * (kK / 4) + 16 * m, lane, e);
}

// The slab from columns [c0, c0 + kBV) of a (K, V) float32 matrix (null: zeros; rows past K and
// columns past V: zeros), and back (rows and columns past them skipped).
template <int kK, int kMT>
__device__ __forceinline__ void load_slab(float (&h)[kMT][kBV / 8][4], const float* src, int K, int V, int c0,
                                          int warp, int lane) {
#pragma unroll
  for (int m = 0; m < kMT; ++m) {
#pragma unroll
    for (int t = 0; t < kBV / 8; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = slab_row<kK>(warp, m, lane, e), c = c0 + acc_col(t, lane, e);
        h[m][t][e] = src != nullptr && r < K && c < V ? src[int64_t(r) * V + c] : 0.f;
      }
    }
  }
}
template <int kK, int kMT>
__device__ __forceinline__ void store_slab(const float (&h)[kMT][kBV / 8][4], float* dst, int K, int V, int c0,
                                           int warp, int lane) {
  if (dst == nullptr) return;
#pragma unroll
  for (int m = 0; m < kMT; ++m) {
#pragma unroll
    for (int t = 0; t < kBV / 8; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = slab_row<kK>(warp, m, lane, e), c = c0 + acc_col(t, lane, e);
        if (r < K && c < V) dst[int64_t(r) * V + c] = h[m][t][e];
      }
    }
  }
}

// The slab rounded to T into a (kK, kBV) shared tile (the walks' per-chunk operand).
template <typename T, typename HTile, int kK, int kMT>
__device__ __forceinline__ void slab_to_tile(const float (&h)[kMT][kBV / 8][4], uint32_t tile, int warp, int lane) {
  using Ops = tc::TypeOps<T>;
#pragma unroll
  for (int m = 0; m < kMT; ++m) {
#pragma unroll
    for (int t = 0; t < kBV / 8; ++t) {
      const int r = slab_row<kK>(warp, m, lane, 0), c = acc_col(t, lane, 0);
      tc::st_shared_b32(tile + HTile::offset(r, c), Ops::pack(h[m][t][0], h[m][t][1]));
      tc::st_shared_b32(tile + HTile::offset(r + 8, c), Ops::pack(h[m][t][2], h[m][t][3]));
    }
  }
}

// h <- f h (a chunk's decay w(n-1, -1)).
template <int kMT>
__device__ __forceinline__ void scale_slab(float (&h)[kMT][kBV / 8][4], float f) {
#pragma unroll
  for (int m = 0; m < kMT; ++m) {
#pragma unroll
    for (int t = 0; t < kBV / 8; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) h[m][t][e] *= f;
    }
  }
}

// h += X^T Y: X (kC, kK) at x (rows the chunk's tokens: A = X^T by ldmatrix.trans), Y (kC, kBV) at y.
template <typename T, typename XTile, typename YTile, int kK, int kMT>
__device__ __forceinline__ void add_xt_y(float (&h)[kMT][kBV / 8][4], uint32_t x, uint32_t y, int warp, int lane) {
  const uint32_t bo = YTile::lane_bt(0, lane);
#pragma unroll
  for (int m = 0; m < kMT; ++m) {
#pragma unroll
    for (int kb = 0; kb < kC / 16; ++kb) {
      uint32_t af[4];
      lda_trans<XTile>(af, x, 16 * kb, warp * (kK / 4) + 16 * m, lane);
#pragma unroll
      for (int np = 0; np < kBV / 16; ++np) {
        uint32_t bf[4];
        tc::ldmatrix_x4_trans(bf, y + YTile::advance(bo, kb * 16, np * 16));
        tc::mma_n16<T>(h[m][2 * np], af, bf);
      }
    }
  }
}

// h <- Diag(f) h, f (kK) the per-key decay across a chunk: each thread's rows' factors.
template <int kK, int kMT>
__device__ __forceinline__ void scale_slab_rows(float (&h)[kMT][kBV / 8][4], const float* f, int warp, int lane) {
#pragma unroll
  for (int m = 0; m < kMT; ++m) {
    const float f0 = f[slab_row<kK>(warp, m, lane, 0)], f1 = f[slab_row<kK>(warp, m, lane, 2)];
#pragma unroll
    for (int t = 0; t < kBV / 8; ++t) {
      h[m][t][0] *= f0;
      h[m][t][1] *= f0;
      h[m][t][2] *= f1;
      h[m][t][3] *= f1;
    }
  }
}

// w(n-1, -1) of the chunk at slot hs of `len` rows, chunk c: the state's decay across it.
__device__ __forceinline__ float chunk_decay(const DeltaChunkPlan& plan, int64_t hs, int len, int c) {
  const int n = min(kC, len - c * kC);
  return plan.scal[hs * kScalars + 3 * kC + n - 1];
}

// ------------------------------------------------------------------------------ state walk
template <int kK>
struct StateSmem {
  using KTile = tc::SmemTile<kC, kK>;   // W, K~
  using CTile = tc::SmemTile<kC, kBV>;  // U, u
  using HTile = tc::SmemTile<kK, kBV>;  // h, rounded
  // two stages of (W, K~, U), then h and u
  static constexpr uint32_t kStage = 2 * KTile::kBytes + CTile::kBytes;
  static constexpr uint32_t kH = 2 * kStage, kU = kH + HTile::kBytes;
  static constexpr int kBytes = int(kU + CTile::kBytes);
  __device__ static uint32_t w(int s) { return s * kStage; }
  __device__ static uint32_t kt(int s) { return s * kStage + KTile::kBytes; }
  __device__ static uint32_t uin(int s) { return s * kStage + 2 * KTile::kBytes; }
};

// kPerKey: the decay across a chunk per key channel (delta_chunk_prep_key_kernel's), else one per
// chunk.
template <typename T, int kK, bool kPerKey>
__global__ void __launch_bounds__(kThreads, 1) delta_chunk_state_kernel(const DeltaParams p, const DeltaChunkPlan plan) {
  using L = StateSmem<kK>;
  using KTile = typename L::KTile;
  using CTile = typename L::CTile;
  using HTile = typename L::HTile;
  using Ops = tc::TypeOps<T>;
  constexpr int kMT = kK / 64;  // 16-row tiles of h per warp (kK / 4 rows)
  ATTN_EXTERN_SMEM(smem);
  const uint32_t sb = tc::smem_u32(smem);
  const int tile = blockIdx.x, hv = blockIdx.y, seq = blockIdx.z, c0 = tile * kBV;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int K = p.dim_k, V = p.dim_v, vp = plan.vp();
  int len = p.s;
  if (p.cu_seqlens != nullptr) len = p.cu_seqlens[seq + 1] - p.cu_seqlens[seq];
  const int nc = (len + kC - 1) / kC;
  const int64_t hs0 = int64_t(hv) * plan.slots + seq_base(p, plan, seq);  // (head, first slot)
  const int64_t st0 = (int64_t(seq) * p.h_v + hv) * K * V;

  float h[kMT][kBV / 8][4];
  load_slab<kK>(h, p.init_state != nullptr ? p.init_state + st0 : nullptr, K, V, c0, warp, lane);

  // tid and lane pass through opaque() per chunk: otherwise the compiler hoists every copy's and
  // product's shared address out of the walk, one register each (spills at kK = 128)
  auto load_chunk = [&](int c, int tid) {
    const int64_t hs = hs0 + c;
    const int s = c & 1;
    tc::load_tile_async<kC, kK, kThreads, T>(sb + L::w(s), static_cast<const T*>(plan.w) + hs * kC * kK, kK, kC, kK, tid);
    tc::load_tile_async<kC, kK, kThreads, T>(sb + L::kt(s), static_cast<const T*>(plan.kt) + hs * kC * kK, kK, kC, kK,
                                             tid);
    tc::load_tile_async<kC, kBV, kThreads, T>(sb + L::uin(s), static_cast<const T*>(plan.u) + hs * kC * vp + c0, vp, kC,
                                              kBV, tid);
  };
  if (nc > 0) load_chunk(0, tid);
  tc::cp_async_commit();

#pragma unroll 1
  for (int c = 0; c < nc; ++c) {
    const int s = c & 1;
    const int64_t hs = hs0 + c;
    const int lane = linear_tc::opaque(threadIdx.x % 32);
    if (c + 1 < nc) load_chunk(c + 1, linear_tc::opaque(tid));
    tc::cp_async_commit();
    // h, rounded: the operand of W h here and of the outputs' product (stored from the tile)
    slab_to_tile<T, HTile, kK>(h, sb + L::kH, warp, lane);
    tc::cp_async_wait<1>();  // chunk c's tiles (the group before the one just committed)
    __syncthreads();
    store_tile<T, HTile, kK>(static_cast<T*>(plan.hc) + hs * kK * vp + c0, vp, sb + L::kH, linear_tc::opaque(tid));

    // u = U - W h: rows [16 w, 16 w + 16) into u's tile, then stored over U
    {
      float acc[kBV / 8][4];
      linear_tc::zero(acc);
      linear_tc::mma_smem<T, KTile, HTile, kK, kBV, true>(acc, sb + L::w(s), 16 * warp, sb + L::kH, lane);
#pragma unroll
      for (int t = 0; t < kBV / 8; ++t) {
        const int i = acc_row(16 * warp, lane, 0), cc = acc_col(t, lane, 0);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = i + 8 * half;
          const float2 x = Ops::unpack(*reinterpret_cast<const uint32_t*>(smem + L::uin(s) + CTile::offset(r, cc)));
          tc::st_shared_b32(sb + L::kU + CTile::offset(r, cc),
                            Ops::pack(x.x - acc[t][2 * half], x.y - acc[t][2 * half + 1]));
        }
      }
    }
    __syncthreads();
    store_tile<T, CTile, kC>(static_cast<T*>(plan.u) + hs * kC * vp + c0, vp, sb + L::kU, linear_tc::opaque(tid));

    // h <- w(n-1, -1) h + K~^T u: A = K~^T from K~'s row-major tile by ldmatrix.trans
    if constexpr (kPerKey) {
      scale_slab_rows<kK>(h, plan.scal + hs * kScalars + kKeyDecay, warp, lane);
    } else {
      scale_slab(h, chunk_decay(plan, hs, len, c));
    }
    add_xt_y<T, KTile, CTile, kK>(h, sb + L::kt(s), sb + L::kU, warp, lane);
    __syncthreads();  // h's and u's tiles and stage s are free for the next chunk
  }

  store_slab<kK>(h, p.final_state != nullptr ? p.final_state + st0 : nullptr, K, V, c0, warp, lane);
}

// acc += S B with S (the warp's 16 rows of fp32 scores in accumulators) as hi + lo, both 16-bit,
// B the (kC, kCols) tile at b: the scores' rounding would otherwise add a rounding to every
// result; the second product costs 64 x 64 x kCols per warp.
template <typename T, int kCols>
__device__ __forceinline__ void mma_reg_split(float (&acc)[kCols / 8][4], const float (&s)[kC / 8][4], uint32_t b,
                                              int lane) {
  using CTile = tc::SmemTile<kC, kCols>;
  float lo[kC / 8][4];
#pragma unroll
  for (int t = 0; t < kC / 8; ++t) {
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      const float2 hi = tc::TypeOps<T>::unpack(tc::TypeOps<T>::pack(s[t][e], s[t][e + 1]));
      lo[t][e] = s[t][e] - hi.x;
      lo[t][e + 1] = s[t][e + 1] - hi.y;
    }
  }
  linear_tc::mma_reg<T, CTile, kC, kCols>(acc, s, b, lane);
  linear_tc::mma_reg<T, CTile, kC, kCols>(acc, lo, b, lane);
}

// o += P u (P: the warp's 16 rows of intra-chunk scores, split hi + lo: u's and the output's
// roundings are then the only ones), then rows < n of the warp stored to the output's value
// columns [c0, c0 + kBV).
template <typename T, int kCols>
__device__ __forceinline__ void out_tail(float (&o)[kCols / 8][4], const float (&s)[kC / 8][4], uint32_t ut,
                                         const DeltaParams& p, const ChunkAt& at, int hv, int c0, int n, int warp,
                                         int lane) {
  mma_reg_split<T, kCols>(o, s, ut, lane);

  T* oh = static_cast<T*>(p.o) + int64_t(at.b) * p.o_batch_stride + int64_t(hv) * p.o_head_stride +
          at.row * p.o_row_stride;
  const int V = p.dim_v;
#pragma unroll
  for (int t = 0; t < kCols / 8; ++t) {
    const int i = acc_row(16 * warp, lane, 0), c = c0 + acc_col(t, lane, 0);
    if (c < V) {
      if (i < n) st_pair(oh + int64_t(i) * p.o_row_stride + c, o[t][0], o[t][1]);
      if (i + 8 < n) st_pair(oh + int64_t(i + 8) * p.o_row_stride + c, o[t][2], o[t][3]);
    }
  }
}

// ------------------------------------------------------------------------------ outputs
template <int kK>
struct OutSmem {
  using KTile = tc::SmemTile<kC, kK>;   // Q, K
  using CTile = tc::SmemTile<kC, kBV>;  // u
  using HTile = tc::SmemTile<kK, kBV>;  // the entering state
  static constexpr uint32_t kQ = 0, kK_ = KTile::kBytes, kH = 2 * KTile::kBytes, kU = kH + HTile::kBytes,
                            kF = kU + CTile::kBytes;
  static constexpr int kBytes = int(kF) + 5 * kC * 4;
};

template <typename T, int kK>
__global__ void __launch_bounds__(kThreads) delta_chunk_out_kernel(const DeltaParams p, const DeltaChunkPlan plan) {
  using L = OutSmem<kK>;
  using KTile = typename L::KTile;
  using CTile = typename L::CTile;
  using HTile = typename L::HTile;
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
  const int K = p.dim_k, V = p.dim_v, vp = plan.vp();
  const int64_t hs = int64_t(hv) * plan.slots + x;

  const T* qh = head_rows<T>(p.q, p.q_batch_stride, p.q_head_stride, at.b, hk) + at.row * p.q_row_stride;
  const T* kh = head_rows<T>(p.k, p.k_batch_stride, p.k_head_stride, at.b, hk) + at.row * p.k_row_stride;
  tc::load_tile_async<kC, kK, kThreads, T>(sb + L::kQ, qh, p.q_row_stride, n, K, tid);
  tc::load_tile_async<kC, kK, kThreads, T>(sb + L::kK_, kh, p.k_row_stride, n, K, tid);
  tc::load_tile_async<kK, kBV, kThreads, T>(sb + L::kH, static_cast<const T*>(plan.hc) + hs * kK * vp + c0, vp, kK, kBV,
                                            tid);
  tc::load_tile_async<kC, kBV, kThreads, T>(sb + L::kU, static_cast<const T*>(plan.u) + hs * kC * vp + c0, vp, kC, kBV,
                                            tid);
  tc::cp_async_commit();
  if (tid < kC) {
    const float* sc = plan.scal + hs * kScalars;
    G[tid] = sc[tid];
    F[tid] = sc[kC + tid];
    NK[tid] = sc[2 * kC + tid];
    E[tid] = sc[3 * kC + tid];
  }
  tc::cp_async_wait<0>();
  __syncthreads();
  if (tid < kC) {
    NQ[tid] = tid < n ? (p.qk_l2norm ? p.scale * inv_norm<T, KTile, kK>(smem, L::kQ, tid, K, p.l2_eps) : p.scale)
                      : 0.f;
  }
  __syncthreads();

  float o[kBV / 8][4];
  linear_tc::zero(o);
  linear_tc::mma_smem<T, KTile, HTile, kK, kBV, true>(o, sb + L::kQ, 16 * warp, sb + L::kH, lane);
  float s[kC / 8][4];
  linear_tc::zero(s);
  linear_tc::mma_smem<T, KTile, KTile, kK, kC, false>(s, sb + L::kQ, 16 * warp, sb + L::kK_, lane);
#pragma unroll
  for (int t = 0; t < kBV / 8; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = acc_row(16 * warp, lane, e);
      o[t][e] *= NQ[i] * E[i];
    }
  }
#pragma unroll
  for (int t = 0; t < kC / 8; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = acc_row(16 * warp, lane, e), j = acc_col(t, lane, e);
      s[t][e] = j <= i && i < n ? NQ[i] * NK[j] * decay(G, F, i, j) * s[t][e] : 0.f;
    }
  }
  out_tail<T, kBV>(o, s, sb + L::kU, p, at, hv, c0, n, warp, lane);
}


// The outputs with per-key gates: o = (w(i, -1) q^_i) h0 + S u, both operands from the prep's
// scratch (no gates or keys read here).
template <int kK>
struct OutKeySmem {
  using KTile = tc::SmemTile<kC, kK>;   // w(i, -1) q^_i
  using CTile = tc::SmemTile<kC, kBV>;  // u
  using HTile = tc::SmemTile<kK, kBV>;  // the entering state
  static constexpr uint32_t kQ = 0, kH = KTile::kBytes, kU = kH + HTile::kBytes;
  static constexpr int kBytes = int(kU + CTile::kBytes);
};

template <typename T, int kK>
__global__ void __launch_bounds__(kThreads) delta_chunk_out_key_kernel(const DeltaParams p, const DeltaChunkPlan plan) {
  using L = OutKeySmem<kK>;
  using KTile = typename L::KTile;
  using HTile = typename L::HTile;
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

  tc::load_tile_async<kC, kK, kThreads, T>(sb + L::kQ, static_cast<const T*>(plan.qd) + hs * kC * kK, kK, kC, kK, tid);
  tc::load_tile_async<kK, kBV, kThreads, T>(sb + L::kH, static_cast<const T*>(plan.hc) + hs * kK * vp + c0, vp, kK, kBV,
                                            tid);
  tc::load_tile_async<kC, kBV, kThreads, T>(sb + L::kU, static_cast<const T*>(plan.u) + hs * kC * vp + c0, vp, kC, kBV,
                                            tid);
  tc::cp_async_commit();
  // the warp's score rows from the scratch while the tiles arrive
  const float* sc = plan.sc + hs * kC * kC;
  float s[kC / 8][4];
#pragma unroll
  for (int t = 0; t < kC / 8; ++t) {
    const int i = acc_row(16 * warp, lane, 0), j = acc_col(t, lane, 0);
    const float2 a = *reinterpret_cast<const float2*>(sc + i * kC + j);
    const float2 b = *reinterpret_cast<const float2*>(sc + (i + 8) * kC + j);
    s[t][0] = a.x;
    s[t][1] = a.y;
    s[t][2] = b.x;
    s[t][3] = b.y;
  }
  tc::cp_async_wait<0>();
  __syncthreads();

  float o[kBV / 8][4];
  linear_tc::zero(o);
  linear_tc::mma_smem<T, KTile, HTile, kK, kBV, true>(o, sb + L::kQ, 16 * warp, sb + L::kH, lane);
  out_tail<T, kBV>(o, s, sb + L::kU, p, at, hv, c0, n, warp, lane);
}

}  // namespace delta_chunk
}  // namespace attn
