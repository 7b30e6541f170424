// One row per warp: lane l holds head-dim elements l, l + 32, ... (up to kSimtMaxD) of a row in
// float32 registers, and q.k is a per-lane sum then a warp reduction. Shared by the softmax
// family's SIMT kernels and top-k's threshold pass (sparse), which must compute each logit's q.k
// bit for bit alike.
#pragma once

#include <cuda_runtime.h>

#include "cuda/convert.cuh"  // to_float, from_float

namespace attn {
namespace simt {

constexpr int kSimtMaxD = 256;
constexpr int kChunks = kSimtMaxD / 32;

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

template <typename T>
__device__ __forceinline__ void load_row(float* r, const T* src, int d, int lane) {
#pragma unroll
  for (int t = 0; t < kChunks; ++t) {
    const int col = lane + 32 * t;
    r[t] = col < d ? to_float(src[col]) : 0.f;
  }
}
template <typename T>
__device__ __forceinline__ void store_row(T* dst, const float* r, int d, int lane) {
#pragma unroll
  for (int t = 0; t < kChunks; ++t) {
    const int col = lane + 32 * t;
    if (col < d) dst[col] = from_float<T>(r[t]);
  }
}
template <typename T>
__device__ __forceinline__ float dot_row(const float* r, const T* src, int d, int lane) {
  float acc = 0.f;
#pragma unroll
  for (int t = 0; t < kChunks; ++t) {
    const int col = lane + 32 * t;
    if (col < d) acc += r[t] * to_float(src[col]);
  }
  return warp_sum(acc);
}

}  // namespace simt
}  // namespace attn
