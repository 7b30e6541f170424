// The key-split heuristic of the CUDA decode kernel (csrc/decode/cuda), torch- and CUDA-free so
// it is unit-tested on the CPU (tests/cpp/test_heuristics.cpp).
#pragma once

#include <cstdint>

namespace attn {

// Upper bound of key splits per (batch, kv head): the combine kernel loops over them per row.
constexpr int kDecodeMaxSplits = 128;
// A split reads at least this many keys (when the call lets it), so that its partial (O_s, lse_s)
// round trip through fp32 scratch and the combine stay a small cost next to the K / V it reads.
constexpr int kDecodeMinKeysPerSplit = 256;

// Splits for an unsplit grid of `ctas` = batch x kv heads CTAs over caches of up to max_keys
// visible keys on `sms` SMs. requested > 0: that many, at most one per 16 keys and
// kDecodeMaxSplits. 0: about two CTAs per SM (the kernel fits two or more per SM by registers,
// and a second CTA hides the tail of ragged lengths): of the two counts around 2 x sms / ctas, the
// one whose CTAs fill their last wave of 2 x sms best (64 CTAs on 132 SMs: 4 splits, 256 CTAs in
// one wave, not 5, 320 CTAs in 1.2 waves: benchmarks/gpu_cost.py predicts 1.6x), each split >= 256
// keys; no split when the grid already fills 0.8 of the SMs twice.
inline int decode_num_splits_heuristic(int64_t ctas, int sms, int64_t max_keys, int64_t requested) {
  if (ctas < 1) ctas = 1;
  if (max_keys < 1) return 1;
  if (requested > 0) {
    int64_t cap = (max_keys + 15) / 16;
    cap = cap < kDecodeMaxSplits ? cap : kDecodeMaxSplits;
    const int64_t n = requested < cap ? requested : cap;
    return n >= 1 ? int(n) : 1;
  }
  const int64_t target = 2 * int64_t(sms);
  if (ctas * 5 >= target * 4) return 1;
  const int64_t by_len = max_keys / kDecodeMinKeysPerSplit;
  auto capped = [&](int64_t n) {
    n = n < by_len ? n : by_len;
    n = n < kDecodeMaxSplits ? n : kDecodeMaxSplits;
    return n >= 1 ? n : int64_t(1);
  };
  // the fraction of the last wave's slots a count fills, as a comparison without division
  auto fill = [&](int64_t n, int64_t* used, int64_t* slots) {
    *used = ctas * n;
    *slots = (*used + target - 1) / target * target;
  };
  const int64_t hi = capped((target + ctas - 1) / ctas), lo = capped(target / ctas);
  int64_t used_hi, slots_hi, used_lo, slots_lo;
  fill(hi, &used_hi, &slots_hi);
  fill(lo, &used_lo, &slots_lo);
  const int64_t n = used_lo * slots_hi > used_hi * slots_lo ? lo : hi;  // a tie keeps the larger
  return n >= 2 ? int(n) : 1;
}

}  // namespace attn
