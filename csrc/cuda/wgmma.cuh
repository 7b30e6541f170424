// PTX building blocks of the sm_90a (Hopper) kernels: the shared-memory layout and descriptors
// of wgmma operands, warpgroup MMA (wgmma.mma_async m64nNk16, fp32 accumulators), mbarriers,
// the generic -> async proxy fence, setmaxnreg and named barriers.
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

#define ATTN_WGMMA_ACC32(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define ATTN_WGMMA_REGS32 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define ATTN_WGMMA_ACC64(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
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

#undef ATTN_DEFINE_WGMMA
#undef ATTN_WGMMA_SS
#undef ATTN_WGMMA_RS
#undef ATTN_WGMMA_ACC32
#undef ATTN_WGMMA_ACC64
#undef ATTN_WGMMA_REGS32
#undef ATTN_WGMMA_REGS64

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

// Barrier among kThreads threads (whole warps) of the CTA; id 0 is __syncthreads'.
template <int kThreads>
__device__ __forceinline__ void named_barrier_sync(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}

}  // namespace wg
}  // namespace attn
