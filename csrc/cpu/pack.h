// Float32 (float64 on the float64 path) copies of K / V (and Q / dO in the backward) laid out
// for the GEMM micro-kernel.
//
// Packing once per (batch, kv head) costs O(S * D) and turns every later tile product into a
// unit-stride GEMM, whatever the input dtype and strides: (B, S, H, D) views, QKV
// slices and varlen packs all look the same after it. Extra memory stays O(B * H_k * S * D),
// never O(S^2).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/policy.h"
#include "cpu/bf16dot.h"
#include "cpu/isa.h"
#include "cpu/memory.h"
#include "cpu/parallel.h"
#include "cpu/q8dot.h"
#include "cpu/simd.h"

namespace attn {
namespace cpu {
ATTN_CPU_ISA_BEGIN

constexpr int kBlockM = 48;  // query rows per task: 8 whole 6-row micro-kernel blocks, no remainder
constexpr int kBlockN = 128;  // keys per tile; a multiple of kPanel so tile rows are whole panels

// Head dim padded to whole GEMM panels (kPanel<float> = 2W floats, a multiple of kPanel<double>),
// so every product over the head dim runs the full-width micro-kernel. Zero columns cost only in
// P @ V-like products, and only for head dims that are not a multiple of 2W.
inline int padded_head_dim(int d) { return round_up(d, 2 * W); }

// Where the packed rows of each (batch, kv head) start. Sequences are padded to whole key
// blocks, so every tile reads kBlockN rows (the pad is zero, and masked by the policy).
struct PackIndex {
  int h_k = 0, d = 0, dp = 0;  // dp: padded_head_dim(d)
  std::vector<int64_t> row0;   // (B + 1) padded key rows of the sequences before b
  std::vector<int> len;        // (B) key length of sequence b

  template <typename Acc>
  explicit PackIndex(const SoftmaxParamsT<Acc>& p) : h_k(p.h_k), d(p.d), dp(padded_head_dim(p.d)) {
    row0.assign(p.b + 1, 0);
    len.assign(p.b, 0);
    for (int b = 0; b < p.b; ++b) {
      SeqInfo s(p, b);
      len[b] = s.len_k;
      row0[b + 1] = row0[b] + round_up(len[b] > 0 ? len[b] : 0, kBlockN);
    }
  }
  int64_t padded_len(int b) const { return row0[b + 1] - row0[b]; }
  // first element of (b, kv head) in a packed array
  int64_t offset(int b, int head) const { return (row0[b] * h_k + int64_t(head) * padded_len(b)) * dp; }
  int64_t total() const { return row0.back() * h_k * dp; }
};

// P = kPanel<T>, the micro-kernel's width. Every layout stores `pad` rows in pad * dp elements,
// block r / R starting at element (r / R) * R * dp, so one offset rule serves all three.
enum class PackLayout {
  kRows,     // (pad, dp) row-major: the A operand of Q @ K^T and dO @ V^T
  kPanels,   // per block of R rows, dp / P column panels of (R, P) each: the B operand of P @ V,
             // dS @ K, P^T @ dO and dS^T @ Q (gemm ldb = P, bpanel = R * P)
  kTPanels,  // per block of R rows, the block transposed and cut into R / P key panels of (dp, P)
             // each: the B operand of Q @ K^T and dO @ V^T (gemm ldb = P, bpanel = dp * P)
  // bf16 elements for the bf16 dot products (cpu/bf16dot.h's pairs layouts, Q = kDotPanel):
  kTPairs,   // kTPanels with (c, c + 1) pairs side by side: key panels of (dp / 2, Q, 2), the B
             // operand of Q @ K^T (gemm_dp bpanel = dp * Q)
  kPairs,    // kPanels with the key pairs (j, j + 1) side by side: per block of R rows, dp / Q
             // column panels of (R / 2, Q, 2), the B operand of P @ V (gemm_dp bpanel = R * Q)
};

// Packs rows [0, len) of one (batch, head) slice `src` (row stride rstride, dtype dt) into
// `dst` in `layout` with blocks of R rows, zero-padding to `pad` rows (a multiple of R) of dp
// elements. `row` is dp elements of scratch. Rows [len, zero_end) are written as zeros (zero_end
// -1: the whole pad); rows past zero_end are left as they are, for readers that never read them
// (pack_keys' kPanelRows).
//
// Small calls are where packing shows: at (1, 8, 16, 64) the 16 keys pad to a whole kBlockN
// block of 128 rows, and writing that pad element by element (kTPanels' transposed stores) was
// half of the forward. So the zero rows are whole-memory fills where the layout keeps them
// contiguous, and kTPanels' float rows go 8 at a time through an 8 x 8 register transpose.
template <typename T>
inline void pack_one(DType dt, const void* src, int64_t rstride, int len, int64_t pad, int d, int dp,
                     PackLayout layout, int R, T* dst, T* row, int64_t zero_end = -1) {
  constexpr int P = kPanel<T>;
  const size_t es = dtype_size(dt);
  const char* base = static_cast<const char*>(src);
  const int64_t n = std::max<int64_t>(0, std::min<int64_t>(len, pad));
  zero_end = zero_end < 0 ? pad : std::max(n, std::min(zero_end, pad));
  auto put = [&](int64_t j) {
    T* blk = dst + (j / R) * R * dp;
    const int jj = int(j % R);
    switch (layout) {
      case PackLayout::kRows: std::copy(row, row + dp, dst + j * dp); break;
      case PackLayout::kPanels:
        for (int c0 = 0; c0 < dp; c0 += P) std::copy(row + c0, row + c0 + P, blk + int64_t(c0) * R + jj * P);
        break;
      case PackLayout::kTPanels: {
        T* pan = blk + int64_t(jj / P) * dp * P + jj % P;
        for (int c = 0; c < dp; ++c) pan[c * P] = row[c];
        break;
      }
      default: break;  // the pairs layouts are pack_one_pairs'
    }
  };
  int64_t j = 0;
#if defined(__AVX__)
  if constexpr (std::is_same<T, float>::value) {
    // 8 keys of one panel at a time: their rows in `rows8`, transposed into the panel's (dp, P)
    // columns by simd.h's transpose (8 x 8 blocks in registers; P and dp are multiples of 8)
    constexpr int kMaxDp = 256;
    if (layout == PackLayout::kTPanels && R % P == 0 && P % 8 == 0 && dp % 8 == 0 && dp <= kMaxDp) {
      alignas(64) float rows8[8 * kMaxDp];
      for (; j + 8 <= n; j += 8) {
        for (int r = 0; r < 8; ++r) load_row(dt, base + es * (j + r) * rstride, rows8 + r * dp, d, dp);
        const int jj = int(j % R);
        transpose(rows8, 8, dp, dp, dst + (j / R) * R * dp + int64_t(jj / P) * dp * P + jj % P, P,
                  /*keep_rest=*/true);
      }
    }
  }
#endif
  for (; j < n; ++j) {
    load_row(dt, base + es * j * rstride, row, d, dp);
    put(j);
  }
  if (n >= zero_end) return;
  // the zero rows [n, zero_end)
  switch (layout) {
    case PackLayout::kRows: std::fill(dst + n * dp, dst + zero_end * dp, T(0)); return;
    case PackLayout::kPanels: {
      // in each column panel of the block holding row n, its rows from n on are contiguous; the
      // whole blocks after that are contiguous too
      const int64_t b0 = n / R * R, end_blk = std::min(zero_end, b0 + R);
      T* blk = dst + b0 * dp;
      const int j0 = int(n - b0), j1 = int(end_blk - b0);
      for (int c0 = 0; c0 < dp; c0 += P) std::fill(blk + int64_t(c0) * R + j0 * P, blk + int64_t(c0) * R + j1 * P, T(0));
      j = std::max(end_blk, zero_end / R * R);
      std::fill(dst + end_blk * dp, dst + j * dp, T(0));
      break;  // a partial last block: row by row below
    }
    case PackLayout::kTPanels:
      if (R % P == 0) {
        // key panels of P rows are contiguous (dp * P elements each) across blocks: the rest of
        // the partial panel holding row n row by row, then the whole panels at once
        const int64_t whole = std::min<int64_t>(zero_end, (n + P - 1) / P * P);
        if (whole > n) {  // in the panel's (dp, P) columns, keys n % P .. are contiguous
          T* pan = dst + n / P * dp * P;
          const int k0 = int(n % P), k1 = int(whole - n / P * P);
          for (int c = 0; c < dp; ++c) std::fill(pan + c * P + k0, pan + c * P + k1, T(0));
        }
        j = std::max(whole, zero_end / P * P);
        std::fill(dst + whole * dp, dst + j * dp, T(0));
        break;
      }
      j = n;
      break;
    default: j = n; break;
  }
  std::fill(row, row + dp, T(0));
  for (; j < zero_end; ++j) put(j);
}

// pack_one for the pairs layouts (and kRows) in bf16: rows of dt = kBF16 copied as they are, no
// widening.
inline void pack_one_pairs(const void* src, int64_t rstride, int len, int64_t pad, int d, int dp, PackLayout layout,
                           int R, uint16_t* dst, int64_t zero_end = -1) {
  constexpr int Q = kDotPanel;
  const uint16_t* base = static_cast<const uint16_t*>(src);
  const int64_t n = std::max<int64_t>(0, std::min<int64_t>(len, pad));
  zero_end = zero_end < 0 ? pad : std::max(n, std::min(zero_end, pad));
  // row j: columns [0, m) from src row j, [m, dp) zero (m = 0: a pad row); no per-element
  // branch, so the copies vectorize
  auto put = [&](int64_t j, int m) {
    const uint16_t* row = base + (m > 0 ? j : 0) * rstride;
    uint16_t* blk = dst + (j / R) * R * dp;
    const int jj = int(j % R);
    if (layout == PackLayout::kRows) {
      uint16_t* out = dst + j * dp;
      for (int c = 0; c < m; ++c) out[c] = row[c];
      for (int c = m; c < dp; ++c) out[c] = 0;
    } else if (layout == PackLayout::kTPairs) {
      // element c at word c / 2 of the key's column in its panel, words 2 Q elements apart
      uint16_t* pan = blk + int64_t(jj / Q) * dp * Q + (jj % Q) * 2;
      for (int c = 0; c < m; ++c) pan[(c / 2) * 2 * Q + c % 2] = row[c];
      for (int c = m; c < dp; ++c) pan[(c / 2) * 2 * Q + c % 2] = 0;
    } else {
      uint16_t* pr = blk + (jj / 2) * 2 * Q + jj % 2;
      for (int c = 0; c < m; ++c) pr[int64_t(c / Q) * R * Q + (c % Q) * 2] = row[c];
      for (int c = m; c < dp; ++c) pr[int64_t(c / Q) * R * Q + (c % Q) * 2] = 0;
    }
  };
  for (int64_t j = 0; j < n; ++j) put(j, d);
  // the zero rows [n, zero_end), as whole fills where the layout keeps them contiguous (pack_one)
  int64_t j = n;
  if (layout == PackLayout::kRows) {
    std::fill(dst + n * dp, dst + zero_end * dp, uint16_t(0));
    return;
  }
  if (layout == PackLayout::kTPairs && R % Q == 0) {
    // key panels of Q rows, dp * Q elements each, contiguous across blocks
    for (; j < zero_end && j % Q != 0; ++j) put(j, 0);
    const int64_t end = std::max(j, zero_end / Q * Q);
    std::fill(dst + j * dp, dst + end * dp, uint16_t(0));
    j = end;
  } else if (layout == PackLayout::kPairs && R % 2 == 0) {
    // in each column panel of a block, the key pairs from an even row on are contiguous
    for (; j < zero_end && j % 2 != 0; ++j) put(j, 0);
    if (j < zero_end) {
      const int64_t b0 = j / R * R, end_blk = std::min(zero_end, b0 + R) / 2 * 2;
      uint16_t* blk = dst + b0 * dp;
      for (int c0 = 0; c0 < dp; c0 += Q) {
        std::fill(blk + int64_t(c0) * R + (j - b0) * Q, blk + int64_t(c0) * R + (end_blk - b0) * Q, uint16_t(0));
      }
      j = std::max(end_blk, j);
      if (j == b0 + R) {  // whole blocks after
        const int64_t end = std::max(j, zero_end / R * R);
        std::fill(dst + j * dp, dst + end * dp, uint16_t(0));
        j = end;
      }
    }
  }
  for (; j < zero_end; ++j) put(j, 0);
}

// The element at offset `off` (in elements of dt) of a tensor: offsets come from SeqInfo.
template <typename Void>
inline auto elem(Void* base, DType dt, int64_t off) {
  using Char = typename std::conditional<std::is_const<Void>::value, const char, char>::type;
  return static_cast<Char*>(base) + dtype_size(dt) * off;
}

// The rows past a sequence's end that pack_keys writes as zeros: readers that cut their key
// tiles at a panel past the last key (the forward: tile.h's for_key_tiles reads up to the next
// multiple of kPanel<T>, the bf16 pairs up to kDotPanel) need only those; readers of whole
// kBlockN blocks (top-k's threshold pass) need the whole pad.
enum class PackPad { kPanelRows, kWholeBlocks };
constexpr int kPackPanelRows = 32;  // a multiple of every panel width: kPanel<float> = 2W <= 32, kDotPanel
static_assert(kBlockN % kPackPanelRows == 0 && kDotPanel <= kPackPanelRows && 2 * W <= kPackPanelRows,
              "the zeroed rows of a short pack must cover every reader's panel");

// Packs the key-side rows of every (batch, kv head) of a (B, H_k, S, D) tensor (K or V) in
// blocks of kBlockN rows.
// Out = uint16_t: the pairs layouts (bf16 in).
template <typename T, typename Out>
inline void pack_keys(const SoftmaxParamsT<T>& p, DType dt, const void* base, int64_t bstride, int64_t hstride,
                      int64_t rstride, const PackIndex& idx, PackLayout layout, Out* out,
                      PackPad pad = PackPad::kWholeBlocks) {
  parallel_tasks(int64_t(p.b) * p.h_k, p.num_threads, [&] {
    return [&, row = Buffer<T>(idx.dp)](int64_t t) mutable {
      const int b = int(t / p.h_k), hh = int(t % p.h_k);
      const int64_t off = SeqInfo(p, b).k_offset(p, b, hh, 0, bstride, hstride, rstride);
      const int64_t zero_end =
          pad == PackPad::kWholeBlocks ? -1 : (std::max(idx.len[b], 0) + kPackPanelRows - 1) / kPackPanelRows * kPackPanelRows;
      if constexpr (std::is_same<Out, uint16_t>::value) {
        pack_one_pairs(elem(base, dt, off), rstride, idx.len[b], idx.padded_len(b), idx.d, idx.dp, layout, kBlockN,
                       out + idx.offset(b, hh), zero_end);
      } else {
        pack_one(dt, elem(base, dt, off), rstride, idx.len[b], idx.padded_len(b), idx.d, idx.dp, layout, kBlockN,
                 out + idx.offset(b, hh), row.data(), zero_end);
      }
    };
  });
}

// K for the forward's int8 Q K^T (cpu/q8dot.h), packed per (batch, kv head) in blocks of kBlockN
// rows like the float layouts (same PackIndex offsets, in bytes):
//   mean  (B, H_k, dp) float32: the mean of the sequence's keys, summed in float64 (SageAttention's
//         smoothing: q . k = q . (k - mean) + q . mean, and k - mean has a smaller range to round);
//   scale one float32 per block of kBlockN keys, amax |k - mean| / 127 over the block's keys and d
//         channels (the non-finite rule: q8dot.h);
//   keys  uint8 rint((k - mean) 127 / amax) + 128 in q8dot.h's quads layout; pad rows and
//         channels hold 128 (a signed 0).
// The rounding is the one reference.qk_int8_scores states, float32 op for op, so the integer
// keys here and there agree (but where the two float64 sums of the mean, in different orders,
// round to different float32: a tie, which no test has met).
// Keys that no row of any head of the kv group may see (q8_seen_keys: lengths, causal, the window,
// a bool mask, the block layout) take no part in the mean or the scales and are stored as 0: a
// padding key's values, NaN included, reach nothing (every row's score for it is -inf), as in the
// float forward.
struct Q8Keys {
  const uint8_t* keys = nullptr;
  const float* scale = nullptr;  // scale[offset(b, h) / (dp kBlockN) + j / kBlockN]
  const float* mean = nullptr;   // mean[(b H_k + h) dp + c]
};
inline int64_t q8_scale_count(const PackIndex& idx) { return idx.row0.back() * idx.h_k / kBlockN; }

// seen[j] = 1 for the keys j < len_k of (b, kv head hh) that some row of some head of its group
// may see (PolicyT::key_seen's rule, a row at a time), else 0. Without a bool bias or a layout
// that is one interval; a bias shared by the rows (a key mask) is read once, one shared by the
// heads once per group.
template <typename T>
inline void q8_seen_keys(const SoftmaxParamsT<T>& p, int b, int hh, uint8_t* seen) {
  const SeqInfo s(p, b);
  const int len_k = std::max(s.len_k, 0), group = p.h / p.h_k;
  std::fill(seen, seen + len_k, uint8_t(0));
  const bool mask = p.bias_kind == BiasKind::kBool, layout = p.sparse.on();
  const int heads = layout || (mask && p.bias_head_stride != 0) ? group : 1;
  for (int g = 0; g < heads; ++g) {
    const PolicyT<T> pol(p, s, b, hh * group + g);
    if (pol.len_q <= 0) continue;
    int j0, j1;
    pol.key_range(0, pol.len_q, &j0, &j1);
    j0 = std::max(j0, 0);
    j1 = std::min(j1, len_k);
    if (!mask && !layout) {
      for (int j = j0; j < j1; ++j) seen[j] = 1;
    } else if (!layout && p.bias_row_stride == 0) {
      const uint8_t* row = static_cast<const uint8_t*>(pol.bias);
      for (int j = j0; j < j1; ++j) seen[j] |= uint8_t(row[j * p.bias_col_stride] != 0);
    } else {
      for (int i = 0; i < pol.len_q; ++i) pol.mark_seen_row(i, seen);
    }
  }
}

template <typename T>
inline void pack_keys_q8(const SoftmaxParamsT<T>& p, DType dt, const PackIndex& idx, uint8_t* keys, float* scale,
                         float* mean) {
  constexpr int P = kQ8Panel;
  static_assert(kBlockN % P == 0, "a key block is whole q8 panels");
  const int d = idx.d, dp = idx.dp;
  const size_t es = dtype_size(dt);
  parallel_tasks(int64_t(p.b) * p.h_k, p.num_threads, [&] {
    return [&, blk = Buffer<float>(size_t(kBlockN) * dp), sum = std::vector<double>(dp),
            row = Buffer<int8_t>(dp), seen = std::vector<uint8_t>()](int64_t t) mutable {
      const int b = int(t / p.h_k), hh = int(t % p.h_k);
      const int len = std::max(idx.len[b], 0);
      const char* src =
          elem(p.k, dt, SeqInfo(p, b).k_offset(p, b, hh, 0, p.k_batch_stride, p.k_head_stride, p.k_row_stride));
      seen.resize(size_t(len));
      q8_seen_keys(p, b, hh, seen.data());
      auto hidden = [&](int64_t j) { return seen[size_t(j)] == 0; };
      float* mu = mean + (int64_t(b) * p.h_k + hh) * dp;
      std::fill(sum.begin(), sum.end(), 0.0);
      int64_t count = 0;
      for (int j = 0; j < len; ++j) {
        if (hidden(j)) continue;
        load_row(dt, src + es * j * p.k_row_stride, blk.data(), d, dp);
        for (int c = 0; c < d; ++c) sum[c] += blk[c];
        ++count;
      }
      for (int c = 0; c < dp; ++c) mu[c] = c < d && count > 0 ? float(sum[c] / double(count)) : 0.f;
      const int64_t base = idx.offset(b, hh);
      for (int64_t j0 = 0; j0 < idx.padded_len(b); j0 += kBlockN) {
        const int n = int(std::max<int64_t>(0, std::min<int64_t>(len - j0, kBlockN)));
        for (int r = 0; r < n; ++r) {  // k - mean, rows of dp (the pad channels stay 0); hidden keys 0
          float* x = blk.data() + size_t(r) * dp;
          if (hidden(j0 + r)) {
            std::fill(x, x + dp, 0.f);
            continue;
          }
          load_row(dt, src + es * (j0 + r) * p.k_row_stride, x, d, dp);
          for (int c = 0; c < dp; c += kLanes<float>) vstore(x + c, vload(x + c) - vload(mu + c));
        }
        const float amax = q8_amax(blk.data(), int64_t(n) * dp);
        scale[(base / dp + j0) / kBlockN] = q8_scale(amax);
        const float inv = q8_inv(amax);
        uint8_t* dst = keys + base + j0 * dp;
        std::memset(dst, kQ8Bias, size_t(kBlockN) * dp);
        for (int r = 0; r < n; ++r) {
          q8_round(blk.data() + size_t(r) * dp, dp, inv, row.data());
          // + 128, one channel quad (a 32-bit word) at a time into the key's column of its panel
          uint8_t* col = dst + int64_t(r / P) * dp * P + (r % P) * 4;
          for (int c = 0; c < dp; c += 4) {
            uint32_t w;
            std::memcpy(&w, row.data() + c, 4);
            w ^= 0x80808080u;  // two's complement byte + 128 = its top bit flipped
            std::memcpy(col + (c / 4) * 4 * P, &w, 4);
          }
        }
      }
    };
  });
}

ATTN_CPU_ISA_END
}  // namespace cpu
}  // namespace attn
