// Top-k attention's threshold pass on the CPU: a streaming per-row top-k over the logits, never
// an (Sq, Sk) tensor.
//
// One task = (batch, query head, block of kBlockM query rows), as the softmax forward's. It
// computes each (rows, kBlockN) score tile with the forward's own packed GEMM and row code
// (cpu/online_softmax.h), so the logits are bit for bit the ones the fused kernels later compare
// against the threshold. A task first computes every logit of its rows (kBlockM x Sk, one
// block of rows at a time: never an Sq x Sk tensor), then selects per row in two vector passes
// and one small nth_element (select() below). A min-heap streamed over the tiles cost about
// three times as much at k = 64: its branchy replacements, a few hundred per row, dominated.
// Work O(Sq Sk D) for the products plus O(Sq Sk) compares; memory the packed K plus
// O(kBlockM * Sk) per thread.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/isa.h"
#include "cpu/pack.h"
#include "cpu/online_softmax.h"
#include "sparse/cpu/entry.h"

namespace attn {
namespace cpu {
ATTN_CPU_ISA_BEGIN

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

template <typename T>
struct TopkWorker {
  static constexpr int L = kLanes<T>;
  using Key = decltype(rank_key(T(0), 0));
  const SoftmaxParamsT<T>& p;
  DType dt;
  const PackIndex& kidx;
  const T* kt;
  int n_mblocks, k_top;
  T* thr;
  int32_t* jcut;
  Scratch<T, 2> mem;
  T *q, *lg;               // the Q tile; the task's logits (kBlockM, ldl)
  int64_t ldl;             // keys of the longest sequence, padded to whole tiles
  std::vector<T> gmax;     // group maxima of one row
  std::vector<Key> cand;   // candidates of one row

  TopkWorker(const SoftmaxParamsT<T>& p_, DType dt_, const PackIndex& ki, const T* kt_, int nmb, int k, T* thr_,
             int32_t* jcut_)
      : p(p_), dt(dt_), kidx(ki), kt(kt_), n_mblocks(nmb), k_top(k), thr(thr_), jcut(jcut_),
        mem(carved_size<T>(sizes(ki.dp, p_.sk))), ldl(round_up(std::max(p_.sk, 1), kBlockN)),
        gmax(size_t(ldl)), cand(size_t(ldl)) {
    carve(mem.data(), sizes(ki.dp, p.sk), {&q, &lg});
  }
  static std::array<size_t, 2> sizes(int dp, int sk) {
    return {size_t(kBlockM) * dp, size_t(kBlockM) * round_up(std::max(sk, 1), kBlockN)};
  }

  // Row selection on n logits (a multiple of L; -inf = not allowed): (thr, jcut) of the k best.
  // A lower bound first, the k-th largest of >= k group maxima (k distinct elements are at or
  // above it): groups of gv vectors' lanes, about 4k of them, so that only a few more than k
  // elements pass it. Then the exact k-th among those (rank keys, nth_element).
  void select(const T* row, int n, int k, T* thr_out, int32_t* jcut_out, int j0) {
    const T ninf = -std::numeric_limits<T>::infinity();
    const int nv = n / L;
    const int gv = std::max(1, nv / std::max(1, 4 * k / L));
    const int ng = nv / gv;  // whole groups; a tail of vectors joins no group (still scanned)
    T bound = ninf;
    if (int64_t(ng) * L >= k) {
      for (int g = 0; g < ng; ++g) {
        vec<T> m = vload(row + int64_t(g) * gv * L);
        for (int u = 1; u < gv; ++u) m = vmax(m, vload(row + (int64_t(g) * gv + u) * L));
        for (int u = 0; u < L; ++u) gmax[size_t(g) * L + u] = std::isnan(m[u]) ? ninf : m[u];
      }
      std::nth_element(gmax.begin(), gmax.begin() + (k - 1), gmax.begin() + size_t(ng) * L, std::greater<T>());
      bound = gmax[k - 1];
    }
    const vec<T> lim = vbcast(bound);
    int nc = 0;
    for (int c = 0; c < n; c += L) {
      for (uint32_t bits = ~lane_bits(vload(row + c) < lim) & ((1u << L) - 1); bits != 0; bits &= bits - 1) {
        const int u = __builtin_ctz(bits);
        const T v = row[c + u];
        if (v != ninf) cand[nc++] = rank_key(v, j0 + c + u);
      }
    }
    if (nc <= k && bound == ninf) {  // every allowed key is a candidate, and they are at most k
      *thr_out = ninf;
      *jcut_out = std::numeric_limits<int32_t>::max();
      return;
    }
    std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.begin() + nc, std::greater<Key>());
    *thr_out = key_logit<T>(cand[k - 1]);
    *jcut_out = int32_t(~uint32_t(cand[k - 1] & 0xffffffffu));
  }

  void operator()(int64_t task) {
    const QueryTask qt(task, n_mblocks, p.h, false);
    const int b = qt.b, h = qt.h, i0 = qt.i0;
    const SeqInfo si(p, b);
    if (i0 >= si.len_q) return;
    const int i1 = std::min(i0 + kBlockM, si.len_q), rows = i1 - i0;
    const PolicyT<T> pol(p, si, b, h);
    const TileSoftmax<T> ts(p, pol, b * p.h + h);
    const int hk = h / (p.h / p.h_k);
    const int d = kidx.d, dp = kidx.dp;
    const size_t es = dtype_size(dt);
    T* thr_row = thr + b * p.lse_batch_stride + h * p.lse_head_stride + si.row_q + i0;
    int32_t* jcut_row = jcut + b * p.lse_batch_stride + h * p.lse_head_stride + si.row_q + i0;
    int n_lo, n_hi;
    pol.key_blocks(i0, i1, kBlockN, &n_lo, &n_hi);
    if (k_top >= si.len_k || n_lo >= n_hi) {  // every allowed key is kept
      std::fill(thr_row, thr_row + rows, -std::numeric_limits<T>::infinity());
      std::fill(jcut_row, jcut_row + rows, std::numeric_limits<int32_t>::max());
      return;
    }
    const char* qbase = elem(p.q, dt, si.q_offset(p, b, h, i0, p.q_batch_stride, p.q_head_stride, p.q_row_stride));
    for (int r = 0; r < rows; ++r) load_row(dt, qbase + es * r * p.q_row_stride, q + r * dp, d, dp);

    // every logit of the task's rows: (rows, n) with n = the keys of the blocks they may see
    const T* kt_bh = kt + kidx.offset(b, hk);
    const int n = (n_hi - n_lo) * kBlockN;
    for (int jb = n_lo; jb < n_hi; ++jb) {
      const int j0 = jb * kBlockN;
      T* s = lg + (jb - n_lo) * kBlockN;
      // the forward's product, call for call (fwd.cpp: FwdWorker::tile); only ldc differs
      gemm<false>(rows, kBlockN, d, q, dp, kt_bh + int64_t(j0) * dp, kPanel<T>, int64_t(dp) * kPanel<T>, s, ldl);
      const bool full = ts.tile_full(i0, i1, j0);
      for (int r = 0; r < rows; ++r) {
        T* srow = s + r * ldl;
        ts.scores(srow, i0 + r, j0, full);
        // logits: the plain path left x in the row (online_softmax.h), as its topk() multiplies it
        if (ts.plain) {
          const vec<T> sc = vbcast(pol.scale);
          for (int c = 0; c < kBlockN; c += L) vstore(srow + c, vload(srow + c) * sc);
        }
      }
    }
    for (int r = 0; r < rows; ++r) select(lg + r * ldl, n, k_top, thr_row + r, jcut_row + r, n_lo * kBlockN);
  }
};

}  // namespace

template <typename T>
void topk_threshold(const SoftmaxParamsT<T>& p, DType dt, int k_top, T* thr, int32_t* jcut) {
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
template void topk_threshold<float>(const SoftmaxParamsT<float>&, DType, int, float*, int32_t*);
template void topk_threshold<double>(const SoftmaxParamsT<double>&, DType, int, double*, int32_t*);
ATTN_CPU_REGISTER(topk_threshold_stub<float>, &topk_threshold<float>);
ATTN_CPU_REGISTER(topk_threshold_stub<double>, &topk_threshold<double>);

ATTN_CPU_ISA_END
}  // namespace cpu
}  // namespace attn
