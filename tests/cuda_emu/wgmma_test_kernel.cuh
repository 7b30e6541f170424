// A test kernel of the emulated wgmma (test_wgmma_emulated.py): one warpgroup computes
// D (64 x kN) = A (64 x kK) B (kK x kN) + C with the operand layouts, descriptors and k-step
// offsets of cuda/wgmma.cuh as the sm_90a kernels build them, so the emulator checks that layout
// code against a plain matrix product. Variants:
//   0  ss:   A K-major (the forward's Q of S = Q K^T), B K-major (K, stored (kN, kK))
//   1  rs:   A from registers (mma A fragments: the forward's P of O = P V), B N-major (V)
//   2  ss_t: A M-major (the backward's dS^T of dQ = dS K), B N-major
// and two deliberate layout bugs that a correct emulation must turn into wrong results:
//   3  variant 0 with the stride-dimension offset of A's descriptor halved
//   4  variant 0 with A stored row-major without the 128-byte swizzle
#pragma once

#include <cstdint>

#include "cuda/convert.cuh"
#include "cuda/mma.cuh"
#include "cuda/wgmma.cuh"

namespace attn {
namespace wgmma_test {

template <typename T, int kN, int kK>
struct Plan {
  using TileA = wg::Sw128Tile<64, kK>;   // K-major A: (m, k)
  using TileAt = wg::Sw128Tile<kK, 64>;  // M-major A: (k, m)
  using TileB = wg::Sw128Tile<kN, kK>;   // K-major B: (n, k)
  using TileBt = wg::Sw128Tile<kK, kN>;  // N-major B: (k, n)
  static constexpr int kA = 0;
  static constexpr int kB = (TileA::kBytes > TileAt::kBytes ? TileA::kBytes : TileAt::kBytes);
  static constexpr int kBytes = kB + (TileB::kBytes > TileBt::kBytes ? TileB::kBytes : TileBt::kBytes);
};

// a (64, kK), b (kK, kN), c and d (64, kN) fp32, all row-major; grid 1, 128 threads,
// Plan::kBytes of dynamic shared memory (1024-aligned offsets)
template <typename T, int kN, int kK>
__global__ void wgmma_test_kernel(const T* a, const T* b, const float* c, float* d, int variant) {
  using P = Plan<T, kN, kK>;
  ATTN_EXTERN_SMEM(smem);
  const uint32_t base = tc::smem_u32(smem);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const bool a_mmajor = variant == 2, b_nmajor = variant == 1 || variant == 2;
  for (int e = tid; e < 64 * kK; e += 128) {
    const int m = e / kK, k = e % kK;
    uint32_t off = a_mmajor ? P::TileAt::offset(k, m) : P::TileA::offset(m, k);
    if (variant == 4) off = uint32_t(((k / 64) * 64 + m) * 128 + (k % 64) * 2);  // no swizzle
    *reinterpret_cast<T*>(smem + P::kA + off) = a[m * kK + k];
  }
  for (int e = tid; e < kK * kN; e += 128) {
    const int k = e / kN, n = e % kN;
    const uint32_t off = b_nmajor ? P::TileBt::offset(k, n) : P::TileB::offset(n, k);
    *reinterpret_cast<T*>(smem + P::kB + off) = b[k * kN + n];
  }
  __syncthreads();
  float acc[kN / 2];
  for (int nt = 0; nt < kN / 8; ++nt)
    for (int x = 0; x < 4; ++x) acc[4 * nt + x] = c[(16 * warp + g + (x >= 2 ? 8 : 0)) * kN + 8 * nt + 2 * t + (x & 1)];
  const uint64_t desc_a = a_mmajor ? wg::make_desc_sw128(base + P::kA, P::TileAt::kBlockBytes, 1024)
                                   : wg::make_desc_sw128(base + P::kA, 16, variant == 3 ? 512 : 1024);
  const uint64_t desc_b = b_nmajor ? wg::make_desc_sw128(base + P::kB, P::TileBt::kBlockBytes, 1024)
                                   : wg::make_desc_sw128(base + P::kB, 16, 1024);
  wg::fence();
  for (int kk = 0; kk < kK / 16; ++kk) {
    if (variant == 1) {
      uint32_t ar[4];
      const int r0 = 16 * warp + g, k0 = 16 * kk + 2 * t;
      auto pk = [&](int r, int k) { return tc::TypeOps<T>::pack(to_float(a[r * kK + k]), to_float(a[r * kK + k + 1])); };
      ar[0] = pk(r0, k0);
      ar[1] = pk(r0 + 8, k0);
      ar[2] = pk(r0, k0 + 8);
      ar[3] = pk(r0 + 8, k0 + 8);
      wg::Wgmma<kN, T>::rs(acc, ar, desc_b + wg::mnmajor_step(kk), 1);
    } else if (variant == 2) {
      wg::Wgmma<kN, T>::ss_t(acc, desc_a + wg::mnmajor_step(kk), desc_b + wg::mnmajor_step(kk), 1);
    } else {
      wg::Wgmma<kN, T>::ss(acc, desc_a + wg::kmajor_step<typename P::TileA>(kk),
                           desc_b + wg::kmajor_step<typename P::TileB>(kk), 1);
    }
  }
  wg::commit();
  wg::wait<0>();
  for (int nt = 0; nt < kN / 8; ++nt)
    for (int x = 0; x < 4; ++x) d[(16 * warp + g + (x >= 2 ? 8 : 0)) * kN + 8 * nt + 2 * t + (x & 1)] = acc[4 * nt + x];
}

}  // namespace wgmma_test
}  // namespace attn
