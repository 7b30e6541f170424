// The machine's peak arithmetic rate per thread, for the benchmarks' ceiling (`python -m
// attention_ext bench`): loops that do nothing but the instruction the kernels' inner products
// run on, compiled per ISA level like the kernels, so the stub runs the level they run. No
// torch types: the binding (csrc/torch/library.cpp, _C.cpu_peak_flops) times them on the pool.
#pragma once

#include <cstdint>

#include "cpu/dispatch.h"

namespace attn {
namespace cpu {

// What a peak loop runs.
enum PeakKind : int {
  kPeakFp32Fma = 0,  // float32 multiply-adds, W lanes (FMA where the level has it, else mul + add)
  kPeakBf16Dot = 1,  // bf16 pair dot products into float32 lanes (vdpbf16ps, AVX512-BF16 only)
  kPeakInt8Dot = 2,  // int8 quad dot products into int32 lanes (vpdpbusd, AVX512-VNNI only)
  kPeakInt8Amx = 3,  // int8 tile products (tdpbsud; the "avx512amx" variant only: cpu/amx.h)
  kPeakBf16Amx = 4,  // bf16 tile products (tdpbf16ps; the same)
};

// Runs `iters` rounds of the kind's loop on the calling thread; returns the FLOPs done (2 per
// multiply-add), or 0 when this level has no such instruction.
inline DispatchStub<double (*)(int kind, int64_t iters)> peak_loop_stub;

#if defined(ATTN_CPU_ISA)
inline namespace ATTN_CPU_ISA {  // this level's loops
double peak_loop(int kind, int64_t iters);
}  // namespace ATTN_CPU_ISA
#endif
}  // namespace cpu
}  // namespace attn
