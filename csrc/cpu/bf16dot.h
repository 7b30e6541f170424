// bf16 dot products for the softmax kernels' bf16 inputs, on CPUs with AVX512-BF16 (Zen 4,
// Cooper Lake, Sapphire Rapids and later): vdpbf16ps multiplies 16 pairs of bf16 and adds both
// products into 16 float32 lanes, twice the multiply-adds per instruction of a float32 FMA, and
// reads its operands as bf16, half the bytes. The float32 path widens bf16 to float32 first
// (simd.h's gemm), so on such a CPU its bf16 forward ran at its float32 speed.
//
// Operands, "pairs" layouts: the products run over k two at a time, so the two bf16 of one k
// pair sit side by side in one 32-bit word.
//   A (M, K) row-major bf16: row m's pair k is A[m * lda + 2k], A[m * lda + 2k + 1], which is
//     plain row-major storage (Q's rows; P's rows after rounding to bf16). K even.
//   B (K, N) in panels of kDotPanel columns: element (k, n) at
//     B[(n / kDotPanel) * bpanel + (k / 2) * 2 * kDotPanel + (n % kDotPanel) * 2 + k % 2],
//     so one 64-byte load is a k pair's 16 columns (pack.h's kTPairs for K^T, kPairs for V).
//
// Numerics. The products of two bf16 are exact in float32 and the sums are float32, as in the
// widening path; only the order differs. The bf16 forward rounds P to bf16 before P V (as
// FlashAttention does on the GPU: ~2^-9 relative per term, averaged over the keys), while the
// row sum l is taken over the float32 P.
//
// vdpbf16ps computes, per lane, acc <- ftz(acc' + a1 b1), then ftz(that + a0 b0): the odd pair
// element first, each step rounded once (to nearest even), with denormal inputs (acc included)
// read as zero and denormal results flushed to zero, whatever MXCSR says. tests/cpp/test_bf16dot.cpp
// checks dp_step against the instruction on 1.6M random lanes across the denormal range, on any
// CPU with AVX512-BF16 (checked on AMD: no difference, while even-first or pair-first orders
// differ: benchmarks/results/2026-11-29-figures-from-comments.md; Intel's CPUs
// are unchecked: were one to round or flush the product before the add, results would differ
// from dp_step's only where a product leaves the normal range). dp_step() emulates one lane of it;
// gemm_dp_skipping() uses it to redo a product without some terms, as simd.h's gemm_skipping
// does for the float32 gemm, and the NaN-poisoning tests in bf16 (tests/fuzz/test_invariants.py)
// hold the redo to the instruction's bits.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu/isa.h"
#include "cpu/simd.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace attn {
namespace cpu {
ATTN_CPU_ISA_BEGIN

#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif

// Columns per B panel: two 16-lane accumulators, the float32 gemm's kPanel at AVX-512 width, so
// the packed K / V blocks hold as many elements as the float32 ones (pack.h's PackIndex).
constexpr int kDotPanel = 32;
constexpr int kDotMR = 8;  // rows per micro-kernel block: kBlockM = 48 is 6 blocks

// bf16 -> float32 as vdpbf16ps reads it: denormals (exponent 0) as signed zero.
inline float bf16_daz(uint16_t h) { return bf16_to_f32((h & 0x7f80u) == 0 ? uint16_t(h & 0x8000u) : h); }
inline float ftz(float x) { return std::fabs(x) < FLT_MIN ? std::copysign(0.f, x) : x; }
// One product term of vdpbf16ps on one lane: acc (already flushed) + a b, rounded once, flushed.
inline float dp_step(float acc, uint16_t a, uint16_t b) { return ftz(std::fma(bf16_daz(a), bf16_daz(b), acc)); }

// float32 -> bf16 as the bf16 path rounds P: to nearest even (simd.h's f32_to_bf16, which
// vcvtneps2bf16 matches except that it flushes denormal inputs; P's are left alone here).
// dst row stride ld, n elements per row, n a multiple of 16.
inline void rows_to_bf16(const float* src, int64_t ld_src, uint16_t* dst, int64_t ld_dst, int rows, int n) {
  for (int r = 0; r < rows; ++r) {
    const float* s = src + r * ld_src;
    uint16_t* d = dst + r * ld_dst;
#if defined(__AVX512BF16__)
    for (int c = 0; c < n; c += 16) {
      // vcvtneps2bf16: round to nearest even, NaN kept; denormal P is below any weight that
      // survives the output's own bf16 rounding
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(s + c));
      std::memcpy(d + c, &h, 32);
    }
#else
    for (int c = 0; c < n; ++c) d[c] = f32_to_bf16(s[c]);
#endif
  }
}

#if defined(__AVX512BF16__)
// C (MR, 16 NV) = A (MR, 2 K2) @ B panel (2 K2, 16 NV): MR x NV accumulators stay in registers
// (12 of the 32 zmm at 6 x 2); each k pair loads NV vectors of B and broadcasts MR words of A
// (one load-port uop each, as simd.h's vbcast_mem) for MR x NV vdpbf16ps.
template <int MR, int NV>
inline void dp_micro(int K2, const uint16_t* __restrict__ A, int64_t lda, const uint16_t* __restrict__ B,
                     float* __restrict__ C, int64_t ldc) {
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  for (int k = 0; k < K2; ++k) {
    __m512bh b[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(B + int64_t(k) * 2 * kDotPanel + v * 32);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      int32_t w;
      std::memcpy(&w, A + r * lda + 2 * k, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(w);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(C + r * ldc + v * 16, acc[r][v]);
  }
}

template <int NV>
inline void dp_rows(int mr, int K2, const uint16_t* A, int64_t lda, const uint16_t* B, float* C, int64_t ldc) {
  rows_switch<kDotMR>(mr, [&](auto m) { dp_micro<decltype(m)::value, NV>(K2, A, lda, B, C, ldc); });
}
#endif

// C (M, N) = A (M, K) @ B (K, N), float32 out, in the pairs layouts above; K even, N a multiple
// of 16. Each element is summed over k pairs in order, one vdpbf16ps step per pair.
inline void gemm_dp(int M, int N, int K, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t bpanel,
                    float* C, int64_t ldc) {
#if defined(__AVX512BF16__)
  // n outer, m inner: the (K, kDotPanel) panel of B stays in L1 while A's rows stream past it
  for (int n0 = 0; n0 < N; n0 += kDotPanel) {
    const uint16_t* b = B + int64_t(n0 / kDotPanel) * bpanel;
    for (int m0 = 0; m0 < M; m0 += kDotMR) {
      const int mr = M - m0 < kDotMR ? M - m0 : kDotMR;
      if (N - n0 >= kDotPanel) {
        dp_rows<2>(mr, K / 2, A + m0 * lda, lda, b, C + m0 * ldc + n0, ldc);
      } else {
        dp_rows<1>(mr, K / 2, A + m0 * lda, lda, b, C + m0 * ldc + n0, ldc);
      }
    }
  }
#else
  // the instruction's arithmetic, lane by lane (levels without it never choose this path; it
  // keeps one definition of the product for every level)
  for (int m = 0; m < M; ++m) {
    for (int n = 0; n < N; ++n) {
      const uint16_t* b = B + int64_t(n / kDotPanel) * bpanel + (n % kDotPanel) * 2;
      float acc = 0.f;
      for (int k = 0; k < K; k += 2) {
        acc = dp_step(acc, A[m * lda + k + 1], b[int64_t(k / 2) * 2 * kDotPanel + 1]);
        acc = dp_step(acc, A[m * lda + k], b[int64_t(k / 2) * 2 * kDotPanel]);
      }
      C[m * ldc + n] = acc;
    }
  }
#endif
}

// gemm_dp without the terms k of row m where skip(m, k): a term left out is a step not taken,
// so where those terms are 0 times a finite number the result is gemm_dp's bit for bit (adding
// a zero product changes no sum but -0's sign). The softmax forward calls it only where
// gemm_dp's P V came out NaN (see simd.h's gemm_skipping).
template <typename Skip>
inline void gemm_dp_skipping(int M, int N, int K, const uint16_t* A, int64_t lda, const uint16_t* B,
                             int64_t bpanel, float* C, int64_t ldc, Skip&& skip) {
  for (int m = 0; m < M; ++m) {
    for (int n = 0; n < N; ++n) {
      const uint16_t* b = B + int64_t(n / kDotPanel) * bpanel + (n % kDotPanel) * 2;
      float acc = 0.f;
      for (int k = 0; k < K; k += 2) {
        if (!skip(m, k + 1)) acc = dp_step(acc, A[m * lda + k + 1], b[int64_t(k / 2) * 2 * kDotPanel + 1]);
        if (!skip(m, k)) acc = dp_step(acc, A[m * lda + k], b[int64_t(k / 2) * 2 * kDotPanel]);
      }
      C[m * ldc + n] = acc;
    }
  }
}

ATTN_CPU_ISA_END
}  // namespace cpu
}  // namespace attn
