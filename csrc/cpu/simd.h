// SIMD building blocks for the CPU kernels: one portable vector type, a vector exp, dtype
// conversion, and the register-blocked GEMM micro-kernel every attention product runs on.
//
// The vector type is a GCC/Clang vector extension, so one source compiles to AVX-512, AVX2 or
// SSE as -march allows (no intrinsics per ISA to keep in sync). Width W floats: one register,
// 16 with AVX-512F, 8 with AVX, 4 on x86 below AVX (SSE2, the portable base level). A vector
// wider than the registers is lowered poorly (split ops, vectors passed through memory): an
// 8-float type on SSE2 ran the forward many times slower than AVX2
// (benchmarks/results/2026-11-25-cpu-isa.md). Other targets (AArch64: NEON is
// 4 floats) keep 8, two registers.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/softmax_params.h"
#include "cpu/isa.h"

#if defined(__F16C__) || defined(__AVX__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace attn {
namespace cpu {
ATTN_CPU_ISA_BEGIN

#if defined(__AVX512F__)
constexpr int W = 16;
#elif defined(__AVX__) || !(defined(__x86_64__) || defined(__i386__))
constexpr int W = 8;
#else
constexpr int W = 4;
#endif
constexpr int kVecBytes = W * 4;

// One vector register of T: W floats, or W / 2 doubles for the float64 path. Rows are padded
// to W floats, which is a whole number of vectors of either type.
template <typename T>
struct VecOf {
  typedef T type __attribute__((vector_size(kVecBytes)));
};
template <typename T>
using vec = typename VecOf<T>::type;
template <typename T>
constexpr int kLanes = kVecBytes / int(sizeof(T));

typedef vec<float> vf;
typedef int32_t vi __attribute__((vector_size(kVecBytes)));

template <typename T>
inline vec<T> vload(const T* p) {
  vec<T> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <typename T>
inline void vstore(T* p, vec<T> v) { std::memcpy(p, &v, sizeof(v)); }
template <typename T>
inline vec<T> vbcast(T x) { return vec<T>{} + x; }
// Broadcast straight from memory: one load-port uop. A register broadcast would take a shuffle
// port that, on Zen, is shared with an FMA pipe and caps the micro-kernel near 2/3 of peak.
inline vf vbcast_mem(const float* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_set1_ps(*p);
#elif defined(__AVX__)
  return (vf)_mm256_broadcast_ss(p);
#else
  return vbcast(*p);
#endif
}
inline vec<double> vbcast_mem(const double* p) {
#if defined(__AVX512F__)
  return (vec<double>)_mm512_set1_pd(*p);
#elif defined(__AVX__)
  return (vec<double>)_mm256_broadcast_sd(p);
#else
  return vbcast(*p);
#endif
}
template <typename V>
inline V vmax(V a, V b) { return a > b ? a : b; }
// horizontal max / sum of any vec<T>; returns T. hsum adds lane by lane (a chain of as many
// adds as lanes; the order the float64 / linear paths were validated with); hmax and hsum_tree
// halve the vector log2(lanes) times (shuffle + op), for reductions once per row and tile,
// where the chain's latency showed in profiles (16 lanes at AVX-512).
template <typename V>
inline auto hmax(V v) {
  // lane i against lane i + w for w = lanes / 2 .. 1: a NaN in the lower lane is kept, in the
  // upper one dropped (maxps(a, b) is a > b ? a : b, the scalar loop's expression). float in
  // registers: a stack array made a chain of scalar maxes, and halves through memcpy a store the
  // next load could not forward from (that one slowed the forward:
  // benchmarks/results/2026-11-29-small-calls-cpu-zen5.md).
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<V, vec<float>>) {
    const __m512 x = (__m512)v;
    const __m256 m8 = _mm256_max_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)),
                                    _mm512_castps512_ps256(x));
    const __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m8, 1), _mm256_castps256_ps128(m8));
    const __m128 m2 = _mm_max_ps(_mm_movehl_ps(m4, m4), m4);
    return _mm_cvtss_f32(_mm_max_ss(_mm_movehdup_ps(m2), m2));
  }
#elif defined(__AVX__)
  if constexpr (std::is_same_v<V, vec<float>>) {
    const __m256 x = (__m256)v;
    const __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    const __m128 m2 = _mm_max_ps(_mm_movehl_ps(m4, m4), m4);
    return _mm_cvtss_f32(_mm_max_ss(_mm_movehdup_ps(m2), m2));
  }
#endif
  using E = decltype(v[0] + 0);
  constexpr int n = int(sizeof(V) / sizeof(E));
  E a[n];
  std::memcpy(a, &v, sizeof(v));
  for (int w = n / 2; w >= 1; w /= 2) {
    for (int i = 0; i < w; ++i) a[i] = a[i + w] > a[i] ? a[i + w] : a[i];
  }
  return a[0];
}
template <typename V>
inline auto hsum(V v) {
  decltype(v[0] + 0) s = 0;
  for (int i = 0; i < int(sizeof(V) / sizeof(s)); ++i) s += v[i];
  return s;
}
template <typename V>
inline auto hsum_tree(V v) {
#if defined(__AVX__) && !defined(__AVX512F__)
  if constexpr (std::is_same_v<V, vec<float>>) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
  }
#endif
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<V, vec<float>>) return _mm512_reduce_add_ps((__m512)v);
#endif
  return hsum(v);
}
// x . y over n elements: one vector of partial sums, its lanes added in order (hsum), then the
// scalar tail past the last whole vector (none for rows padded to the lanes).
template <typename T>
inline T dot(const T* x, const T* y, int n) {
  vec<T> acc{};
  int i = 0;
  for (; i + kLanes<T> <= n; i += kLanes<T>) acc += vload(x + i) * vload(y + i);
  T s = hsum(acc);
  for (; i < n; ++i) s += x[i] * y[i];
  return s;
}
#if defined(__AVX__) && !defined(__AVX512F__)
// The first two levels of hsum4 / hsum8's tree for r[0..3]: adjacent lane pairs, then pairs of
// pairs, within each 128-bit half: lane x of the low half holds row x's lanes 0-3 summed, lane
// x of the high half its lanes 4-7.
inline __m256 hadd_pairs4(const vf* r) {
  return _mm256_hadd_ps(_mm256_hadd_ps((__m256)r[0], (__m256)r[1]), _mm256_hadd_ps((__m256)r[2], (__m256)r[3]));
}
#endif
// out[x] = the lane sum of r[x], four float vectors at once: the reductions share their
// shuffles (AVX2: three hadds and one add; AVX-512: five shuffles and six adds), where four
// hsum_tree calls take four times log2(lanes) shuffle + add pairs. A dot product per
// (key, row), as in the decode kernel, spends as long on these sums as on its FMAs at D = 128.
// Returns false, writing nothing, where the ISA has no shared form (the caller sums each).
inline bool hsum4(const vf* r, float* out) {
#if defined(__AVX512F__)
  // quarters (128 bits) of r0 and r1 folded into [r0: 8 lanes | r1: 8 lanes]; then both halves
  // into one vector whose quarter x holds row x's 4 partial sums; then within each quarter
  const __m512 r0 = (__m512)r[0], r1 = (__m512)r[1], r2 = (__m512)r[2], r3 = (__m512)r[3];
  const __m512 u01 = _mm512_add_ps(_mm512_shuffle_f32x4(r0, r1, 0x44), _mm512_shuffle_f32x4(r0, r1, 0xEE));
  const __m512 u23 = _mm512_add_ps(_mm512_shuffle_f32x4(r2, r3, 0x44), _mm512_shuffle_f32x4(r2, r3, 0xEE));
  __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, 0x88), _mm512_shuffle_f32x4(u01, u23, 0xDD));
  w = _mm512_add_ps(w, _mm512_permute_ps(w, 0x4E));  // lanes (2 3 0 1) of each quarter
  w = _mm512_add_ps(w, _mm512_permute_ps(w, 0xB1));  // lanes (1 0 3 2)
  _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), w)));
  return true;
#elif defined(__AVX__)
  const __m256 t = hadd_pairs4(r);  // lanes (0 1 2 3) low half, (0 1 2 3) high half
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
  return true;
#else
  (void)r;
  (void)out;
  return false;
#endif
}

// *out = (the lane sums of r[0], ..., r[7]): eight 8-lane float vectors reduced into one, in
// lane order, through six hadds, two cross-half permutes and one add (AVX without AVX-512): under
// one instruction per sum, where hsum4 takes five for four. Each sum follows hsum4's tree
// (adjacent lane pairs, then pairs of pairs, then the two 128-bit halves). Returns false,
// writing nothing, where vf is not eight floats.
inline bool hsum8(const vf* r, vf* out) {
#if defined(__AVX__) && !defined(__AVX512F__)
  const __m256 u0 = hadd_pairs4(r);      // (r0..r3 lanes 0-3 | r0..r3 lanes 4-7)
  const __m256 u1 = hadd_pairs4(r + 4);  // (r4..r7 lanes 0-3 | r4..r7 lanes 4-7)
  *out = (vf)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  return true;
#endif
  (void)r, (void)out;
  return false;
}

// 2^x for the softmax, where x = (s - max) * log2(e) <= 0: no overflow handling, and the clamp at
// -127 makes the exponent field 0, so 2^-inf = 0 exactly (masked scores). NaN stays NaN.
// Round-to-nearest split x = n + r, r in [-1/2, 1/2], and a degree-5 polynomial fitted for
// relative error on that interval (max 7.7e-8 with its fitted constant 1.000000071; the constant
// is 1 exactly instead, which adds at most 7.1e-8 and makes 2^0 = 1): about 14 vector ops, 10 at
// AVX-512 (a general exp with range checks takes about 25). At D = 64 the exp costs about as much
// as the two matmuls, so every op counts.
inline vf vexp2_nonpos(vf x) {
#if defined(__AVX512F__)
  // AVX-512: no clamp, and vscalefps for the scale (one op for cvt, add, shift and multiply):
  // lanes with n <= -127 (-inf included, whose r is NaN) are zeroed by the compare's mask, and
  // NaN's n compares unordered, so it stays NaN. The same bits as the form below for every float
  // <= 0 and the specials (checked exhaustively over [-200, 0]). The empty asm materializes x:
  // with no clamp in between, the compiler would contract the caller's x = d * log2e into
  // r = x - n (one FMA from the unrounded product), and the bits would differ.
  asm("" : "+v"(x));
  const vf magic = vbcast(12582912.f);
  const vf n = (x + magic) - magic;
#else
  x = x < -127.f ? vbcast(-127.f) : x;
  const vf magic = vbcast(12582912.f);
  vf n = (x + magic) - magic;
#endif
  vf r = x - n;
  vf p = vbcast(1.326697993e-3f);
  p = p * r + 9.675469400e-3f;
  p = p * r + 5.550742675e-2f;
  p = p * r + 2.402212158e-1f;
  p = p * r + 6.931469491e-1f;
  p = p * r + 1.f;  // exactly 1 at r = 0: exp2(0) = 1, so a lone visible key gets P = 1 exactly
#if defined(__AVX512F__)
  const __mmask16 live = _mm512_cmp_ps_mask(__m512(n), _mm512_set1_ps(-127.f), _CMP_NLE_UQ);
  return vf(_mm512_maskz_scalef_ps(live, __m512(p), __m512(n)));
#else
  vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return p * scale;
#endif
}
// The float64 path is for accuracy (gradcheck, numerics work), not speed: libm's exp2 per lane.
inline vec<double> vexp2_nonpos(vec<double> x) {
  for (int i = 0; i < kLanes<double>; ++i) x[i] = std::exp2(x[i]);
  return x;
}

// (0, 1, ..., lanes - 1) as a vec<T>: column indices for masks built with vector compares.
template <typename T>
inline vec<T> lane_index() {
  vec<T> v;
  for (int i = 0; i < kLanes<T>; ++i) v[i] = T(i);
  return v;
}

// Bit u set: lane u of a vector compare's mask is true (AVX: one movemask), for scans that
// visit the few lanes a compare selects.
template <typename M>
inline uint32_t lane_bits(M m) {
#if defined(__AVX512F__)
  // a test into a mask register; the generic loop below extracts 16 lanes one by one (it was a
  // third of a masked forward's softmax time at AVX-512)
  if constexpr (sizeof(M) == 64 && sizeof(m[0]) == 4) return uint32_t(_mm512_test_epi32_mask(__m512i(m), __m512i(m)));
  if constexpr (sizeof(M) == 64 && sizeof(m[0]) == 8) return uint32_t(_mm512_test_epi64_mask(__m512i(m), __m512i(m)));
#elif defined(__AVX__)
  if constexpr (sizeof(M) == 32 && sizeof(m[0]) == 4) return uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(__m256i(m))));
  if constexpr (sizeof(M) == 32 && sizeof(m[0]) == 8) return uint32_t(_mm256_movemask_pd(_mm256_castsi256_pd(__m256i(m))));
#elif defined(__SSE2__) && !defined(__AVX__)
  if constexpr (sizeof(M) == 16 && sizeof(m[0]) == 4) return uint32_t(_mm_movemask_ps(_mm_castsi128_ps(__m128i(m))));
  if constexpr (sizeof(M) == 16 && sizeof(m[0]) == 8) return uint32_t(_mm_movemask_pd(_mm_castsi128_pd(__m128i(m))));
#endif
  uint32_t bits = 0;
  for (int u = 0; u < int(sizeof(M) / sizeof(m[0])); ++u) bits |= (m[u] != 0 ? 1u : 0u) << u;
  return bits;
}

// dst (cols, ld_dst) <- src (rows, cols)^T, src row stride ld_src; dst columns [rows, ld_dst)
// are set to 0 unless keep_rest (a transpose into part of a wider panel). Float blocks of 8 x 8 go through registers (AVX: 24 shuffles per 64 elements);
// a scalar transpose of a strided operand costs about a third of the small products it feeds.
// Sizes that are not whole blocks, and doubles, take the scalar loop.
template <typename T>
inline void transpose(const T* src, int rows, int cols, int64_t ld_src, T* dst, int64_t ld_dst,
                      bool keep_rest = false) {
  int r0 = 0;
#if defined(__AVX__)
  if constexpr (std::is_same<T, float>::value) {
    if (cols % 8 == 0) {
      for (; r0 + 8 <= rows; r0 += 8) {
        for (int c0 = 0; c0 < cols; c0 += 8) {
          const float* s = src + int64_t(r0) * ld_src + c0;
          __m256 r[8], t[8];
          for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(s + i * ld_src);
          for (int i = 0; i < 8; i += 2) {
            t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
            t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
          }
          for (int i = 0; i < 8; i += 4) {
            r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
            r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
            r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
            r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
          }
          float* d = dst + int64_t(c0) * ld_dst + r0;
          for (int i = 0; i < 4; ++i) {
            _mm256_storeu_ps(d + i * ld_dst, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
            _mm256_storeu_ps(d + (i + 4) * ld_dst, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
          }
        }
      }
    }
  }
#endif
  for (int c = 0; c < cols; ++c) {
    T* d = dst + int64_t(c) * ld_dst;
    for (int r = r0; r < rows; ++r) d[r] = src[int64_t(r) * ld_src + c];
    if (!keep_rest) {
      for (int r = rows; r < ld_dst; ++r) d[r] = T(0);
    }
  }
}

// ---------------------------------------------------------------------------------- dtypes
inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return uint16_t(u >> 16);
}
inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: renormalize
      exp = 127 - 15 + 1;
      while ((man & 0x400u) == 0) {
        man <<= 1;
        --exp;
      }
      u = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
inline uint16_t f32_to_f16(float f) {
#if defined(__F16C__)
  return _cvtss_sh(f, 0);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000u;
  int32_t exp = int32_t((u >> 23) & 0xff) - 127 + 15;
  uint32_t man = u & 0x7fffffu;
  if (((u >> 23) & 0xff) == 0xff) return uint16_t(sign | 0x7c00u | (man ? 0x200u : 0u));
  if (exp >= 31) return uint16_t(sign | 0x7c00u);
  if (exp <= 0) {
    if (exp < -10) return uint16_t(sign);
    man |= 0x800000u;
    uint32_t shift = uint32_t(14 - exp);
    uint32_t half = man >> shift, rem = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return uint16_t(sign | half);
  }
  uint32_t half = sign | (uint32_t(exp) << 10) | (man >> 13);
  uint32_t rem = man & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) ++half;
  return uint16_t(half);
#endif
}

// Row of n elements of dtype dt -> T (float, or double for DType::kF64), zero-filled up to
// n_pad. bf16 / fp16 only ever load into float.
// Plain loops, not memcpy, for the float32 / float64 rows: a row is a few hundred bytes, where a
// libc memcpy call costs more than the copy (the delta rule's forward, which loads a q, k and v
// row per token, ran 1.8x slower through memcpy on Zen 5: benchmarks/results/2026-11-29-delta-cpu.md).
template <typename T>
inline void load_row(DType dt, const void* src, T* dst, int n, int n_pad) {
  if (dt == DType::kF32 || dt == DType::kF64) {
    const T* s = static_cast<const T*>(src);
    for (int i = 0; i < n; ++i) dst[i] = s[i];
  } else if (dt == DType::kBF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    int i = 0;
#if defined(__F16C__)
    if constexpr (std::is_same_v<T, float>) {  // 8 at a time (one vcvtph2ps), not one per call
      for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
    }
#endif
    for (; i < n; ++i) dst[i] = f16_to_f32(s[i]);
  }
  for (int i = n; i < n_pad; ++i) dst[i] = T(0);
}

template <typename T>
inline void store_row(DType dt, const T* src, void* dst, int n) {
  if (dt == DType::kF32 || dt == DType::kF64) {
    T* d = static_cast<T*>(dst);
    for (int i = 0; i < n; ++i) d[i] = src[i];
  } else if (dt == DType::kBF16) {
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int i = 0; i < n; ++i) d[i] = f32_to_bf16(float(src[i]));
  } else {
    uint16_t* d = static_cast<uint16_t*>(dst);
    int i = 0;
#if defined(__F16C__)
    if constexpr (std::is_same_v<T, float>) {  // round to nearest even, as _cvtss_sh(f, 0)
      for (; i + 8 <= n; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), 0));
    }
#endif
    for (; i < n; ++i) d[i] = f32_to_f16(float(src[i]));
  }
}

inline size_t dtype_size(DType dt) { return dt == DType::kF64 ? 8 : (dt == DType::kF32 ? 4 : 2); }

inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

// ---------------------------------------------------------------------------------- GEMM
// C (M, N) (+)= A (M, K) @ B (K, N) in T (float, or double on the float64 path); A and C
// row-major, N a multiple of kLanes<T>. With kTransA the A operand is stored transposed, (K, M)
// with leading dimension lda: the backward's P^T dO and dS^T Q then read P and dS in place
// instead of transposing them first.
//
// B is read in panels of kPanel<T> = 2 vectors of columns: element (k, n) is at
// B[(n / kPanel) * bpanel + k * ldb + n % kPanel]. A row-major B is ldb = its row stride,
// bpanel = kPanel; the packed operands of pack.h are ldb = kPanel, bpanel = the panel's size, so
// the micro-kernel streams one contiguous panel, which measured faster
// (benchmarks/results/2026-11-29-figures-from-comments.md).
//
// Register blocking: kMR rows x 2 vectors of C live in registers while k runs, so each step
// loads 2 vectors of B and broadcasts kMR scalars of A for 2 * kMR FMAs. kMR = 6 fills 12 of
// AVX2's 16 ymm registers (the classic 6x16 sgemm kernel); AVX-512 has room for the same shape
// at twice the width.
constexpr int kMR = 6;
template <typename T>
constexpr int kPanel = 2 * kLanes<T>;

// The part of a square causal block a product touches (indices from 0 on the diagonal), so that
// a masked (n, n) tile costs about half a full one (gemm's kTri):
enum class Tri {
  kFull,
  kLowerC,   // only C[i][j], j <= i is wanted: column panels wholly above the diagonal are skipped
             // (left unwritten; the caller's mask zeroes them)
  kLowerA,   // A[i][k] = 0 for k > i: row i's sum stops at k = i (M <= K)
  kUpperAT,  // kTransA with A^T[i][k] = 0 for k < i (A lower): row i's sum starts at k = i (M <= K)
};
// kLowerA and kUpperAT never read A's masked triangle, not even the zeros inside a row block's
// (kMR, kMR) diagonal corner: 0 times a NaN or inf row of B is NaN, so a value at position t
// would reach the rows of the block that do not read t (the linear kernels' A V', P K~, P^T Q~
// and A^T dO'). The corner takes its k steps one by one, each on the rows that own it, which is
// also fewer FMAs than the full (kMR, kMR) block it replaces.

template <int MR, int NV, bool kAccumulate, bool kTransA, Tri kTri, typename T>
inline void micro_kernel(int K, const T* __restrict__ A, int64_t lda, const T* __restrict__ B, int64_t ldb,
                         T* __restrict__ C, int64_t ldc) {
  constexpr int L = kLanes<T>;
  // the (MR, MR) corner: the first MR of the K steps for kUpperAT (row r from step r on), the
  // last MR for kLowerA (row r up to step r); the steps [k0, k1) are full
  constexpr bool kHead = kTri == Tri::kUpperAT, kTail = kTri == Tri::kLowerA;
  static_assert(!kHead || kTransA, "kUpperAT reads A transposed");
  const int k0 = kHead ? MR : 0, k1 = kTail ? K - MR : K;
  vec<T> acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = kAccumulate ? vload(C + r * ldc + v * L) : vec<T>{};
  }
  if constexpr (kHead) {
#pragma GCC unroll 8
    for (int k = 0; k < MR; ++k) {
      vec<T> b[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) b[v] = vload(B + k * ldb + v * L);
#pragma GCC unroll 8
      for (int r = 0; r <= k; ++r) {
        vec<T> a = vbcast_mem(A + k * lda + r);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[r][v] += a * b[v];
      }
    }
  }
  for (int k = k0; k < k1; ++k) {
    vec<T> b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = vload(B + k * ldb + v * L);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      vec<T> a = vbcast_mem(kTransA ? A + k * lda + r : A + r * lda + k);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] += a * b[v];
    }
  }
  if constexpr (kTail) {
#pragma GCC unroll 8
    for (int kk = 0; kk < MR; ++kk) {
      const int k = k1 + kk;
      vec<T> b[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) b[v] = vload(B + k * ldb + v * L);
#pragma GCC unroll 8
      for (int r = kk; r < MR; ++r) {
        vec<T> a = vbcast_mem(kTransA ? A + k * lda + r : A + r * lda + k);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[r][v] += a * b[v];
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) vstore(C + r * ldc + v * L, acc[r][v]);
  }
}

// f(std::integral_constant<int, m>{}) for the row count m = clamp(mr, 1, kMax): the micro-kernels'
// remainder blocks, each a compile-time row count (the accumulators stay in registers).
template <int kMax, typename F>
inline void rows_switch(int mr, F&& f) {
  if constexpr (kMax > 1) {
    if (mr < kMax) return rows_switch<kMax - 1>(mr, f);
  }
  f(std::integral_constant<int, kMax>{});
}

template <int NV, bool kAccumulate, bool kTransA, Tri kTri, typename T>
inline void micro_rows(int mr, int K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc) {
  rows_switch<kMR>(mr, [&](auto m) { micro_kernel<decltype(m)::value, NV, kAccumulate, kTransA, kTri>(K, A, lda, B, ldb, C, ldc); });
}

template <bool kAccumulate, bool kTransA = false, Tri kTri = Tri::kFull, typename T>
inline void gemm(int M, int N, int K, const T* A, int64_t lda, const T* B, int64_t ldb, int64_t bpanel, T* C,
                 int64_t ldc) {
  constexpr int P = kPanel<T>;
  // the micro-kernel's corner: kLowerA and kUpperAT (kLowerC takes whole blocks)
  constexpr Tri kCorner = kTri == Tri::kLowerC ? Tri::kFull : kTri;
  // n outer, m inner: the (K, P) panel of B stays in L1 while A's rows stream past it
  for (int n0 = 0; n0 < N; n0 += P) {
    const T* b = B + int64_t(n0 / P) * bpanel;
    // kLowerC: the first row block that reaches column n0
    for (int m0 = kTri == Tri::kLowerC ? n0 / kMR * kMR : 0; m0 < M; m0 += kMR) {
      const int mr = M - m0 < kMR ? M - m0 : kMR;
      int k0 = 0, k1 = K;
      if (kTri == Tri::kLowerA) k1 = m0 + mr;  // the block's last row stops at its own k
      if (kTri == Tri::kUpperAT) k0 = m0;      // its first row starts at its own k
      const T* a = kTransA ? A + m0 + int64_t(k0) * lda : A + m0 * lda + k0;
      const T* bk = b + int64_t(k0) * ldb;
      if (N - n0 >= P) {
        micro_rows<2, kAccumulate, kTransA, kCorner>(mr, k1 - k0, a, lda, bk, ldb, C + m0 * ldc + n0, ldc);
      } else {
        micro_rows<1, kAccumulate, kTransA, kCorner>(mr, k1 - k0, a, lda, bk, ldb, C + m0 * ldc + n0, ldc);
      }
    }
  }
}

// C (M, N) = A (M, K) @ B as gemm<kAccumulate, kTransA> computes it (B in gemm's panel layout, N
// a multiple of kPanel; kAccumulate: C += the product; kTransA: A is read as (K, M) with row
// stride lda), leaving out the terms k of row m where skip(m, k). Each element is summed over k
// in order from 0 (or from C), one multiply-add per term, as micro_kernel does, so where the
// skipped terms are zero times a finite number the result is gemm's bit for bit. The softmax
// kernels call it only where gemm's product would put 0 x NaN (or 0 x inf) into a row or key the
// operand never reaches: a key hidden from a row has P = 0 (dS = 0), and if the key's V (K) row,
// or the row's dO (Q), holds a NaN or an inf, gemm's 0 * NaN would make the product NaN there.
template <bool kAccumulate = false, bool kTransA = false, typename T, typename Skip>
inline void gemm_skipping(int M, int N, int K, const T* A, int64_t lda, const T* B, int64_t ldb, int64_t bpanel,
                          T* C, int64_t ldc, Skip&& skip) {
  constexpr int L = kLanes<T>, P = kPanel<T>;
  for (int m = 0; m < M; ++m) {
    for (int n0 = 0; n0 < N; n0 += P) {
      const T* b = B + int64_t(n0 / P) * bpanel;
      vec<T> acc0 = kAccumulate ? vload(C + m * ldc + n0) : vec<T>{};
      vec<T> acc1 = kAccumulate ? vload(C + m * ldc + n0 + L) : vec<T>{};
      for (int k = 0; k < K; ++k) {
        if (skip(m, k)) continue;
        const vec<T> a = vbcast_mem(kTransA ? A + int64_t(k) * lda + m : A + m * lda + k);
        acc0 += a * vload(b + k * ldb);
        acc1 += a * vload(b + k * ldb + L);
      }
      vstore(C + m * ldc + n0, acc0);
      vstore(C + m * ldc + n0 + L, acc1);
    }
  }
}

// True when any of x (n, a multiple of the vector width) is NaN.
template <typename T>
inline bool any_nan(const T* x, int64_t n) {
  auto bad = vload(x) != vload(x);
  for (int64_t i = kLanes<T>; i < n; i += kLanes<T>) bad |= vload(x + i) != vload(x + i);
  return lane_bits(bad) != 0;
}
// True when any of x (n, a multiple of the vector width) is NaN or +-inf (x - x is NaN there).
template <typename T>
inline bool any_nonfinite(const T* x, int64_t n) {
  auto diff = [&](int64_t i) { return vload(x + i) - vload(x + i); };
  auto bad = diff(0) != diff(0);
  for (int64_t i = kLanes<T>; i < n; i += kLanes<T>) bad |= diff(i) != diff(i);
  return lane_bits(bad) != 0;
}

// ---------------------------------------------------------------- compensated running sums
// The softmax kernels' running sums over a row's keys (the denominator l and the output O)
// take one term per key block, for as many blocks as the row has keys. Added plainly, a float32
// sum loses the low bits of every term, and its error grows with the row length: past 2^24
// keys of weight 1, each + 1 rounds away entirely. So each block's keys are summed on their
// own (a block-local accumulator: a tile of kBlockN keys, a few decode chunks) and the block's
// total joins the running sum through Kahan's compensated addition: s holds the sum and c the
// part of it that rounding lost, negated (the value is s - c), so the error stays that of one
// block plus a few ulps whatever the row length. Both scale together when the running max
// moves. NaN propagates; a sum that overflows turns into NaN (c = inf - inf) instead of inf.
// The kernels are built without -ffast-math, which would fold c to 0.
template <typename T>
inline void kahan_add(T& s, T& c, T x) {
  const T y = x - c;
  const T t = s + y;
  c = (t - s) - y;
  s = t;
}
// s (n) += x (n) with compensation c (n), n a multiple of the vector width
template <typename T>
inline void kahan_add(T* s, T* c, const T* x, int n) {
  for (int i = 0; i < n; i += kLanes<T>) {
    const vec<T> y = vload(x + i) - vload(c + i);
    const vec<T> s0 = vload(s + i);
    const vec<T> t = s0 + y;
    vstore(c + i, (t - s0) - y);
    vstore(s + i, t);
  }
}

ATTN_CPU_ISA_END
}  // namespace cpu
}  // namespace attn
