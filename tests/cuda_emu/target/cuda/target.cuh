// The CPU emulator's csrc/cuda/target.cuh: the same functions and macros, each the host emulation
// of its instruction (cuda_emu.h). The emulator build puts tests/cuda_emu/target ahead of csrc/
// on the include path, so the kernels' `#include "cuda/target.cuh"` finds this file.
#pragma once

#include "cuda_emu.h"

#include <cstdint>

#define ATTN_LAUNCH(kernel, grid, block, smem, stream) ::attn_emu::launch(kernel, grid, block, smem, stream)
#define ATTN_EXTERN_SMEM(name) unsigned char* const name = attn_emu::dynamic_smem()

namespace attn {
namespace ptx {

__device__ __forceinline__ void mma_m16n8k16_f16(float* c, const uint32_t* a, const uint32_t* b) {
  attn_emu::mma_m16n8k16(attn_emu::Elem::kF16, c, a, b);
}
__device__ __forceinline__ void mma_m16n8k16_bf16(float* c, const uint32_t* a, const uint32_t* b) {
  attn_emu::mma_m16n8k16(attn_emu::Elem::kBF16, c, a, b);
}
__device__ __forceinline__ void mma_m16n8k32_s8(int32_t* c, const uint32_t* a, const uint32_t* b) {
  attn_emu::mma_m16n8k32_s8(c, a, b);
}
__device__ __forceinline__ uint32_t smem_u32(const void* ptr) { return attn_emu::smem_u32(ptr); }
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  attn_emu::cp_async(dst, src, 16, src_bytes);
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, int src_bytes) {
  attn_emu::cp_async(dst, src, 4, src_bytes);
}
__device__ __forceinline__ void cp_async_commit() { attn_emu::cp_async_commit(); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  attn_emu::cp_async_wait(N);
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, uint32_t addr) { attn_emu::ldmatrix_x4(r, addr, false); }
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, uint32_t addr) { attn_emu::ldmatrix_x4(r, addr, true); }
__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t val) { attn_emu::st_shared_b32(addr, val); }
__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t addr) { return attn_emu::ld_shared_b32(addr); }
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) { return attn_emu::ld_shared_v4(addr); }
__device__ __forceinline__ float ex2_approx_ftz(float x) { return attn_emu::ex2_approx_ftz(x); }
__device__ __forceinline__ int opaque(int x) { return x; }

}  // namespace ptx
}  // namespace attn
