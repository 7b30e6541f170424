// The delta rule on the CPU (DeltaNet, Gated DeltaNet, KDA: common/delta_params.h states the
// math), forward and backward, in its recurrent form.
//
// Why recurrent and not chunked: the recurrence is exact for every gate, a hard reset (-inf)
// included, where the chunked (WY) form divides by cumulative gates; and each column j of the
// (K, V) state evolves on its own (the gate scales rows, and u_j, o_j only read column j), so a
// block of columns stays in L1 across every token of a sequence. A token then costs 4 K V
// multiply-adds out of L1 (about the chunked form's count at K = V = 128), with no C x C
// triangular solve and no state round trip through memory.
//
// Forward: one task per (sequence, value head, block of kCols columns), the block row-major
// (K rows of kCols), two passes per token over it: h' = a h with p = h'^T k accumulated; then
// u = beta (v - p), h = h' + k u^T with o = h^T q accumulated. Reductions run down the rows
// (over K), so they are vertical vector adds; kChains independent accumulators hide the FMA
// latency.
//
// Backward: one task per (sequence, value head), the state transposed (V rows of K, so the
// reductions over V that dq, dk and the gate's gradient need become vertical adds; the one over
// K, du, is a horizontal sum per row). The states are recomputed: a forward pass keeps a
// checkpoint every `chunk` tokens, then each chunk, last first, is replayed from its checkpoint
// keeping h_{t-1}, p_t and u_t of its tokens, and walked backwards. Per row j of a token, one
// pass gets du_j, the next dh' and the new dh_j. dq and dk of a value head go to float scratch
// and are summed over the value heads that share q / k (GVA) in a last pass, which also applies
// the L2 norm's backward.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/delta_params.h"
#include "cpu/isa.h"
#include "cpu/memory.h"
#include "cpu/parallel.h"
#include "cpu/simd.h"
#include "linear/cpu/entry.h"

namespace attn {
namespace cpu {
ATTN_CPU_ISA_BEGIN

namespace {

template <typename T>
using DP = DeltaParamsT<T>;
template <typename T>
using DBP = DeltaBwdParamsT<T>;

template <typename T>
T load_elem(DType dt, const void* base, int64_t i) {
  switch (dt) {
    case DType::kF32: return T(static_cast<const float*>(base)[i]);
    case DType::kF64: return T(static_cast<const double*>(base)[i]);
    case DType::kBF16: return T(bf16_to_f32(static_cast<const uint16_t*>(base)[i]));
    default: return T(f16_to_f32(static_cast<const uint16_t*>(base)[i]));
  }
}

template <typename T>
void store_elem(DType dt, void* base, int64_t i, T x) {
  switch (dt) {
    case DType::kF32: static_cast<float*>(base)[i] = float(x); break;
    case DType::kF64: static_cast<double*>(base)[i] = double(x); break;
    case DType::kBF16: static_cast<uint16_t*>(base)[i] = f32_to_bf16(float(x)); break;
    default: static_cast<uint16_t*>(base)[i] = f32_to_f16(float(x)); break;
  }
}

// Rows [row0, row0 + len) of sequence n, in batch b of the tensors.
struct Span {
  int b;
  int64_t row0;
  int len;
};

template <typename T>
Span span_of(const DP<T>& p, int n) {
  if (p.cu_seqlens != nullptr) return {0, p.cu_seqlens[n], p.cu_seqlens[n + 1] - p.cu_seqlens[n]};
  return {n, 0, p.s};
}

// 1 / sqrt(sum x^2 + eps) over the n values of x (the L2 norm's reciprocal)
template <typename T>
T inv_norm(const T* x, int n, T eps) {
  T s = 0;
  for (int i = 0; i < n; ++i) s += x[i] * x[i];
  return T(1) / std::sqrt(s + eps);
}

// One token's q / k rows (normalized, q scaled), gate factors and beta, widened to T and
// zero-padded to kp. a is left untouched without a gate.
template <typename T>
struct TokenIn {
  const DP<T>& p;
  int hv, hk;
  size_t es;
  TokenIn(const DP<T>& p_, int hv_) : p(p_), hv(hv_), hk(hv_ / (p_.h_v / p_.h_k)), es(dtype_size(p_.dt)) {}

  // row of (b, head, row) in a (B, H, S, .) tensor of dtype dt with these strides
  const char* row(const void* base, int64_t bs, int64_t hs, int64_t rs, int b, int h, int64_t r) const {
    return static_cast<const char*>(base) + (int64_t(b) * bs + int64_t(h) * hs + r * rs) * int64_t(es);
  }
  int64_t side(int b, int64_t r) const { return (int64_t(b) * p.h_v + hv) * p.s + r; }  // beta / gate index

  void qk(int b, int64_t r, T* q, T* k, int kp) const {
    load_row(p.dt, row(p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride, b, hk, r), k, p.dim_k, kp);
    if (q != nullptr) load_row(p.dt, row(p.q, p.q_batch_stride, p.q_head_stride, p.q_row_stride, b, hk, r), q, p.dim_k, kp);
    if (p.qk_l2norm) {
      const T rk = inv_norm(k, p.dim_k, p.l2_eps);
      for (int i = 0; i < p.dim_k; ++i) k[i] *= rk;
    }
    if (q != nullptr) {
      const T sq = p.qk_l2norm ? p.scale * inv_norm(q, p.dim_k, p.l2_eps) : p.scale;
      for (int i = 0; i < p.dim_k; ++i) q[i] *= sq;
    }
  }
  T beta(int b, int64_t r) const { return load_elem<T>(p.beta_dt, p.beta, side(b, r)); }
  void gate(int b, int64_t r, T* a, int kp) const {
    if (p.gate_per_key) {
      const int64_t g0 = side(b, r) * p.dim_k;
      for (int i = 0; i < p.dim_k; ++i) a[i] = std::exp(load_elem<T>(p.gate_dt, p.gate, g0 + i));
    } else {
      const T x = std::exp(load_elem<T>(p.gate_dt, p.gate, side(b, r)));
      for (int i = 0; i < p.dim_k; ++i) a[i] = x;
    }
    for (int i = p.dim_k; i < kp; ++i) a[i] = T(0);
  }
};

// ---------------------------------------------------------------------------------- forward

// columns per forward task: 32 (a 16 KiB block at K = 128 in float32, in L1 with room to spare)
template <typename T>
constexpr int kColVecs = std::max(1, 32 / kLanes<T>);
// independent accumulators per column vector, so that about 8 FMA chains are in flight
template <typename T>
constexpr int kChains = std::max(1, std::min(4, 8 / kColVecs<T>));

template <bool kGate, typename T>
void fwd_block(const DP<T>& p, int n, int hv, int j0, T* S, T* rows) {
  constexpr int L = kLanes<T>, NV = kColVecs<T>, CH = kChains<T>, Wp = NV * L;
  const int K = p.dim_k, w = std::min(Wp, p.dim_v - j0);
  const Span sp = span_of(p, n);
  const TokenIn<T> in(p, hv);
  T *q = rows, *k = q + K, *a = k + K, *v = a + K, *o = v + Wp;
  const int64_t st0 = (int64_t(n) * p.h_v + hv) * K * p.dim_v + j0;  // this block in a (b, h_v, K, V) state
  for (int m = 0; m < K; ++m) {
    T* row = S + int64_t(m) * Wp;
    for (int j = 0; j < Wp; ++j) row[j] = (p.init_state != nullptr && j < w) ? p.init_state[st0 + int64_t(m) * p.dim_v + j] : T(0);
  }
  for (int t = 0; t < sp.len; ++t) {
    const int64_t r = sp.row0 + t;
    in.qk(sp.b, r, q, k, K);
    if (kGate) in.gate(sp.b, r, a, K);
    const T beta = in.beta(sp.b, r);
    load_row(p.dt, in.row(p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride, sp.b, hv, r) + int64_t(j0) * in.es, v,
             w, Wp);
    // pass 1: h' = a h, p = h'^T k
    vec<T> acc[CH][NV];
    for (int c = 0; c < CH; ++c)
      for (int i = 0; i < NV; ++i) acc[c][i] = vec<T>{};
    int m = 0;
    for (; m + CH <= K; m += CH) {
#pragma GCC unroll 4
      for (int c = 0; c < CH; ++c) {
        T* row = S + int64_t(m + c) * Wp;
        const vec<T> km = vbcast(k[m + c]);
        const vec<T> am = vbcast(kGate ? a[m + c] : T(1));
#pragma GCC unroll 8
        for (int i = 0; i < NV; ++i) {
          vec<T> x = vload(row + i * L);
          if (kGate) {
            x *= am;
            vstore(row + i * L, x);
          }
          acc[c][i] += km * x;
        }
      }
    }
    for (; m < K; ++m) {
      T* row = S + int64_t(m) * Wp;
      const vec<T> km = vbcast(k[m]);
      const vec<T> am = vbcast(kGate ? a[m] : T(1));
      for (int i = 0; i < NV; ++i) {
        vec<T> x = vload(row + i * L);
        if (kGate) {
          x *= am;
          vstore(row + i * L, x);
        }
        acc[0][i] += km * x;
      }
    }
    vec<T> u[NV];
    const vec<T> bv = vbcast(beta);
    for (int i = 0; i < NV; ++i) {
      vec<T> s = acc[0][i];
      for (int c = 1; c < CH; ++c) s += acc[c][i];
      u[i] = bv * (vload(v + i * L) - s);
      for (int c = 0; c < CH; ++c) acc[c][i] = vec<T>{};
    }
    // pass 2: h = h' + k u^T, o = h^T q
    m = 0;
    for (; m + CH <= K; m += CH) {
#pragma GCC unroll 4
      for (int c = 0; c < CH; ++c) {
        T* row = S + int64_t(m + c) * Wp;
        const vec<T> km = vbcast(k[m + c]), qm = vbcast(q[m + c]);
#pragma GCC unroll 8
        for (int i = 0; i < NV; ++i) {
          const vec<T> x = vload(row + i * L) + km * u[i];
          vstore(row + i * L, x);
          acc[c][i] += qm * x;
        }
      }
    }
    for (; m < K; ++m) {
      T* row = S + int64_t(m) * Wp;
      const vec<T> km = vbcast(k[m]), qm = vbcast(q[m]);
      for (int i = 0; i < NV; ++i) {
        const vec<T> x = vload(row + i * L) + km * u[i];
        vstore(row + i * L, x);
        acc[0][i] += qm * x;
      }
    }
    for (int i = 0; i < NV; ++i) {
      vec<T> s = acc[0][i];
      for (int c = 1; c < CH; ++c) s += acc[c][i];
      vstore(o + i * L, s);
    }
    char* orow = static_cast<char*>(p.o) +
                 (int64_t(sp.b) * p.o_batch_stride + int64_t(hv) * p.o_head_stride + r * p.o_row_stride + j0) * int64_t(in.es);
    store_row(p.dt, o, orow, w);
  }
  if (p.final_state != nullptr) {
    for (int m = 0; m < K; ++m)
      std::memcpy(p.final_state + st0 + int64_t(m) * p.dim_v, S + int64_t(m) * Wp, sizeof(T) * w);
  }
}

// ---------------------------------------------------------------------------------- backward

// One task's scratch: the transposed state and its gradient (V rows of kp), the checkpoints, a
// chunk's token inputs and replayed states, per-token results.
template <typename T>
struct BwdScratch {
  int kp, V, chunk, nck;
  Buffer<T> mem;
  T *S, *dS, *ckpt, *H, *k, *q, *a, *v, *dov, *pp, *uu, *beta, *dq, *dk, *dg, *dvv;
  BwdScratch(int K, int V_, int chunk_, int max_len)
      : kp(round_up(K, kLanes<T>)), V(V_), chunk(chunk_), nck((max_len + chunk_ - 1) / chunk_) {
    const size_t st = size_t(V) * kp, ck = size_t(chunk);
    const size_t total = st * (2 + size_t(std::max(nck, 1)) + ck) + ck * (3 * size_t(kp) + 5 * size_t(V) + 1) +
                         3 * size_t(kp);
    mem.resize(total);
    T* x = mem.data();
    auto take = [&](size_t n) {
      T* r = x;
      x += n;
      return r;
    };
    S = take(st);
    dS = take(st);
    ckpt = take(st * std::max(nck, 1));
    H = take(st * ck);
    k = take(ck * kp);
    q = take(ck * kp);
    a = take(ck * kp);
    v = take(ck * V);
    dov = take(ck * V);
    pp = take(ck * V);
    uu = take(ck * V);
    dvv = take(ck * V);
    beta = take(ck);
    dq = take(kp);
    dk = take(kp);
    dg = take(kp);
  }
};

// Tokens of one chunk chosen so its replayed states (chunk x V x kp) stay near 2 MiB, the size of
// a core's L2 on current parts: 32 tokens at K = V = 128 in float32.
template <typename T>
int bwd_chunk(int K, int V) {
  const int64_t per = int64_t(round_up(K, kLanes<T>)) * V * int64_t(sizeof(T));
  return int(std::clamp<int64_t>((int64_t(2) << 20) / std::max<int64_t>(per, 1), 4, 64));
}

// Loads tokens [t0, t0 + nt) of the span into the chunk rows (with q and dout when `grads`).
template <bool kGate, typename T>
void load_chunk(const DBP<T>& p, const TokenIn<T>& in, const Span& sp, int t0, int nt, bool grads, BwdScratch<T>& sc) {
  const int kp = sc.kp, V = p.dim_v;
  for (int t = 0; t < nt; ++t) {
    const int64_t r = sp.row0 + t0 + t;
    in.qk(sp.b, r, grads ? sc.q + int64_t(t) * kp : nullptr, sc.k + int64_t(t) * kp, kp);
    if (kGate) in.gate(sp.b, r, sc.a + int64_t(t) * kp, kp);
    sc.beta[t] = in.beta(sp.b, r);
    load_row(p.dt, in.row(p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride, sp.b, in.hv, r), sc.v + int64_t(t) * V,
             V, V);
    if (grads) {
      const char* d = static_cast<const char*>(p.dout) +
                      (int64_t(sp.b) * p.do_batch_stride + int64_t(in.hv) * p.do_head_stride + r * p.do_row_stride) *
                          int64_t(in.es);
      load_row(p.dt, d, sc.dov + int64_t(t) * V, V, V);
    }
  }
}

// One token's step on the transposed state S (V rows of kp): per row j, S_j <- a S_j + u_j k with
// p_j = (a S_j) . k, u_j = beta (v_j - p_j); p and u written when not null.
template <bool kGate, typename T>
void step_t(T* S, int V, int kp, const T* k, const T* a, T beta, const T* v, T* p_out, T* u_out) {
  constexpr int L = kLanes<T>;
  for (int j = 0; j < V; ++j) {
    T* row = S + int64_t(j) * kp;
    vec<T> acc0{}, acc1{};
    int i = 0;
    for (; i + 2 * L <= kp; i += 2 * L) {
      vec<T> x0 = vload(row + i), x1 = vload(row + i + L);
      if (kGate) {
        x0 *= vload(a + i);
        x1 *= vload(a + i + L);
        vstore(row + i, x0);
        vstore(row + i + L, x1);
      }
      acc0 += x0 * vload(k + i);
      acc1 += x1 * vload(k + i + L);
    }
    for (; i < kp; i += L) {
      vec<T> x = vload(row + i);
      if (kGate) {
        x *= vload(a + i);
        vstore(row + i, x);
      }
      acc0 += x * vload(k + i);
    }
    const T pj = hsum_tree(acc0 + acc1), uj = beta * (v[j] - pj);
    const vec<T> uv = vbcast(uj);
    for (i = 0; i < kp; i += L) vstore(row + i, vload(row + i) + uv * vload(k + i));
    if (p_out != nullptr) p_out[j] = pj;
    if (u_out != nullptr) u_out[j] = uj;
  }
}

// The backward of one token: given h_{t-1} (H, transposed), p_t, u_t and the inputs, turns dS
// from dL/dh_t (without this token's output term) into dL/dh_{t-1}; writes dq~ (w.r.t. scale q^),
// dk^, dg (per key, w.r.t. the log-gate), dv and returns dbeta.
template <bool kGate, typename T>
T token_bwd(T* dS, const T* H, int V, int kp, const T* k, const T* q, const T* a, T beta, const T* v, const T* pv,
            const T* uv, const T* dov, T* dq, T* dk, T* dg, T* dv) {
  constexpr int L = kLanes<T>;
  std::fill(dq, dq + kp, T(0));
  std::fill(dk, dk + kp, T(0));
  if (kGate) std::fill(dg, dg + kp, T(0));
  T dbeta = 0;
  for (int j = 0; j < V; ++j) {
    const T* hj = H + int64_t(j) * kp;
    T* dsj = dS + int64_t(j) * kp;
    const vec<T> u = vbcast(uv[j]), d = vbcast(dov[j]);
    // ds = dh_t (with the output term), ht = h_t; dq += do_j ht, dk += u_j ds, du = ds . k
    vec<T> du{};
    for (int i = 0; i < kp; i += L) {
      const vec<T> kk = vload(k + i);
      const vec<T> hp = kGate ? vload(a + i) * vload(hj + i) : vload(hj + i);
      const vec<T> ht = hp + u * kk;
      const vec<T> ds = vload(dsj + i) + d * vload(q + i);
      vstore(dq + i, vload(dq + i) + d * ht);
      vstore(dk + i, vload(dk + i) + u * ds);
      du += ds * kk;
    }
    const T duj = hsum_tree(du), dpj = -beta * duj;
    dv[j] = beta * duj;
    dbeta += duj * (v[j] - pv[j]);
    // dh' = ds + dp_j k; dk += dp_j h'; dg += dh' h'; dh_{t-1} = a dh'
    const vec<T> dp = vbcast(dpj);
    for (int i = 0; i < kp; i += L) {
      const vec<T> kk = vload(k + i);
      const vec<T> hp = kGate ? vload(a + i) * vload(hj + i) : vload(hj + i);
      const vec<T> dhp = vload(dsj + i) + d * vload(q + i) + dp * kk;
      vstore(dk + i, vload(dk + i) + dp * hp);
      if (kGate) {
        vstore(dg + i, vload(dg + i) + dhp * hp);
        vstore(dsj + i, vload(a + i) * dhp);
      } else {
        vstore(dsj + i, dhp);
      }
    }
  }
  return dbeta;
}

// Float scratch for dq~ / dk^ per value head: (B, h_v, S, kp), summed over a q / k head's group
// by finish_qk.
template <typename T>
struct QkScratch {
  int64_t kp;
  T* dq;
  T* dk;
  T* at(T* base, const DP<T>& p, int b, int hv, int64_t r) const {
    return base + ((int64_t(b) * p.h_v + hv) * p.s + r) * kp;
  }
};

template <bool kGate, typename T>
void bwd_task(const DBP<T>& p, int n, int hv, BwdScratch<T>& sc, const QkScratch<T>& qs) {
  const int kp = sc.kp, V = p.dim_v, K = p.dim_k, C = sc.chunk;
  const Span sp = span_of(p, n);
  const TokenIn<T> in(p, hv);
  const int64_t st0 = (int64_t(n) * p.h_v + hv) * K * V;
  const int64_t st = int64_t(V) * kp;
  // the forward, keeping a checkpoint at each chunk's start
  std::fill(sc.S, sc.S + st, T(0));
  if (p.init_state != nullptr)
    for (int m = 0; m < K; ++m)
      for (int j = 0; j < V; ++j) sc.S[int64_t(j) * kp + m] = p.init_state[st0 + int64_t(m) * V + j];
  const int nck = (sp.len + C - 1) / C;
  for (int c = 0; c < nck; ++c) {
    std::memcpy(sc.ckpt + c * st, sc.S, sizeof(T) * st);
    if (c == nck - 1) break;  // the last chunk's states are replayed below
    load_chunk<kGate>(p, in, sp, c * C, C, false, sc);
    for (int t = 0; t < C; ++t)
      step_t<kGate>(sc.S, V, kp, sc.k + int64_t(t) * kp, sc.a + int64_t(t) * kp, sc.beta[t], sc.v + int64_t(t) * V,
                    (T*)nullptr, (T*)nullptr);
  }
  // dL/dh at the end
  std::fill(sc.dS, sc.dS + st, T(0));
  if (p.dfinal_state != nullptr)
    for (int m = 0; m < K; ++m)
      for (int j = 0; j < V; ++j) sc.dS[int64_t(j) * kp + m] = p.dfinal_state[st0 + int64_t(m) * V + j];
  for (int c = nck - 1; c >= 0; --c) {
    const int t0 = c * C, nt = std::min(C, sp.len - t0);
    load_chunk<kGate>(p, in, sp, t0, nt, true, sc);
    std::memcpy(sc.S, sc.ckpt + c * st, sizeof(T) * st);
    for (int t = 0; t < nt; ++t) {
      std::memcpy(sc.H + t * st, sc.S, sizeof(T) * st);
      step_t<kGate>(sc.S, V, kp, sc.k + int64_t(t) * kp, sc.a + int64_t(t) * kp, sc.beta[t], sc.v + int64_t(t) * V,
                    sc.pp + int64_t(t) * V, sc.uu + int64_t(t) * V);
    }
    for (int t = nt - 1; t >= 0; --t) {
      const int64_t r = sp.row0 + t0 + t;
      const T* kt = sc.k + int64_t(t) * kp;
      const T* at = sc.a + int64_t(t) * kp;
      T* dvt = sc.dvv + int64_t(t) * V;
      const T dbeta = token_bwd<kGate>(sc.dS, sc.H + t * st, V, kp, kt, sc.q + int64_t(t) * kp, at, sc.beta[t],
                                       sc.v + int64_t(t) * V, sc.pp + int64_t(t) * V, sc.uu + int64_t(t) * V,
                                       sc.dov + int64_t(t) * V, sc.dq, sc.dk, sc.dg, dvt);
      const int64_t side = (int64_t(sp.b) * p.h_v + hv) * p.s + r;
      store_elem(p.beta_dt, p.dbeta, side, dbeta);
      if (kGate) {
        if (p.gate_per_key) {
          for (int i = 0; i < K; ++i) store_elem(p.gate_dt, p.dgate, side * K + i, sc.dg[i]);
        } else {
          T s = 0;
          for (int i = 0; i < K; ++i) s += sc.dg[i];
          store_elem(p.gate_dt, p.dgate, side, s);
        }
      }
      std::memcpy(qs.at(qs.dq, p, sp.b, hv, r), sc.dq, sizeof(T) * kp);
      std::memcpy(qs.at(qs.dk, p, sp.b, hv, r), sc.dk, sizeof(T) * kp);
      char* dvr = static_cast<char*>(p.dv) +
                  (int64_t(sp.b) * p.dv_batch_stride + int64_t(hv) * p.dv_head_stride + r * p.dv_row_stride) *
                      int64_t(in.es);
      store_row(p.dt, dvt, dvr, V);
    }
  }
  if (p.dinit_state != nullptr)
    for (int m = 0; m < K; ++m)
      for (int j = 0; j < V; ++j) p.dinit_state[st0 + int64_t(m) * V + j] = sc.dS[int64_t(j) * kp + m];
}

// dq, dk of one (b, q / k head, row): the group's value heads summed; then the scale, and the L2
// norm's backward (y = x r, r = (x.x + eps)^-1/2: dx = r (dy - y (y . dy))).
template <typename T>
void finish_qk(const DBP<T>& p, const QkScratch<T>& qs, int b, int hk, int64_t r, T* x, T* dy) {
  const int K = p.dim_k, G = p.h_v / p.h_k;
  const size_t es = dtype_size(p.dt);
  for (int which = 0; which < 2; ++which) {
    T* base = which == 0 ? qs.dq : qs.dk;
    std::fill(dy, dy + K, T(0));
    for (int g = 0; g < G; ++g) {
      const T* s = qs.at(base, p, b, hk * G + g, r);
      for (int i = 0; i < K; ++i) dy[i] += s[i];
    }
    if (which == 0)
      for (int i = 0; i < K; ++i) dy[i] *= p.scale;
    if (p.qk_l2norm) {
      const void* src = which == 0 ? p.q : p.k;
      const int64_t bs = which == 0 ? p.q_batch_stride : p.k_batch_stride;
      const int64_t hs = which == 0 ? p.q_head_stride : p.k_head_stride;
      const int64_t rs = which == 0 ? p.q_row_stride : p.k_row_stride;
      load_row(p.dt, static_cast<const char*>(src) + (int64_t(b) * bs + int64_t(hk) * hs + r * rs) * int64_t(es), x, K, K);
      const T rn = inv_norm(x, K, p.l2_eps);
      T yd = 0;
      for (int i = 0; i < K; ++i) yd += x[i] * rn * dy[i];
      for (int i = 0; i < K; ++i) dy[i] = rn * (dy[i] - x[i] * rn * yd);
    }
    void* dst = which == 0 ? p.dq : p.dk;
    const int64_t bs = which == 0 ? p.dq_batch_stride : p.dk_batch_stride;
    const int64_t hs = which == 0 ? p.dq_head_stride : p.dk_head_stride;
    const int64_t rs = which == 0 ? p.dq_row_stride : p.dk_row_stride;
    store_row(p.dt, dy, static_cast<char*>(dst) + (int64_t(b) * bs + int64_t(hk) * hs + r * rs) * int64_t(es), K);
  }
}

}  // namespace

template <typename T>
void delta_fwd(const DeltaParamsT<T>& p) {
  constexpr int Wp = kColVecs<T> * kLanes<T>;
  const int nblk = (p.dim_v + Wp - 1) / Wp;
  const int64_t tasks = int64_t(p.b) * p.h_v * nblk;
  if (tasks == 0) return;
  parallel_tasks(tasks, 0, [&] {
    return [&, S = Buffer<T>(size_t(p.dim_k) * Wp), rows = Buffer<T>(3 * size_t(p.dim_k) + 2 * Wp)](int64_t task) mutable {
      const int jb = int(task % nblk), hv = int(task / nblk % p.h_v), n = int(task / nblk / p.h_v);
      if (p.gate != nullptr) {
        fwd_block<true>(p, n, hv, jb * Wp, S.data(), rows.data());
      } else {
        fwd_block<false>(p, n, hv, jb * Wp, S.data(), rows.data());
      }
    };
  });
}

template <typename T>
void delta_bwd(const DeltaBwdParamsT<T>& p) {
  const int64_t tasks = int64_t(p.b) * p.h_v;
  if (tasks == 0 || p.s == 0) return;
  int max_len = p.s;
  if (p.cu_seqlens != nullptr) {
    max_len = 0;
    for (int n = 0; n < p.b; ++n) max_len = std::max(max_len, p.cu_seqlens[n + 1] - p.cu_seqlens[n]);
  }
  const int kp = round_up(p.dim_k, kLanes<T>);
  const int batches = p.cu_seqlens != nullptr ? 1 : p.b;
  Buffer<T> scratch(size_t(2) * batches * p.h_v * size_t(p.s) * kp);
  const QkScratch<T> qs{kp, scratch.data(), scratch.data() + size_t(batches) * p.h_v * size_t(p.s) * kp};
  const int chunk = bwd_chunk<T>(p.dim_k, p.dim_v);
  parallel_tasks(tasks, 0, [&] {
    return [&, sc = BwdScratch<T>(p.dim_k, p.dim_v, chunk, max_len)](int64_t task) mutable {
      const int hv = int(task % p.h_v), n = int(task / p.h_v);
      if (p.gate != nullptr) {
        bwd_task<true>(p, n, hv, sc, qs);
      } else {
        bwd_task<false>(p, n, hv, sc, qs);
      }
    };
  });
  // rows of every sequence (varlen: the pack's rows inside a sequence; the rest stay zero)
  const int hk_all = p.h_k;
  const int64_t rows = int64_t(batches) * hk_all * p.s;
  pool_for(rows, 64, [&](int64_t r0, int64_t r1) {
    Buffer<T> x(size_t(p.dim_k)), dy(size_t(p.dim_k));
    for (int64_t i = r0; i < r1; ++i) {
      const int64_t r = i % p.s;
      const int hk = int(i / p.s % hk_all), b = int(i / p.s / hk_all);
      if (p.cu_seqlens != nullptr && (r < p.cu_seqlens[0] || r >= p.cu_seqlens[p.b])) continue;
      finish_qk(p, qs, b, hk, r, x.data(), dy.data());
    }
  });
}

template void delta_fwd<float>(const DeltaParamsT<float>&);
template void delta_fwd<double>(const DeltaParamsT<double>&);
template void delta_bwd<float>(const DeltaBwdParamsT<float>&);
template void delta_bwd<double>(const DeltaBwdParamsT<double>&);
ATTN_CPU_REGISTER(delta_fwd_stub<float>, &delta_fwd<float>);
ATTN_CPU_REGISTER(delta_fwd_stub<double>, &delta_fwd<double>);
ATTN_CPU_REGISTER(delta_bwd_stub<float>, &delta_bwd<float>);
ATTN_CPU_REGISTER(delta_bwd_stub<double>, &delta_bwd<double>);

ATTN_CPU_ISA_END
}  // namespace cpu
}  // namespace attn
