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
// Forward: the state by blocks of 32-64 columns, each row-major (K rows) in L1; a task runs one
// (sequence, value head)'s blocks, all of them or one (fwd_group), by chunks of tokens prepared
// once for all its blocks. One pass per token: it finishes token t (h_t = h' + k u^T, o_t =
// h_t^T q) and starts token t + 1 (h' = a h_t, p = h'^T k) in the same sweep, so each token
// loads and stores the block once. Reductions run down the rows (over K), so they are vertical
// vector adds; a few rows at a time keep independent accumulators, hiding the FMA latency. Over
// a gated sequence the gates stay out of the block as running per-row factors, folded back into
// it when they leave a safe range, so the pass costs the ungated one's FMAs. At AVX-512 one pass
// finishes two tokens where no gate folds between them (delta_pair_pass), p_{t+1} coming from
// sums the pass before took.
//
// Backward: one task per (sequence, value head), the state transposed (V rows of K, so the
// reductions over V that dq, dk and the gate's gradient need become vertical adds; the one over
// K, du, is a horizontal sum per row). The states are recomputed: a forward pass keeps a
// checkpoint every `chunk` tokens, then each chunk, last first, is replayed from its checkpoint
// and walked backwards. Rows evolve independently, so both run by blocks of rows that stay in L1
// (block_rows): a block is replayed through the chunk, keeping its h' = a h_{t-1}, p_t and u_t, then
// walked back through it. The replay (and the first forward pass) sweeps the block's rows once per
// token, R rows at a time sharing the loads of k and a (replay_sweep); rows held in registers
// through all the tokens instead wait on each token's horizontal sum, and at AVX2 a row of 16
// vectors does not fit. Per row j of a token, one pass gets du_j, the next dh' and the new dh_j;
// the terms of dq, dk and dg that a per-token scalar times q or k carries are added once per
// token (finish_token). Without GVA a token's dq and dk are then done (the L2 norm's backward
// applied); with it they go to float scratch and are summed over the value heads that share q / k
// in a last pass.
//
// The plain write (params.plain: u_t = v_t, linear attention with GLA's per-feature gates) is the
// same recurrence without p = h'^T k and its gradient terms: the kDelta = false instantiations.
// As u does not wait on the state, its forward finishes two ungated tokens per pass
// (plain_pair_pass).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

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

// Element 0 of checkpoint c of sequence n, value head hv, in p.checkpoints ((slots, h_v, V, K):
// delta_params.h).
template <typename T>
int64_t checkpoint_offset(const DP<T>& p, int n, int hv, int c) {
  const int64_t slot0 = p.cu_seqlens != nullptr ? int64_t(p.cu_seqlens[n]) / kDeltaChunk + n
                                                 : int64_t(n) * ((p.s + kDeltaChunk - 1) / kDeltaChunk);
  return ((slot0 + c) * p.h_v + hv) * int64_t(p.dim_v) * p.dim_k;
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
      load_row(p.gate_dt, static_cast<const char*>(p.gate) + g0 * int64_t(dtype_size(p.gate_dt)), a, p.dim_k, p.dim_k);
      int i = 0;
      if constexpr (std::is_same_v<T, float>) {  // K exps per token: vectorized where the gates are <= 0
        constexpr int L = kLanes<T>;
        const vec<T> log2e = vbcast(T(1.4426950408889634));
        for (; i + L <= p.dim_k; i += L) {
          const vec<T> x = vload(a + i);
          if (hmax(x) <= T(0)) {
            vstore(a + i, vexp2_nonpos(x * log2e));
          } else {
            for (int l = 0; l < L; ++l) a[i + l] = std::exp(a[i + l]);
          }
        }
      }
      for (; i < p.dim_k; ++i) a[i] = std::exp(a[i]);
    } else {  // by vectors (the compiler left the plain loop scalar)
      const T x = std::exp(load_elem<T>(p.gate_dt, p.gate, side(b, r)));
      constexpr int L = kLanes<T>;
      const vec<T> xv = vbcast(x);
      int i = 0;
      for (; i + L <= p.dim_k; i += L) vstore(a + i, xv);
      for (; i < p.dim_k; ++i) a[i] = x;
    }
    for (int i = p.dim_k; i < kp; ++i) a[i] = T(0);
  }
};

// ---------------------------------------------------------------------------------- forward

// calls of at most this many tokens are decode steps (direct_step)
constexpr int kStepTokens = 16;
// A decode step: a few tokens from a given state to a returned one, no checkpoints. Its passes
// may run on the final state's own rows (fwd_group's direct mode, delta_fwd's wide blocks): in
// place when the two are one tensor (delta_rule_step(inplace=True)), else the first pass reads
// the initial state's rows and writes the final state's.
// step_call: such a call, checkpoints or not (which choose its blocks and whether the gate is
// factored, so that a forward with checkpoints computes what one without does, bit for bit).
template <typename T>
bool step_call(const DP<T>& p) {
  return p.s <= kStepTokens && p.init_state != nullptr && p.final_state != nullptr;
}
template <typename T>
bool direct_step(const DP<T>& p) {
  return step_call(p) && p.checkpoints == nullptr;
}
// Whether a direct step's blocks of Wp columns run on the state's rows: whole blocks only.
template <typename T>
bool on_state_rows(const DP<T>& p, int Wp) {
  return direct_step(p) && p.dim_v % Wp == 0;
}

// columns per forward block: 32 (a 16 KiB block at K = 128 in float32, in L1 with room to spare)
// Vector registers: 32 at AVX-512, 16 below.
constexpr int kVecRegs = kVecBytes >= 64 ? 32 : 16;

template <typename T>
constexpr int kColVecs = std::max(1, 32 / kLanes<T>);
// At AVX-512 in float32, 64 columns where the block fits in three quarters of L1 (32 KiB at K =
// 128: Sapphire Rapids' and Zen 5's 48 KiB L1, not Zen 4's 32 KiB): a row's broadcasts of k, q
// and a and its loop overhead then serve 4 vectors instead of 2 (1.15-1.3x on the forward,
// benchmarks/results/2026-12-01-delta-fwd-intel.md).
template <typename T>
constexpr int kBigColVecs = kLanes<T> >= 16 ? 4 : kColVecs<T>;

// One token's inputs, widened: q (scaled), k, gate factors (K each), v's block (Wp), beta; kn:
// the k that the pass starting this token dots with h' (k itself, or k C with the gate factored
// out, fwd_group).
template <typename T>
struct FwdToken {
  T *q, *k, *a, *v, *kn;
  T beta;
  bool fold;  // with the gate factored out: the pass starting this token is the gated one
};

// A pass's walk over the block's K rows (stride ld; `from`, the rows it reads, the same or a
// source's at the same stride), CH rows a step, each with its own sums (c), then the rest on sums 0:
// step(row, from_row, m, c). By a running pointer: an index times the runtime ld cost each row an
// imul and address arithmetic on the ports the FMAs use.
template <int CH, typename T, typename Step>
__attribute__((always_inline)) inline void walk_rows(T* S, const T* from, int64_t ld, int K, Step&& step) {
  int m = 0;
  T* rp = S;
  const T* fp = from;
  for (; m + CH <= K; m += CH, rp += CH * ld, fp += CH * ld) {
#pragma GCC unroll 4
    for (int c = 0; c < CH; ++c) step(rp + c * ld, fp + c * ld, m + c, c);
  }
  for (; m < K; ++m, rp += ld, fp += ld) step(rp, fp, m, 0);
}

// out = the CH chains of sums added in order (the order every pass uses: checkpoints and the
// two-token pass reproduce the single passes bit for bit)
template <int CH, int NV, typename T>
__attribute__((always_inline)) inline void sum_chains(const vec<T> (&s)[CH][NV], vec<T> (&out)[NV]) {
  for (int i = 0; i < NV; ++i) {
    out[i] = s[0][i];
    for (int c = 1; c < CH; ++c) out[i] += s[c][i];
  }
}

// The pass over the block that finishes token t and starts token t + 1 (kNext): per row m,
// x = h'_t[m] + k_t[m] u (h_t's row), o += q_t[m] x; then h'_{t+1}[m] = a_{t+1}[m] x, and
// p += k_{t+1}[m] h'_{t+1}[m]. One load and one store of the block per token. Without kFinish
// (the prologue) it only starts token t + 1 (x = h_{-1}'s row).
// Always inlined: with the kDelta instantiations GCC stopped inlining it into the forward's
// call sites, and the out-of-line pass ran the forward 1.7x slower.
// kSrc (a direct step's first pass, out of place): the rows are read from src (same ld), not S.
template <bool kFinish, bool kNext, bool kGate, bool kDelta, int NV, int CH, typename T, bool kSrc = false>
__attribute__((always_inline)) inline void fused_pass(T* __restrict__ S, int64_t ld, int K, const FwdToken<T>& cur,
                                                      const FwdToken<T>& nxt, const vec<T>* u, vec<T> (&o)[NV],
                                                      vec<T> (&pn)[NV], const T* __restrict__ src = nullptr) {
  constexpr int L = kLanes<T>;
  // the token rows as local restrict pointers: read through the FwdToken references, they were
  // reloaded on every row (the stores to S may alias them as far as the compiler knows)
  const T* __restrict__ ck = cur.k;
  const T* __restrict__ cq = cur.q;
  const T* __restrict__ nk = nxt.kn;
  const T* __restrict__ na = nxt.a;
  vec<T> oc[CH][NV] = {}, pc[CH][NV] = {};
  auto row_step = [&](T* __restrict__ row, const T* from, int m, int c) __attribute__((always_inline)) {
    vec<T>* oa = oc[c];
    vec<T>* pa = pc[c];
    // broadcasts from memory (load ports): a register broadcast takes the shuffle port, which Zen
    // shares with an FMA pipe (simd.h's vbcast_mem)
    vec<T> kc{}, qc{}, kn{}, an = vbcast(T(1));
    if (kFinish) kc = vbcast_mem(ck + m), qc = vbcast_mem(cq + m);
    if (kNext && kDelta) kn = vbcast_mem(nk + m);
    if (kNext && kGate) an = vbcast_mem(na + m);
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) {
      vec<T> x = vload((kSrc ? from : row) + i * L);
      if (kFinish) {
        x += kc * u[i];
        oa[i] += qc * x;
      }
      if (kNext) {
        if (kGate) x *= an;
        if (kDelta) pa[i] += kn * x;  // the plain write (GLA) reads no p
      }
      vstore(row + i * L, x);
    }
  };
  walk_rows<CH>(S, kSrc ? src : S, ld, K, row_step);
  sum_chains<CH, NV, T>(oc, o);
  sum_chains<CH, NV, T>(pc, pn);
}

// The plain write (GLA) over two tokens in one pass, both passes ungated (no gate, or the gate
// factored out) and nothing started: per row m, x = h[m] + k_t[m] u_t, o_t += q_t[m] x,
// x += k_{t+1}[m] u_{t+1}, o_{t+1} += q_{t+1}[m] x. The two single passes' operations in their
// order and sums (bit for bit the same), with one load and one store of the block for both
// tokens: a single plain pass has two FMAs per load and store, and ran at about a third of the
// FMA peak. kPairRegs: the registers it holds (two sets of o sums, both u, four broadcasts, x).
template <int NV, int CH>
constexpr int kPairRegs = 2 * CH * NV + 2 * NV + 5;

template <int NV, int CH, typename T>
__attribute__((always_inline)) inline void plain_pair_pass(T* __restrict__ S, int64_t ld, int K,
                                                           const FwdToken<T>& t0, const FwdToken<T>& t1,
                                                           const vec<T>* u0, const vec<T>* u1, vec<T> (&o0)[NV],
                                                           vec<T> (&o1)[NV]) {
  constexpr int L = kLanes<T>;
  const T *__restrict__ k0 = t0.k, *__restrict__ q0 = t0.q;  // restrict: as in fused_pass
  const T *__restrict__ k1 = t1.k, *__restrict__ q1 = t1.q;
  vec<T> a0[CH][NV] = {}, a1[CH][NV] = {};
  auto row_step = [&](T* __restrict__ row, const T*, int m, int c) __attribute__((always_inline)) {
    vec<T>* oa = a0[c];
    vec<T>* ob = a1[c];
    const vec<T> kc = vbcast_mem(k0 + m), qc = vbcast_mem(q0 + m);
    const vec<T> kd = vbcast_mem(k1 + m), qd = vbcast_mem(q1 + m);
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) {
      vec<T> x = vload(row + i * L);
      x += kc * u0[i];
      oa[i] += qc * x;
      x += kd * u1[i];
      ob[i] += qd * x;
      vstore(row + i * L, x);
    }
  };
  walk_rows<CH>(S, S, ld, K, row_step);
  sum_chains<CH, NV, T>(a0, o0);
  sum_chains<CH, NV, T>(a1, o1);
}

// The delta rule over two ungated tokens in one pass (fwd_group, where no gate folds between
// them). u_t waits on p_t = h'_t^T kn_t, which the pass before gave; u_{t+1} waits on
// p_{t+1} = h_t^T kn_{t+1} = r_{t+1} + kappa_t u_t, with r_{t+1} = h'_t^T kn_{t+1} (from the pass
// before too) and kappa_t = kn_{t+1} . k_t (a scalar per token pair, from the chunk's
// preparation). Then per row m: x = h'[m] + k_t[m] u_t, o_t += q_t[m] x, x += k_{t+1}[m] u_{t+1},
// o_{t+1} += q_{t+1}[m] x, and for the next pair p_{t+2} += kn_{t+2}[m] x, r_{t+3} += kn_{t+3}[m] x:
// six FMAs per load and store of the block where two single passes take six per two loads and
// stores. p_{t+1} rounds differently from the single pass's dot product: the forward chooses its
// pairs the same with and without checkpoints, so the two compute the same bits.
// registers: four sums a vector per chain, u_t and u_{t+1}, x and the six broadcasts of a row
template <int NV, int CH>
constexpr int kDeltaPairRegs = 4 * CH * NV + 2 * NV + 7;
// Whether a block of NV vectors takes delta_pair_pass: blocks of four vectors where their sums, u
// and the broadcasts fit the registers (AVX-512's 64-column float blocks, its float64 blocks:
// medians 1.07-1.19x the single passes on an Intel Xeon). Narrower blocks serve the row's six
// broadcasts and token pointers with fewer vectors: AVX-512's 32-column blocks (Zen 4's L1, few
// tasks) ran 0.89-0.92x gated (GCC kept two sums on the stack) and 1.02-1.05x ungated, and at AVX2
// half blocks (two vectors) 0.83-1.0x (benchmarks/results/2026-12-01-delta-pair-pass.md).
template <int NV>
constexpr bool kDeltaPairs = NV >= 4 && kDeltaPairRegs<NV, 1> <= kVecRegs;

template <int NV, int CH, typename T>
__attribute__((always_inline)) inline void delta_pair_pass(T* __restrict__ S, int64_t ld, int K, const T* k0_,
                                                           const T* q0_, const T* k1_, const T* q1_, const T* n2_,
                                                           const T* n3_, const vec<T>* u0, const vec<T>* u1,
                                                           vec<T>* o0, vec<T>* o1, vec<T>* p2, vec<T>* r3) {
  constexpr int L = kLanes<T>;
  const T *__restrict__ k0 = k0_, *__restrict__ q0 = q0_, *__restrict__ k1 = k1_, *__restrict__ q1 = q1_;
  const T *__restrict__ n2 = n2_, *__restrict__ n3 = n3_;
  static_assert(kDeltaPairRegs<NV, CH> <= kVecRegs, "the sums leave registers for u, x and a broadcast");
  vec<T> a0[CH][NV] = {}, a1[CH][NV] = {}, a2[CH][NV] = {}, a3[CH][NV] = {};
  auto row_step = [&](T* __restrict__ row, const T*, int m, int c) __attribute__((always_inline)) {
    const vec<T> kc = vbcast_mem(k0 + m), qc = vbcast_mem(q0 + m);
    const vec<T> kd = vbcast_mem(k1 + m), qd = vbcast_mem(q1 + m);
    const vec<T> ke = vbcast_mem(n2 + m), kf = vbcast_mem(n3 + m);
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) {
      vec<T> x = vload(row + i * L);
      x += kc * u0[i];
      a0[c][i] += qc * x;
      x += kd * u1[i];
      a1[c][i] += qd * x;
      a2[c][i] += ke * x;
      a3[c][i] += kf * x;
      vstore(row + i * L, x);
    }
  };
  walk_rows<CH>(S, S, ld, K, row_step);
  vec<T> s0[NV], s1[NV], s2[NV], s3[NV];
  sum_chains<CH, NV, T>(a0, s0);
  sum_chains<CH, NV, T>(a1, s1);
  sum_chains<CH, NV, T>(a2, s2);
  sum_chains<CH, NV, T>(a3, s3);
  for (int i = 0; i < NV; ++i) o0[i] = s0[i], o1[i] = s1[i], p2[i] = s2[i], r3[i] = s3[i];
}

// r = h'^T kn over the block's columns (a read-only pass): the r_{t+1} a chain of pair passes
// starts from.
template <int NV, int CH, typename T>
__attribute__((always_inline)) inline void dot_pass(const T* __restrict__ S, int64_t ld, int K, const T* kn_,
                                                    vec<T> (&r)[NV]) {
  constexpr int L = kLanes<T>;
  const T* __restrict__ kn = kn_;
  vec<T> a[CH][NV] = {};
  auto row_step = [&](T* row, const T*, int m, int c) __attribute__((always_inline)) {
    const vec<T> kc = vbcast_mem(kn + m);
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) a[c][i] += kc * vload(row + i * L);
  };
  walk_rows<CH>(const_cast<T*>(S), S, ld, K, row_step);
  sum_chains<CH, NV, T>(a, r);
}

// Columns [j0, j0 + w) of the block S (K rows of Wp) into checkpoint c, transposed: each of its
// rows written in order (the block's strided reads stay in L1).
template <typename T>
void write_checkpoint(const DP<T>& p, int n, int hv, int c, int j0, int w, int Wp, const T* S) {
  T* ck = p.checkpoints + checkpoint_offset(p, n, hv, c) + int64_t(j0) * p.dim_k;
  for (int j = 0; j < w; ++j) {
    T* row = ck + int64_t(j) * p.dim_k;
    for (int m = 0; m < p.dim_k; ++m) row[m] = S[int64_t(m) * Wp + j];
  }
}

// At a checkpoint, once every 64 tokens: finish token t (S = h_t), keep it, start token t + 1.
// Out of line, so that fwd_group's token loop is the one it is without checkpoints.
template <bool kGate, bool kDelta, int NV, int CH, typename T>
__attribute__((noinline)) void checkpoint_pass(const DP<T>& p, int n, int hv, int c, int j0, int w, T* S,
                                               const FwdToken<T>& cur, const FwdToken<T>& nxt, const vec<T>* u,
                                               vec<T> (&o)[NV], vec<T> (&pn)[NV]) {
  vec<T> unused[NV];
  fused_pass<true, false, kGate, kDelta, NV, CH>(S, NV * kLanes<T>, p.dim_k, cur, nxt, u, o, unused);
  write_checkpoint(p, n, hv, c, j0, w, NV * kLanes<T>, S);
  fused_pass<false, true, kGate, kDelta, NV, CH>(S, NV * kLanes<T>, p.dim_k, cur, nxt, u, unused, pn);
}

// Tokens whose inputs a forward task prepares at once (fwd_group): 65 x 4 K floats (the chunk
// and the next one's first; q, k, a and kn), 130 KiB at K = 128, held in L2 while each of the
// task's column blocks runs through them.
constexpr int kFwdChunk = 64;

// One forward task's scratch: its blocks' rows (nb x K x Wp; none for a direct step, which runs
// on the state's rows) and pending p (nb x Wp), a chunk's prepared tokens (kFwdChunk + 1 rows of
// q, k, a and kn, K each, beta, kappa and the fold flags), two v blocks, o and the running
// factors C (K).
// It points into its own memory: not to be copied.
template <typename T>
struct FwdScratch {
  static constexpr size_t kBetaSlots = size_t(kFwdChunk + 16) / 16 * 16;  // whole lines after it
  Buffer<T> mem;
  T *S, *pv, *tok, *beta, *kappa, *v, *o, *C;
  bool fold[kFwdChunk + 1];
  FwdScratch(int K, int nb, int Wp, bool rows) {
    const size_t st = rows ? size_t(nb) * K * Wp : 0, tk = size_t(kFwdChunk + 1) * 4 * K;
    mem.resize(st + size_t(nb) * Wp + tk + 2 * kBetaSlots + 3 * size_t(Wp) + size_t(K));
    S = mem.data();
    pv = S + st;
    tok = pv + size_t(nb) * Wp;
    beta = tok + tk;
    kappa = beta + kBetaSlots;  // delta_pair_pass's kn_{t+1} . k_t per token of the chunk
    v = kappa + kBetaSlots;
    o = v + 2 * size_t(Wp);
    C = o + Wp;
  }
  FwdScratch(const FwdScratch&) = delete;
  FwdScratch& operator=(const FwdScratch&) = delete;
};

// The gate factored out of the state (fwd_group): the rows hold H with h = Diag(C) H while every
// C stays in [2^-40, 2^40], so that H's magnitudes stay inside float32's range.
template <typename T>
constexpr T kFactorLo = T(9.094947017729282e-13);
template <typename T>
constexpr T kFactorHi = T(1.099511627776e12);

// One token's factors with the gate factored out (fwd_group): x = a C into a (a the token's gate
// factors, C the running ones, K each). Unless the token folds (edge, or an x outside
// [kFactorLo, kFactorHi], NaN included), kn = k x for the pass that starts it and k / x, q x for
// the one that finishes it. With keep, C becomes x, or 1 where it folds. Returns whether it folds.
// All by vectors: C's copy as a plain loop stayed scalar (benchmarks/results/2026-12-02-delta-prep-zen5.md).
template <typename T>
bool factor_token(T* __restrict__ a, T* __restrict__ C, T* __restrict__ k, T* __restrict__ q, T* __restrict__ kn,
                  int K, bool edge, bool keep) {
  constexpr int L = kLanes<T>;
  const vec<T> lo = vbcast(kFactorLo<T>), hi = vbcast(kFactorHi<T>);
  uint32_t out = edge ? 1u : 0u;
  int m = 0;
  for (; m + L <= K; m += L) {
    const vec<T> x = vload(a + m) * vload(C + m);
    vstore(a + m, x);
    out |= lane_bits(~((x >= lo) & (x <= hi)));
  }
  for (; m < K; ++m) {
    a[m] *= C[m];
    out |= !(a[m] >= kFactorLo<T> && a[m] <= kFactorHi<T>) ? 1u : 0u;
  }
  const bool fold = out != 0;
  m = 0;
  if (fold) {
    if (keep) {
      const vec<T> one = vbcast(T(1));
      for (; m + L <= K; m += L) vstore(C + m, one);
      for (; m < K; ++m) C[m] = T(1);
    }
    return true;
  }
  for (; m + L <= K; m += L) {
    const vec<T> f = vload(a + m), km = vload(k + m);
    vstore(kn + m, km * f);
    vstore(k + m, km / f);
    vstore(q + m, vload(q + m) * f);
    if (keep) vstore(C + m, f);
  }
  for (; m < K; ++m) {
    kn[m] = k[m] * a[m], k[m] /= a[m], q[m] *= a[m];
    if (keep) C[m] = a[m];
  }
  return false;
}

// The forward of one sequence n and value head hv over column blocks [jb0, jb0 + nb) of Wp = NV
// vectors. By chunks of kFwdChunk tokens: the chunk's q and k are widened, normalized and scaled,
// and its gates exponentiated, once (with the next chunk's first token, which the chunk's last
// pass starts), then each block runs through the chunk, its K rows (and the p its last pass
// started) carried in the scratch from one chunk to the next: a block's 16-32 KiB come back from
// L2 once per chunk, where preparing the tokens per block repeated that work nb times (a fifth of
// the KDA forward at AVX2's 4 blocks per head).
// kCkpt: keep the backward's checkpoints (p.checkpoints); an instantiation of its own, so that the
// token loop without them compiles as it did (a branch in it slowed the gated float32 forward 1.6x).
// flatten: every call in it inlined (the token / store_out lambdas, load_row, store_row, the
// preparation; checkpoint_pass stays out, noinline). GCC left load_row and store_row out of line
// in the gated instantiations only, which then ran slower than DeltaNet's forward with the same
// FMA loop (benchmarks/results/2026-12-02-delta-flatten-zen5.md).
template <bool kGate, bool kDelta, bool kCkpt, typename T, int NV = kColVecs<T>>
__attribute__((flatten)) void fwd_group(const DP<T>& p, int n, int hv, int jb0, int nb, FwdScratch<T>& sc) {
  // rows per step (each with its own o and p sums): 2 x CH x NV accumulators, NV of u and the
  // broadcasts in the registers (32 at AVX-512, 16 at AVX2)
  constexpr int L = kLanes<T>, CH = (L >= 16 && NV == 4) ? 2 : std::max(1, 4 / NV), Wp = NV * L;
  const int K = p.dim_k;
  const Span sp = span_of(p, n);
  const TokenIn<T> in(p, hv);
  // A decode step (direct_step, whole blocks of columns): the passes run on the final state's
  // rows themselves, the first reading the initial state's, without the copy into the block and
  // back (two of a step's four passes). Strided rows would conflict in L1 over many tokens.
  const bool direct = !kCkpt && on_state_rows(p, Wp);
  const int64_t ld = direct ? p.dim_v : Wp;
  // The gate factored out of the rows over a sequence (not a step, whose state must come out as
  // itself): the rows hold H with h = Diag(C) H, C the running product of the gates, so a
  // token multiplies C by its gate (K multiplies, once per chunk's preparation) instead of every
  // element of every block, and the pass takes the factors in its per-row scalars (k / C for the
  // update, q C for o, k C for p): the ungated pass's FMAs. The gated pass (the recurrence itself)
  // folds C back into the rows when one leaves [kFactorLo, kFactorHi] (a gate of -inf among them)
  // and at the first and last token of every kDeltaChunk (checkpoints are after the last). It
  // rounds differently from the recurrence (a prefill then steps, which run unfactored, equals
  // the whole sequence to rounding, not bit for bit).
  const bool factor = kGate && !step_call(p);
  // the delta rule two tokens a pass (delta_pair_pass): not in a decode step (which runs as the
  // recurrence, token by token)
  const bool pairs = kDelta && kDeltaPairs<NV> && !step_call(p);
  auto kn_of = [&](int t, int c0) {  // the kn row token t's pass dots with (FwdToken::kn)
    T* row = sc.tok + int64_t(t - c0) * 4 * K;
    return (!factor || sc.fold[t - c0]) ? row + K : row + 3 * K;
  };
  const int64_t st0 = (int64_t(n) * p.h_v + hv) * K * p.dim_v;  // this head in a (b, h_v, K, V) state
  auto block = [&](int g) { return direct ? p.final_state + st0 + int64_t(jb0 + g) * Wp : sc.S + int64_t(g) * K * Wp; };
  auto width = [&](int g) { return std::min(Wp, p.dim_v - (jb0 + g) * Wp); };
  if (!direct) {
    for (int g = 0; g < nb; ++g) {
      const int j0 = (jb0 + g) * Wp, w = width(g);
      // Two loops, not one select: GCC turned `init_state != nullptr && j < w ? init_state[..] : 0`
      // into masked loads from the null pointer, each a fault-suppression assist on Zen 5, about
      // 200 us a call whatever its length (benchmarks/results/2026-12-02-delta-prep-zen5.md).
      for (int m = 0; m < K; ++m) {
        T* row = block(g) + int64_t(m) * Wp;
        int j = 0;
        if (p.init_state != nullptr) {
          const T* src = p.init_state + st0 + int64_t(m) * p.dim_v + j0;
          for (; j < w; ++j) row[j] = src[j];
        }
        for (; j < Wp; ++j) row[j] = T(0);
      }
    }
  }
  // v's block is 32-64 columns of each row (128-256 of a row's 512 bytes at V = 128 in float32),
  // a strided stream the hardware prefetchers left the token loop waiting on: fetched kAhead
  // tokens early into L2.
  constexpr int kAhead = 8;
  auto v_row = [&](int t, int j0) {
    return in.row(p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride, sp.b, hv, sp.row0 + t) + int64_t(j0) * in.es;
  };
  // The next chunk's q and k rows (and KDA's gate rows), fetched into L2 while the first block
  // runs through this chunk: the preparation otherwise waited on them, a new stream every chunk
  // (about 7% of the bf16 DeltaNet forward, benchmarks/results/2026-12-02-delta-prep-zen5.md).
  auto prefetch_prep = [&](int t) {
    const int64_t r = sp.row0 + t, kb = int64_t(K) * int64_t(in.es);
    const char* kr = in.row(p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride, sp.b, in.hk, r);
    const char* qr = in.row(p.q, p.q_batch_stride, p.q_head_stride, p.q_row_stride, sp.b, in.hk, r);
    for (int64_t c = 0; c < kb; c += 64) {
      __builtin_prefetch(kr + c, 0, 2);
      __builtin_prefetch(qr + c, 0, 2);
    }
    if (kGate && p.gate_per_key) {
      const int64_t gb = int64_t(K) * int64_t(dtype_size(p.gate_dt));
      const char* gr = static_cast<const char*>(p.gate) + in.side(sp.b, r) * gb;
      for (int64_t c = 0; c < gb; c += 64) __builtin_prefetch(gr + c, 0, 2);
    }
  };
  FwdToken<T> tok[2]{};
  for (int i = 0; i < 2; ++i) tok[i].v = sc.v + int64_t(i) * Wp;
  auto token = [&](int t, int c0, int j0, int w, FwdToken<T>& x) {  // token t of the chunk from c0
    T* row = sc.tok + int64_t(t - c0) * 4 * K;
    x.q = row, x.k = row + K, x.a = row + 2 * K, x.beta = sc.beta[t - c0];
    x.fold = !factor || sc.fold[t - c0];
    x.kn = kn_of(t, c0);
    if (t + kAhead < sp.len) {
      const char* vr = v_row(t + kAhead, j0);
      for (int64_t c = 0; c < int64_t(w) * int64_t(in.es); c += 64) __builtin_prefetch(vr + c, 0, 2);
    }
    if (j0 == jb0 * Wp && t + kFwdChunk < sp.len) prefetch_prep(t + kFwdChunk);
    load_row(p.dt, v_row(t, j0), x.v, w, Wp);
  };
  auto store_out = [&](int t, int j0, int w, const vec<T>* ov) {  // token t's o: columns [j0, j0 + w)
    for (int i = 0; i < NV; ++i) vstore(sc.o + i * L, ov[i]);
    const int64_t r = sp.row0 + t;
    store_row(p.dt, sc.o,
              static_cast<char*>(p.o) +
                  (int64_t(sp.b) * p.o_batch_stride + int64_t(hv) * p.o_head_stride + r * p.o_row_stride + j0) *
                      int64_t(in.es),
              w);
  };
  if (direct && sp.len == 0 && p.init_state != p.final_state) {  // an empty sequence of a pack
    for (int m = 0; m < K; ++m) {
      const int64_t at = st0 + int64_t(m) * p.dim_v + int64_t(jb0) * Wp;
      std::memcpy(p.final_state + at, p.init_state + at, sizeof(T) * size_t(nb) * Wp);
    }
  }
  if (factor)
    for (int m = 0; m < K; ++m) sc.C[m] = T(1);
  for (int c0 = 0; c0 < sp.len; c0 += kFwdChunk) {
    const int c1 = std::min(sp.len, c0 + kFwdChunk);  // tokens [c0, c1), and c1 (started by c1 - 1)
    for (int t = c0; t <= std::min(c1, sp.len - 1); ++t) {
      T* row = sc.tok + int64_t(t - c0) * 4 * K;
      const int64_t r = sp.row0 + t;
      in.qk(sp.b, r, row, row + K, K);
      if (kGate) in.gate(sp.b, r, row + 2 * K, K);
      sc.beta[t - c0] = in.beta(sp.b, r);
      if (factor) {
        // folds at every chunk of kDeltaChunk's first and last tokens, so that a checkpoint (the
        // state after the last) is the state itself, with or without checkpoints alike
        const bool edge = t % kDeltaChunk == 0 || (t + 1) % kDeltaChunk == 0;
        // c1 is the next chunk's to keep: its factors do not enter C here
        sc.fold[t - c0] = factor_token(row + 2 * K, sc.C, row + K, row, row + 3 * K, K, edge, t < c1);
      }
    }
    if (pairs) {  // delta_pair_pass's kappa_t = kn_{t+1} . k_t
      for (int t = c0; t < std::min(c1, sp.len - 1); ++t) {
        sc.kappa[t - c0] = dot(sc.tok + int64_t(t - c0) * 4 * K + K, kn_of(t + 1, c0), K);
      }
    }
    for (int g = 0; g < nb; ++g) {
      const int j0 = (jb0 + g) * Wp, w = width(g);
      T* S = block(g);
      vec<T> u[NV], ov[NV], pv[NV];
      if (c0 == 0) {
        if (kCkpt) write_checkpoint(p, n, hv, 0, j0, w, Wp, S);  // the state entering token 0
        token(0, c0, j0, w, tok[0]);
        if (direct && p.init_state != p.final_state) {  // h'_0 and p_0
          fused_pass<false, true, kGate, kDelta, NV, CH, T, true>(S, ld, K, tok[1], tok[0], u, ov, pv,
                                                                  p.init_state + st0 + j0);
        } else {
          fused_pass<false, true, kGate, kDelta, NV, CH>(S, ld, K, tok[1], tok[0], u, ov, pv);
        }
      } else {  // this block's pass of token c0 - 1 started token c0: its p, and v reloaded
        for (int i = 0; i < NV; ++i) pv[i] = vload(sc.pv + int64_t(g) * Wp + i * L);
        token(c0, c0, j0, w, tok[c0 & 1]);
      }
      bool have_r = false;  // rv holds r_{t+1} = h'_t^T kn_{t+1} (delta_pair_pass)
      vec<T> rv[NV] = {};
      for (int t = c0; t < c1; ++t) {
        const FwdToken<T>& cur = tok[t & 1];
        FwdToken<T>& nxt = tok[(t + 1) & 1];
        if constexpr (kDelta && kDeltaPairs<NV>) {
          // tokens t and t + 1 in one pass where no gate folds into the rows at t + 1 or t + 2,
          // both are among the chunk's prepared tokens (t + 2 started), and neither h_t nor h_{t+1}
          // is a checkpoint's state (with or without checkpoints: the same pairs, the same bits)
          auto ungated = [&](int x) { return !kGate || (factor && !sc.fold[x - c0]); };
          const int last = std::min(c1, sp.len - 1);  // the last prepared token
          if (pairs && t + 2 <= last && ungated(t + 1) && ungated(t + 2) && (t + 1) % kDeltaChunk != 0 &&
              (t + 2) % kDeltaChunk != 0) {
            if (!have_r) dot_pass<NV, CH>(S, ld, K, kn_of(t + 1, c0), rv);
            token(t + 1, c0, j0, w, nxt);
            vec<T> u1[NV], o1[NV];
            const vec<T> b0 = vbcast(cur.beta), b1 = vbcast(nxt.beta), ka = vbcast(sc.kappa[t - c0]);
            for (int i = 0; i < NV; ++i) {
              u[i] = b0 * (vload(cur.v + i * L) - pv[i]);
              u1[i] = b1 * (vload(nxt.v + i * L) - (rv[i] + ka * u[i]));
            }
            have_r = t + 3 <= last;  // r_{t+3} needs token t + 3's kn
            const T* n3 = kn_of(have_r ? t + 3 : t + 2, c0);
            delta_pair_pass<NV, 1>(S, ld, K, cur.k, cur.q, nxt.k, nxt.q, kn_of(t + 2, c0), n3, u, u1, ov, o1, pv, rv);
            store_out(t, j0, w, ov);
            store_out(t + 1, j0, w, o1);
            token(t + 2, c0, j0, w, tok[t & 1]);  // the next step's cur
            ++t;
            continue;
          }
          have_r = false;
        }
        if constexpr (!kDelta && kPairRegs<NV, CH> <= kVecRegs) {
          // the plain write: tokens t and t + 1 in one pass where both passes are ungated and
          // neither ends at a checkpoint (a 64-token chunk's edges fold, so its inner tokens pair)
          auto ungated = [&](int x) { return !kGate || (factor && !sc.fold[x - c0]); };
          if (t + 1 < c1 && ungated(t + 1) && (t + 2 == sp.len || ungated(t + 2)) &&
              !(kCkpt && ((t + 1) % kDeltaChunk == 0 || (t + 2) % kDeltaChunk == 0))) {
            token(t + 1, c0, j0, w, nxt);
            vec<T> u1[NV], o1[NV];
            for (int i = 0; i < NV; ++i) {
              u[i] = vload(cur.v + i * L);
              u1[i] = vload(nxt.v + i * L);
            }
            plain_pair_pass<NV, CH>(S, ld, K, cur, nxt, u, u1, ov, o1);
            store_out(t, j0, w, ov);
            store_out(t + 1, j0, w, o1);
            if (t + 2 < sp.len) token(t + 2, c0, j0, w, tok[t & 1]);  // the next step's cur
            ++t;
            continue;
          }
        }
        const vec<T> bv = vbcast(cur.beta);
        if constexpr (kDelta) {
          for (int i = 0; i < NV; ++i) u[i] = bv * (vload(cur.v + i * L) - pv[i]);
        } else {  // the plain write (GLA): v itself
          for (int i = 0; i < NV; ++i) u[i] = vload(cur.v + i * L);
        }
        if (t + 1 < sp.len) {
          token(t + 1, c0, j0, w, nxt);
          if (kCkpt && (t + 1) % kDeltaChunk == 0) {  // h_t is a checkpoint
            checkpoint_pass<kGate, kDelta, NV, CH>(p, n, hv, (t + 1) / kDeltaChunk, j0, w, S, cur, nxt, u, ov, pv);
          } else if (kGate && !nxt.fold) {  // the gate in the factors: the ungated pass
            fused_pass<true, true, false, kDelta, NV, CH>(S, ld, K, cur, nxt, u, ov, pv);
          } else {
            fused_pass<true, true, kGate, kDelta, NV, CH>(S, ld, K, cur, nxt, u, ov, pv);
          }
        } else {
          fused_pass<true, false, kGate, kDelta, NV, CH>(S, ld, K, cur, nxt, u, ov, pv);
        }
        store_out(t, j0, w, ov);
      }
      for (int i = 0; i < NV; ++i) vstore(sc.pv + int64_t(g) * Wp + i * L, pv[i]);
    }
  }
  if (p.final_state != nullptr && !direct) {
    for (int g = 0; g < nb; ++g) {
      for (int m = 0; m < K; ++m) {
        T* dst = p.final_state + st0 + int64_t(m) * p.dim_v + (jb0 + g) * Wp;
        const T* row = block(g) + int64_t(m) * Wp;
        if (factor) {
          for (int j = 0; j < width(g); ++j) dst[j] = row[j] * sc.C[m];
        } else {
          std::memcpy(dst, row, sizeof(T) * width(g));
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------- backward

// Rows of kBlockBytes of the transposed state: a block stays in L1 while it runs through a
// chunk's tokens (16 rows at K = 128 in float32).
constexpr int kBlockBytes = 8192;
template <typename T>
int block_rows(int kp) {
  return std::max(1, kBlockBytes / (kp * int(sizeof(T))));
}

// One task's scratch: the transposed state and its gradient (V rows of kp), the checkpoints, a
// chunk's token inputs (and q . k), replayed states (h_{t-1}), p and u, and its per-token sums
// over the rows (dq~, dk^, dkp = sum_j dp_j h'_j, dg; dbeta; dv).
template <typename T>
struct BwdScratch {
  int kp, V, chunk, nck, rb;
  Buffer<T> mem;
  T *S, *dS, *ckpt, *H, *k, *q, *a, *v, *dov, *pp, *uu, *beta, *qk, *dbeta, *dq, *dk, *dkp, *dg, *dvv, *xrow;
  BwdScratch(int K, int V_, int chunk_, int max_len)
      : kp(round_up(K, kLanes<T>)), V(V_), chunk(chunk_), nck((max_len + chunk_ - 1) / chunk_),
        rb(std::min(V_, block_rows<T>(round_up(K, kLanes<T>)))) {
    const size_t st = size_t(V) * kp, ck = size_t(chunk);
    const size_t total = st * (2 + size_t(std::max(nck, 1))) + ck * size_t(rb) * kp +
                         ck * (7 * size_t(kp) + 5 * size_t(V) + 3) + size_t(kp);
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
    H = take(ck * size_t(rb) * kp);
    k = take(ck * kp);
    q = take(ck * kp);
    a = take(ck * kp);
    v = take(ck * V);
    dov = take(ck * V);
    pp = take(ck * V);
    uu = take(ck * V);
    dvv = take(ck * V);
    beta = take(ck);
    qk = take(ck);
    dbeta = take(ck);
    dq = take(ck * kp);
    dk = take(ck * kp);
    dkp = take(ck * kp);
    dg = take(ck * kp);
    xrow = take(kp);
  }
};

// Tokens per chunk: kDeltaChunk (64), the forward's checkpoint interval. A row block's replayed
// states (chunk x rows x kp) are then at most 64 x 8 KiB (kBlockBytes), which stay in L2 between
// the replay and the backward of the block.

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
      sc.qk[t] = dot(sc.q + int64_t(t) * kp, sc.k + int64_t(t) * kp, kp);
    }
  }
}

// One sweep of the replay over R rows of kp (i outer, the R rows inner: k, a and k' loaded once per
// vector for all of them): x = src_r (+ u_r k, kU: finishing the previous token, h = h' + u k);
// with kNext, x *= a (kGate) and the next token starts: p_r = x . k', u'_r = beta (v_r - p_r)
// (v_r without kDelta); dst_r = x, and the next token's row (pf on) is prefetched for writing: the
// chunk's h' rows stream through L2, and the store of a line not in L1 waits for it (1.04x at AVX2).
template <int R, bool kGate, bool kDelta, bool kU, bool kNext, typename T>
inline void replay_sweep(const T* __restrict__ src, T* __restrict__ dst, int kp, const T* uv, const T* k,
                         const T* a, const T* kn, T beta, const T* vn, T* pn, T* un, int64_t pf) {
  constexpr int L = kLanes<T>;
  constexpr bool kDot = kNext && kDelta;
  vec<T> u[R], acc[R];
  for (int r = 0; r < R; ++r) {
    u[r] = kU ? vbcast(uv[r]) : vec<T>{};
    acc[r] = vec<T>{};
  }
  for (int i = 0; i < kp; i += L) {
    const vec<T> kk = kU ? vload(k + i) : vec<T>{};
    const vec<T> aa = kNext && kGate ? vload(a + i) : vec<T>{};
    const vec<T> kv = kDot ? vload(kn + i) : vec<T>{};
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      vec<T> x = vload(src + int64_t(r) * kp + i);
      if (kU) x += u[r] * kk;
      if (kNext && kGate) x *= aa;
      vstore(dst + int64_t(r) * kp + i, x);
      if (kNext) __builtin_prefetch(dst + int64_t(r) * kp + i + pf, 1, 3);
      if (kDot) acc[r] += x * kv;
    }
  }
  if constexpr (kNext) {
    for (int r = 0; r < R; ++r) {
      const T pr = kDelta ? hsum_tree(acc[r]) : T(0);
      pn[r] = pr;
      un[r] = kDelta ? beta * (vn[r] - pr) : vn[r];
    }
  }
}

// Rows a replay sweep runs together: u and the dot's sum of each in registers beside k, a, k'.
constexpr int kSweepRows = kVecRegs >= 32 ? 8 : 4;

template <bool kGate, bool kDelta, bool kU, bool kNext, typename T>
void replay_rows(const T* src, T* dst, int n, int kp, const T* uv, const T* k, const T* a, const T* kn, T beta,
                 const T* vn, T* pn, T* un, int64_t pf) {
  constexpr int R = kSweepRows;
  int r = 0;
  for (; r + R <= n; r += R)
    replay_sweep<R, kGate, kDelta, kU, kNext>(src + int64_t(r) * kp, dst + int64_t(r) * kp, kp, uv + r, k, a, kn,
                                              beta, vn + r, pn + r, un + r, pf);
  for (; r < n; ++r)
    replay_sweep<1, kGate, kDelta, kU, kNext>(src + int64_t(r) * kp, dst + int64_t(r) * kp, kp, uv + r, k, a, kn,
                                              beta, vn + r, pn + r, un + r, pf);
}

// Rows [j0, j1) of the transposed state through the chunk's first nt tokens, from src's rows
// (stride kp) to out's (null: the final state is not needed): per row j, S_j <- a S_j + u_j k with
// p_j = (a S_j) . k, u_j = beta (v_j - p_j). Each token's rows of h' = a h_{t-1} go to H (row j0
// of the state at H's row 0), its p and u to pp and uu. One sweep per token
// over the block's rows (in L1) finishes token t - 1 from its h' (h = h' + u k, not stored) and
// starts token t (h' and the dot with k): a row vector costs its three multiply-adds, a load and a
// store. Rows are independent, so the sweeps of R rows overlap each other's dot sums; the tokens
// of one row are a chain of them (a row held in registers through the tokens waits on its sum
// every token).
template <bool kGate, bool kDelta, typename T>
void advance_rows(const T* src, T* out, int j0, int j1, int nt, BwdScratch<T>& sc) {
  const int kp = sc.kp, V = sc.V, n = j1 - j0;
  for (int t = 0; t < nt; ++t) {
    T* h = sc.H + int64_t(t) * sc.rb * kp;
    const T* k = sc.k + int64_t(t) * kp;
    const int64_t tv = int64_t(t) * V + j0;
    if (t == 0) {  // h' = a S, no u yet (uv unread)
      replay_rows<kGate, kDelta, false, true>(src + int64_t(j0) * kp, h, n, kp, sc.uu + tv, k, sc.a, k, sc.beta[0],
                                              sc.v + tv, sc.pp + tv, sc.uu + tv, int64_t(sc.rb) * kp);
    } else {
      replay_rows<kGate, kDelta, true, true>(h - int64_t(sc.rb) * kp, h, n, kp, sc.uu + tv - V,
                                             sc.k + int64_t(t - 1) * kp, sc.a + int64_t(t) * kp, k, sc.beta[t],
                                             sc.v + tv, sc.pp + tv, sc.uu + tv, int64_t(sc.rb) * kp);
    }
  }
  if (nt > 0 && out != nullptr) {  // h of the last token (nothing next: a, k', v, p and u' unread)
    const int64_t tv = int64_t(nt - 1) * V + j0;
    replay_rows<kGate, kDelta, true, false>(sc.H + int64_t(nt - 1) * sc.rb * kp, out + int64_t(j0) * kp, n, kp,
                                            sc.uu + tv, sc.k + int64_t(nt - 1) * kp, sc.a, sc.k, T(0), sc.v + tv,
                                            sc.pp + tv, sc.uu + tv, 0);
  }
}

// The backward of R rows j.. j + R - 1 of one token (given h' rows, p, u and the inputs), sharing
// the per-token sums' loads and stores among the R rows: turns those rows of dS from dL/dh_t
// (without token t's output term) into dL/dh_{t-1}, adds their terms of the per-token sums, writes
// their dv and returns their part of dbeta.
//
// With h_t = h' + u_j k and ds_j = dS_j + do_j q (row j), the terms that a scalar per token times
// q or k carries are left to the end of the chunk (finish_token), so that a row costs 7 vector
// multiply-adds (gated delta rule) rather than 10:
//   dq~ = sum_j do_j h_t,j       = sum_j do_j h'_j + (sum_j do_j u_j) k
//   dk^ = sum_j u_j ds_j + dp_j h'_j = sum_j (u_j dS_j + dp_j h'_j) + (sum_j do_j u_j) q
//   du_j = ds_j . k              = dS_j . k + do_j (q . k)
//   dg = sum_j dh'_j o h'_j      = sum_j dS_j o h'_j + q o sum_j do_j h'_j + k o sum_j dp_j h'_j
// (dh'_j = ds_j + dp_j k, dp_j = -beta du_j; o the elementwise product). dkp takes the dp_j h'_j
// terms: dk's scratch itself without a gate, its own with one (dg needs their sum apart).
template <int R, bool kGate, bool kDelta, typename T>
inline T backward_rows_of_token(int j, int kp, const T* __restrict__ hrows, T* __restrict__ dS, const T* k,
                                const T* q, const T* a, T beta, T qk, const T* v, const T* pv, const T* uv,
                                const T* dov, T* dq, T* dk, T* dkp, T* dg, T* dv) {
  constexpr int L = kLanes<T>;
  vec<T> u[R], d[R], du[R];
  for (int r = 0; r < R; ++r) {
    u[r] = vbcast(uv[j + r]);
    d[r] = vbcast(dov[j + r]);
    du[r] = vec<T>{};
  }
  // dq~ += do_j h'_j, dk^ += u_j dS_j, du_j = dS_j . k, dg += dS_j o h'_j
  for (int i = 0; i < kp; i += L) {
    const vec<T> kk = vload(k + i);
    vec<T> dqa = vload(dq + i), dka = vload(dk + i), dga = kGate ? vload(dg + i) : vec<T>{};
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const vec<T> hp = vload(hrows + int64_t(r) * kp + i);
      const vec<T> ds = vload(dS + int64_t(j + r) * kp + i);
      dqa += d[r] * hp;
      dka += u[r] * ds;
      du[r] += ds * kk;
      if (kGate) dga += ds * hp;
    }
    vstore(dq + i, dqa);
    vstore(dk + i, dka);
    if (kGate) vstore(dg + i, dga);
  }
  T dbeta = 0;
  vec<T> dp[R];
  for (int r = 0; r < R; ++r) {
    const T duj = hsum_tree(du[r]) + dov[j + r] * qk;
    if constexpr (kDelta) {
      dp[r] = vbcast(-beta * duj);
      dv[j + r] = beta * duj;
      dbeta += duj * (v[j + r] - pv[j + r]);
    } else {  // the plain write u = v: du is dv, and u does not depend on h'
      dp[r] = vec<T>{};
      dv[j + r] = duj;
    }
  }
  // dh' = dS_j + do_j q + dp_j k; dkp += dp_j h'_j; dL/dh_{t-1} = a o dh'
  for (int i = 0; i < kp; i += L) {
    const vec<T> kk = vload(k + i), qq = vload(q + i);
    const vec<T> aa = kGate ? vload(a + i) : vec<T>{};
    vec<T> dpa = kDelta ? vload(dkp + i) : vec<T>{};
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      T* dsr = dS + int64_t(j + r) * kp + i;
      vec<T> dhp = vload(dsr) + d[r] * qq;
      if (kDelta) {
        dhp += dp[r] * kk;
        dpa += dp[r] * vload(hrows + int64_t(r) * kp + i);
      }
      vstore(dsr, kGate ? aa * dhp : dhp);
    }
    if (kDelta) vstore(dkp + i, dpa);
  }
  return dbeta;
}

// Rows a backward pass shares its per-token sums' loads among (u, do and du of each in registers
// beside k and the three sums): 4 at every width; 2 or 8 read 1.2x slower at AVX2, 8 1.1x at
// AVX-512 (benchmarks/results/2026-12-01-delta-bwd-intel.md).
constexpr int kBwdRows = 4;

// The backward of rows [j0, j1) through the chunk's first nt tokens, last first (kBwdRows rows at
// a time, then one), adding into the chunk's per-token sums.
template <bool kGate, bool kDelta, typename T>
void backward_rows(int j0, int j1, int nt, BwdScratch<T>& sc) {
  constexpr int R = kBwdRows;
  const int kp = sc.kp, V = sc.V;
  for (int t = nt - 1; t >= 0; --t) {
    const T* k = sc.k + int64_t(t) * kp;
    const T* q = sc.q + int64_t(t) * kp;
    const T* a = sc.a + int64_t(t) * kp;
    const T beta = sc.beta[t], qk = sc.qk[t];
    const T *v = sc.v + int64_t(t) * V, *pv = sc.pp + int64_t(t) * V, *uv = sc.uu + int64_t(t) * V,
            *dov = sc.dov + int64_t(t) * V;
    T *dq = sc.dq + int64_t(t) * kp, *dk = sc.dk + int64_t(t) * kp, *dg = sc.dg + int64_t(t) * kp;
    T* dkp = kGate ? sc.dkp + int64_t(t) * kp : dk;
    T* dv = sc.dvv + int64_t(t) * V;
    const T* h = sc.H + int64_t(t) * sc.rb * kp - int64_t(j0) * kp;  // row j of the block at h + j kp
    T dbeta = 0;
    int j = j0;
    for (; j + R <= j1; j += R)
      dbeta += backward_rows_of_token<R, kGate, kDelta>(j, kp, h + int64_t(j) * kp, sc.dS, k, q, a, beta, qk, v, pv,
                                                        uv, dov, dq, dk, dkp, dg, dv);
    for (; j < j1; ++j)
      dbeta += backward_rows_of_token<1, kGate, kDelta>(j, kp, h + int64_t(j) * kp, sc.dS, k, q, a, beta, qk, v, pv,
                                                        uv, dov, dq, dk, dkp, dg, dv);
    sc.dbeta[t] += dbeta;
  }
}

// Token t's per-token sums completed once every row has run (backward_rows_of_token's terms
// carried by q and k): dg += q o dq~ + k o dkp first (dq~ still without its k term), then
// dq~ += s k, dk^ += dkp + s q, s = sum_j do_j u_j.
template <bool kGate, bool kDelta, typename T>
void finish_token(int t, BwdScratch<T>& sc) {
  constexpr int L = kLanes<T>;
  const int kp = sc.kp;
  const T *k = sc.k + int64_t(t) * kp, *q = sc.q + int64_t(t) * kp, *dkp = sc.dkp + int64_t(t) * kp;
  T *dq = sc.dq + int64_t(t) * kp, *dk = sc.dk + int64_t(t) * kp, *dg = sc.dg + int64_t(t) * kp;
  const vec<T> s = vbcast(dot(sc.dov + int64_t(t) * sc.V, sc.uu + int64_t(t) * sc.V, sc.V));
  for (int i = 0; i < kp; i += L) {
    const vec<T> kk = vload(k + i), qq = vload(q + i);
    vec<T> dqa = vload(dq + i), dka = vload(dk + i);
    if (kGate) {
      vec<T> dga = vload(dg + i) + qq * dqa;
      if (kDelta) {
        const vec<T> dpa = vload(dkp + i);
        dga += kk * dpa;
        dka += dpa;
      }
      vstore(dg + i, dga);
    }
    vstore(dq + i, dqa + s * kk);
    vstore(dk + i, dka + s * qq);
  }
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

// The dq and dk rows of (b, q / k head hk, row r) from dq~ and dk^ summed over the head's group
// (overwritten): the scale, the L2 norm's backward (y = x r, r = (x.x + eps)^-1/2: dx = r (dy -
// y (y . dy))), the store. x: K of scratch.
template <typename T>
void store_qk_grads(const DBP<T>& p, int b, int hk, int64_t r, T* dqs, T* dks, T* x) {
  const int K = p.dim_k;
  const size_t es = dtype_size(p.dt);
  for (int i = 0; i < K; ++i) dqs[i] *= p.scale;
  for (int which = 0; which < 2; ++which) {
    T* dy = which == 0 ? dqs : dks;
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

// With GVA (h_v > h_k): dq, dk of one (b, q / k head, row), the group's value heads summed from
// the scratch.
template <typename T>
void finish_qk(const DBP<T>& p, const QkScratch<T>& qs, int b, int hk, int64_t r, T* x, T* dqs, T* dks) {
  const int K = p.dim_k, G = p.h_v / p.h_k;
  std::fill(dqs, dqs + K, T(0));
  std::fill(dks, dks + K, T(0));
  for (int g = 0; g < G; ++g) {
    const T* sq = qs.at(qs.dq, p, b, hk * G + g, r);
    const T* sk = qs.at(qs.dk, p, b, hk * G + g, r);
    for (int i = 0; i < K; ++i) {
      dqs[i] += sq[i];
      dks[i] += sk[i];
    }
  }
  store_qk_grads(p, b, hk, r, dqs, dks, x);
}

template <bool kGate, bool kDelta, typename T>
void bwd_task(const DBP<T>& p, int n, int hv, BwdScratch<T>& sc, const QkScratch<T>& qs) {
  const int kp = sc.kp, V = p.dim_v, K = p.dim_k, C = sc.chunk;
  const Span sp = span_of(p, n);
  const TokenIn<T> in(p, hv);
  const int64_t st0 = (int64_t(n) * p.h_v + hv) * K * V;
  const int64_t st = int64_t(V) * kp;
  const int rb = sc.rb;
  const int nck = (sp.len + C - 1) / C;
  // the forward, keeping a checkpoint at each chunk's start, unless the forward op kept them
  std::fill(sc.S, sc.S + st, T(0));
  if (p.init_state != nullptr && p.checkpoints == nullptr)
    for (int m = 0; m < K; ++m)
      for (int j = 0; j < V; ++j) sc.S[int64_t(j) * kp + m] = p.init_state[st0 + int64_t(m) * V + j];
  for (int c = 0; c < (p.checkpoints == nullptr ? nck : 0); ++c) {
    std::memcpy(sc.ckpt + c * st, sc.S, sizeof(T) * st);
    if (c == nck - 1) break;  // the last chunk's states are replayed below
    load_chunk<kGate>(p, in, sp, c * C, C, false, sc);
    for (int j = 0; j < V; j += rb) advance_rows<kGate, kDelta>(sc.S, sc.S, j, std::min(V, j + rb), C, sc);
  }
  // dL/dh at the end
  std::fill(sc.dS, sc.dS + st, T(0));
  if (p.dfinal_state != nullptr)
    for (int m = 0; m < K; ++m)
      for (int j = 0; j < V; ++j) sc.dS[int64_t(j) * kp + m] = p.dfinal_state[st0 + int64_t(m) * V + j];
  for (int c = nck - 1; c >= 0; --c) {
    const int t0 = c * C, nt = std::min(C, sp.len - t0);
    load_chunk<kGate>(p, in, sp, t0, nt, true, sc);
    // the chunk's first state: the checkpoint's rows themselves where they are (V, kp)
    const T* S0 = nullptr;
    if (p.checkpoints == nullptr) {
      S0 = sc.ckpt + c * st;
    } else if (K == kp) {
      S0 = p.checkpoints + checkpoint_offset(p, n, hv, c);
    } else {  // (V, K) rows into the (V, kp) ones; the pad past K stays 0
      const T* ck = p.checkpoints + checkpoint_offset(p, n, hv, c);
      for (int j = 0; j < V; ++j) std::memcpy(sc.S + int64_t(j) * kp, ck + int64_t(j) * K, sizeof(T) * K);
      S0 = sc.S;
    }
    std::fill(sc.dq, sc.dq + int64_t(nt) * kp, T(0));
    std::fill(sc.dk, sc.dk + int64_t(nt) * kp, T(0));
    if (kGate) {
      std::fill(sc.dg, sc.dg + int64_t(nt) * kp, T(0));
      std::fill(sc.dkp, sc.dkp + int64_t(nt) * kp, T(0));
    }
    std::fill(sc.dbeta, sc.dbeta + nt, T(0));
    for (int j = 0; j < V; j += rb) {
      advance_rows<kGate, kDelta>(S0, static_cast<T*>(nullptr), j, std::min(V, j + rb), nt, sc);
      backward_rows<kGate, kDelta>(j, std::min(V, j + rb), nt, sc);
    }
    for (int t = 0; t < nt; ++t) {
      finish_token<kGate, kDelta>(t, sc);
      const int64_t r = sp.row0 + t0 + t;
      const int64_t side = (int64_t(sp.b) * p.h_v + hv) * p.s + r;
      store_elem(p.beta_dt, p.dbeta, side, sc.dbeta[t]);
      const T* dg = sc.dg + int64_t(t) * kp;
      if (kGate) {
        if (p.gate_per_key) {
          for (int i = 0; i < K; ++i) store_elem(p.gate_dt, p.dgate, side * K + i, dg[i]);
        } else {
          T s = 0;
          for (int i = 0; i < K; ++i) s += dg[i];
          store_elem(p.gate_dt, p.dgate, side, s);
        }
      }
      if (p.h_v == p.h_k) {  // q / k are this value head's alone: their gradients are done
        store_qk_grads(p, sp.b, hv, r, sc.dq + int64_t(t) * kp, sc.dk + int64_t(t) * kp, sc.xrow);
      } else {
        std::memcpy(qs.at(qs.dq, p, sp.b, hv, r), sc.dq + int64_t(t) * kp, sizeof(T) * kp);
        std::memcpy(qs.at(qs.dk, p, sp.b, hv, r), sc.dk + int64_t(t) * kp, sizeof(T) * kp);
      }
      char* dvr = static_cast<char*>(p.dv) +
                  (int64_t(sp.b) * p.dv_batch_stride + int64_t(hv) * p.dv_head_stride + r * p.dv_row_stride) *
                      int64_t(in.es);
      store_row(p.dt, sc.dvv + int64_t(t) * V, dvr, V);
    }
  }
  if (p.dinit_state != nullptr)
    for (int m = 0; m < K; ++m)
      for (int j = 0; j < V; ++j) p.dinit_state[st0 + int64_t(m) * V + j] = sc.dS[int64_t(j) * kp + m];
}

}  // namespace

template <typename T>
void delta_fwd(const DeltaParamsT<T>& p) {
  constexpr int WpN = kColVecs<T> * kLanes<T>;
  // a decode step at AVX-512: blocks of 128 columns (whole 512-byte rows of a V = 128 state), its
  // o and p sums and u in 24 of the 32 registers
  constexpr int kWideNV = kLanes<T> >= 16 ? 8 : kColVecs<T>, WpW = kWideNV * kLanes<T>;
  const bool wide = kWideNV != kColVecs<T> && step_call(p) && p.dim_v % WpW == 0;
  constexpr int WpB = kBigColVecs<T> * kLanes<T>;
  const bool big = WpB != WpN && !wide && 4 * size_t(p.dim_k) * WpB * sizeof(T) <= 3 * size_t(l1d_bytes()) &&
                   int64_t(p.b) * p.h_v * ((p.dim_v + WpB - 1) / WpB) >= 2 * int64_t(pool_threads());
  const int Wp = wide ? WpW : big ? WpB : WpN;
  const int nblk = (p.dim_v + Wp - 1) / Wp;
  if (nblk == 0) return;
  // With (sequence, head) pairs enough for the threads a task runs all of a pair's column blocks
  // (fwd_group: each chunk's tokens prepared once for all of them; a decode step's core reads its
  // state front to back instead of the threads interleaving 128-byte pieces of its rows,
  // benchmarks/results/2026-11-30-delta-avx2-cpu.md); else one block.
  const int64_t pairs = int64_t(p.b) * p.h_v;
  const int nb = pairs >= 2 * int64_t(pool_threads()) ? nblk : 1;
  const int64_t tasks = pairs * (nblk / nb);
  if (tasks == 0) return;
  parallel_tasks(tasks, 0, [&] {
    return [&, sc = FwdScratch<T>(p.dim_k, nb, Wp, !on_state_rows(p, Wp))](int64_t task) mutable {
      const int groups = nblk / nb;
      const int jb = int(task % groups) * nb, hv = int(task / groups % p.h_v), n = int(task / groups / p.h_v);
      auto run = [&](auto gate, auto write) {
        constexpr bool kGate = decltype(gate)::value, kDelta = decltype(write)::value;
        if constexpr (kWideNV != kColVecs<T>) {
          if (wide) {
            return p.checkpoints != nullptr ? fwd_group<kGate, kDelta, true, T, kWideNV>(p, n, hv, jb, nb, sc)
                                            : fwd_group<kGate, kDelta, false, T, kWideNV>(p, n, hv, jb, nb, sc);
          }
        }
        if constexpr (kBigColVecs<T> != kColVecs<T>) {
          constexpr int NB = kBigColVecs<T>;
          if (big) {
            return p.checkpoints != nullptr ? fwd_group<kGate, kDelta, true, T, NB>(p, n, hv, jb, nb, sc)
                                            : fwd_group<kGate, kDelta, false, T, NB>(p, n, hv, jb, nb, sc);
          }
        }
        p.checkpoints != nullptr ? fwd_group<kGate, kDelta, true>(p, n, hv, jb, nb, sc)
                                 : fwd_group<kGate, kDelta, false>(p, n, hv, jb, nb, sc);
      };
      using Y = std::true_type;
      using N = std::false_type;
      if (p.gate != nullptr) {
        p.plain ? run(Y{}, N{}) : run(Y{}, Y{});
      } else {
        p.plain ? run(N{}, N{}) : run(N{}, Y{});
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
  const bool gva = p.h_v != p.h_k;  // dq~, dk^ per value head go through scratch, then summed
  Buffer<T> scratch(gva ? size_t(2) * batches * p.h_v * size_t(p.s) * kp : 0);
  const QkScratch<T> qs{kp, scratch.data(), scratch.data() + (gva ? size_t(batches) * p.h_v * size_t(p.s) * kp : 0)};
  const int chunk = kDeltaChunk;
  // with the forward's checkpoints, no task keeps its own
  parallel_tasks(tasks, 0, [&] {
    return [&, sc = BwdScratch<T>(p.dim_k, p.dim_v, chunk, p.checkpoints != nullptr ? 0 : max_len)](int64_t task) mutable {
      const int hv = int(task % p.h_v), n = int(task / p.h_v);
      if (p.gate != nullptr) {
        p.plain ? bwd_task<true, false>(p, n, hv, sc, qs) : bwd_task<true, true>(p, n, hv, sc, qs);
      } else {
        p.plain ? bwd_task<false, false>(p, n, hv, sc, qs) : bwd_task<false, true>(p, n, hv, sc, qs);
      }
    };
  });
  if (!gva) return;
  // rows of every sequence (varlen: the pack's rows inside a sequence; the rest stay zero)
  const int64_t rows = int64_t(batches) * p.h_k * p.s;
  pool_for(rows, 64, [&](int64_t r0, int64_t r1) {
    Buffer<T> x(size_t(p.dim_k)), dqs(size_t(p.dim_k)), dks(size_t(p.dim_k));
    for (int64_t i = r0; i < r1; ++i) {
      const int64_t r = i % p.s;
      const int hk = int(i / p.s % p.h_k), b = int(i / p.s / p.h_k);
      if (p.cu_seqlens != nullptr && (r < p.cu_seqlens[0] || r >= p.cu_seqlens[p.b])) continue;
      finish_qk(p, qs, b, hk, r, x.data(), dqs.data(), dks.data());
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
