// The tensor-core product shapes and fragment helpers of the linear family's chunk kernels (the
// linear attention ones through mma_common.cuh, the delta rule's directly): 16-bit shared-memory
// access, the (row, column) of an accumulator element, and the two product shapes every chunk
// product is made of (operands in swizzled shared tiles, or the A operand in registers). No
// kernels here, so every kernel TU may include it (a header with __global__ definitions may be
// included by one TU only).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/convert.cuh"  // to_float, from_float
#include "cuda/mma.cuh"

namespace attn {
namespace linear_tc {

template <typename T>
__device__ __forceinline__ void st16(unsigned char* base, uint32_t off, float x) {
  *reinterpret_cast<T*>(base + off) = from_float<T>(x);
}
template <typename T>
__device__ __forceinline__ float ld16(const unsigned char* base, uint32_t off) {
  return to_float(*reinterpret_cast<const T*>(base + off));
}

// x, as a value the compiler cannot see through. A sweep's chunk loop starts with lane =
// opaque(lane): the lane's shared-memory addresses of every product are then recomputed per
// chunk (a few integer ops) instead of hoisted out of the loops and all kept live in registers.
__device__ __forceinline__ int opaque(int x) { return ptx::opaque(x); }

template <int kTiles>
__device__ __forceinline__ void zero(float (&acc)[kTiles][4]) {
#pragma unroll
  for (int t = 0; t < kTiles; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
}
// The (row, column) of accumulator element x of n-tile t, for a warp's 16 rows starting at row0.
__device__ __forceinline__ int acc_row(int row0, int lane, int x) { return row0 + lane / 4 + (x < 2 ? 0 : 8); }
__device__ __forceinline__ int acc_col(int t, int lane, int x) { return t * 8 + 2 * (lane % 4) + (x & 1); }

// acc (16 x kCols, kCols / 8 n-tiles) += A B, A = rows [row0, row0 + 16) x columns [0, kK) of
// the ATile at shared address a; B (kK x kCols) from the BTile at b, stored either
//   kBRowsK = false: rows n, columns k (B^T in memory: the Q K^T shape), ldmatrix
//   kBRowsK = true:  rows k, columns n (the A V shape), ldmatrix.trans
// Addresses: one lane offset per operand, moved by SmemTile::advance, so that the unrolled steps
// (and the loop-invariant addresses the compiler would hoist out of a sweep) cost no register
// each.
template <typename T, typename ATile, typename BTile, int kK, int kCols, bool kBRowsK>
__device__ __forceinline__ void mma_smem(float (&acc)[kCols / 8][4], uint32_t a, int row0, uint32_t b, int lane) {
  const uint32_t ao = ATile::advance(ATile::lane_a(0, lane), row0, 0);
  const uint32_t bo = kBRowsK ? BTile::lane_bt(0, lane) : BTile::lane_b(0, lane);
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t af[4];
    tc::ldmatrix_x4(af, a + ATile::advance(ao, 0, kk * 16));
#pragma unroll
    for (int np = 0; np < kCols / 16; ++np) {
      uint32_t bf[4];
      if constexpr (kBRowsK) {
        tc::ldmatrix_x4_trans(bf, b + BTile::advance(bo, kk * 16, np * 16));
      } else {
        tc::ldmatrix_x4(bf, b + BTile::advance(bo, np * 16, kk * 16));
      }
      tc::mma_n16<T>(acc[2 * np], af, bf);
    }
  }
}

// acc (16 x kCols) += P B with P (16 x kK) the fp32 accumulators of an earlier product (the C
// fragments of two adjacent n-tiles are one A fragment, mma.cuh), rounded to T; B in the BTile at
// b as rows k, columns n (kBRowsK, ldmatrix.trans) or rows n, columns k (P B^T's shape).
template <typename T, typename BTile, int kK, int kCols, bool kBRowsK = true>
__device__ __forceinline__ void mma_reg(float (&acc)[kCols / 8][4], const float (&pm)[kK / 8][4], uint32_t b, int lane) {
  using Ops = tc::TypeOps<T>;
  const uint32_t bo = kBRowsK ? BTile::lane_bt(0, lane) : BTile::lane_b(0, lane);
#pragma unroll
  for (int kb = 0; kb < kK / 16; ++kb) {
    uint32_t a[4];
    a[0] = Ops::pack(pm[2 * kb][0], pm[2 * kb][1]);
    a[1] = Ops::pack(pm[2 * kb][2], pm[2 * kb][3]);
    a[2] = Ops::pack(pm[2 * kb + 1][0], pm[2 * kb + 1][1]);
    a[3] = Ops::pack(pm[2 * kb + 1][2], pm[2 * kb + 1][3]);
#pragma unroll
    for (int np = 0; np < kCols / 16; ++np) {
      uint32_t bf[4];
      if constexpr (kBRowsK) {
        tc::ldmatrix_x4_trans(bf, b + BTile::advance(bo, kb * 16, np * 16));
      } else {
        tc::ldmatrix_x4(bf, b + BTile::advance(bo, np * 16, kb * 16));
      }
      tc::mma_n16<T>(acc[2 * np], a, bf);
    }
  }
}

}  // namespace linear_tc
}  // namespace attn
