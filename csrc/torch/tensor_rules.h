// Layout rules the ops share for the tensors they are given: one home.
#pragma once

#include <ATen/core/Tensor.h>

namespace attn {
namespace api {

// The kernels read the last dim (the head dim, or a state's columns) with stride 1. That holds
// when its stride is 1, when it has one element, and for an empty tensor (nothing is read; a
// 0-size tensor's strides are arbitrary, e.g. the gradient autograd hands the backward of a call
// with no query rows).
inline bool unit_stride_last(const at::Tensor& t) {
  return t.stride(-1) == 1 || t.size(-1) == 1 || t.numel() == 0;
}

}  // namespace api
}  // namespace attn
