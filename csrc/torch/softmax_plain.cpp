// attention_ext::softmax_fwd_plain: the fused forward with no tensor option but a mask (no lengths,
// ALiBi, sinks, dropout, varlen, block layout or top-k), the call most small models make.
//
// It is attention_ext::softmax_fwd with those options left at their defaults (bias: fwd's, a 4-D bool or
// additive mask), written as a CompositeImplicitAutograd op over fwd: autograd, torch.compile,
// fake tensors and every device take fwd's own registrations, and fwd's checks are the only ones.
// What it saves is the fixed cost of a small call: from Python, 11 arguments are converted instead
// of fwd's 27 (the boxing of each argument was most of a small call's cost:
// benchmarks/results/2026-11-29-figures-from-comments.md; attention_ext._C.softmax_fwd_plain
// skips that conversion altogether),
// and a call with nothing to differentiate goes straight below the Autograd key, which is what
// fwd's Python autograd layer would decide itself after a pytree walk of its arguments. Which
// kernel then runs is the routed forward's rule (route_fwd, softmax_route.cpp).
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>

#include "torch/softmax_binding.h"  // ATTN_SOFTMAX_OPTIONS, Options


namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// A head dim with a stride is copied to unit stride, as attention() does (the kernels read whole
// rows); a symbolic stride (torch.compile) is guarded on.
Tensor unit_head_stride(const Tensor& t) {
  return t.dim() > 0 && t.sym_stride(-1).guard_int(__FILE__, __LINE__) != 1 ? t.contiguous() : t;
}

std::tuple<Tensor, Tensor> fwd_plain(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                     std::optional<double> scale, int64_t window_left, int64_t window_right,
                                     bool bottom_right, c10::string_view layout, int64_t num_splits,
                                     bool deterministic, const OptTensor& bias) {
  const bool bshd = layout == "bshd";
  TORCH_CHECK_VALUE(bshd || layout == "bhsd", "attention_ext: layout must be 'bhsd' or 'bshd', got '", layout, "'");
  TORCH_CHECK_VALUE(q_in.dim() == 4 && k_in.dim() == 4 && v_in.dim() == 4,
                    "attention_ext: q, k, v must be 4-D (", bshd ? "B, S, H, D" : "B, H, S, D", "), got q ",
                    q_in.sym_sizes(), ", k ", k_in.sym_sizes(), ", v ", v_in.sym_sizes());
  // the kernels take (B, H, S, D) through strides: (B, S, H, D) is a view away
  const auto view = [&](const Tensor& t) { return unit_head_stride(bshd ? t.transpose(1, 2) : t); };
  const Tensor q = view(q_in), k = view(k_in), v = view(v_in);
  // attention()'s default scale, 1 / sqrt(D) (a zero D is fwd's error to report)
  const double sc = scale.has_value()
                        ? *scale
                        : 1.0 / std::sqrt(double(std::max<int64_t>(q.sym_size(3).guard_int(__FILE__, __LINE__), 1)));
  // the options left at their defaults (max_seqlen_q / k are read for varlen packs only; 64 is
  // the functional API's block_size) but the mask and the positions
  attn::api::Options o{};
  o.bias = bias;
  o.scale = sc;
  o.window_left = window_left;
  o.window_right = window_right;
  o.bottom_right = bottom_right;
  o.block_size = 64;
  std::tuple<Tensor, Tensor> res;
  if (!at::GradMode::is_enabled() ||
      !(q.requires_grad() || k.requires_grad() || v.requires_grad() || (bias.has_value() && bias->requires_grad()))) {
    at::AutoDispatchBelowAutograd below;
    res = attn::api::routed_fwd(q, k, v, o, num_splits, deterministic, /*fused_errors=*/false);
  } else {
    res = attn::api::routed_fwd(q, k, v, o, num_splits, deterministic, /*fused_errors=*/false);
  }
  if (bshd) std::get<0>(res) = std::get<0>(res).transpose(1, 2);
  return res;
}

}  // namespace

TORCH_LIBRARY_IMPL(attention_ext, CompositeImplicitAutograd, m) { m.impl("softmax_fwd_plain", &fwd_plain); }
