// The route of a softmax forward (softmax_binding.h, route_fwd): which kernel runs a call of the
// functional API, decided once, in C++, for its two entries: attention_ext::softmax_fwd_routed
// (the general path: softmax_fwd's arguments) and softmax_fwd_plain (small calls,
// softmax_plain.cpp). Both are CompositeImplicitAutograd ops, so the rule reads grad mode and
// requires_grad as the caller set them, and autograd, torch.compile and fake tensors take the
// registrations of the op the call lands on. softmax_fwd_route reports the decision.
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include "torch/softmax_binding.h"

namespace attn {
namespace api {

FwdRoute route_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Options& o) {
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4) return {false, "not 4-D inputs (softmax_fwd says why)"};
  if (!q.is_cpu()) return {false, "not a CPU call"};
  // a symbolic length (torch.compile's dynamic shapes) keeps the fused kernel rather than guard on it
  const auto sq = q.sym_size(2).maybe_as_int(), sk = k.sym_size(2).maybe_as_int();
  if (!sq.has_value() || !sk.has_value()) return {false, "a symbolic sequence length"};
  if (*sq > kDecodeMaxQ) return {false, "more query rows than the decode kernel takes (kDecodeMaxQ)"};
  if (*sk == 0) return {false, "no keys"};
  if (o.bias.has_value()) return {false, "a mask or bias"};
  if (o.dropout_p > 0.0) return {false, "dropout"};
  if (o.block_layout.has_value() || o.topk_thr.has_value()) return {false, "a block layout or top-k"};
  if (o.cu_seqlens_q.has_value()) return {false, "a varlen pack"};
  const bool positional = o.window_left >= 0 || o.window_right >= 0 || o.alibi_slopes.has_value();
  // top-left and bottom-right agree only where every sequence has Sq keys: Sq == Sk, no seqlens_k
  if (positional && !o.bottom_right && (*sq != *sk || o.seqlens_k.has_value())) {
    return {false, "positions aligned top-left (the decode kernel aligns them bottom-right)"};
  }
  const auto grad = [](const OptTensor& t) { return t.has_value() && t->requires_grad(); };
  if (at::GradMode::is_enabled() &&
      (q.requires_grad() || k.requires_grad() || v.requires_grad() || grad(o.alibi_slopes) || grad(o.sinks))) {
    return {false, "an input that requires grad"};
  }
  return {true, "a CPU call of at most kDecodeMaxQ query rows with nothing to differentiate and no mask, dropout, "
                "block layout, top-k or varlen pack"};
}

namespace {

// softmax_fwd's and decode_fwd's C++ signatures (library.cpp; decode_binding.h, ATTN_DECODE_SCHEMA:
// q, k, v, lengths and pages, alibi_slopes, sinks, scale, softcap, the window, num_splits)
using FwdSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor& ATTN_SOFTMAX_OPTIONS_TYPES,
                                          int64_t, bool);
using DecodeSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const OptTensor&,
                                             const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&,
                                             const OptTensor&, double, double, int64_t, int64_t, int64_t,
                                             const OptTensor&, const OptTensor&);

}  // namespace

std::tuple<Tensor, Tensor> routed_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Options& o,
                                      int64_t num_splits, bool deterministic, bool fused_errors) {
  if (route_fwd(q, k, v, o).decode) {
    // the fused op's input rules first, so that an error names the call's arguments as
    // softmax_fwd would (the decode op words its own for a KV cache). Not while torch.compile
    // traces with symbolic sizes: the C++ check reads sizes as integers and would specialize
    // them (the batch of a compiled decode step); the decode op's fake checks the call then, and
    // the kernels check every call at run time.
    const auto symbolic = [](const Tensor& t) { return t.unsafeGetTensorImpl()->has_symbolic_sizes_strides(); };
    if (fused_errors && !symbolic(q) && !symbolic(k) && !symbolic(v)) {
      check_inputs(q, k, v, o);
      check_num_splits(num_splits);
    }
    static const auto decode =
        c10::Dispatcher::singleton().findSchemaOrThrow("attention_ext::decode_fwd", "").typed<DecodeSig>();
    // seqlens_k clamped to [0, Sk] as the fused kernels read it (the decode op rejects lengths
    // outside); below the Autograd key: nothing to differentiate, and the decode op's autograd
    // layer is Python a small call would pay for
    const int64_t sk = *k.sym_size(2).maybe_as_int();  // route_fwd takes concrete lengths only
    const OptTensor lens = o.seqlens_k.has_value() ? OptTensor(o.seqlens_k->clamp(0, sk)) : OptTensor();
    const OptTensor none;
    at::AutoDispatchBelowAutograd below;
    return decode.call(q, k, v, lens, none, none, none, o.alibi_slopes, o.sinks, o.scale, o.softcap, o.window_left,
                       o.window_right, 0, none, none);
  }
  static const auto fwd =
      c10::Dispatcher::singleton().findSchemaOrThrow("attention_ext::softmax_fwd", "").typed<FwdSig>();
#define ATTN_SOFTMAX_OPTIONS_OBJ o
  return fwd.call(q, k, v ATTN_SOFTMAX_OPTIONS_OF, num_splits, deterministic);
#undef ATTN_SOFTMAX_OPTIONS_OBJ
}

}  // namespace api
}  // namespace attn

namespace {

using at::Tensor;

std::tuple<Tensor, Tensor> fwd_routed(const Tensor& q, const Tensor& k, const Tensor& v ATTN_SOFTMAX_OPTIONS_PARAMS,
                                      int64_t num_splits, bool deterministic) {
  return attn::api::routed_fwd(q, k, v, ATTN_SOFTMAX_MAKE_OPTIONS(), num_splits, deterministic);
}

// "decode: <why>" or "fused: <why>" for a routed call on these inputs, checked first as the call
// would check them
std::string fwd_route(const Tensor& q, const Tensor& k, const Tensor& v ATTN_SOFTMAX_OPTIONS_PARAMS) {
  const attn::api::Options o = ATTN_SOFTMAX_MAKE_OPTIONS();
  attn::api::check_inputs(q, k, v, o);
  const attn::api::FwdRoute r = attn::api::route_fwd(q, k, v, o);
  return std::string(r.decode ? "decode: " : "fused: ") + r.why;
}

}  // namespace

TORCH_LIBRARY_IMPL(attention_ext, CompositeImplicitAutograd, m) {
  m.impl("softmax_fwd_routed", &fwd_routed);
  m.impl("softmax_fwd_route", &fwd_route);
}
