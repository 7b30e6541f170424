// SIMT kernels: the fallback for what the tensor-core path does not take (fp32 inputs, sm < 80,
// head dims that are not a multiple of 8 or misaligned tensors), and the small backward
// helpers every path uses (dot(dO, O), dQ conversion).
//
// The fallback is one warp per row: lane l holds head-dim elements l, l + 32, ... (up to
// kSimtMaxD), q.k is a warp reduction, and the online softmax runs on warp-uniform scalars.
// Slow but simple, exact in fp32, and it takes every option of the policy. Block-sparse: a row's
// keys (a key's queries) run in runs of one layout block, off blocks skipped whole, so the work
// follows the on blocks. Top-k calls run here only: q.k is dot_row and the logit pol.score, as
// in the threshold pass (csrc/sparse/cuda/topk_kernel.cuh), so top-k's equality test holds.
// Each lane's sums over a row's keys (O and l; dQ) or a key's queries (dK, dV) take kFoldTerms
// terms in a block-local accumulator, then join a compensated running sum
// (csrc/cuda/compensated.cuh), so their float32 error does not grow with the row length.
#pragma once

#include "softmax/cuda/kernel_common.cuh"
#include "cuda/compensated.cuh"
#include "cuda/convert.cuh"  // to_float, from_float
#include "cuda/warp_row.cuh"  // kChunks, warp_sum, load_row, store_row, dot_row

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace attn {
namespace simt {

constexpr int kRowsPerBlock = 4;  // warps per block, one row each

__device__ __forceinline__ float dropout_factor(const SoftmaxParams& p, int bh, int i, int j) {
  if (!(p.dropout_p > 0.f)) return 1.f;
  return dropout_keep_at(p.seed, p.offset, p.dropout_coords, bh, i, j, p.dropout_p) ? 1.f / (1.f - p.dropout_p) : 0.f;
}

// grid (ceil(Sq / 4), H, B), 128 threads: warp w of block x computes query row 4x + w.
template <typename T>
__global__ void __launch_bounds__(32 * kRowsPerBlock) fwd_kernel(const SoftmaxParams p) {
  const int lane = threadIdx.x & 31;
  const int i = blockIdx.x * kRowsPerBlock + (threadIdx.x >> 5);
  const int h = blockIdx.y, b = blockIdx.z;
  const SeqInfo si(p, b);
  if (i >= si.len_q) return;
  const Policy pol(p, si, b, h);
  const bool plain = policy_is_plain(pol);
  const int hk = h / (p.h / p.h_k);
  const int bh = b * p.h + h;
  const float scale_log2 = p.scale * kLog2e;

  const T* q = q_ptr<T>(p, si, b, h, i);
  const T* k = k_ptr<T>(p, si, b, hk, 0);
  const T* v = v_ptr<T>(p, si, b, hk, 0);

  // o, l: this block of keys' sums, relative to the running max m; os, ls: the sums of the
  // folded blocks, relative to m_fold, the running max at the last fold
  float qr[kChunks], o[kChunks];
  load_row(qr, q, p.d, lane);
#pragma unroll
  for (int t = 0; t < kChunks; ++t) o[t] = 0.f;
  float m = -INFINITY, l = 0.f, m_fold = -INFINITY;
  CompensatedSum<kChunks> os;
  CompensatedSum<1> ls;
  os.zero();
  ls.zero();
  int pending = 0;  // keys in the block (warp-uniform)
  auto fold = [&]() {
    if (m != m_fold) {  // m only grows: the folded sums move to the new max (none yet: all 0)
      const float f = m_fold == -INFINITY ? 0.f : exp2f(m_fold - m);
      os.scale(f);
      ls.scale(f);
      m_fold = m;
    }
    os.fold(o);
    ls.fold(&l);
    pending = 0;
  };
  int j0, j1;
  pol.key_range(i, i + 1, &j0, &j1);
  j0 = max(j0, 0);
  j1 = min(j1, si.len_k);
  // block-sparse: the keys come in runs of one layout block each, off blocks skipped whole
  for (int j = j0; j < j1;) {
    const int j_end = layout_run_end(pol, j, j1);
    if (!pol.in_layout(i, j)) {
      j = j_end;
      continue;
    }
    for (; j < j_end; ++j) {
      const float x = dot_row(qr, k + int64_t(j) * p.k_row_stride, p.d, lane);
      const float s = logit2_topk(pol, plain, scale_log2, x, i, j);
      if (s == -INFINITY) continue;
      const float m_new = fmaxf(m, s);
      const float alpha = exp2f(m - m_new);
      const float pr = exp2f(s - m_new);
      l = l * alpha + pr;
      const float pd = pr * dropout_factor(p, bh, i, j);
      const T* vr = v + int64_t(j) * p.v_row_stride;
#pragma unroll
      for (int t = 0; t < kChunks; ++t) {
        const int col = lane + 32 * t;
        o[t] = o[t] * alpha + (col < p.d ? pd * to_float(vr[col]) : 0.f);
      }
      m = m_new;
      if (++pending == kFoldTerms) fold();
    }
  }
  fold();
  const float sink = p.sinks != nullptr ? p.sinks[h] : -INFINITY;
  float lse, factor;
  finish_lse(m, ls.value(0), p.sinks != nullptr, sink, 1.f, &lse, &factor);
#pragma unroll
  for (int t = 0; t < kChunks; ++t) o[t] = os.value(t) * factor;
  store_row(o_ptr<T>(p, si, b, h, i), o, p.d, lane);
  if (lane == 0 && p.lse != nullptr) p.lse[lse_index(p, si, b, h, i)] = lse;
}

// Backward preprocess, for every path: softmax_d = dot(dO, O) - dlse per row, zero the dQ scratch
// row (dq_ld floats, when there is one), and d sink_h = -sum_i exp(sink_h - lse_i) dot_i. A row
// whose dO holds a NaN or an inf, or whose q holds a NaN (or an inf, without softcap), gets
// softmax_d = kPoisonedDsum (a NaN):
// the tensor-core dK / dV kernel keeps it from the keys hidden from that row (nonfinite.cuh,
// poisoned rows).
template <typename T>
__global__ void __launch_bounds__(32 * kRowsPerBlock) bwd_preprocess_kernel(const SoftmaxBwdParams p,
                                                                            int dq_ld) {
  __shared__ float sink_part[kRowsPerBlock];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int i = blockIdx.x * kRowsPerBlock + warp;
  const int h = blockIdx.y, b = blockIdx.z;
  const SeqInfo si(p, b);
  float dsink = 0.f;
  if (i < si.len_q) {
    const T* dout = dout_ptr<T>(p, si, b, h, i);
    const T* o = o_ptr<T>(p, si, b, h, i);
    const T* q = q_ptr<T>(p, si, b, h, i);
    float acc = 0.f;
    bool bad = false;
    for (int col = lane; col < p.d; col += 32) {
      const float x = to_float(dout[col]), y = to_float(q[col]);
      acc += x * to_float(o[col]);
      // dO non-finite (x - x is NaN for inf and NaN), or q NaN; an inf in q too without softcap.
      // Under softcap an inf in q is not marked: its logits (+-cap), P and dV stay finite (a
      // known gap: the dK of keys hidden from it)
      bad |= !(x - x == 0.f) || (p.softcap > 0.f ? y != y : !(y - y == 0.f));
    }
    acc = warp_sum(acc);
    if (p.dlse != nullptr) acc -= p.dlse[lse_index(p, si, b, h, i)];
    const int64_t row = scratch_row(p, b, h, i);
    // the mark goes on last: any arithmetic on it would give the canonical NaN instead
    const bool marked = __any_sync(0xffffffffu, bad);
    if (lane == 0) p.softmax_d[row] = marked ? __uint_as_float(kPoisonedDsum) : acc;
    if (p.dq_accum != nullptr) {
      for (int col = lane; col < dq_ld; col += 32) p.dq_accum[row * dq_ld + col] = 0.f;
    }
    if (p.sinks != nullptr) {  // from the row's own dot(dO, O) - dlse, not the mark
      const float lse = p.lse[lse_index(p, si, b, h, i)];
      dsink = -expf(p.sinks[h] - lse) * acc;
    }
  }
  if (p.dsinks != nullptr) {
    if (lane == 0) sink_part[warp] = dsink;
    __syncthreads();
    if (threadIdx.x == 0) {
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < kRowsPerBlock; ++w) s += sink_part[w];
      if (s != 0.f) atomicAdd(p.dsinks + int64_t(b) * p.h + h, s);
    }
  }
}

// dq (dtype, strided) = dq_accum (float32 scratch rows of dq_ld).
template <typename T>
__global__ void __launch_bounds__(32 * kRowsPerBlock) bwd_convert_dq_kernel(const SoftmaxBwdParams p,
                                                                            int dq_ld) {
  const int lane = threadIdx.x & 31;
  const int i = blockIdx.x * kRowsPerBlock + (threadIdx.x >> 5);
  const int h = blockIdx.y, b = blockIdx.z;
  const SeqInfo si(p, b);
  if (i >= si.len_q) return;
  const float* src = p.dq_accum + scratch_row(p, b, h, i) * dq_ld;
  T* dq = dq_ptr<T>(p, si, b, h, i);
  for (int col = lane; col < p.d; col += 32) dq[col] = from_float<T>(src[col]);
}

// dK, dV: warp per key row j of kv head hk, summing over the query heads of its group.
// grid (ceil(Sk / 4), H_k, B).
template <typename T>
__global__ void __launch_bounds__(32 * kRowsPerBlock) bwd_dkdv_kernel(const SoftmaxBwdParams p) {
  const int lane = threadIdx.x & 31;
  const int j = blockIdx.x * kRowsPerBlock + (threadIdx.x >> 5);
  const int hk = blockIdx.y, b = blockIdx.z;
  const SeqInfo si(p, b);
  const int rows_store = p.cu_seqlens_k != nullptr ? si.len_k : p.sk;
  if (j >= rows_store) return;
  const int group = p.h / p.h_k;
  // dk, dv: this block of queries' sums; dks, dvs: the folded blocks'
  float kr[kChunks], vr[kChunks], dk[kChunks], dv[kChunks];
#pragma unroll
  for (int t = 0; t < kChunks; ++t) dk[t] = dv[t] = 0.f;
  CompensatedSum<kChunks> dks, dvs;
  dks.zero();
  dvs.zero();
  int pending = 0;  // queries in the block (warp-uniform)
  if (j < si.len_k) {
    const T* k = k_ptr<T>(p, si, b, hk, j);
    const T* v = v_ptr<T>(p, si, b, hk, j);
    load_row(kr, k, p.d, lane);
    load_row(vr, v, p.d, lane);
    for (int gi = 0; gi < group; ++gi) {
      const int h = hk * group + gi;
      const Policy pol(p, si, b, h);
      const bool plain = policy_is_plain(pol);
      const int bh = b * p.h + h;
      // spelled out rather than q_ptr() / dout_ptr(): through the helpers nvcc schedules this
      // loop differently
      const T* q = static_cast<const T*>(p.q) +
          si.q_offset(p, b, h, 0, p.q_batch_stride, p.q_head_stride, p.q_row_stride);
      const T* dout = static_cast<const T*>(p.dout) +
          si.q_offset(p, b, h, 0, p.do_batch_stride, p.do_head_stride, p.do_row_stride);
      int i0, i1;
      pol.query_range(j, j + 1, &i0, &i1);
      i0 = max(i0, 0);
      i1 = min(i1, si.len_q);
      // block-sparse: the queries come in runs of one layout block each, off blocks skipped whole
      for (int i = i0; i < i1;) {
        const int i_end = layout_run_end(pol, i, i1);
        if (!pol.in_layout(i, j)) {
          i = i_end;
          continue;
        }
        for (; i < i_end; ++i) {
          const bool ok = plain ? pol.in_window(i, j) : pol.allowed(i, j);
          if (!ok) continue;
          const T* qi = q + int64_t(i) * p.q_row_stride;
          const T* doi = dout + int64_t(i) * p.do_row_stride;
          // the logit's q.k as the forward and the top-k threshold pass compute it (dot_row's
          // products commute: k q here, q k there)
          const float x = dot_row(kr, qi, p.d, lane);
          const float dp = dot_row(vr, doi, p.d, lane);
          const BwdPoint bp = bwd_point<true>(pol, plain, false, p.scale, x, dp,
                                        lse_to_log2(p.lse[lse_index(p, si, b, h, i)]),
                                        p.softmax_d[scratch_row(p, b, h, i)],
                                        dropout_factor(p, bh, i, j), i, j);
          // a zero term adds nothing, not 0 x a NaN / inf of its q or dO row: a pair top-k drops
          // or whose P is 0, and dS = 0 alone at softcap's zero derivative (an inf in q), where
          // dV still takes P dO (warp-uniform: bp comes from warp sums)
          if (bp.pd != 0.f || bp.dx != 0.f) {
            const bool with_dv = bp.pd != 0.f, with_dk = bp.dx != 0.f;
#pragma unroll
            for (int t = 0; t < kChunks; ++t) {
              const int col = lane + 32 * t;
              if (col < p.d) {
                if (with_dv) dv[t] += bp.pd * to_float(doi[col]);
                if (with_dk) dk[t] += bp.dx * to_float(qi[col]);
              }
            }
          }
          if (++pending == kFoldTerms) {
            dks.fold(dk);
            dvs.fold(dv);
            pending = 0;
          }
        }
      }
    }
  }
  dks.fold(dk);
  dvs.fold(dv);
#pragma unroll
  for (int t = 0; t < kChunks; ++t) {
    dk[t] = dks.value(t);
    dv[t] = dvs.value(t);
  }
  T* dkp = dk_ptr<T>(p, si, b, hk, j);
  T* dvp = dv_ptr<T>(p, si, b, hk, j);
  store_row(dkp, dk, p.d, lane);
  store_row(dvp, dv, p.d, lane);
}

// dQ (and the bias gradient): warp per query row. grid (ceil(Sq / 4), H, B).
template <typename T>
__global__ void __launch_bounds__(32 * kRowsPerBlock) bwd_dq_kernel(const SoftmaxBwdParams p) {
  const int lane = threadIdx.x & 31;
  const int i = blockIdx.x * kRowsPerBlock + (threadIdx.x >> 5);
  const int h = blockIdx.y, b = blockIdx.z;
  const SeqInfo si(p, b);
  if (i >= si.len_q) return;
  const Policy pol(p, si, b, h);
  const bool plain = policy_is_plain(pol);
  const int hk = h / (p.h / p.h_k);
  const int bh = b * p.h + h;
  const T* q = q_ptr<T>(p, si, b, h, i);
  const T* dout = dout_ptr<T>(p, si, b, h, i);
  // spelled out rather than k_ptr() / v_ptr(): through the helpers nvcc schedules the key loop
  // differently
  const T* k = static_cast<const T*>(p.k) + si.k_offset(p, b, hk, 0, p.k_batch_stride, p.k_head_stride, p.k_row_stride);
  const T* v = static_cast<const T*>(p.v) + si.k_offset(p, b, hk, 0, p.v_batch_stride, p.v_head_stride, p.v_row_stride);
  // dq: this block of keys' sum; dqs: the folded blocks'
  float qr[kChunks], dor[kChunks], dq[kChunks];
  load_row(qr, q, p.d, lane);
  load_row(dor, dout, p.d, lane);
#pragma unroll
  for (int t = 0; t < kChunks; ++t) dq[t] = 0.f;
  CompensatedSum<kChunks> dqs;
  dqs.zero();
  int pending = 0;  // keys in the block (warp-uniform)
  const float lse2 = lse_to_log2(p.lse[lse_index(p, si, b, h, i)]);
  const float dsum = p.softmax_d[scratch_row(p, b, h, i)];
  float* dbias = p.dbias != nullptr ? p.dbias + int64_t(b) * p.dbias_batch_stride +
                                          int64_t(h) * p.dbias_head_stride + int64_t(i) * p.dbias_row_stride
                                    : nullptr;
  int j0, j1;
  pol.key_range(i, i + 1, &j0, &j1);
  j0 = max(j0, 0);
  j1 = min(j1, si.len_k);
  // block-sparse: the keys come in runs of one layout block each, off blocks skipped whole
  for (int j = j0; j < j1;) {
    const int j_end = layout_run_end(pol, j, j1);
    if (!pol.in_layout(i, j)) {
      j = j_end;
      continue;
    }
    for (; j < j_end; ++j) {
      const bool ok = plain ? pol.in_window(i, j) : pol.allowed(i, j);
      if (!ok) continue;
      const T* kj = k + int64_t(j) * p.k_row_stride;
      const float x = dot_row(qr, kj, p.d, lane);
      const float dp = dot_row(dor, v + int64_t(j) * p.v_row_stride, p.d, lane);
      const BwdPoint bp =
          bwd_point<true>(pol, plain, false, p.scale, x, dp, lse2, dsum, dropout_factor(p, bh, i, j), i, j);
      if (bp.dx != 0.f) {  // as in bwd_dkdv_kernel: a zero term adds nothing, not 0 x NaN / inf
#pragma unroll
        for (int t = 0; t < kChunks; ++t) {
          const int col = lane + 32 * t;
          if (col < p.d) dq[t] += bp.dx * to_float(kj[col]);
        }
      }
      if (dbias != nullptr && lane == 0) {
        if (p.dbias_row_stride == 0) {
          if (bp.ds != 0.f) atomicAdd(dbias + j, bp.ds);
        } else {
          dbias[j] = bp.ds;
        }
      }
      if (++pending == kFoldTerms) {
        dqs.fold(dq);
        pending = 0;
      }
    }
  }
  dqs.fold(dq);
#pragma unroll
  for (int t = 0; t < kChunks; ++t) dq[t] = dqs.value(t);
  store_row(dq_ptr<T>(p, si, b, h, i), dq, p.d, lane);
}

}  // namespace simt
}  // namespace attn
