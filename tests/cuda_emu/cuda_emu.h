// Host shim that compiles the mma.sync / SIMT CUDA kernels (fwd_kernel.cuh, bwd_kernel.cuh,
// simt_kernel.cuh, launched by launch_template.cuh and dispatch.cu) as plain C++ when
// ATTN_CUDA_EMULATE is defined, so that CI runs their index math, masking and tiling on the CPU
// (test_emulated.py). The kernels themselves are not edited: the PTX wrappers of
// mma.cuh and the launch macro of launch_util.h switch to the functions declared here.
//
// Thread model: every thread of one CTA is a fiber on one OS thread (emu_runtime.cpp). A fiber
// runs until it reaches a scheduling point: __syncthreads, or a warp collective (ldmatrix,
// mma.sync, __shfl_xor_sync), where the 32 lanes deposit their operands and the last lane to
// arrive computes every lane's result. By default one warp runs to its next barrier before the
// next warp starts (set_schedule: lockstep = round robin; reverse = warps
// last-first). Blocks run one after another. A barrier or collective
// that can never complete (some threads exited or wait elsewhere) raises an error, as does any
// out-of-bounds or misaligned shared-memory access, cp.async source outside the kernel's
// tensors, or a warp whose lanes reach different collectives.
//
// Shared memory is one buffer per CTA, filled with 0xff bytes (NaN in fp16, bf16 and fp32) at
// each block start; a cp.async destination is filled the same way when the copy is issued and
// written only when the issuing thread waits for its group, so data read before its wait +
// barrier, or a buffer overwritten while another warp still reads it, turns into NaN.
//
// Include order matters: the real CUDA headers first (host builds of cuda_fp16.h / cuda_bf16.h
// give round-to-nearest-even conversions), then the macros below replace the device-only names.
#pragma once

#if !defined(ATTN_CUDA_EMULATE)
#error "cuda_emu.h is the host build of the CUDA kernels; define ATTN_CUDA_EMULATE"
#endif
#if defined(__CUDACC__)
#error "cuda_emu.h is for host compilers, not nvcc"
#endif

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

#include "emu_entry.h"  // add_global_range

namespace attn_emu {

// ---------------------------------------------------------------- launch and device queries
// The emulated device: 80 (sm_80) or 90 (sm_90). It picks the shared-memory limit and what the
// device queries answer; the kernels' own `#if __CUDA_ARCH__` code is fixed per translation unit
// (emu_kernels_sm80.cpp / emu_kernels_sm90.cpp), and each entry point sets the matching arch.
void set_arch(int sm);
void set_schedule(bool warp_serial, bool reverse);  // emu_entry.h
int arch();

// The current CTA's dynamic shared memory (mma.cuh ATTN_EXTERN_SMEM), kMaxSmem bytes.
constexpr size_t kMaxSmem = 228 * 1024;
unsigned char* dynamic_smem();

// Runs fn(ctx) as every thread of every block of the grid.
void run_grid(const void* kernel_id, dim3 grid, dim3 block, size_t smem_bytes, void (*fn)(void*), void* ctx);

// The kernel<<<grid, block, smem, stream>>>(args) of launch_util.h's ATTN_LAUNCH.
template <typename... KArgs>
struct Launcher {
  void (*kernel)(KArgs...);
  dim3 grid, block;
  size_t smem;
  template <typename... Args>
  void operator()(Args&&... args) const {
    // the kernel parameters, copied once as the launch's parameter buffer
    struct Call {
      void (*kernel)(KArgs...);
      std::tuple<std::decay_t<KArgs>...> args;
    } call{kernel, std::tuple<std::decay_t<KArgs>...>(std::forward<Args>(args)...)};
    run_grid(reinterpret_cast<const void*>(kernel), grid, block, smem,
             [](void* c) {
               Call* call = static_cast<Call*>(c);
               std::apply(call->kernel, call->args);
             },
             &call);
  }
};
template <typename... KArgs>
Launcher<KArgs...> launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t) {
  return Launcher<KArgs...>{kernel, grid, block, smem};
}

// cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes): a launch
// asking for more than 48 KB fails without it, as on the hardware.
void set_max_dynamic_smem(const void* kernel_id, int bytes);
template <typename Kernel>
cudaError_t func_set_attribute(Kernel kernel, cudaFuncAttribute attr, int value) {
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    set_max_dynamic_smem(reinterpret_cast<const void*>(kernel), value);
  }
  return cudaSuccess;
}
cudaError_t get_device(int* dev);
cudaError_t device_get_attribute(int* value, cudaDeviceAttr attr, int dev);
cudaError_t get_last_error();
const char* get_error_string(cudaError_t e);
cudaError_t memset_async(void* ptr, int value, size_t bytes, cudaStream_t);

// ---------------------------------------------------------------- the current thread
struct ThreadCtx {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};
extern thread_local ThreadCtx* g_thread;

void syncthreads();
int syncthreads_or(int pred);

// ---------------------------------------------------------------- warp collectives
enum class Elem : int { kF16 = 0, kBF16 = 1 };
// D = A B + C of mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: this lane's a[4], b[2], c[4]
void mma_m16n8k16(Elem e, float* c, const uint32_t* a, const uint32_t* b);
// D = A B + C of mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 (exact, wrapping as int32)
void mma_m16n8k32_s8(int32_t* c, const uint32_t* a, const uint32_t* b);
// wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{f16,bf16} (cuda/wgmma_ops.cuh), executed when it
// is issued (fence / commit_group / wait_group are then no-ops): this warp's 16 rows of the
// warpgroup's 64 (warp % 4), d its n / 2 accumulators (C fragments per 8-column n-tile), A from
// shared memory through desc_a (a null) or from this lane's a[4] registers (an mma.m16n8k16 A
// fragment), B through desc_b; trans_a / trans_b: M-major A / N-major B. Both descriptors in
// the 128-byte-swizzle mode (the only one the kernels build; any other faults), addresses decoded
// as the hardware does (PTX ISA "Matrix Descriptor Format", the swizzle on absolute address
// bits [4:6] ^= [7:9]). accumulate 0 overwrites d.
void wgmma(Elem e, int n, float* d, uint64_t desc_a, const uint32_t* a, uint64_t desc_b, int accumulate, bool trans_a,
           bool trans_b);
// wgmma.mma_async.sync.aligned.m64n{n}k32.s32.s8.s8: as wgmma, with int8 A and B, both from
// shared memory and K-major (byte k of a row is the low or high byte of its 16-bit element
// k / 2), int32 accumulators d (exact, wrapping as int32).
void wgmma_s8(int n, int32_t* d, uint64_t desc_a, uint64_t desc_b, int accumulate);
// wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3: as wgmma_s8, with fp8 e4m3 A and B and
// float32 accumulators: each instruction's 32 products and d summed exactly (float64) and rounded
// once (the hardware adds in an unspecified order at a lower internal precision, so a GPU
// differs from this in the last bits of the float32 sums).
void wgmma_e4m3(int n, float* d, uint64_t desc_a, uint64_t desc_b, int accumulate);
// mbarrier.init / arrive (release) / try_wait.parity (acquire, in a loop: blocks this thread
// until the phase of that parity has completed) on an 8-byte object in shared memory, and
// bar.sync id, count (a barrier of `count` threads, id 1..15)
void mbar_init(uint32_t addr, int count);
void mbar_arrive(uint32_t addr);
void mbar_wait(uint32_t addr, uint32_t parity);
void named_barrier(int id, int count);
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 with this lane's row address
void ldmatrix_x4(uint32_t* r, uint32_t addr, bool trans);
uint32_t shfl_xor_bits(uint32_t mask, uint32_t bits, int lane_mask, int width);

// ---------------------------------------------------------------- shared memory and cp.async
uint32_t smem_u32(const void* ptr);
void cp_async(uint32_t dst, const void* src, int bytes, int src_bytes);
void cp_async_commit();
void cp_async_wait(int n);
void st_shared_b32(uint32_t addr, uint32_t v);
uint4 ld_shared_v4(uint32_t addr);
float2 ld_shared_v2f(uint32_t addr);
uint32_t ld_shared_b32(uint32_t addr);

// ex2.approx.ftz.f32: flush-to-zero in and out (the approximation error, ~2 ulp, is not modeled)
inline float ex2_approx_ftz(float x) {
  if (std::fpclassify(x) == FP_SUBNORMAL) x = 0.f;
  const float y = std::exp2(x);
  return std::fpclassify(y) == FP_SUBNORMAL ? 0.f : y;
}

}  // namespace attn_emu

// ---------------------------------------------------------------- device names on the host
#define threadIdx (::attn_emu::g_thread->thread_idx)
#define blockIdx (::attn_emu::g_thread->block_idx)
#define blockDim (::attn_emu::g_thread->block_dim)
#define gridDim (::attn_emu::g_thread->grid_dim)

// One CTA runs at a time per OS thread, so a static __shared__ variable is a thread_local
// object shared by the CTA's fibers (dynamic shared memory: ATTN_EXTERN_SMEM, mma.cuh).
#undef __shared__
#define __shared__ thread_local
// plain inline: the host compiler inlines what it likes, and the build stays short (__noinline__
// too: it steers ptxas's register allocation, which the emulator does not model)
#undef __forceinline__
#define __forceinline__ inline
#undef __noinline__
#define __noinline__ inline
#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __grid_constant__
#define __grid_constant__

#define cudaGetDevice ::attn_emu::get_device
#define cudaDeviceGetAttribute ::attn_emu::device_get_attribute
#define cudaFuncSetAttribute ::attn_emu::func_set_attribute
#define cudaGetLastError ::attn_emu::get_last_error
#define cudaGetErrorString ::attn_emu::get_error_string
#define cudaMemsetAsync ::attn_emu::memset_async

inline void __syncthreads() { ::attn_emu::syncthreads(); }
inline int __syncthreads_or(int pred) { return ::attn_emu::syncthreads_or(pred); }
// a warp-wide meeting point: every lane's earlier memory writes are visible to the others after it
inline void __syncwarp(unsigned mask = 0xffffffffu) { (void)::attn_emu::shfl_xor_bits(mask, 0u, 0, 32); }

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  static_assert(sizeof(T) == 4, "32-bit shuffles only");
  uint32_t bits;
  std::memcpy(&bits, &var, 4);
  bits = ::attn_emu::shfl_xor_bits(mask, bits, lane_mask, width);
  std::memcpy(&var, &bits, 4);
  return var;
}

// a warp vote, through the emulated shuffles (full warps only, as shfl_xor_bits checks)
inline int __any_sync(unsigned mask, int pred) {
  uint32_t v = pred != 0;
  for (int o = 16; o > 0; o >>= 1) v |= ::attn_emu::shfl_xor_bits(mask, v, o, 32);
  return v != 0;
}

inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t __float_as_uint(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// a multiply rounded on its own, never contracted into an FMA with what uses it (as on the GPU):
// the empty asm makes the compiler materialize the rounded product
inline float __fmul_rn(float a, float b) {
  float r = a * b;
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  asm("" : "+x"(r));
#elif defined(__GNUC__) && defined(__aarch64__)
  asm("" : "+w"(r));
#endif
  return r;
}

// a sum or difference rounded on its own (the kernels' compensated sums, csrc/cuda/compensated.cuh);
// the host build has no -ffast-math, so plain float arithmetic is already never reassociated
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

// Atomics: the fibers of a CTA never run concurrently, so a plain read-modify-write is atomic.
// The vector forms (sm_90+) check the alignment the hardware requires.
inline float atomicAdd(float* p, float v) {
  const float old = *p;
  *p = old + v;
  return old;
}
inline float2 atomicAdd(float2* p, float2 v) {
  if (reinterpret_cast<uintptr_t>(p) % 8 != 0) throw std::runtime_error("emulator: misaligned float2 atomicAdd");
  const float2 old = *p;
  p->x += v.x;
  p->y += v.y;
  return old;
}
inline float4 atomicAdd(float4* p, float4 v) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) throw std::runtime_error("emulator: misaligned float4 atomicAdd");
  const float4 old = *p;
  p->x += v.x;
  p->y += v.y;
  p->z += v.z;
  p->w += v.w;
  return old;
}
