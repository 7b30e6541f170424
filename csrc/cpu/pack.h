// Float32 (float64 on the float64 path) copies of K / V (and Q / dO in the backward) laid out
// for the GEMM micro-kernel.
//
// Packing once per (batch, kv head) costs O(S * D) and turns every later tile product into a
// unit-stride GEMM, whatever the input dtype and strides: (B, S, H, D) views, QKV
// slices and varlen packs all look the same after it. Extra memory stays O(B * H_k * S * D),
// never O(S^2).
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "common/policy.h"
#include "cpu/bf16dot.h"
#include "cpu/isa.h"
#include "cpu/memory.h"
#include "cpu/parallel.h"
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
  explicit PackIndex(const FwdParamsT<Acc>& p) : h_k(p.h_k), d(p.d), dp(padded_head_dim(p.d)) {
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
// elements. `row` is dp elements of scratch.
template <typename T>
inline void pack_one(DType dt, const void* src, int64_t rstride, int len, int64_t pad, int d, int dp,
                     PackLayout layout, int R, T* dst, T* row) {
  constexpr int P = kPanel<T>;
  const size_t es = dtype_size(dt);
  const char* base = static_cast<const char*>(src);
  for (int64_t j = 0; j < pad; ++j) {
    if (j < len) {
      load_row(dt, base + es * j * rstride, row, d, dp);
    } else {
      std::fill(row, row + dp, T(0));
    }
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
    }
  }
}

// pack_one for the pairs layouts (and kRows) in bf16: rows of dt = kBF16 copied as they are, no
// widening.
inline void pack_one_pairs(const void* src, int64_t rstride, int len, int64_t pad, int d, int dp, PackLayout layout,
                           int R, uint16_t* dst) {
  constexpr int Q = kDotPanel;
  const uint16_t* base = static_cast<const uint16_t*>(src);
  for (int64_t j = 0; j < pad; ++j) {
    // columns [0, n) from the row, [n, dp) zero: no per-element branch, so the copies vectorize
    const int n = j < len ? d : 0;
    const uint16_t* row = base + (j < len ? j : 0) * rstride;
    uint16_t* blk = dst + (j / R) * R * dp;
    const int jj = int(j % R);
    if (layout == PackLayout::kRows) {
      uint16_t* out = dst + j * dp;
      for (int c = 0; c < n; ++c) out[c] = row[c];
      for (int c = n; c < dp; ++c) out[c] = 0;
    } else if (layout == PackLayout::kTPairs) {
      // element c at word c / 2 of the key's column in its panel, words 2 Q elements apart
      uint16_t* pan = blk + int64_t(jj / Q) * dp * Q + (jj % Q) * 2;
      for (int c = 0; c < n; ++c) pan[(c / 2) * 2 * Q + c % 2] = row[c];
      for (int c = n; c < dp; ++c) pan[(c / 2) * 2 * Q + c % 2] = 0;
    } else {
      uint16_t* pr = blk + (jj / 2) * 2 * Q + jj % 2;
      for (int c = 0; c < n; ++c) pr[int64_t(c / Q) * R * Q + (c % Q) * 2] = row[c];
      for (int c = n; c < dp; ++c) pr[int64_t(c / Q) * R * Q + (c % Q) * 2] = 0;
    }
  }
}

// The element at offset `off` (in elements of dt) of a tensor: offsets come from SeqInfo.
template <typename Void>
inline auto elem(Void* base, DType dt, int64_t off) {
  using Char = typename std::conditional<std::is_const<Void>::value, const char, char>::type;
  return static_cast<Char*>(base) + dtype_size(dt) * off;
}

// Packs the key-side rows of every (batch, kv head) of a (B, H_k, S, D) tensor (K or V) in
// blocks of kBlockN rows.
// Out = uint16_t: the pairs layouts (bf16 in).
template <typename T, typename Out>
inline void pack_keys(const FwdParamsT<T>& p, DType dt, const void* base, int64_t bstride, int64_t hstride,
                      int64_t rstride, const PackIndex& idx, PackLayout layout, Out* out) {
  parallel_tasks(int64_t(p.b) * p.h_k, p.num_threads, [&] {
    return [&, row = Buffer<T>(idx.dp)](int64_t t) mutable {
      const int b = int(t / p.h_k), hh = int(t % p.h_k);
      const int64_t off = SeqInfo(p, b).k_offset(p, b, hh, 0, bstride, hstride, rstride);
      if constexpr (std::is_same<Out, uint16_t>::value) {
        pack_one_pairs(elem(base, dt, off), rstride, idx.len[b], idx.padded_len(b), idx.d, idx.dp, layout, kBlockN,
                       out + idx.offset(b, hh));
      } else {
        pack_one(dt, elem(base, dt, off), rstride, idx.len[b], idx.padded_len(b), idx.d, idx.dp, layout, kBlockN,
                 out + idx.offset(b, hh), row.data());
      }
    };
  });
}

ATTN_CPU_ISA_END
}  // namespace cpu
}  // namespace attn
