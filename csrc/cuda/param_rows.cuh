// Where rows live in the tensors a SoftmaxParams / SoftmaxBwdParams names (common/softmax_params.h)
// and in the CUDA backward's float32 scratch: shared by the kernels that read those params, the
// softmax family's and top-k's threshold pass (sparse).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/policy.h"
#include "common/softmax_params.h"

namespace attn {

// lse element (b, h, i): (B, H, Sq) float32 through its batch/head strides; varlen: one
// (1, H, total_q) pack indexed by the sequence's first row (batch stride unused).
__device__ __forceinline__ int64_t lse_index(const SoftmaxParams& p, const SeqInfo& si, int b, int h,
                                             int i) {
  return si.batch_off(p, b, p.lse_batch_stride) + int64_t(h) * p.lse_head_stride + si.row_q + i;
}

// Row of the CUDA backward's float32 scratch (softmax_d, dq_accum): always the padded
// (B, H, Sq) index, so varlen needs B * H * max_seqlen_q rows, independent of the pack.
__device__ __forceinline__ int64_t scratch_row(const SoftmaxParams& p, int b, int h, int i) {
  return (int64_t(b) * p.h + h) * p.sq + i;
}

// Element pointers into the tensors of sequence b, by (head, sequence-local row): query-side
// tensors (q, o, dout, dq) take a query head h and start at SeqInfo::row_q, key-side ones (k, v,
// dk, dv) a kv head hk and start at row_k.
template <typename T>
__device__ __forceinline__ const T* q_ptr(const SoftmaxParams& p, const SeqInfo& si, int b, int h, int row) {
  return static_cast<const T*>(p.q) + si.q_offset(p, b, h, row, p.q_batch_stride, p.q_head_stride, p.q_row_stride);
}
template <typename T>
__device__ __forceinline__ T* o_ptr(const SoftmaxParams& p, const SeqInfo& si, int b, int h, int row) {
  return static_cast<T*>(p.o) + si.q_offset(p, b, h, row, p.o_batch_stride, p.o_head_stride, p.o_row_stride);
}
template <typename T>
__device__ __forceinline__ const T* dout_ptr(const SoftmaxBwdParams& p, const SeqInfo& si, int b, int h, int row) {
  return static_cast<const T*>(p.dout) +
         si.q_offset(p, b, h, row, p.do_batch_stride, p.do_head_stride, p.do_row_stride);
}
template <typename T>
__device__ __forceinline__ T* dq_ptr(const SoftmaxBwdParams& p, const SeqInfo& si, int b, int h, int row) {
  return static_cast<T*>(p.dq) + si.q_offset(p, b, h, row, p.dq_batch_stride, p.dq_head_stride, p.dq_row_stride);
}
template <typename T>
__device__ __forceinline__ const T* k_ptr(const SoftmaxParams& p, const SeqInfo& si, int b, int hk, int row) {
  return static_cast<const T*>(p.k) + si.k_offset(p, b, hk, row, p.k_batch_stride, p.k_head_stride, p.k_row_stride);
}
template <typename T>
__device__ __forceinline__ const T* v_ptr(const SoftmaxParams& p, const SeqInfo& si, int b, int hk, int row) {
  return static_cast<const T*>(p.v) + si.k_offset(p, b, hk, row, p.v_batch_stride, p.v_head_stride, p.v_row_stride);
}
template <typename T>
__device__ __forceinline__ T* dk_ptr(const SoftmaxBwdParams& p, const SeqInfo& si, int b, int hk, int row) {
  return static_cast<T*>(p.dk) + si.k_offset(p, b, hk, row, p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride);
}
template <typename T>
__device__ __forceinline__ T* dv_ptr(const SoftmaxBwdParams& p, const SeqInfo& si, int b, int hk, int row) {
  return static_cast<T*>(p.dv) + si.k_offset(p, b, hk, row, p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride);
}

}  // namespace attn
