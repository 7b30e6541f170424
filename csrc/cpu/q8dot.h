// int8 dot products for the softmax forward's quantized Q K^T (qk_quant = "int8", SageAttention's
// method): Q and the mean-smoothed K are rounded to int8 with a scale per block, their products
// are summed exactly in int32, and one multiply-add per score brings the sum back to float32.
//
// On CPUs with AVX512-VNNI (every CPU with AVX512-BF16: Zen 4 / 5, Cooper Lake, Sapphire Rapids)
// vpdpbusd multiplies 64 pairs of bytes (one unsigned, one signed) and adds each 4 adjacent
// products into 16 int32 lanes: twice the multiply-adds per instruction of vdpbf16ps, four times
// a float32 FMA's, on a quarter of the float32 operand bytes (whether the core issues it as often
// as those is the CPU's: csrc/peak's int8_dot loop measures it). AVX2 levels widen the bytes to
// int16 and multiply pairs (vpmaddwd: 16
// multiply-adds per instruction, a float32 FMA's 8); other levels run the integer arithmetic in
// plain C++. The sums are exact integers, so every level computes the same scores bit for bit.
// The variants "avx512vnni" (AVX-512 with VNNI but no BF16: Cascade Lake, Ice Lake) and
// "avx2vnni" (AVX-VNNI, vpdpbusd on 256 bits: Alder Lake and later, Zen 5) run their level's
// code with vpdpbusd here (isa.h's int8_vnni, at run time; the functions carry the target
// attribute, since their level's flags do not include the instruction).
//
// The unsigned operand is K, stored with a bias of 128 (k + 128 in [1, 255]); Q stays signed, so
//   sum_c (k_c + 128) q_c = q . k + 128 sum_c q_c
// and the row's correction 128 sum_c q_c, one integer per query row, is subtracted before the
// conversion. No product or sum can overflow: |sum| <= D 255 127 < 2^31 for D < 66,000.
//
// Operands:
//   A (M, K) int8 row-major (Q's rows, zero past d): row m's quad k is A[m * lda + 4k .. + 3].
//   B (K, N) uint8 in panels of kQ8Panel keys: element (c, n) at
//     B[(n / kQ8Panel) * bpanel + (c / 4) * 4 kQ8Panel + (n % kQ8Panel) * 4 + c % 4],
//     so one 64-byte load is a channel quad of 16 keys: the "quads" layout, which pack.h's
//     pack_keys_q8 writes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cpu/amx.h"
#include "cpu/isa.h"
#include "cpu/simd.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace attn {
namespace cpu {
ATTN_CPU_ISA_BEGIN

// Keys per B panel: the float32 micro-kernel's kPanel at every level, so that the forward's key
// tiles (which start on kPanel<float> boundaries) start on a panel.
constexpr int kQ8Panel = 2 * W;
constexpr int kQ8Bias = 128;  // K's bias in the unsigned operand
constexpr int kQ8MR = 8;      // rows per micro-kernel block

// ---------------------------------------------------------------- rounding to int8
// The blocks' scales and integers, float32 op for op as reference.py's _int8_blocks:
//   scale = amax / 127, x_i = clamp(rint(x * (127 / amax)), -127, 127)
// amax the block's largest |x|, NaN when one is not finite. The non-finite rule, stated here
// once: such a block's scale is NaN, so every score that uses it is NaN (its integers are
// meaningless and never read as numbers); a non-finite key also makes its sequence's K mean NaN,
// so the whole (sequence, kv head) shows NaN, and a non-finite query its block of rows. A
// non-finite input shows instead of rounding to junk, except in keys no row may see, which
// pack.h's pack_keys_q8 leaves out (q8_seen_keys).

// max |x| over n floats (a multiple of the vector width), or NaN if one is not finite.
inline float q8_amax(const float* x, int64_t n) {
  if (any_nonfinite(x, n)) return std::numeric_limits<float>::quiet_NaN();
  vf m = vbcast(0.f);
  for (int64_t i = 0; i < n; i += kLanes<float>) {
    const vf v = vload(x + i);
    m = vmax(m, vmax(v, -v));
  }
  return hmax(m);
}
inline float q8_scale(float amax) { return amax / 127.f; }  // NaN stays NaN
// 0 for NaN, 0 and an amax so small that 127 / amax overflows
inline float q8_inv(float amax) {
  const float inv = 127.f / amax;
  return amax > 0.f && inv <= std::numeric_limits<float>::max() ? inv : 0.f;
}

// dst[c] = clamp(rint(x[c] inv), -127, 127) for c < n; returns sum_c dst[c]. The loop vectorizes
// (-fno-math-errno: nearbyint is a rounding instruction).
inline int32_t q8_round(const float* x, int n, float inv, int8_t* dst) {
  int32_t sum = 0;
  for (int c = 0; c < n; ++c) {
    const float y = std::min(127.f, std::max(-127.f, std::nearbyint(x[c] * inv)));
    const int32_t v = int32_t(y);
    dst[c] = int8_t(v);
    sum += v;
  }
  return sum;
}

// What turns a block's int32 sums into the float32 scores q . k: for row m,
//   C[m][n] = float(acc - corr[m]) * scale + add[m]
// (corr: 128 sum_c q_c; scale: the Q block's scale times the K block's; add: the row's q . mean,
// the part of q . k the smoothing took out of K).
struct Q8Epilogue {
  const int32_t* corr;
  float scale;
  const float* add;
};

// The 512-bit vpdpbusd kernel: built in with AVX512-VNNI's flags (avx512bf16), and under the
// target attribute at the avx512 level (its "avx512vnni" variant)
#if defined(__AVX512VNNI__)
#define ATTN_Q8_VNNI512 1
#define ATTN_Q8_VNNI512_FN
#elif defined(__AVX512F__) && defined(__AVX512BW__) && (defined(__GNUC__) || defined(__clang__))
#define ATTN_Q8_VNNI512 1
#define ATTN_Q8_VNNI512_FN __attribute__((target("avx512vnni")))
#endif

#if defined(ATTN_Q8_VNNI512)
// C (MR, 16 NV) = epilogue(A (MR, 4 K4) @ B panel (4 K4, 16 NV)): MR x NV int32 accumulators
// in registers (16 of the 32 zmm at 8 x 2); each channel quad loads NV vectors of B and
// broadcasts MR words of A, for MR x NV vpdpbusd.
template <int MR, int NV>
ATTN_Q8_VNNI512_FN inline void q8_micro(int K4, const int8_t* __restrict__ A, int64_t lda,
                                        const uint8_t* __restrict__ B,
                     float* __restrict__ C, int64_t ldc, const Q8Epilogue& e) {
  __m512i acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_si512();
  }
  for (int k = 0; k < K4; ++k) {
    __m512i b[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_si512(B + int64_t(k) * 4 * kQ8Panel + v * 64);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      int32_t w;
      std::memcpy(&w, A + r * lda + 4 * k, 4);
      const __m512i a = _mm512_set1_epi32(w);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], b[v], a);
    }
  }
  const __m512 sc = _mm512_set1_ps(e.scale);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const __m512i corr = _mm512_set1_epi32(e.corr[r]);
    const __m512 add = _mm512_set1_ps(e.add[r]);
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      const __m512 s = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][v], corr));
      _mm512_storeu_ps(C + r * ldc + v * 16, _mm512_fmadd_ps(s, sc, add));
    }
  }
}

template <int NV>
inline void q8_rows(int mr, int K4, const int8_t* A, int64_t lda, const uint8_t* B, float* C, int64_t ldc,
                    const Q8Epilogue& e) {
  rows_switch<kQ8MR>(mr, [&](auto m) { q8_micro<decltype(m)::value, NV>(K4, A, lda, B, C, ldc, e); });
}

// gemm_q8 on the 512-bit kernel. n outer, m inner: the (K, kQ8Panel) panel of B stays in L1
// while A's rows stream past it.
inline void gemm_q8_vnni512(int M, int N, int K, const int8_t* A, int64_t lda, const uint8_t* B, int64_t bpanel,
                            float* C, int64_t ldc, const Q8Epilogue& e) {
  for (int n0 = 0; n0 < N; n0 += kQ8Panel) {
    const uint8_t* b = B + int64_t(n0 / kQ8Panel) * bpanel;
    for (int m0 = 0; m0 < M; m0 += kQ8MR) {
      const int mr = M - m0 < kQ8MR ? M - m0 : kQ8MR;
      const Q8Epilogue em{e.corr + m0, e.scale, e.add + m0};
      if (N - n0 >= kQ8Panel) {
        q8_rows<2>(mr, K / 4, A + m0 * lda, lda, b, C + m0 * ldc + n0, ldc, em);
      } else {
        q8_rows<1>(mr, K / 4, A + m0 * lda, lda, b, C + m0 * ldc + n0, ldc, em);
      }
    }
  }
}
#endif

// AMX-INT8 (cpu/amx.h: the "avx512amx" variant): tdpbsud multiplies a (16, 64) tile of signed
// bytes by a (64, 16) tile of unsigned bytes held as 16 rows of 16 channel quads, into a (16, 16)
// int32 tile: 16384 multiply-adds, 64 vpdpbusd's worth, per instruction. The B operand's quads
// layout is already AMX's: a panel's channel quad c/4 is 32 keys x 4 bytes, so the tile of keys
// [0, 16) is the rows of 64 bytes at stride 4 kQ8Panel, and keys [16, 32) the same rows 64 bytes
// on. The sums are the same exact integers as vpdpbusd's, so the scores are the other levels' bit
// for bit.
//
// A is copied into a zeroed (rows, Kp) buffer, Kp = K rounded up to 64, so that a tile never
// reads past a row; B's tiles then read past the panel's last quad (into the next panel, or
// kQ8Overread bytes past the buffer: the caller's allocation has them) where K < Kp, and those
// bytes meet A's zeros (integers: any byte times 0 is 0).
#if defined(ATTN_AMX)
#define ATTN_Q8_AMX 1
constexpr int kQ8Overread = 16 * 4 * kQ8Panel;  // >= (Kp - K) / 4 quads of 4 kQ8Panel bytes

// (MB 16, NB 16) of C from the accumulator tiles: the epilogue on `rows` valid rows
template <int MB, int NB>
ATTN_AMX_FN inline void q8_amx_block(int rows, int Kp, const int8_t* a, const uint8_t* b, float* C, int64_t ldc,
                                        const Q8Epilogue& e) {
  constexpr int kBStride = 4 * kQ8Panel;
  amx_acc_zero<MB, NB>();
  for (int k0 = 0; k0 < Kp; k0 += 64) {
    const uint8_t* bk = b + int64_t(k0 / 4) * kBStride;
    _tile_loadd(4, a + k0, Kp);
    _tile_loadd(6, bk, kBStride);
    if constexpr (NB == 2) _tile_loadd(7, bk + 64, kBStride);
    if constexpr (MB == 2) _tile_loadd(5, a + 16 * Kp + k0, Kp);
    _tile_dpbsud(0, 4, 6);
    if constexpr (NB == 2) _tile_dpbsud(1, 4, 7);
    if constexpr (MB == 2) _tile_dpbsud(2, 5, 6);
    if constexpr (MB == 2 && NB == 2) _tile_dpbsud(3, 5, 7);
  }
  alignas(64) int32_t acc[32 * 32];  // (32, 32), rows past `rows` not read
  amx_acc_store<MB, NB>(acc, 32 * 4);
  const __m512 sc = _mm512_set1_ps(e.scale);
  for (int r = 0; r < rows; ++r) {
    const __m512i corr = _mm512_set1_epi32(e.corr[r]);
    const __m512 add = _mm512_set1_ps(e.add[r]);
#pragma GCC unroll 2
    for (int j = 0; j < NB; ++j) {
      const __m512i s = _mm512_load_si512(acc + r * 32 + 16 * j);
      const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(s, corr));
      _mm512_storeu_ps(C + int64_t(r) * ldc + 16 * j, _mm512_fmadd_ps(f, sc, add));
    }
  }
}

// gemm_q8 on AMX: M <= 64 rows (the forward's tiles have at most kBlockM)
ATTN_AMX_FN inline void gemm_q8_amx(int M, int N, int K, const int8_t* A, int64_t lda, const uint8_t* B,
                                       int64_t bpanel, float* C, int64_t ldc, const Q8Epilogue& e) {
  static_assert(kQ8Panel == 32, "a panel is two 16-key tiles");
  constexpr int kMaxM = 64, kMaxK = 256;
  if (M > kMaxM || K > kMaxK) __builtin_trap();  // unreachable: kBlockM rows, the head-dim rule
  const int Kp = (K + 63) / 64 * 64, Mp = (M + 15) / 16 * 16;
  alignas(64) int8_t a[kMaxM * kMaxK];
  for (int m = 0; m < Mp; ++m) {
    if (m < M) std::memcpy(a + m * Kp, A + m * lda, size_t(K));
    std::memset(a + m * Kp + (m < M ? K : 0), 0, size_t(m < M ? Kp - K : Kp));
  }
  const AmxCall tiles;
  for (int n0 = 0; n0 < N; n0 += kQ8Panel) {
    const uint8_t* b = B + int64_t(n0 / kQ8Panel) * bpanel;
    const bool two = N - n0 >= kQ8Panel;  // N is a multiple of 16: else one 16-key half
    for (int m0 = 0; m0 < M; m0 += 32) {
      const int rows = M - m0 < 32 ? M - m0 : 32;
      const Q8Epilogue em{e.corr + m0, e.scale, e.add + m0};
      const int8_t* am = a + m0 * Kp;
      float* c = C + int64_t(m0) * ldc + n0;
      if (rows > 16) {
        two ? q8_amx_block<2, 2>(rows, Kp, am, b, c, ldc, em) : q8_amx_block<2, 1>(rows, Kp, am, b, c, ldc, em);
      } else {
        two ? q8_amx_block<1, 2>(rows, Kp, am, b, c, ldc, em) : q8_amx_block<1, 1>(rows, Kp, am, b, c, ldc, em);
      }
    }
  }
}
#else
constexpr int kQ8Overread = 0;
#endif

// The 256-bit vpdpbusd kernel (AVX-VNNI) of the avx2 level's "avx2vnni" variant: the panel's 16
// keys as NV vectors of 8 (one channel quad each; NV = 1 for a tile's last, half-full panel), MR
// rows of A broadcast a word at a time.
#if defined(__AVX2__) && !defined(__AVX512F__) && (defined(__GNUC__) || defined(__clang__))
#define ATTN_Q8_AVXVNNI 1
template <int MR, int NV>
__attribute__((target("avxvnni"))) inline void q8_micro_avxvnni(int K4, const int8_t* __restrict__ A, int64_t lda,
                                                                 const uint8_t* __restrict__ B, float* __restrict__ C,
                                                                 int64_t ldc, const Q8Epilogue& e) {
  static_assert(kQ8Panel == 16, "two 8-key vectors per panel");
  __m256i acc[MR][NV];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_si256();
  }
  for (int k = 0; k < K4; ++k) {
    const uint8_t* b = B + int64_t(k) * 4 * kQ8Panel;
    __m256i bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * v));
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      int32_t w;
      std::memcpy(&w, A + r * lda + 4 * k, 4);
      const __m256i a = _mm256_set1_epi32(w);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_dpbusd_avx_epi32(acc[r][v], bv[v], a);
    }
  }
  const __m256 sc = _mm256_set1_ps(e.scale);
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    const __m256i corr = _mm256_set1_epi32(e.corr[r]);
    const __m256 add = _mm256_set1_ps(e.add[r]);
    for (int v = 0; v < NV; ++v) {
      const __m256 f = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r][v], corr));
      _mm256_storeu_ps(C + r * ldc + v * 8, _mm256_fmadd_ps(f, sc, add));
    }
  }
}

inline void gemm_q8_avxvnni(int M, int N, int K, const int8_t* A, int64_t lda, const uint8_t* B, int64_t bpanel,
                            float* C, int64_t ldc, const Q8Epilogue& e) {
  for (int n0 = 0; n0 < N; n0 += kQ8Panel) {  // N: a multiple of 8, the last panel maybe half full
    const uint8_t* b = B + int64_t(n0 / kQ8Panel) * bpanel;
    const bool full = N - n0 >= kQ8Panel;
    for (int m0 = 0; m0 < M; m0 += 4) {
      const int mr = M - m0 < 4 ? M - m0 : 4;
      const Q8Epilogue em{e.corr + m0, e.scale, e.add + m0};
      rows_switch<4>(mr, [&](auto m) {
        constexpr int MR = decltype(m)::value;
        if (full) {
          q8_micro_avxvnni<MR, 2>(K / 4, A + m0 * lda, lda, b, C + m0 * ldc + n0, ldc, em);
        } else {
          q8_micro_avxvnni<MR, 1>(K / 4, A + m0 * lda, lda, b, C + m0 * ldc + n0, ldc, em);
        }
      });
    }
  }
}
#endif

#if defined(__AVX2__) && !defined(__AVX512VNNI__)
// C (MR, 8) = epilogue(A (MR, 4 K4) @ B keys [0, 8) of a panel): A's quads as 4 int16 (a16, 8
// bytes a quad: one 64-bit broadcast); B's bytes widened 4 keys at a time (vpmovzxbw: 16 bytes =
// 4 keys x 4 channels -> 16 int16), vpmaddwd against the broadcast quad gives per key two sums of
// two products, and the two are added in the epilogue (vphaddd, then the lanes put in key order).
template <int MR>
inline void q8_micro_avx2(int K4, const int16_t* __restrict__ A, int64_t lda, const uint8_t* __restrict__ B,
                          float* __restrict__ C, int64_t ldc, const Q8Epilogue& e) {
  __m256i acc[MR][2];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  for (int k = 0; k < K4; ++k) {
    const uint8_t* b = B + int64_t(k) * 4 * kQ8Panel;
    const __m256i b0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    const __m256i b1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16)));
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      int64_t w;
      std::memcpy(&w, A + r * lda + 4 * k, 8);
      const __m256i a = _mm256_set1_epi64x(w);
      acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(b0, a));
      acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(b1, a));
    }
  }
  const __m256 sc = _mm256_set1_ps(e.scale);
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    // [k0 k1 k4 k5 | k2 k3 k6 k7] -> [k0 .. k7]
    const __m256i s = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[r][0], acc[r][1]), 0xD8);
    const __m256 f = _mm256_cvtepi32_ps(_mm256_sub_epi32(s, _mm256_set1_epi32(e.corr[r])));
    _mm256_storeu_ps(C + r * ldc, _mm256_fmadd_ps(f, sc, _mm256_set1_ps(e.add[r])));
  }
}

inline void q8_rows_avx2(int mr, int K4, const int16_t* A, int64_t lda, const uint8_t* B, float* C, int64_t ldc,
                         const Q8Epilogue& e) {
  rows_switch<4>(mr, [&](auto m) { q8_micro_avx2<decltype(m)::value>(K4, A, lda, B, C, ldc, e); });
}
#endif

// The portable form: one panel of up to kQ8Panel keys for one row, int16 products summed in
// int32 (the compiler turns the inner loop into pmaddwd-style multiply-adds).
inline void q8_row_portable(int K4, const int8_t* a, const uint8_t* B, int32_t* acc) {
  for (int j = 0; j < kQ8Panel; ++j) acc[j] = 0;
  for (int k = 0; k < K4; ++k) {
    const uint8_t* b = B + int64_t(k) * 4 * kQ8Panel;
    const int32_t a0 = a[4 * k], a1 = a[4 * k + 1], a2 = a[4 * k + 2], a3 = a[4 * k + 3];
    for (int j = 0; j < kQ8Panel; ++j) {
      acc[j] += int32_t(b[4 * j]) * a0 + int32_t(b[4 * j + 1]) * a1 + int32_t(b[4 * j + 2]) * a2 +
                int32_t(b[4 * j + 3]) * a3;
    }
  }
}

// C (M, N) = epilogue(A (M, K) @ B (K, N)) in the layouts above; K a multiple of 4, at most 256
// (the ops' head-dim rule, d <= 256, padded to dp <= 256); N a multiple of the forward's key step
// (tile.h's kFwdKeyStep: a tile's last panel may be part full).
inline void gemm_q8(int M, int N, int K, const int8_t* A, int64_t lda, const uint8_t* B, int64_t bpanel, float* C,
                    int64_t ldc, const Q8Epilogue& e) {
#if defined(__AVX512VNNI__)
#if defined(ATTN_Q8_AMX)
  if (amx()) return gemm_q8_amx(M, N, K, A, lda, B, bpanel, C, ldc, e);  // "avx512amx"
#endif
  gemm_q8_vnni512(M, N, K, A, lda, B, bpanel, C, ldc, e);
#elif defined(__AVX2__)
#if defined(ATTN_Q8_VNNI512)
  if (int8_vnni()) return gemm_q8_vnni512(M, N, K, A, lda, B, bpanel, C, ldc, e);  // "avx512vnni"
#elif defined(ATTN_Q8_AVXVNNI)
  if (int8_vnni()) return gemm_q8_avxvnni(M, N, K, A, lda, B, bpanel, C, ldc, e);  // "avx2vnni"
#endif
  // A widened to int16 once per call (at most 48 rows of K <= 256: small beside the products)
  constexpr int kMaxM = 64, kMaxK = 256;
  if (K > kMaxK) __builtin_trap();  // unreachable under the head-dim rule
  alignas(64) int16_t a16[kMaxM * kMaxK];
  for (int m0 = 0; m0 < M; m0 += kMaxM) {
    const int mm = M - m0 < kMaxM ? M - m0 : kMaxM;
    for (int m = 0; m < mm; ++m) {
      for (int c = 0; c < K; ++c) a16[m * K + c] = A[(m0 + m) * lda + c];
    }
    for (int n0 = 0; n0 < N; n0 += 8) {  // half panels of 8 keys
      const uint8_t* b = B + int64_t(n0 / kQ8Panel) * bpanel + (n0 % kQ8Panel) * 4;
      for (int m = 0; m < mm; m += 4) {
        const int mr = mm - m < 4 ? mm - m : 4;
        const Q8Epilogue em{e.corr + m0 + m, e.scale, e.add + m0 + m};
        q8_rows_avx2(mr, K / 4, a16 + m * K, K, b, C + (m0 + m) * ldc + n0, ldc, em);
      }
    }
  }
#else
  int32_t acc[kQ8Panel];
  for (int n0 = 0; n0 < N; n0 += kQ8Panel) {
    const uint8_t* b = B + int64_t(n0 / kQ8Panel) * bpanel;
    const int nn = N - n0 < kQ8Panel ? N - n0 : kQ8Panel;
    for (int m = 0; m < M; ++m) {
      q8_row_portable(K / 4, A + m * lda, b, acc);
      // one rounding, as vfmadd231ps
      for (int j = 0; j < nn; ++j) C[m * ldc + n0 + j] = std::fma(float(acc[j] - e.corr[m]), e.scale, e.add[m]);
    }
  }
#endif
}

ATTN_CPU_ISA_END
}  // namespace cpu
}  // namespace attn
