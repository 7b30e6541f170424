// CPU registration of the sparse family's own op: attention_ext::topk_threshold on
// csrc/sparse/cpu (block-sparse attention itself is the softmax ops with block_layout).
#include <torch/library.h>

#include <cstdint>
#include <tuple>

#include "sparse/cpu/entry.h"
#include "torch/softmax_binding.h"
#include "torch/sparse_topk.h"

namespace {

using at::Tensor;
using attn::api::Options;

std::tuple<Tensor, Tensor> topk_threshold_cpu(const Tensor& q, const Tensor& k ATTN_SOFTMAX_OPTIONS_PARAMS,
                                              int64_t k_top) {
  const Options o = ATTN_SOFTMAX_MAKE_OPTIONS();
  attn::api::check_topk_inputs(q, k, o, k_top);
  auto [thr, jcut] = attn::api::alloc_topk_outputs(q);
  if (attn::api::is_empty_call(q, k)) return {thr, jcut};
  const attn::DType dt = attn::api::dtype_of(q);
  // v = k and out = q stand in for tensors the pass never reads; thr has lse's layout
  if (dt == attn::DType::kF64) {
    auto p = attn::api::make_fwd_params<double>(q, k, k, q, thr, o);
    attn::cpu::topk_threshold_stub<double>(p, dt, int(k_top), thr.data_ptr<double>(), jcut.data_ptr<int32_t>());
  } else {
    auto p = attn::api::make_fwd_params<float>(q, k, k, q, thr, o);
    attn::cpu::topk_threshold_stub<float>(p, dt, int(k_top), thr.data_ptr<float>(), jcut.data_ptr<int32_t>());
  }
  return {thr, jcut};
}

// The Meta kernel (torch.compile's fake tensors, meta tensors): the op's own checks, then the
// (B, H, Sq) outputs (softmax_meta.cpp says why).
std::tuple<Tensor, Tensor> topk_threshold_meta(const Tensor& q, const Tensor& k ATTN_SOFTMAX_OPTIONS_PARAMS,
                                               int64_t k_top) {
  attn::api::check_topk_inputs(q, k, ATTN_SOFTMAX_MAKE_OPTIONS(), k_top);
  const auto rows = [&](at::ScalarType dt) {
    return at::empty_symint({q.sym_size(0), q.sym_size(1), q.sym_size(2)}, q.options().dtype(dt));
  };
  return {rows(attn::api::acc_dtype(q)), rows(at::kInt)};
}

}  // namespace

TORCH_LIBRARY_IMPL(attention_ext, CPU, m) { m.impl("topk_threshold", &topk_threshold_cpu); }
TORCH_LIBRARY_IMPL(attention_ext, Meta, m) { m.impl("topk_threshold", &topk_threshold_meta); }
