// What the two CUDA decode kernels share: the key cursor over a contiguous or paged cache, the
// split of a sequence's keys, and the write of a merged row (to the output, or to the split
// scratch the combine kernel reads). kernel.cuh is the CUDA-core kernel (every dtype), mma_kernel.cuh
// the tensor-core one (fp16 / bf16).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "common/decode_params.h"
#include "common/policy.h"
#include "cuda/convert.cuh"

namespace attn {
namespace decode_cuda {

// Steps through keys j, j + step, ... of (b, hk) in KvRows' address space: one division at the
// start, then page crossings by subtraction (about step / page_size of them per step). sr: the
// key's row of a per-token descale (KvRows::scale_row).
struct KvCursor {
  int64_t ko, vo;  // current offsets
  int64_t sr;      // current descale row
  int pi, in;      // paged: page index in the block table and row inside the page
  __device__ __forceinline__ void start(const KvRows& kv, int j) {
    const int r = kv.pad + j;
    if (kv.pages == nullptr) {
      pi = 0;
      in = 0;
      ko = kv.k_head + int64_t(r) * kv.k_rs;
      vo = kv.v_head + int64_t(r) * kv.v_rs;
      sr = kv.row0 + r;
    } else {
      pi = r / kv.page;
      in = r % kv.page;
      set_page(kv);
    }
  }
  __device__ __forceinline__ void set_page(const KvRows& kv) {
    const int64_t pg = kv.page_of(pi * kv.page);
    ko = pg * kv.k_ps + kv.k_head + int64_t(in) * kv.k_rs;
    vo = pg * kv.v_ps + kv.v_head + int64_t(in) * kv.v_rs;
    sr = pg * kv.page + in;
  }
  __device__ __forceinline__ void advance(const KvRows& kv, int step) {
    if (kv.pages == nullptr) {
      ko += int64_t(step) * kv.k_rs;
      vo += int64_t(step) * kv.v_rs;
      sr += step;
      return;
    }
    in += step;
    while (in >= kv.page) {
      in -= kv.page;
      ++pi;
    }
    set_page(kv);
  }
};

// This split's keys [*a, *e) of (b, hk): the keys any row may see (the window does not depend on
// the head), cut into `splits` runs of a multiple of `step` keys (the keys a CTA takes per
// iteration).
__device__ __forceinline__ void split_range(const DecodeParams& p, const SeqInfo& si, int b, int h0, int split,
                                            int splits, int step, int* a, int* e) {
  const PolicyT<float> pol(p, si, b, h0);
  int klo, khi;
  pol.key_range(0, p.sq, &klo, &khi);
  klo = imax(klo, 0);
  khi = imin(khi, si.len_k);
  const int n = imax(khi - klo, 0);
  const int per = ((n + splits - 1) / splits + step - 1) / step * step;
  *a = imin(khi, klo + split * per);
  *e = imin(khi, *a + per);
  if (*e < *a) *e = *a;
}

// Column c of row (b, h, i) from the CTA's merged max mr, sum lr and unnormalized o. With split
// scratch (part_o != nullptr): the split's partial, normalized by its own sum, without the sink
// (the combine adds it). Otherwise out / lse, the sink joining the denominator as on the CPU.
// lse is written by the thread of column 0.
template <typename E>
__device__ __forceinline__ void finish_elem(const DecodeParams& p, int splits, int split, float* part_o,
                                            float* part_lse, int b, int h, int i, int c, float mr, float lr,
                                            float o) {
  constexpr float kNegInf = -INFINITY;
  const int64_t row_id = (int64_t(b) * p.h + h) * p.sq + i;
  if (part_o != nullptr) {
    const bool empty = !(lr > 0.f) && !(lr != lr);
    part_o[(row_id * splits + split) * p.d + c] = empty ? 0.f : o / lr;
    if (c == 0) part_lse[row_id * splits + split] = empty ? kNegInf : mr + logf(lr);
    return;
  }
  float alpha = 1.f;
  const float sink = p.sinks != nullptr ? p.sinks[h] : kNegInf;
  if (sink > mr) {  // the sink joins the denominator only; rescale to its max
    alpha = mr == kNegInf ? 0.f : expf(mr - sink);
    lr = lr * alpha + 1.f;
    mr = sink;
  } else if (p.sinks != nullptr) {
    lr += expf(sink - mr);
  }
  const bool empty = !(lr > 0.f) && !(lr != lr);
  const float inv = empty ? 0.f : alpha / lr;
  E* orow = static_cast<E*>(p.o) + int64_t(b) * p.o_batch_stride + int64_t(h) * p.o_head_stride +
            int64_t(i) * p.o_row_stride;
  orow[c] = from_float<E>(o * inv);
  if (c == 0) {
    p.lse[int64_t(b) * p.lse_batch_stride + int64_t(h) * p.lse_head_stride + i] = empty ? kNegInf : mr + logf(lr);
  }
}

}  // namespace decode_cuda
}  // namespace attn
