// The CPU emulator's csrc/cuda/wgmma_ops.cuh: the same functions, each the host emulation of its
// instruction (cuda_emu.h). The emulator's include path puts tests/cuda_emu/target ahead of
// csrc/, so cuda/wgmma.cuh's `#include "cuda/wgmma_ops.cuh"` finds this file, while the operand
// layouts and descriptors (cuda/wgmma.cuh itself) are the ones the GPU build runs.
//
// wgmma runs when it is issued, so fence / commit / wait and the operand fences have nothing to
// order. An mbarrier wait blocks the emulated thread until the phase completes; a phase that
// never completes, or a named barrier some threads never reach, is reported as a deadlock.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "cuda_emu.h"

namespace attn {
namespace wg {

__device__ __forceinline__ void fence() {}
__device__ __forceinline__ void commit() {}
template <int N>
__device__ __forceinline__ void wait() {}
template <int N>
__device__ __forceinline__ void fence_operands(float (&)[N]) {}
template <int N>
__device__ __forceinline__ void fence_operands(uint32_t (&)[N][4]) {}
template <int N>
__device__ __forceinline__ void fence_operands(int32_t (&)[N]) {}

template <int N, typename T>
struct Wgmma {
  static_assert(N == 64 || N == 128, "the kernels' wgmma shapes: m64n64k16 and m64n128k16");
  static constexpr ::attn_emu::Elem kElem =
      std::is_same_v<T, __half> ? ::attn_emu::Elem::kF16 : ::attn_emu::Elem::kBF16;
  static void ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int accumulate) {
    ::attn_emu::wgmma(kElem, N, d, desc_a, nullptr, desc_b, accumulate, false, false);
  }
  static void ss_t(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int accumulate) {
    ::attn_emu::wgmma(kElem, N, d, desc_a, nullptr, desc_b, accumulate, true, true);
  }
  static void rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b, int accumulate) {
    ::attn_emu::wgmma(kElem, N, d, 0, a, desc_b, accumulate, false, true);
  }
};

template <int N>
struct WgmmaS8 {
  static_assert(N == 64 || N == 128, "the kernels' int8 wgmma shapes: m64n64k32 and m64n128k32");
  static void ss(int32_t (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int accumulate) {
    ::attn_emu::wgmma_s8(N, d, desc_a, desc_b, accumulate);
  }
};

template <int N>
struct WgmmaE4M3 {
  static_assert(N == 64 || N == 128, "the kernels' fp8 wgmma shapes: m64n64k32 and m64n128k32");
  static void ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int accumulate) {
    ::attn_emu::wgmma_e4m3(N, d, desc_a, desc_b, accumulate);
  }
};

__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t val) { ::attn_emu::st_shared_b32(addr, val); }
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) { return ::attn_emu::ld_shared_v4(addr); }
__device__ __forceinline__ float2 ld_shared_f2(uint32_t addr) { return ::attn_emu::ld_shared_v2f(addr); }
__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t addr) { return ::attn_emu::ld_shared_b32(addr); }
__device__ __forceinline__ int opaque(int x) { return x; }

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) { ::attn_emu::mbar_init(bar, count); }
__device__ __forceinline__ void mbar_arrive(uint32_t bar) { ::attn_emu::mbar_arrive(bar); }
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) { ::attn_emu::mbar_wait(bar, parity); }
// the emulator has one proxy: cp.async data land at the issuing thread's wait, before it arrives
__device__ __forceinline__ void fence_proxy_async() {}
// register budgets are not modeled
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {}
template <int kThreads>
__device__ __forceinline__ void named_barrier_sync(int id) {
  ::attn_emu::named_barrier(id, kThreads);
}

}  // namespace wg
}  // namespace attn
