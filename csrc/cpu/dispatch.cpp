// The CPU kernels' run-time ISA dispatch (cpu/dispatch.h): which levels were built (each
// registered itself, cpu/level.cpp), which one runs, and set_isa. Compiled once, with the
// baseline flags of the torch bindings. It knows no family: the families' stubs read
// active_level().
#include <atomic>
#include <cstring>
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <string>
#include <utility>
#include <vector>

#include "cpu/dispatch.h"
#include "cpu/isa.h"

namespace attn {
namespace cpu {

namespace {

// The slots of the levels built, lowest first (setup.py links them in this order; native last:
// it includes every level built beside it). A level setup.py did not build (avx512 off x86,
// native unless ATTENTION_EXT_NATIVE=1, every level but the machine's highest in a sanitized
// build) registered nothing.
const std::vector<int>& levels() {
  static const std::vector<int> v = [] {
    std::vector<int> l;
    for (int i = 0; i < kNumLevels; ++i) {
      if (built_levels[i] != nullptr) l.push_back(i);
    }
    return l;
  }();
  return v;
}

uint32_t cpu_features() {
  uint32_t f = 0;
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  const std::pair<bool, CpuFeature> have[] = {
      {__builtin_cpu_supports("sse3"), kSse3},           {__builtin_cpu_supports("ssse3"), kSsse3},
      {__builtin_cpu_supports("sse4.1"), kSse41},        {__builtin_cpu_supports("sse4.2"), kSse42},
      {__builtin_cpu_supports("sse4a"), kSse4a},         {__builtin_cpu_supports("popcnt"), kPopcnt},
      {__builtin_cpu_supports("avx"), kAvx},             {__builtin_cpu_supports("avx2"), kAvx2},
      {__builtin_cpu_supports("fma"), kFma},             {__builtin_cpu_supports("f16c"), kF16c},
      {__builtin_cpu_supports("bmi"), kBmi},             {__builtin_cpu_supports("bmi2"), kBmi2},
      {__builtin_cpu_supports("lzcnt"), kLzcnt},         {__builtin_cpu_supports("movbe"), kMovbe},
      {__builtin_cpu_supports("avx512f"), kAvx512f},     {__builtin_cpu_supports("avx512bw"), kAvx512bw},
      {__builtin_cpu_supports("avx512vl"), kAvx512vl},   {__builtin_cpu_supports("avx512dq"), kAvx512dq},
      {__builtin_cpu_supports("avx512cd"), kAvx512cd},   {__builtin_cpu_supports("avx512bf16"), kAvx512bf16},
      {__builtin_cpu_supports("avx512vnni"), kAvx512vnni}, {__builtin_cpu_supports("avx512vbmi"), kAvx512vbmi},
      {__builtin_cpu_supports("avxvnni"), kAvxVnni},
#if (defined(__clang__) && __clang_major__ >= 18) || (!defined(__clang__) && __GNUC__ >= 11)  // older: no AMX names
      {__builtin_cpu_supports("amx-tile"), kAmxTile},    {__builtin_cpu_supports("amx-int8"), kAmxInt8},
      {__builtin_cpu_supports("amx-bf16"), kAmxBf16},
#endif
#if defined(__clang__) || __GNUC__ >= 12  // older compilers know no "avx512fp16" (and define no __AVX512FP16__)
      {__builtin_cpu_supports("avx512fp16"), kAvx512fp16},
#endif
  };
  for (const auto& [yes, bit] : have) f |= yes ? uint32_t(bit) : 0u;
#endif
  return f;
}

bool runs_here(int level) {
  static const uint32_t have = cpu_features();
  return (built_levels[level]->features & ~have) == 0;
}

// Whether the process may use AMX tiles: Linux hands the tile data state (8 KB of registers per
// thread) only to a process that asks for it (arch_prctl ARCH_REQ_XCOMP_PERM, feature 18,
// XTILEDATA). Asked once, on the first look at the variants; harmless where granted already.
bool os_grants_amx() {
#if defined(__linux__) && defined(__x86_64__)
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
  return granted;
#else
  return false;
#endif
}

// The variants of a level (isa.h's int8_vnni / amx): the level's code, with vpdpbusd in the int8
// dot products, or AMX tiles in the int8 and bf16 ones, where the CPU has `feature`. Listed after
// their level.
enum class ProductPath { kVnni, kAmx };
struct Variant {
  const char* name;
  int slot;
  uint32_t feature;
  ProductPath path;
};
constexpr Variant kVariants[] = {{"avx2vnni", level_index("avx2"), kAvxVnni, ProductPath::kVnni},
                                 {"avx512vnni", level_index("avx512"), kAvx512vnni, ProductPath::kVnni},
                                 {"avx512amx", level_index("avx512bf16"), kAmxTile | kAmxInt8 | kAmxBf16, ProductPath::kAmx}};

// A choice: a built level, or one of its variants (variant >= 0)
struct Choice {
  int slot, variant;
};
bool variant_runs_here(const Variant& v) {
  static const uint32_t have = cpu_features();
  return built_levels[v.slot] != nullptr && runs_here(v.slot) && (v.feature & ~have) == 0 &&
         (v.path != ProductPath::kAmx || os_grants_amx());
}
// every choice built, lowest first: each level, then its variants
const std::vector<Choice>& choices() {
  static const std::vector<Choice> c = [] {
    std::vector<Choice> l;
    for (int k : levels()) {
      l.push_back({k, -1});
      for (int i = 0; i < int(sizeof(kVariants) / sizeof(kVariants[0])); ++i) {
        if (kVariants[i].slot == k) l.push_back({k, i});
      }
    }
    return l;
  }();
  return c;
}
const char* name_of(const Choice& c) { return c.variant >= 0 ? kVariants[c.variant].name : built_levels[c.slot]->name; }
bool choice_runs_here(const Choice& c) {
  return c.variant >= 0 ? variant_runs_here(kVariants[c.variant]) : runs_here(c.slot);
}

// the highest choice this CPU runs (a level's variant above the level)
int best_choice() {
  int b = 0;
  for (int i = 0; i < int(choices().size()); ++i) {
    if (choice_runs_here(choices()[i])) b = i;
  }
  return b;
}

std::atomic<int>& active_choice() {
  static std::atomic<int> choice{best_choice()};
  return choice;
}

}  // namespace

int active_level() { return choices()[active_choice().load(std::memory_order_relaxed)].slot; }

namespace {
bool product_path(ProductPath path) {
  const Choice& c = choices()[active_choice().load(std::memory_order_relaxed)];
  return c.variant >= 0 && kVariants[c.variant].path == path;
}
}  // namespace

bool int8_vnni() { return product_path(ProductPath::kVnni); }

bool amx() { return product_path(ProductPath::kAmx); }

bool vbmi() {
  static const bool have = (cpu_features() & kAvx512vbmi) != 0;
  return have;
}

int l1d_bytes() {
  static const int bytes = [] {
#if defined(_SC_LEVEL1_DCACHE_SIZE)
    const long b = sysconf(_SC_LEVEL1_DCACHE_SIZE);
    if (b >= 4096 && b <= (1L << 22)) return int(b);
#endif
    return 32 * 1024;
  }();
  return bytes;
}

const char* isa() { return name_of(choices()[active_choice().load(std::memory_order_relaxed)]); }

int simd_width() { return built_levels[active_level()]->simd_width; }

const char* isa_levels(bool all) {
  static const std::string runnable = [] {
    std::string s;
    for (const Choice& c : choices()) {
      if (choice_runs_here(c)) s += (s.empty() ? "" : ",") + std::string(name_of(c));
    }
    return s;
  }();
  static const std::string built = [] {
    std::string s;
    for (const Choice& c : choices()) s += (s.empty() ? "" : ",") + std::string(name_of(c));
    return s;
  }();
  return all ? built.c_str() : runnable.c_str();
}

const char* set_isa(const char* name) {
  if (name == nullptr || name[0] == '\0') {
    active_choice().store(best_choice());
    return nullptr;
  }
  for (int i = 0; i < int(choices().size()); ++i) {
    if (std::strcmp(name_of(choices()[i]), name) != 0) continue;
    if (!choice_runs_here(choices()[i])) return "this CPU lacks instructions that level uses";
    active_choice().store(i);
    return nullptr;
  }
  return "this build has no such level";
}

}  // namespace cpu
}  // namespace attn
