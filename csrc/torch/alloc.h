// Allocation of the outputs the CPU kernels write: one rule for every op.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/accumulate.h>

#include "cpu/memory.h"

namespace attn {
namespace api {

// An uninitialized tensor of `sizes`. On the CPU, from 2 MB up, its memory comes from
// cpu/memory.h's BlockCache (huge pages, recycled across calls): a fresh output is first-touched
// by the kernel, and on fresh 4 KB pages each page costs a fault, zeroing and accounting; huge
// pages cost far less (benchmarks/results/2026-11-29-figures-from-comments.md). Fresh
// pages made a causal forward + backward at S = 65536 scale worse than linearly from S = 8192,
// whose 16 MB outputs malloc recycles.
inline at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& opts) {
  const size_t bytes = size_t(c10::multiply_integers(sizes)) * opts.dtype().itemsize();
  if (!opts.device().is_cpu() || bytes < cpu::LineAllocator<char>::kHuge) return at::empty(sizes, opts);
  void* p = cpu::BlockCache::take(bytes);
  return at::from_blob(p, sizes, [bytes](void* q) { cpu::BlockCache::give(q, bytes); }, opts);
}

}  // namespace api
}  // namespace attn
