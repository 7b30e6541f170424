// Top-k attention's threshold pass on the CPU: a streaming per-row top-k over the logits, never
// an (Sq, Sk) tensor.
//
// One task = (batch, query head, block of kBlockM query rows), as the softmax forward's. It
// computes each (rows, kBlockN) score tile with the forward's own packed GEMM and row code
// (softmax/cpu/tile.h), so the logits are bit for bit the ones the fused kernels later compare
// against the threshold. Per row it keeps a buffer of at most 2k candidates (logit, key) and a
// bound, the k-th best after the last prune: a key enters only if it beats the bound, and a
// full buffer is pruned back to its k best (nth_element). A vector compare against the bound
// skips most of a tile once the bound has settled: a random row sees about k (1 + ln(Sk / k))
// insertions in all. Work O(Sq Sk D) for the products plus O(Sq Sk) compares; memory the
// packed K plus O(kBlockM * k) per thread.
#include <algorithm>
#include <cstring>
#include <functional>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu/pack.h"
#include "softmax/cpu/tile.h"
#include "sparse/cpu/entry.h"

namespace attn {
namespace cpu {

namespace {

// A candidate as one unsigned integer whose order is the ranking: the logit's bits made
// monotone (a NaN, canonicalized, above +inf: it must reach the output), then the key index
// complemented (ties to the lower key). One integer compare per step of nth_element.
inline uint64_t rank_key(float logit, int32_t j) {
  uint32_t u;
  if (std::isnan(logit)) logit = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(&u, &logit, 4);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (uint64_t(u) << 32) | uint32_t(~uint32_t(j));
}
inline unsigned __int128 rank_key(double logit, int32_t j) {
  uint64_t u;
  if (std::isnan(logit)) logit = std::numeric_limits<double>::quiet_NaN();
  std::memcpy(&u, &logit, 8);
  u = (u & 0x8000000000000000ull) ? ~u : (u | 0x8000000000000000ull);
  return ((unsigned __int128)u << 32) | uint32_t(~uint32_t(j));
}
template <typename T>
inline T key_logit(decltype(rank_key(T(0), 0)) key) {
  using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  constexpr U top = U(1) << (8 * sizeof(U) - 1);
  U u = U(key >> 32);
  u = (u & top) ? (u & ~top) : ~u;
  T x;
  std::memcpy(&x, &u, sizeof(T));
  return x;
}

#ifndef TOPK_BUF
#define TOPK_BUF 4
#endif
constexpr int kBuf = TOPK_BUF;

template <typename T>
struct RowTopK {
  using Key = decltype(rank_key(T(0), 0));
  Key* buf = nullptr;  // 2k keys of the worker's storage
  int n = 0, k = 0;
  bool pruned = false;  // bound is valid
  Key bound = 0;        // the k-th best key at the last prune
  T bound_logit = T(0);

  void reset(Key* storage, int k_) {
    buf = storage;
    k = k_;
    n = 0;
    pruned = false;
  }
  // keep the k best of buf; the bound becomes the k-th
  void prune() {
    std::nth_element(buf, buf + (k - 1), buf + n, std::greater<Key>());
    n = k;
    bound = buf[k - 1];  // nth_element puts the k-th best there, the better ones before it
    bound_logit = key_logit<T>(bound);
    pruned = true;
  }
  void push(T logit, int32_t j) {
    const Key c = rank_key(logit, j);
    if (pruned && c <= bound) return;
    buf[n++] = c;
    if (n == kBuf * k) prune();
  }
  // (thr, jcut) of the row
  void finish(T* thr, int32_t* jcut) {
    if (n <= k && !pruned) {
      *thr = -std::numeric_limits<T>::infinity();
      *jcut = std::numeric_limits<int32_t>::max();
      return;
    }
    if (n > k || !pruned) prune();
    *thr = bound_logit;
    *jcut = int32_t(~uint32_t(bound & 0xffffffffu));
  }
};

// Bit u set: lane u of a vector mask is true (AVX: one movemask).
template <typename M>
inline uint32_t lane_bits(M m) {
#if defined(__AVX__) && !defined(__AVX512F__)
  if constexpr (sizeof(M) == 32 && sizeof(m[0]) == 4) return uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(__m256i(m))));
  if constexpr (sizeof(M) == 32 && sizeof(m[0]) == 8) return uint32_t(_mm256_movemask_pd(_mm256_castsi256_pd(__m256i(m))));
#endif
  uint32_t bits = 0;
  for (int u = 0; u < int(sizeof(M) / sizeof(m[0])); ++u) bits |= (m[u] != 0 ? 1u : 0u) << u;
  return bits;
}

// every x[0 .. n) < lim (n a multiple of the lanes; false when any is NaN)
template <typename T>
inline bool all_below(const T* x, int n, vec<T> lim) {
  constexpr int L = kLanes<T>;
  auto acc = vload(x) < lim;
  for (int c = L; c < n; c += L) acc &= vload(x + c) < lim;
  return lane_bits(acc) == (1u << L) - 1;
}

template <typename T>
struct TopkWorker {
  static constexpr int L = kLanes<T>;
  const FwdParamsT<T>& p;
  DType dt;
  const PackIndex& kidx;
  const T* kt;
  int n_mblocks, k_top;
  T* thr;
  int32_t* jcut;
  Scratch<T, 2> mem;
  T *q, *s;
  std::vector<RowTopK<T>> rows_topk;
  std::vector<typename RowTopK<T>::Key> keys;  // (kBlockM, 2k): the rows' candidate buffers

  TopkWorker(const FwdParamsT<T>& p_, DType dt_, const PackIndex& ki, const T* kt_, int nmb, int k, T* thr_,
             int32_t* jcut_)
      : p(p_), dt(dt_), kidx(ki), kt(kt_), n_mblocks(nmb), k_top(k), thr(thr_), jcut(jcut_),
        mem(carved_size<T>(sizes(ki.dp))), rows_topk(kBlockM), keys(size_t(kBlockM) * kBuf * k) {
    carve(mem.data(), sizes(ki.dp), {&q, &s});
  }
  static std::array<size_t, 2> sizes(int dp) { return {size_t(kBlockM) * dp, size_t(kBlockM) * kBlockN}; }

  void operator()(int64_t task) {
    const int mblk = int(task % n_mblocks);
    const int h = int((task / n_mblocks) % p.h);
    const int b = int(task / (int64_t(n_mblocks) * p.h));
    const SeqInfo si(p, b);
    const int i0 = mblk * kBlockM;
    if (i0 >= si.len_q) return;
    const int i1 = std::min(i0 + kBlockM, si.len_q), rows = i1 - i0;
    const PolicyT<T> pol(p, si, b, h);
    const TileSoftmax<T> ts(p, pol, b * p.h + h);
    const int hk = h / (p.h / p.h_k);
    const int d = kidx.d, dp = kidx.dp;
    const size_t es = dtype_size(dt);
    const char* qbase = elem(p.q, dt, si.q_offset(p, b, h, i0, p.q_batch_stride, p.q_head_stride, p.q_row_stride));
    for (int r = 0; r < rows; ++r) load_row(dt, qbase + es * r * p.q_row_stride, q + r * dp, d, dp);
    T* thr_row = thr + b * p.lse_batch_stride + h * p.lse_head_stride + si.row_q + i0;
    int32_t* jcut_row = jcut + b * p.lse_batch_stride + h * p.lse_head_stride + si.row_q + i0;
    if (k_top >= si.len_k) {  // every allowed key is kept
      std::fill(thr_row, thr_row + rows, -std::numeric_limits<T>::infinity());
      std::fill(jcut_row, jcut_row + rows, std::numeric_limits<int32_t>::max());
      return;
    }
    const int k = k_top;
    for (int r = 0; r < rows; ++r) rows_topk[r].reset(keys.data() + size_t(r) * kBuf * k, k);

    const T* kt_bh = kt + kidx.offset(b, hk);
    const T ninf = -std::numeric_limits<T>::infinity();
    int n_lo, n_hi;
    pol.key_blocks(i0, i1, kBlockN, &n_lo, &n_hi);
    for (int jb = n_lo; jb < n_hi; ++jb) {
      const int j0 = jb * kBlockN;
      // the forward's product, call for call (fwd.cpp: FwdWorker::tile)
      gemm<false>(rows, kBlockN, d, q, dp, kt_bh + int64_t(j0) * dp, kPanel<T>, int64_t(dp) * kPanel<T>, s, kBlockN);
      const bool full = ts.tile_full(i0, i1, j0);
      for (int r = 0; r < rows; ++r) {
        T* srow = s + r * kBlockN;
        ts.scores(srow, i0 + r, j0, full);
        // logits: the plain path left x in the row (tile.h); -inf = not allowed, never a candidate
        if (ts.plain) {
          const vec<T> sc = vbcast(pol.scale);
          for (int c = 0; c < kBlockN; c += L) vstore(srow + c, vload(srow + c) * sc);
        }
        RowTopK<T>& tk = rows_topk[r];
        // most of a row sits below the bound once it has settled: one vector AND over the row
        // decides that, and only the vectors with a lane at or above it (or NaN) are read lane
        // by lane; -inf (not allowed) is never a candidate
        const vec<T> lim = vbcast(tk.pruned ? tk.bound_logit : ninf);
        if (tk.pruned && all_below(srow, kBlockN, lim)) continue;
        for (int c = 0; c < kBlockN; c += L) {
          // lanes not below the limit (NaN included)
          for (uint32_t bits = ~lane_bits(vload(srow + c) < lim) & ((1u << L) - 1); bits != 0; bits &= bits - 1) {
            const int u = __builtin_ctz(bits);
            const T v = srow[c + u];
            if (v != ninf) tk.push(v, j0 + c + u);
          }
        }
      }
    }
    for (int r = 0; r < rows; ++r) rows_topk[r].finish(thr_row + r, jcut_row + r);
  }
};

}  // namespace

template <typename T>
void topk_threshold(const FwdParamsT<T>& p, DType dt, int k_top, T* thr, int32_t* jcut) {
  const PackIndex kidx(p);
  const int n_mblocks = (p.sq + kBlockM - 1) / kBlockM;
  const int64_t n_tasks = int64_t(p.b) * p.h * n_mblocks;
  const Scratch<T, 0> kt(kidx.total());
  pack_keys(p, dt, p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride, kidx, PackLayout::kTPanels, kt.data());
  // k_top past the longest sequence keeps every key of every row (and sizes no buffer)
  const int k = std::min(k_top, std::max(p.sk, 1));
  parallel_tasks(n_tasks, p.num_threads,
                 [&] { return TopkWorker<T>(p, dt, kidx, kt.data(), n_mblocks, k, thr, jcut); });
}
template void topk_threshold<float>(const FwdParamsT<float>&, DType, int, float*, int32_t*);
template void topk_threshold<double>(const FwdParamsT<double>&, DType, int, double*, int32_t*);

}  // namespace cpu
}  // namespace attn
