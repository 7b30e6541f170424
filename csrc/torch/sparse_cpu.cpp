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

}  // namespace

TORCH_LIBRARY_IMPL(attention_ext, CPU, m) { m.impl("topk_threshold", &topk_threshold_cpu); }
