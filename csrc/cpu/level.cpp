// One ISA level's description (its name, the CPU features its code needs, its vector width),
// compiled once per level with -DATTN_CPU_ISA=<level> like the kernels (cpu/isa.h), and
// registered for the dispatcher (cpu/dispatch.h). It knows no family: each family registers its
// own kernels.
#include <cstdint>

#include "cpu/dispatch.h"
#include "cpu/isa.h"
#include "cpu/simd.h"  // kLanes

#if !defined(ATTN_CPU_ISA)
#error "cpu/level.cpp is compiled once per ISA level, with -DATTN_CPU_ISA=<level> (setup.py)"
#endif

namespace attn {
namespace cpu {
ATTN_CPU_ISA_BEGIN

namespace {

// The features this level's compiler flags enabled: the CPU must have every one of them.
constexpr uint32_t compiled_features() {
  uint32_t f = 0;
#if defined(__SSE3__)
  f |= kSse3;
#endif
#if defined(__SSSE3__)
  f |= kSsse3;
#endif
#if defined(__SSE4_1__)
  f |= kSse41;
#endif
#if defined(__SSE4_2__)
  f |= kSse42;
#endif
#if defined(__SSE4A__)
  f |= kSse4a;
#endif
#if defined(__POPCNT__)
  f |= kPopcnt;
#endif
#if defined(__AVX__)
  f |= kAvx;
#endif
#if defined(__AVX2__)
  f |= kAvx2;
#endif
#if defined(__FMA__)
  f |= kFma;
#endif
#if defined(__F16C__)
  f |= kF16c;
#endif
#if defined(__BMI__)
  f |= kBmi;
#endif
#if defined(__BMI2__)
  f |= kBmi2;
#endif
#if defined(__LZCNT__)
  f |= kLzcnt;
#endif
#if defined(__MOVBE__)
  f |= kMovbe;
#endif
#if defined(__AVX512F__)
  f |= kAvx512f;
#endif
#if defined(__AVX512BW__)
  f |= kAvx512bw;
#endif
#if defined(__AVX512VL__)
  f |= kAvx512vl;
#endif
#if defined(__AVX512DQ__)
  f |= kAvx512dq;
#endif
#if defined(__AVX512CD__)
  f |= kAvx512cd;
#endif
#if defined(__AVX512BF16__)
  f |= kAvx512bf16;
#endif
#if defined(__AVX512VNNI__)
  f |= kAvx512vnni;
#endif
#if defined(__AVX512VBMI__)
  f |= kAvx512vbmi;
#endif
#if defined(__AVX512FP16__)
  f |= kAvx512fp16;
#endif
  return f;
}

}  // namespace

// cpu/dispatch.cpp lists the levels built from these registrations
static const LevelInfo kThisLevel = {ATTN_CPU_STR(ATTN_CPU_ISA), compiled_features(), kLanes<float>};
constexpr int kThisSlot = ATTN_CPU_LEVEL;
static_assert(kThisSlot >= 0, "ATTN_CPU_ISA names no level of kLevelNames");
[[maybe_unused]] static const bool kRegistered = (built_levels[kThisSlot] = &kThisLevel, true);

ATTN_CPU_ISA_END
}  // namespace cpu
}  // namespace attn
