// The recurrent step of linear attention on the CPU: T positions (1 or a few) of the causal
// recurrence on a state updated in place (common/linear_params.h LinearStepParamsT states the
// math). A decode step's work and traffic are the state's (B H M Dv elements against
// O(T (M + Dv)) of inputs per head), so the kernel is built around one pass over the state:
//
// - one task per (batch, query head); a thread takes a contiguous range of tasks, so it streams
//   through consecutive (b, h) states;
// - the T positions' features phi(q_t) * scale, phi(k_t) and rows v_t are loaded and converted
//   once per task into a few rows of L1 scratch;
// - the state in column blocks (advance_columns): a block's v_t and O'_t columns live in
//   registers while the rows stream past, and the block stays in L1 across the positions, so
//   T positions cost one read and one write of S from memory, not T of each;
// - the normalizer z (M), vectorized over m, positions inner.
// In place (not a new state): a new state per step would add a third stream of state bytes
// (the destination's read for ownership) and, for states over malloc's mmap threshold, fresh
// pages every step.
#include <algorithm>
#include <cmath>

#include "common/linear_params.h"
#include "cpu/isa.h"
#include "cpu/memory.h"
#include "cpu/parallel.h"
#include "cpu/simd.h"
#include "linear/cpu/entry.h"
#include "linear/cpu/feature_map.h"

namespace attn {
namespace cpu {
ATTN_CPU_ISA_BEGIN

namespace {

template <typename T>
using SP = LinearStepParamsT<T>;

// One thread's rows for a task: T rows each of Q~ and K~ (mp wide), v and O' (dp wide), the
// decay factors w_t = exp(decay_t) (a row of mp per position: its first entry with a gate per
// head, every feature's with GLA's per-feature gates) and T vectors of normalizer partial sums.
template <typename T>
struct StepRows {
  int mp, dp, t;
  Buffer<T> mem;
  T *q, *k, *v, *o, *w, *acc;
  StepRows(int m, int dv, int t_)
      : mp(round_up(m, kLanes<T>)), dp(round_up(dv, kLanes<T>)), t(t_),
        mem(size_t(t_) * (3 * size_t(mp) + 2 * size_t(dp) + kLanes<T>)) {
    q = mem.data();
    k = q + int64_t(t) * mp;
    v = k + int64_t(t) * mp;
    o = v + int64_t(t) * dp;
    acc = o + int64_t(t) * dp;
    w = acc + int64_t(t) * kLanes<T>;
  }
};

template <typename T>
void load_rows(const SP<T>& p, DType dt, int b, int h, StepRows<T>& r) {
  const int hk = h / (p.h / p.h_k);
  const size_t es = dtype_size(dt);
  const char* q = static_cast<const char*>(p.q) + (int64_t(b) * p.q_batch_stride + int64_t(h) * p.q_head_stride) * es;
  const char* k = static_cast<const char*>(p.k) + (int64_t(b) * p.k_batch_stride + int64_t(hk) * p.k_head_stride) * es;
  const char* v = static_cast<const char*>(p.v) + (int64_t(b) * p.v_batch_stride + int64_t(hk) * p.v_head_stride) * es;
  for (int t = 0; t < p.sq; ++t) {
    T* fq = r.q + int64_t(t) * r.mp;
    T* fk = r.k + int64_t(t) * r.mp;
    load_row(dt, q + int64_t(t) * p.q_row_stride * es, fq, p.d, r.mp);
    apply_feature(p.feature_map, fq, p.d, r.mp, p.scale);
    load_row(dt, k + int64_t(t) * p.k_row_stride * es, fk, p.d, r.mp);
    apply_feature(p.feature_map, fk, p.d, r.mp, T(1));
    load_row(dt, v + int64_t(t) * p.v_row_stride * es, r.v + int64_t(t) * r.dp, p.dim_v, r.dp);
    T* w = r.w + int64_t(t) * r.mp;
    const int64_t gate = (int64_t(b) * p.h + h) * p.sq + t;
    if (p.decay == nullptr) {
      w[0] = T(1);
    } else if (!p.decay_per_feature) {
      w[0] = T(std::exp(p.decay[gate]));
    } else {
      for (int m = 0; m < p.d; ++m) w[m] = T(std::exp(p.decay[gate * p.d + m]));
      std::fill(w + p.d, w + r.mp, T(0));
    }
  }
}

// How the state decays per position: not at all, by one factor per head, or by one per row
// (feature) of the state.
enum class Decay { kNone, kHead, kFeature };

// Columns [j0, j0 + NV vectors) of one (M, Dv) state s (row stride ld), every position in
// turn: S[:, j] <- w_t S[:, j] + K~_t v_t[j], O'_t[j] = Q~_t . S[:, j]. The NV vectors of v_t and
// of O'_t stay in registers while m runs down the rows (per vector: one load and one store of
// S, two FMAs); the (M, NV) column block, 8 KiB at M = 64, NV = 4, stays in L1 for the later
// positions, so only the first one reads it from memory.
template <int NV, Decay kDecay, typename T>
inline void advance_columns(const SP<T>& p, const StepRows<T>& r, T* __restrict__ s, int64_t ld, int j0) {
  constexpr int L = kLanes<T>;
  for (int t = 0; t < p.sq; ++t) {
    const T* __restrict__ fk = r.k + int64_t(t) * r.mp;
    const T* __restrict__ fq = r.q + int64_t(t) * r.mp;
    const T* __restrict__ wr = r.w + int64_t(t) * r.mp;
    const T w = wr[0];
    vec<T> v[NV], o[NV];
#pragma GCC unroll 4
    for (int i = 0; i < NV; ++i) {
      v[i] = vload(r.v + int64_t(t) * r.dp + j0 + i * L);
      o[i] = vec<T>{};
    }
    T* row = s + j0;
    for (int m = 0; m < p.d; ++m, row += ld) {
      const vec<T> a = vbcast_mem(fk + m), c = vbcast_mem(fq + m);
      vec<T> wm{};
      if constexpr (kDecay == Decay::kFeature) wm = vbcast_mem(wr + m);
#pragma GCC unroll 4
      for (int i = 0; i < NV; ++i) {
        vec<T> x = vload(row + i * L);
        if constexpr (kDecay == Decay::kHead) x *= w;
        if constexpr (kDecay == Decay::kFeature) x *= wm;
        x += a * v[i];
        vstore(row + i * L, x);
        o[i] += c * x;
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < NV; ++i) vstore(r.o + int64_t(t) * r.dp + j0 + i * L, o[i]);
  }
}

// The pass over one (M, Dv) state: blocks of 4 vectors of columns, then 2, 1, then the odd Dv
// tail column by column.
template <Decay kDecay, typename T>
void advance_state(const SP<T>& p, const StepRows<T>& r, T* s, int64_t ld) {
  constexpr int L = kLanes<T>;
  const int dv = p.dim_v, dv_vec = dv / L * L;
  int j = 0;
  for (; j + 4 * L <= dv_vec; j += 4 * L) advance_columns<4, kDecay>(p, r, s, ld, j);
  for (; j + 2 * L <= dv_vec; j += 2 * L) advance_columns<2, kDecay>(p, r, s, ld, j);
  for (; j + L <= dv_vec; j += L) advance_columns<1, kDecay>(p, r, s, ld, j);
  for (; j < dv; ++j) {
    for (int t = 0; t < p.sq; ++t) {
      const T* fk = r.k + int64_t(t) * r.mp;
      const T* fq = r.q + int64_t(t) * r.mp;
      const T vj = r.v[int64_t(t) * r.dp + j];
      const T* wr = r.w + int64_t(t) * r.mp;
      T o = T(0);
      for (int m = 0; m < p.d; ++m) {
        T& x = s[int64_t(m) * ld + j];
        if constexpr (kDecay == Decay::kHead) x *= wr[0];
        if constexpr (kDecay == Decay::kFeature) x *= wr[m];
        x += fk[m] * vj;
        o += fq[m] * x;
      }
      r.o[int64_t(t) * r.dp + j] = o;
    }
  }
}

// z <- w_t z + K~_t through the positions, vectorized over m; den[t] <- Q~_t . z_t + eps. w_t
// is the row r.w + t mp with per-feature gates, else its first entry (1 without decay).
template <typename T>
void advance_normalizer(const SP<T>& p, StepRows<T>& r, T* z, T* den) {
  constexpr int L = kLanes<T>;
  const int m_vec = p.d / L * L, nt = p.sq;
  const bool per_feature = p.decay != nullptr && p.decay_per_feature;
  auto w_at = [&](int t, int m) { return r.w[int64_t(t) * r.mp + (per_feature ? m : 0)]; };
  for (int t = 0; t < nt; ++t) den[t] = p.eps;
  std::fill(r.acc, r.acc + int64_t(nt) * L, T(0));
  for (int m = 0; m < m_vec; m += L) {
    vec<T> x = vload(z + m);
    for (int t = 0; t < nt; ++t) {
      const vec<T> w = per_feature ? vload(r.w + int64_t(t) * r.mp + m) : vbcast(w_at(t, 0));
      x = x * w + vload(r.k + int64_t(t) * r.mp + m);
      vstore(r.acc + int64_t(t) * L, vload(r.acc + int64_t(t) * L) + vload(r.q + int64_t(t) * r.mp + m) * x);
    }
    vstore(z + m, x);
  }
  for (int m = m_vec; m < p.d; ++m) {  // the odd M tail
    T x = z[m];
    for (int t = 0; t < nt; ++t) {
      x = x * w_at(t, m) + r.k[int64_t(t) * r.mp + m];
      den[t] += r.q[int64_t(t) * r.mp + m] * x;
    }
    z[m] = x;
  }
  for (int t = 0; t < nt; ++t) den[t] += hsum(vload(r.acc + int64_t(t) * L));
}

template <typename T>
void step_task(const SP<T>& p, DType dt, int64_t task, StepRows<T>& r, T* den) {
  const int b = int(task / p.h), h = int(task % p.h);
  load_rows(p, dt, b, h, r);
  T* s = p.state + int64_t(b) * p.state_batch_stride + int64_t(h) * p.state_head_stride;
  if (p.decay == nullptr) {
    advance_state<Decay::kNone>(p, r, s, p.state_row_stride);
  } else if (p.decay_per_feature) {
    advance_state<Decay::kFeature>(p, r, s, p.state_row_stride);
  } else {
    advance_state<Decay::kHead>(p, r, s, p.state_row_stride);
  }
  if (p.normalizer != nullptr) {
    advance_normalizer(p, r, p.normalizer + int64_t(b) * p.z_batch_stride + int64_t(h) * p.z_head_stride, den);
  }
  const size_t es = dtype_size(dt);
  char* o = static_cast<char*>(p.o) + (int64_t(b) * p.o_batch_stride + int64_t(h) * p.o_head_stride) * es;
  for (int t = 0; t < p.sq; ++t) {
    T* ot = r.o + int64_t(t) * r.dp;
    if (p.normalizer != nullptr) {
      const T inv = T(1) / den[t];
      for (int j = 0; j < p.dim_v; ++j) ot[j] *= inv;
    }
    store_row(dt, ot, o + int64_t(t) * p.o_row_stride * es, p.dim_v);
  }
}

}  // namespace

template <typename T>
void linear_step(const LinearStepParamsT<T>& p, DType dt) {
  const int64_t tasks = int64_t(p.b) * p.h;
  if (tasks == 0 || p.sq == 0) return;
  // at least ~32K state elements per chunk: smaller states are not worth waking the pool for
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(1, int64_t(p.d) * p.dim_v));
  pool_for(tasks, grain, [&](int64_t t0, int64_t t1) {
    StepRows<T> r(p.d, p.dim_v, p.sq);
    Buffer<T> den(size_t(p.sq));
    for (int64_t task = t0; task < t1; ++task) step_task(p, dt, task, r, den.data());
  });
}
template void linear_step<float>(const LinearStepParamsT<float>&, DType);
template void linear_step<double>(const LinearStepParamsT<double>&, DType);
ATTN_CPU_REGISTER(linear_step_stub<float>, &linear_step<float>);
ATTN_CPU_REGISTER(linear_step_stub<double>, &linear_step<double>);

ATTN_CPU_ISA_END
}  // namespace cpu
}  // namespace attn
