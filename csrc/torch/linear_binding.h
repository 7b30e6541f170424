// The torch side of the linear attention op (the `linear` family), shared by its bindings:
// input checks with clear messages, output allocation, tensors -> attn::LinearParams.
//
// Op schema (registered in library.cpp):
//   linear_fwd(q, k, v, <options>, keep_residual=False) -> (out, den, final_state, out_residual)
//   linear_bwd(dout, dfinal_state?, q, k, v, out, den, <options>, out_residual?=None)
//       -> (dq, dk, dv, ddecay, dinit_state)
// out_residual: out's rounding residual (LinearParamsT::o_res), like out where keep_residual_for
// holds, else an empty tensor; the backward reads it when given.
//   linear_step(q, k, v, state!, normalizer!?, decay?, feature_map, eps, scale) -> out
//   <options> = decay?, initial_state?, key_mask?, cu_seqlens?, max_seqlen, feature_map, causal,
//       normalize, eps, scale
// q (B, H, S, M), k (B, H_k, S, M), v (B, H_k, S, Dv) through strides (last dim stride 1); varlen
// packs are (1, H, total, .) with cu_seqlens. common/linear_params.h states the math.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <type_traits>

#include "common/linear_params.h"

// The linear ops' options after their tensors, in schema order: the one list. X(schema type, C++
// parameter type, name); the schema text, the C++ parameters and arguments of every binding, and
// LinearOptions are generated from it (as softmax_binding.h's ATTN_SOFTMAX_OPTIONS).
#define ATTN_LINEAR_OPTIONS(X)                                                                       \
  X("Tensor?", const std::optional<at::Tensor>&, decay)                                              \
  X("Tensor?", const std::optional<at::Tensor>&, initial_state)                                      \
  X("Tensor?", const std::optional<at::Tensor>&, key_mask)                                           \
  X("Tensor?", const std::optional<at::Tensor>&, cu_seqlens) X("int", int64_t, max_seqlen)           \
  X("int", int64_t, feature_map) X("bool", bool, causal) X("bool", bool, normalize)                  \
  X("float", double, eps) X("float", double, scale)

// Each with a leading comma, to follow a binding's tensors (see ATTN_SOFTMAX_OPTIONS_SCHEMA).
#define ATTN_LINEAR_OPTION_SCHEMA_(s, t, n) ", " s " " #n
#define ATTN_LINEAR_OPTION_PARAM_(s, t, n) , t n
#define ATTN_LINEAR_OPTION_ARG_(s, t, n) n,
#define ATTN_LINEAR_OPTION_FIELD_(s, t, n) std::decay_t<t> n;
#define ATTN_LINEAR_OPTIONS_SCHEMA ATTN_LINEAR_OPTIONS(ATTN_LINEAR_OPTION_SCHEMA_)
#define ATTN_LINEAR_OPTIONS_PARAMS ATTN_LINEAR_OPTIONS(ATTN_LINEAR_OPTION_PARAM_)
// The LinearOptions of a kernel that took ATTN_LINEAR_OPTIONS_PARAMS.
#define ATTN_LINEAR_MAKE_OPTIONS() ::attn::api::LinearOptions{ATTN_LINEAR_OPTIONS(ATTN_LINEAR_OPTION_ARG_)}

namespace attn {
namespace api {

struct LinearOptions {
  ATTN_LINEAR_OPTIONS(ATTN_LINEAR_OPTION_FIELD_)
};

// Checks q / k / v and the options; throws c10::Error naming the bad argument.
void check_linear_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const LinearOptions& o);

// Checks the backward's extra inputs against q, v and the options.
void check_linear_bwd_inputs(const at::Tensor& dout, const std::optional<at::Tensor>& dfinal_state,
                             const at::Tensor& q, const at::Tensor& v, const at::Tensor& out, const at::Tensor& den,
                             const std::optional<at::Tensor>& out_residual, const LinearOptions& o);

// Whether linear_fwd(keep_residual=True) keeps out's rounding residual (LinearParamsT::o_res): a
// normalized call in a 16-bit dtype (float32 / float64 outputs are the kernels' own precision;
// without the normalizer the backward never reads out). The same on every device, as the Meta
// kernel (which sees meta tensors only) must state it too; the CUDA binding refuses the calls
// its tensor-core kernels take (check_cuda_residual), and linear/ops.py asks for none there.
bool keep_residual_for(const at::Tensor& q, const LinearOptions& o, bool keep_residual);

// The CUDA binding's rule: a kept residual needs M > kLinearTensorCoreMaxFeatures (the SIMT
// kernels; the tensor-core kernels keep none: LinearParamsT::o_res). Throws c10::ValueError.
void check_cuda_residual(const at::Tensor& q, const LinearOptions& o, bool keep_residual);

// out (q's layout, v's width), den (B, H, S), final_state (B_seq, H, M, Dv + normalize) (den and
// the state in float32, float64 for float64 inputs) and out_residual (like out where
// keep_residual_for(q, o, keep_residual) holds, else empty).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> alloc_linear_outputs(const at::Tensor& q,
                                                                               const at::Tensor& v,
                                                                               const LinearOptions& o,
                                                                               bool keep_residual);

template <typename Acc>
LinearParamsT<Acc> make_linear_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& out, const at::Tensor& den, const at::Tensor& final_state,
                                      const LinearOptions& o, const at::Tensor& out_residual = at::Tensor());

struct LinearGrads {
  at::Tensor dq, dk, dv, ddecay, dinit_state;
};
// dq, dk, dv like q, k, v; ddecay like decay and dinit_state like initial_state when given (else
// empty tensors); zeros where no kernel writes (every row of an empty call).
LinearGrads alloc_linear_grads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const LinearOptions& o);

// linear_bwd's out_residual in out's strides (the kernels index both alike): itself, a copy when
// its strides differ, or an undefined tensor when none was given (or an empty one).
at::Tensor residual_as_out(const at::Tensor& out, const std::optional<at::Tensor>& out_residual);

// out_residual: residual_as_out's (undefined = none).
template <typename Acc>
LinearBwdParamsT<Acc> make_linear_bwd_params(const at::Tensor& dout, const std::optional<at::Tensor>& dfinal_state,
                                             const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             const at::Tensor& out, const at::Tensor& den,
                                             const at::Tensor& out_residual, const LinearOptions& o,
                                             LinearGrads& g);

// linear_step: q (B, H, T, M), k (B, H_k, T, M), v (B, H_k, T, Dv) (last dims contiguous), state
// (B, H, M, Dv) and normalizer (B, H, M) in float32 (float64 for float64 inputs), updated in
// place, decay (B, H, T) or (B, H, T, M) (GLA's gate per feature). Checks throw c10::Error naming
// the bad argument.
void check_linear_step_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& state,
                              const std::optional<at::Tensor>& normalizer, const std::optional<at::Tensor>& decay,
                              int64_t feature_map, double eps, double scale);

template <typename Acc>
LinearStepParamsT<Acc> make_linear_step_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               const at::Tensor& out, at::Tensor& state,
                                               const std::optional<at::Tensor>& normalizer,
                                               const std::optional<at::Tensor>& decay, int64_t feature_map,
                                               double eps, double scale);

}  // namespace api
}  // namespace attn
