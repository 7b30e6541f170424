// Top-k attention's threshold pass on the GPU: a streaming per-row top-k over the logits, never
// an (Sq, Sk) tensor (the CPU's is sparse/cpu/topk.cpp, the same algorithm).
//
// One warp per query row, as the SIMT attention kernels: q.k is simt::dot_row (lane l holds
// head-dim elements l, l + 32, ..., summed per lane then over the warp), the logit Policy::score,
// so every logit is bit for bit the one the SIMT forward and backward later compare against the
// threshold. Each warp keeps, in its slice of a global scratch, a buffer of up to 2k candidates
// (logit, key) and a bound, the k-th best after the last prune: a key enters only if it beats
// the bound, and a full buffer is pruned back to its k best by rank (each lane ranks its
// candidates against all 2k, O(k^2 / 32) per lane, rare once the bound settles: a random row
// sees about k (1 + ln(Sk / k)) insertions in all). The grid is persistent (warps stride over
// the rows), so the scratch is 3k pairs per resident warp, not per row.
#pragma once

#include <cstdint>

#include "common/policy.h"
#include "common/softmax_params.h"
#include "cuda/param_rows.cuh"  // q_ptr, k_ptr, lse_index
#include "cuda/warp_row.cuh"    // load_row, dot_row: the SIMT kernels' q.k

namespace attn {
namespace topk {

constexpr int kWarps = 4;  // warps per block
constexpr int32_t kKeepAll = 2147483647;

// (la, ja) ranks before (lb, jb): a NaN first (it must reach the output), then the higher logit,
// then the lower key. A strict total order on distinct keys, so ranks are distinct.
__device__ __forceinline__ bool better(float la, int ja, float lb, int jb) {
  const bool na = la != la, nb = lb != lb;
  if (na != nb) return na;
  if (!na && la != lb) return la > lb;
  return ja < jb;
}

// The n candidates (lg, key)[0, n) of one warp cut to their k best, in rank order, through
// (lg2, key2)[0, k); the k-th best ends at index k - 1.
__device__ __forceinline__ void prune(float* lg, int32_t* key, float* lg2, int32_t* key2, int n, int k, int lane) {
  __syncwarp();  // lane 0's insertions are visible
  for (int e = lane; e < n; e += 32) {
    const float le = lg[e];
    const int je = key[e];
    int rank = 0;
    for (int f = 0; f < n; ++f) rank += better(lg[f], key[f], le, je) ? 1 : 0;
    if (rank < k) {
      lg2[rank] = le;
      key2[rank] = je;
    }
  }
  __syncwarp();
  for (int e = lane; e < k; e += 32) {
    lg[e] = lg2[e];
    key[e] = key2[e];
  }
  __syncwarp();
}

// grid (blocks), 32 * kWarps threads; warp w of the grid takes rows w, w + W, ... of the (B, H,
// Sq) rows (W = warps in the grid) and the scratch pairs [3 kcap w, 3 kcap (w + 1)).
template <typename T>
__global__ void __launch_bounds__(32 * kWarps)
    threshold_kernel(const SoftmaxParams p, int k_top, int kcap, float* thr, int32_t* jcut, float* s_logit,
                     int32_t* s_key) {
  using simt::kChunks;
  const int lane = threadIdx.x & 31;
  const int64_t w = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  const int64_t n_warps = int64_t(gridDim.x) * kWarps;
  float* lg = s_logit + w * 3 * kcap;
  int32_t* key = s_key + w * 3 * kcap;
  float* lg2 = lg + 2 * kcap;
  int32_t* key2 = key + 2 * kcap;
  const int64_t rows = int64_t(p.b) * p.h * p.sq;
  for (int64_t r = w; r < rows; r += n_warps) {
    const int i = int(r % p.sq);
    const int h = int((r / p.sq) % p.h);
    const int b = int(r / (int64_t(p.sq) * p.h));
    const SeqInfo si(p, b);
    if (i >= si.len_q) continue;
    const Policy pol(p, si, b, h);
    const int hk = h / (p.h / p.h_k);
    const int k = min(k_top, max(si.len_k, 1));
    float qr[kChunks];
    simt::load_row(qr, q_ptr<T>(p, si, b, h, i), p.d, lane);
    const T* kp = k_ptr<T>(p, si, b, hk, 0);
    int j0, j1;
    pol.key_range(i, i + 1, &j0, &j1);
    j0 = max(j0, 0);
    j1 = min(j1, si.len_k);
    int count = 0;
    bool pruned = false;
    float bound_l = 0.f;
    int bound_j = 0;
    for (int j = j0; j < j1; ++j) {
      if (!pol.allowed(i, j)) continue;
      // the SIMT forward's logit (simt::fwd_kernel: dot_row, then logit2's pol.score)
      const float x = simt::dot_row(qr, kp + int64_t(j) * p.k_row_stride, p.d, lane);
      const float s = pol.score(x, i, j);
      if (s == -INFINITY) continue;  // masked by the bias: never a candidate
      if (pruned && !better(s, j, bound_l, bound_j)) continue;
      if (lane == 0) {
        lg[count] = s;
        key[count] = j;
      }
      if (++count >= 2 * k) {
        prune(lg, key, lg2, key2, count, k, lane);
        count = k;
        pruned = true;
        bound_l = lg[k - 1];
        bound_j = key[k - 1];
      }
    }
    if (count <= k && !pruned) continue;  // keep all: the caller's -inf / INT32_MAX stay
    if (count > k) prune(lg, key, lg2, key2, count, k, lane);
    if (lane == 0) {
      const int64_t o = lse_index(p, si, b, h, i);
      thr[o] = lg[k - 1];
      jcut[o] = key[k - 1];
    }
    __syncwarp();  // lane 0 read the buffer before the next row overwrites it
  }
}

}  // namespace topk
}  // namespace attn
