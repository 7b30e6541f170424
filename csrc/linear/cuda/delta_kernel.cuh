// The delta rule's forward on CUDA (DeltaNet, Gated DeltaNet, KDA and the plain write of GLA's
// per-key gates; common/delta_params.h states the math), in its recurrent form: the state stays
// in registers for the whole sequence and each token is one pass over it.
//
// Why recurrent: each column j of the (K, V) state evolves on its own (the gate scales rows; u_j
// and o_j read column j only), so the columns split over threads and CTAs with no communication,
// and the recurrence is exact for every gate, a hard reset (-inf) included, where a chunked (WY)
// form subtracts cumulative log-gates. It is the schedule of flash-linear-attention's fused
// recurrent kernels: what a decode step (delta_step) and inference need; a chunked tensor-core
// form for long training sequences would be a separate kernel.
//
// Layout: one CTA per (block of kBV columns, value head, sequence), kWarps warps. A column is held
// by KS lanes of one warp, each with kRows consecutive rows of it (K <= KS x kRows) in registers:
// lane = slice x kCW + column, kCW = 32 / KS columns per warp. The two reductions over K a token
// needs (p = h'^T k and o = h^T q) are then log2(KS) xor-shuffles each, and no barrier.
//
// Tokens go in blocks of `tokens` (host-chosen to fit 48 KB): every thread stages the block's q
// and k rows (L2-normalized when asked, q scaled), gate factors exp(g), beta and the CTA's v
// columns in shared memory; one barrier; each thread walks the block's tokens reading its rows of
// k and q (and per-key gates) as float4 broadcasts; the slice-0 lanes leave o in shared memory,
// written out coalesced after a second barrier. The state's rows past K stay 0 (their k is 0).
//
// The in-place step (delta_step) passes the state as both the initial and the final state: each
// thread reads its elements at its start and writes the same elements at its end.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/delta_params.h"
#include "cuda/convert.cuh"
#include "cuda/mma.cuh"  // ATTN_EXTERN_SMEM (and the emulator's device names)

namespace attn {
namespace delta_cuda {

using DeltaParams = DeltaParamsT<float>;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxTokens = 32;
constexpr int kSmemBudget = 48 * 1024;  // no opt-in needed: several CTAs per SM

// Shared-memory floats of one token (rounded up to 4 so that every section stays 16-byte aligned):
// q and k rows (kp each), per-key gate factors (kp) or one factor, v's columns and o's (bv each),
// beta.
__host__ __device__ inline int token_floats(int kp, int bv, bool per_key) {
  const int n = 2 * kp + (per_key ? kp : 1) + 2 * bv + 1;
  return (n + 3) / 4 * 4;
}

__device__ __forceinline__ float load_side(DType dt, const void* base, int64_t i) {
  switch (dt) {
    case DType::kF32: return static_cast<const float*>(base)[i];
    case DType::kF16: return __half2float(static_cast<const __half*>(base)[i]);
    default: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
  }
}

template <int KS>
__device__ __forceinline__ float slice_sum(float x) {
  constexpr int kCW = 32 / KS;
#pragma unroll
  for (int o = kCW; o < 32; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

template <typename T, int KS, int kRows>
__global__ void __launch_bounds__(kThreads) delta_fwd_kernel(const DeltaParams p, const int tokens) {
  constexpr int kCW = 32 / KS, kBV = kWarps * kCW, kKp = KS * kRows;
  static_assert(kRows % 4 == 0, "rows are read as float4");
  ATTN_EXTERN_SMEM(smem);
  float* sm = reinterpret_cast<float*>(smem);
  const bool per_key = p.gate != nullptr && p.gate_per_key;
  const bool gated = p.gate != nullptr;
  // sections, each a multiple of 4 floats
  float* ks = sm;                                          // (tokens, kKp)
  float* qs = ks + tokens * kKp;                           // (tokens, kKp)
  float* as = qs + tokens * kKp;                           // (tokens, kKp) per key, else (tokens)
  float* vs = as + (per_key ? tokens * kKp : (tokens + 3) / 4 * 4);  // (tokens, kBV)
  float* os = vs + tokens * kBV;                           // (tokens, kBV)
  float* bs = os + tokens * kBV;                           // (tokens)

  const int n = blockIdx.z, hv = blockIdx.y, c0 = blockIdx.x * kBV;
  const int hk = hv / (p.h_v / p.h_k);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int slice = lane / kCW, jl = warp * kCW + lane % kCW, col = c0 + jl, r0 = slice * kRows;
  const int K = p.dim_k, V = p.dim_v;
  const bool has_col = col < V;

  int b = n;
  int64_t row0 = 0;
  int len = p.s;
  if (p.cu_seqlens != nullptr) {
    b = 0;
    row0 = p.cu_seqlens[n];
    len = p.cu_seqlens[n + 1] - p.cu_seqlens[n];
  }
  const T* qh = static_cast<const T*>(p.q) + int64_t(b) * p.q_batch_stride + int64_t(hk) * p.q_head_stride;
  const T* kh = static_cast<const T*>(p.k) + int64_t(b) * p.k_batch_stride + int64_t(hk) * p.k_head_stride;
  const T* vh = static_cast<const T*>(p.v) + int64_t(b) * p.v_batch_stride + int64_t(hv) * p.v_head_stride;
  T* oh = static_cast<T*>(p.o) + int64_t(b) * p.o_batch_stride + int64_t(hv) * p.o_head_stride;
  const int64_t side0 = (int64_t(b) * p.h_v + hv) * p.s + row0;  // beta / gate index of the first row
  const int64_t st0 = (int64_t(n) * p.h_v + hv) * K * V;          // this head in a (N, h_v, K, V) state

  float h[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int r = r0 + i;
    h[i] = p.init_state != nullptr && has_col && r < K ? p.init_state[st0 + int64_t(r) * V + col] : 0.f;
  }

  for (int t0 = 0; t0 < len; t0 += tokens) {
    const int nt = min(tokens, len - t0);
    // stage: a warp per token row of q and k (sum of squares by shuffles), then the rest
    for (int t = warp; t < nt; t += kWarps) {
      const int64_t r = row0 + t0 + t;
      float sk = 0.f, sq = 0.f;
      for (int i = lane; i < kKp; i += 32) {
        const float x = i < K ? to_float(kh[r * p.k_row_stride + i]) : 0.f;
        const float y = i < K ? to_float(qh[r * p.q_row_stride + i]) : 0.f;
        ks[t * kKp + i] = x;
        qs[t * kKp + i] = y;
        sk = fmaf(x, x, sk);
        sq = fmaf(y, y, sq);
      }
      float fk = 1.f, fq = p.scale;
      if (p.qk_l2norm) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          sk += __shfl_xor_sync(0xffffffffu, sk, o);
          sq += __shfl_xor_sync(0xffffffffu, sq, o);
        }
        fk = 1.f / sqrtf(sk + p.l2_eps);
        fq = p.scale / sqrtf(sq + p.l2_eps);
      }
      for (int i = lane; i < kKp; i += 32) {  // this lane's own elements: no barrier
        ks[t * kKp + i] *= fk;
        qs[t * kKp + i] *= fq;
      }
      if (per_key) {
        for (int i = lane; i < kKp; i += 32) {
          as[t * kKp + i] = i < K ? expf(load_side(p.gate_dt, p.gate, (side0 + t0 + t) * K + i)) : 0.f;
        }
      }
    }
    for (int e = tid; e < nt * kBV; e += kThreads) {
      const int t = e / kBV, j = e % kBV;
      vs[e] = c0 + j < V ? to_float(vh[(row0 + t0 + t) * p.v_row_stride + c0 + j]) : 0.f;
    }
    if (tid < nt) {
      bs[tid] = p.plain ? 0.f : load_side(p.beta_dt, p.beta, side0 + t0 + tid);
      if (gated && !per_key) as[tid] = expf(load_side(p.gate_dt, p.gate, side0 + t0 + tid));
    }
    __syncthreads();

    for (int t = 0; t < nt; ++t) {
      const float4* k4 = reinterpret_cast<const float4*>(ks + t * kKp + r0);
      float kr[kRows];
#pragma unroll
      for (int i = 0; i < kRows / 4; ++i) {
        const float4 x = k4[i];
        kr[4 * i] = x.x;
        kr[4 * i + 1] = x.y;
        kr[4 * i + 2] = x.z;
        kr[4 * i + 3] = x.w;
      }
      if (per_key) {
        const float4* a4 = reinterpret_cast<const float4*>(as + t * kKp + r0);
#pragma unroll
        for (int i = 0; i < kRows / 4; ++i) {
          const float4 x = a4[i];
          h[4 * i] *= x.x;
          h[4 * i + 1] *= x.y;
          h[4 * i + 2] *= x.z;
          h[4 * i + 3] *= x.w;
        }
      } else if (gated) {
        const float a = as[t];
#pragma unroll
        for (int i = 0; i < kRows; ++i) h[i] *= a;
      }
      float u = vs[t * kBV + jl];
      if (!p.plain) {  // u = beta (v - h'^T k)
        float pa[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int i = 0; i < kRows; ++i) pa[i % 4] = fmaf(h[i], kr[i], pa[i % 4]);
        const float pk = slice_sum<KS>((pa[0] + pa[1]) + (pa[2] + pa[3]));
        u = bs[t] * (u - pk);
      }
      const float4* q4 = reinterpret_cast<const float4*>(qs + t * kKp + r0);
      float oa[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int i = 0; i < kRows / 4; ++i) {
        const float4 x = q4[i];
        const float qv[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          h[4 * i + e] = fmaf(kr[4 * i + e], u, h[4 * i + e]);
          oa[e] = fmaf(h[4 * i + e], qv[e], oa[e]);
        }
      }
      const float o = slice_sum<KS>((oa[0] + oa[1]) + (oa[2] + oa[3]));
      if (slice == 0) os[t * kBV + jl] = o;
    }
    __syncthreads();  // o of the block; the staged rows are read
    for (int e = tid; e < nt * kBV; e += kThreads) {
      const int t = e / kBV, j = e % kBV;
      if (c0 + j < V) oh[(row0 + t0 + t) * p.o_row_stride + c0 + j] = from_float<T>(os[e]);
    }
    // the next block's staging writes ks .. vs and bs, which no thread reads past the barrier
    // above; os is written again only after the next barrier
  }

  if (p.final_state != nullptr && has_col) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int r = r0 + i;
      if (r < K) p.final_state[st0 + int64_t(r) * V + col] = h[i];
    }
  }
}

}  // namespace delta_cuda
}  // namespace attn
