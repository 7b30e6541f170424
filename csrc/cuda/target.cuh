// The instructions the CUDA kernels of every family reach through inline PTX, one wrapper each,
// and the kernel launch: the one place where the kernels meet the GPU. The CPU emulator compiles
// the same kernels with g++, putting a header of this name with the same functions (their host
// emulation) ahead of csrc/ on the include path; nothing in csrc/ names the emulator.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

// kernel<<<grid, block, smem, stream>>>
#define ATTN_LAUNCH(kernel, grid, block, smem, stream) kernel<<<grid, block, smem, stream>>>

// The kernel's dynamic shared memory, `unsigned char name[]`.
#define ATTN_EXTERN_SMEM(name) extern __shared__ __align__(128) unsigned char name[]

// The wrappers are device code: host translation units (the launchers' .cpp callers of
// launch.h) see the macros only.
#if defined(__CUDACC__)
namespace attn {
namespace ptx {

// mma.sync.m16n8k16 with fp32 accumulators, f16 or bf16 operands: c += a b (mma.cuh's layouts)
__device__ __forceinline__ void mma_m16n8k16_f16(float* c, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_m16n8k16_bf16(float* c, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// mma.sync.m16n8k32 with int32 accumulators and signed int8 operands: c += a b, exact (mma.cuh's
// layouts with each 32-bit word holding four int8 along k: a0 = (g, 4c..4c+3), a2 = (g, 16+4c..))
__device__ __forceinline__ void mma_m16n8k32_s8(int32_t* c, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// A generic pointer into shared memory as the 32-bit shared-window address PTX takes.
__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// global -> shared copies of 16 bytes (.cg) and 4 bytes (.ca); src_bytes = 0 writes zeros
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t val) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(val));
}
__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t addr) {
  uint32_t val;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(val) : "r"(addr));
  return val;
}
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 val;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w)
               : "r"(addr));
  return val;
}

// ex2.approx.ftz: 2^x with -inf -> +0
__device__ __forceinline__ float ex2_approx_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// x, as a value the compiler cannot see through (an empty asm that claims to change it)
__device__ __forceinline__ int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

}  // namespace ptx
}  // namespace attn
#endif  // __CUDACC__
