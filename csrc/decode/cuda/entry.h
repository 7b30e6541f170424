// Host entry points of the CUDA decode kernel (attention of a few query rows over a KV cache,
// common/decode_params.h). No torch here: csrc/torch/decode_cuda.cpp (and the CPU emulator) fill
// the params through csrc/torch/decode_binding, pick the
// split count (decode/cuda/heuristics.h) and allocate its scratch (csrc/torch/decode_cuda_steps.h),
// and call this on the current stream. Errors are thrown as
// std::runtime_error naming the cause. The kernel computes in float32 for fp32 / fp16 / bf16.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/decode_params.h"

namespace attn {

// The kernel selection, process-wide (set by the attention_ext::decode_set_cuda_kernels op):
//   tensor_cores: false = the CUDA-core kernel (kernel.cuh) for every call (the default until a
//                 GPU run has passed the other); true = the tensor-core kernel (mma_kernel.cuh)
//                 for fp16 / bf16 calls whose K / V rows allow 16-byte loads; fp32 and the others
//                 keep the CUDA-core kernel.
//   quantized:    false = int8 / fp8 e4m3 caches are refused (the Python layer runs them through
//                 the dequantized reference); true = the CUDA-core kernel's 8-bit build reads them
//                 (not the default until a GPU run has passed it).
struct DecodeCudaKernels {
  bool tensor_cores = false;
  bool quantized = false;
};
void cuda_decode_set_kernels(const DecodeCudaKernels& k);
DecodeCudaKernels cuda_decode_kernels();

// out, lse <- decode attention. splits > 1: part_o (B, H, Sq, splits, D) and part_lse
// (B, H, Sq, splits) float32 scratch (every element is written before the combine reads it; no
// zeroing needed).
void cuda_decode_fwd(const DecodeParams& p, DType dt, int splits, float* part_o, float* part_lse,
                     cudaStream_t stream);

}  // namespace attn
