// Counter-based dropout RNG shared by every backend.
//
// Philox4x32-10 (Salmon et al., SC'11): a keyed bijection of a 128-bit counter. The keep/drop
// decision for element (b, h, i, j) is a pure function of (seed, offset, b, h, i, j), so the
// CPU and CUDA kernels, the forward and the backward, and attention_ext.dropout_mask() all
// agree bit for bit, with no state and no storage of the mask.
#pragma once

#include <cstdint>

#include "hd.h"

namespace attn {

struct Philox4 {
  uint32_t x[4];
};

ATTN_HD void mulhilo32(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  uint64_t prod = uint64_t(a) * uint64_t(b);
  *hi = uint32_t(prod >> 32);
  *lo = uint32_t(prod);
}

ATTN_HD Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                              uint32_t k1) {
  // round constants from the Philox paper
  const uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  const uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(kM0, c0, &hi0, &lo0);
    mulhilo32(kM1, c2, &hi1, &lo1);
    uint32_t n0 = hi1 ^ c1 ^ k0;
    uint32_t n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  Philox4 r;
  r.x[0] = c0;
  r.x[1] = c1;
  r.x[2] = c2;
  r.x[3] = c3;
  return r;
}

// One Philox call yields the uniforms of 4 consecutive keys j = 4m .. 4m + 3 of row i.
// u in [0, 1) with 24 random bits; the element is kept when u >= p.
ATTN_HD Philox4 dropout_bits4(uint64_t seed, uint64_t offset, int bh, int i, int j4) {
  return philox4x32_10(uint32_t(j4), uint32_t(i), uint32_t(bh), uint32_t(offset),
                       uint32_t(seed), uint32_t(seed >> 32) ^ uint32_t(offset >> 32));
}

ATTN_HD bool dropout_keep_bits(uint32_t bits, float p) {
  return float(bits >> 8) * (1.0f / 16777216.0f) >= p;
}

// Word k (0..3) of a Philox result by selects, not a run-time array index: on a GPU an indexed
// r.x[k] puts r in local memory (a 16-byte stack frame and local loads per element in every
// kernel that inlines it).
ATTN_HD uint32_t philox_word(const Philox4& r, int k) {
  const uint32_t lo = (k & 1) ? r.x[1] : r.x[0];
  const uint32_t hi = (k & 1) ? r.x[3] : r.x[2];
  return (k & 2) ? hi : lo;
}

ATTN_HD bool dropout_keep(uint64_t seed, uint64_t offset, int bh, int i, int j, float p) {
  Philox4 r = dropout_bits4(seed, offset, bh, i, j >> 2);
  return dropout_keep_bits(philox_word(r, j & 3), p);
}

// Dropout at the coordinates of a larger problem. A kernel call that computes one piece of a
// bigger attention (context parallelism: this rank's queries against one visiting key shard, or
// this rank's heads of the whole sequence) draws the decision of its local element (bh, i, j) at
// the big problem's (bh_map[bh], rows[i], cols[j]), so the pieces together drop exactly what one
// call on the whole problem drops. Null pointers mean identity (an ordinary call). Local indices
// past n_rows / n_cols (a tile's tail, always masked) are not looked up.
struct DropoutCoords {
  const int32_t* bh;    // (B * H) the global b * H_global + h of each local (b, h)
  const int32_t* rows;  // (n_rows) the global query index of each local row
  const int32_t* cols;  // (n_cols) the global key index of each local key
  int32_t n_rows, n_cols;

  ATTN_HD bool identity() const { return bh == nullptr; }  // all three are given together
  ATTN_HD int global_bh(int x) const { return bh == nullptr ? x : bh[x]; }
  ATTN_HD int row(int i) const { return rows == nullptr || i >= n_rows ? i : rows[i]; }
  ATTN_HD int col(int j) const { return cols == nullptr || j >= n_cols ? j : cols[j]; }
};

// The keep decision of local element (bh, i, j) under `c` (one Philox draw per element).
ATTN_HD bool dropout_keep_at(uint64_t seed, uint64_t offset, const DropoutCoords& c, int bh, int i, int j,
                             float p) {
  return dropout_keep(seed, offset, c.global_bh(bh), c.row(i), c.col(j), p);
}

}  // namespace attn
