// Allocation of the outputs the CPU kernels write: one rule for every op.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/accumulate.h>

#include "cpu/memory.h"

namespace attn {
namespace api {

// An uninitialized tensor of `sizes`. On the CPU, from 2 MB up, its memory comes from
// cpu/memory.h's BlockCache (huge pages, recycled across calls): a fresh output is first-touched
// by the kernel, and on fresh 4 KB pages that cost about 1.2 us per page (fault, zeroing,
// accounting) in this VM. 4 x 128 MB of outputs took 360 ms to allocate and fill, 90 ms on fresh
// huge pages, and made a causal forward + backward at S = 65536 scale worse than linearly from
// S = 8192, whose 16 MB outputs malloc recycles.
inline at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& opts) {
  const size_t bytes = size_t(c10::multiply_integers(sizes)) * opts.dtype().itemsize();
  if (!opts.device().is_cpu() || bytes < cpu::LineAllocator<char>::kHuge) return at::empty(sizes, opts);
  void* p = cpu::BlockCache::take(bytes);
  return at::from_blob(p, sizes, [bytes](void* q) { cpu::BlockCache::give(q, bytes); }, opts);
}

}  // namespace api
}  // namespace attn
