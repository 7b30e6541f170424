// Meta kernels of the linear ops (linear_fwd, linear_bwd, linear_step) and the check-only op
// linear_check: the ops' own C++ input checks (linear_binding.cpp, sizes as SymInts), then outputs
// of the right shapes, dtypes and layouts. torch.compile's fake tensors and meta tensors run the
// Meta kernels, so an input error reads the same traced, on meta tensors and in eager mode; the
// Python reference fallback runs linear_check, on any device. Under a fake tensor's kernel call
// every tensor is on the meta device, so the device rules pass (the kernels check them).
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "torch/linear_binding.h"
#include "torch/tensor_rules.h"

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// the final state's (B or the varlen sequences, H, M, Dv (+1 with the normalizer)) shape
std::vector<c10::SymInt> state_shape(const Tensor& q, const Tensor& v, const attn::api::LinearOptions& o) {
  const c10::SymInt nb = o.cu_seqlens.has_value() ? o.cu_seqlens->sym_numel() - 1 : q.sym_size(0);
  return {nb, q.sym_size(1), q.sym_size(3), v.sym_size(3) + (o.normalize ? 1 : 0)};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> linear_fwd_meta(const Tensor& q, const Tensor& k,
                                                           const Tensor& v ATTN_LINEAR_OPTIONS_PARAMS,
                                                           bool keep_residual) {
  const attn::api::LinearOptions o = ATTN_LINEAR_MAKE_OPTIONS();
  attn::api::check_linear_inputs(q, k, v, o);
  const auto acc = q.options().dtype(attn::api::acc_dtype(q));
  Tensor out = attn::api::empty_like_layout(q, q.sym_size(1), v.sym_size(3), q.options());
  Tensor res = attn::api::keep_residual_for(q, o, keep_residual) ? at::empty_like(out) : at::empty({0}, q.options());
  return {out, at::empty_symint({q.sym_size(0), q.sym_size(1), q.sym_size(2)}, acc),
          at::empty_symint(state_shape(q, v, o), acc), res};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> linear_bwd_meta(const Tensor& dout, const OptTensor& dfinal_state,
                                                                   const Tensor& q, const Tensor& k, const Tensor& v,
                                                                   const Tensor& out,
                                                                   const Tensor& den ATTN_LINEAR_OPTIONS_PARAMS,
                                                                   const OptTensor& out_residual) {
  const attn::api::LinearOptions o = ATTN_LINEAR_MAKE_OPTIONS();
  attn::api::check_linear_inputs(q, k, v, o);
  attn::api::check_linear_bwd_inputs(dout, dfinal_state, q, v, out, den, out_residual, o);
  const auto acc = q.options().dtype(attn::api::acc_dtype(q));
  // alloc_linear_grads' shapes: ddecay like decay, dinit_state like initial_state, else (0)
  Tensor ddecay = o.decay.has_value() ? at::empty_symint(o.decay->sym_sizes(), acc) : at::empty({0}, acc);
  Tensor dinit = o.initial_state.has_value() ? at::empty_symint(state_shape(q, v, o), acc) : at::empty({0}, acc);
  return {attn::api::empty_like_layout(q), attn::api::empty_like_layout(k), attn::api::empty_like_layout(v), ddecay, dinit};
}

Tensor linear_step_meta(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& state, const OptTensor& normalizer,
                        const OptTensor& decay, int64_t feature_map, double eps, double scale) {
  attn::api::check_linear_step_inputs(q, k, v, state, normalizer, decay, feature_map, eps, scale);
  return at::empty_symint({q.sym_size(0), q.sym_size(1), q.sym_size(2), v.sym_size(3)}, q.options());
}

void linear_check(const Tensor& q, const Tensor& k, const Tensor& v ATTN_LINEAR_OPTIONS_PARAMS) {
  attn::api::check_linear_inputs(q, k, v, ATTN_LINEAR_MAKE_OPTIONS());
}

}  // namespace

TORCH_LIBRARY_IMPL(attention_ext, Meta, m) {
  m.impl("linear_fwd", &linear_fwd_meta);
  m.impl("linear_bwd", &linear_bwd_meta);
  m.impl("linear_step", &linear_step_meta);
}

TORCH_LIBRARY_IMPL(attention_ext, CompositeExplicitAutograd, m) { m.impl("linear_check", &linear_check); }
