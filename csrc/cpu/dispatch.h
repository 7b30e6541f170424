// Run-time ISA dispatch of the CPU kernels, family by family (the DispatchStub pattern of ATen):
// a family declares one stub per entry point in its cpu/entry.h, and each ISA level's build of
// the family's kernels (cpu/isa.h: the same sources compiled once per level) registers its
// function in the stub's slot for that level. A binding calls the stub, which runs the active
// level's function (cpu/dispatch.cpp chooses the level). This folder knows the levels, never the
// families: a new CPU op touches its family's folder and its binding only.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string_view>

#include "cpu/isa.h"

namespace attn {
namespace cpu {

// The levels setup.py may build, lowest first: a stub's slot index. `native` (-march=native,
// ATTENTION_EXT_NATIVE=1) comes last: it includes every level built beside it.
inline constexpr std::string_view kLevelNames[] = {"base", "avx2", "avx512", "avx512bf16", "native"};
inline constexpr int kNumLevels = int(sizeof(kLevelNames) / sizeof(kLevelNames[0]));

constexpr int level_index(std::string_view name) {
  for (int i = 0; i < kNumLevels; ++i)
    if (kLevelNames[i] == name) return i;
  return -1;
}

// x86 features a level's code may use, one bit each: a level runs where the CPU has all of its
// `features` (the macros its compiler flags defined; cpu/level.cpp), checked by the dispatcher
// with __builtin_cpu_supports, which also checks that the OS saves the AVX / AVX-512 registers.
enum CpuFeature : uint32_t {
  kSse3 = 1u << 0, kSsse3 = 1u << 1, kSse41 = 1u << 2, kSse42 = 1u << 3, kSse4a = 1u << 4,
  kPopcnt = 1u << 5, kAvx = 1u << 6, kAvx2 = 1u << 7, kFma = 1u << 8, kF16c = 1u << 9,
  kBmi = 1u << 10, kBmi2 = 1u << 11, kLzcnt = 1u << 12, kMovbe = 1u << 13,
  kAvx512f = 1u << 14, kAvx512bw = 1u << 15, kAvx512vl = 1u << 16, kAvx512dq = 1u << 17,
  kAvx512cd = 1u << 18, kAvx512bf16 = 1u << 19, kAvx512vnni = 1u << 20, kAvx512vbmi = 1u << 21,
  kAvx512fp16 = 1u << 22, kAvxVnni = 1u << 23, kAmxTile = 1u << 24, kAmxInt8 = 1u << 25,
  kAmxBf16 = 1u << 26,
};

// A level built into this library (cpu/level.cpp, compiled once per level, registers it).
struct LevelInfo {
  const char* name;
  uint32_t features;  // CpuFeature bits
  int simd_width;     // float32 lanes of the level's SIMD vector
};
// Slot i: level kLevelNames[i] when it was built, else null. Constant-initialized.
inline const LevelInfo* built_levels[kNumLevels] = {};

// The active level's slot (cpu/dispatch.cpp): the highest level built that this CPU runs, unless
// set_isa chose a lower one.
int active_level();

// One entry point's function per level; slots of levels not built stay null. Constant-
// initialized, so the registrations (dynamic initializers of the level builds) may run in any
// order at load time.
template <typename Fn>
struct DispatchStub {
  Fn at[kNumLevels] = {};

  template <typename... Args>
  decltype(auto) operator()(Args&&... args) const {
    const Fn fn = at[active_level()];
    if (fn == nullptr) throw std::logic_error("attention_ext: a CPU kernel is missing from the active ISA level");
    return fn(static_cast<Args&&>(args)...);
  }
};

// A template on the level, so that the slot is a compile-time constant: a level's static
// initializers run on every CPU at load time, before any dispatch, and must stay plain stores.
template <int kLevel, typename Fn>
bool register_kernel(DispatchStub<Fn>& stub, Fn fn) {
  static_assert(kLevel >= 0 && kLevel < kNumLevels, "ATTN_CPU_ISA names no level of kLevelNames");
  stub.at[kLevel] = fn;
  return true;
}

}  // namespace cpu
}  // namespace attn

// In a level's build of a family's kernels (-DATTN_CPU_ISA=<level>): puts `fn` in `stub`'s slot
// for this level. At namespace scope, after the kernel's definition.
#if defined(ATTN_CPU_ISA)
#define ATTN_CPU_STR2(x) #x
#define ATTN_CPU_STR(x) ATTN_CPU_STR2(x)
#define ATTN_CPU_CAT2(a, b) a##b
#define ATTN_CPU_CAT(a, b) ATTN_CPU_CAT2(a, b)
#define ATTN_CPU_LEVEL ::attn::cpu::level_index(ATTN_CPU_STR(ATTN_CPU_ISA))
#define ATTN_CPU_REGISTER(stub, fn)                                               \
  [[maybe_unused]] static const bool ATTN_CPU_CAT(attn_cpu_registered_, __LINE__) = \
      ::attn::cpu::register_kernel<ATTN_CPU_LEVEL>(stub, fn)
#endif
