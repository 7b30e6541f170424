// Meta kernels of the softmax ops (softmax_fwd, softmax_bwd): the ops' own
// C++ input checks, then outputs of the right shapes, dtypes and layouts. torch.compile's fake
// tensors and meta tensors run these, so an input error reads the same traced, on meta tensors
// and in eager mode: the rules are stated once (softmax_binding.cpp), with sizes as SymInts.
// Under a fake tensor's kernel call every tensor is on the meta device, so the device rules pass
// (the kernels check devices at run time).
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "torch/softmax_binding.h"
#include "torch/tensor_rules.h"

namespace {

using at::Tensor;
using attn::api::OptTensor;
using attn::api::Options;

Tensor rows_like(const Tensor& q, at::ScalarType dtype) {  // (B, H, Sq), q's (varlen: the pack's) rows
  return at::empty_symint({q.sym_size(0), q.sym_size(1), q.sym_size(2)}, q.options().dtype(dtype));
}

std::tuple<Tensor, Tensor> fwd_meta(const Tensor& q, const Tensor& k, const Tensor& v ATTN_SOFTMAX_OPTIONS_PARAMS,
                                    int64_t num_splits, bool /*deterministic*/) {
  const Options o = ATTN_SOFTMAX_MAKE_OPTIONS();
  attn::api::check_inputs(q, k, v, o);
  attn::api::check_num_splits(num_splits);
  return {attn::api::empty_like_layout(q), rows_like(q, attn::api::acc_dtype(q))};
}

std::tuple<Tensor, Tensor> fwd_quant_meta(const Tensor& q, const Tensor& k,
                                          const Tensor& v ATTN_SOFTMAX_OPTIONS_PARAMS, c10::string_view qk_quant) {
  const Options o = ATTN_SOFTMAX_MAKE_OPTIONS();
  attn::api::check_qk_quant(q, o, qk_quant);
  attn::api::check_inputs(q, k, v, o);
  return {attn::api::empty_like_layout(q), rows_like(q, attn::api::acc_dtype(q))};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> bwd_meta(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                            const Tensor& v, const Tensor& out,
                                                            const Tensor& lse ATTN_SOFTMAX_OPTIONS_PARAMS,
                                                            bool bias_grad, bool /*deterministic*/,
                                                            const OptTensor& dlse) {
  const Options o = ATTN_SOFTMAX_MAKE_OPTIONS();
  attn::api::check_inputs(q, k, v, o);
  attn::api::check_bwd_inputs(dout, q, out, lse, dlse);
  // alloc_grads' shapes: dbias (B, H, Sq_b, Sk) when wanted, dsinks (B, H) with sinks, else (0)
  const auto acc = q.options().dtype(attn::api::acc_dtype(q));
  const bool varlen = o.cu_seqlens_q.has_value();
  const c10::SymInt nb = varlen ? o.cu_seqlens_q->sym_numel() - 1 : q.sym_size(0);
  Tensor dbias = at::empty({0}, acc), dsinks = at::empty({0}, acc);
  if (bias_grad && o.bias.has_value() && o.bias->is_floating_point()) {
    const c10::SymInt sq = varlen ? c10::SymInt(o.max_seqlen_q) : q.sym_size(2);
    const c10::SymInt sk = varlen ? c10::SymInt(o.max_seqlen_k) : k.sym_size(2);
    dbias = at::empty_symint({nb, q.sym_size(1), o.bias->sym_size(2) == 1 ? c10::SymInt(1) : sq, sk}, acc);
  }
  if (o.sinks.has_value()) dsinks = at::empty_symint({nb, q.sym_size(1)}, acc);
  return {attn::api::empty_like_layout(q), attn::api::empty_like_layout(k), attn::api::empty_like_layout(v), dbias,
          dsinks};
}

}  // namespace

TORCH_LIBRARY_IMPL(attention_ext, Meta, m) {
  m.impl("softmax_fwd", &fwd_meta);
  m.impl("softmax_fwd_quant", &fwd_quant_meta);
  m.impl("softmax_bwd", &bwd_meta);
}
