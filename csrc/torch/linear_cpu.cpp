// CPU registration of the linear family: attention_ext::linear_fwd / linear_bwd / linear_step on
// the CPU kernels (csrc/linear/cpu), float64 included.
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "linear/cpu/entry.h"
#include "torch/linear_binding.h"

namespace {

using at::Tensor;

attn::DType linear_dtype(const Tensor& q) {
  switch (q.scalar_type()) {
    case at::kHalf: return attn::DType::kF16;
    case at::kBFloat16: return attn::DType::kBF16;
    case at::kDouble: return attn::DType::kF64;
    default: return attn::DType::kF32;
  }
}

std::tuple<Tensor, Tensor, Tensor, Tensor> linear_fwd_cpu(const Tensor& q, const Tensor& k, const Tensor& v
                                                          ATTN_LINEAR_OPTIONS_PARAMS, bool keep_residual) {
  const attn::api::LinearOptions o = ATTN_LINEAR_MAKE_OPTIONS();
  attn::api::check_linear_inputs(q, k, v, o);
  auto [out, den, state, res] = attn::api::alloc_linear_outputs(q, v, o, keep_residual);
  if (q.numel() == 0 || v.numel() == 0 || q.size(2) == 0) return {out, den, state, res};
  const attn::DType dt = linear_dtype(q);
  if (dt == attn::DType::kF64) {
    attn::cpu::linear_fwd_stub<double>(attn::api::make_linear_params<double>(q, k, v, out, den, state, o, res), dt);
  } else {
    attn::cpu::linear_fwd_stub<float>(attn::api::make_linear_params<float>(q, k, v, out, den, state, o, res), dt);
  }
  return {out, den, state, res};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> linear_bwd_cpu(const Tensor& dout,
                                                                  const std::optional<Tensor>& dfinal_state,
                                                                  const Tensor& q, const Tensor& k, const Tensor& v,
                                                                  const Tensor& out, const Tensor& den
                                                                      ATTN_LINEAR_OPTIONS_PARAMS,
                                                                  const std::optional<Tensor>& out_residual) {
  const attn::api::LinearOptions o = ATTN_LINEAR_MAKE_OPTIONS();
  attn::api::check_linear_inputs(q, k, v, o);
  attn::api::check_linear_bwd_inputs(dout, dfinal_state, q, v, out, den, out_residual, o);
  attn::api::LinearGrads g = attn::api::alloc_linear_grads(q, k, v, o);
  if (q.numel() == 0 || v.numel() == 0 || q.size(2) == 0) {
    if (o.initial_state.has_value() && dfinal_state.has_value()) {
      g.dinit_state.copy_(*dfinal_state);  // an empty sequence passes the state through
    }
    return {g.dq, g.dk, g.dv, g.ddecay, g.dinit_state};
  }
  const attn::DType dt = linear_dtype(q);
  const Tensor res = attn::api::residual_as_out(out, out_residual);
  if (dt == attn::DType::kF64) {
    attn::cpu::linear_bwd_stub<double>(
        attn::api::make_linear_bwd_params<double>(dout, dfinal_state, q, k, v, out, den, res, o, g), dt);
  } else {
    attn::cpu::linear_bwd_stub<float>(
        attn::api::make_linear_bwd_params<float>(dout, dfinal_state, q, k, v, out, den, res, o, g), dt);
  }
  return {g.dq, g.dk, g.dv, g.ddecay, g.dinit_state};
}

// out (B, H, T, Dv) in q's dtype; state and normalizer advanced in place
Tensor linear_step_cpu(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& state,
                       const std::optional<Tensor>& normalizer, const std::optional<Tensor>& decay,
                       int64_t feature_map, double eps, double scale) {
  attn::api::check_linear_step_inputs(q, k, v, state, normalizer, decay, feature_map, eps, scale);
  Tensor out = at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
  if (out.numel() == 0) return out;
  const attn::DType dt = linear_dtype(q);
  if (dt == attn::DType::kF64) {
    attn::cpu::linear_step_stub<double>(
        attn::api::make_linear_step_params<double>(q, k, v, out, state, normalizer, decay, feature_map, eps, scale), dt);
  } else {
    attn::cpu::linear_step_stub<float>(
        attn::api::make_linear_step_params<float>(q, k, v, out, state, normalizer, decay, feature_map, eps, scale), dt);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(attention_ext, CPU, m) {
  m.impl("linear_fwd", &linear_fwd_cpu);
  m.impl("linear_bwd", &linear_bwd_cpu);
  m.impl("linear_step", &linear_step_cpu);
}
