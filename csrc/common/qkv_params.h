// The family-neutral part of every family's kernel params: the element type and the problem's
// sizes and q, k, v, out tensors.
//
// Plain old data: raw pointers, strides in elements, sizes. No ATen or CUDA types, so both
// backends and plain C++ tests can fill and read it (the role of FA2's flash.h).
#pragma once

#include <cstdint>

namespace attn {

// Element type of q, k, v, out (and of dout, dq, dk, dv). float64 runs on the CPU only.
enum class DType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2, kF64 = 3 };

// The part of every family's params that names the problem: sizes and the q, k, v, out tensors,
// (B, H, S, D) through each family's strides. Every family's params start with it.
struct QkvParams {
  // ---------------------------------------------------------------- sizes
  int32_t b;      // batch (varlen: number of sequences)
  int32_t h;      // query heads
  int32_t h_k;    // key/value heads; h % h_k == 0 (MQA: h_k = 1, GQA: 1 < h_k < h)
  int32_t sq;     // query length (varlen: the longest sequence)
  int32_t sk;     // key length (varlen: the longest sequence)
  int32_t d;      // head dim

  // ---------------------------------------------------------------- tensors (B, H, S, D)
  const void* q;
  const void* k;
  const void* v;
  void* o;
};

}  // namespace attn
