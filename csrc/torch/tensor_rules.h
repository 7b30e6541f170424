// Layout rules the ops share for the tensors they are given: one home.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "common/qkv_params.h"

namespace attn {
namespace api {

// The kernels' element type of q, k, v: float32, float16, bfloat16 or float64 (the CPU's only).
inline DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kF32;
    case at::kHalf: return DType::kF16;
    case at::kBFloat16: return DType::kBF16;
    case at::kDouble: return DType::kF64;
    default:
      TORCH_CHECK_TYPE(false, "attention_ext: q, k, v must be float32, float16, bfloat16 or float64, got ",
                       t.scalar_type());
  }
}

// The dtype of the float side tensors (lse, an additive bias, ALiBi slopes, sinks, a state and
// their gradients): float64 for float64 inputs, else float32 (the kernels' Acc).
inline at::ScalarType acc_dtype(const at::Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// Sizes are read as SymInts: the rules also run in the ops' Meta kernels, which torch.compile
// calls with symbolic sizes (a comparison then guards on the symbols, as a Python check would).

// The kernels read the last dim (the head dim, or a state's columns) with stride 1. That holds
// when its stride is 1, when it has one element, and for an empty tensor (nothing is read; a
// 0-size tensor's strides are arbitrary, e.g. the gradient autograd hands the backward of a call
// with no query rows).
inline bool unit_stride_last(const at::Tensor& t) {
  return t.sym_stride(-1) == 1 || t.sym_size(-1) == 1 || t.sym_numel() == 0;
}

// An uninitialized (B, H, S, D) tensor with the same memory layout as `like`: (B, S, H, D)
// storage when `like` has heads inside rows, else contiguous (B, H, S, D).
inline at::Tensor empty_like_layout(const at::Tensor& like) {
  const auto opts = like.options();
  if (like.sym_stride(1) < like.sym_stride(2)) {  // heads inside rows: keep (B, S, H, D) storage
    return at::empty_symint({like.sym_size(0), like.sym_size(2), like.sym_size(1), like.sym_size(3)}, opts)
        .transpose(1, 2);
  }
  return at::empty_symint(like.sym_sizes(), opts);
}

// The same with `h` heads and a last dim of `last` (an output whose heads or width differ from
// its input's: the linear and delta ops' out, their gradients), of dtype / device `opts`.
inline at::Tensor empty_like_layout(const at::Tensor& like, const c10::SymInt& h, const c10::SymInt& last,
                                    const at::TensorOptions& opts) {
  if (like.sym_stride(1) < like.sym_stride(2))
    return at::empty_symint({like.sym_size(0), like.sym_size(2), h, last}, opts).transpose(1, 2);
  return at::empty_symint({like.sym_size(0), h, like.sym_size(2), last}, opts);
}

// The (batch, head, row) strides of a (B, H, S, D) tensor, as the families' params keep them.
inline void bhs_strides(const at::Tensor& t, int64_t* batch, int64_t* head, int64_t* row) {
  *batch = t.stride(0);
  *head = t.stride(1);
  *row = t.stride(2);
}

}  // namespace api
}  // namespace attn
