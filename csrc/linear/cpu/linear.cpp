// Linear attention on the CPU: the chunked parallel form, forward and backward
// (common/linear_params.h states the math).
//
// One task = (batch, head) in the forward, (batch, kv head) in the backward (the group's query
// heads accumulate one dK / dV). A task walks its sequence in chunks of kChunk rows carrying the
// (M, dv_aug) state across chunks; inside a chunk the causal part is a masked (C, C) product. Per
// chunk of n rows, with g the running sum of decay since the chunk start (gC = g_{n-1}):
//   forward     A = Q~ K~^T (masked j <= i, weights e^{g_i - g_j});  O' = A V' + e^{g_i} Q~ S
//               S <- e^{gC} S + sum_j e^{gC - g_j} K~_j v'_j^T
// Every e^{g_i - g_j} is computed as e^{d_{j+1} + ... + d_i}, a sum of the gates between j and i
// (mask_chunk, weights_to_end), never as a difference of running sums: gates of -1e4, -1e9 or
// -inf (a hard reset) then give the recurrence's answer, where the difference loses the gates
// after a large one to rounding and turns -inf - -inf into NaN.
// The backward takes the normalization apart first: dO'_i = [dout_i / den_i, -(dout_i . out_i)
// / den_i] (the last column only when normalize), so that everything after is the unnormalized
// form over v'. Then, with S_i the forward state at row i and U_j = sum_{i >= j} e^{G_i - G_j}
// Q~_i dO'_i^T (+ e^{G_T - G_j} dS_T) the reverse state:
//   dQ~_i = S_i dO'_i,  dK~_j = U_j v'_j,  dV'_j = U_j^T K~_j
//   dS_init = U_{-1};  dG_i = Q~_i . dQ~_i - K~_i . dK~_i (+ <dS_T, S_T> at the last row), and
//   ddecay is the reverse running sum of dG.
// An ascending sweep stores the forward state at every chunk boundary; one descending sweep then
// carries U and yields every gradient of a chunk at once (BwdTask states the products). Extra
// memory: O(chunk * (M + dv)) per thread plus S / kChunk + 1 states per head of a task.
//
// The products with a masked (C, C) factor (A V', P K~, P^T Q~, A^T dO') read only its kept
// triangle (cpu/simd.h Tri), never a masked zero against a row of the other operand, so a NaN
// at position t reaches only the rows, and the gradients, that depend on t.
//
// All products run on the softmax kernels' register-blocked micro-kernel (cpu/simd.h gemm) in T
// (float; double for float64 inputs); rows are loaded and converted once per chunk and padded
// to whole vectors (the padding columns stay 0, so they add nothing to any product).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>

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

// Rows per chunk. Per row, the masked (C, C) products cost O(C (M + dv)) and the state products
// O(M dv) whatever C, so a smaller C saves flops until the per-chunk work (state copies and
// transposes, short gemm k-loops, the 6-row micro-kernel's tail) takes over. C = 48 is whole
// 6-row blocks and 16-column panels, and measured faster than C = 64 and no slower than C = 32
// (benchmarks/results/2026-11-29-figures-from-comments.md).
constexpr int kChunk = 48;

template <typename T>
using LP = LinearParamsT<T>;

// Element offset of (b, head, row) in a tensor with the given strides; varlen packs address
// rows from the sequence's first row and ignore the batch stride.
inline int64_t offset(const int32_t* cu, int b, int64_t bs, int head, int64_t hs, int64_t row, int64_t rs) {
  return (cu != nullptr ? int64_t(cu[b]) * rs : int64_t(b) * bs) + int64_t(head) * hs + row * rs;
}
template <typename T>
int seq_len(const LP<T>& p, int b) {
  return p.cu_seqlens != nullptr ? p.cu_seqlens[b + 1] - p.cu_seqlens[b] : p.sq;
}
template <typename T>
int64_t seq_index(const LP<T>& p, int b, int h, int i) {  // (B, H, S) side tensors
  return (p.cu_seqlens != nullptr ? int64_t(p.cu_seqlens[b]) : int64_t(b) * p.seq_batch_stride) +
         int64_t(h) * p.seq_head_stride + i;
}
template <typename T>
int64_t state_index(const LP<T>& p, int b, int h) {
  return (int64_t(b) * p.h + h) * int64_t(p.d) * p.dim_v_aug;
}

// dx <- dx * d(feature(x) * mul)/dx over n_pad values, from y = feature(x) * mul alone (so the
// raw rows need no copy): for elu + 1 the derivative is mul where x > 0, else y itself
// (d e^x = e^x), and x > 0 exactly when y / mul = x + 1 > 1, i.e. y * mul > mul^2; for relu
// x > 0 when y * mul > 0. mul = 0 (a padded key) gives y = 0 and a zero derivative either way.
template <typename T>
void feature_backward(FeatureMap fm, T* dx, const T* y, int n_pad, T mul) {
  constexpr int L = kLanes<T>;
  const vec<T> m = vbcast(mul), zero{};
  for (int i = 0; i < n_pad; i += L) {
    const vec<T> v = vload(y + i);
    vec<T> f = m;
    if (fm == FeatureMap::kElu) {
      f = v * m > m * m ? m : v;
    } else if (fm == FeatureMap::kRelu) {
      f = v * m > zero ? m : zero;
    }
    vstore(dx + i, vload(dx + i) * f);
  }
}

// The intra-chunk mask on a (n, ldp) product P (rows i, columns j): keeps j <= i with weight
// Keeps the causal triangle j <= i of the (n, ldp) block P, each entry times its gate weight
// e^{d_{j+1} + ... + d_i} (the forward's A = Q~ K~^T and the backward's dO' V'^T; the products
// that need the reverse mask read these transposed), zeroes the rest, columns past n included.
// The exponents are sums of gates built row by row (seg: row i = row i - 1 + d_i, 0 at column
// i), never differences of running sums, so gates of -1e4, -1e9 or -inf (a hard reset: every
// weight across it is 0) keep the recurrence's answer. seg: ldp of scratch. Vector compares and
// the vector exp: a scalar std::exp per kept entry cost as much as the product it masks.
template <typename T>
void mask_chunk(T* P, int n, int ldp, const T* d, T* seg, bool decay) {
  constexpr int L = kLanes<T>;
  const T log2e = T(1.4426950408889634);
  const vec<T> iota = lane_index<T>(), zero{};
  if (decay) std::fill(seg, seg + ldp, T(0));
  for (int r = 0; r < n; ++r) {
    T* row = P + int64_t(r) * ldp;
    const vec<T> dr = vbcast(decay ? d[r] : T(0));
    for (int c0 = 0; c0 < ldp; c0 += L) {
      vec<T> x = vload(row + c0);
      const auto keep = iota + T(c0) <= T(r);
      if (decay) {
        const vec<T> sg = iota + T(c0) < T(r) ? vload(seg + c0) + dr : zero;
        vstore(seg + c0, sg);
        x *= vexp2_nonpos(sg * log2e);
      }
      vstore(row + c0, keep ? x : zero);
    }
  }
}

// dst[i] <- w_i src[i] over n rows of ld (whole vectors) elements
template <typename T>
void scale_rows(T* dst, const T* src, int n, int ld, const T* w) {
  for (int i = 0; i < n; ++i) {
    const vec<T> wi = vbcast(w[i]);
    for (int x = 0; x < ld; x += kLanes<T>) vstore(dst + int64_t(i) * ld + x, vload(src + int64_t(i) * ld + x) * wi);
  }
}
// x <- f x, dst += src over n (whole vectors) elements
template <typename T>
void scale(T* x, int64_t n, T f) {
  for (int64_t i = 0; i < n; i += kLanes<T>) vstore(x + i, vload(x + i) * f);
}
template <typename T>
void add_to(T* dst, const T* src, int64_t n) {
  for (int64_t i = 0; i < n; i += kLanes<T>) vstore(dst + i, vload(dst + i) + vload(src + i));
}

template <bool kAcc, bool kTransA = false, Tri kTri = Tri::kFull, typename T>
inline void mm(int M, int N, int K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc) {
  gemm<kAcc, kTransA, kTri>(M, N, K, A, lda, B, ldb, kPanel<T>, C, ldc);
}

// A view of n elements of a carved buffer.
template <typename T>
struct Span {
  T* ptr = nullptr;
  int64_t n = 0;
  T* data() const { return ptr; }
  T* begin() const { return ptr; }
  T* end() const { return ptr + n; }
  T& operator[](int64_t i) const { return ptr[i]; }
};

// One worker's buffers, sized for one chunk, carved from this thread's scratch that outlives
// the call (cpu/memory.h Scratch, slot 4): fresh buffers per call cost more in page faults than
// the backward's scalar work.
template <typename T>
struct Chunk {
  int mp, dp, cp;  // M, dim_v_aug and kChunk padded to whole vectors
  Scratch<T, 4> mem;
  Span<T> q, k, v, dov, kt, p, p2, o, t, s, st, u, g, grow, d, seg;
  Chunk(int m, int dv_aug)
      : mp(round_up(m, kLanes<T>)), dp(round_up(dv_aug, kLanes<T>)), cp(round_up(kChunk, kLanes<T>)),
        mem(carved_size<T, 16>(sizes(mp, dp, cp))) {
    const auto n = sizes(mp, dp, cp);
    std::array<Span<T>*, 16> spans{&q, &k, &v, &dov, &o, &kt, &p, &p2, &t, &s, &st, &u, &g, &grow, &d, &seg};
    std::array<T*, 16> ptrs{};
    std::array<T**, 16> out{};
    for (int i = 0; i < 16; ++i) out[i] = &ptrs[i];
    carve<T, 16>(mem.data(), n, out);
    for (int i = 0; i < 16; ++i) {
      spans[i]->ptr = ptrs[i];
      spans[i]->n = int64_t(n[i]);
      std::fill(spans[i]->begin(), spans[i]->end(), T(0));
    }
  }
  static std::array<size_t, 16> sizes(int mp, int dp, int cp) {
    const size_t cm = size_t(cp) * mp, cd = size_t(cp) * dp, md = size_t(mp) * dp;
    const size_t big = std::max({cm, cd, size_t(cp) * cp});
    // q, k | v, dov, o | kt, p, p2, t | s, st, u | g, grow, d, seg
    return {cm, cm, cd, cd, cd, big, big, big, big, md, md, md, size_t(cp), size_t(cp), size_t(cp), size_t(cp)};
  }
};

// d_i <- decay of row r0 + i of (b, h) and g_i <- d_0 + ... + d_i, i < n (0 without decay). g is
// a sum of gates, never a difference of two sums: e^{g_i} is exact for any gate, -inf included.
template <typename T>
void running_decay(const LP<T>& p, int b, int h, int r0, int n, T* g, T* d) {
  T acc = T(0);
  for (int i = 0; i < n; ++i) {
    d[i] = p.decay != nullptr ? p.decay[seq_index(p, b, h, r0 + i)] : T(0);
    acc += d[i];
    g[i] = acc;
  }
}

// w_j <- e^{d_{j+1} + ... + d_{n-1}} (the weight of row j in the state at the chunk's end),
// summed from the end: the difference g_{n-1} - g_j would lose the small gates after a large one
// (1e-3 relative after a gate of -1e4 in float32) and give NaN after a -inf.
template <typename T>
void weights_to_end(const T* d, int n, T* w) {
  T acc = T(0);
  for (int j = n - 1; j >= 0; --j) {
    w[j] = T(std::exp(acc));
    acc += d[j];
  }
}

// Loads rows [r0, r0 + n) of sequence b, head h (kv head hk) into the chunk: Q~, K~, v' and the
// running decay sum g. Rows n .. cp of every buffer are zero.
template <typename T>
void load_chunk(const LP<T>& p, DType dt, int b, int h, int hk, int r0, int n, Chunk<T>& c, bool want_q, bool want_kv) {
  const int m = p.d;
  const size_t es = dtype_size(dt);
  for (int i = 0; i < c.cp; ++i) {
    const bool live = i < n;
    const int64_t row = r0 + i;
    if (want_q) {
      T* q = c.q.data() + int64_t(i) * c.mp;
      if (live) {
        load_row(dt, static_cast<const char*>(p.q) + offset(p.cu_seqlens, b, p.q_batch_stride, h, p.q_head_stride, row, p.q_row_stride) * es, q, m, c.mp);
        apply_feature(p.feature_map, q, m, c.mp, p.scale);
      } else {
        std::fill(q, q + c.mp, T(0));
      }
    }
    if (want_kv) {
      T* k = c.k.data() + int64_t(i) * c.mp;
      T* v = c.v.data() + int64_t(i) * c.dp;
      bool real = live;
      if (live && p.key_mask != nullptr) {
        const int64_t mrow = p.cu_seqlens != nullptr ? int64_t(p.cu_seqlens[b]) + row : int64_t(b) * p.key_mask_batch_stride + row;
        real = p.key_mask[mrow] != 0;
      }
      // a padded key is never read, as rows past the length are not: its zero feature row times a
      // loaded NaN would otherwise give NaN (0 * NaN), and its value row would enter the products
      if (real) {
        load_row(dt, static_cast<const char*>(p.k) + offset(p.cu_seqlens, b, p.k_batch_stride, hk, p.k_head_stride, row, p.k_row_stride) * es, k, m, c.mp);
        apply_feature(p.feature_map, k, m, c.mp, T(1));
        load_row(dt, static_cast<const char*>(p.v) + offset(p.cu_seqlens, b, p.v_batch_stride, hk, p.v_head_stride, row, p.v_row_stride) * es, v, p.dim_v, c.dp);
        if (p.normalize) v[p.dim_v] = T(1);
      } else {
        std::fill(k, k + c.mp, T(0));
        std::fill(v, v + c.dp, T(0));
      }
    }
  }
  running_decay(p, b, h, r0, n, c.g.data(), c.d.data());
}

// out_i, den_i from O'_i (n rows in c.o); with p.o_res, out_i's rounding residual too (c.dov,
// unused by the forward, holds the rounded row)
template <typename T>
void store_out(const LP<T>& p, DType dt, int b, int h, int r0, int n, Chunk<T>& c) {
  const size_t es = dtype_size(dt);
  for (int i = 0; i < n; ++i) {
    T* o = c.o.data() + int64_t(i) * c.dp;
    T den = T(1);
    if (p.normalize) {
      den = o[p.dim_v] + p.eps;
      const T inv = T(1) / den;
      for (int j = 0; j < p.dim_v; ++j) o[j] *= inv;
    }
    p.den[seq_index(p, b, h, r0 + i)] = den;
    const int64_t at = offset(p.cu_seqlens, b, p.o_batch_stride, h, p.o_head_stride, r0 + i, p.o_row_stride) * es;
    char* dst = static_cast<char*>(p.o) + at;
    store_row(dt, o, dst, p.dim_v);
    if (p.o_res != nullptr) {
      T* r = c.dov.data();
      load_row(dt, dst, r, p.dim_v, p.dim_v);
      // scaled (kResidualScale*); 0 where the rounded value is inf / NaN: the backward then reads
      // out as it is
      const T sc = T(dt == DType::kF16 ? kResidualScaleF16 : kResidualScaleBF16);
      for (int j = 0; j < p.dim_v; ++j) {
        r[j] = std::abs(r[j]) <= std::numeric_limits<T>::max() ? (o[j] - r[j]) * sc : T(0);
      }
      store_row(dt, r, static_cast<char*>(p.o_res) + at, p.dim_v);
    }
  }
}

// S (mp x dp) <- the initial state of (b, h) (or 0)
template <typename T>
void init_state(const LP<T>& p, int b, int h, Chunk<T>& c, T* s) {
  std::fill(s, s + int64_t(c.mp) * c.dp, T(0));
  if (p.init_state == nullptr) return;
  const T* src = p.init_state + state_index(p, b, h);
  for (int m = 0; m < p.d; ++m) std::memcpy(s + int64_t(m) * c.dp, src + int64_t(m) * p.dim_v_aug, sizeof(T) * p.dim_v_aug);
}
template <typename T>
void save_state(const LP<T>& p, int b, int h, const Chunk<T>& c, const T* s, T* dst_base) {
  T* dst = dst_base + state_index(p, b, h);
  for (int m = 0; m < p.d; ++m) std::memcpy(dst + int64_t(m) * p.dim_v_aug, s + int64_t(m) * c.dp, sizeof(T) * p.dim_v_aug);
}

// S <- e^{gC} S + sum_j e^{gC - g_j} K~_j v'_j^T over the chunk's n rows (scales c.k in place).
template <typename T>
void advance_state(Chunk<T>& c, int n, bool decay, T* s) {
  if (decay) {
    const T f = T(std::exp(c.g[n - 1]));
    for (int64_t x = 0; x < int64_t(c.mp) * c.dp; ++x) s[x] *= f;
    weights_to_end(c.d.data(), n, c.grow.data());
    for (int j = 0; j < n; ++j) {
      const T w = c.grow[j];
      T* k = c.k.data() + int64_t(j) * c.mp;
      for (int x = 0; x < c.mp; ++x) k[x] *= w;
    }
  }
  mm<true, true>(c.mp, c.dp, n, c.k.data(), c.mp, c.v.data(), c.dp, s, c.dp);
}

// The non-causal state: S += sum over the sequence of K~_j v'_j^T.
template <typename T>
void sum_state(const LP<T>& p, DType dt, int b, int h, int hk, int len, Chunk<T>& c, T* s) {
  for (int r0 = 0; r0 < len; r0 += kChunk) {
    const int n = std::min(kChunk, len - r0);
    load_chunk(p, dt, b, h, hk, r0, n, c, false, true);
    mm<true, true>(c.mp, c.dp, n, c.k.data(), c.mp, c.v.data(), c.dp, s, c.dp);
  }
}

template <typename T>
struct FwdTask {
  const LP<T>& p;
  DType dt;
  Chunk<T> c;
  FwdTask(const LP<T>& p_, DType dt_) : p(p_), dt(dt_), c(p_.d, p_.dim_v_aug) {}

  void operator()(int64_t task) {
    const int b = int(task / p.h), h = int(task % p.h), hk = h / (p.h / p.h_k);
    const int len = seq_len(p, b);
    const bool decay = p.decay != nullptr;
    T* s = c.s.data();
    init_state(p, b, h, c, s);
    if (!p.causal) {
      sum_state(p, dt, b, h, hk, len, c, s);
      for (int r0 = 0; r0 < len; r0 += kChunk) {
        const int n = std::min(kChunk, len - r0);
        load_chunk(p, dt, b, h, hk, r0, n, c, true, false);
        mm<false>(n, c.dp, c.mp, c.q.data(), c.mp, s, c.dp, c.o.data(), c.dp);
        store_out(p, dt, b, h, r0, n, c);
      }
    } else {
      bool state_zero = p.init_state == nullptr;
      for (int r0 = 0; r0 < len; r0 += kChunk) {
        const int n = std::min(kChunk, len - r0);
        load_chunk(p, dt, b, h, hk, r0, n, c, true, true);
        transpose(c.k.data(), c.cp, c.mp, c.mp, c.kt.data(), c.cp);  // K~^T (mp, cp)
        mm<false, false, Tri::kLowerC>(n, c.cp, c.mp, c.q.data(), c.mp, c.kt.data(), c.cp, c.p.data(), c.cp);
        mask_chunk(c.p.data(), n, c.cp, c.d.data(), c.seg.data(), decay);
        mm<false, false, Tri::kLowerA>(n, c.dp, n, c.p.data(), c.cp, c.v.data(), c.dp, c.o.data(), c.dp);
        if (!state_zero) {
          const T* qw = c.q.data();
          if (decay) {  // O' += e^{g_i} Q~_i S
            for (int i = 0; i < n; ++i) c.grow[i] = T(std::exp(c.g[i]));
            scale_rows(c.t.data(), c.q.data(), n, c.mp, c.grow.data());
            qw = c.t.data();
          }
          mm<true>(n, c.dp, c.mp, qw, c.mp, s, c.dp, c.o.data(), c.dp);
        }
        store_out(p, dt, b, h, r0, n, c);
        advance_state(c, n, decay, s);
        state_zero = false;
      }
    }
    if (p.final_state != nullptr) save_state(p, b, h, c, s, p.final_state);
  }
};

// The backward of one (batch, kv head): the group's query heads share each chunk's K~ and V'
// (loaded, transposed once) and sum their dK~ / dV' contributions in chunk buffers, so dK / dV
// rows are stored once, finished.
//
// Causal, two sweeps over the chunks:
//   ascending:  S^T before every chunk, per head, stored (nch + 1 states of (dp, mp): the only
//               O(S / kChunk) memory; recomputing them in the descending sweep would cost as
//               much as the forward's state products again, and storing avoids a second pass
//               over Q / dO)
//   descending: per chunk and head, with P = dO' V'^T and A = Q~ K~^T masked j <= i with
//               e^{g_i - g_j} (the only (n, n) products):
//                 dQ~ = P K~ + e^{g_i} dO' S^T      dK~ = P^T Q~ + e^{gC - g_j} v' U^T
//                 dV' = A^T dO' + e^{gC - g_j} K~ U
//               then U^T <- e^{gC} U^T + (e^{g_i} dO')^T Q~; dG and its reverse running sum
//               (ddecay) come out row by row in the same sweep.
// P^T and A^T are read in place by the transposed-A gemm; the states are kept transposed,
// (dp, mp), because every product reads S^T and U^T as its B operand. Only U (for dV') and the
// chunk's K~^T and V'^T are transposed, in registers (cpu/simd.h transpose).
// dV' is computed over dv only (its normalizer column has no gradient to give): N = vp, not dp.
// Non-causal: S^T (shared by the group but for init_state), dQ~ = dO' S^T and U_h^T += dO'^T Q~
// per head in one sweep, then dK~ = v' U^T and dV' = K~ U with U the group's sum.
template <typename T>
struct BwdTask {
  const LinearBwdParamsT<T>& p;
  DType dt;
  Chunk<T> c;
  int group, nstates;
  int64_t md;  // elements of one state, (dp, mp)
  Scratch<T, 5> mem;
  Span<T> st;    // (group, nstates, dp, mp): S^T before chunk 0 .. nch (causal), S^T (non-causal)
  Span<T> ut;    // (group, dp, mp): U^T after the current chunk
  Span<T> usum;  // (dp, mp): non-causal, the group's sum of U^T
  Span<T> kt, vt;                 // (mp, cp), (dp, cp): K~^T, V'^T
  Span<T> dq, dkh, dka, kw;       // (cp, mp)
  Span<T> dvh, dva, vw, dow;      // (cp, dp)
  Span<T> ew, ec, dgr, ddacc;     // (cp) and (group)

  BwdTask(const LinearBwdParamsT<T>& p_, DType dt_)
      : p(p_), dt(dt_), c(p_.d, p_.dim_v_aug), group(p_.h / p_.h_k),
        nstates(p_.causal ? (p_.sq + kChunk - 1) / kChunk + 1 : 1), md(int64_t(c.mp) * c.dp),
        mem(carved_size<T, 17>(sizes())) {
    std::array<Span<T>*, 17> spans{&st, &ut, &usum, &kt, &vt, &dq, &dkh, &dka, &kw, &dvh, &dva, &vw, &dow, &ew, &ec, &dgr, &ddacc};
    const auto n = sizes();
    std::array<T*, 17> ptrs{};
    std::array<T**, 17> out{};
    for (int i = 0; i < 17; ++i) out[i] = &ptrs[i];
    carve<T, 17>(mem.data(), n, out);
    for (int i = 0; i < 17; ++i) *spans[i] = {ptrs[i], int64_t(n[i])};
  }
  std::array<size_t, 17> sizes() const {
    const size_t cm = size_t(c.cp) * c.mp, cd = size_t(c.cp) * c.dp, m = size_t(md), cp = size_t(c.cp);
    return {size_t(group) * nstates * m, size_t(group) * m, m, cm, cd, cm, cm, cm, cm, cd, cd, cd, cd, cp, cp, cp, size_t(group)};
  }
  T* st_at(int hh, int chunk) const { return st.data() + (int64_t(hh) * nstates + chunk) * md; }
  T* ut_at(int hh) const { return ut.data() + hh * md; }

  // dO' of the chunk's rows into c.dov (rows >= n zero)
  void load_dout(int b, int h, int r0, int n) {
    const size_t es = dtype_size(dt);
    std::fill(c.dov.begin() + int64_t(n) * c.dp, c.dov.end(), T(0));
    for (int i = 0; i < n; ++i) {
      T* d = c.dov.data() + int64_t(i) * c.dp;
      const int64_t row = r0 + i;
      load_row(dt, static_cast<const char*>(p.dout) + offset(p.cu_seqlens, b, p.do_batch_stride, h, p.do_head_stride, row, p.do_row_stride) * es, d, p.dim_v, c.dp);
      if (p.normalize) {
        T* o = c.o.data();  // scratch row: out_i (plus its rounding residual, when kept)
        const int64_t at = offset(p.cu_seqlens, b, p.o_batch_stride, h, p.o_head_stride, row, p.o_row_stride) * es;
        load_row(dt, static_cast<const char*>(p.o) + at, o, p.dim_v, c.dp);
        if (p.o_res != nullptr) {
          T* r = o + c.dp;  // c.o's second row, free here
          load_row(dt, static_cast<const char*>(p.o_res) + at, r, p.dim_v, c.dp);
          const T unscale = T(1) / T(dt == DType::kF16 ? kResidualScaleF16 : kResidualScaleBF16);
          for (int j = 0; j < p.dim_v; ++j) o[j] += r[j] * unscale;
        }
        // vector dot and scale over the zero-padded rows (a scalar float sum runs at one add
        // per FMA latency)
        const T inv = T(1) / p.den[seq_index(p, b, h, int(row))];
        const T dn = dot(d, o, c.dp);
        scale(d, c.dp, inv);
        d[p.dim_v] = -dn * inv;
      }
    }
  }

  void store_grad(void* base, int64_t bs, int64_t hs, int64_t rs, int b, int head, int64_t row, const T* src, int n) {
    store_row(dt, src, static_cast<char*>(base) + offset(p.cu_seqlens, b, bs, head, hs, row, rs) * dtype_size(dt), n);
  }

  // dst (dp, mp) <- the (M, dim_v_aug) state of (b, h) in base, transposed (0 without one)
  void load_state_t(const T* base, int b, int h, T* dst) const {
    std::fill(dst, dst + md, T(0));
    if (base == nullptr) return;
    const T* src = base + state_index(p, b, h);
    for (int m = 0; m < p.d; ++m) {
      for (int x = 0; x < p.dim_v_aug; ++x) dst[int64_t(x) * c.mp + m] = src[int64_t(m) * p.dim_v_aug + x];
    }
  }
  // dinit_state of (b, h) <- U from U^T (dp, mp)
  void save_dinit(int b, int h, const T* u_t) {
    if (p.dinit_state == nullptr) return;
    transpose(u_t, c.dp, c.mp, c.mp, c.u.data(), c.dp);
    save_state(p, b, h, c, c.u.data(), p.dinit_state);
  }

  // dQ~ rows of head h: feature backward and store
  void finish_dq(int b, int h, int r0, int n) {
    for (int i = 0; i < n; ++i) {
      T* dqi = dq.data() + int64_t(i) * c.mp;
      feature_backward(p.feature_map, dqi, c.q.data() + int64_t(i) * c.mp, c.mp, p.scale);
      store_grad(p.dq, p.dq_batch_stride, p.dq_head_stride, p.dq_row_stride, b, h, r0 + i, dqi, p.d);
    }
  }
  // the group's dK~ (dk, feature backward here) and dV' rows of the chunk: store
  void finish_dkv(int b, int hk, int r0, int n, T* dk, const T* dv) {
    for (int j = 0; j < n; ++j) {
      T* dkj = dk + int64_t(j) * c.mp;
      feature_backward(p.feature_map, dkj, c.k.data() + int64_t(j) * c.mp, c.mp,
                       kj_live(b, r0 + j) ? T(1) : T(0));
      store_grad(p.dk, p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride, b, hk, r0 + j, dkj, p.d);
      store_grad(p.dv, p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride, b, hk, r0 + j, dv + int64_t(j) * c.dp, p.dim_v);
    }
  }
  // head hh's (n, mp) dK~ and (n, dp) dV' into the group's sums (group > 1)
  void accumulate(int hh, int n) {
    if (hh == 0) {
      std::copy(dkh.begin(), dkh.begin() + int64_t(n) * c.mp, dka.begin());
      std::copy(dvh.begin(), dvh.begin() + int64_t(n) * c.dp, dva.begin());
    } else {
      add_to(dka.data(), dkh.data(), int64_t(n) * c.mp);
      add_to(dva.data(), dvh.data(), int64_t(n) * c.dp);
    }
  }

  void causal(int b, int hk, int len) {
    const int h0 = hk * group, nch = (len + kChunk - 1) / kChunk;
    const bool decay = p.decay != nullptr, want_dg = decay && p.ddecay != nullptr;
    const int mp = c.mp, dp = c.dp, cp = c.cp, vp = round_up(p.dim_v, kLanes<T>);
    // ---------------------------------------------------------------- ascending: S^T per chunk
    for (int hh = 0; hh < group; ++hh) load_state_t(p.init_state, b, h0 + hh, st_at(hh, 0));
    for (int ci = 0; ci < nch; ++ci) {
      const int r0 = ci * kChunk, n = std::min(kChunk, len - r0);
      load_chunk(p, dt, b, h0, hk, r0, n, c, false, true);
      for (int hh = 0; hh < group; ++hh) {
        T* next = st_at(hh, ci + 1);
        std::copy(st_at(hh, ci), st_at(hh, ci) + md, next);
        const T* a = c.v.data();
        if (decay) {  // S <- e^{gC} S + sum_j e^{gC - g_j} K~_j v'_j^T
          running_decay(p, b, h0 + hh, r0, n, c.g.data(), c.d.data());
          scale(next, md, T(std::exp(c.g[n - 1])));
          weights_to_end(c.d.data(), n, ec.data());
          scale_rows(vw.data(), c.v.data(), n, dp, ec.data());
          a = vw.data();
        }
        mm<true, true>(dp, mp, n, a, dp, c.k.data(), mp, next, mp);  // S^T += v'^T K~
      }
    }
    // ---------------------------------------------------------------- descending: dQ~, dK~, dV'
    for (int hh = 0; hh < group; ++hh) {
      load_state_t(p.dfinal_state, b, h0 + hh, ut_at(hh));
      ddacc[hh] = T(0);
      if (want_dg && p.dfinal_state != nullptr && len > 0) {
        // the direct dependence of S_T on G_T: <dS_T, S_T>, at the last row
        ddacc[hh] = dot(ut_at(hh), st_at(hh, nch), int(md));
      }
    }
    T* P = c.p.data();
    T* A = c.p2.data();
    for (int ci = nch - 1; ci >= 0; --ci) {
      const int r0 = ci * kChunk, n = std::min(kChunk, len - r0);
      load_chunk(p, dt, b, h0, hk, r0, n, c, false, true);
      transpose(c.k.data(), cp, mp, mp, kt.data(), cp);
      transpose(c.v.data(), cp, dp, dp, vt.data(), cp);
      const bool s_live = ci > 0 || p.init_state != nullptr;
      const bool u_live = ci < nch - 1 || p.dfinal_state != nullptr;
      for (int hh = 0; hh < group; ++hh) {
        const int h = h0 + hh;
        load_chunk(p, dt, b, h, hk, r0, n, c, true, false);
        load_dout(b, h, r0, n);
        const T* g = c.g.data();
        // intra-chunk
        mm<false, false, Tri::kLowerC>(n, cp, dp, c.dov.data(), dp, vt.data(), cp, P, cp);
        mask_chunk(P, n, cp, c.d.data(), c.seg.data(), decay);
        mm<false, false, Tri::kLowerC>(n, cp, mp, c.q.data(), mp, kt.data(), cp, A, cp);
        mask_chunk(A, n, cp, c.d.data(), c.seg.data(), decay);
        mm<false, false, Tri::kLowerA>(n, mp, n, P, cp, c.k.data(), mp, dq.data(), mp);          // dQ~ = P K~
        mm<false, true, Tri::kUpperAT>(n, mp, n, P, cp, c.q.data(), mp, dkh.data(), mp);  // dK~ = P^T Q~
        mm<false, true, Tri::kUpperAT>(n, vp, n, A, cp, c.dov.data(), dp, dvh.data(), dp);  // dV' = A^T dO'
        // across chunks: S before the chunk, U after it
        const T* dow_ = c.dov.data();
        const T* vw_ = c.v.data();
        const T* kw_ = c.k.data();
        const T gc = g[n - 1];
        if (decay) {
          for (int i = 0; i < n; ++i) ew[i] = T(std::exp(g[i]));
          weights_to_end(c.d.data(), n, ec.data());
          scale_rows(dow.data(), c.dov.data(), n, dp, ew.data());
          dow_ = dow.data();
        }
        if (s_live) mm<true>(n, mp, dp, dow_, dp, st_at(hh, ci), mp, dq.data(), mp);  // += e^{g_i} dO' S^T
        T* u_t = ut_at(hh);
        if (u_live) {
          if (decay) {
            scale_rows(vw.data(), c.v.data(), n, dp, ec.data());
            scale_rows(kw.data(), c.k.data(), n, mp, ec.data());
            vw_ = vw.data();
            kw_ = kw.data();
          }
          transpose(u_t, dp, mp, mp, c.u.data(), dp);                          // U (mp, dp)
          mm<true>(n, mp, dp, vw_, dp, u_t, mp, dkh.data(), mp);               // += e^{gC - g_j} v' U^T
          mm<true>(n, vp, mp, kw_, mp, c.u.data(), dp, dvh.data(), dp);        // += e^{gC - g_j} K~ U
        }
        if (decay) scale(u_t, md, T(std::exp(gc)));
        mm<true, true>(dp, mp, n, dow_, dp, c.q.data(), mp, u_t, mp);         // U^T += (e^{g_i} dO')^T Q~
        if (want_dg) {
          // dG_i = Q~_i . dQ~_i - K~_i . dK~_i (this head's share); ddecay_i = sum_{t >= i} dG_t
          for (int i = 0; i < n; ++i) {
            dgr[i] = dot(c.q.data() + int64_t(i) * mp, dq.data() + int64_t(i) * mp, mp) -
                     dot(c.k.data() + int64_t(i) * mp, dkh.data() + int64_t(i) * mp, mp);
          }
          for (int i = n - 1; i >= 0; --i) {
            ddacc[hh] += dgr[i];
            p.ddecay[seq_index(p, b, h, r0 + i)] = ddacc[hh];
          }
        }
        finish_dq(b, h, r0, n);
        if (group > 1) accumulate(hh, n);
      }
      if (group > 1) {
        finish_dkv(b, hk, r0, n, dka.data(), dva.data());
      } else {
        finish_dkv(b, hk, r0, n, dkh.data(), dvh.data());
      }
    }
    for (int hh = 0; hh < group; ++hh) save_dinit(b, h0 + hh, ut_at(hh));
  }

  void non_causal(int b, int hk, int len) {
    const int h0 = hk * group;
    const int mp = c.mp, dp = c.dp, vp = round_up(p.dim_v, kLanes<T>);
    // S^T = sum_j v'_j K~_j^T (+ the head's initial state)
    T* s0 = st_at(0, 0);
    std::fill(s0, s0 + md, T(0));
    for (int r0 = 0; r0 < len; r0 += kChunk) {
      const int n = std::min(kChunk, len - r0);
      load_chunk(p, dt, b, h0, hk, r0, n, c, false, true);
      mm<true, true>(dp, mp, n, c.v.data(), dp, c.k.data(), mp, s0, mp);
    }
    for (int hh = group - 1; hh >= 0; --hh) {
      T* s = st_at(hh, 0);
      if (hh > 0) std::copy(s0, s0 + md, s);
      if (p.init_state != nullptr) {
        load_state_t(p.init_state, b, h0 + hh, c.st.data());
        add_to(s, c.st.data(), md);
      }
      load_state_t(p.dfinal_state, b, h0 + hh, ut_at(hh));
    }
    // dQ~ = dO' S^T, U^T = dS_T^T + sum_i dO'_i Q~_i^T
    for (int r0 = 0; r0 < len; r0 += kChunk) {
      const int n = std::min(kChunk, len - r0);
      for (int hh = 0; hh < group; ++hh) {
        load_chunk(p, dt, b, h0 + hh, hk, r0, n, c, true, false);
        load_dout(b, h0 + hh, r0, n);
        mm<false>(n, mp, dp, c.dov.data(), dp, st_at(hh, 0), mp, dq.data(), mp);
        mm<true, true>(dp, mp, n, c.dov.data(), dp, c.q.data(), mp, ut_at(hh), mp);
        finish_dq(b, h0 + hh, r0, n);
      }
    }
    // dK~ = v' U^T, dV' = K~ U with U the group's sum
    std::copy(ut_at(0), ut_at(0) + md, usum.data());
    for (int hh = 1; hh < group; ++hh) add_to(usum.data(), ut_at(hh), md);
    transpose(usum.data(), dp, mp, mp, c.u.data(), dp);
    for (int r0 = 0; r0 < len; r0 += kChunk) {
      const int n = std::min(kChunk, len - r0);
      load_chunk(p, dt, b, h0, hk, r0, n, c, false, true);
      mm<false>(n, mp, dp, c.v.data(), dp, usum.data(), mp, dkh.data(), mp);
      mm<false>(n, vp, mp, c.k.data(), mp, c.u.data(), dp, dvh.data(), dp);
      finish_dkv(b, hk, r0, n, dkh.data(), dvh.data());
    }
    for (int hh = 0; hh < group; ++hh) save_dinit(b, h0 + hh, ut_at(hh));
  }

  bool kj_live(int b, int64_t row) const {
    if (p.key_mask == nullptr) return true;
    const int64_t mrow = p.cu_seqlens != nullptr ? int64_t(p.cu_seqlens[b]) + row : int64_t(b) * p.key_mask_batch_stride + row;
    return p.key_mask[mrow] != 0;
  }

  void operator()(int64_t task) {
    const int b = int(task / p.h_k), hk = int(task % p.h_k);
    const int len = seq_len(p, b);
    if (p.causal) {
      causal(b, hk, len);
    } else {
      non_causal(b, hk, len);
    }
  }
};

}  // namespace

template <typename T>
void linear_fwd(const LinearParamsT<T>& p, DType dt) {
  parallel_tasks(int64_t(p.b) * p.h, p.num_threads, [&] { return FwdTask<T>(p, dt); });
}
template void linear_fwd<float>(const LinearParamsT<float>&, DType);
template void linear_fwd<double>(const LinearParamsT<double>&, DType);
ATTN_CPU_REGISTER(linear_fwd_stub<float>, &linear_fwd<float>);
ATTN_CPU_REGISTER(linear_fwd_stub<double>, &linear_fwd<double>);

template <typename T>
void linear_bwd(const LinearBwdParamsT<T>& p, DType dt) {
  parallel_tasks(int64_t(p.b) * p.h_k, p.num_threads, [&] { return BwdTask<T>(p, dt); });
}
template void linear_bwd<float>(const LinearBwdParamsT<float>&, DType);
template void linear_bwd<double>(const LinearBwdParamsT<double>&, DType);
ATTN_CPU_REGISTER(linear_bwd_stub<float>, &linear_bwd<float>);
ATTN_CPU_REGISTER(linear_bwd_stub<double>, &linear_bwd<double>);

ATTN_CPU_ISA_END
}  // namespace cpu
}  // namespace attn
