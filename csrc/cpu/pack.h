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

// The element at offset `off` (in elements of dt) of a tensor: offsets come from SeqInfo.
template <typename Void>
inline auto elem(Void* base, DType dt, int64_t off) {
  using Char = typename std::conditional<std::is_const<Void>::value, const char, char>::type;
  return static_cast<Char*>(base) + dtype_size(dt) * off;
}

// Packs the key-side rows of every (batch, kv head) of a (B, H_k, S, D) tensor (K or V) in
// blocks of kBlockN rows.
template <typename T>
inline void pack_keys(const FwdParamsT<T>& p, DType dt, const void* base, int64_t bstride, int64_t hstride,
                      int64_t rstride, const PackIndex& idx, PackLayout layout, T* out) {
  parallel_tasks(int64_t(p.b) * p.h_k, p.num_threads, [&] {
    return [&, row = Buffer<T>(idx.dp)](int64_t t) mutable {
      const int b = int(t / p.h_k), hh = int(t % p.h_k);
      const int64_t off = SeqInfo(p, b).k_offset(p, b, hh, 0, bstride, hstride, rstride);
      pack_one(dt, elem(base, dt, off), rstride, idx.len[b], idx.padded_len(b), idx.d, idx.dp, layout, kBlockN,
               out + idx.offset(b, hh), row.data());
    };
  });
}

ATTN_CPU_ISA_END
}  // namespace cpu
}  // namespace attn
