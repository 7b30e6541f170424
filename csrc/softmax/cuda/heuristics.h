// The split-KV (flash-decoding) heuristic of the tensor-core forward and the GQA row packing of
// one-query-row calls, torch- and CUDA-free so they are unit-tested on the CPU
// (tests/cpp/test_heuristics.cpp).
#pragma once

#include <cstdint>

#include "common/softmax_params.h"

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

// A decode-like forward whose query heads of a kv group may share one query block (flash-attn's
// "seqlenq_ngroups_swapped"): one query row per head, GQA / MQA, and every packed row seeing the
// same keys with the same score: no ALiBi, sinks, bias, dropout, layout or top-k (per head or per
// row), no left window, causal only bottom-right (which one query row does not restrict), not
// varlen, and the LSE's heads consecutive (lse_head_stride 1, as the op allocates (B, H, 1)).
inline bool gqa_rows_packable(const SoftmaxParams& p) {
  if (p.sq != 1 || p.h_k < 1 || p.h == p.h_k || p.h % p.h_k != 0 || p.cu_seqlens_q != nullptr) return false;
  if (p.alibi_slopes != nullptr || p.sinks != nullptr || p.bias_kind != BiasKind::kNone) return false;
  if (p.dropout_p > 0.f || p.sparse.on() || p.topk_thr != nullptr) return false;
  if (p.window_left >= 0 || (p.window_right >= 0 && !p.bottom_right)) return false;
  return p.lse_head_stride == 1;
}

// p with the G = H / H_k query heads of each kv group as G query rows of one head (the group's):
// (B, H, 1, D) viewed as (B, H_k, G, D) through the head stride, the same for out and the LSE.
// A packed call reads each K / V block once per group instead of G times and fills its query
// blocks G times fuller; its outputs are the unpacked call's up to rounding (bit for bit where the
// same kernel and split count run; packing changes the grid the split heuristic sees). p itself
// when it cannot be packed. The split scratch's rows (FwdSplitScratch::rows) become G too.
inline SoftmaxParams pack_gqa_rows(const SoftmaxParams& p) {
  if (!gqa_rows_packable(p)) return p;
  const int g = p.h / p.h_k;
  SoftmaxParams r = p;
  r.h = p.h_k;
  r.sq = g;
  r.q_row_stride = p.q_head_stride;
  r.q_head_stride = p.q_head_stride * g;
  r.o_row_stride = p.o_head_stride;
  r.o_head_stride = p.o_head_stride * g;
  r.lse_head_stride = g;
  r.window_right = -1;  // bottom-right causal hid nothing from the one row; the G rows must not differ
  return r;
}

}  // namespace attn
