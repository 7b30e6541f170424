// Plain C++ checks of common/fp8.h's e4m3 encoding against its decoding and the rounding rule:
// every finite byte comes back from its value; the midpoint of two neighbours rounds to the one
// with the even mantissa and a float32 step either side to the nearer; past 448 (inf included) it
// saturates to 448, a NaN gives S.1111.111, and below half the smallest subnormal it is a signed 0.
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>

#include "common/fp8.h"

#include "check.h"

int main() {
  for (uint32_t b = 0; b < 256; ++b) {
    if ((b & 0x7fu) == 0x7fu) continue;
    const float x = attn::e4m3_to_float(b);
    CHECK(attn::float_to_e4m3(x) == b, "byte 0x%02x (%g) -> 0x%02x", b, double(x), attn::float_to_e4m3(x));
  }
  for (uint32_t b = 0; b < 0x7eu; ++b) {  // neighbours b, b + 1 (both signs)
    for (uint32_t s : {0u, 0x80u}) {
      const float lo = attn::e4m3_to_float(s | b), hi = attn::e4m3_to_float(s | (b + 1));
      const float mid = (lo + hi) / 2;  // exact: both have at most 4 significant bits
      const uint32_t even = (b & 1u) ? s | (b + 1) : s | b;
      CHECK(attn::float_to_e4m3(mid) == even, "midpoint %g -> 0x%02x", double(mid), attn::float_to_e4m3(mid));
      const float below = std::nextafter(mid, lo), above = std::nextafter(mid, hi);
      CHECK(attn::float_to_e4m3(below) == (s | b), "%g -> 0x%02x", double(below), attn::float_to_e4m3(below));
      CHECK(attn::float_to_e4m3(above) == (s | (b + 1)), "%g -> 0x%02x", double(above), attn::float_to_e4m3(above));
    }
  }
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {448.f, 449.f, 464.f, 480.f, 1e6f, 3e38f, inf}) {
    CHECK(attn::float_to_e4m3(x) == 0x7eu, "%g", double(x));
    CHECK(attn::float_to_e4m3(-x) == 0xfeu, "%g", double(-x));
  }
  CHECK((attn::float_to_e4m3(std::numeric_limits<float>::quiet_NaN()) & 0x7fu) == 0x7fu);
  const float tiny = 0x1p-10f;  // half the smallest subnormal (2^-9): a tie, to the even 0
  CHECK(attn::float_to_e4m3(tiny) == 0u && attn::float_to_e4m3(-tiny) == 0x80u);
  CHECK(attn::float_to_e4m3(std::nextafter(tiny, 1.f)) == 1u);
  CHECK(attn::float_to_e4m3(1e-30f) == 0u && attn::float_to_e4m3(-1e-40f) == 0x80u);
  return failures == 0 ? 0 : 1;
}
