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
// CPU with AVX512-BF16 (no difference on AMD's Zen 4 / 5 nor on an Intel Xeon with AMX, while
// even-first or pair-first orders differ: benchmarks/results/2026-11-29-figures-from-comments.md,
// 2026-12-01-amx-cpu.md). dp_step() emulates one lane of it;
// gemm_dp_skipping() uses it to redo a product without some terms, as simd.h's gemm_skipping
// does for the float32 gemm, and the NaN-poisoning tests in bf16 (tests/fuzz/test_invariants.py)
// hold the redo to the instruction's bits.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu/amx.h"
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

#if defined(ATTN_AMX)
// AMX-BF16 (cpu/amx.h: the "avx512amx" variant): tdpbf16ps multiplies a (16, 32) tile of bf16 by
// a (32, 16) tile held as 16 rows of 16 column pairs, into a (16, 16) float32 tile: 8192
// multiply-adds per instruction, 16 vdpbf16ps' worth. The pairs layout is already AMX's: a
// panel's k pair is 32 columns x 2 bf16, so the tile of columns [0, 16) is the rows of 64 bytes
// at stride 4 kDotPanel bytes, and columns [16, 32) the same rows 64 bytes on.
//
// Numerics. tdpbf16ps rounds differently from vdpbf16ps (its sums of a tile row's products are
// not vdpbf16ps' step-by-step roundings; tests/cpp/test_bf16dot.cpp's emulation does not match
// it), so this variant's bf16 scores differ from avx512bf16's in the last bits; the forward and
// the backward both take it, so the backward still recomputes the forward's logits bit for bit
// (an element's sum depends on its row of A, its column of B and the k chunks' order only, not
// on the rows beside it). The products are exact and the sums float32, as in every other path.
//
// k runs in chunks of 32 in place; the last, part-full chunk (K % 32: a head dim that is not a
// multiple of 32, a key tile of 16 keys) comes from zero-padded copies of A's and B's chunk, so
// no tile reads an element past K: past K, A may hold stale values and B other keys' rows (NaN
// included), and 0 x NaN would show. Rows past M come from a zeroed copy of the block's A the
// same way.
constexpr int kAmxDpK = 32;  // bf16 per tile row

// One k chunk of 32 into the (MB, NB) accumulator tiles: A's rows at stride la, B's panel rows.
// A function, not a lambda inside dp_amx_block: clang does not give a lambda its enclosing
// function's target attribute, and its tile builtins need it.
template <int MB, int NB>
ATTN_AMX_FN inline void dp_amx_step(const uint16_t* a0, int64_t la, const uint16_t* b0) {
  constexpr int kPairRow = 2 * kDotPanel;  // bf16 per k pair of a panel
  _tile_loadd(4, a0, la * 2);
  _tile_loadd(6, b0, kPairRow * 2);
  if constexpr (NB == 2) _tile_loadd(7, b0 + 32, kPairRow * 2);
  if constexpr (MB == 2) _tile_loadd(5, a0 + 16 * la, la * 2);
  _tile_dpbf16ps(0, 4, 6);
  if constexpr (NB == 2) _tile_dpbf16ps(1, 4, 7);
  if constexpr (MB == 2) _tile_dpbf16ps(2, 5, 6);
  if constexpr (MB == 2 && NB == 2) _tile_dpbf16ps(3, 5, 7);
}

// C (16 MB, 16 NB) (+)= A (16 MB, K) @ B (K, 16 NB): k chunks [0, K32) in place (A stride lda, B
// one panel), then the padded chunk (at: 16 MB rows of 32; bt: 16 pair rows of a panel) where at
// is set. Rows [rows, 16 MB) of C are neither read nor stored.
template <int MB, int NB>
ATTN_AMX_FN inline void dp_amx_block(int K32, const uint16_t* a, int64_t lda, const uint16_t* b, const uint16_t* at,
                                     const uint16_t* bt, float* C, int64_t ldc, int rows, bool add) {
  constexpr int kPairRow = 2 * kDotPanel;  // bf16 per k pair of a panel
  // a part-full block goes through a (32, 32) copy (rows past `rows` neither read nor written back)
  alignas(64) float acc[32 * 32];
  const bool whole = rows == 16 * MB;
  float* c = whole ? C : acc;
  const int64_t ld = whole ? ldc : 32;
  if (add) {
    for (int r = 0; r < rows && !whole; ++r) std::memcpy(acc + r * 32, C + int64_t(r) * ldc, size_t(NB) * 64);
    amx_acc_load<MB, NB>(c, ld * 4);
  } else {
    amx_acc_zero<MB, NB>();
  }
  for (int k0 = 0; k0 < K32; k0 += kAmxDpK) dp_amx_step<MB, NB>(a + k0, lda, b + int64_t(k0 / 2) * kPairRow);
  if (at != nullptr) dp_amx_step<MB, NB>(at, kAmxDpK, bt);
  amx_acc_store<MB, NB>(c, ld * 4);
  for (int r = 0; r < rows && !whole; ++r) std::memcpy(C + int64_t(r) * ldc, acc + r * 32, size_t(NB) * 64);
}

// gemm_dp on AMX (add: C += A @ B): M <= 64 (the kernels' tiles have at most kBlockM rows),
// K <= 256 or a key tile (<= kBlockN), N <= 256.
ATTN_AMX_FN inline void gemm_dp_amx(int M, int N, int K, const uint16_t* A, int64_t lda, const uint16_t* B,
                                    int64_t bpanel, float* C, int64_t ldc, bool add = false) {
  constexpr int kMaxM = 64, kMaxK = 256, kMaxN = 256, kPairRow = 2 * kDotPanel;
  // unreachable: the callers' tiles (K even: gemm_dp's rule)
  if (M > kMaxM || K > kMaxK || N > kMaxN || K % 2 != 0) __builtin_trap();
  const int K32 = K / kAmxDpK * kAmxDpK, tail = K - K32;
  // the padded last chunk: A's (M, tail) and, per panel, B's tail / 2 pair rows
  alignas(64) uint16_t at[kMaxM * kAmxDpK];
  alignas(64) uint16_t bt[kMaxN / kDotPanel][16 * kPairRow];
  if (tail > 0) {
    std::memset(at, 0, sizeof(at));
    for (int m = 0; m < M; ++m) std::memcpy(at + m * kAmxDpK, A + m * lda + K32, size_t(tail) * 2);
    for (int n0 = 0; n0 < N; n0 += kDotPanel) {
      uint16_t* t = bt[n0 / kDotPanel];
      const size_t valid = size_t(tail / 2) * kPairRow;
      std::memcpy(t, B + int64_t(n0 / kDotPanel) * bpanel + int64_t(K32 / 2) * kPairRow, valid * 2);
      std::memset(t + valid, 0, (16 * kPairRow - valid) * 2);
    }
  }
  // a part-full row block's A, zero past M
  alignas(64) uint16_t ap[32 * kMaxK];
  const AmxCall tiles;
  for (int m0 = 0; m0 < M; m0 += 32) {
    const int rows = M - m0 < 32 ? M - m0 : 32;
    const uint16_t* a = A + m0 * lda;
    int64_t la = lda;
    if (rows % 16 != 0 && K32 > 0) {
      const int full = (rows + 15) / 16 * 16;
      for (int r = 0; r < full; ++r) {
        if (r < rows) {
          std::memcpy(ap + r * K32, a + r * lda, size_t(K32) * 2);
        } else {
          std::memset(ap + r * K32, 0, size_t(K32) * 2);
        }
      }
      a = ap;
      la = K32;
    }
    const uint16_t* am_t = tail > 0 ? at + m0 * kAmxDpK : nullptr;
    for (int n0 = 0; n0 < N; n0 += kDotPanel) {
      const uint16_t* b = B + int64_t(n0 / kDotPanel) * bpanel;
      const uint16_t* bt_n = bt[n0 / kDotPanel];
      float* c = C + int64_t(m0) * ldc + n0;
      const bool two = N - n0 >= kDotPanel;  // N is a multiple of 16: else one 16-column half
      if (rows > 16) {
        two ? dp_amx_block<2, 2>(K32, a, la, b, am_t, bt_n, c, ldc, rows, add)
            : dp_amx_block<2, 1>(K32, a, la, b, am_t, bt_n, c, ldc, rows, add);
      } else {
        two ? dp_amx_block<1, 2>(K32, a, la, b, am_t, bt_n, c, ldc, rows, add)
            : dp_amx_block<1, 1>(K32, a, la, b, am_t, bt_n, c, ldc, rows, add);
      }
    }
  }
}
// Rows [0, rows) of a float tile (row stride ld; n columns, a multiple of 32) in bf16 (round to
// nearest even, NaN kept), as the B operand of a product over those rows: kPairs' layout with
// blocks of R rows (panels of 32 columns, R / 2 pair rows (r, r + 1) a panel, the pair's two words
// side by side). An odd last row pairs with zeros. Two vcvtne2ps2bf16 and two vpermt2w per 64.
inline void rows_to_pairs(const float* src, int64_t ld, int rows, int n, uint16_t* dst, int R) {
  alignas(64) static const uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                               8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                               24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_load_si512(kHi);
  for (int r = 0; r < rows; r += 2) {
    const float* a = src + r * ld;
    const float* b = a + ld;
    for (int c = 0; c < n; c += 32) {
      const __m512i va = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(a + c + 16), _mm512_loadu_ps(a + c));
      const __m512i vb = r + 1 < rows
                             ? (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(b + c + 16), _mm512_loadu_ps(b + c))
                             : _mm512_setzero_si512();
      uint16_t* out = dst + int64_t(c / kDotPanel) * R * kDotPanel + (r / 2) * 2 * kDotPanel;
      _mm512_storeu_si512(out, _mm512_permutex2var_epi16(va, lo, vb));
      _mm512_storeu_si512(out + 32, _mm512_permutex2var_epi16(va, hi, vb));
    }
  }
}
#endif

// Whether gemm_dp_add runs here (AMX): C += A @ B in the accumulator tiles, uncompensated
inline bool gemm_dp_adds() {
#if defined(ATTN_AMX)
  return amx();
#else
  return false;
#endif
}

// C (M, N) += A (M, K) @ B (K, N) where gemm_dp_adds(); not called elsewhere
inline void gemm_dp_add(int M, int N, int K, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t bpanel,
                        float* C, int64_t ldc) {
#if defined(ATTN_AMX)
  gemm_dp_amx(M, N, K, A, lda, B, bpanel, C, ldc, true);
#else
  (void)M, (void)N, (void)K, (void)A, (void)lda, (void)B, (void)bpanel, (void)C, (void)ldc;
  __builtin_trap();
#endif
}

// C (M, N) = A (M, K) @ B (K, N), float32 out, in the pairs layouts above; K even, N a multiple
// of 16. Each element is summed over k pairs in order, one vdpbf16ps step per pair (AMX: tiles
// of 32, above).
inline void gemm_dp(int M, int N, int K, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t bpanel,
                    float* C, int64_t ldc) {
#if defined(__AVX512BF16__)
#if defined(ATTN_AMX)
  if (amx()) return gemm_dp_amx(M, N, K, A, lda, B, bpanel, C, ldc);
#endif
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
#if defined(ATTN_AMX)
  // AMX's sums are not dp_step's: each row is redone by the tiles, on a copy of B whose rows k
  // with skip(m, k) are zero (a term 0 x 0, where gemm_dp had 0 x a finite number: the same sum)
  if (amx()) {
    constexpr int kPairRow = 2 * kDotPanel;
    const int panels = (N + kDotPanel - 1) / kDotPanel, pair_rows = (K + 1) / 2;
    std::vector<uint16_t> b(size_t(panels) * pair_rows * kPairRow);
    for (int m = 0; m < M; ++m) {
      for (int pn = 0; pn < panels; ++pn) {
        uint16_t* dst = b.data() + size_t(pn) * pair_rows * kPairRow;
        std::memcpy(dst, B + int64_t(pn) * bpanel, size_t(pair_rows) * kPairRow * 2);
        for (int k = 0; k < K; ++k) {
          if (!skip(m, k)) continue;
          for (int c = 0; c < kDotPanel; ++c) dst[(k / 2) * kPairRow + c * 2 + k % 2] = 0;
        }
      }
      gemm_dp_amx(1, N, K, A + int64_t(m) * lda, lda, b.data(), int64_t(pair_rows) * kPairRow, C + int64_t(m) * ldc,
                  ldc);
    }
    return;
  }
#endif
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
