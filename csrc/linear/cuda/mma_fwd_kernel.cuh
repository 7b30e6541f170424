// Tensor-core (mma.sync m16n8k16, fp16 / bf16 operands, fp32 accumulators) forward of the
// linear attention family: the chunked form of simt_kernel.cuh with the four chunk products on
// tensor cores, for fp16 / bf16 inputs with M <= 128.
//
// One CTA (4 warps) per (value tile of kN columns, head, sequence); warp w owns chunk rows
// [16w, 16w + 16). Per chunk of kChunk rows:
//   A  = Q~ K~^T                  (C, C):  mma, A from Q~ (C, kM), B from K~ (C, kM) rows
//   A <- mask j <= i, e^{g_i - g_j}   in the accumulators, then repacked as the A operand
//   O' = e^{g_i} Q~ S + A V'      (C, kN): B from S (kM, kN) and V (C, kN) with ldmatrix.trans
//   S <- e^{gC} S + (wk K~)^T V   (kM, kN): A from the (kM, C) transposed copy of wk * K~
// The state lives in shared memory twice: fp32 and a scaled 16-bit copy that feeds Q~ S
// (mma_common.cuh). The normalizer column is not a tile column: its state is the fp32 vector
// z (kM) = the running sum of the weighted K~ rows, and den_i = rowsum(A_i) + e^{g_i} Q~_i . z
// + eps, so every value tile has den without spending an 8-column mma tile on one column.
// Non-causal calls take two passes: S over the whole sequence, then O' = Q~ S per chunk.
// Operands are staged by plain 16-bit shared stores (the feature map and the key mask are
// applied while loading), so any row stride and alignment works.
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
struct Smem {
  static_assert(kM == 64 || kM == 128, "feature-width buckets");
  using QTile = tc::SmemTile<kChunk, kM>;   // Q~, K~ (C, kM)
  using KtTile = tc::SmemTile<kM, kChunk>;  // (wk K~)^T (kM, C)
  using VTile = tc::SmemTile<kChunk, kN>;   // V (C, kN)
  using STile = tc::SmemTile<kM, kN>;       // 16-bit S (kM, kN)
  static constexpr int kQ = 0, kK = kQ + QTile::kBytes, kKt = kK + QTile::kBytes, kV = kKt + KtTile::kBytes,
                       kS = kV + VTile::kBytes, kSf = kS + STile::kBytes;  // fp32 S (kM, kN)
  static constexpr int kZ = kSf + kM * kN * 4;                            // fp32 z (kM)
  static constexpr int kQz = kZ + kM * 4;                                  // Q~_i . z (C)
  static constexpr int kScalars = kQz + kChunk * 4;                        // g, wq, wk, kmul (C each)
  static constexpr int kRed = kScalars + 4 * kChunk * 4;                   // per-warp max |S|
  static constexpr int kBytes = kRed + kWarps * 4;
};

// grid (ceil(Dv / kN), H, B), kThreads threads, Smem<kM>::kBytes bytes.
template <typename T, int kM>
__global__ void __launch_bounds__(kThreads, 1) fwd_kernel(const Params p) {
  using L = Smem<kM>;
  const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / (p.h / p.h_k);
  const int tid = threadIdx.x, warp = tid / 32;
  int lane = tid % 32;  // opaque() per chunk (mma_common.cuh)
  const int m = p.d, c0 = tile * kN, nv = min(kN, p.dim_v - c0);
  const linear_simt::Seq s(p, b);
  const bool decay = p.decay != nullptr;
  ATTN_EXTERN_SMEM(smem);
  const uint32_t sbase = tc::smem_u32(smem);
  float* Sf = reinterpret_cast<float*>(smem + L::kSf);
  float* z = reinterpret_cast<float*>(smem + L::kZ);
  float* qz = reinterpret_cast<float*>(smem + L::kQz);
  float* g = reinterpret_cast<float*>(smem + L::kScalars);
  float* wq = g + kChunk;
  float* wk = wq + kChunk;
  float* kmul = wk + kChunk;
  float* red = reinterpret_cast<float*>(smem + L::kRed);
  const T* qh = static_cast<const T*>(p.q) + s.off(p.q_batch_stride, h, p.q_head_stride, 0, p.q_row_stride);
  const T* kh = static_cast<const T*>(p.k) + s.off(p.k_batch_stride, hk, p.k_head_stride, 0, p.k_row_stride);
  const T* vh = static_cast<const T*>(p.v) + s.off(p.v_batch_stride, hk, p.v_head_stride, 0, p.v_row_stride);
  T* oh = static_cast<T*>(p.o) + s.off(p.o_batch_stride, h, p.o_head_stride, 0, p.o_row_stride);

  load_state<kM>(Sf, z, p.init_state, p, b, h, c0, nv, p.normalize);
  __syncthreads();
  float sigma = refresh_s16<T, L, kM>(smem, Sf, red);

  // pass 0 (non-causal only): S, z over the whole sequence; pass 1: outputs (and, causal, S)
  for (int pass = p.causal ? 1 : 0; pass < 2; ++pass) {
    const bool want_out = pass == 1, want_update = pass == 0 || p.causal;
    for (int r0 = 0; r0 < s.len; r0 += kChunk) {
      const int n = min(kChunk, s.len - r0);
      lane = opaque(lane);
      linear_simt::load_row_scalars(p, s, h, r0, n, g, wq, wk, kmul);
      __syncthreads();
      const float egc = expf(g[n - 1]);
      // stage Q~, K~, (wk K~)^T and V as 16-bit tiles
      for (int e = tid; e < kChunk * kM; e += kThreads) {
        const int i = e / kM, c = e % kM;
        const bool ok = i < n && c < m;
        if (want_out) {
          const float x = ok ? linear_simt::feature(p.feature_map, to_float(qh[int64_t(r0 + i) * p.q_row_stride + c])) * p.scale : 0.f;
          st16<T>(smem, L::kQ + L::QTile::offset(i, c), x);
        }
        // a padded key (kmul 0): 0 without a read, not 0 x its row (NaN where the row is)
        const float y = ok && kmul[i] != 0.f
                            ? linear_simt::feature(p.feature_map, to_float(kh[int64_t(r0 + i) * p.k_row_stride + c])) * kmul[i]
                            : 0.f;
        st16<T>(smem, L::kK + L::QTile::offset(i, c), y);
        st16<T>(smem, L::kKt + L::KtTile::offset(c, i), y * wk[i]);
      }
      for (int e = tid; e < kChunk * kN; e += kThreads) {
        const int i = e / kN, c = e % kN;
        const float x = i < n && c < nv && kmul[i] != 0.f ? to_float(vh[int64_t(r0 + i) * p.v_row_stride + c0 + c]) : 0.f;
        st16<T>(smem, L::kV + L::VTile::offset(i, c), x);
      }
      __syncthreads();
      if (want_out && tid < kChunk) {  // Q~_i . z with the chunk-start z
        float acc = 0.f;
        for (int c = 0; c < m; ++c) acc += ld16<T>(smem, L::kQ + L::QTile::offset(tid, c)) * z[c];
        qz[tid] = acc;
      }
      if (want_out) {
        const int row_a = 16 * warp;
        float acc_o[kN / 8][4];
        zero(acc_o);
        // O' = Q~ S, rows scaled by e^{g_i} below
        mma_smem<T, typename L::QTile, typename L::STile, kM, kN, true>(acc_o, sbase + L::kQ, row_a, sbase + L::kS, lane);
        const int ra = row_a + lane / 4, rb = ra + 8;  // this thread's two rows of the warp's 16
        const float ea = p.causal ? wq[ra] : 1.f, eb = p.causal ? wq[rb] : 1.f;
#pragma unroll
        for (int t = 0; t < kN / 8; ++t) {
          acc_o[t][0] *= ea * sigma;
          acc_o[t][1] *= ea * sigma;
          acc_o[t][2] *= eb * sigma;
          acc_o[t][3] *= eb * sigma;
        }
        float sum_a = 0.f, sum_b = 0.f;
        if (p.causal) {
          // A = Q~ K~^T for the warp's 16 rows x the chunk's kChunk keys
          float acc_s[kChunk / 8][4];
          zero(acc_s);
          mma_smem<T, typename L::QTile, typename L::QTile, kM, kChunk, false>(acc_s, sbase + L::kQ, row_a, sbase + L::kK,
                                                                              lane);
          // mask j <= i with weights e^{g_i - g_j}; row sums feed den
#pragma unroll
          for (int t = 0; t < kChunk / 8; ++t) {
#pragma unroll
            for (int x = 0; x < 4; ++x) {
              const int i = x < 2 ? ra : rb, j = t * 8 + 2 * (lane % 4) + (x & 1);
              float val = j <= i ? acc_s[t][x] : 0.f;
              if (decay && j <= i) val *= expf(g[i] - g[j]);
              acc_s[t][x] = val;
            }
            sum_a += acc_s[t][0] + acc_s[t][1];
            sum_b += acc_s[t][2] + acc_s[t][3];
          }
          // O' += A V: the accumulators of two adjacent key tiles are one A fragment
          mma_reg<T, typename L::VTile, kChunk, kN>(acc_o, acc_s, sbase + L::kV, lane);
#pragma unroll
          for (int o = 1; o <= 2; o <<= 1) {
            sum_a += __shfl_xor_sync(0xffffffffu, sum_a, o);
            sum_b += __shfl_xor_sync(0xffffffffu, sum_b, o);
          }
        }
        __syncthreads();  // qz is complete
        const float den_a = p.normalize ? sum_a + ea * qz[ra] + p.eps : 1.f;
        const float den_b = p.normalize ? sum_b + eb * qz[rb] + p.eps : 1.f;
#pragma unroll
        for (int t = 0; t < kN / 8; ++t) {
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            const int i = x < 2 ? ra : rb, c = t * 8 + 2 * (lane % 4) + (x & 1);
            if (i < n && c < nv) oh[int64_t(r0 + i) * p.o_row_stride + c0 + c] = from_float<T>(acc_o[t][x] / (x < 2 ? den_a : den_b));
          }
        }
        if (tile == 0 && lane % 4 == 0) {
          if (ra < n) p.den[s.row(p, p.h, h, r0 + ra)] = den_a;
          if (rb < n) p.den[s.row(p, p.h, h, r0 + rb)] = den_b;
        }
      }
      __syncthreads();  // every warp is done reading S and z
      if (want_update) {
        // S <- e^{gC} S + (wk K~)^T V, 16-row tiles of the state over the warps
        const float f = p.causal ? egc : 1.f;
        add_outer<T, L, kM>(Sf, sbase + L::kKt, sbase + L::kV, f, warp, lane);
        for (int c = tid; c < kM; c += kThreads) {  // z <- e^{gC} z + sum_j wk_j K~_j
          float acc = 0.f;
          for (int j = 0; j < n; ++j) acc += ld16<T>(smem, L::kKt + L::KtTile::offset(c, j));
          z[c] = f * z[c] + acc;
        }
        __syncthreads();
        sigma = refresh_s16<T, L, kM>(smem, Sf, red);
      }
      __syncthreads();
    }
  }
  if (p.final_state != nullptr) store_state(p.final_state, Sf, z, p, b, h, c0, nv, tile == 0 && p.normalize);
}

}  // namespace linear_tc
}  // namespace attn
