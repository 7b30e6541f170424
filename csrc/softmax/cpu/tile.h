// The softmax family's CPU tile plumbing, over the online softmax of cpu/online_softmax.h: which
// products a call takes (direct rows, bf16 dot products), the keys a tile hides from its rows, and
// the key / query tiles of the dense and block-sparse walks. Shared by the CPU forward and
// backward.
#pragma once

#include <cmath>
#include <limits>

#include "cpu/isa.h"
#include "cpu/online_softmax.h"
#include "cpu/pack.h"
#include "cpu/simd.h"

namespace attn {
namespace cpu {
ATTN_CPU_ISA_BEGIN

// ---------------------------------------------------------------- hidden keys
// A tile that may hide some of its keys from some rows (a partial mask, causal edge, padding,
// top-k) records, per row, which ones scores() hid: bit jj of the row's kMaskWords words is set
// where its logit is -inf. P V and dS K are gemm products, in which a hidden key still costs
// 0 * its row; if that row holds a NaN or an inf, the product is NaN in every row of the tile.
// Where a product comes out NaN, the kernels redo it leaving hidden keys out (simd.h's
// gemm_skipping, the same bits where nothing was hidden), so a value no row reads never reaches
// an output: only the rows that read a NaN show it.
constexpr int kMaskWords = kBlockN / 64;

template <typename T>
inline void hidden_keys(const T* srow, int n, uint64_t* bits) {
  const vec<T> ninf = vbcast(-std::numeric_limits<T>::infinity());
  std::fill(bits, bits + kMaskWords, uint64_t(0));
  for (int c = 0; c < n; c += kLanes<T>) bits[c / 64] |= uint64_t(lane_bits(vload(srow + c) == ninf)) << (c % 64);
}

inline bool key_hidden(const uint64_t* bits, int jj) { return (bits[jj >> 6] >> (jj & 63)) & 1u; }

// ---------------------------------------------------------------- which products
// At most this many query rows per sequence (decode steps, short prompts): the forward reads
// K / V in place, row by row, instead of packed. Packing costs a read and a write of all of K / V
// plus the pad to whole key blocks, and pays off only when many query rows reuse each packed
// block; with one query row it was most of the call
// (benchmarks/results/2026-11-29-figures-from-comments.md). Top-k needs the logits bit for bit
// as its threshold pass computed them, with the packed GEMM.
constexpr int kDirectMaxRows = 8;
template <typename T>
inline bool direct_mode(const SoftmaxParamsT<T>& p) {
  return p.sq <= kDirectMaxRows && p.topk_thr == nullptr && p.qk_quant == 0;  // int8 Q K^T: packed K
}

// bf16 inputs on a level with AVX512-BF16 take the bf16 dot products (cpu/bf16dot.h) for the
// forward's Q K^T and P V and the backward's Q K^T and dO V^T. The forward and the backward
// decide alike, so the backward recomputes the forward's logits bit for bit (a lone visible key
// keeps P = 1 exactly). Not the direct mode (few rows: bandwidth-bound, float32) nor top-k
// (float32 logits, as its threshold pass). attention_ext.set_cpu_isa("avx512") forces the
// widening path on such a CPU.
template <typename T>
inline bool bf16_dot(const SoftmaxParamsT<T>& p, DType dt) {
  return kBf16Dot && std::is_same<T, float>::value && dt == DType::kBF16 && !direct_mode(p) &&
         p.topk_thr == nullptr;
}

// ---------------------------------------------------------------- the block-sparse walk's tiles
// The packed operands (pack.h) are blocked by R rows, so a sub-tile of the walk must not cross
// an R boundary, and key tiles start on a kPanel boundary (the K^T panels). Layout blocks are
// multiples of 16 rows; where kPanel is wider (AVX-512 float) the first tile of a block starts
// a little early and the keys before the block are masked (`lo` below).

// The key tiles covering the valid keys [c0, c1) (c0 < c1): f(j0, n, lo, hi) for keys
// [j0, j0 + n), of which [lo, hi) are valid. Each tile starts on a kPanel boundary; all but the
// last are whole panels, and the last ends at the next multiple of `end_step` (kPanel<T>, or
// kFwdKeyStep<T> in the forward).
template <typename T, typename F>
inline void for_key_tiles(int c0, int c1, F&& f, int end_step = kPanel<T>) {
  constexpr int P = kPanel<T>;
  const int end = round_up(c1, end_step);
  for (int j = c0 / P * P; j < end;) {
    const int jn = std::min(end, (j / kBlockN + 1) * kBlockN);
    f(j, jn - j, std::max(c0, j), std::min(c1, jn));
    j = jn;
  }
}

// The forward's last key tile ends at the next whole vector, not the next whole panel (two
// vectors): gemm computes a one-vector remainder, and the row operations and the dropout (4 keys
// a draw) step by vectors. At 16 keys on AVX-512 the panel would double the tile's products. The
// extra keys are masked, so their P is 0 and the results are bit for bit the panel-wide tile's.
template <typename T>
constexpr int kFwdKeyStep = kLanes<T> >= 4 ? kLanes<T> : kPanel<T>;

// The query tiles of rows [r0, r1), cut at kBlockM boundaries: f(i0, rows).
template <typename F>
inline void for_query_tiles(int r0, int r1, F&& f) {
  for (int i = r0; i < r1;) {
    const int in = std::min(r1, (i / kBlockM + 1) * kBlockM);
    f(i, in - i);
    i = in;
  }
}

// Row j of a kPanels operand blocked by R rows (pack.h), as the B operand of a product over
// rows: the panels of its block are R * kP apart. A kPairs operand (bf16, kP = kDotPanel) too,
// for even j: its row pair j / 2 is 2 kDotPanel elements.
template <typename T, int kP = kPanel<T>>
inline const T* panel_row(const T* base, int j, int R, int dp) {
  return base + int64_t(j / R) * R * dp + int64_t(j % R) * kP;
}

ATTN_CPU_ISA_END
}  // namespace cpu
}  // namespace attn
