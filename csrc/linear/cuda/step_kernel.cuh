// The recurrent step of linear attention on CUDA (attention_ext::linear_step; the math:
// common/linear_params.h LinearStepParamsT): T positions (1 or a few) of the causal recurrence on
// a float32 state (B, H, M, Dv) and normalizer (B, H, M) updated in place. A decode step's cost is
// the state's one read and one write, so the kernel is one pass over it:
//
//   grid (H, B), kThreads = 256 threads: one CTA per (batch, query head), so the normalizer and
//   the state of a head are read and written by one CTA (a column-split grid would read z in one
//   CTA while another writes it).
//   The T positions go in blocks of kMaxT: Q~_t = scale phi(q_t), K~_t = phi(k_t) and the decay
//   factors w_t = e^{decay_t} to shared memory (a row of M per position: the head's factor in
//   every entry, or GLA's per-feature factors, so both read w_t[r]); then z over its M rows (den_t = Q~_t . z_t + eps
//   with z_t after position t); then the state in column tiles of kCols: thread (row group g,
//   column c) holds v_t[c] for the block's positions and walks rows g, g + kGroups, ...: each
//   element is loaded once, advanced through the block's positions in a register
//   (s <- w_t s + K~_t[r] v_t[c]), multiplied into its out partials (o_t += Q~_t[r] s) and stored
//   once; kUnroll rows' loads are issued together. The row groups' partials add up in shared
//   memory and row group 0 writes out_t[c] = o_t / den_t.
// More than kMaxT positions read and write the state once per block of kMaxT.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/linear_params.h"
#include "cuda/convert.cuh"
#include "cuda/mma.cuh"                 // ATTN_EXTERN_SMEM (and the emulator's device names)
#include "linear/cuda/simt_kernel.cuh"  // feature()

namespace attn {
namespace linear_step_cuda {

using StepParams = LinearStepParamsT<float>;

constexpr int kCols = 32;                   // state columns per tile: one warp's lanes
constexpr int kGroups = 8;                  // row groups (warps)
constexpr int kThreads = kCols * kGroups;   // 256
constexpr int kMaxT = 4;                    // positions per pass over the state
constexpr int kUnroll = 4;                  // rows per thread with loads in flight together

// floats of dynamic shared memory: Q~, K~, w (kMaxT x M each), den (kMaxT), the row groups'
// partials (kMaxT x kGroups x kCols), the per-warp dot partials (kMaxT x kGroups)
inline int smem_floats(int m) { return 3 * kMaxT * m + kMaxT + kMaxT * kGroups * kCols + kMaxT * kGroups; }

template <typename T>
__global__ void __launch_bounds__(kThreads) step_kernel(const StepParams p) {
  ATTN_EXTERN_SMEM(smem);
  float* sm = reinterpret_cast<float*>(smem);
  const int m = p.d, dv = p.dim_v;
  float* qf = sm;                   // (kMaxT, m)
  float* kf = qf + kMaxT * m;       // (kMaxT, m)
  float* w = kf + kMaxT * m;        // (kMaxT, m)
  float* den = w + kMaxT * m;       // (kMaxT)
  float* red = den + kMaxT;         // (kMaxT, kGroups, kCols)
  float* dots = red + kMaxT * kGroups * kCols;  // (kMaxT, kGroups)
  const int h = blockIdx.x, b = blockIdx.y, hk = h / (p.h / p.h_k);
  const int tid = threadIdx.x, lane = tid % kCols, grp = tid / kCols;
  const T* qh = static_cast<const T*>(p.q) + int64_t(b) * p.q_batch_stride + int64_t(h) * p.q_head_stride;
  const T* kh = static_cast<const T*>(p.k) + int64_t(b) * p.k_batch_stride + int64_t(hk) * p.k_head_stride;
  const T* vh = static_cast<const T*>(p.v) + int64_t(b) * p.v_batch_stride + int64_t(hk) * p.v_head_stride;
  T* oh = static_cast<T*>(p.o) + int64_t(b) * p.o_batch_stride + int64_t(h) * p.o_head_stride;
  float* S = p.state + int64_t(b) * p.state_batch_stride + int64_t(h) * p.state_head_stride;
  float* z = p.normalizer != nullptr ? p.normalizer + int64_t(b) * p.z_batch_stride + int64_t(h) * p.z_head_stride
                                     : nullptr;

  for (int t0 = 0; t0 < p.sq; t0 += kMaxT) {
    const int nt = min(kMaxT, p.sq - t0);
    __syncthreads();  // the previous block's readers of qf / kf / w / den / red are done
    for (int e = tid; e < nt * m; e += kThreads) {
      const int t = e / m, r = e % m;
      qf[t * m + r] = linear_simt::feature(p.feature_map, to_float(qh[int64_t(t0 + t) * p.q_row_stride + r])) * p.scale;
      kf[t * m + r] = linear_simt::feature(p.feature_map, to_float(kh[int64_t(t0 + t) * p.k_row_stride + r]));
      const int64_t gate = (int64_t(b) * p.h + h) * p.sq + t0 + t;
      w[t * m + r] = p.decay == nullptr     ? 1.f
                     : p.decay_per_feature ? expf(p.decay[gate * m + r])
                                           : expf(p.decay[gate]);
    }
    __syncthreads();

    // the normalizer: z_t = w_t z_{t-1} + K~_t, den_t = Q~_t . z_t + eps (1 without it)
    if (z != nullptr) {
      float part[kMaxT];
#pragma unroll
      for (int t = 0; t < kMaxT; ++t) part[t] = 0.f;
      for (int r = tid; r < m; r += kThreads) {
        float zr = z[r];
#pragma unroll
        for (int t = 0; t < kMaxT; ++t) {
          if (t < nt) {
            zr = w[t * m + r] * zr + kf[t * m + r];
            part[t] = fmaf(qf[t * m + r], zr, part[t]);
          }
        }
        z[r] = zr;
      }
#pragma unroll
      for (int t = 0; t < kMaxT; ++t) {
        float x = part[t];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
        if (lane == 0) dots[t * kGroups + grp] = x;
      }
      __syncthreads();
      if (tid < nt) {
        float x = 0.f;
#pragma unroll
        for (int g = 0; g < kGroups; ++g) x += dots[tid * kGroups + g];
        den[tid] = x + p.eps;
      }
    } else if (tid < kMaxT) {
      den[tid] = 1.f;
    }

    // the state, one column tile at a time
    for (int c0 = 0; c0 < dv; c0 += kCols) {
      const int c = c0 + lane;
      const bool col = c < dv;
      float vc[kMaxT], o[kMaxT];
#pragma unroll
      for (int t = 0; t < kMaxT; ++t) {
        vc[t] = col && t < nt ? to_float(vh[int64_t(t0 + t) * p.v_row_stride + c]) : 0.f;
        o[t] = 0.f;
      }
      if (col) {
        for (int r0 = grp; r0 < m; r0 += kGroups * kUnroll) {
          float s[kUnroll];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int r = r0 + u * kGroups;
            s[u] = r < m ? S[int64_t(r) * p.state_row_stride + c] : 0.f;
          }
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int r = r0 + u * kGroups;
            if (r < m) {
#pragma unroll
              for (int t = 0; t < kMaxT; ++t) {
                if (t < nt) {
                  s[u] = fmaf(kf[t * m + r], vc[t], w[t * m + r] * s[u]);
                  o[t] = fmaf(qf[t * m + r], s[u], o[t]);
                }
              }
              S[int64_t(r) * p.state_row_stride + c] = s[u];
            }
          }
        }
      }
#pragma unroll
      for (int t = 0; t < kMaxT; ++t) red[(t * kGroups + grp) * kCols + lane] = o[t];
      __syncthreads();  // every row group's partials (and den)
      if (grp == 0 && col) {
        for (int t = 0; t < nt; ++t) {
          float x = 0.f;
#pragma unroll
          for (int g = 0; g < kGroups; ++g) x += red[(t * kGroups + g) * kCols + lane];
          oh[int64_t(t0 + t) * p.o_row_stride + c] = from_float<T>(x / den[t]);
        }
      }
      __syncthreads();  // red is read before the next tile writes it
    }
  }
}

}  // namespace linear_step_cuda
}  // namespace attn
