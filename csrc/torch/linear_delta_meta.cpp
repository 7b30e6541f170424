// Meta kernels of the delta-rule ops and the check-only op delta_check: the ops' own C++ input
// checks (linear_delta_binding.cpp, sizes as SymInts), then outputs of the right shapes, dtypes and
// layouts, as linear_meta.cpp does for linear attention.
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "torch/linear_delta_binding.h"

namespace {

using at::Tensor;

std::tuple<Tensor, Tensor, Tensor> delta_fwd_meta(const Tensor& q, const Tensor& k, const Tensor& v,
                                                  const Tensor& beta ATTN_DELTA_OPTIONS_PARAMS, bool checkpoints) {
  const attn::api::DeltaOptions o = ATTN_DELTA_MAKE_OPTIONS();
  attn::api::check_delta_inputs(q, k, v, beta, o);
  auto [out, state] = attn::api::alloc_delta_outputs(q, v, o);
  return {out, state, attn::api::alloc_delta_checkpoints(q, v, o, checkpoints)};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> delta_bwd_meta(const Tensor& dout,
                                                                          const std::optional<Tensor>& dfinal_state,
                                                                          const Tensor& q, const Tensor& k,
                                                                          const Tensor& v,
                                                                          const Tensor& beta ATTN_DELTA_OPTIONS_PARAMS,
                                                                          const std::optional<Tensor>& checkpoints) {
  const attn::api::DeltaOptions o = ATTN_DELTA_MAKE_OPTIONS();
  attn::api::check_delta_inputs(q, k, v, beta, o);
  attn::api::check_delta_bwd_inputs(dout, dfinal_state, q, v, o);
  attn::api::check_delta_checkpoints(checkpoints, q, v, o);
  attn::api::DeltaGrads g = attn::api::alloc_delta_grads(q, k, v, beta, o);
  return {g.dq, g.dk, g.dv, g.dbeta, g.dgate, g.dinit_state};
}

Tensor delta_step_meta(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta, Tensor& state,
                       const std::optional<Tensor>& gate, double scale, bool qk_l2norm) {
  const attn::api::DeltaOptions o{gate, state, std::nullopt, scale, qk_l2norm, false};
  attn::api::check_delta_step_inputs(q, k, v, beta, state, o);
  return attn::api::alloc_delta_out(q, v);
}

void delta_check(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta ATTN_DELTA_OPTIONS_PARAMS) {
  attn::api::check_delta_inputs(q, k, v, beta, ATTN_DELTA_MAKE_OPTIONS());
}

}  // namespace

TORCH_LIBRARY_IMPL(attention_ext, Meta, m) {
  m.impl("delta_fwd", &delta_fwd_meta);
  m.impl("delta_bwd", &delta_bwd_meta);
  m.impl("delta_step", &delta_step_meta);
}

TORCH_LIBRARY_IMPL(attention_ext, CompositeExplicitAutograd, m) { m.impl("delta_check", &delta_check); }
