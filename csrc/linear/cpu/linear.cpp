// Linear attention on the CPU: the chunked parallel form, forward and backward
// (common/linear_params.h states the math).
//
// One task = (batch, head) in the forward, (batch, kv head) in the backward (the group's query
// heads accumulate one dK / dV). A task walks its sequence in chunks of kChunk rows carrying the
// (M, dv_aug) state across chunks; inside a chunk the causal part is a masked (C, C) product. Per
// chunk of n rows, with g the running sum of decay since the chunk start (gC = g_{n-1}):
//   forward     A = Q~ K~^T (masked j <= i, weights e^{g_i - g_j});  O' = A V' + e^{g_i} Q~ S
//               S <- e^{gC} S + sum_j e^{gC - g_j} K~_j v'_j^T
// The backward takes the normalization apart first: dO'_i = [dout_i / den_i, -(dout_i . out_i)
// / den_i] (the last column only when normalize), so that everything after is the unnormalized
// form over v'. Then, with S_i the forward state at row i and U_j = sum_{i >= j} e^{G_i - G_j}
// Q~_i dO'_i^T (+ e^{G_T - G_j} dS_T) the reverse state:
//   dQ~_i = S_i dO'_i        an ascending sweep that recomputes the forward states by chunk
//   dK~_j = U_j v'_j, dV'_j = U_j^T K~_j      one descending sweep
//   dS_init = U_{-1};  dG_i = Q~_i . dQ~_i - K~_i . dK~_i (+ <dS_T, S_T> at the last row), and
//   ddecay is the reverse running sum of dG.
// So the extra memory is O(chunk * (M + dv)) per thread plus, with GQA, the group's dK / dV
// accumulators: never a state per position.
//
// All products run on the softmax kernels' register-blocked micro-kernel (cpu/simd.h gemm) in T
// (float; double for float64 inputs); rows are loaded and converted once per chunk and padded
// to whole vectors (the padding columns stay 0, so they add nothing to any product).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "common/linear_params.h"
#include "cpu/memory.h"
#include "cpu/parallel.h"
#include "cpu/simd.h"
#include "linear/cpu/entry.h"
#include "linear/cpu/feature_map.h"

namespace attn {
namespace cpu {

namespace {

// Rows per chunk: the (C, C) masked product costs C / (M + dv) of the state products per row,
// and C = 64 keeps the chunk's operands (a few 64 x 64 tiles) in L1 / L2.
constexpr int kChunk = 64;

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

// dx <- dx * d(feature(x) * mul)/dx over n_pad values, from the raw x and y = feature(x) * mul:
// for elu + 1 that is mul where x > 0, else y itself (d e^x = e^x), so no exp is evaluated.
template <typename T>
void feature_backward(FeatureMap fm, T* dx, const T* x, const T* y, int n_pad, T mul) {
  constexpr int L = kLanes<T>;
  for (int i = 0; i < n_pad; i += L) {
    const vec<T> v = vload(x + i), m = vbcast(mul);
    vec<T> f = m;
    if (fm == FeatureMap::kElu) {
      f = v > T(0) ? m : vload(y + i);
    } else if (fm == FeatureMap::kRelu) {
      f = v > T(0) ? m : vbcast(T(0));
    }
    vstore(dx + i, vload(dx + i) * f);
  }
}

// dst (cols x ld_dst) <- src (rows x cols)^T, zero-filled to ld_dst columns
template <typename T>
void transpose(const T* src, int rows, int cols, int64_t ld_src, T* dst, int ld_dst) {
  for (int c = 0; c < cols; ++c) {
    T* d = dst + int64_t(c) * ld_dst;
    for (int r = 0; r < rows; ++r) d[r] = src[int64_t(r) * ld_src + c];
    for (int r = rows; r < ld_dst; ++r) d[r] = T(0);
  }
}

template <typename T>
T dot(const T* a, const T* b, int n) {
  constexpr int L = kLanes<T>;
  vec<T> acc{};
  for (int i = 0; i < n; i += L) acc += vload(a + i) * vload(b + i);
  return hsum(acc);
}

// The intra-chunk mask on a (n, ldp) product P. kForward: row i keeps columns j <= i with weight
// e^{g_i - g_j} (A, dO' V'^T); else row j keeps columns i >= j with e^{g_i - g_j} (the reverse
// products V' dO'^T, K~ Q~^T). Columns past n are zeroed.
template <bool kForward, typename T>
void mask_chunk(T* P, int n, int ldp, const T* g, bool decay) {
  for (int r = 0; r < n; ++r) {
    T* row = P + int64_t(r) * ldp;
    const int c0 = kForward ? 0 : r, c1 = kForward ? r + 1 : n;
    for (int c = 0; c < c0; ++c) row[c] = T(0);
    if (decay) {
      for (int c = c0; c < c1; ++c) row[c] *= T(std::exp(kForward ? g[r] - g[c] : g[c] - g[r]));
    }
    for (int c = c1; c < ldp; ++c) row[c] = T(0);
  }
}

template <bool kAcc, bool kTransA = false, typename T>
inline void mm(int M, int N, int K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc) {
  gemm<kAcc, kTransA>(M, N, K, A, lda, B, ldb, kPanel<T>, C, ldc);
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
  Span<T> q, qraw, k, kraw, v, dov, kt, p, p2, o, t, s, st, u, g, grow;
  Chunk(int m, int dv_aug)
      : mp(round_up(m, kLanes<T>)), dp(round_up(dv_aug, kLanes<T>)), cp(round_up(kChunk, kLanes<T>)),
        mem(carved_size<T, 16>(sizes(mp, dp, cp))) {
    const auto n = sizes(mp, dp, cp);
    std::array<Span<T>*, 16> spans{&q, &qraw, &k, &kraw, &v, &dov, &o, &kt, &p, &p2, &t, &s, &st, &u, &g, &grow};
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
    // q, qraw, k, kraw | v, dov, o | kt, p, p2, t | s, st, u | g, grow
    return {cm, cm, cm, cm, cd, cd, cd, big, big, big, big, md, md, md, size_t(cp), size_t(cp)};
  }
};

// Loads rows [r0, r0 + n) of sequence b, head h (kv head hk) into the chunk: Q~ (and raw q),
// K~ (raw k), v' and the running decay sum g. Rows n .. cp of every buffer are zero.
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
        std::memcpy(c.qraw.data() + int64_t(i) * c.mp, q, sizeof(T) * c.mp);
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
      if (live) {
        load_row(dt, static_cast<const char*>(p.k) + offset(p.cu_seqlens, b, p.k_batch_stride, hk, p.k_head_stride, row, p.k_row_stride) * es, k, m, c.mp);
        std::memcpy(c.kraw.data() + int64_t(i) * c.mp, k, sizeof(T) * c.mp);
        apply_feature(p.feature_map, k, m, c.mp, real ? T(1) : T(0));
        load_row(dt, static_cast<const char*>(p.v) + offset(p.cu_seqlens, b, p.v_batch_stride, hk, p.v_head_stride, row, p.v_row_stride) * es, v, p.dim_v, c.dp);
        if (p.normalize) v[p.dim_v] = T(1);
      } else {
        std::fill(k, k + c.mp, T(0));
        std::fill(v, v + c.dp, T(0));
      }
    }
  }
  T acc = T(0);
  for (int i = 0; i < n; ++i) {
    if (p.decay != nullptr) acc += p.decay[seq_index(p, b, h, r0 + i)];
    c.g[i] = acc;
  }
}

// out_i, den_i from O'_i (n rows in c.o)
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
    store_row(dt, o, static_cast<char*>(p.o) + offset(p.cu_seqlens, b, p.o_batch_stride, h, p.o_head_stride, r0 + i, p.o_row_stride) * es, p.dim_v);
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
    const T gc = c.g[n - 1];
    const T f = T(std::exp(gc));
    for (int64_t x = 0; x < int64_t(c.mp) * c.dp; ++x) s[x] *= f;
    for (int j = 0; j < n; ++j) {
      const T w = T(std::exp(gc - c.g[j]));
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

// rows x cols block of a per-row-scaled add: dst[i] += e^{g_i} src[i]
template <typename T>
void add_scaled_rows(T* dst, const T* src, int n, int ld, const T* g, bool decay) {
  for (int i = 0; i < n; ++i) {
    const T w = decay ? T(std::exp(g[i])) : T(1);
    for (int x = 0; x < ld; ++x) dst[int64_t(i) * ld + x] += w * src[int64_t(i) * ld + x];
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
        mm<false>(n, c.cp, c.mp, c.q.data(), c.mp, c.kt.data(), c.cp, c.p.data(), c.cp);
        mask_chunk<true>(c.p.data(), n, c.cp, c.g.data(), decay);
        mm<false>(n, c.dp, c.cp, c.p.data(), c.cp, c.v.data(), c.dp, c.o.data(), c.dp);
        if (!state_zero) {
          if (decay) {
            mm<false>(n, c.dp, c.mp, c.q.data(), c.mp, s, c.dp, c.t.data(), c.dp);
            add_scaled_rows(c.o.data(), c.t.data(), n, c.dp, c.g.data(), true);
          } else {
            mm<true>(n, c.dp, c.mp, c.q.data(), c.mp, s, c.dp, c.o.data(), c.dp);
          }
        }
        store_out(p, dt, b, h, r0, n, c);
        advance_state(c, n, decay, s);
        state_zero = false;
      }
    }
    if (p.final_state != nullptr) save_state(p, b, h, c, s, p.final_state);
  }
};

template <typename T>
struct BwdTask {
  const LinearBwdParamsT<T>& p;
  DType dt;
  Chunk<T> c;
  // the group's dK~ / dv' accumulators (GQA) and the per-row dG, for the longest sequence
  Scratch<T, 5> rows_mem;
  Span<T> dk_acc, dv_acc, dg;
  BwdTask(const LinearBwdParamsT<T>& p_, DType dt_)
      : p(p_), dt(dt_), c(p_.d, p_.dim_v_aug), rows_mem(size_t(p_.sq) * (c.mp + c.dp + 1)) {
    dk_acc = {rows_mem.data(), int64_t(p.sq) * c.mp};
    dv_acc = {dk_acc.end(), int64_t(p.sq) * c.dp};
    dg = {dv_acc.end(), int64_t(p.sq)};
  }

  // dO' of the chunk's rows into c.dov (rows >= n zero)
  void load_dout(int b, int h, int r0, int n) {
    const size_t es = dtype_size(dt);
    std::fill(c.dov.begin(), c.dov.end(), T(0));
    for (int i = 0; i < n; ++i) {
      T* d = c.dov.data() + int64_t(i) * c.dp;
      const int64_t row = r0 + i;
      load_row(dt, static_cast<const char*>(p.dout) + offset(p.cu_seqlens, b, p.do_batch_stride, h, p.do_head_stride, row, p.do_row_stride) * es, d, p.dim_v, c.dp);
      if (p.normalize) {
        T* o = c.o.data();  // scratch row: out_i
        load_row(dt, static_cast<const char*>(p.o) + offset(p.cu_seqlens, b, p.o_batch_stride, h, p.o_head_stride, row, p.o_row_stride) * es, o, p.dim_v, c.dp);
        const T inv = T(1) / p.den[seq_index(p, b, h, int(row))];
        T dn = T(0);
        for (int j = 0; j < p.dim_v; ++j) dn += d[j] * o[j];
        for (int j = 0; j < p.dim_v; ++j) d[j] *= inv;
        d[p.dim_v] = -dn * inv;
      }
    }
  }

  void store_grad(void* base, int64_t bs, int64_t hs, int64_t rs, int b, int head, int64_t row, const T* src, int n) {
    store_row(dt, src, static_cast<char*>(base) + offset(p.cu_seqlens, b, bs, head, hs, row, rs) * dtype_size(dt), n);
  }

  // dq of head h (ascending sweep), dK~ / dv' contributions (descending sweep) into the group's
  // accumulators, ddecay and dinit_state of h.
  void head(int b, int h, int hk, int len, bool store_kv_direct) {
    const bool decay = p.decay != nullptr, want_dg = decay && p.ddecay != nullptr;
    T* s = c.s.data();
    T* u = c.u.data();
    const int64_t md = int64_t(c.mp) * c.dp;
    if (want_dg) std::fill(dg.begin(), dg.begin() + len, T(0));
    init_state(p, b, h, c, s);
    // ---------------------------------------------------------------- dQ~ = S_i dO'_i
    if (!p.causal) sum_state(p, dt, b, h, hk, len, c, s);
    transpose(s, c.mp, c.dp, c.dp, c.st.data(), c.mp);  // S^T (dp, mp), for non-causal
    std::fill(u, u + md, T(0));
    if (p.dfinal_state != nullptr) init_state_from(p.dfinal_state, b, h, u);
    T final_dot = T(0);
    for (int r0 = 0; r0 < len; r0 += kChunk) {
      const int n = std::min(kChunk, len - r0);
      load_chunk(p, dt, b, h, hk, r0, n, c, true, p.causal);
      load_dout(b, h, r0, n);
      T* dq = c.t.data();  // (n, mp)
      if (p.causal) {
        transpose(c.v.data(), c.cp, c.dp, c.dp, c.kt.data(), c.cp);  // V'^T (dp, cp)
        mm<false>(n, c.cp, c.dp, c.dov.data(), c.dp, c.kt.data(), c.cp, c.p.data(), c.cp);
        mask_chunk<true>(c.p.data(), n, c.cp, c.g.data(), decay);
        mm<false>(n, c.mp, c.cp, c.p.data(), c.cp, c.k.data(), c.mp, dq, c.mp);
        transpose(s, c.mp, c.dp, c.dp, c.st.data(), c.mp);
        mm<false>(n, c.mp, c.dp, c.dov.data(), c.dp, c.st.data(), c.mp, c.p2.data(), c.mp);
        add_scaled_rows(dq, c.p2.data(), n, c.mp, c.g.data(), decay);
      } else {
        mm<false>(n, c.mp, c.dp, c.dov.data(), c.dp, c.st.data(), c.mp, dq, c.mp);
        mm<true, true>(c.mp, c.dp, n, c.q.data(), c.mp, c.dov.data(), c.dp, u, c.dp);  // dS += Q~^T dO'
      }
      for (int i = 0; i < n; ++i) {
        T* dqi = dq + int64_t(i) * c.mp;
        const T* qi = c.q.data() + int64_t(i) * c.mp;
        const T* xi = c.qraw.data() + int64_t(i) * c.mp;
        if (want_dg) dg[r0 + i] += dot(qi, dqi, c.mp);
        feature_backward(p.feature_map, dqi, xi, qi, c.mp, p.scale);
        store_grad(p.dq, p.dq_batch_stride, p.dq_head_stride, p.dq_row_stride, b, h, r0 + i, dqi, p.d);
      }
      if (p.causal) advance_state(c, n, decay, s);
    }
    if (want_dg && p.dfinal_state != nullptr && len > 0) {
      // the direct dependence of S_T on G_T: <dS_T, S_T>
      for (int64_t x = 0; x < md; ++x) final_dot += u[x] * s[x];
      dg[len - 1] += final_dot;
    }
    // ---------------------------------------------------------------- dK~_j = U_j v'_j, dV'_j = U_j^T K~_j
    // non-causal: U = dS for every row (u already holds dS_T + sum_i Q~_i dO'_i^T)
    const int last = len == 0 ? 0 : (len - 1) / kChunk * kChunk;
    for (int r0 = last; r0 >= 0 && len > 0; r0 -= kChunk) {
      const int n = std::min(kChunk, len - r0);
      load_chunk(p, dt, b, h, hk, r0, n, c, true, true);
      load_dout(b, h, r0, n);
      T* dkc = c.t.data();   // (n, mp)
      T* dvc = c.o.data();   // (n, dp)
      transpose(u, c.mp, c.dp, c.dp, c.st.data(), c.mp);  // U^T (dp, mp)
      if (p.causal) {
        transpose(c.dov.data(), c.cp, c.dp, c.dp, c.kt.data(), c.cp);  // dO'^T (dp, cp)
        mm<false>(n, c.cp, c.dp, c.v.data(), c.dp, c.kt.data(), c.cp, c.p.data(), c.cp);
        mask_chunk<false>(c.p.data(), n, c.cp, c.g.data(), decay);
        mm<false>(n, c.mp, c.cp, c.p.data(), c.cp, c.q.data(), c.mp, dkc, c.mp);
        transpose(c.q.data(), c.cp, c.mp, c.mp, c.kt.data(), c.cp);  // Q~^T (mp, cp)
        mm<false>(n, c.cp, c.mp, c.k.data(), c.mp, c.kt.data(), c.cp, c.p2.data(), c.cp);
        mask_chunk<false>(c.p2.data(), n, c.cp, c.g.data(), decay);
        mm<false>(n, c.dp, c.cp, c.p2.data(), c.cp, c.dov.data(), c.dp, dvc, c.dp);
        // the later chunks, through U at this chunk's end, weighted e^{gC - g_j}
        T* tk = c.p.data();   // (n, mp)
        T* tv = c.p2.data();  // (n, dp)
        mm<false>(n, c.mp, c.dp, c.v.data(), c.dp, c.st.data(), c.mp, tk, c.mp);
        mm<false>(n, c.dp, c.mp, c.k.data(), c.mp, u, c.dp, tv, c.dp);
        const T gc = c.g[n - 1];
        for (int j = 0; j < n; ++j) c.grow[j] = decay ? gc - c.g[j] : T(0);
        add_scaled_rows(dkc, tk, n, c.mp, c.grow.data(), decay);
        add_scaled_rows(dvc, tv, n, c.dp, c.grow.data(), decay);
      } else {
        mm<false>(n, c.mp, c.dp, c.v.data(), c.dp, c.st.data(), c.mp, dkc, c.mp);
        mm<false>(n, c.dp, c.mp, c.k.data(), c.mp, u, c.dp, dvc, c.dp);
      }
      for (int j = 0; j < n; ++j) {
        T* dkj = dkc + int64_t(j) * c.mp;
        const T* kj = c.k.data() + int64_t(j) * c.mp;
        const T* xj = c.kraw.data() + int64_t(j) * c.mp;
        if (want_dg) dg[r0 + j] -= dot(kj, dkj, c.mp);
        feature_backward(p.feature_map, dkj, xj, kj, c.mp, kj_live(b, r0 + j) ? T(1) : T(0));
        const T* dvj = dvc + int64_t(j) * c.dp;
        if (store_kv_direct) {
          store_grad(p.dk, p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride, b, hk, r0 + j, dkj, p.d);
          store_grad(p.dv, p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride, b, hk, r0 + j, dvj, p.dim_v);
        } else {
          T* ak = dk_acc.data() + int64_t(r0 + j) * c.mp;
          T* av = dv_acc.data() + int64_t(r0 + j) * c.dp;
          for (int x = 0; x < c.mp; ++x) ak[x] += dkj[x];
          for (int x = 0; x < c.dp; ++x) av[x] += dvj[x];
        }
      }
      if (p.causal) {
        // U <- e^{gC} U + sum_i e^{g_i} Q~_i dO'_i^T
        if (decay) {
          const T f = T(std::exp(c.g[n - 1]));
          for (int64_t x = 0; x < md; ++x) u[x] *= f;
          for (int i = 0; i < n; ++i) {
            const T w = T(std::exp(c.g[i]));
            T* q = c.q.data() + int64_t(i) * c.mp;
            for (int x = 0; x < c.mp; ++x) q[x] *= w;
          }
        }
        mm<true, true>(c.mp, c.dp, n, c.q.data(), c.mp, c.dov.data(), c.dp, u, c.dp);
      }
    }
    if (p.dinit_state != nullptr) save_state(p, b, h, c, u, p.dinit_state);
    if (want_dg) {
      T acc = T(0);
      for (int i = len - 1; i >= 0; --i) {
        acc += dg[i];
        p.ddecay[seq_index(p, b, h, i)] = acc;
      }
    }
  }

  bool kj_live(int b, int64_t row) const {
    if (p.key_mask == nullptr) return true;
    const int64_t mrow = p.cu_seqlens != nullptr ? int64_t(p.cu_seqlens[b]) + row : int64_t(b) * p.key_mask_batch_stride + row;
    return p.key_mask[mrow] != 0;
  }

  void init_state_from(const T* base, int b, int h, T* dst) {
    const T* src = base + state_index(p, b, h);
    for (int m = 0; m < p.d; ++m) std::memcpy(dst + int64_t(m) * c.dp, src + int64_t(m) * p.dim_v_aug, sizeof(T) * p.dim_v_aug);
  }

  void operator()(int64_t task) {
    const int b = int(task / p.h_k), hk = int(task % p.h_k), group = p.h / p.h_k;
    const int len = seq_len(p, b);
    const bool direct = group == 1;
    if (!direct) {
      std::fill(dk_acc.begin(), dk_acc.begin() + int64_t(len) * c.mp, T(0));
      std::fill(dv_acc.begin(), dv_acc.begin() + int64_t(len) * c.dp, T(0));
    }
    for (int h = hk * group; h < (hk + 1) * group; ++h) head(b, h, hk, len, direct);
    if (!direct) {
      for (int j = 0; j < len; ++j) {
        store_grad(p.dk, p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride, b, hk, j, dk_acc.data() + int64_t(j) * c.mp, p.d);
        store_grad(p.dv, p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride, b, hk, j, dv_acc.data() + int64_t(j) * c.dp, p.dim_v);
      }
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

template <typename T>
void linear_bwd(const LinearBwdParamsT<T>& p, DType dt) {
  parallel_tasks(int64_t(p.b) * p.h_k, p.num_threads, [&] { return BwdTask<T>(p, dt); });
}
template void linear_bwd<float>(const LinearBwdParamsT<float>&, DType);
template void linear_bwd<double>(const LinearBwdParamsT<double>&, DType);

}  // namespace cpu
}  // namespace attn
