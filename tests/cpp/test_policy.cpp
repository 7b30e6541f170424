// Plain C++ checks of the shared policy and dropout RNG (no torch): the structural mask agrees
// with a brute-force definition, block ranges cover exactly the allowed keys, Philox is a
// deterministic function with the expected keep rate.
#include <cstdio>
#include <cstdlib>

#include "common/philox.h"
#include "common/policy.h"

#include "check.h"

int main() {
  const int shapes[][4] = {{7, 7, -1, 0}, {5, 13, -1, 0}, {13, 5, 3, 0}, {9, 9, 2, 2}, {16, 40, 0, -1}};
  for (const auto& s : shapes) {
    for (int br = 0; br < 2; ++br) {
      attn::SoftmaxParams p{};
      p.b = 1;
      p.h = p.h_k = 1;
      p.sq = s[0];
      p.sk = s[1];
      p.window_left = s[2];
      p.window_right = s[3];
      p.bottom_right = br != 0;
      p.scale = 1.f;
      attn::SeqInfo si(p, 0);
      attn::Policy pol(p, si, 0, 0);
      const int diag = br ? p.sk - p.sq : 0;
      for (int i = 0; i < p.sq; ++i) {
        int j0, j1;
        pol.key_range(i, i + 1, &j0, &j1);
        for (int j = 0; j < p.sk; ++j) {
          bool want = (p.window_left < 0 || j >= i + diag - p.window_left) &&
                      (p.window_right < 0 || j <= i + diag + p.window_right);
          CHECK(pol.allowed(i, j) == want);
          if (want) CHECK(j >= j0 && j < j1);
          if (want) {
            int i0, i1;
            pol.query_range(j, j + 1, &i0, &i1);
            CHECK(i >= i0 && i < i1);
          }
        }
      }
    }
  }
  int kept = 0, n = 0;
  for (int i = 0; i < 64; ++i)
    for (int j = 0; j < 256; ++j, ++n) {
      bool a = attn::dropout_keep(42, 0, 3, i, j, 0.25f), b = attn::dropout_keep(42, 0, 3, i, j, 0.25f);
      CHECK(a == b);
      kept += a;
    }
  const double rate = double(kept) / n;
  CHECK(rate > 0.73 && rate < 0.77);
  std::printf("%d passed, %d failed\n", failures == 0 ? 1 : 0, failures == 0 ? 0 : 1);
  return failures == 0 ? 0 : 1;
}
