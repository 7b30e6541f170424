// cpu/simd.h's transpose, the triangular gemm variants, the shared horizontal sums and the
// softmax's exp2 against plain loops; built with and without -march=native (test_cpp.py) so both the register forms
// and the portable loops run.
#include <cmath>
#include <cstring>
#include <vector>

#include "check.h"
#include "cpu/simd.h"

using namespace attn::cpu;

template <typename T>
void check_transpose(int rows, int cols, int ld_src, int ld_dst) {
  std::vector<T> src(size_t(rows) * ld_src), dst(size_t(cols) * ld_dst, T(-1));
  for (size_t i = 0; i < src.size(); ++i) src[i] = T(i % 97) - T(40);
  transpose(src.data(), rows, cols, ld_src, dst.data(), ld_dst);
  for (int c = 0; c < cols; ++c) {
    for (int r = 0; r < ld_dst; ++r) {
      const T want = r < rows ? src[size_t(r) * ld_src + c] : T(0);
      CHECK(dst[size_t(c) * ld_dst + r] == want, "rows %d cols %d at (%d, %d)", rows, cols, c, r);
    }
  }
}

// C = A B over an n x n causal block with A lower triangular (kLowerA), A^T upper (kUpperAT, A
// stored lower), or only the lower part of C wanted (kLowerC), against the full product.
template <typename T>
void check_tri(int n, int nc) {
  const int ld = round_up(n > nc ? n : nc, kLanes<T>);
  std::vector<T> a(size_t(n) * ld, T(0)), b(size_t(n) * ld), full(size_t(n) * ld), tri(size_t(n) * ld);
  for (int i = 0; i < n; ++i) {
    for (int k = 0; k <= i; ++k) a[size_t(i) * ld + k] = T((i * 7 + k * 3) % 11) - T(5);  // lower
  }
  for (size_t i = 0; i < b.size(); ++i) b[i] = T(i % 13) - T(6);
  const int N = round_up(nc, kLanes<T>);
  gemm<false, false, Tri::kFull>(n, N, n, a.data(), ld, b.data(), ld, kPanel<T>, full.data(), ld);
  gemm<false, false, Tri::kLowerA>(n, N, n, a.data(), ld, b.data(), ld, kPanel<T>, tri.data(), ld);
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < N; ++j) CHECK(tri[size_t(i) * ld + j] == full[size_t(i) * ld + j], "kLowerA n %d (%d, %d)", n, i, j);
  }
  gemm<false, true, Tri::kFull>(n, N, n, a.data(), ld, b.data(), ld, kPanel<T>, full.data(), ld);
  gemm<false, true, Tri::kUpperAT>(n, N, n, a.data(), ld, b.data(), ld, kPanel<T>, tri.data(), ld);
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < N; ++j) CHECK(tri[size_t(i) * ld + j] == full[size_t(i) * ld + j], "kUpperAT n %d (%d, %d)", n, i, j);
  }
  const int Nn = round_up(n, kLanes<T>);
  gemm<false, false, Tri::kFull>(n, Nn, n, b.data(), ld, b.data(), ld, kPanel<T>, full.data(), ld);
  gemm<false, false, Tri::kLowerC>(n, Nn, n, b.data(), ld, b.data(), ld, kPanel<T>, tri.data(), ld);
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j <= i; ++j) CHECK(tri[size_t(i) * ld + j] == full[size_t(i) * ld + j], "kLowerC n %d (%d, %d)", n, i, j);
  }
}

// hsum4 / hsum8 against the tree they document, sum by sum and bit for bit: adjacent lane pairs,
// pairs of pairs, then the two 128-bit halves (8 lanes). Where the ISA has no shared form they
// must say so (false) and write nothing.
void check_hsums() {
  constexpr int L = kLanes<float>;
  vf r[8];
  for (int x = 0; x < 8; ++x) {
    for (int u = 0; u < L; ++u) r[x][u] = std::ldexp(1.0f + 0.37f * float(x * L + u), (x + 3 * u) % 29 - 14) * (u % 3 ? 1 : -1);
  }
  auto tree8 = [&](int x) {  // used where L == 8; a copy keeps narrower builds in bounds
    float v[8] = {};
    std::memcpy(v, &r[x], sizeof(float) * (L < 8 ? L : 8));
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
  };
  float out4[4] = {-1, -1, -1, -1};
  const bool has4 = hsum4(r, out4);
  vf out8;
  for (int u = 0; u < L; ++u) out8[u] = -1;
  const bool has8 = hsum8(r, &out8);
#if defined(__AVX__) && !defined(__AVX512F__)
  CHECK(has4 && has8, "hsum4 / hsum8 must have their AVX form with 8 lanes");
#endif
  if (L != 8) CHECK(!has8, "hsum8 with %d lanes", L);
  if (has4 && L == 8) {
    for (int x = 0; x < 4; ++x) CHECK(out4[x] == tree8(x), "hsum4 row %d: %g against %g", x, out4[x], tree8(x));
  }
  if (has8) {
    for (int x = 0; x < 8; ++x) CHECK(out8[x] == tree8(x), "hsum8 row %d: %g against %g", x, out8[x], tree8(x));
  } else {
    for (int u = 0; u < L; ++u) CHECK(out8[u] == -1, "hsum8 wrote lane %d without a shared form", u);
  }
}

// hmax against the halving loop it documents (lane i against lane i + w, w = lanes / 2 .. 1, the
// upper lane kept where it is greater), bit for bit: NaN and infinities at every lane included.
void check_hmax() {
  constexpr int L = kLanes<float>;
  const float nan = std::nanf(""), inf = INFINITY;
  for (int t = 0; t < 400; ++t) {
    vf v;
    for (int u = 0; u < L; ++u) v[u] = std::ldexp(1.0f + 0.61f * float((t * 7 + u * 13) % 37), (t + 5 * u) % 23 - 11) * ((t + u) % 3 ? 1 : -1);
    if (t % 4 == 1) v[(t / 4) % L] = nan;
    if (t % 4 == 2) v[(t / 4) % L] = (t % 8 < 4) ? inf : -inf;
    if (t % 4 == 3) {
      v[(t / 4) % L] = nan;
      v[(t / 4 + 3) % L] = -inf;
    }
    float a[L];
    std::memcpy(a, &v, sizeof(v));
    for (int w = L / 2; w >= 1; w /= 2) {
      for (int i = 0; i < w; ++i) a[i] = a[i + w] > a[i] ? a[i + w] : a[i];
    }
    const float got = hmax(v);
    CHECK(std::memcmp(&got, &a[0], sizeof(float)) == 0, "hmax case %d: %g against %g", t, got, a[0]);
  }
}

// vexp2_nonpos against its portable form (the clamp at -127 and the exponent built in integers),
// bit for bit: on AVX-512 the kernel computes the scale with vscalefps and zeroes lanes by a mask
// instead. Every float in [-130, -120] (the clamp's edge and the denormal results), every 997th
// in [-1e-3, 0], every 61st in [-200, 0], and the specials, a vector's lanes all different.
vf exp2_portable(vf x) {
  x = x < -127.f ? vbcast(-127.f) : x;
  const vf magic = vbcast(12582912.f);
  vf n = (x + magic) - magic;
  vf r = x - n;
  vf p = vbcast(1.326697993e-3f);
  p = p * r + 9.675469400e-3f;
  p = p * r + 5.550742675e-2f;
  p = p * r + 2.402212158e-1f;
  p = p * r + 6.931469491e-1f;
  p = p * r + 1.f;
  vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return p * scale;
}
__attribute__((noinline)) vf exp2_of_product(vf d) { return vexp2_nonpos(d * 1.4426950408889634f); }
__attribute__((noinline)) vf exp2_portable_of_product(vf d) { return exp2_portable(d * 1.4426950408889634f); }
void check_exp2() {
  std::vector<float> xs = {-INFINITY, NAN, -NAN, -0.f, 0.f, -1e30f, -3e38f, -127.f, -126.5f, -126.f};
  auto add_range = [&](float lo, float hi, uint32_t step) {  // negative floats from hi down to lo
    uint32_t a, b;
    std::memcpy(&a, &hi, 4);
    std::memcpy(&b, &lo, 4);
    for (uint32_t u = a; u <= b; u += step) {
      float f;
      std::memcpy(&f, &u, 4);
      xs.push_back(f);
    }
  };
  add_range(-130.f, -120.f, 1);
  add_range(-1e-3f, -0.f, 997);
  add_range(-200.f, -0.f, 61);
  while (xs.size() % kLanes<float> != 0) xs.push_back(-1.f);
  int bad = 0;
  for (size_t i = 0; i < xs.size(); i += kLanes<float>) {
    const vf x = vload(xs.data() + i);
    const vf got = vexp2_nonpos(x), want = exp2_portable(x);
    for (int u = 0; u < kLanes<float>; ++u) {
      uint32_t g, w;
      std::memcpy(&g, &got[u], 4);
      std::memcpy(&w, &want[u], 4);
      if (g != w && bad++ < 5) CHECK(g == w, "exp2(%a): %a, portable %a", xs[i + u], got[u], want[u]);
    }
  }
  CHECK(bad == 0, "%d lanes differ", bad);
  // with the callers' multiply in front (x = d log2 e, as TileSoftmax::exp2_arg): the compiler
  // must not contract it into r = x - n (kernel form) where the clamp stops it (portable form)
  int bad_mul = 0;
  for (size_t i = 0; i + kLanes<float> <= xs.size(); i += kLanes<float>) {
    const vf d = vload(xs.data() + i) * 0.6931471805599453f;
    const vf got = exp2_of_product(d), want = exp2_portable_of_product(d);
    for (int u = 0; u < kLanes<float>; ++u) {
      uint32_t g, w;
      std::memcpy(&g, &got[u], 4);
      std::memcpy(&w, &want[u], 4);
      if (g != w && bad_mul++ < 5) CHECK(g == w, "exp2(%a log2 e): %a, portable %a", d[u], got[u], want[u]);
    }
  }
  CHECK(bad_mul == 0, "%d lanes differ with the multiply", bad_mul);
}

int main() {
  check_exp2();
  check_hsums();
  check_hmax();
  check_transpose<float>(48, 64, 64, 48);
  check_transpose<float>(48, 72, 72, 48);
  check_transpose<float>(72, 64, 64, 72);
  check_transpose<float>(13, 24, 24, 16);  // rows not whole blocks: a scalar tail, zero fill
  check_transpose<float>(16, 12, 12, 16);  // cols not whole blocks: the scalar loop
  check_transpose<double>(48, 64, 64, 48);
  for (int n : {1, 5, 6, 7, 34, 48, 64}) {
    check_tri<float>(n, 64);
    check_tri<double>(n, 40);
  }
  std::printf("%s\n", failures == 0 ? "ok" : "FAILED");
  return failures == 0 ? 0 : 1;
}
