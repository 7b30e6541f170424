// Plain C++ checks of the split-KV heuristic (csrc/softmax/cuda/heuristics.h) on the grids the
// CUDA forward meets: a decode step against a long cache splits to about two CTAs per SM, a grid
// that already fills the GPU never splits, and no split gets fewer than 4 key blocks.
#include <cstdio>

#include "softmax/cuda/heuristics.h"

#include "check.h"

int main() {
  using attn::num_splits_heuristic;
  const int sms = 132;  // H100 SXM
  // decode: 1 query block x 8 heads x 1 batch against 64k keys in 64-key blocks (1024 blocks)
  const int n = num_splits_heuristic(8, sms, 1024);
  CHECK(n == (2 * sms + 7) / 8);  // 33: about two CTAs per SM
  CHECK(n * 8 >= 2 * sms && (n - 1) * 8 < 2 * sms);
  // a grid at >= 0.8 of the SMs is never split
  CHECK(num_splits_heuristic(106, sms, 1 << 20) == 1);
  CHECK(num_splits_heuristic(105, sms, 1 << 20) > 1);
  // >= 4 key blocks per split: 12 key blocks allow 3 splits, 7 allow 1 (no split)
  CHECK(num_splits_heuristic(1, sms, 12) == 3);
  CHECK(num_splits_heuristic(1, sms, 7) == 1);
  // at most kMaxSplits
  CHECK(num_splits_heuristic(1, 1000, 1 << 20) == attn::kMaxSplits);
  for (int ctas = 1; ctas < 300; ++ctas)
    for (int kb = 1; kb < 2000; kb += 37) {
      const int s = num_splits_heuristic(ctas, sms, kb);
      CHECK(s >= 1 && s <= attn::kMaxSplits && (s == 1 || kb / s >= 4));
    }
  if (failures == 0) std::printf("ok\n");
  return failures == 0 ? 0 : 1;
}
