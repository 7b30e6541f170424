// fp8 e4m3 (torch.float8_e4m3fn: no infinities, S.1111.111 NaN) to float32, for the kernels that
// read 8-bit KV caches on the CPU and on CUDA (one definition of the decoding).
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

}  // namespace attn
