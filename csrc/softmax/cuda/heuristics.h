// The split-KV (flash-decoding) heuristic of the tensor-core forward, torch- and CUDA-free so it is
// unit-tested on the CPU.
#pragma once

#include <cstdint>

namespace attn {

constexpr int kMaxSplits = 128;

// How many CTAs to split each query block's keys over, given the unsplit grid (ctas = query
// blocks x heads x batch), the SM count and the key blocks a query block visits. FA2-like: split
// only when the unsplit grid fills well under one wave (< 0.8 x SMs), into enough CTAs for about
// two per SM (the mma.sync forward fits two per SM by registers), keeping >= 4 key blocks per
// split so that each amortizes its Q load and the combine pass.
inline int num_splits_heuristic(int64_t ctas, int sms, int64_t key_blocks) {
  if (ctas * 5 >= int64_t(sms) * 4) return 1;
  int64_t n = (2 * int64_t(sms) + ctas - 1) / ctas;
  n = n < key_blocks / 4 ? n : key_blocks / 4;
  n = n < kMaxSplits ? n : kMaxSplits;
  return n >= 2 ? int(n) : 1;
}

}  // namespace attn
