// Plain C++ checks of the split-KV heuristics on the grids the CUDA kernels meet. Softmax forward
// (csrc/softmax/cuda/heuristics.h): a decode step against a long cache splits to about two CTAs
// per SM, a grid that already fills the GPU never splits, and no split gets fewer than 4 key
// blocks. Decode kernel (csrc/decode/cuda/heuristics.h): about two CTAs per SM, >= 256 keys per
// split (of the two counts around it, the one that fills its last wave best), a requested count
// bounded by one split per 16 keys. The softmax forward's GQA row packing of one-query-row calls.
#include <cstdio>

#include "decode/cuda/heuristics.h"
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

  // decode: B 8 x H_k 8 = 64 CTAs on 132 SMs -> 4 splits (256 CTAs: one wave of two per SM; 5
  // would make 320, a second wave a fifth full) at 4k..64k keys
  using attn::decode_num_splits_heuristic;
  CHECK(decode_num_splits_heuristic(64, sms, 4096, 0) == 4);
  CHECK(decode_num_splits_heuristic(64, sms, 65536, 0) == 4);
  // B 4 x H_k 8 = 32 CTAs: 8 splits (256 CTAs) over 9 (288)
  CHECK(decode_num_splits_heuristic(32, sms, 65536, 0) == 8);
  // batch 1, one kv head: as many splits as two CTAs per SM allow, bounded by 256 keys per split
  CHECK(decode_num_splits_heuristic(1, sms, 1 << 20, 0) == attn::kDecodeMaxSplits);
  CHECK(decode_num_splits_heuristic(1, sms, 2048, 0) == 8);
  CHECK(decode_num_splits_heuristic(1, sms, 511, 0) == 1);
  // a grid that fills 0.8 x two CTAs per SM is not split; nothing to read is not split
  CHECK(decode_num_splits_heuristic(212, sms, 1 << 16, 0) == 1);
  CHECK(decode_num_splits_heuristic(211, sms, 1 << 16, 0) == 2);
  CHECK(decode_num_splits_heuristic(4, sms, 0, 0) == 1);
  CHECK(decode_num_splits_heuristic(4, sms, 0, 7) == 1);
  // requested: honoured up to one split per 16 keys and kDecodeMaxSplits
  CHECK(decode_num_splits_heuristic(4, sms, 1000, 7) == 7);
  CHECK(decode_num_splits_heuristic(4, sms, 40, 7) == 3);
  CHECK(decode_num_splits_heuristic(4, sms, 1 << 20, 1000) == attn::kDecodeMaxSplits);
  for (int ctas = 1; ctas < 400; ctas += 3)
    for (int keys = 0; keys < 100000; keys += 997) {
      const int s = decode_num_splits_heuristic(ctas, sms, keys, 0);
      CHECK(s >= 1 && s <= attn::kDecodeMaxSplits && (s == 1 || keys / s >= attn::kDecodeMinKeysPerSplit));
      CHECK(s == 1 || int64_t(ctas) * (s - 1) < 2 * sms);  // no more splits than two CTAs per SM need
    }

  // GQA row packing (softmax/cuda/heuristics.h): a (B 2, H 8, 1, D 64) call over 2 kv heads, q / out
  // in (B, S, H, D) storage and a (B, H, 1) LSE, becomes (B 2, H_k 2, G 4 rows): element (b, hk, g)
  // of the packed view is element (b, hk * 4 + g, 0) of the call, in q, out and the LSE
  attn::SoftmaxParams p{};
  p.b = 2, p.h = 8, p.h_k = 2, p.sq = 1, p.sk = 1000, p.d = 64;
  p.q_batch_stride = 8 * 64, p.q_head_stride = 64, p.q_row_stride = 8 * 64;
  p.o_batch_stride = 8 * 64, p.o_head_stride = 64, p.o_row_stride = 8 * 64;
  p.lse_batch_stride = 8, p.lse_head_stride = 1;
  p.window_left = -1, p.window_right = 0, p.bottom_right = true;  // causal, bottom-right
  CHECK(attn::gqa_rows_packable(p));
  const attn::SoftmaxParams r = attn::pack_gqa_rows(p);
  CHECK(r.h == 2 && r.h_k == 2 && r.sq == 4 && r.window_right == -1 && r.window_left == -1);
  for (int b = 0; b < 2; ++b)
    for (int h = 0; h < 8; ++h) {
      const int hk = h / 4, g = h % 4;
      CHECK(b * r.q_batch_stride + hk * r.q_head_stride + g * r.q_row_stride == b * p.q_batch_stride + h * p.q_head_stride);
      CHECK(b * r.o_batch_stride + hk * r.o_head_stride + g * r.o_row_stride == b * p.o_batch_stride + h * p.o_head_stride);
      CHECK(b * r.lse_batch_stride + hk * r.lse_head_stride + g == b * p.lse_batch_stride + h * p.lse_head_stride);
    }
  // what a packed row could not share, or a call that is not one query row of GQA: unchanged
  auto refused = [&](auto change) {
    attn::SoftmaxParams q = p;
    change(q);
    return !attn::gqa_rows_packable(q) && attn::pack_gqa_rows(q).h == q.h;
  };
  const float slopes[8] = {};
  const int32_t cu[3] = {0, 1, 2};
  CHECK(refused([](attn::SoftmaxParams& q) { q.sq = 2; }));
  CHECK(refused([](attn::SoftmaxParams& q) { q.h_k = 8; }));
  CHECK(refused([&](attn::SoftmaxParams& q) { q.alibi_slopes = slopes; }));
  CHECK(refused([&](attn::SoftmaxParams& q) { q.sinks = slopes; }));
  CHECK(refused([](attn::SoftmaxParams& q) { q.bias_kind = attn::BiasKind::kBool; }));
  CHECK(refused([](attn::SoftmaxParams& q) { q.dropout_p = 0.1f; }));
  CHECK(refused([](attn::SoftmaxParams& q) { q.window_left = 100; }));
  CHECK(refused([](attn::SoftmaxParams& q) { q.bottom_right = false; }));  // top-left causal: key 0 only
  CHECK(refused([&](attn::SoftmaxParams& q) { q.cu_seqlens_q = cu; }));
  CHECK(refused([](attn::SoftmaxParams& q) { q.lse_head_stride = 3; }));
  CHECK(!refused([](attn::SoftmaxParams& q) { q.window_right = -1, q.bottom_right = false; }));  // no mask at all
  CHECK(!refused([](attn::SoftmaxParams& q) { q.softcap = 30.f; }));

  if (failures == 0) std::printf("ok\n");
  return failures == 0 ? 0 : 1;
}
