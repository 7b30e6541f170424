// One ISA level's CPU entry points (the families' cpu/entry.h) as a table of function pointers:
// cpu/kernels.cpp fills it once per level, cpu/dispatch.cpp forwards every call to the active
// level's. No torch types.
#pragma once

#include <cstdint>

#include "common/decode_params.h"
#include "common/linear_params.h"
#include "common/params.h"

namespace attn {
namespace cpu {

// x86 features a level's code may use, one bit each: a level runs where the CPU has all of its
// `features` (the macros its compiler flags defined; cpu/kernels.cpp), checked by the
// dispatcher with __builtin_cpu_supports, which also checks that the OS saves the AVX / AVX-512
// registers.
enum CpuFeature : uint32_t {
  kSse3 = 1u << 0, kSsse3 = 1u << 1, kSse41 = 1u << 2, kSse42 = 1u << 3, kSse4a = 1u << 4,
  kPopcnt = 1u << 5, kAvx = 1u << 6, kAvx2 = 1u << 7, kFma = 1u << 8, kF16c = 1u << 9,
  kBmi = 1u << 10, kBmi2 = 1u << 11, kLzcnt = 1u << 12, kMovbe = 1u << 13,
  kAvx512f = 1u << 14, kAvx512bw = 1u << 15, kAvx512vl = 1u << 16, kAvx512dq = 1u << 17,
  kAvx512cd = 1u << 18, kAvx512bf16 = 1u << 19, kAvx512vnni = 1u << 20, kAvx512vbmi = 1u << 21,
  kAvx512fp16 = 1u << 22,
};

template <typename T>
struct KernelsT {
  void (*fwd)(const FwdParamsT<T>&, DType);
  void (*bwd)(const BwdParamsT<T>&, DType);
  void (*topk_threshold)(const FwdParamsT<T>&, DType, int, T*, int32_t*);
  void (*linear_fwd)(const LinearParamsT<T>&, DType);
  void (*linear_bwd)(const LinearBwdParamsT<T>&, DType);
  void (*linear_step)(const LinearStepParamsT<T>&, DType);
  void (*decode_fwd)(const DecodeParamsT<T>&, DType);
  int (*decode_num_splits)(const DecodeParamsT<T>&, int);
};

struct Kernels {
  const char* name;
  uint32_t features;  // CpuFeature bits
  KernelsT<float> f32;
  KernelsT<double> f64;
  int (*simd_width)();
  void (*dropout_mask)(uint8_t*, int, int, int, int, float, uint64_t, uint64_t);
  double (*peak_loop)(int, int64_t);
};

}  // namespace cpu
}  // namespace attn
