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

template <typename T>
struct Cand {
  T logit;
  int32_t j;
};

// a ranks before b: a NaN first (it must reach the output), then the higher logit, then the
// lower key
template <typename T>
inline bool better(const Cand<T>& a, const Cand<T>& b) {
  const bool na = std::isnan(a.logit), nb = std::isnan(b.logit);
  if (na != nb) return na;
  if (a.logit != b.logit) return a.logit > b.logit;
  return a.j < b.j;
}

template <typename T>
struct RowTopK {
  std::vector<Cand<T>> buf;
  int k = 0;
  bool pruned = false;  // bound is valid
  Cand<T> bound{};

  void reset(int k_) {
    k = k_;
    buf.clear();
    pruned = false;
  }
  // the k best of buf, the k-th last; the bound becomes that k-th
  void prune() {
    std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), better<T>);
    buf.resize(k);
    bound = buf[k - 1];
    for (const Cand<T>& c : buf)
      if (better(bound, c)) bound = c;
    pruned = true;
  }
  void push(T logit, int32_t j) {
    const Cand<T> c{logit, j};
    if (pruned && !better(c, bound)) return;
    buf.push_back(c);
    if (int(buf.size()) >= 2 * k) prune();
  }
  // (thr, jcut) of the row
  void finish(T* thr, int32_t* jcut) {
    if (int(buf.size()) <= k && !pruned) {
      *thr = -std::numeric_limits<T>::infinity();
      *jcut = std::numeric_limits<int32_t>::max();
      return;
    }
    if (int(buf.size()) > k || !pruned) prune();
    *thr = bound.logit;
    *jcut = bound.j;
  }
};

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

  TopkWorker(const FwdParamsT<T>& p_, DType dt_, const PackIndex& ki, const T* kt_, int nmb, int k, T* thr_,
             int32_t* jcut_)
      : p(p_), dt(dt_), kidx(ki), kt(kt_), n_mblocks(nmb), k_top(k), thr(thr_), jcut(jcut_),
        mem(carved_size<T>(sizes(ki.dp))), rows_topk(kBlockM) {
    carve(mem.data(), sizes(ki.dp), {&q, &s});
    for (RowTopK<T>& r : rows_topk) r.buf.reserve(2 * size_t(k));
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
    const int k = std::min(k_top, std::max(si.len_k, 1));
    for (int r = 0; r < rows; ++r) rows_topk[r].reset(k);

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
        // below the bound (or -inf before one exists): skip L keys at a time
        const vec<T> lim = vbcast(tk.pruned ? tk.bound.logit : ninf);
        for (int c = 0; c < kBlockN; c += L) {
          const vec<T> x = vload(srow + c);
          // any lane >= the limit or NaN (not below it)
          const auto below = x < lim;
          bool any = false;
          for (int u = 0; u < L; ++u) any |= below[u] == 0;
          if (!any) continue;
          for (int u = 0; u < L; ++u) {
            const T v = srow[c + u];
            if (v == ninf) continue;
            tk.push(v, j0 + c + u);
          }
        }
      }
    }
    T* thr_row = thr + b * p.lse_batch_stride + h * p.lse_head_stride + si.row_q + i0;
    int32_t* jcut_row = jcut + b * p.lse_batch_stride + h * p.lse_head_stride + si.row_q + i0;
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
  parallel_tasks(n_tasks, p.num_threads,
                 [&] { return TopkWorker<T>(p, dt, kidx, kt.data(), n_mblocks, k_top, thr, jcut); });
}
template void topk_threshold<float>(const FwdParamsT<float>&, DType, int, float*, int32_t*);
template void topk_threshold<double>(const FwdParamsT<double>&, DType, int, double*, int32_t*);

}  // namespace cpu
}  // namespace attn
