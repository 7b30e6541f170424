// fp8 e4m3 (torch.float8_e4m3fn: no infinities, S.1111.111 NaN) to and from float32: the decoding
// for the kernels that read 8-bit KV caches on the CPU and on CUDA, the encoding for the fp8 Q K^T's
// quantize pass (softmax/cuda/q8.cuh); one definition of each.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

#include "hd.h"

namespace attn {

// The 7 magnitude bits placed at float32's exponent / mantissa boundary (bits << 20) read as a
// float32 are x * 2^-120 for normal and subnormal e4m3 alike (an e4m3 subnormal lands on a
// float32 subnormal), so one multiply by 2^120 finishes (exact; the kernels are built without
// flush-to-zero); the sign is or-ed in and 0x7f / 0xff give NaN.
ATTN_HD float e4m3_to_float(uint32_t b) {
  if ((b & 0x7fu) == 0x7fu) return std::numeric_limits<float>::quiet_NaN();
  const uint32_t m = (b & 0x7fu) << 20;
  float f;
  std::memcpy(&f, &m, 4);
  f *= 0x1p120f;
  return (b & 0x80u) ? -f : f;
}

// float32 to e4m3 bits, rounded to nearest even and saturated to +-448 (cvt's .satfinite: an inf
// or a value past 448 gives the largest finite, a NaN gives S.1111.111), as torch's
// float8_e4m3fn conversion of a value inside the range. Integer operations only, so the host (the
// emulator) and the device round alike. Normal e4m3 (|x| >= 2^-6): float32's exponent rebased
// (127 - 7) and its mantissa rounded to 3 bits; below, a multiple of 2^-9 (the subnormal step),
// the full significand shifted and rounded the same way (8 x 2^-9 lands on the smallest normal).
ATTN_HD uint32_t float_to_e4m3(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t sign = (u >> 24) & 0x80u;
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return sign | 0x7fu;   // NaN
  if (u >= 0x43e00000u) return sign | 0x7eu;  // >= 448 (inf included): the largest finite
  if (u >= 0x3c800000u) {                     // [2^-6, 448): normal
    const uint32_t r = (u + 0x7ffffu + ((u >> 20) & 1u)) >> 20;  // 8 exponent + 3 mantissa bits
    return sign | (r - (120u << 3));
  }
  const uint32_t e = u >> 23;  // < 121; 0: a float32 subnormal, far below 2^-10
  const uint32_t shift = 141u - e;  // x / 2^-9 = significand >> shift, shift >= 21
  if (e == 0u || shift > 31u) return sign;
  const uint32_t m = (u & 0x7fffffu) | 0x800000u;
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return sign | q;
}

}  // namespace attn
