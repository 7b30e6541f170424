// SIMT (fp32 FMA) kernels of the linear attention family: the chunked parallel form of
// csrc/linear/cpu/linear.cpp, forward and backward, for float32, float16 and bfloat16 inputs.
// They take what the tensor-core kernels (mma_fwd_kernel.cuh, mma_bwd_kernel.cuh) do not:
// float32 inputs, M > 128, devices below sm_80. The backward's finalize_kernel and ddecay_kernel
// serve both backward kernels.
//
// One CTA per (value tile, head, sequence): it owns the columns [c0, c0 + nv) of v (plus the
// normalizer column) and walks its sequence in chunks of kChunk rows, carrying its (M, cols)
// slab of the state in shared memory (fp32). Tiling the value width keeps that slab small for
// any M <= 1024 (tile_cols) and gives B * H * ceil(Dv / cols) CTAs. Per chunk, the feature
// dimension M is consumed in slices of kSlice columns, so the chunk's Q~ / K~ never need to be
// whole in shared memory: each slice adds into the (C, C) products held in registers and
// updates its own rows of the state.
//
// Forward (rows [r0, r0 + n), g the running decay sum since the chunk start, gC = g_{n-1}):
//   A = Q~ K~^T masked j <= i, weights e^{g_i - g_j};  O' = A V' + e^{g_i} Q~ S
//   S <- e^{gC} S + sum_j e^{gC - g_j} K~_j v'_j^T
// Every tile computes the normalizer column (each needs den); tile 0 stores den and the
// state's last column.
//
// Backward (the CPU file's notation): dQ~ = S_i dO'_i in an ascending sweep that recomputes the
// states, then dK~_j = U_j v'_j and dV'_j = U_j^T K~_j in a descending sweep carrying the reverse
// state U. dQ~, dK~ and dG are sums over the value columns, so each tile adds its share into
// fp32 scratch with atomics (the normalizer column belongs to tile 0 alone), and the query heads
// of a GQA group add into one dK~ / dV. finalize_kernel then applies the feature map's
// derivative and converts, and ddecay_kernel takes dG's reverse running sum. Extra memory:
// that scratch, O(N * (M + Dv)); never a state per position.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "common/linear_params.h"
#include "cuda/convert.cuh"  // to_float, from_float
#include "cuda/mma.cuh"  // ATTN_EXTERN_SMEM (and the emulator's device names)

namespace attn {
namespace linear_simt {

constexpr int kThreads = 256;
constexpr int kChunk = 64;               // rows per chunk
constexpr int kSlice = 32;               // feature columns per pass over M
constexpr int kLdSlice = kSlice + 1;     // padded row of a slice tile (no bank conflicts on columns)
constexpr int kLdP = kChunk + 1;         // padded row of a (C, C) product
constexpr int kMaxCols = 32;             // value columns per CTA, + 1 normalizer column
// each thread's entries of a (C, C), (C, kSlice) and (C, kMaxCols + 1) tile
constexpr int kPerCC = kChunk * kChunk / kThreads;
constexpr int kPerCS = kChunk * kSlice / kThreads;
constexpr int kPerCV = (kChunk * (kMaxCols + 1) + kThreads - 1) / kThreads;
static_assert(kChunk * kChunk % kThreads == 0 && kChunk * kSlice % kThreads == 0, "whole tiles per thread");
static_assert(kThreads % kChunk == 0, "a thread keeps one column of the (C, C) tiles");
static_assert(kThreads >= kChunk, "one thread per chunk row for the per-row scalars");

// x's rounding residual in T as LinearParamsT::o_res keeps it, (x - float(T(x))) times
// kResidualScale*; 0 where T(x) is inf or NaN (the backward then reads out alone, as without a
// residual). The forward stores it beside out; the backward's d den reads out + residual /
// scale. (The tensor-core kernels keep none: LinearParamsT::o_res says why.)
template <typename T>
__device__ __forceinline__ float residual_scale() {
  return std::is_same_v<T, __half> ? kResidualScaleF16 : kResidualScaleBF16;
}
template <typename T>
__device__ __forceinline__ float out_residual(float x) {
  const float y = to_float(from_float<T>(x));
  return fabsf(y) <= 3.402823466e38f ? (x - y) * residual_scale<T>() : 0.f;
}

// Value columns per CTA for feature width m: the (M, cols + 1) fp32 state slab stays <= ~37 KB.
__host__ __device__ constexpr int tile_cols(int m) { return m <= 256 ? 32 : (m <= 512 ? 16 : 8); }

// Shared memory of the forward / backward for feature width m (bytes).
__host__ __device__ constexpr int fwd_smem_floats(int m) {
  return m * (tile_cols(m) + 1) + 2 * kChunk * kLdSlice + kChunk * (tile_cols(m) + 1) + kChunk * kLdP + 5 * kChunk;
}
__host__ __device__ constexpr int bwd_smem_floats(int m) {
  return m * (tile_cols(m) + 1) + 2 * kChunk * kLdSlice + 2 * kChunk * (tile_cols(m) + 1) + 2 * kChunk * kLdP +
         6 * kChunk + 1;
}

// phi(x) (linear_params.h's feature map)
__device__ __forceinline__ float feature(FeatureMap fm, float x) {
  if (fm == FeatureMap::kElu) return x > 0.f ? x + 1.f : expf(x);
  if (fm == FeatureMap::kRelu) return x > 0.f ? x : 0.f;
  return x;
}
// d(phi(x) * mul) / dx
__device__ __forceinline__ float feature_grad(FeatureMap fm, float x, float mul) {
  if (fm == FeatureMap::kElu) return x > 0.f ? mul : expf(x) * mul;
  if (fm == FeatureMap::kRelu) return x > 0.f ? mul : 0.f;
  return mul;
}

using Params = LinearParamsT<float>;
using BwdParams = LinearBwdParamsT<float>;

// Where sequence b lives: tensors are indexed (bt, head, row0 + i) with bt = 0 and row0 =
// cu_seqlens[b] for a varlen pack, bt = b and row0 = 0 otherwise.
struct Seq {
  int len, bt;
  int64_t row0;
  __device__ Seq(const Params& p, int b) {
    if (p.cu_seqlens != nullptr) {
      row0 = p.cu_seqlens[b];
      len = p.cu_seqlens[b + 1] - p.cu_seqlens[b];
      bt = 0;
    } else {
      row0 = 0;
      len = p.sq;
      bt = b;
    }
  }
  // element offset of (head, row i) in a (B_t, heads, rows, .) tensor with these strides
  __device__ int64_t off(int64_t bs, int head, int64_t hs, int i, int64_t rs) const {
    return int64_t(bt) * bs + int64_t(head) * hs + (row0 + i) * rs;
  }
  // flat row of a contiguous (B_t, heads, rows) tensor (den, decay, dG; the scratch rows)
  __device__ int64_t row(const Params& p, int heads, int head, int i) const {
    return (int64_t(bt) * heads + head) * p.seq_head_stride + row0 + i;
  }
};

// The CTA's columns of the augmented value width: j < nv is v column c0 + j, j == nv (when
// has_norm) the normalizer column dim_v.
struct Cols {
  int c0, nv, ncol, ld;
  bool has_norm;
  __device__ int col(int j) const { return j < nv ? c0 + j : -1; }
};

// (kChunk, kSlice) tile dst of feature-mapped rows [0, n) x columns [m0, m0 + kSlice) of x
// (row stride rs), each row times mul * row_mul[i] (row_mul may be null); 0 past n rows / m
// columns, and 0 without a read where row_mul[i] is 0 (a padded key: not 0 x its row, which is
// NaN where the row is; the NaN policy, README).
template <typename T>
__device__ __forceinline__ void load_slice(float* dst, const T* x, int64_t rs, int n, int m0, int m, FeatureMap fm,
                                           float mul, const float* row_mul) {
  for (int e = threadIdx.x; e < kChunk * kSlice; e += kThreads) {
    const int i = e / kSlice, c = e % kSlice;
    float val = 0.f;
    if (i < n && m0 + c < m && (row_mul == nullptr || row_mul[i] != 0.f)) {
      val = feature(fm, to_float(x[int64_t(i) * rs + m0 + c])) * mul;
      if (row_mul != nullptr) val *= row_mul[i];
    }
    dst[i * kLdSlice + c] = val;
  }
}

// (kChunk, cols.ld) tile of v' rows [0, n): v's columns then the normalizer's 1; 0 elsewhere,
// and a padded key's row (kmul[i] = 0) is 0, not read.
template <typename T>
__device__ __forceinline__ void load_values(float* dst, const T* v, int64_t rs, int n, const Cols& cols,
                                            const float* kmul) {
  for (int e = threadIdx.x; e < kChunk * cols.ld; e += kThreads) {
    const int i = e / cols.ld, j = e % cols.ld;
    float val = 0.f;
    if (i < n && j < cols.nv && kmul[i] != 0.f) val = to_float(v[int64_t(i) * rs + cols.c0 + j]);
    if (i < n && cols.has_norm && j == cols.nv) val = 1.f;
    dst[e] = val;
  }
}

using ::attn::kResetGate;  // common/linear_params.h

// The chunk's per-row scalars: g and ep (the running decay sum since the chunk start or since the
// last reset, and the number of resets up to the row: the row's epoch), wq = e^{G_i} (G the sum
// since the chunk start: 0 once a reset is in), wk = e^{G_C - G_i}, and kmul (1 for a real key, 0
// for a padded one); 0 past n. Thread 0 takes the running sum. A reset row starts its epoch at
// g = 0, so e^{g_i - g_j} (pair_weight) is a difference of sums over one epoch: gates of -1e4,
// -1e9 or -inf give the recurrence's answer, where one running sum over the chunk would lose the
// small gates after a large one and turn -inf - -inf into NaN.
__device__ __forceinline__ void load_row_scalars(const Params& p, const Seq& s, int h, int r0, int n, float* g,
                                                 float* wq, float* wk, float* kmul, float* ep) {
  // the chunk's gates into g by every thread at once (one memory round trip), then the running
  // sum by one thread from shared memory: thread 0 loading them itself issued each load after
  // the last one's store (g may alias p.decay for all nvcc knows), 64 round trips per chunk
  for (int i = threadIdx.x; i < kChunk; i += blockDim.x)
    g[i] = i < n && p.decay != nullptr ? p.decay[s.row(p, p.h, h, r0 + i)] : 0.f;
  __syncthreads();
  if (threadIdx.x == 0) {
    float acc = 0.f, e = 0.f;
    for (int i = 0; i < kChunk; ++i) {
      if (i < n && p.decay != nullptr) {
        const float d = g[i];
        if (d <= kResetGate) {
          acc = 0.f;
          e += 1.f;
        } else {
          acc += d;
        }
      }
      g[i] = i < n ? acc : 0.f;
      ep[i] = i < n ? e : 0.f;
    }
  }
  __syncthreads();
  if (threadIdx.x < kChunk) {
    const int i = threadIdx.x;
    const float gc = g[n - 1], ec = ep[n - 1];
    const bool live = i < n;
    wq[i] = live && ep[i] == 0.f ? expf(g[i]) : 0.f;
    wk[i] = live && ep[i] == ec ? expf(gc - g[i]) : 0.f;
    bool real = live;
    if (live && p.key_mask != nullptr) real = p.key_mask[int64_t(s.bt) * p.key_mask_batch_stride + s.row0 + r0 + i] != 0;
    kmul[i] = real ? 1.f : 0.f;
  }
  __syncthreads();  // the loaders read every row's kmul
}

// e^{G_i - G_j} for rows j <= i of a chunk (load_row_scalars' g and ep): 0 across a reset.
__device__ __forceinline__ float pair_weight(const float* g, const float* ep, int i, int j) {
  return ep[i] == ep[j] ? expf(g[i] - g[j]) : 0.f;
}

// The chunk's total decay e^{G_C} (0 once a reset is in), from load_row_scalars' wq.
__device__ __forceinline__ float chunk_decay(const float* wq, int n) { return wq[n - 1]; }

// S[m0 + c][j] <- egc S + sum_t wk[t] K~[t][c] V'[t][j] for this slice's rows of the state
__device__ __forceinline__ void advance_slice(float* S, const float* Ks, const float* V, const float* wk, float egc,
                                              int m0, int m, int n, const Cols& cols) {
  for (int e = threadIdx.x; e < kSlice * cols.ncol; e += kThreads) {
    const int c = e / cols.ncol, j = e % cols.ncol;
    if (m0 + c >= m) continue;
    float acc = 0.f;
    for (int t = 0; t < n; ++t) acc += wk[t] * Ks[t * kLdSlice + c] * V[t * cols.ld + j];
    float& st = S[(m0 + c) * cols.ld + j];
    st = egc * st + acc;
  }
}

// The CTA's state slab (m, cols.ld) <- its columns of src (B, H, M, dim_v_aug), or 0.
__device__ __forceinline__ void load_state(float* S, const float* src, const Params& p, int b, int h,
                                           const Cols& cols) {
  const int64_t base = (int64_t(b) * p.h + h) * int64_t(p.d) * p.dim_v_aug;
  for (int e = threadIdx.x; e < p.d * cols.ld; e += kThreads) {
    const int mm = e / cols.ld, j = e % cols.ld;
    float val = 0.f;
    if (src != nullptr && j < cols.ncol) val = src[base + int64_t(mm) * p.dim_v_aug + (j < cols.nv ? cols.c0 + j : p.dim_v)];
    S[e] = val;
  }
}
__device__ __forceinline__ void store_state(float* dst, const float* S, const Params& p, int b, int h,
                                            const Cols& cols, bool norm_col) {
  const int64_t base = (int64_t(b) * p.h + h) * int64_t(p.d) * p.dim_v_aug;
  for (int e = threadIdx.x; e < p.d * cols.ncol; e += kThreads) {
    const int mm = e / cols.ncol, j = e % cols.ncol;
    if (j == cols.nv && !norm_col) continue;
    dst[base + int64_t(mm) * p.dim_v_aug + (j < cols.nv ? cols.c0 + j : p.dim_v)] = S[mm * cols.ld + j];
  }
}

__device__ __forceinline__ Cols make_cols(const Params& p, int tile, bool has_norm) {
  Cols c;
  const int w = tile_cols(p.d);
  c.c0 = tile * w;
  c.nv = min(w, p.dim_v - c.c0);
  c.has_norm = has_norm;
  c.ncol = c.nv + (has_norm ? 1 : 0);
  c.ld = w + 1;
  return c;
}

// ---------------------------------------------------------------------------------- forward
// grid (ceil(Dv / tile_cols(M)), H, B), kThreads threads, fwd_smem_floats(M) floats.
// kResidual: also store out's rounding residual (p.o_res; 16-bit normalized calls). A template
// flag, not a branch on p.o_res, so the other calls keep their registers: the 16-bit forward fits
// 128 without it, and the residual's pass either spills there or takes ~167
// (benchmarks/results/2026-12-02-linear-residual.md).
template <typename T, bool kResidual = false>
__global__ void __launch_bounds__(kThreads) fwd_kernel(const Params p) {
  const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / (p.h / p.h_k);
  const int m = p.d;
  const Seq s(p, b);
  const Cols cols = make_cols(p, tile, p.normalize);
  const bool decay = p.decay != nullptr;
  ATTN_EXTERN_SMEM(smem_raw);
  float* S = reinterpret_cast<float*>(smem_raw);  // (M, ld) state slab
  float* Qs = S + m * cols.ld;                    // (C, kLdSlice) Q~ slice
  float* Ks = Qs + kChunk * kLdSlice;             // (C, kLdSlice) K~ slice
  float* V = Ks + kChunk * kLdSlice;              // (C, ld) v'
  float* P = V + kChunk * cols.ld;                // (C, kLdP) masked A, then the O' staging
  float* g = P + kChunk * kLdP;
  float* wq = g + kChunk;
  float* wk = wq + kChunk;
  float* kmul = wk + kChunk;
  float* ep = kmul + kChunk;
  const T* qh = static_cast<const T*>(p.q) + s.off(p.q_batch_stride, h, p.q_head_stride, 0, p.q_row_stride);
  const T* kh = static_cast<const T*>(p.k) + s.off(p.k_batch_stride, hk, p.k_head_stride, 0, p.k_row_stride);
  const T* vh = static_cast<const T*>(p.v) + s.off(p.v_batch_stride, hk, p.v_head_stride, 0, p.v_row_stride);
  T* oh = static_cast<T*>(p.o) + s.off(p.o_batch_stride, h, p.o_head_stride, 0, p.o_row_stride);

  load_state(S, p.init_state, p, b, h, cols);
  __syncthreads();
  // non-causal: S += sum over the sequence of K~_j v'_j^T first, then O' = Q~ S
  if (!p.causal) {
    for (int r0 = 0; r0 < s.len; r0 += kChunk) {
      const int n = min(kChunk, s.len - r0);
      load_row_scalars(p, s, h, r0, n, g, wq, wk, kmul, ep);
      load_values(V, vh + int64_t(r0) * p.v_row_stride, p.v_row_stride, n, cols, kmul);
      for (int m0 = 0; m0 < m; m0 += kSlice) {
        __syncthreads();
        load_slice(Ks, kh + int64_t(r0) * p.k_row_stride, p.k_row_stride, n, m0, m, p.feature_map, 1.f, kmul);
        __syncthreads();
        advance_slice(S, Ks, V, wk, 1.f, m0, m, n, cols);  // no decay: wk = 1
      }
      __syncthreads();
    }
  }
  for (int r0 = 0; r0 < s.len; r0 += kChunk) {
    const int n = min(kChunk, s.len - r0);
    load_row_scalars(p, s, h, r0, n, g, wq, wk, kmul, ep);
    if (p.causal) load_values(V, vh + int64_t(r0) * p.v_row_stride, p.v_row_stride, n, cols, kmul);
    const float egc = chunk_decay(wq, n);
    float a[kPerCC], oi[kPerCV];
#pragma unroll
    for (int t = 0; t < kPerCC; ++t) a[t] = 0.f;
#pragma unroll
    for (int t = 0; t < kPerCV; ++t) oi[t] = 0.f;
    for (int m0 = 0; m0 < m; m0 += kSlice) {
      __syncthreads();
      load_slice(Qs, qh + int64_t(r0) * p.q_row_stride, p.q_row_stride, n, m0, m, p.feature_map, p.scale, nullptr);
      if (p.causal) load_slice(Ks, kh + int64_t(r0) * p.k_row_stride, p.k_row_stride, n, m0, m, p.feature_map, 1.f, kmul);
      __syncthreads();
      const int cs = min(kSlice, m - m0);
      if (p.causal) {
#pragma unroll
        for (int t = 0; t < kPerCC; ++t) {
          const int e = threadIdx.x + t * kThreads, i = e / kChunk, j = e % kChunk;
          if (j > i) continue;
          float acc = 0.f;
          for (int c = 0; c < cs; ++c) acc += Qs[i * kLdSlice + c] * Ks[j * kLdSlice + c];
          a[t] += acc;
        }
      }
#pragma unroll
      for (int t = 0; t < kPerCV; ++t) {
        const int e = threadIdx.x + t * kThreads, i = e / cols.ncol, j = e % cols.ncol;
        if (i >= kChunk) continue;
        float acc = 0.f;
        for (int c = 0; c < cs; ++c) acc += Qs[i * kLdSlice + c] * S[(m0 + c) * cols.ld + j];
        oi[t] += acc;
      }
      if (p.causal) {
        __syncthreads();
        advance_slice(S, Ks, V, wk, egc, m0, m, n, cols);
      }
    }
    // O' = mask(A) V' + e^{g_i} Q~ S  (non-causal: Q~ S)
    if (p.causal) {
      const int jj = threadIdx.x % kChunk;  // this thread's column of every row it takes
      const float gj = g[jj], ej = ep[jj];
#pragma unroll
      for (int t = 0; t < kPerCC; ++t) {
        const int i = (threadIdx.x + t * kThreads) / kChunk;
        const float w = !decay ? 1.f : ep[i] == ej ? expf(g[i] - gj) : 0.f;  // pair_weight(g, ep, i, jj)
        P[i * kLdP + jj] = jj <= i ? a[t] * w : 0.f;
      }
      __syncthreads();
#pragma unroll
      for (int t = 0; t < kPerCV; ++t) {
        const int e = threadIdx.x + t * kThreads, i = e / cols.ncol, j = e % cols.ncol;
        if (i >= kChunk) continue;
        float acc = 0.f;
        for (int u = 0; u <= i && u < n; ++u) acc += P[i * kLdP + u] * V[u * cols.ld + j];
        oi[t] = acc + wq[i] * oi[t];
      }
    }
    __syncthreads();
#pragma unroll
    for (int t = 0; t < kPerCV; ++t) {
      const int e = threadIdx.x + t * kThreads, i = e / cols.ncol, j = e % cols.ncol;
      if (i < kChunk) P[i * cols.ld + j] = oi[t];
    }
    __syncthreads();
    // out_i = O'_i[:Dv] / den_i; tile 0 stores den
    for (int e = threadIdx.x; e < n * cols.ncol; e += kThreads) {
      const int i = e / cols.ncol, j = e % cols.ncol;
      const float den = p.normalize ? P[i * cols.ld + cols.nv] + p.eps : 1.f;
      if (j < cols.nv) {
        oh[int64_t(r0 + i) * p.o_row_stride + cols.c0 + j] = from_float<T>(P[i * cols.ld + j] / den);
      } else if (tile == 0) {
        p.den[s.row(p, p.h, h, r0 + i)] = den;
      }
    }
    if constexpr (kResidual) {
      // out's rounding residual (out's strides; normalized calls only), the same x as above, in a
      // pass of its own, its row pointer formed at each store: inside the loop above, or with a
      // pointer held across the chunks, the kernel spilled
      for (int e = threadIdx.x; e < n * cols.nv; e += kThreads) {
        const int i = e / cols.nv, j = e % cols.nv;
        const float x = P[i * cols.ld + j] / (P[i * cols.ld + cols.nv] + p.eps);
        T* rrow = static_cast<T*>(p.o_res) + s.off(p.o_batch_stride, h, p.o_head_stride, r0 + i, p.o_row_stride);
        rrow[cols.c0 + j] = from_float<T>(out_residual<T>(x));
      }
    }
    if (!p.normalize && tile == 0) {
      for (int i = threadIdx.x; i < n; i += kThreads) p.den[s.row(p, p.h, h, r0 + i)] = 1.f;
    }
    __syncthreads();
  }
  if (p.final_state != nullptr) store_state(p.final_state, S, p, b, h, cols, tile == 0);
}

// ---------------------------------------------------------------------------------- backward
// The scratch of entry.h, carved: dQ~, dK~, dV, dG.
struct BwdScratch {
  float* dq;
  float* dk;
  float* dv;
  float* dg;
};

// dO' rows [0, n) of the CTA's columns: dout / den, and -(dout . out) / den in the normalizer
// column (the whole row's dot: one warp per row); 0 elsewhere.
template <typename T>
__device__ __forceinline__ void load_dout(float* D, const BwdParams& p, const Seq& s, int h, int r0, int n,
                                          const Cols& cols) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* dout = static_cast<const T*>(p.dout) + s.off(p.do_batch_stride, h, p.do_head_stride, r0, p.do_row_stride);
  const int64_t out_off = s.off(p.o_batch_stride, h, p.o_head_stride, r0, p.o_row_stride);
  const T* out = static_cast<const T*>(p.o) + out_off;
  const T* res = p.o_res == nullptr ? nullptr : static_cast<const T*>(p.o_res) + out_off;
  for (int i = warp; i < kChunk; i += kThreads / 32) {
    float dot = 0.f, inv = 1.f;
    if (i < n && p.normalize) {
      for (int c = lane; c < p.dim_v; c += 32) {
        const int64_t at = int64_t(i) * p.o_row_stride + c;
        const float o = to_float(out[at]) + (res != nullptr ? to_float(res[at]) * (1.f / residual_scale<T>()) : 0.f);
        dot += to_float(dout[int64_t(i) * p.do_row_stride + c]) * o;
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      inv = 1.f / p.den[s.row(p, p.h, h, r0 + i)];
    }
    for (int j = lane; j < cols.ld; j += 32) {
      float val = 0.f;
      if (i < n && j < cols.nv) val = to_float(dout[int64_t(i) * p.do_row_stride + cols.c0 + j]) * inv;
      if (i < n && cols.has_norm && j == cols.nv) val = -dot * inv;
      D[i * cols.ld + j] = val;
    }
  }
}

// grid (ceil(Dv / tile_cols(M)), H, B), kThreads threads, bwd_smem_floats(M) floats.
template <typename T>
__global__ void __launch_bounds__(kThreads) bwd_kernel(const BwdParams p, const BwdScratch sc) {
  const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / (p.h / p.h_k);
  const int m = p.d;
  const Seq s(p, b);
  const Cols cols = make_cols(p, tile, p.normalize && tile == 0);
  const bool decay = p.decay != nullptr, want_dg = decay && p.ddecay != nullptr;
  ATTN_EXTERN_SMEM(smem_raw);
  float* S = reinterpret_cast<float*>(smem_raw);  // (M, ld) state slab, then the reverse state U
  float* Qs = S + m * cols.ld;                    // (C, kLdSlice) Q~ slice
  float* Ks = Qs + kChunk * kLdSlice;             // (C, kLdSlice) K~ slice
  float* V = Ks + kChunk * kLdSlice;              // (C, ld) v'
  float* D = V + kChunk * cols.ld;                // (C, ld) dO'
  float* P1 = D + kChunk * cols.ld;               // (C, kLdP)
  float* P2 = P1 + kChunk * kLdP;                 // (C, kLdP)
  float* g = P2 + kChunk * kLdP;
  float* wq = g + kChunk;
  float* wk = wq + kChunk;
  float* kmul = wk + kChunk;
  float* ep = kmul + kChunk;
  float* rowdot = ep + kChunk;  // per-row dG share of this tile, + 1 scalar
  const T* qh = static_cast<const T*>(p.q) + s.off(p.q_batch_stride, h, p.q_head_stride, 0, p.q_row_stride);
  const T* kh = static_cast<const T*>(p.k) + s.off(p.k_batch_stride, hk, p.k_head_stride, 0, p.k_row_stride);
  const T* vh = static_cast<const T*>(p.v) + s.off(p.v_batch_stride, hk, p.v_head_stride, 0, p.v_row_stride);
  const int64_t q_rows = (int64_t(s.bt) * p.h + h) * p.seq_head_stride + s.row0;     // dQ~, dG rows
  const int64_t kv_rows = (int64_t(s.bt) * p.h_k + hk) * p.seq_head_stride + s.row0;  // dK~, dV rows

  // ---------------------------------------------------------------- dQ~_i = S_i dO'_i
  load_state(S, p.init_state, p, b, h, cols);
  __syncthreads();
  if (!p.causal) {
    for (int r0 = 0; r0 < s.len; r0 += kChunk) {
      const int n = min(kChunk, s.len - r0);
      load_row_scalars(p, s, h, r0, n, g, wq, wk, kmul, ep);
      load_values(V, vh + int64_t(r0) * p.v_row_stride, p.v_row_stride, n, cols, kmul);
      for (int m0 = 0; m0 < m; m0 += kSlice) {
        __syncthreads();
        load_slice(Ks, kh + int64_t(r0) * p.k_row_stride, p.k_row_stride, n, m0, m, p.feature_map, 1.f, kmul);
        __syncthreads();
        advance_slice(S, Ks, V, wk, 1.f, m0, m, n, cols);
      }
      __syncthreads();
    }
  }
  for (int r0 = 0; r0 < s.len; r0 += kChunk) {
    const int n = min(kChunk, s.len - r0);
    load_row_scalars(p, s, h, r0, n, g, wq, wk, kmul, ep);
    if (p.causal) load_values(V, vh + int64_t(r0) * p.v_row_stride, p.v_row_stride, n, cols, kmul);
    load_dout<T>(D, p, s, h, r0, n, cols);
    if (threadIdx.x < kChunk) rowdot[threadIdx.x] = 0.f;
    const float egc = chunk_decay(wq, n);
    __syncthreads();
    if (p.causal) {  // P1 = mask(dO' V'^T), weights e^{g_i - g_j}
#pragma unroll
      for (int t = 0; t < kPerCC; ++t) {
        const int e = threadIdx.x + t * kThreads, i = e / kChunk, j = e % kChunk;
        float acc = 0.f;
        if (j <= i) {
          for (int c = 0; c < cols.ncol; ++c) acc += D[i * cols.ld + c] * V[j * cols.ld + c];
          if (decay) acc *= pair_weight(g, ep, i, j);
        }
        P1[i * kLdP + j] = acc;
      }
    }
    for (int m0 = 0; m0 < m; m0 += kSlice) {
      __syncthreads();
      load_slice(Qs, qh + int64_t(r0) * p.q_row_stride, p.q_row_stride, n, m0, m, p.feature_map, p.scale, nullptr);
      if (p.causal) load_slice(Ks, kh + int64_t(r0) * p.k_row_stride, p.k_row_stride, n, m0, m, p.feature_map, 1.f, kmul);
      __syncthreads();
#pragma unroll
      for (int t = 0; t < kPerCS; ++t) {
        const int e = threadIdx.x + t * kThreads, i = e / kSlice, c = e % kSlice;
        if (i >= n || m0 + c >= m) continue;
        float inter = 0.f;
        for (int j = 0; j < cols.ncol; ++j) inter += D[i * cols.ld + j] * S[(m0 + c) * cols.ld + j];
        float acc = p.causal ? wq[i] * inter : inter;
        if (p.causal) {
          for (int j = 0; j <= i; ++j) acc += P1[i * kLdP + j] * Ks[j * kLdSlice + c];
        }
        atomicAdd(sc.dq + (q_rows + r0 + i) * m + m0 + c, acc);
        if (want_dg) atomicAdd(rowdot + i, Qs[i * kLdSlice + c] * acc);
      }
      if (p.causal) {
        __syncthreads();
        advance_slice(S, Ks, V, wk, egc, m0, m, n, cols);
      }
    }
    __syncthreads();
    if (want_dg && threadIdx.x < n) atomicAdd(sc.dg + q_rows + r0 + threadIdx.x, rowdot[threadIdx.x]);
  }
  __syncthreads();
  // ---------------------------------------------------------------- U = dS_T (+ sum Q~ dO'^T)
  if (want_dg && p.dfinal_state != nullptr && s.len > 0) {  // dG_T += <dS_T, S_T>
    if (threadIdx.x == 0) rowdot[kChunk] = 0.f;
    __syncthreads();
    const int64_t base = (int64_t(b) * p.h + h) * int64_t(m) * p.dim_v_aug;
    float part = 0.f;
    for (int e = threadIdx.x; e < m * cols.ncol; e += kThreads) {
      const int mm = e / cols.ncol, j = e % cols.ncol;
      part += S[mm * cols.ld + j] * p.dfinal_state[base + int64_t(mm) * p.dim_v_aug + (j < cols.nv ? cols.c0 + j : p.dim_v)];
    }
    atomicAdd(rowdot + kChunk, part);
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(sc.dg + q_rows + s.len - 1, rowdot[kChunk]);
    __syncthreads();
  }
  float* U = S;
  load_state(U, p.dfinal_state, p, b, h, cols);
  __syncthreads();
  if (!p.causal) {
    for (int r0 = 0; r0 < s.len; r0 += kChunk) {
      const int n = min(kChunk, s.len - r0);
      load_dout<T>(D, p, s, h, r0, n, cols);
      for (int m0 = 0; m0 < m; m0 += kSlice) {
        __syncthreads();
        load_slice(Qs, qh + int64_t(r0) * p.q_row_stride, p.q_row_stride, n, m0, m, p.feature_map, p.scale, nullptr);
        __syncthreads();
        for (int e = threadIdx.x; e < kSlice * cols.ncol; e += kThreads) {
          const int c = e / cols.ncol, j = e % cols.ncol;
          if (m0 + c >= m) continue;
          float acc = 0.f;
          for (int i = 0; i < n; ++i) acc += Qs[i * kLdSlice + c] * D[i * cols.ld + j];
          U[(m0 + c) * cols.ld + j] += acc;
        }
      }
      __syncthreads();
    }
  }
  // ---------------------------------------------------------------- dK~_j = U_j v'_j, dV'_j = U_j^T K~_j
  const int last = s.len == 0 ? -1 : (s.len - 1) / kChunk * kChunk;
  for (int r0 = last; r0 >= 0; r0 -= kChunk) {
    const int n = min(kChunk, s.len - r0);
    load_row_scalars(p, s, h, r0, n, g, wq, wk, kmul, ep);
    load_values(V, vh + int64_t(r0) * p.v_row_stride, p.v_row_stride, n, cols, kmul);
    load_dout<T>(D, p, s, h, r0, n, cols);
    if (threadIdx.x < kChunk) rowdot[threadIdx.x] = 0.f;
    const float egc = chunk_decay(wq, n);
    __syncthreads();
    if (p.causal) {  // P1[j][i] = V'_j . dO'_i for i >= j, weights e^{g_i - g_j}
#pragma unroll
      for (int t = 0; t < kPerCC; ++t) {
        const int e = threadIdx.x + t * kThreads, j = e / kChunk, i = e % kChunk;
        float acc = 0.f;
        if (i >= j) {
          for (int c = 0; c < cols.ncol; ++c) acc += V[j * cols.ld + c] * D[i * cols.ld + c];
          if (decay) acc *= pair_weight(g, ep, i, j);
        }
        P1[j * kLdP + i] = acc;
      }
    }
    // pass A over M: P2 = K~ Q~^T and KU = K~ U (U at this chunk's end)
    float p2[kPerCC], ku[kPerCV];
#pragma unroll
    for (int t = 0; t < kPerCC; ++t) p2[t] = 0.f;
#pragma unroll
    for (int t = 0; t < kPerCV; ++t) ku[t] = 0.f;
    for (int m0 = 0; m0 < m; m0 += kSlice) {
      __syncthreads();
      if (p.causal) load_slice(Qs, qh + int64_t(r0) * p.q_row_stride, p.q_row_stride, n, m0, m, p.feature_map, p.scale, nullptr);
      load_slice(Ks, kh + int64_t(r0) * p.k_row_stride, p.k_row_stride, n, m0, m, p.feature_map, 1.f, kmul);
      __syncthreads();
      const int cs = min(kSlice, m - m0);
      if (p.causal) {
#pragma unroll
        for (int t = 0; t < kPerCC; ++t) {
          const int e = threadIdx.x + t * kThreads, j = e / kChunk, i = e % kChunk;
          if (i < j) continue;
          float acc = 0.f;
          for (int c = 0; c < cs; ++c) acc += Ks[j * kLdSlice + c] * Qs[i * kLdSlice + c];
          p2[t] += acc;
        }
      }
#pragma unroll
      for (int t = 0; t < kPerCV; ++t) {
        const int e = threadIdx.x + t * kThreads, j = e / cols.ncol, col = e % cols.ncol;
        if (j >= kChunk) continue;
        float acc = 0.f;
        for (int c = 0; c < cs; ++c) acc += Ks[j * kLdSlice + c] * U[(m0 + c) * cols.ld + col];
        ku[t] += acc;
      }
    }
    if (p.causal) {
#pragma unroll
      for (int t = 0; t < kPerCC; ++t) {
        const int e = threadIdx.x + t * kThreads, j = e / kChunk, i = e % kChunk;
        P2[j * kLdP + i] = i >= j ? p2[t] * (decay ? pair_weight(g, ep, i, j) : 1.f) : 0.f;
      }
    }
    __syncthreads();
    // dV'_j = mask(K~ Q~^T) dO' + e^{gC - g_j} K~_j U  (the normalizer column has no dv)
#pragma unroll
    for (int t = 0; t < kPerCV; ++t) {
      const int e = threadIdx.x + t * kThreads, j = e / cols.ncol, col = e % cols.ncol;
      if (j >= n || col >= cols.nv) continue;
      float acc = 0.f;
      if (p.causal) {
        for (int i = j; i < n; ++i) acc += P2[j * kLdP + i] * D[i * cols.ld + col];
      }
      acc += (p.causal ? wk[j] : 1.f) * ku[t];
      atomicAdd(sc.dv + (kv_rows + r0 + j) * p.dim_v + cols.c0 + col, acc);
    }
    // pass B over M: dK~ = mask(V' dO'^T) Q~ + e^{gC - g_j} V' U^T, then U moves past the chunk
    for (int m0 = 0; m0 < m; m0 += kSlice) {
      __syncthreads();
      load_slice(Qs, qh + int64_t(r0) * p.q_row_stride, p.q_row_stride, n, m0, m, p.feature_map, p.scale, nullptr);
      load_slice(Ks, kh + int64_t(r0) * p.k_row_stride, p.k_row_stride, n, m0, m, p.feature_map, 1.f, kmul);
      __syncthreads();
#pragma unroll
      for (int t = 0; t < kPerCS; ++t) {
        const int e = threadIdx.x + t * kThreads, j = e / kSlice, c = e % kSlice;
        if (j >= n || m0 + c >= m) continue;
        float later = 0.f;
        for (int col = 0; col < cols.ncol; ++col) later += V[j * cols.ld + col] * U[(m0 + c) * cols.ld + col];
        float acc = (p.causal ? wk[j] : 1.f) * later;
        if (p.causal) {
          for (int i = j; i < n; ++i) acc += P1[j * kLdP + i] * Qs[i * kLdSlice + c];
        }
        atomicAdd(sc.dk + (kv_rows + r0 + j) * m + m0 + c, acc);
        if (want_dg) atomicAdd(rowdot + j, Ks[j * kLdSlice + c] * acc);
      }
      if (p.causal) {  // U[m0 + c] <- e^{gC} U + sum_i e^{g_i} Q~_i[c] dO'_i
        __syncthreads();
        for (int e = threadIdx.x; e < kSlice * cols.ncol; e += kThreads) {
          const int c = e / cols.ncol, col = e % cols.ncol;
          if (m0 + c >= m) continue;
          float acc = 0.f;
          for (int i = 0; i < n; ++i) acc += wq[i] * Qs[i * kLdSlice + c] * D[i * cols.ld + col];
          float& u = U[(m0 + c) * cols.ld + col];
          u = egc * u + acc;
        }
      }
    }
    __syncthreads();
    if (want_dg && threadIdx.x < n) atomicAdd(sc.dg + q_rows + r0 + threadIdx.x, -rowdot[threadIdx.x]);
  }
  __syncthreads();
  if (p.dinit_state != nullptr) store_state(p.dinit_state, U, p, b, h, cols, true);
}

// dq, dk, dv <- the scratch's dQ~ / dK~ / dV times the feature map's derivative, in T. which:
// 0 dq, 1 dk, 2 dv. Flat over (B_t, heads, rows, width): rows no sequence owns (a varlen pack's
// tail) hold 0 in the scratch and come out 0.
template <typename T>
__global__ void __launch_bounds__(kThreads) finalize_kernel(const BwdParams p, const BwdScratch sc, int which) {
  const int heads = which == 0 ? p.h : p.h_k;
  const int width = which == 2 ? p.dim_v : p.d;
  const int64_t rows = p.seq_head_stride;
  const int64_t bt_count = p.cu_seqlens != nullptr ? 1 : p.b;
  const int64_t total = bt_count * heads * rows * width;
  const float* src = which == 0 ? sc.dq : (which == 1 ? sc.dk : sc.dv);
  for (int64_t e = int64_t(blockIdx.x) * kThreads + threadIdx.x; e < total; e += int64_t(gridDim.x) * kThreads) {
    const int c = int(e % width);
    const int64_t r = (e / width) % rows;
    const int head = int((e / width / rows) % heads);
    const int64_t bt = e / width / rows / heads;
    float val = src[e];
    if (which == 0) {
      const T x = static_cast<const T*>(p.q)[bt * p.q_batch_stride + head * p.q_head_stride + r * p.q_row_stride + c];
      val *= feature_grad(p.feature_map, to_float(x), p.scale);
      static_cast<T*>(p.dq)[bt * p.dq_batch_stride + head * p.dq_head_stride + r * p.dq_row_stride + c] = from_float<T>(val);
    } else if (which == 1) {
      const T x = static_cast<const T*>(p.k)[bt * p.k_batch_stride + head * p.k_head_stride + r * p.k_row_stride + c];
      // a padded key's dk is 0, not 0 x feature_grad of its k (NaN where k is)
      const bool real = p.key_mask == nullptr || p.key_mask[bt * p.key_mask_batch_stride + r] != 0;
      val = real ? val * feature_grad(p.feature_map, to_float(x), 1.f) : 0.f;
      static_cast<T*>(p.dk)[bt * p.dk_batch_stride + head * p.dk_head_stride + r * p.dk_row_stride + c] = from_float<T>(val);
    } else {
      static_cast<T*>(p.dv)[bt * p.dv_batch_stride + head * p.dv_head_stride + r * p.dv_row_stride + c] = from_float<T>(val);
    }
  }
}

// ddecay_i = sum_{t >= i} dG_t per (sequence, head): one thread each, grid ceil(B * H / kThreads).
__global__ void __launch_bounds__(kThreads) ddecay_kernel(const BwdParams p, const BwdScratch sc) {
  const int64_t task = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (task >= int64_t(p.b) * p.h) return;
  const int b = int(task / p.h), h = int(task % p.h);
  const Seq s(p, b);
  float acc = 0.f;
  for (int i = s.len - 1; i >= 0; --i) {
    const int64_t r = s.row(p, p.h, h, i);
    acc += sc.dg[r];
    p.ddecay[r] = acc;
  }
  // Without an initial state the first position's decay scales a zero state, so its gradient is
  // exactly 0; the sum above reaches it only as a cancellation (Q~ . dQ~ - K~ . dK~ over the whole
  // sequence, rounded through 16-bit operands on the tensor-core path), so it is set, not summed.
  if (p.init_state == nullptr && s.len > 0) p.ddecay[s.row(p, p.h, h, 0)] = 0.f;
}

}  // namespace linear_simt
}  // namespace attn
