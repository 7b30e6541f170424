// The torch side of top-k's threshold pass, shared by its CPU and CUDA bindings: input rules
// and output allocation.
#pragma once

#include <ATen/ATen.h>

#include <limits>
#include <tuple>

#include "torch/softmax_binding.h"

namespace attn {
namespace api {

// q, k and the softmax options as fwd takes them (v = k for the shape rules); no dropout, no
// block layout and no top-k fields of its own; k_top >= 1.
inline void check_topk_inputs(const Tensor& q, const Tensor& k, const Options& o, int64_t k_top) {
  check_inputs(q, k, k, o);
  TORCH_CHECK_VALUE(k_top >= 1 && k_top <= std::numeric_limits<int32_t>::max(),
                    "attention_ext: k_top must be in [1, 2^31 - 1], got ", k_top);
  TORCH_CHECK_VALUE(!o.block_layout.has_value(), "attention_ext: top-k attention takes no block_layout");
  TORCH_CHECK_VALUE(!o.topk_thr.has_value(), "attention_ext: topk_threshold computes topk_thr; do not pass one");
  TORCH_CHECK_VALUE(o.dropout_p == 0.0, "attention_ext: topk_threshold takes no dropout (the fused op applies it)");
}

// thr (B, H, Sq) in the acc dtype, jcut (B, H, Sq) int32. Rows no kernel writes (an empty
// call, a varlen pack's tail) keep every key: thr = -inf, jcut = INT32_MAX.
inline std::tuple<Tensor, Tensor> alloc_topk_outputs(const Tensor& q) {
  Tensor thr = at::full({q.size(0), q.size(1), q.size(2)}, -std::numeric_limits<double>::infinity(),
                        q.options().dtype(acc_dtype(q)));
  Tensor jcut = at::full({q.size(0), q.size(1), q.size(2)}, std::numeric_limits<int32_t>::max(),
                         q.options().dtype(at::kInt));
  return {thr, jcut};
}

}  // namespace api
}  // namespace attn
