// Building blocks shared by the tensor-core forward (mma_fwd_kernel.cuh) and backward
// (mma_bwd_kernel.cuh) of the linear attention family: the CTA shape, 16-bit staging, the
// fp32 state slab with its scaled 16-bit operand copy, and the two product shapes every chunk
// product is made of (operands in swizzled shared tiles, or the A operand in registers).
//
// The state slab of a CTA is (kM, kN): kM feature rows x the CTA's kN value columns, fp32 in
// shared memory (a running sum, never rounded), plus a 16-bit copy S16 = S / sigma that feeds
// the tensor cores. fp16 has a narrow range and the state grows with the sequence, so sigma is
// a power of 2 (exact) that keeps |S / sigma| <= 2^14 and products with S16 are multiplied back
// by sigma in fp32; bf16 has fp32's range (sigma = 1). A layout L names its tiles' offsets:
// kS (the 16-bit copy, L::STile) and whatever the products read.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "common/linear_params.h"
#include "cuda/mma.cuh"
#include "linear/cuda/mma_products.cuh"  // 16-bit shared access, the two product shapes
#include "linear/cuda/simt_kernel.cuh"   // Seq, feature, row scalars, dtype conversion

namespace attn {
namespace linear_tc {

using linear_simt::kChunk;
using linear_simt::Params;
using linear_simt::BwdParams;
constexpr int kWarps = kChunk / 16;  // warp w owns chunk rows [16w, 16w + 16)
constexpr int kThreads = 32 * kWarps;
// The kernels declare __launch_bounds__(kThreads, 1): without the explicit minimum, ptxas for
// sm_90a capped the fp16 forward near 128 registers and spilled; one CTA per SM is the
// budget the shared memory (~100 KB at kM = 128) sets anyway.
constexpr int kN = 64;  // value columns per CTA
static_assert(kThreads >= kChunk, "one thread per chunk row for the per-row scalars");

// sigma for a slab whose entries this thread's part has max |x| = mx: the block-wide max, then
// the power of 2 that keeps |S / sigma| <= 2^14 (1 below that). Every thread calls it; red is
// kWarps floats of shared memory, free again on return.
__device__ __forceinline__ float fp16_sigma(float mx, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = mx;
  __syncthreads();
  mx = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, red[w]);
  __syncthreads();
  return mx > 16384.f ? exp2f(ceilf(log2f(mx / 16384.f))) : 1.f;
}

// The 16-bit copy of the fp32 state Sf (kM, kN) at L::kS; returns its scale sigma (S16 = S /
// sigma). Every thread calls it, after a barrier that follows the last write of Sf and the
// last read of the old copy (block-wide max for fp16).
template <typename T, typename L, int kM>
__device__ __forceinline__ float refresh_s16(unsigned char* smem, const float* Sf, float* red) {
  float sigma = 1.f;
  if constexpr (std::is_same_v<T, __half>) {
    float mx = 0.f;
    for (int e = threadIdx.x; e < kM * kN; e += kThreads) mx = fmaxf(mx, fabsf(Sf[e]));
    sigma = fp16_sigma(mx, red);
  }
  const float inv = 1.f / sigma;
  for (int e = threadIdx.x; e < kM * kN; e += kThreads) {
    st16<T>(smem, L::kS + L::STile::offset(e / kN, e % kN), Sf[e] * inv);
  }
  __syncthreads();
  return sigma;
}

// Sf <- f Sf + Xt Y: Xt (kM, kChunk) a transposed weighted copy (L::KtTile at xt), Y (kChunk, kN)
// (L::VTile at y); 16-row tiles of the state over the warps. The forward's S update with
// (wk K~)^T and V, the backward's reverse state U with (wq Q~)^T and dO'.
template <typename T, typename L, int kM>
__device__ __forceinline__ void add_outer(float* Sf, uint32_t xt, uint32_t y, float f, int warp, int lane) {
  for (int rt = warp; rt < kM / 16; rt += kWarps) {
    float acc[kN / 8][4];
    zero(acc);
    mma_smem<T, typename L::KtTile, typename L::VTile, kChunk, kN, true>(acc, xt, rt * 16, y, lane);
#pragma unroll
    for (int t = 0; t < kN / 8; ++t) {
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const int r = acc_row(rt * 16, lane, x), c = acc_col(t, lane, x);
        Sf[r * kN + c] = f * Sf[r * kN + c] + acc[t][x];
      }
    }
  }
}

// The chunk-parallel kernels' cut of the sequence and their scratch (dispatch.cu sizes both):
// segments of whole chunks; per (sequence, head) the forward states entering each segment (the
// forward's kSegState writes each segment's local state, seg_scan_kernel turns them into these in
// place; slot n_seg: the final state), the backward's reverse states at each segment's end
// (likewise; slot n_seg: the reverse state at the sequence start) and each segment's summed log-decay.
struct SegPlan {
  int n_seg = 1;     // segments per sequence
  int seg_rows = 0;  // rows per segment, a multiple of kChunk
  float* states = nullptr;   // (nb, H, n_seg + 1, M, dim_v_aug)
  float* ustates = nullptr;  // (nb, H, n_seg + 1, M, dim_v_aug), the backward only
  float* gtot = nullptr;     // (nb, H, n_seg)
  __device__ static int64_t slot(const Params& p, int n_seg, int b, int h, int s) {
    return ((int64_t(b) * p.h + h) * (n_seg + 1) + s) * int64_t(p.d) * p.dim_v_aug;
  }
  __device__ float* state(const Params& p, int b, int h, int s) const { return states + slot(p, n_seg, b, h, s); }
  __device__ float* ustate(const Params& p, int b, int h, int s) const { return ustates + slot(p, n_seg, b, h, s); }
};

// Row `i * rows` clamped to len, without an int overflow of the product.
__device__ __forceinline__ int clamp_rows(int64_t i, int rows, int len) {
  const int64_t r = i * rows;
  return r < len ? int(r) : len;
}

// ---------------------------------------------------------------- 16-byte staging
// The chunk-parallel kernels stage a chunk's (kChunk, kCols) 16-bit rows from 16-byte loads, all
// of a thread's loads issued before the first is used (one memory round trip per chunk, where a
// plain loop may wait once per element). Thread tid owns the 8-element vectors tid + j * kThreads
// of the tile, j < kVecs; vec_i / vec_c name their row and first column. The caller checks that
// whole vectors are in or out (widths and row strides multiples of 8, rows 16-byte aligned).
template <typename T>
__device__ __forceinline__ bool aligned16(const T* ptr) {
  return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0;
}

template <int kCols>
struct RowVecs {
  static constexpr int kRowVecs = kCols / 8, kVecs = kChunk * kRowVecs / kThreads;
  static_assert(kChunk * kRowVecs % kThreads == 0, "whole vectors per thread");
  uint4 r[kVecs];
  __device__ __forceinline__ static int vec_i(int tid, int j) { return (tid + j * kThreads) / kRowVecs; }
  __device__ __forceinline__ static int vec_c(int tid, int j) { return (tid + j * kThreads) % kRowVecs * 8; }
  // rows [r0, r0 + n) x columns [0, ncols) of base (row stride rs); 0 elsewhere, for rows with
  // kmul 0 (a padded key: not read) when kmul is given, and everywhere when !on
  template <typename T>
  __device__ __forceinline__ void load(const T* base, int64_t rs, int r0, int n, int ncols, const float* kmul, bool on,
                                       int tid) {
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int i = vec_i(tid, j), c = vec_c(tid, j);
      const bool ok = on && i < n && c < ncols && (kmul == nullptr || kmul[i] != 0.f);
      r[j] = ok ? *reinterpret_cast<const uint4*>(base + int64_t(r0 + i) * rs + c) : make_uint4(0u, 0u, 0u, 0u);
    }
  }
};

// Features of loaded Q or K vectors into the (kChunk, kM) tile at `tile` and, when `tr`, times
// w[i] into the transposed (kM, kChunk) tile at `tr_tile`: x -> phi(x) * mul[i] (mul null: * scale);
// rows past n, columns past m and (mul) rows with mul 0 are stored as 0, not phi(0).
template <typename T, typename Tile, typename TrTile, int kM>
__device__ __forceinline__ void store_features(unsigned char* smem, uint32_t tile, uint32_t tr_tile, const RowVecs<kM>& v,
                                               const Params& p, int n, const float* mul, const float* w, bool tr,
                                               int tid) {
  using Ops = tc::TypeOps<T>;
#pragma unroll
  for (int j = 0; j < RowVecs<kM>::kVecs; ++j) {
    const int i = RowVecs<kM>::vec_i(tid, j), c = RowVecs<kM>::vec_c(tid, j);
    const bool live = i < n && c < p.d && (mul == nullptr || mul[i] != 0.f);
    const float f = live ? (mul != nullptr ? mul[i] : p.scale) : 0.f;
    const float wi = tr && live ? w[i] : 0.f;
    const uint32_t in[4] = {v.r[j].x, v.r[j].y, v.r[j].z, v.r[j].w};
    uint32_t o[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const float2 x = Ops::unpack(in[t]);
      const float a = live ? linear_simt::feature(p.feature_map, x.x) * f : 0.f;
      const float b = live ? linear_simt::feature(p.feature_map, x.y) * f : 0.f;
      o[t] = Ops::pack(a, b);
      if (tr) {
        st16<T>(smem, tr_tile + TrTile::offset(c + 2 * t, i), a * wi);
        st16<T>(smem, tr_tile + TrTile::offset(c + 2 * t + 1, i), b * wi);
      }
    }
    *reinterpret_cast<uint4*>(smem + tile + Tile::offset(i, c)) = make_uint4(o[0], o[1], o[2], o[3]);
  }
}

// Loaded vectors into the (kChunk, kCols) tile at `tile` as they are (V), or times inv[i] (dO').
template <typename T, typename Tile, int kCols>
__device__ __forceinline__ void store_rows(unsigned char* smem, uint32_t tile, const RowVecs<kCols>& v, const float* inv,
                                           int tid) {
  using Ops = tc::TypeOps<T>;
#pragma unroll
  for (int j = 0; j < RowVecs<kCols>::kVecs; ++j) {
    const int i = RowVecs<kCols>::vec_i(tid, j), c = RowVecs<kCols>::vec_c(tid, j);
    uint4 o = v.r[j];
    if (inv != nullptr) {
      const float s = inv[i];
      uint32_t w[4] = {o.x, o.y, o.z, o.w};
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const float2 x = Ops::unpack(w[t]);
        w[t] = Ops::pack(x.x * s, x.y * s);
      }
      o = make_uint4(w[0], w[1], w[2], w[3]);
    }
    *reinterpret_cast<uint4*>(smem + tile + Tile::offset(i, c)) = o;
  }
}

// The (M, dim_v_aug) fp32 state matrix of (b, h) in a (B, H, M, dim_v_aug) tensor, or null.
__device__ __forceinline__ const float* state_at(const float* t, const Params& p, int b, int h) {
  return t == nullptr ? nullptr : t + (int64_t(b) * p.h + h) * int64_t(p.d) * p.dim_v_aug;
}
__device__ __forceinline__ float* state_at(float* t, const Params& p, int b, int h) {
  return t == nullptr ? nullptr : t + (int64_t(b) * p.h + h) * int64_t(p.d) * p.dim_v_aug;
}

// Sf (kM, kN) and z (kM) <- columns [c0, c0 + nv) and (with_z) the normalizer column of the
// (M, dim_v_aug) matrix src, or 0 (src null, rows past M, columns past nv). kBatched issues a
// thread's loads 16 at a time before storing them (4 memory round trips at kM = 128, where the
// plain loop may wait once per element): the chunk-parallel forward loads a state per CTA.
template <int kM, bool kBatched = false>
__device__ __forceinline__ void load_state(float* Sf, float* z, const float* src, const Params& p, int c0, int nv,
                                           bool with_z) {
  if constexpr (kBatched) {
    constexpr int kPer = kM * kN / kThreads, kB = 16;
    static_assert(kM * kN % kThreads == 0 && kPer % kB == 0, "whole batches per thread");
#pragma unroll 1
    for (int j0 = 0; j0 < kPer; j0 += kB) {
      float x[kB];
#pragma unroll
      for (int j = 0; j < kB; ++j) {
        const int e = threadIdx.x + (j0 + j) * kThreads, r = e / kN, c = e % kN;
        x[j] = src != nullptr && r < p.d && c < nv ? src[int64_t(r) * p.dim_v_aug + c0 + c] : 0.f;
      }
#pragma unroll
      for (int j = 0; j < kB; ++j) Sf[threadIdx.x + (j0 + j) * kThreads] = x[j];
    }
  } else {
    for (int e = threadIdx.x; e < kM * kN; e += kThreads) {
      const int r = e / kN, c = e % kN;
      Sf[e] = src != nullptr && r < p.d && c < nv ? src[int64_t(r) * p.dim_v_aug + c0 + c] : 0.f;
    }
  }
  for (int r = threadIdx.x; r < kM; r += kThreads) {
    z[r] = src != nullptr && with_z && r < p.d ? src[int64_t(r) * p.dim_v_aug + p.dim_v] : 0.f;
  }
}
// The inverse of load_state: dst's columns [c0, c0 + nv) and (with_z) its normalizer column.
__device__ __forceinline__ void store_state(float* dst, const float* Sf, const float* z, const Params& p, int c0,
                                            int nv, bool with_z) {
  for (int e = threadIdx.x; e < p.d * nv; e += kThreads) {
    const int r = e / nv, c = e % nv;
    dst[int64_t(r) * p.dim_v_aug + c0 + c] = Sf[r * kN + c];
  }
  if (with_z) {
    for (int r = threadIdx.x; r < p.d; r += kThreads) dst[int64_t(r) * p.dim_v_aug + p.dim_v] = z[r];
  }
}

}  // namespace linear_tc
}  // namespace attn
