// Hidden keys and non-finite values in the tensor-core kernels (README, NaN policy).
//
// An mma.sync product has no per-row skip: a key the policy hides from some rows of a tile (a
// bool mask, key_padding_mask, a causal / window edge, a block-sparse layout) still enters P V
// with P = 0 and dQ = dS K with dS = 0, and 0 x NaN / inf = NaN reaches rows that never read the
// key. Where a tile may hide keys (tile_may_hide), the kernels zero the bad elements of that
// operand in shared memory before the product (scan_nonfinite, one pass over the tile and a block
// vote), so a hidden key adds exact zeros and the rows that never read it keep every bit:
//   forward  P V:  V's NaN / inf elements are zeroed; a row that reads a zeroed element v(j, c) gets
//                  acc_o(i, c) += v(j, c) back from global memory (fwd_kernel.cuh);
//   dQ      dS K:  K's NaN / inf elements are zeroed for this product only, in every tile. A
//                  key whose k row holds one has dS = 0 or NaN in every row: q.k is +-inf or NaN,
//                  so a row that reads it is NaN (+inf, NaN), has P = 0 (-inf) or sits at
//                  softcap's zero derivative (+-cap), and a row it is hidden from selects 0. The
//                  zeros give the CPU's result (its zero terms left out), never 0 x inf. The dQ
//                  kernel zeroes its tile after S and dP were computed from it. The dK / dV
//                  kernel keeps K for all its query blocks: it zeroes K's bad elements once and
//                  restores those keys' scores: NaN from every query where k held a NaN (the
//                  forward's q.k there is NaN whatever the policy: softcap's tanh keeps it), and
//                  where it held an inf the exact q.k, +-inf or NaN (inf_key_scores), so softcap
//                  still maps it to +-cap with a finite P (bwd_kernel.cuh).
//   dK      dS^T Q: an inf (not NaN) in q under softcap is not a poisoned row (below): its
//                  logits are +-cap and its dS is 0 at every key it reads, so the dK / dV kernel
//                  zeroes the inf elements of a query block that holds one (a vote per block,
//                  softcap only) after every warp's S read them.
// The backward's dP = dO V^T needs nothing: bwd_point() selects dS = 0 for hidden keys.
//   dK / dV  dS^T Q, P^T dO: a query row whose dO holds a NaN / inf or whose q holds a NaN
//                  ("poisoned") would add 0 x NaN into the keys hidden from it. bwd_preprocess_kernel marks such a row
//                  with a NaN of its own as its dsum (kernel_common.cuh, kPoisonedDsum). Where a
//                  query block holds one (a warp vote on dsum), the dK / dV kernel zeroes those
//                  rows of Q and dO in shared memory and sets their lse to NaN before anything
//                  reads them (zero_poisoned_rows, then a barrier), so every P of the row is NaN,
//                  0 where the policy hides the key. The keys the row sees get NaN dK / dV (NaN x
//                  the zeroed row: the whole row of dK / dV, not only the bad columns), the
//                  hidden ones exact zeros, and the row's own dq is NaN; nothing else changes.
//                  An inf (not NaN) in q is marked only without softcap: under softcap its
//                  logits are +-cap and its P and dV finite, which the mark would turn NaN
//                  (there dS^T Q meets zeros instead, above).
// The sm_90a wgmma kernels follow the same rules with their warp roles (sm90/): the forward's
// producer zeroes V where a tile may hide keys and its consumers give the elements back; the
// backward's producer zeroes K before publishing it (the consumers restore the scores), and its
// consumers zero poisoned rows of a ring slot and, under softcap, Q's inf elements after S^T.
// The scan costs one 16-byte shared load per chunk of the tile and one barrier, on tiles that may
// hide keys (the dQ kernel: on every tile; the dK / dV kernel: once per CTA, on every CTA that
// adds dQ atomically, and under softcap once per query block for Q); the dK / dV
// kernel's poisoned-row vote costs kBlockM / 32 shared loads and a warp vote per query block; the
// other work runs only where a non-finite value is present.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/policy.h"
#include "cuda/mma.cuh"

namespace attn {
namespace tc {

// An element of T is inf or NaN when its exponent bits are all ones.
template <typename T>
struct ExpBits;
template <>
struct ExpBits<__half> {
  static constexpr uint32_t kMask = 0x7c00u;
};
template <>
struct ExpBits<__nv_bfloat16> {
  static constexpr uint32_t kMask = 0x7f80u;
};

// The 16-bit pattern h (high bits ignored) is inf or NaN; kNanOnly: NaN only (exponent all ones
// and a nonzero mantissa: above the exponent mask once the sign is dropped).
template <typename T, bool kNanOnly = false>
__device__ __forceinline__ bool bad_bits(uint32_t h) {
  return kNanOnly ? (h & 0x7fffu) > ExpBits<T>::kMask : (h & ExpBits<T>::kMask) == ExpBits<T>::kMask;
}

// One 16-byte chunk of T in shared memory: whether it holds a non-finite element; kZero: set
// those to +0.
template <typename T, bool kZero, bool kNanOnly = false>
__device__ __forceinline__ bool scan_chunk(uint32_t addr) {
  const uint4 v = ld_shared_v4(addr);
  uint32_t w[4] = {v.x, v.y, v.z, v.w};
  bool hit = false;
#pragma unroll
  for (int x = 0; x < 4; ++x) {
    const bool lo = bad_bits<T, kNanOnly>(w[x]), hi = bad_bits<T, kNanOnly>(w[x] >> 16);
    hit |= lo | hi;
    if (lo) w[x] &= 0xffff0000u;
    if (hi) w[x] &= 0x0000ffffu;
  }
  if (kZero && hit) {
#pragma unroll
    for (int x = 0; x < 4; ++x) st_shared_b32(addr + 4 * x, w[x]);
  }
  return hit;
}

// This thread's share of the 16-byte chunks of a (kRows, Tile's columns) tile of T in shared
// memory: kZero, set its non-finite elements to +0; returns whether it held any. Head-dim
// padding and rows past the sequence were zero-filled by the loader, so only data is found.
template <typename T, typename Tile, int kRows, int kThreads, bool kZero, bool kNanOnly = false>
__device__ __forceinline__ bool scan_nonfinite(uint32_t tile, int tid) {
  bool any = false;
  // rolled: the callers keep their accumulators live across this
#pragma unroll 1
  for (int idx = tid; idx < kRows * Tile::kChunks; idx += kThreads) {
    any |= scan_chunk<T, kZero, kNanOnly>(tile + Tile::offset(idx / Tile::kChunks, idx % Tile::kChunks * 8));
  }
  return any;
}

// The wgmma forward's give-back (fwd_kernel.cuh writes the same loop out): acc (one warp's 16
// rows of O as C fragments, 4 floats per 8-column n-tile) += the NaN / inf elements of V row vrow
// in this lane's columns (2 c, 2 c + 1 of each n-tile) of row half hf. Not times P: the element
// is inf or NaN, so the row's output there is non-finite either way.
template <typename T, int kDT>
__device__ __forceinline__ void add_back_nonfinite(float (&acc)[kDT][4], const T* vrow, int hf, int c, int d) {
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt) {
    const int col = dt * 8 + 2 * c;  // d % 8 == 0: the pair is inside the row
    if (col >= d) continue;
    const uint32_t w = *reinterpret_cast<const uint32_t*>(vrow + col);
    if (bad_bits<T>(w)) acc[dt][2 * hf] += TypeOps<T>::unpack(w).x;
    if (bad_bits<T>(w >> 16)) acc[dt][2 * hf + 1] += TypeOps<T>::unpack(w).y;
  }
}

// Whether the policy may hide some key of the tile [i0, i1) x [j0, j1) from some row (block-
// uniform): a window / length edge, a bool mask, or a sparse tile not marked full (layout_full).
// Softcap, ALiBi and an additive bias hide nothing (a float -inf is a logit, and reads its key).
__device__ __forceinline__ bool tile_may_hide(const Policy& pol, bool layout_full, int i0, int i1, int j0, int j1) {
  return !(layout_full && pol.bias_kind != BiasKind::kBool && pol.tile_full(i0, i1, j0, j1));
}

// After this thread issued its chunks of the tile with load_tile_async (the same chunk per thread
// as scan_nonfinite: idx = tid + k * kThreads): wait for its own copies and zero the non-finite
// elements in them. No barrier: every thread touches only what it loaded, and the caller's next
// barrier orders the zeros before any other thread reads. Out of line, and barrier-free: a wait
// and barrier inline in a rare branch before the dK / dV kernel's main loop made ptxas spill the
// loop's accumulators (hd128, sm_80: 400 bytes of spill stores against 28, LDL / STL among the
// mma.sync).
template <typename T, typename Tile, int kRows, int kThreads, bool kNanOnly>
__device__ __noinline__ void wait_and_zero_nonfinite(uint32_t tile, int tid) {
  cp_async_wait<0>();
  scan_nonfinite<T, Tile, kRows, kThreads, true, kNanOnly>(tile, tid);
}

// scan_nonfinite<..., true> out of line, for the forward's loop: inline, its chunk addresses
// joined the loop's own (fp16 hd128 plain on sm_80: 76 bytes of spill stores against 28 out of
// line; 8 before the scan existed)
template <typename T, typename Tile, int kRows, int kThreads>
__device__ __noinline__ bool zero_nonfinite(uint32_t tile, int tid) {
  return scan_nonfinite<T, Tile, kRows, kThreads, true>(tile, tid);
}

// Float r of a row in shared memory, by generic pointer (the mma.sync kernels: plain loads the
// compiler schedules; ld.shared there cost the hd128 dK / dV kernel 68 bytes of spills on sm_90a)
// or by shared address (the wgmma kernels' plan).
__device__ __forceinline__ float smem_float(const float* row, int r) { return row[r]; }
__device__ __forceinline__ float smem_float(uint32_t row, int r) { return __uint_as_float(ld_shared_u32(row + 4 * r)); }
__device__ __forceinline__ void set_smem_nan(float* row, int r) { row[r] = __uint_as_float(0x7fffffffu); }
__device__ __forceinline__ void set_smem_nan(uint32_t row, int r) { st_shared_b32(row + 4 * r, 0x7fffffffu); }

// Whether any of the kRows dsum floats in shared memory is poisoned: a warp vote, the same in
// every warp.
template <int kRows, typename Row>
__device__ __forceinline__ bool any_poisoned(Row dsum, int lane) {
  bool any = false;
#pragma unroll
  for (int r = lane; r < kRows; r += 32) any |= poisoned(smem_float(dsum, r));
  return __any_sync(0xffffffffu, any);
}
// The poisoned rows of a query block in shared memory: zero their rows of the (kRows, Tile's
// columns) tiles a and b (the dK / dV kernel's Q and dO; this thread's share of the 16-byte
// chunks) and set their lse to NaN, so every P of theirs is NaN (0 where the policy hides the
// key: a selection). Out of line: it runs only where any_poisoned() found one; the caller's
// barrier follows. A select on the lse inside the products' elementwise pass instead cost the
// sm_90a hd128 dK / dV kernel 44 more bytes of spill stores.
template <typename Tile, int kRows, int kThreads, typename Row, typename CRow>
__device__ __noinline__ void zero_poisoned_rows(uint32_t a, uint32_t b, Row lse, CRow dsum, int tid) {
#pragma unroll 1
  for (int idx = tid; idx < kRows * Tile::kChunks; idx += kThreads) {
    const int r = idx / Tile::kChunks;
    if (!poisoned(smem_float(dsum, r))) continue;
    const uint32_t off = Tile::offset(r, idx % Tile::kChunks * 8);
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      st_shared_b32(a + off + 4 * x, 0u);
      st_shared_b32(b + off + 4 * x, 0u);
    }
  }
  for (int r = tid; r < kRows; r += kThreads)
    if (poisoned(smem_float(dsum, r))) set_smem_nan(lse, r);
}

// Whether this thread's share of rows [0, rows) x columns [0, d) of a 16-bit tensor in global
// memory (row stride and d multiples of 8) holds a non-finite element, in 16-byte reads.
template <typename T, int kThreads, bool kNanOnly = false>
__device__ __forceinline__ bool has_nonfinite(const T* base, int64_t row_stride, int rows, int d, int tid) {
  const int chunks = d / 8;
  bool any = false;
#pragma unroll 1
  for (int idx = tid; idx < rows * chunks; idx += kThreads) {
    const uint4 v = *reinterpret_cast<const uint4*>(base + int64_t(idx / chunks) * row_stride + idx % chunks * 8);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int x = 0; x < 4; ++x) any |= bad_bits<T, kNanOnly>(w[x]) || bad_bits<T, kNanOnly>(w[x] >> 16);
  }
  return any;
}


// The scores q_i . k_j of one key j whose k row holds an inf (and no NaN) against the kQT * 2
// query rows of this thread's S^T fragments in a (kBlockM, Tile's columns) tile of Q in shared
// memory (rows i = t * 8 + 2 c + e2, t < kQT, e2 < 2). Such a score is +inf, -inf or NaN whatever
// the order of the sum (an inf term absorbs every finite one; q = 0 there, or two infinities of
// opposite sign, give NaN), so a plain float32 loop reproduces the tensor-core product exactly.
// Two bits per row, row (t, e2) at bits 2 (2 t + e2): 1 = +inf, 2 = -inf, 3 = NaN, 0 = finite
// (not reached). Out of line: it runs only in a CTA that holds such a key (bwd_kernel.cuh).
template <typename T, typename TileQ, int kQT>
__device__ __noinline__ uint64_t inf_key_scores(uint32_t sq, const T* krow, int c, int d) {
  static_assert(kQT * 2 <= 32, "two bits per query row in 64 bits");
  using Ops = TypeOps<T>;
  uint64_t codes = 0;
#pragma unroll 1
  for (int r = 0; r < kQT * 2; ++r) {
    const int il = (r >> 1) * 8 + 2 * c + (r & 1);
    float s = 0.f;
#pragma unroll 1
    for (int col = 0; col < d; col += 8) {
      const uint4 qv = ld_shared_v4(sq + TileQ::offset(il, col));
      const uint4 kv = *reinterpret_cast<const uint4*>(krow + col);
      const uint32_t qw[4] = {qv.x, qv.y, qv.z, qv.w}, kw[4] = {kv.x, kv.y, kv.z, kv.w};
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const float2 a = Ops::unpack(qw[x]), b = Ops::unpack(kw[x]);
        s += a.x * b.x;
        s += a.y * b.y;
      }
    }
    const uint64_t code = s != s ? 3u : s == INFINITY ? 1u : s == -INFINITY ? 2u : 0u;
    codes |= code << (2 * r);
  }
  return codes;
}

// The keys of a dK / dV kernel whose k row holds a NaN or inf, for dQ += dS K over K with those
// elements zeroed: this thread's two keys of S^T's C fragments, rows krow0 and krow0 + 8 rows on
// (valid_rows of them exist), as bits: hf (0, 1) a NaN in row 8 hf, 2 + hf an inf (and no NaN).
// Read from global memory: run only in a CTA whose K tile held one.
template <typename T>
__device__ __forceinline__ uint32_t key_fix_bits(const T* krow0, int64_t row_stride, int valid_rows, int d) {
  uint32_t bits = 0;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const T* krow = krow0 + int64_t(8 * hf) * row_stride;
    if (8 * hf < valid_rows && has_nonfinite<T, 1, true>(krow, row_stride, 1, d, 0))
      bits |= 1u << hf;
    else if (8 * hf < valid_rows && has_nonfinite<T, 1>(krow, row_stride, 1, d, 0))
      bits |= 4u << hf;
  }
  return bits;
}

// S^T (this warp's 16 keys x kQT * 8 queries of a Q tile at sq, C fragments) as it would be
// without the zeroing of key_fix_bits' keys: NaN for every query where k held a NaN, the exact
// score (+-inf or NaN, inf_key_scores) where it held an inf. Row row0 of k (rows row_stride
// apart) holds bit 0's key.
template <typename T, typename TileQ, int kQT>
__device__ __forceinline__ void fix_key_scores(float (&acc)[kQT][4], uint32_t bits, uint32_t sq, const T* k, int row0,
                                               int64_t row_stride, int c, int d) {
  if (bits == 0u) return;
  uint64_t codes[2] = {0, 0};
#pragma unroll
  for (int hf = 0; hf < 2; ++hf)
    if ((bits >> (2 + hf)) & 1u)
      codes[hf] = inf_key_scores<T, TileQ, kQT>(sq, k + int64_t(row0 + 8 * hf) * row_stride, c, d);
#pragma unroll
  for (int t = 0; t < kQT; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int hf = e >> 1;
      const uint32_t code = uint32_t(codes[hf] >> (2 * (2 * t + (e & 1)))) & 3u;
      if ((bits >> hf) & 1u) acc[t][e] = __uint_as_float(0x7fffffffu);
      if (code != 0u) acc[t][e] = code == 1u ? INFINITY : code == 2u ? -INFINITY : __uint_as_float(0x7fffffffu);
    }
}

// Whether this thread's share of the 16-byte chunks of a (kRows, Tile's columns) tile of T in
// shared memory holds an inf or NaN (read only). Out of line, for the dK / dV kernel's loop.
template <typename T, typename Tile, int kRows, int kThreads>
__device__ __noinline__ bool any_nonfinite_smem(uint32_t tile, int tid) {
  return scan_nonfinite<T, Tile, kRows, kThreads, false>(tile, tid);
}

}  // namespace tc
}  // namespace attn
