// cpu/bf16dot.h against the instruction it emulates: dp_step() (the redo of a product without
// some terms, gemm_dp_skipping) must give vdpbf16ps's bits exactly, lane by lane, across the
// denormal range; gemm_dp's packed product must equal gemm_dp_skipping with nothing skipped, and
// a skipped term that is 0 x a finite value must change no bit. Built with the avx512bf16
// level's flags; test_cpp.py runs it only on a CPU with AVX512-BF16 (exit 77 = skipped).
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "check.h"
#include "cpu/bf16dot.h"

using namespace attn::cpu;

static uint16_t to_bf16(float f) { return f32_to_bf16(f); }

int main() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512bf16")) {
    std::printf("no AVX512-BF16 on this CPU\n");
    return 77;
  }
  std::mt19937 g(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  // one instruction vs dp_step, lane by lane: operands from 2^-130 to 2^10 (denormal inputs,
  // products and sums below the normal range), accumulators down to 2^-150
  long lanes = 0;
  for (int it = 0; it < 100000; ++it) {
    alignas(64) uint16_t a[32], b[32];
    alignas(64) float c[16], out[16];
    for (int i = 0; i < 32; ++i) {
      a[i] = to_bf16(nd(g) * std::ldexp(1.f, int(g() % 140) - 130));
      b[i] = to_bf16(nd(g) * std::ldexp(1.f, int(g() % 40) - 20));
    }
    for (int i = 0; i < 16; ++i) c[i] = ftz(nd(g) * std::ldexp(1.f, int(g() % 160) - 150));
    const __m512 r = _mm512_dpbf16_ps(_mm512_load_ps(c), (__m512bh)_mm512_load_si512(a), (__m512bh)_mm512_load_si512(b));
    _mm512_store_ps(out, r);
    for (int j = 0; j < 16; ++j, ++lanes) {
      const float e = dp_step(dp_step(c[j], a[2 * j + 1], b[2 * j + 1]), a[2 * j], b[2 * j]);
      CHECK(std::memcmp(&e, &out[j], 4) == 0, "lane %d of step %d: instruction %a, dp_step %a", j, it, out[j], e);
      if (failures > 10) return 1;
    }
  }
  // gemm_dp (packed, hardware) vs gemm_dp_skipping: nothing skipped, then skipping zero terms
  const int M = 13, N = 64, K = 70, Q = kDotPanel;
  std::vector<uint16_t> A(size_t(M) * K), B(size_t(K) * N);
  for (auto& x : A) x = to_bf16(nd(g));
  for (int m = 0; m < M; ++m) A[size_t(m) * K + 5] = 0;  // term k = 5: 0 x B's row 5
  std::vector<float> B32(size_t(K) * N);
  for (int k = 0; k < K; ++k) {
    for (int n = 0; n < N; ++n) {
      const uint16_t v = to_bf16(nd(g));
      B[size_t(n / Q) * K * Q + size_t(k / 2) * 2 * Q + (n % Q) * 2 + k % 2] = v;  // the pairs layout
    }
  }
  std::vector<float> hw(size_t(M) * N), emu(size_t(M) * N), skip(size_t(M) * N);
  gemm_dp(M, N, K, A.data(), K, B.data(), int64_t(K) * Q, hw.data(), N);
  gemm_dp_skipping(M, N, K, A.data(), K, B.data(), int64_t(K) * Q, emu.data(), N, [](int, int) { return false; });
  gemm_dp_skipping(M, N, K, A.data(), K, B.data(), int64_t(K) * Q, skip.data(), N,
                   [](int, int k) { return k == 5; });
  CHECK(std::memcmp(hw.data(), emu.data(), hw.size() * 4) == 0, "gemm_dp != its emulation");
  CHECK(std::memcmp(hw.data(), skip.data(), hw.size() * 4) == 0, "skipping a 0 x finite term changed bits");
  std::printf("%ld lanes, %d failures\n", lanes, failures);
  return failures == 0 ? 0 : 1;
}
