// The instructions of the sm_90a (Hopper) kernels: warpgroup MMA (wgmma.mma_async m64nNk16,
// fp32 accumulators), mbarriers, the generic -> async proxy fence, setmaxnreg and named barriers.
// Included by cuda/wgmma.cuh (the operand layouts and descriptors); the CPU emulator has its own
// copy of this header (tests/cuda_emu/target/cuda/wgmma_ops.cuh), the host emulation of each.
//
// wgmma and setmaxnreg exist only on sm_90a: call these only from code compiled under
// __CUDA_ARCH_FEAT_SM90_ALL (softmax/cuda/sm90/fwd_kernel.cuh guards its kernel body). Including
// this header elsewhere is harmless: inline asm is assembled only where it is instantiated.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace attn {
namespace wg {

// ---------------------------------------------------------------- warpgroup MMA
// Issue order for one product: fence() (orders this thread's earlier register writes to the
// accumulators and A fragments before the async reads), the wgmma.mma_async of every k-step,
// commit(), then wait<N>() before the accumulators are read or the smem operands are reused.
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// The compiler sees a wgmma as reading and writing its registers when it is issued, not when it
// completes: tie them to this point so no read of an accumulator moves above wait() and no
// register of an in-flight A fragment is reused before it.
template <int N>
__device__ __forceinline__ void fence_operands(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_operands(uint32_t (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

#define ATTN_WGMMA_OPS32(C, d) \
  C(d[0]), C(d[1]), C(d[2]), C(d[3]), C(d[4]), C(d[5]), C(d[6]), C(d[7]), \
  C(d[8]), C(d[9]), C(d[10]), C(d[11]), C(d[12]), C(d[13]), C(d[14]), C(d[15]), \
  C(d[16]), C(d[17]), C(d[18]), C(d[19]), C(d[20]), C(d[21]), C(d[22]), C(d[23]), \
  C(d[24]), C(d[25]), C(d[26]), C(d[27]), C(d[28]), C(d[29]), C(d[30]), C(d[31])
#define ATTN_WGMMA_ACC32(d) ATTN_WGMMA_OPS32("+f", d)
#define ATTN_WGMMA_REGS32 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define ATTN_WGMMA_OPS64(C, d) \
  C(d[0]), C(d[1]), C(d[2]), C(d[3]), C(d[4]), C(d[5]), C(d[6]), C(d[7]), \
  C(d[8]), C(d[9]), C(d[10]), C(d[11]), C(d[12]), C(d[13]), C(d[14]), C(d[15]), \
  C(d[16]), C(d[17]), C(d[18]), C(d[19]), C(d[20]), C(d[21]), C(d[22]), C(d[23]), \
  C(d[24]), C(d[25]), C(d[26]), C(d[27]), C(d[28]), C(d[29]), C(d[30]), C(d[31]), \
  C(d[32]), C(d[33]), C(d[34]), C(d[35]), C(d[36]), C(d[37]), C(d[38]), C(d[39]), \
  C(d[40]), C(d[41]), C(d[42]), C(d[43]), C(d[44]), C(d[45]), C(d[46]), C(d[47]), \
  C(d[48]), C(d[49]), C(d[50]), C(d[51]), C(d[52]), C(d[53]), C(d[54]), C(d[55]), \
  C(d[56]), C(d[57]), C(d[58]), C(d[59]), C(d[60]), C(d[61]), C(d[62]), C(d[63])
#define ATTN_WGMMA_ACC64(d) ATTN_WGMMA_OPS64("+f", d)
#define ATTN_WGMMA_REGS64 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// wgmma.mma_async m64nNk16 with fp32 accumulators d (64 x N over the warpgroup: warp w holds rows
// 16 w .. 16 w + 15 as mma.m16n8 C fragments, d[4 nt + e] for n-tile nt). accumulate = 0
// overwrites d (the first k-step), 1 adds. Scale factors are +1; the transpose flags select the
// majors: ss() takes A and B K-major, ss_t() A M-major and B N-major (both transposed: legal for
// 16-bit types only; the backward's dQ = dS K reads dS^T and K as they lie in shared memory),
// rs() takes A from registers and B N-major. TA / TB: the transpose immediates as text.
#define ATTN_WGMMA_SS(N, TY, ACC, REGS, IA, IB, IP, TA, TB)                                      \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" IP ", 0;\n"                                 \
               "wgmma.mma_async.sync.aligned.m64n" N "k16.f32." TY "." TY " " REGS ", %" IA      \
               ", %" IB ", p, 1, 1, " TA ", " TB ";\n}\n"                                       \
               : ACC                                                                             \
               : "l"(desc_a), "l"(desc_b), "r"(accumulate))
#define ATTN_WGMMA_RS(N, TY, ACC, REGS, IA0, IA1, IA2, IA3, IB, IP)                               \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" IP ", 0;\n"                                 \
               "wgmma.mma_async.sync.aligned.m64n" N "k16.f32." TY "." TY " " REGS ", {%" IA0     \
               ", %" IA1 ", %" IA2 ", %" IA3 "}, %" IB ", p, 1, 1, 1;\n}\n"                     \
               : ACC                                                                             \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate))

template <int N, typename T>
struct Wgmma;

#define ATTN_DEFINE_WGMMA(CT, TY)                                                                \
  template <>                                                                                    \
  struct Wgmma<64, CT> {                                                                         \
    static __device__ __forceinline__ void ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b,  \
                                              int accumulate) {                                  \
      ATTN_WGMMA_SS("64", TY, ATTN_WGMMA_ACC32(d), ATTN_WGMMA_REGS32, "32", "33", "34", "0",    \
                    "0");                                                                        \
    }                                                                                            \
    static __device__ __forceinline__ void ss_t(float (&d)[32], uint64_t desc_a, uint64_t desc_b, \
                                                int accumulate) {                                \
      ATTN_WGMMA_SS("64", TY, ATTN_WGMMA_ACC32(d), ATTN_WGMMA_REGS32, "32", "33", "34", "1",    \
                    "1");                                                                        \
    }                                                                                            \
    static __device__ __forceinline__ void rs(float (&d)[32], const uint32_t (&a)[4],            \
                                              uint64_t desc_b, int accumulate) {                 \
      ATTN_WGMMA_RS("64", TY, ATTN_WGMMA_ACC32(d), ATTN_WGMMA_REGS32, "32", "33", "34", "35",    \
                    "36", "37");                                                                 \
    }                                                                                            \
  };                                                                                             \
  template <>                                                                                    \
  struct Wgmma<128, CT> {                                                                        \
    static __device__ __forceinline__ void ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b,  \
                                              int accumulate) {                                  \
      ATTN_WGMMA_SS("128", TY, ATTN_WGMMA_ACC64(d), ATTN_WGMMA_REGS64, "64", "65", "66", "0",   \
                    "0");                                                                        \
    }                                                                                            \
    static __device__ __forceinline__ void ss_t(float (&d)[64], uint64_t desc_a, uint64_t desc_b, \
                                                int accumulate) {                                \
      ATTN_WGMMA_SS("128", TY, ATTN_WGMMA_ACC64(d), ATTN_WGMMA_REGS64, "64", "65", "66", "1",   \
                    "1");                                                                        \
    }                                                                                            \
    static __device__ __forceinline__ void rs(float (&d)[64], const uint32_t (&a)[4],            \
                                              uint64_t desc_b, int accumulate) {                 \
      ATTN_WGMMA_RS("128", TY, ATTN_WGMMA_ACC64(d), ATTN_WGMMA_REGS64, "64", "65", "66", "67",   \
                    "68", "69");                                                                 \
    }                                                                                            \
  };

ATTN_DEFINE_WGMMA(__nv_bfloat16, "bf16")
ATTN_DEFINE_WGMMA(__half, "f16")

// wgmma.mma_async m64nNk32 with 8-bit A and B, both from shared memory and K-major (the only
// major 8-bit operands take; 32 bytes of K per step, as a 16-bit k16 step), for the 8-bit Q K^T of
// the sm_90a forward (qk_quant). d: C fragments as the 16-bit form's. Two forms:
//   WgmmaS8    .s32.s8.s8, int32 accumulators (qk_quant = "int8"). Exact: the sums wrap as int32
//              (they cannot here: d <= 128 products of |x| <= 127);
//   WgmmaE4M3  .f32.e4m3.e4m3, float32 accumulators, scale factors +1 (qk_quant = "fp8").
// TYPES: the instruction's type suffix; TAIL: the operands after scale-d (the scale immediates;
// none for integers); C: the accumulators' constraint.
#define ATTN_WGMMA_K32(N, TYPES, TAIL, ACC, REGS, IA, IB, IP)                                        \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" IP ", 0;\n"                                   \
               "wgmma.mma_async.sync.aligned.m64n" N "k32." TYPES " " REGS ", %" IA ", %" IB ", p" TAIL \
               ";\n}\n"                                                                             \
               : ACC                                                                               \
               : "l"(desc_a), "l"(desc_b), "r"(accumulate))
#define ATTN_DEFINE_WGMMA_K32(NAME, AT, TYPES, TAIL, C)                                             \
  template <int N>                                                                                \
  struct NAME;                                                                                    \
  template <>                                                                                     \
  struct NAME<64> {                                                                               \
    static __device__ __forceinline__ void ss(AT (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) { \
      ATTN_WGMMA_K32("64", TYPES, TAIL, ATTN_WGMMA_OPS32(C, d), ATTN_WGMMA_REGS32, "32", "33", "34");      \
    }                                                                                             \
  };                                                                                              \
  template <>                                                                                     \
  struct NAME<128> {                                                                              \
    static __device__ __forceinline__ void ss(AT (&d)[64], uint64_t desc_a, uint64_t desc_b, int accumulate) { \
      ATTN_WGMMA_K32("128", TYPES, TAIL, ATTN_WGMMA_OPS64(C, d), ATTN_WGMMA_REGS64, "64", "65", "66");     \
    }                                                                                             \
  };

ATTN_DEFINE_WGMMA_K32(WgmmaS8, int32_t, "s32.s8.s8", "", "+r")
ATTN_DEFINE_WGMMA_K32(WgmmaE4M3, float, "f32.e4m3.e4m3", ", 1, 1", "+f")

template <int N>
__device__ __forceinline__ void fence_operands(int32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

#undef ATTN_DEFINE_WGMMA
#undef ATTN_DEFINE_WGMMA_K32
#undef ATTN_WGMMA_K32
#undef ATTN_WGMMA_SS
#undef ATTN_WGMMA_RS
#undef ATTN_WGMMA_ACC32
#undef ATTN_WGMMA_ACC64
#undef ATTN_WGMMA_REGS32
#undef ATTN_WGMMA_REGS64
#undef ATTN_WGMMA_OPS32
#undef ATTN_WGMMA_OPS64

// ---------------------------------------------------------------- shared memory, ordered
// The warp-specialized kernels' own shared-memory accesses (the O staging, the LSE / dot rows of
// a ring slot): "memory" clobbers keep them in program order with the barriers around them.
__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t val) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(val) : "memory");
}
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 val;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w)
               : "r"(addr)
               : "memory");
  return val;
}
// A word at a shared-memory address (4-byte aligned).
__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
// Two floats at a shared-memory address (8-byte aligned).
__device__ __forceinline__ float2 ld_shared_f2(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr));
  return v;
}
// x, opaque to the compiler (an empty asm that may change it, executed where it stands).
__device__ __forceinline__ int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

// ---------------------------------------------------------------- mbarrier (shared::cta, 8 bytes)
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Arrive with release semantics: this thread's earlier memory accesses happen before the phase
// completes for whoever waits on it.
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Wait (acquire) until the phase with the given parity has completed. A fresh barrier is in
// phase 0, so waiting for parity 1 returns at once: producers start on the "empty" barriers
// with parity 1, consumers on the "full" ones with parity 0.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}

// Orders this thread's generic-proxy shared-memory writes (st.shared, cp.async once complete)
// before later async-proxy accesses (wgmma operand reads) that a barrier hands them to.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// ---------------------------------------------------------------- warpgroup roles
// setmaxnreg moves registers between warpgroups of one CTA; it takes effect only when the kernel
// has a register cap at entry (__launch_bounds__(threads, 1)). Every warp of the warpgroup
// executes it.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// Barrier among kThreads threads (whole warps) of the CTA; id 0 is __syncthreads'.
template <int kThreads>
__device__ __forceinline__ void named_barrier_sync(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}

}  // namespace wg
}  // namespace attn
