// The decode family's params (attention over a KV cache, flash_attn_with_kvcache) and its address
// policy, shared by the CPU and CUDA decode kernels and the CPU emulator.
//
// A decode call is the fused softmax forward (SoftmaxParamsT: q, out, lse, the score policy, causal
// bottom-right) whose keys live in a cache instead of a (B, H_k, S_k, D) tensor:
//   contiguous  k / v are (B_cache, H_k, S_cache, D) through the k_ / v_ strides; batch b reads
//               cache row cache_batch_idx[b] (or b)
//   paged       k / v are (num_pages, H_k, page_size, D) through the same strides (the batch
//               stride is the page stride); cache row r of batch b is row r % page_size of page
//               block_table[b, r / page_size]
// A quantized cache (kv_quant: int8 or fp8 e4m3) holds x / descale: element e of cache row r, kv
// head hk is e * k_descale (v_descale for V) with one float32 scale per (batch entry, kv head),
// (B, H_k), or per row and kv head (descale_per_token): (B_cache, S_cache, H_k), paged
// (num_pages, page_size, H_k), addressed like the row (KvRows::scale_row).
// Either way the keys of batch b are cache rows [leftpad_k[b], seqlens_k[b]) (leftpad 0 when
// absent): key j of the policy is cache row leftpad + j, and the policy's len_k is
// seqlens_k[b] - leftpad, so causal and ALiBi see positions relative to the left pad, as in
// flash-attn. SoftmaxParamsT::sk is the capacity of one sequence (S_cache, or max_pages * page_size).
#pragma once

#include <cstdint>

#include "hd.h"
#include "softmax_params.h"
#include "policy.h"

namespace attn {

template <typename Acc>
struct DecodeParamsT : SoftmaxParamsT<Acc> {
  // paged cache: (B, max_pages) int32 page ids with row stride block_table_stride, or nullptr
  const int32_t* block_table;
  int64_t block_table_stride;
  int32_t page_size;  // rows per page (paged only)
  int32_t num_pages;  // pages in the pool: page ids are clamped into [0, num_pages) (never read
                      // out of bounds); the bindings reject a table that needs the clamp
  // (B) cache row of each batch entry (contiguous cache only), or nullptr: row b
  const int32_t* cache_batch_idx;
  // (B) first valid cache row of each batch entry, or nullptr: 0
  const int32_t* leftpad_k;
  // key splits per (batch, kv head); 0 = the backend's heuristic
  int32_t num_splits;
  // the cache's storage: kKvNone (q's dtype), kKvInt8, kKvFp8 (e4m3), with its descales
  int32_t kv_quant;
  const float* k_descale;
  const float* v_descale;
  bool descale_per_token;
};

inline constexpr int32_t kKvNone = 0, kKvInt8 = 1, kKvFp8 = 2;

using DecodeParams = DecodeParamsT<float>;

// Sequence b's lengths for the policy: len_q = sq, len_k = seqlens_k[b] - leftpad (clamped to
// the capacity). row_q / row_k are unused by the decode kernels (0).
template <typename Acc>
ATTN_HD SeqInfo decode_seq_info(const DecodeParamsT<Acc>& p, int b) {
  SeqInfo si(p, b);  // padded layout: len_k = clamp(seqlens_k[b], 0, sk)
  const int pad = p.leftpad_k != nullptr ? imin(imax(p.leftpad_k[b], 0), si.len_k) : 0;
  si.len_k -= pad;
  return si;
}

// The address policy: where key j (0-based, after the left pad) of (batch b, kv head hk) lives
// in k and v, as element offsets. Contiguous: one row stride apart. Paged: a page lookup per row;
// kernels that step through keys in order use walk().
struct KvRows {
  int64_t k_head, v_head;          // contiguous: offset of (cache row 0, hk); paged: hk * head stride
  int64_t k_rs, v_rs, k_ps, v_ps;  // row strides; page strides (paged)
  const int32_t* pages;            // this sequence's block-table row; nullptr = contiguous
  int32_t page, num_pages, pad;    // page size, pool size, left pad
  int64_t row0;                    // contiguous: the first cache row of the sequence, cb * capacity

  template <typename Acc>
  ATTN_HD KvRows(const DecodeParamsT<Acc>& p, int b, int hk) {
    pad = p.leftpad_k != nullptr ? imax(p.leftpad_k[b], 0) : 0;
    k_rs = p.k_row_stride;
    v_rs = p.v_row_stride;
    k_ps = p.k_batch_stride;
    v_ps = p.v_batch_stride;
    page = p.page_size;
    num_pages = p.num_pages;
    if (p.block_table != nullptr) {
      pages = p.block_table + int64_t(b) * p.block_table_stride;
      k_head = int64_t(hk) * p.k_head_stride;
      v_head = int64_t(hk) * p.v_head_stride;
      row0 = 0;
    } else {
      pages = nullptr;
      const int64_t cb = p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b;
      k_head = cb * p.k_batch_stride + int64_t(hk) * p.k_head_stride;
      v_head = cb * p.v_batch_stride + int64_t(hk) * p.v_head_stride;
      row0 = cb * p.sk;
    }
  }
  // The row of key j in a per-token descale ((B_cache, S_cache) or (num_pages, page_size) rows,
  // times H_k plus the kv head for the element)
  ATTN_HD int64_t scale_row(int j) const {
    const int r = pad + j;
    if (pages == nullptr) return row0 + r;
    return page_of(r) * page + r % page;
  }
  // The page holding cache row r, clamped into the pool.
  ATTN_HD int64_t page_of(int r) const {
    const int pg = pages[r / page];
    return pg < 0 ? 0 : (pg >= num_pages ? num_pages - 1 : pg);
  }
  ATTN_HD int64_t k_off(int j) const {
    const int r = pad + j;
    if (pages == nullptr) return k_head + int64_t(r) * k_rs;
    return page_of(r) * k_ps + k_head + int64_t(r % page) * k_rs;
  }
  ATTN_HD int64_t v_off(int j) const {
    const int r = pad + j;
    if (pages == nullptr) return v_head + int64_t(r) * v_rs;
    return page_of(r) * v_ps + v_head + int64_t(r % page) * v_rs;
  }
  // f(jj, k_off(j0 + jj), v_off(j0 + jj)) for jj in [0, n), in order, with one division for
  // the whole walk (a page lookup per row costs as much as a short dot product).
  template <typename F>
  ATTN_HD void walk(int j0, int n, F&& f) const {
    int r = pad + j0;
    if (pages == nullptr) {
      for (int jj = 0; jj < n; ++jj, ++r) f(jj, k_head + int64_t(r) * k_rs, v_head + int64_t(r) * v_rs);
      return;
    }
    int pi = r / page, in = r % page;
    int64_t kp = page_of(pi * page) * k_ps + k_head, vp = page_of(pi * page) * v_ps + v_head;
    for (int jj = 0; jj < n; ++jj) {
      f(jj, kp + int64_t(in) * k_rs, vp + int64_t(in) * v_rs);
      if (++in == page && jj + 1 < n) {
        in = 0;
        ++pi;
        kp = page_of(pi * page) * k_ps + k_head;
        vp = page_of(pi * page) * v_ps + v_head;
      }
    }
  }
};

}  // namespace attn
