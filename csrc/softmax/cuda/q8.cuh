// The int8 Q K^T of the CUDA forward (qk_quant = "int8", SageAttention's method; the CPU's is
// cpu/q8dot.h): a quantize pass writes the operands the mma.sync forward reads (fwd_kernel.cuh,
// FwdQ8), then the forward sums q . k exactly in int32 on mma.m16n8k32.s8 and turns each sum
// back into a float score with one FMA: s = sum * (q_scale * k_scale) + q . mean. The fp8 form
// (qk_quant = "fp8", the sm_90a wgmma kernel's only) is the same pass with e4m3 for int8: the
// scale amax / 448 and the rounding float_to_e4m3 (common/fp8.h), the sums in float32.
//
//   q8_mean_kernel     float64 partial sums of K over chunks of kQ8MeanKeys valid keys, for the K
//                      mean of each (sequence, kv head) (float64 as the CPU and
//                      reference.qk_int8_scores): the smoothing k - mean, which softmax does not
//                      see, and which takes a shared offset out of the int8 range;
//   q8_mean_finalize_kernel  the mean from those partials, in chunk order, per (sequence, kv head);
//   q8_quant_k_kernel  (k - mean) to int8 per block of block_k keys (the forward's key tile, so
//                      one scale per tile) and kv head: rint((k - mean) 127 / amax), amax over the
//                      block's valid keys and d channels;
//   q8_quant_q_kernel  q to int8 per block of block_q rows (one warp's rows of the forward) and
//                      head, and q . mean per row (float64), which the scores get back exactly.
//
// Valid keys are those some row of some head of the kv group may see (PolicyT::key_seen: the
// length, causal, the window, a bool bias): the others take no part in the mean or the scales and
// quantize to 0, so a NaN there reaches nothing, as in the float forward. A block holding a
// non-finite value gets a NaN scale (every score it feeds is NaN), as on the CPU. Float32 op for
// op as the reference rounds: the scale amax / 127 and the step 127 / amax are one IEEE division
// each (no fast-math in this build), the rounding to nearest even.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/fp8.h"
#include "cuda/mma.cuh"
#include "softmax/cuda/kernel_common.cuh"

namespace attn {
namespace tc {

constexpr int kQ8Threads = 128;
constexpr int kQ8MaxBlockK = 128;  // the largest key tile a FwdQ8 kernel quantizes per scale

// C of two adjacent n-tiles (c[0..3], c[4..7]) += A (16 x 32 int8) times the two 8-column halves
// (b[0..1], b[2..3]) of one ldmatrix.x4 B fragment: mma_n16's int8 form.
__device__ __forceinline__ void mma_s8_n16(int32_t* c, const uint32_t* a, const uint32_t* b) {
  ptx::mma_m16n8k32_s8(c, a, b);
  ptx::mma_m16n8k32_s8(c + 4, a, b + 2);
}

template <typename T>
__device__ __forceinline__ float q8_load(const T* x);
template <>
__device__ __forceinline__ float q8_load<__half>(const __half* x) {
  return __half2float(*x);
}
template <>
__device__ __forceinline__ float q8_load<__nv_bfloat16>(const __nv_bfloat16* x) {
  return __bfloat162float(*x);
}

// seen[r] for the n keys from j0 of (b, kv head hk): whether some row of some head of its group may
// see key j0 + r (PolicyT::key_seen), one thread per key; a bias shared by the heads is one head's
// work. Ends with a barrier.
__device__ __forceinline__ void q8_seen_keys(const SoftmaxParams& p, const SeqInfo& si, int b, int hk, int j0, int n,
                                             uint8_t* seen) {
  const int group = p.h / p.h_k;
  const int heads = p.sparse.on() || (p.bias_kind == BiasKind::kBool && p.bias_head_stride != 0) ? group : 1;
  // one policy per thread, moved from head to head (set_score_head: the bias); each thread reads
  // and writes only its own keys' flags until the barrier
  Policy pol(p, si, b, hk * group);
  for (int r = threadIdx.x; r < n; r += kQ8Threads) seen[r] = pol.key_seen(j0 + r);
  for (int g = 1; g < heads; ++g) {
    pol.set_score_head(p, b, hk * group + g);
    for (int r = threadIdx.x; r < n; r += kQ8Threads) seen[r] = seen[r] || pol.key_seen(j0 + r);
  }
  __syncthreads();
}

__device__ __forceinline__ bool q8_nonfinite(float x) { return (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u; }

// (max |x|, any non-finite) over the CTA: every thread gets the result
__device__ __forceinline__ float q8_block_amax(float amax, bool bad, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float v = bad ? __uint_as_float(0x7fc00000u) : amax;  // NaN stands for a non-finite value
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = (v != v || w != w) ? __uint_as_float(0x7fc00000u) : fmaxf(v, w);
  }
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float r = red[0];
  for (int i = 1; i < kQ8Threads / 32; ++i) {
    r = (r != r || red[i] != red[i]) ? __uint_as_float(0x7fc00000u) : fmaxf(r, red[i]);
  }
  __syncthreads();
  return r;
}

// The format's largest code: 127 (int8), 448 (e4m3)
__device__ __forceinline__ float q8_top(bool fp8) { return fp8 ? 448.f : 127.f; }

// scale = amax / top (NaN stays NaN); step = top / amax, 0 for NaN, 0 and an overflowing step
__device__ __forceinline__ void q8_scale_step(float amax, bool fp8, float* scale, float* step) {
  *scale = amax / q8_top(fp8);
  const float inv = q8_top(fp8) / amax;
  *step = amax > 0.f && inv <= 3.402823466e38f ? inv : 0.f;
}
// x * step to int8 (rint, clamped to +-127; NaN to 0) or to e4m3 bits (nearest even, saturated;
// NaN to 0). A non-finite input only comes with a NaN scale and step 0, so x * step is 0 or NaN.
__device__ __forceinline__ int8_t q8_round(float x, float step, bool fp8) {
  if (fp8) {
    const float y = x * step;
    return y == y ? int8_t(float_to_e4m3(y)) : int8_t(0);
  }
  const float y = rintf(x * step);
  return y == y ? int8_t(fminf(127.f, fmaxf(-127.f, y))) : int8_t(0);
}

// One block, n rows x d channels of value(r, c), to 8 bits at dst (row stride ld) with one scale,
// which thread 0 writes to *scale: the amax pass over the CTA, the scale and step, the rounding
// (fp8: e4m3 bits, else int8).
template <typename F>
__device__ __forceinline__ void q8_quantize_block(const F& value, int n, int d, bool fp8, int8_t* dst, int64_t ld,
                                                  float* scale, float* red) {
  float amax = 0.f;
  bool bad = false;
  for (int e = threadIdx.x; e < n * d; e += kQ8Threads) {
    const float x = value(e / d, e % d);
    bad |= q8_nonfinite(x);
    amax = fmaxf(amax, fabsf(x));
  }
  amax = q8_block_amax(amax, bad, red);
  float sc, step;
  q8_scale_step(amax, fp8, &sc, &step);
  if (threadIdx.x == 0) *scale = sc;
  for (int e = threadIdx.x; e < n * d; e += kQ8Threads) {
    const int r = e / d, c = e % d;
    dst[int64_t(r) * ld + c] = q8_round(value(r, c), step, fp8);
  }
}

// grid (chunks, H_k, B): the float64 sums of each channel over the valid keys of chunk
// blockIdx.x (kQ8MeanKeys keys; past the sequence: 0) and their count, into k_sum / k_count. The
// chunks spread a long sequence's mean over many CTAs; q8_mean_finalize_kernel adds them up.
template <typename T>
__global__ void __launch_bounds__(kQ8Threads) q8_mean_kernel(const SoftmaxParams p) {
  const int ch = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const SeqInfo si(p, b);
  const T* k = static_cast<const T*>(p.k) + si.k_offset(p, b, hk, 0, p.k_batch_stride, p.k_head_stride, p.k_row_stride);
  __shared__ uint8_t seen[kQ8MeanKeys];
  const int j0 = ch * kQ8MeanKeys, j1 = imin(si.len_k, j0 + kQ8MeanKeys);
  q8_seen_keys(p, si, b, hk, j0, j1 - j0, seen);
  const int64_t part = (int64_t(b) * p.h_k + hk) * p.q8.nch + ch;
  for (int c = threadIdx.x; c < p.d; c += kQ8Threads) {
    double sum = 0.0;
    int count = 0;
    for (int j = j0; j < j1; ++j) {
      if (!seen[j - j0]) continue;
      sum += double(q8_load(k + int64_t(j) * p.k_row_stride + c));
      ++count;
    }
    p.q8.k_sum[part * p.d + c] = sum;
    if (c == 0) p.q8.k_count[part] = count;
  }
}

// grid (H_k, B): k_mean of (b, hk) from q8_mean_kernel's partials, summed in chunk order; 0 with
// no valid key. Once per (sequence, kv head), so the K blocks read the mean instead of each
// re-summing the partials (which would grow as the square of the length). A template like the
// others (on the element type it does not read), so that every instantiation file may hold it.
template <typename T>
__global__ void __launch_bounds__(kQ8Threads) q8_mean_finalize_kernel(const SoftmaxParams p) {
  const int hk = blockIdx.x, b = blockIdx.y;
  const int64_t part0 = (int64_t(b) * p.h_k + hk) * p.q8.nch;
  int64_t count = 0;
  for (int ch = 0; ch < p.q8.nch; ++ch) count += p.q8.k_count[part0 + ch];
  for (int c = threadIdx.x; c < p.d; c += kQ8Threads) {
    double sum = 0.0;
    for (int ch = 0; ch < p.q8.nch; ++ch) sum += p.q8.k_sum[(part0 + ch) * p.d + c];
    p.q8.k_mean[(int64_t(b) * p.h_k + hk) * p.d + c] = count > 0 ? float(sum / double(count)) : 0.f;
  }
}

// grid (key blocks, H_k, B): k8 and k_scale of block blockIdx.x (keys [j0, j0 + block_k))
template <typename T>
__global__ void __launch_bounds__(kQ8Threads) q8_quant_k_kernel(const SoftmaxParams p) {
  __shared__ float red[kQ8Threads / 32];
  __shared__ uint8_t seen[kQ8MaxBlockK];
  const int hk = blockIdx.y, b = blockIdx.z, j0 = blockIdx.x * p.q8.block_k;
  const SeqInfo si(p, b);
  const int n = imin(p.q8.block_k, si.len_k - j0);
  if (n <= 0) return;  // past this sequence: the forward never reads the block
  q8_seen_keys(p, si, b, hk, j0, n, seen);
  const T* k =
      static_cast<const T*>(p.k) + si.k_offset(p, b, hk, j0, p.k_batch_stride, p.k_head_stride, p.k_row_stride);
  int8_t* k8 = p.q8.k + si.k_offset(p, b, hk, j0, p.q8.k_batch_stride, p.q8.k_head_stride, p.q8.k_row_stride);
  const float* mean = p.q8.k_mean + (int64_t(b) * p.h_k + hk) * p.d;
  auto value = [&](int r, int c) {  // k - mean of the block's key r, channel c; 0 where hidden
    if (!seen[r]) return 0.f;
    return q8_load(k + int64_t(r) * p.k_row_stride + c) - mean[c];
  };
  float* scale = p.q8.k_scale + (int64_t(b) * p.h_k + hk) * p.q8.nbk + blockIdx.x;
  q8_quantize_block(value, n, p.d, p.qk_quant == kQkFp8, k8, p.q8.k_row_stride, scale, red);
}

// grid (query blocks, H, B): q8 and q_scale of block blockIdx.x (rows [i0, i0 + block_q)), and
// q_mean of its rows
template <typename T>
__global__ void __launch_bounds__(kQ8Threads) q8_quant_q_kernel(const SoftmaxParams p) {
  __shared__ float red[kQ8Threads / 32];
  const int h = blockIdx.y, b = blockIdx.z, i0 = blockIdx.x * p.q8.block_q;
  const SeqInfo si(p, b);
  const int n = imin(p.q8.block_q, si.len_q - i0);
  if (n <= 0) return;
  const int hk = h / (p.h / p.h_k);
  const T* q = static_cast<const T*>(p.q) + si.q_offset(p, b, h, i0, p.q_batch_stride, p.q_head_stride, p.q_row_stride);
  int8_t* q8 = p.q8.q + si.q_offset(p, b, h, i0, p.q8.q_batch_stride, p.q8.q_head_stride, p.q8.q_row_stride);
  auto value = [&](int r, int c) { return q8_load(q + int64_t(r) * p.q_row_stride + c); };
  float* scale = p.q8.q_scale + (int64_t(b) * p.h + h) * p.q8.nbq + blockIdx.x;
  q8_quantize_block(value, n, p.d, p.qk_quant == kQkFp8, q8, p.q8.q_row_stride, scale, red);
  // q . mean, one row per thread (d <= 128 products in float64, in channel order)
  const float* mean = p.q8.k_mean + (int64_t(b) * p.h_k + hk) * p.d;
  for (int r = threadIdx.x; r < n; r += kQ8Threads) {
    double dot = 0.0;
    for (int c = 0; c < p.d; ++c) dot += double(q8_load(q + int64_t(r) * p.q_row_stride + c)) * double(mean[c]);
    p.q8.q_mean[lse_index(p, si, b, h, i0 + r)] = float(dot);
  }
}

}  // namespace tc
}  // namespace attn
