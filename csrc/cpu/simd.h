// SIMD building blocks for the CPU kernels: one portable vector type, a vector exp, dtype
// conversion, and the register-blocked GEMM micro-kernel every attention product runs on.
//
// The vector type is a GCC/Clang vector extension, so one source compiles to AVX-512, AVX2 or
// SSE as -march allows (no intrinsics per ISA to keep in sync). Width W floats: 16 with
// AVX-512F, else 8 (two SSE registers when AVX is off).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "../common/params.h"

#if defined(__F16C__) || defined(__AVX__)
#include <immintrin.h>
#endif

namespace attn {
namespace cpu {

#if defined(__AVX512F__)
constexpr int W = 16;
#else
constexpr int W = 8;
#endif

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));

inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
inline vf vbcast(float x) { return vf{} + x; }
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
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
  return m;
}
inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}

// 2^x for the softmax, where x = (s - max) * log2(e) <= 0: no overflow handling, and the clamp at
// -127 makes the exponent field 0, so 2^-inf = 0 exactly (masked scores). NaN stays NaN.
// Round-to-nearest split x = n + r, r in [-1/2, 1/2], and a degree-5 polynomial fitted for
// relative error on that interval (max 7.7e-8, about float32 epsilon): about 14 vector ops
// (a general exp with range checks takes about 25). At D = 64 the exp costs about as much as
// the two matmuls, so every op counts.
inline vf vexp2_nonpos(vf x) {
  x = x < -127.f ? vbcast(-127.f) : x;
  const vf magic = vbcast(12582912.f);
  vf n = (x + magic) - magic;
  vf r = x - n;
  vf p = vbcast(1.326697993e-3f);
  p = p * r + 9.675469400e-3f;
  p = p * r + 5.550742675e-2f;
  p = p * r + 2.402212158e-1f;
  p = p * r + 6.931469491e-1f;
  p = p * r + 1.000000071f;
  vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return p * scale;
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

// Row of n elements of dtype dt -> float32, zero-filled up to n_pad.
inline void load_row(DType dt, const void* src, float* dst, int n, int n_pad) {
  if (dt == DType::kF32) {
    std::memcpy(dst, src, sizeof(float) * n);
  } else if (dt == DType::kBF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
  }
  for (int i = n; i < n_pad; ++i) dst[i] = 0.f;
}

inline void store_row(DType dt, const float* src, void* dst, int n) {
  if (dt == DType::kF32) {
    std::memcpy(dst, src, sizeof(float) * n);
  } else if (dt == DType::kBF16) {
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
  } else {
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int i = 0; i < n; ++i) d[i] = f32_to_f16(src[i]);
  }
}

inline size_t dtype_size(DType dt) { return dt == DType::kF32 ? 4 : 2; }

inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

// ---------------------------------------------------------------------------------- GEMM
// C (M, N) (+)= A (M, K) @ B (K, N); all row-major float32, N a multiple of W. With kTransA the
// A operand is stored transposed, (K, M) with leading dimension lda: the backward's P^T dO and
// dS^T Q then read P and dS in place instead of transposing them first.
//
// Register blocking: kMR rows x 2 vectors of C live in registers while k runs, so each step
// loads 2 vectors of B and broadcasts kMR scalars of A for 2 * kMR FMAs. kMR = 6 fills 12 of
// AVX2's 16 ymm registers (the classic 6x16 sgemm kernel); AVX-512 has room for the same shape
// at twice the width.
constexpr int kMR = 6;

template <int MR, int NV, bool kAccumulate, bool kTransA>
inline void micro_kernel(int K, const float* __restrict__ A, int64_t lda, const float* __restrict__ B,
                         int64_t ldb, float* __restrict__ C, int64_t ldc) {
  vf acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = kAccumulate ? vload(C + r * ldc + v * W) : vf{};
  }
  for (int k = 0; k < K; ++k) {
    vf b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = vload(B + k * ldb + v * W);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      vf a = vbcast_mem(kTransA ? A + k * lda + r : A + r * lda + k);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] += a * b[v];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) vstore(C + r * ldc + v * W, acc[r][v]);
  }
}

template <int NV, bool kAccumulate, bool kTransA>
inline void micro_rows(int mr, int K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                       int64_t ldc) {
  switch (mr) {
    case 6: micro_kernel<6, NV, kAccumulate, kTransA>(K, A, lda, B, ldb, C, ldc); break;
    case 5: micro_kernel<5, NV, kAccumulate, kTransA>(K, A, lda, B, ldb, C, ldc); break;
    case 4: micro_kernel<4, NV, kAccumulate, kTransA>(K, A, lda, B, ldb, C, ldc); break;
    case 3: micro_kernel<3, NV, kAccumulate, kTransA>(K, A, lda, B, ldb, C, ldc); break;
    case 2: micro_kernel<2, NV, kAccumulate, kTransA>(K, A, lda, B, ldb, C, ldc); break;
    default: micro_kernel<1, NV, kAccumulate, kTransA>(K, A, lda, B, ldb, C, ldc); break;
  }
}

template <bool kAccumulate, bool kTransA = false>
inline void gemm(int M, int N, int K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                 int64_t ldc) {
  // n outer, m inner: the (K, 2W) panel of B stays in L1 while A's rows stream past it
  for (int n0 = 0; n0 < N; n0 += 2 * W) {
    const bool two = N - n0 >= 2 * W;
    for (int m0 = 0; m0 < M; m0 += kMR) {
      const int mr = M - m0 < kMR ? M - m0 : kMR;
      const float* a = kTransA ? A + m0 : A + m0 * lda;
      if (two) {
        micro_rows<2, kAccumulate, kTransA>(mr, K, a, lda, B + n0, ldb, C + m0 * ldc + n0, ldc);
      } else {
        micro_rows<1, kAccumulate, kTransA>(mr, K, a, lda, B + n0, ldb, C + m0 * ldc + n0, ldc);
      }
    }
  }
}

}  // namespace cpu
}  // namespace attn
