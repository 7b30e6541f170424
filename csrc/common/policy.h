// The attention variants as one small host/device policy.
//
// Every backend asks the same two questions per (query i, key j) of one (batch, head):
//   allowed(i, j)  -- may i attend j? (lengths, causal, sliding window, bool mask)
//   score(x, i, j) -- the logit given x = q.k (scale, softcap, ALiBi, additive bias)
// and one per block of rows, key_range(), so that masked key blocks are skipped entirely and a
// sliding window costs O(S * window). The CPU loops and the CUDA kernels call this same code,
// so the semantics are tested on the CPU every day and a GPU kernel only has to tile.
#pragma once

#include <cmath>
#include <cstdint>

#include "hd.h"
#include "softmax_params.h"


namespace attn {

ATTN_HD int imin(int a, int b) { return a < b ? a : b; }
ATTN_HD int imax(int a, int b) { return a > b ? a : b; }
// tanh in the softmax's type (tanhf keeps the float path in float on the device)
ATTN_HD float tanh_acc(float x) { return tanhf(x); }
ATTN_HD double tanh_acc(double x) { return tanh(x); }

// Where sequence b lives and how long it is, for either the padded or the varlen layout.
struct SeqInfo {
  int len_q, len_k;
  int64_t row_q, row_k;  // first row of the sequence inside its (batch, head) slice

  template <typename Acc>
  ATTN_HD SeqInfo(const SoftmaxParamsT<Acc>& p, int b) {
    if (p.cu_seqlens_q != nullptr) {
      row_q = p.cu_seqlens_q[b];
      len_q = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
      row_k = p.cu_seqlens_k[b];
      len_k = p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b];
    } else {
      row_q = 0;
      row_k = 0;
      len_q = p.sq;
      len_k = p.seqlens_k != nullptr ? imin(imax(p.seqlens_k[b], 0), p.sk) : p.sk;
    }
  }
  // batch offset in elements for a tensor with the given batch stride (varlen: one pack)
  template <typename Acc>
  ATTN_HD int64_t batch_off(const SoftmaxParamsT<Acc>& p, int b, int64_t batch_stride) const {
    return p.cu_seqlens_q != nullptr ? 0 : int64_t(b) * batch_stride;
  }
  // Element offset of (head, sequence-local row) in a tensor with strides (bs, hs, rs):
  // query-side tensors (q, o, dout, dq) start at row_q, key-side ones (k, v, dk, dv) at row_k.
  template <typename Acc>
  ATTN_HD int64_t q_offset(const SoftmaxParamsT<Acc>& p, int b, int head, int row, int64_t bs, int64_t hs,
                           int64_t rs) const {
    return batch_off(p, b, bs) + int64_t(head) * hs + (row_q + row) * rs;
  }
  template <typename Acc>
  ATTN_HD int64_t k_offset(const SoftmaxParamsT<Acc>& p, int b, int head, int row, int64_t bs, int64_t hs,
                           int64_t rs) const {
    return batch_off(p, b, bs) + int64_t(head) * hs + (row_k + row) * rs;
  }
};

// Acc: the type scores are computed in (SoftmaxParamsT); float on the GPU.
template <typename Acc>
struct PolicyT {
  int len_q, len_k;
  int diag;        // key aligned with query i is i + diag
  int wl, wr;      // window, -1 = unbounded
  Acc scale, softcap, inv_softcap;
  Acc slope;       // ALiBi slope, 0 = off
  BiasKind bias_kind;
  const void* bias;  // already offset to (b, h)
  int64_t bias_row_stride, bias_col_stride;
  const uint8_t* layout;  // (n_qb, n_kb) block grid of this head, nullptr = dense
  int n_kb, block;
  const Acc* topk_thr;        // (len_q) of this (b, h), nullptr = no top-k
  const int32_t* topk_jcut;

  ATTN_HD PolicyT(const SoftmaxParamsT<Acc>& p, const SeqInfo& s, int b, int h) {
    len_q = s.len_q;
    len_k = s.len_k;
    diag = p.bottom_right ? len_k - len_q : 0;
    wl = p.window_left;
    wr = p.window_right;
    scale = p.scale;
    softcap = p.softcap;
    inv_softcap = p.softcap > Acc(0) ? Acc(1) / p.softcap : Acc(0);
    bias_kind = p.bias_kind;
    bias_row_stride = p.bias_row_stride;
    bias_col_stride = p.bias_col_stride;
    set_score_head(p, b, h);
    layout = p.sparse.on() ? p.sparse.head_layout(h) : nullptr;
    n_kb = p.sparse.n_kb;
    block = p.sparse.block;
    if (p.topk_thr != nullptr) {
      const int64_t off = int64_t(b) * p.lse_batch_stride + int64_t(h) * p.lse_head_stride + s.row_q;
      topk_thr = p.topk_thr + off;
      topk_jcut = p.topk_jcut + off;
    } else {
      topk_thr = nullptr;
      topk_jcut = nullptr;
    }
  }

  // The score's per-head fields, ALiBi's slope and the bias of (b, h): a kernel that walks the
  // heads of a kv group with one policy moves it to the next head with this.
  ATTN_HD void set_score_head(const SoftmaxParamsT<Acc>& p, int b, int h) {
    slope = p.alibi_slopes != nullptr ? p.alibi_slopes[int64_t(b) * p.alibi_batch_stride + h] : Acc(0);
    const int64_t off = int64_t(b) * p.bias_batch_stride + int64_t(h) * p.bias_head_stride;
    if (p.bias_kind == BiasKind::kAdditive) {
      bias = static_cast<const Acc*>(p.bias) + off;
    } else if (p.bias_kind == BiasKind::kBool) {
      bias = static_cast<const uint8_t*>(p.bias) + off;
    } else {
      bias = nullptr;
    }
  }

  // Structural mask: length, causal and window. Cheap, no memory reads.
  ATTN_HD bool in_window(int i, int j) const {
    if (j >= len_k || i >= len_q) return false;
    if (wl >= 0 && j < i + diag - wl) return false;
    if (wr >= 0 && j > i + diag + wr) return false;
    return true;
  }
  // The block layout's rule (block_sparse.h). Kernels that walk the layout's tile index only
  // need it inside tiles the index does not mark full.
  ATTN_HD bool in_layout(int i, int j) const {
    return layout == nullptr || layout[int64_t(i / block) * n_kb + j / block] != 0;
  }
  // Top-k's rule on the logit s of (i, j), s = score(x, i, j) computed as the threshold pass
  // computed it: keep the k best, ties to the lower key. A NaN logit is kept (it must poison).
  ATTN_HD bool topk_keep(Acc s, int i, int j) const {
    if (topk_thr == nullptr) return true;
    const Acc t = topk_thr[i];
    return !(s < t) && (s != t || j <= topk_jcut[i]);
  }
  // Every element rule but top-k's (which needs the logit): the structural mask, the bool mask
  // and the layout.
  ATTN_HD bool allowed(int i, int j) const {
    if (!in_window(i, j)) return false;
    if (!in_layout(i, j)) return false;
    if (bias_kind == BiasKind::kBool) {
      return static_cast<const uint8_t*>(bias)[i * bias_row_stride + j * bias_col_stride] != 0;
    }
    return true;
  }
  // True when every (i, j) of the tile [i0, i1) x [j0, j1) is inside the window, so the
  // per-element structural checks can be skipped (they still apply a bool mask; the layout and
  // top-k are the block iterator's and the kernel's to check).
  ATTN_HD bool tile_full(int i0, int i1, int j0, int j1) const {
    if (i1 > len_q || j1 > len_k) return false;
    if (wl >= 0 && j0 < (i1 - 1) + diag - wl) return false;
    if (wr >= 0 && j1 - 1 > i0 + diag + wr) return false;
    return true;
  }
  // Keys any row of [i0, i1) may see: [*j0, *j1). Empty when *j0 >= *j1.
  ATTN_HD void key_range(int i0, int i1, int* j0, int* j1) const {
    int lo = 0, hi = len_k;
    if (wl >= 0) lo = imax(lo, i0 + diag - wl);
    if (wr >= 0) hi = imin(hi, (i1 - 1) + diag + wr + 1);
    *j0 = lo;
    *j1 = hi;
  }
  // The blocks of block_n keys that rows [i0, i1) may see: [*n_lo, *n_hi), empty when equal.
  ATTN_HD void key_blocks(int i0, int i1, int block_n, int* n_lo, int* n_hi) const {
    int j0, j1;
    key_range(i0, i1, &j0, &j1);
    j0 = imax(j0, 0);
    j1 = imin(j1, len_k);
    *n_lo = j0 / block_n;
    *n_hi = j0 < j1 ? (j1 + block_n - 1) / block_n : *n_lo;
  }
  // Query rows any key of [j0, j1) is seen by: [*i0, *i1).
  ATTN_HD void query_range(int j0, int j1, int* i0, int* i1) const {
    int lo = 0, hi = len_q;
    if (wr >= 0) lo = imax(lo, j0 - diag - wr);
    if (wl >= 0) hi = imin(hi, (j1 - 1) - diag + wl + 1);
    *i0 = lo;
    *i1 = hi;
  }

  // Whether some row may see key j (allowed: every element rule but top-k's). The int8 Q K^T's
  // smoothing and block scales leave out the keys that no row of a kv group sees, so a value
  // there, NaN included, reaches nothing, as in the float forward. This column form is the CUDA
  // quantize pass's (one thread per key); mark_seen_row is the same rule a row at a time (the
  // CPU's, which reads a bool bias in its row order).
  ATTN_HD bool key_seen(int j) const {
    int i0, i1;
    query_range(j, j + 1, &i0, &i1);
    if (j < 0 || j >= len_k || i0 >= i1) return false;
    // every row of [i0, i1) has j inside its window: without a layout, a bias the rows share (a
    // key mask) or none decides alone, with no walk over the rows
    if (layout == nullptr && bias_kind != BiasKind::kBool) return true;
    if (layout == nullptr && bias_row_stride == 0) {
      return static_cast<const uint8_t*>(bias)[j * bias_col_stride] != 0;
    }
    for (int i = i0; i < i1; ++i) {
      if (allowed(i, j)) return true;
    }
    return false;
  }
  // seen[j] made nonzero where allowed(i, j), for every key j of row i (other entries unchanged).
  // Rows whose key ranges meet cover one interval between them, so without a bool bias or a
  // layout a caller may mark key_range(0, len_q) at once instead.
  ATTN_HD void mark_seen_row(int i, uint8_t* seen) const {
    if (i < 0 || i >= len_q) return;
    int j0, j1;
    key_range(i, i + 1, &j0, &j1);
    j0 = imax(j0, 0);
    j1 = imin(j1, len_k);
    if (layout == nullptr && bias_kind == BiasKind::kBool) {
      const uint8_t* row = static_cast<const uint8_t*>(bias) + i * bias_row_stride;
      if (bias_col_stride == 1) {  // OR-ed bytes are nonzero iff one is: a loop compilers vectorize
        for (int j = j0; j < j1; ++j) seen[j] |= row[j];
      } else {
        for (int j = j0; j < j1; ++j) seen[j] |= uint8_t(row[j * bias_col_stride] != 0);
      }
    } else {
      for (int j = j0; j < j1; ++j) seen[j] |= uint8_t(allowed(i, j));
    }
  }

  // The logit for raw x = q.k. Softcap applies to the scaled product; ALiBi and the additive
  // bias come after it (the flash-attn and SDPA conventions).
  ATTN_HD Acc score(Acc x, int i, int j) const {
    Acc s = x * scale;
    if (softcap > Acc(0)) s = softcap * tanh_acc(s * inv_softcap);
    if (slope != Acc(0)) {
      const int dist = i + diag - j;
      s -= slope * Acc(dist < 0 ? -dist : dist);
    }
    if (bias_kind == BiasKind::kAdditive) {
      s += static_cast<const Acc*>(bias)[i * bias_row_stride + j * bias_col_stride];
    }
    return s;
  }
  // d score / d x, given x. Only softcap makes it non-constant: d/dx c*tanh(x*scale/c) =
  // scale * (1 - tanh^2).
  ATTN_HD Acc dscore_dx(Acc x) const {
    if (softcap > Acc(0)) {
      Acc t = tanh_acc(x * scale * inv_softcap);
      return scale * (Acc(1) - t * t);
    }
    return scale;
  }
};

using Policy = PolicyT<float>;

// What a call's options ask of a kernel, on the host before a launch (the device side reads the
// same through PolicyT). Plain: the score is the scaled product, masked by lengths, causal and
// the window alone (no softcap, ALiBi or bias). General: a plain-only kernel cannot serve the call
// (a score that is not plain, or dropout).
template <typename Acc>
ATTN_HD bool score_is_plain(const SoftmaxParamsT<Acc>& p) {
  return p.softcap <= Acc(0) && p.alibi_slopes == nullptr && p.bias_kind == BiasKind::kNone;
}
template <typename Acc>
ATTN_HD bool needs_general_kernel(const SoftmaxParamsT<Acc>& p) {
  return !score_is_plain(p) || p.dropout_p > 0.f;
}

}  // namespace attn
