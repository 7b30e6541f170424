// PTX building blocks for the sm_80+ tensor-core kernels of every family: cp.async, ldmatrix,
// mma.sync m16n8k16, a swizzled shared-memory tile, fp32 <-> 16-bit packing, exp2.
//
// Fragment layouts of mma.m16n8k16 (lane = 4 * g + c, g = lane / 4, c = lane % 4):
//   A (16 x 16, row-major): a0 = (g, 2c..2c+1)   a1 = (g+8, 2c..)   a2 = (g, 2c+8..)   a3 = (g+8, 2c+8..)
//   B (16 x 8,  "col"):     b0 = (k 2c..2c+1, n g)                  b1 = (k 2c+8.., n g)
//   C (16 x 8,  fp32):      c0,c1 = (g, 2c..2c+1)                   c2,c3 = (g+8, 2c..2c+1)
// so the C fragments of two adjacent n-tiles of one product are exactly the A fragment of the
// next product (the P of softmax(QK^T) feeding PV without a trip through shared memory).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/target.cuh"  // the instructions (ptx::), ATTN_EXTERN_SMEM

namespace attn {
namespace tc {

// ---------------------------------------------------------------- element type traits
template <typename T>
struct TypeOps;

template <>
struct TypeOps<__half> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  // the inverse of pack: (lo, hi)
  static __device__ __forceinline__ float2 unpack(uint32_t u) {
    return __half22float2(*reinterpret_cast<__half2*>(&u));
  }
  static __device__ __forceinline__ void mma(float* c, const uint32_t* a, const uint32_t* b) {
    ptx::mma_m16n8k16_f16(c, a, b);
  }
};

template <>
struct TypeOps<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  static __device__ __forceinline__ float2 unpack(uint32_t u) {
    return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
  }
  static __device__ __forceinline__ void mma(float* c, const uint32_t* a, const uint32_t* b) {
    ptx::mma_m16n8k16_bf16(c, a, b);
  }
};

// C of two adjacent n-tiles (c[0..3], c[4..7]) += A times the two 8-column halves (b[0..1],
// b[2..3]) of one ldmatrix.x4 B fragment.
template <typename T>
__device__ __forceinline__ void mma_n16(float* c, const uint32_t* a, const uint32_t* b) {
  TypeOps<T>::mma(c, a, b);
  TypeOps<T>::mma(c + 4, a, b + 2);
}

// ---------------------------------------------------------------- shared memory
__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return ptx::smem_u32(ptr);
}

// 16-byte global -> shared copy; src_bytes = 0 writes zeros (rows past the sequence end, head
// dims past d), so padded lanes never hold garbage that could turn into NaN.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  int n = valid ? 16 : 0;
  ptx::cp_async16(dst, src, n);
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool valid) {
  int n = valid ? 4 : 0;
  ptx::cp_async4(dst, src, n);
}
__device__ __forceinline__ void cp_async_commit() { ptx::cp_async_commit(); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  ptx::cp_async_wait<N>();
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, uint32_t addr) {
  ptx::ldmatrix_x4(r, addr);
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, uint32_t addr) {
  ptx::ldmatrix_x4_trans(r, addr);
}

// 32-bit store, 32- and 128-bit loads of shared memory at a smem_u32 address (the forward's O
// staging, the backward's dS^T, the poisoned-row votes of nonfinite.cuh).
__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t val) {
  ptx::st_shared_b32(addr, val);
}
__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t addr) {
  return ptx::ld_shared_u32(addr);
}
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  return ptx::ld_shared_v4(addr);
}

// A (kRows x kCols) tile of 16-bit elements in shared memory, rows of kCols / 8 chunks of 16
// bytes, with an XOR swizzle of the chunk index so that the 8 rows one ldmatrix 8x8 reads hit
// 8 different 16-byte bank groups (conflict-free):
//   rows of >= 128 bytes: chunk c of row r is stored at chunk c ^ (r % 8)
//   rows of 64 bytes (two rows per 128 bytes): chunk c ^ ((r / 2) % 4)
template <int kRows, int kCols>
struct SmemTile {
  static_assert(kCols % 64 == 0 || kCols == 32, "rows must be 64 bytes or a multiple of 128");
  static constexpr int kChunks = kCols / 8;
  static constexpr int kBytes = kRows * kCols * 2;
  __device__ __forceinline__ static int swz(int r) { return kChunks >= 8 ? (r & 7) : ((r >> 1) & 3); }
  __device__ __forceinline__ static uint32_t offset(int r, int col) {  // col in elements
    int c = col >> 3;
    return uint32_t((r * kChunks + (c ^ swz(r))) * 16 + (col & 7) * 2);
  }
  // offset(r + dr, col + dc) from off = offset(r, col), for dr % 8 == 0 and chunk deltas
  // dc / 8 whose low bits (3, or 2 for 64-byte rows) are disjoint from those of col / 8: one
  // XOR and an immediate, so an unrolled loop keeps one base register per operand instead of
  // one address per step.
  __device__ __forceinline__ static uint32_t advance(uint32_t off, int dr, int dc) {
    constexpr int kMask = kChunks >= 8 ? 7 : 3;
    const int cd = dc >> 3;
    return (off ^ uint32_t((cd & kMask) << 4)) + uint32_t(dr * kChunks * 16 + (cd & ~kMask) * 16);
  }
  // This lane's ldmatrix.x4 row address (then moved with advance()) for
  //   lane_a:  an A fragment, rows [r0, r0 + 16) x columns [0, 16)
  //   lane_b:  B fragments of two n-tiles, the tile's rows [0, 16) as n, columns [c0, c0 + 16)
  //            as k (b[0..1]: rows 0-7, b[2..3]: rows 8-15)
  //   lane_bt: the same read with .trans from a (k, n) tile, rows [0, 16) as k, columns
  //            [c0, c0 + 16) as n
  __device__ __forceinline__ static uint32_t lane_a(int r0, int lane) {
    return offset(r0 + (lane & 15), (lane >> 4) * 8);
  }
  __device__ __forceinline__ static uint32_t lane_b(int c0, int lane) {
    return offset((lane & 7) + (lane >> 4) * 8, c0 + ((lane >> 3) & 1) * 8);
  }
  __device__ __forceinline__ static uint32_t lane_bt(int c0, int lane) {
    return offset((lane & 7) + ((lane >> 3) & 1) * 8, c0 + (lane >> 4) * 8);
  }
};

// Copy rows [0, kRows) x cols [0, kCols) of a global tile (row stride in elements) into a
// swizzled shared tile; rows >= valid_rows and cols >= valid_cols are zero-filled. Tile is the
// shared layout: SmemTile for ldmatrix, wg::Sw128Tile for the wgmma operands of sm_90a.
template <int kRows, int kCols, int kThreads, typename T, typename Tile = SmemTile<kRows, kCols>>
__device__ __forceinline__ void load_tile_async(uint32_t smem, const T* gmem, int64_t row_stride,
                                                int valid_rows, int valid_cols, int tid) {
  constexpr int kTotal = kRows * Tile::kChunks;
#pragma unroll
  for (int it = 0; it < (kTotal + kThreads - 1) / kThreads; ++it) {
    int idx = it * kThreads + tid;
    if (kTotal % kThreads == 0 || idx < kTotal) {
      int r = idx / Tile::kChunks;
      int c = idx % Tile::kChunks;
      bool ok = r < valid_rows && c * 8 < valid_cols;
      const T* src = ok ? gmem + int64_t(r) * row_stride + c * 8 : gmem;
      cp_async16(smem + Tile::offset(r, c * 8), src, ok);
    }
  }
}

// ex2.approx: 2^x with -inf -> +0, the one transcendental of the softmax inner loop.
__device__ __forceinline__ float fast_exp2(float x) {
  return ptx::ex2_approx_ftz(x);
}

}  // namespace tc
}  // namespace attn
