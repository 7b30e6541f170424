// Merging split-KV partial softmax results (flash-decoding), shared by the CUDA combine kernel
// and the CPU unit test (tests/cpp/test_split_merge.cpp).
//
// A split s of a query row's visible keys K_s yields
//   lse_s = log sum_{j in K_s} exp(s_j)              (-inf when K_s is empty or fully masked)
//   O_s   = sum_{j in K_s} exp(s_j - lse_s) v_j       (0 when lse_s = -inf)
// and the whole row, with an optional sink logit that joins the denominator only, is
//   lse = log(sum_s exp(lse_s) + exp(sink)),   O = sum_s exp(lse_s - lse) O_s.
// Dropout needs nothing here: each O_s already carries its kept-and-rescaled probabilities, the
// lse_s are of the undropped ones, as in the unsplit kernel.
#pragma once

#include <cmath>
#include <cstdint>

#include "hd.h"

namespace attn {

ATTN_HD float exp_acc(float x) { return expf(x); }
ATTN_HD double exp_acc(double x) { return exp(x); }
ATTN_HD float log_acc(float x) { return logf(x); }
ATTN_HD double log_acc(double x) { return log(x); }

// The merged lse of n partials lse[0], lse[stride], ... (and the sink when has_sink). Subtracting
// the maximum keeps exp() in range; -inf partials are skipped rather than evaluated, so an all
// -inf row (nothing visible, no sink) returns -inf without computing -inf - -inf.
template <typename Acc>
ATTN_HD Acc merge_split_lse(const Acc* lse, int n, int64_t stride, bool has_sink, Acc sink) {
  Acc mx = has_sink ? sink : Acc(-INFINITY);
  for (int s = 0; s < n; ++s) {
    const Acc l = lse[s * stride];
    if (l != l) return l;  // a split read a NaN logit: the row's LSE is NaN (the max would skip it)
    mx = l > mx ? l : mx;
  }
  if (mx == Acc(-INFINITY)) return mx;
  Acc sum = has_sink && sink != Acc(-INFINITY) ? exp_acc(sink - mx) : Acc(0);
  for (int s = 0; s < n; ++s) {
    const Acc l = lse[s * stride];
    if (l != Acc(-INFINITY)) sum += exp_acc(l - mx);
  }
  return mx + log_acc(sum);
}

// The weight exp(lse_s - lse) of partial s in the merged O; 0 for an empty split (which also
// covers lse = -inf: then every partial is -inf).
template <typename Acc>
ATTN_HD Acc split_weight(Acc lse_s, Acc lse) {
  return lse_s == Acc(-INFINITY) ? Acc(0) : exp_acc(lse_s - lse);
}

}  // namespace attn
