// Building blocks of the sm_90a (Hopper) kernels: the shared-memory layout and descriptors of
// wgmma operands and the register split of warpgroup roles (plain C++, here), and the
// instructions (cuda/wgmma_ops.cuh: warpgroup MMA, mbarriers, the proxy fence, setmaxnreg, named
// barriers), which the CPU emulator replaces with its own (tests/cuda_emu/target/cuda/wgmma_ops.cuh)
// while this layout code stays the one both run.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace attn {
namespace wg {

// ---------------------------------------------------------------- operand layout in shared memory
// A (kRows, kCols) tile of 16-bit elements in wgmma's 128-byte-swizzle layout: kCols / 64 column
// blocks of (kRows, 64), each block row-major with 128-byte rows and 16-byte chunk c of row r
// stored at chunk c ^ (r % 8). Element (r, col) is at
//   (col / 64) * kRows * 128 + r * 128 + (((col / 8) % 8) ^ (r % 8)) * 16 + (col % 8) * 2.
// 8 rows x 128 bytes (1024 bytes) form one swizzle atom. The hardware applies the swizzle to
// absolute address bits ([4:6] ^= [7:9]), so the two agree only when each atom starts on a
// 1024-byte boundary: every tile base must be 1024-aligned (then the descriptor's base offset
// is 0), which the kernel's shared-memory plan asserts.
//
// One layout serves both majors the kernel needs:
//   K-major (Q as A, K as B of S = Q K^T; rows = M or N, columns = head dim = K): a k-step of
//     16 columns is 32 bytes inside a 128-byte row; 8-row atoms repeat every 1024 bytes (SBO);
//     columns 64.. are the next column block (a new start address, not a descriptor stride).
//   N-major (V as B of O = P V; rows = keys = K, columns = head dim = N): 64 N-columns are 128
//     contiguous bytes, 8 key rows form an atom, the next 8 keys are 1024 bytes on (SBO), the
//     next 64 N-columns one column block on (LBO = kRows * 128).
//   M-major (an A operand stored transposed, e.g. dS^T as A of the backward's dQ = dS K: rows =
//     keys = K, columns = queries = M): the N-major layout with M in the role of N.
template <int kRows, int kCols>
struct Sw128Tile {
  static_assert(kCols % 64 == 0, "whole 128-byte rows per column block");
  static_assert(kRows % 8 == 0, "whole 8-row swizzle atoms");
  static constexpr int kChunks = kCols / 8;          // 16-byte chunks per row
  static constexpr int kBlockBytes = kRows * 128;    // one 64-column block
  static constexpr int kBytes = kRows * kCols * 2;
  static_assert(kBlockBytes % 1024 == 0, "column blocks keep the atoms 1024-aligned");
  __device__ __forceinline__ static uint32_t offset(int r, int col) {  // col in elements
    const int c = col >> 3;
    return uint32_t((c >> 3) * kBlockBytes + r * 128 + (((c & 7) ^ (r & 7)) << 4) + (col & 7) * 2);
  }
};

// 64-bit shared-memory matrix descriptor of wgmma (PTX ISA, "Matrix Descriptor Format"):
//   bits  0-13  start address >> 4
//   bits 16-29  leading-dimension byte offset >> 4 (K-major swizzled: unused, set to 1)
//   bits 32-45  stride-dimension byte offset >> 4
//   bits 49-51  base offset (0: atoms start on 1024-byte boundaries)
//   bits 62-63  swizzle mode, 1 = 128-byte swizzle
// Moving to another k-step adds (byte offset >> 4) to the low bits: shared addresses stay below
// 2^18, so the 14-bit address field never carries into the next one.
__device__ __forceinline__ uint64_t make_desc_sw128(uint32_t smem_addr, uint32_t lbo_bytes,
                                                    uint32_t sbo_bytes) {
  return uint64_t((smem_addr & 0x3FFFFu) >> 4) | (uint64_t((lbo_bytes >> 4) & 0x3FFFu) << 16) |
         (uint64_t((sbo_bytes >> 4) & 0x3FFFu) << 32) | (uint64_t(1) << 62);
}

// Descriptor offsets (already >> 4) of k-step kk (16 along K) of an operand in an Sw128Tile:
//   K-major (K along the 128-byte rows): 32 bytes on inside a row, a column block on every 4
//     steps;
//   MN-major (K along the rows: 16 rows = two 8-row atoms): 2048 bytes on.
template <typename Tile>
__device__ __forceinline__ constexpr uint64_t kmajor_step(int kk) {
  return uint64_t(((kk >> 2) * Tile::kBlockBytes + (kk & 3) * 32) >> 4);
}
__device__ __forceinline__ constexpr uint64_t mnmajor_step(int kk) { return uint64_t((kk * 16 * 128) >> 4); }

// Compile-time check of a split of kThreads = 128 x (1 + kConsumerWGs) threads into one producer
// warpgroup (kProducerRegs each) and kConsumerWGs consumer warpgroups (kConsumerRegs each):
// setmaxnreg only redistributes what the launch allocated, kThreads x the per-thread cap of
// __launch_bounds__(kThreads, 1), a multiple of 8 (168 for 384 threads: e.g. 40 + 2 x 232 = 504).
// A plan instantiates it (kOk) so that its asserts fire there.
template <int kThreads, int kConsumerWGs, int kProducerRegs, int kConsumerRegs>
struct RegisterSplit {
  static_assert(kThreads == 128 * (1 + kConsumerWGs), "one producer and kConsumerWGs consumer warpgroups");
  static_assert(kProducerRegs + kConsumerWGs * kConsumerRegs <= (65536 / kThreads) / 8 * 8 * (1 + kConsumerWGs),
                "setmaxnreg asks for more registers than the launch allocates");
  static_assert(kProducerRegs % 8 == 0 && kConsumerRegs % 8 == 0 && kProducerRegs >= 24 && kConsumerRegs <= 256,
                "setmaxnreg takes multiples of 8 in [24, 256]");
  static constexpr bool kOk = true;
};

}  // namespace wg
}  // namespace attn

#include "cuda/wgmma_ops.cuh"
