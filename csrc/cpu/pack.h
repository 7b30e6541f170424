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

#include "../common/policy.h"
#include "parallel.h"
#include "simd.h"

namespace attn {
namespace cpu {

constexpr int kBlockM = 48;  // query rows per task: 8 whole 6-row micro-kernel blocks, no remainder
constexpr int kBlockN = 128;  // keys per tile; a multiple of 2 * W so tile rows are whole panels

// Where the packed rows of each (batch, kv head) start. Sequences are padded to whole key
// blocks, so every tile reads kBlockN rows (the pad is zero, and masked by the policy).
struct PackIndex {
  int h_k = 0, d = 0, dp = 0;  // dp: head dim padded to a multiple of W
  std::vector<int64_t> row0;   // (B + 1) padded key rows of the sequences before b
  std::vector<int> len;        // (B) key length of sequence b

  template <typename Acc>
  explicit PackIndex(const FwdParamsT<Acc>& p) : h_k(p.h_k), d(p.d), dp(round_up(p.d, W)) {
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

enum class PackLayout {
  kRows,     // (S_pad, dp) row-major: the B operand of P @ V, dS @ K, or the A operand of Q @ .
  kTBlocks,  // per kBlockN rows, the block transposed to (d, kBlockN): the B operand of Q @ K^T
};

// Packs rows [row0, row0 + len) of one (batch, head) slice `src` (row stride rstride, dtype
// dt) into `dst`, zero-padding to `pad` rows of dp elements.
template <typename T>
inline void pack_one(DType dt, const void* src, int64_t rstride, int len, int64_t pad, int d, int dp,
                     PackLayout layout, T* dst, T* row) {
  const size_t es = dtype_size(dt);
  const char* base = static_cast<const char*>(src);
  for (int64_t j = 0; j < pad; ++j) {
    if (j < len) {
      load_row(dt, base + es * j * rstride, row, d, dp);
    } else {
      std::fill(row, row + dp, T(0));
    }
    if (layout == PackLayout::kRows) {
      std::copy(row, row + dp, dst + j * dp);
    } else {
      // block jb = j / kBlockN holds (d, kBlockN) at dst + jb * dp * kBlockN
      T* blk = dst + (j / kBlockN) * int64_t(dp) * kBlockN;
      const int jj = int(j % kBlockN);
      for (int c = 0; c < d; ++c) blk[c * kBlockN + jj] = row[c];
    }
  }
}

// The element at offset `off` (in elements of dt) of a tensor: offsets come from SeqInfo.
template <typename Void>
inline auto elem(Void* base, DType dt, int64_t off) {
  using Char = typename std::conditional<std::is_const<Void>::value, const char, char>::type;
  return static_cast<Char*>(base) + dtype_size(dt) * off;
}

// Packs the key-side rows of every (batch, kv head) of a (B, H_k, S, D) tensor (K or V).
template <typename T>
inline void pack_keys(const FwdParamsT<T>& p, DType dt, const void* base, int64_t bstride, int64_t hstride,
                      int64_t rstride, const PackIndex& idx, PackLayout layout, T* out) {
  parallel_tasks(int64_t(p.b) * p.h_k, p.num_threads, [&] {
    return [&, row = std::vector<T>(idx.dp)](int64_t t) mutable {
      const int b = int(t / p.h_k), hh = int(t % p.h_k);
      const int64_t off = SeqInfo(p, b).k_offset(p, b, hh, 0, bstride, hstride, rstride);
      pack_one(dt, elem(base, dt, off), rstride, idx.len[b], idx.padded_len(b), idx.d, idx.dp, layout,
               out + idx.offset(b, hh), row.data());
    };
  });
}

}  // namespace cpu
}  // namespace attn
