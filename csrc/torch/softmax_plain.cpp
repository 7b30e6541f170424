// attention_ext::fwd_plain: the fused forward with no tensor option but a mask (no lengths,
// ALiBi, sinks, dropout, varlen, block layout or top-k), the call most small models make.
//
// It is attention_ext::fwd with those options left at their defaults (bias: fwd's, a 4-D bool or
// additive mask), written as a CompositeImplicitAutograd op over fwd: autograd, torch.compile,
// fake tensors and every device take fwd's own registrations, and fwd's checks are the only ones.
// What it saves is the fixed cost of a small call: from Python, 11 arguments are converted instead
// of fwd's 27 (the boxing of each argument was ~60% of the op's cost at (1, 8, 16, 64) on one CPU
// thread; attention_ext._C.fwd_plain skips that conversion altogether),
// and a call with nothing to differentiate goes straight below the Autograd key, which is what
// fwd's Python autograd layer would decide itself after a pytree walk of its arguments.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>

#include "torch/softmax_params.h"  // kDecodeMaxQ

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// fwd's C++ signature, in its schema's order (library.cpp, ATTN_SOFTMAX_OPTIONS_SCHEMA)
using FwdSig = std::tuple<Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&,                                                // q, k, v
    const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&,                     // bias .. seqlens_k
    const OptTensor&, const OptTensor&, int64_t, int64_t,                                       // varlen
    double, double, int64_t, int64_t, bool,                                                     // scale .. bottom_right
    double, int64_t, int64_t, const OptTensor&, const OptTensor&,                               // dropout
    const OptTensor&, int64_t, const OptTensor&, const OptTensor&,                              // block layout, top-k
    int64_t, bool);                                                                             // num_splits, det.
// decode_fwd's (decode_params.h, ATTN_DECODE_SCHEMA)
using DecodeSig = std::tuple<Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&,                                                // q, k, v
    const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&,                     // lengths, pages
    const OptTensor&, const OptTensor&, double, double, int64_t, int64_t, int64_t);             // alibi .. splits

// A head dim with a stride is copied to unit stride, as attention() does (the kernels read whole
// rows); a symbolic stride (torch.compile) is guarded on.
Tensor unit_head_stride(const Tensor& t) {
  return t.dim() > 0 && t.sym_stride(-1).guard_int(__FILE__, __LINE__) != 1 ? t.contiguous() : t;
}

std::tuple<Tensor, Tensor> fwd_plain(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                     std::optional<double> scale, int64_t window_left, int64_t window_right,
                                     bool bottom_right, c10::string_view layout, int64_t num_splits,
                                     bool deterministic, const OptTensor& bias) {
  static const auto fwd =
      c10::Dispatcher::singleton().findSchemaOrThrow("attention_ext::fwd", "").typed<FwdSig>();
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
  const OptTensor none;
  // max_seqlen_q / k are read for varlen packs only; 64 is the schema's block_size default
  const auto call = [&] {
    return fwd.call(q, k, v, bias, none, none, none, none, none, 0, 0, sc, 0.0, window_left, window_right,
                    bottom_right, 0.0, 0, 0, none, none, none, 64, none, none, num_splits, deterministic);
  };
  std::tuple<Tensor, Tensor> res;
  if (!at::GradMode::is_enabled() ||
      !(q.requires_grad() || k.requires_grad() || v.requires_grad() || (bias.has_value() && bias->requires_grad()))) {
    at::AutoDispatchBelowAutograd below;
    // the decode kernel aligns positions bottom-right (top-left is the same where Sq = Sk) and
    // has no backward; a symbolic length (torch.compile's dynamic shapes) keeps the fused kernel
    // rather than guard on it
    const auto sq = q.sym_size(2).maybe_as_int(), sk = k.sym_size(2).maybe_as_int();
    if (q.is_cpu() && !bias.has_value() && sq.has_value() && *sq <= attn::api::kDecodeMaxQ && sk.has_value() && *sk > 0 &&
        ((window_left < 0 && window_right < 0) || bottom_right || *sq == *sk)) {
      static const auto decode =
          c10::Dispatcher::singleton().findSchemaOrThrow("attention_ext::decode_fwd", "").typed<DecodeSig>();
      res = decode.call(q, k, v, none, none, none, none, none, none, sc, 0.0, window_left, window_right, 0);
    } else {
      res = call();
    }
  } else {
    res = call();
  }
  if (bshd) std::get<0>(res) = std::get<0>(res).transpose(1, 2);
  return res;
}

}  // namespace

TORCH_LIBRARY_IMPL(attention_ext, CompositeImplicitAutograd, m) { m.impl("fwd_plain", &fwd_plain); }
