// The torch side of the fused softmax attention op, shared by the CPU and CUDA registrations:
// input checks with clear messages, output allocation, and tensors -> attn::FwdParams /
// attn::BwdParams. Kernels never see a tensor.
//
// Op schema (registered in attention.cpp):
//   fwd(q, k, v, bias?, alibi_slopes?, sinks?, seqlens_k?, cu_seqlens_q?, cu_seqlens_k?,
//       max_seqlen_q, max_seqlen_k, scale, softcap, window_left, window_right, bottom_right,
//       dropout_p, seed, offset) -> (out, lse)
//   bwd(dout, q, k, v, out, lse, <the same options>, bias_grad, deterministic, dlse?)
//       -> (dq, dk, dv, dbias, dsinks)
// q (B, H, Sq, D), k / v (B, H_k, Sk, D) through strides (head-dim stride 1); varlen packs are
// (1, H, total, D) with cu_seqlens. out / dq / dk / dv keep their input's memory layout.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "../common/params.h"

namespace attn {
namespace api {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// The options every entry point takes, after the tensors.
struct Options {
  OptTensor bias, alibi_slopes, sinks, seqlens_k, cu_seqlens_q, cu_seqlens_k;
  int64_t max_seqlen_q, max_seqlen_k;
  double scale, softcap;
  int64_t window_left, window_right;
  bool bottom_right;
  double dropout_p;
  int64_t seed, offset;
};

DType dtype_of(const Tensor& t);

// The dtype of the float side tensors (lse, an additive bias, ALiBi slopes, sinks and their
// gradients): float64 for float64 inputs, else float32 (attn::FwdParamsT's Acc).
at::ScalarType acc_dtype(const Tensor& q);

// Checks q / k / v and the options; throws c10::Error (RuntimeError / ValueError in Python)
// naming the bad argument.
void check_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const Options& o);

// num_splits of the forward: 0 = the split-KV heuristic, N >= 1 = N splits (1 = none; CUDA
// clamps to its maximum, the CPU ignores it).
void check_num_splits(int64_t num_splits);

// An uninitialized (B, H, S, D) tensor with the same memory layout as `like`: (B, S, H, D)
// storage when `like` has heads inside rows, else contiguous (B, H, S, D).
Tensor empty_like_layout(const Tensor& like);

// (B, H, Sq) lse of acc_dtype(q) (varlen: (1, H, total_q)).
Tensor empty_lse(const Tensor& q);

// Acc = float, or double for float64 inputs (instantiated for both).
template <typename Acc>
FwdParamsT<Acc> make_fwd_params(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                const Tensor& lse, const Options& o);

// Outputs of the backward, allocated: dq, dk, dv like q, k, v; dbias (B, H, Sq_b, Sk) zeros
// when bias_grad; dsinks (B, H) when sinks are given (both acc_dtype(q)); else empty tensors.
struct Grads {
  Tensor dq, dk, dv, dbias, dsinks;
};
Grads alloc_grads(const Tensor& q, const Tensor& k, const Tensor& v, const Options& o, bool bias_grad);

// Checks the backward's extra inputs (dout, out, lse and the optional dlse) against q.
void check_bwd_inputs(const Tensor& dout, const Tensor& q, const Tensor& out, const Tensor& lse,
                      const OptTensor& dlse);

template <typename Acc>
BwdParamsT<Acc> make_bwd_params(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& out, const Tensor& lse, const OptTensor& dlse, const Options& o,
                                Grads& g, bool deterministic);

}  // namespace api
}  // namespace attn
