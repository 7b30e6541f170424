// The CPU kernels' run-time ISA dispatch (cpu/isa.h): the families' entry points in attn::cpu
// forward to the active level's table (cpu/kernels.h). Compiled once, with the baseline flags of
// the torch bindings.
#include <atomic>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu/isa.h"
#include "cpu/kernels.h"
#include "decode/cpu/entry.h"
#include "linear/cpu/entry.h"
#include "peak/cpu/entry.h"
#include "softmax/cpu/entry.h"
#include "sparse/cpu/entry.h"

namespace attn {
namespace cpu {

// Every level's table, weak: a level setup.py did not build (avx512 off x86, native unless
// ATTENTION_EXT_NATIVE=1, every level but the machine's highest in a sanitized build) is a null
// address, so this file and the torch bindings compile the same whatever the levels, and
// switching native on builds only its objects.
namespace base {
extern const Kernels kernels __attribute__((weak));
}
namespace avx2 {
extern const Kernels kernels __attribute__((weak));
}
namespace avx512 {
extern const Kernels kernels __attribute__((weak));
}
namespace avx512bf16 {
extern const Kernels kernels __attribute__((weak));
}
namespace native {
extern const Kernels kernels __attribute__((weak));
}

namespace {

// lowest first (setup.py links them in this order; native last: it includes every level built
// beside it), the levels not built left out
const std::vector<const Kernels*>& levels() {
  static const std::vector<const Kernels*> v = [] {
    std::vector<const Kernels*> l;
    for (const Kernels* k : {&base::kernels, &avx2::kernels, &avx512::kernels, &avx512bf16::kernels, &native::kernels}) {
      if (k != nullptr) l.push_back(k);
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
#if defined(__clang__) || __GNUC__ >= 12  // older compilers know no "avx512fp16" (and define no __AVX512FP16__)
      {__builtin_cpu_supports("avx512fp16"), kAvx512fp16},
#endif
  };
  for (const auto& [yes, bit] : have) f |= yes ? uint32_t(bit) : 0u;
#endif
  return f;
}

bool runs_here(const Kernels* k) {
  static const uint32_t have = cpu_features();
  return (k->features & ~have) == 0;
}

const Kernels* best() {
  const Kernels* b = levels()[0];  // the lowest built: base (plain x86-64, or the target's baseline)
  for (const Kernels* k : levels()) {
    if (runs_here(k)) b = k;
  }
  return b;
}

std::atomic<const Kernels*>& active_slot() {
  static std::atomic<const Kernels*> slot{best()};
  return slot;
}
const Kernels& active() { return *active_slot().load(std::memory_order_relaxed); }

}  // namespace

const char* isa() { return active().name; }

const char* isa_levels(bool all) {
  static const std::string runnable = [] {
    std::string s;
    for (const Kernels* k : levels()) {
      if (runs_here(k)) s += (s.empty() ? "" : ",") + std::string(k->name);
    }
    return s;
  }();
  static const std::string built = [] {
    std::string s;
    for (const Kernels* k : levels()) s += (s.empty() ? "" : ",") + std::string(k->name);
    return s;
  }();
  return all ? built.c_str() : runnable.c_str();
}

const char* set_isa(const char* name) {
  if (name == nullptr || name[0] == '\0') {
    active_slot().store(best());
    return nullptr;
  }
  for (const Kernels* k : levels()) {
    if (std::strcmp(k->name, name) != 0) continue;
    if (!runs_here(k)) return "this CPU lacks instructions that level uses";
    active_slot().store(k);
    return nullptr;
  }
  return "this build has no such level";
}

template <typename T>
static const KernelsT<T>& of() {
  if constexpr (std::is_same_v<T, double>) {
    return active().f64;
  } else {
    return active().f32;
  }
}

template <typename T>
void fwd(const FwdParamsT<T>& p, DType dt) { of<T>().fwd(p, dt); }
template <typename T>
void bwd(const BwdParamsT<T>& p, DType dt) { of<T>().bwd(p, dt); }
template <typename T>
void topk_threshold(const FwdParamsT<T>& p, DType dt, int k_top, T* thr, int32_t* jcut) {
  of<T>().topk_threshold(p, dt, k_top, thr, jcut);
}
template <typename T>
void linear_fwd(const LinearParamsT<T>& p, DType dt) { of<T>().linear_fwd(p, dt); }
template <typename T>
void linear_bwd(const LinearBwdParamsT<T>& p, DType dt) { of<T>().linear_bwd(p, dt); }
template <typename T>
void linear_step(const LinearStepParamsT<T>& p, DType dt) { of<T>().linear_step(p, dt); }
template <typename T>
void decode_fwd(const DecodeParamsT<T>& p, DType dt) { of<T>().decode_fwd(p, dt); }
template <typename T>
int decode_num_splits(const DecodeParamsT<T>& p, int max_keys) {
  return of<T>().decode_num_splits(p, max_keys);
}

#define ATTN_INSTANTIATE(T)                                                                  \
  template void fwd<T>(const FwdParamsT<T>&, DType);                                         \
  template void bwd<T>(const BwdParamsT<T>&, DType);                                         \
  template void topk_threshold<T>(const FwdParamsT<T>&, DType, int, T*, int32_t*);           \
  template void linear_fwd<T>(const LinearParamsT<T>&, DType);                               \
  template void linear_bwd<T>(const LinearBwdParamsT<T>&, DType);                            \
  template void linear_step<T>(const LinearStepParamsT<T>&, DType);                          \
  template void decode_fwd<T>(const DecodeParamsT<T>&, DType);                               \
  template int decode_num_splits<T>(const DecodeParamsT<T>&, int);
ATTN_INSTANTIATE(float)
ATTN_INSTANTIATE(double)
#undef ATTN_INSTANTIATE

int simd_width() { return active().simd_width(); }

void dropout_mask(uint8_t* keep, int b, int h, int sq, int sk, float p, uint64_t seed, uint64_t offset) {
  active().dropout_mask(keep, b, h, sq, sk, p, seed, offset);
}

double peak_loop(int kind, int64_t iters) { return active().peak_loop(kind, iters); }

}  // namespace cpu
}  // namespace attn
