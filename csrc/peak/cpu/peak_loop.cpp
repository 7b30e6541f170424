// The peak loops (peak/cpu/entry.h). Each round issues one instruction per accumulator chain,
// every chain independent of the others: the FMA units then start one instruction per port per
// cycle, which needs latency x ports chains in flight (4 x 2 = 8 where the FMA latency is 4
// cycles, 5 x 2 = 10 where it is 5). The chain count is what the registers hold beside the two
// operands (24 of 32 vector registers with AVX-512, 12 of 16 below), above every such product,
// so the loop is bound by the ports and never by latency or by spills. The operands keep the
// accumulators near 1 (a fixed point of acc * m + a) or growing slowly (the dot product): no
// denormals, no overflow, whose slow paths would read as a lower peak.
#include <cstring>

#include "cpu/isa.h"
#include "cpu/amx.h"
#include "cpu/simd.h"
#include "peak/cpu/entry.h"

#if defined(__AVX512BF16__) || defined(__AVX512VNNI__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// The vpdpbusd loops run where the int8 Q.K^T does (cpu/q8dot.h): compiled in with AVX512-VNNI's
// flags (avx512bf16, avx512amx), and under a target attribute in the avx512 level's "avx512vnni"
// and the avx2 level's "avx2vnni" variants (isa.h's int8_vnni(), at run time)
#if defined(__AVX512VNNI__)
#define ATTN_PEAK_DP512 1
#define ATTN_PEAK_DP512_FN
#elif defined(__AVX512F__) && defined(__AVX512BW__) && (defined(__GNUC__) || defined(__clang__))
#define ATTN_PEAK_DP512 1
#define ATTN_PEAK_DP512_FN __attribute__((target("avx512vnni")))
#elif defined(__AVX2__) && !defined(__AVX512F__) && (defined(__GNUC__) || defined(__clang__))
#define ATTN_PEAK_DP256 1
#endif

namespace attn {
namespace cpu {
ATTN_CPU_ISA_BEGIN

namespace {

constexpr int kChains = W == 16 ? 24 : 12;

// Sums the chains into one float, stored where the compiler must assume it is read.
template <typename V>
void keep(const V* acc) {
  V s = acc[0];
  for (int c = 1; c < kChains; ++c) s += acc[c];
  float out[sizeof(V) / sizeof(float)];
  std::memcpy(out, &s, sizeof(s));
  static volatile float sink;
  sink = out[0];
}

double fma_loop(int64_t iters) {
  vf acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = vbcast(0.5f + 1e-3f * float(c));  // not the fixed point: no chain folds away
  const vf m = vbcast(0.999f), a = vbcast(1e-3f);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 24
    for (int c = 0; c < kChains; ++c) acc[c] = acc[c] * m + a;  // one FMA (contracted) per chain
  }
  keep(acc);
  return 2.0 * W * kChains * double(iters);
}

#if defined(__AVX512BF16__)
double bf16_dot_loop(int64_t iters) {
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(1.0f);
  // 32 bf16 of 2^-10 each: every instruction adds 2 products of 2^-20 per lane
  const __m512bh x = (__m512bh)_mm512_set1_epi16(short(0x3A80));
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 24
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], x, x);
  }
  keep(acc);
  return 2.0 * 32 * kChains * double(iters);  // 16 lanes x 2 products, 2 FLOPs each
}
#endif

#if defined(ATTN_PEAK_DP512)
ATTN_PEAK_DP512_FN double int8_dot_loop(int64_t iters) {
  __m512i acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_epi32(c);
  // 64 byte pairs of 1 x 1: every instruction adds 4 to each lane (no overflow in 2^29 rounds)
  const __m512i x = _mm512_set1_epi8(1);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 24
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], x, x);
  }
  __m512i s = acc[0];
  for (int c = 1; c < kChains; ++c) s = _mm512_add_epi32(s, acc[c]);
  static volatile int sink;
  sink = _mm512_reduce_add_epi32(s);
  return 2.0 * 64 * kChains * double(iters);  // 16 lanes x 4 products, 2 ops each
}
#endif

#if defined(ATTN_PEAK_DP256)
// AVX-VNNI's 256-bit vpdpbusd, the avx2vnni variant's int8 Q.K^T product
__attribute__((target("avxvnni"))) double int8_dot_loop(int64_t iters) {
  __m256i acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_epi32(c);
  const __m256i x = _mm256_set1_epi8(1);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_dpbusd_avx_epi32(acc[c], x, x);
  }
  alignas(32) int32_t lanes[8] = {};
  for (int c = 0; c < kChains; ++c) {
    alignas(32) int32_t t[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(t), acc[c]);
    for (int l = 0; l < 8; ++l) lanes[l] += t[l];
  }
  static volatile int sink;
  sink = lanes[0];
  return 2.0 * 32 * kChains * double(iters);  // 8 lanes x 4 products, 2 ops each
}
#endif

#if defined(ATTN_AMX)
// Four independent (16, 16) accumulator tiles, each instruction 16 x 16 x 64 int8 (tdpbsud) or
// 16 x 16 x 32 bf16 (tdpbf16ps) multiply-adds, the tile products' loop without their loads. The
// operands are ones (int8: each round adds 64 to every element, no overflow in 2^25 rounds) or
// 2^-10 (bf16: each round adds 2^-15, far from overflow).
ATTN_AMX_FN double amx_loop(bool bf16, int64_t iters) {
  if (!amx()) return 0.0;
  alignas(64) uint16_t x[16 * 32];
  for (uint16_t& e : x) e = bf16 ? uint16_t(0x3A80) : uint16_t(0x0101);
  const AmxCall tiles;
  amx_acc_zero<2, 2>();
  _tile_loadd(4, x, 64);
  _tile_loadd(5, x, 64);
  _tile_loadd(6, x, 64);
  _tile_loadd(7, x, 64);
  if (bf16) {
    for (int64_t i = 0; i < iters; ++i) {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  } else {
    for (int64_t i = 0; i < iters; ++i) {
      _tile_dpbsud(0, 4, 6);
      _tile_dpbsud(1, 4, 7);
      _tile_dpbsud(2, 5, 6);
      _tile_dpbsud(3, 5, 7);
    }
  }
  alignas(64) int32_t out[16 * 16];
  _tile_stored(0, out, 64);
  static volatile int sink;
  sink = out[0];
  return 2.0 * 4 * 16 * 16 * (bf16 ? 32 : 64) * double(iters);
}
#endif

}  // namespace

double peak_loop(int kind, int64_t iters) {
  if (kind == kPeakFp32Fma) return fma_loop(iters);
#if defined(__AVX512BF16__)
  if (kind == kPeakBf16Dot) return bf16_dot_loop(iters);
#endif
#if defined(__AVX512VNNI__)
  if (kind == kPeakInt8Dot) return int8_dot_loop(iters);
#elif defined(ATTN_PEAK_DP512) || defined(ATTN_PEAK_DP256)
  if (kind == kPeakInt8Dot) return int8_vnni() ? int8_dot_loop(iters) : 0.0;
#endif
#if defined(ATTN_AMX)
  if (kind == kPeakInt8Amx) return amx_loop(false, iters);
  if (kind == kPeakBf16Amx) return amx_loop(true, iters);
#endif
  return 0.0;
}
ATTN_CPU_REGISTER(peak_loop_stub, &peak_loop);

ATTN_CPU_ISA_END
}  // namespace cpu
}  // namespace attn
