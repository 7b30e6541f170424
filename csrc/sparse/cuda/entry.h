// Host entry points of the sparse family's CUDA kernels. No torch here: csrc/torch/sparse_cuda.cpp
// (and the emulator's binding, through csrc/torch/sparse_cuda_steps.h) fills the params, sizes
// the scratch with cuda_topk_scratch_entries() and calls these on the current stream. Block-sparse
// attention itself runs in the softmax kernels (csrc/softmax/cuda, common/block_sparse.h).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/softmax_params.h"

namespace attn {

// Top-k's threshold pass (common/block_sparse.h; the CPU's is sparse/cpu/topk.cpp): for every
// query row of p (q, k and the policy's options; v, out and the top-k fields unused),
// thr[row] = the k_top-th best logit among the keys the policy allows, jcut[row] = the last key
// kept among the logits equal to it (ties go to the lower key); rows with at most k_top such
// keys are left as the caller initialized them: thr = -inf, jcut = INT32_MAX (keep all). thr /
// jcut are (B, H, Sq) in p.lse's layout. The logits are the SIMT forward's and backward's bit for
// bit (simt::dot_row, Policy::score), which is why top-k calls run on the SIMT kernels.
// Scratch: cuda_topk_scratch_entries(p, k_top) (logit, key) pairs, as a float and an int32 array;
// 0 = nothing to compute (k_top >= Sk: every row keeps every key), no launch.
size_t cuda_topk_scratch_entries(const SoftmaxParams& p, int k_top);
void cuda_topk_threshold(const SoftmaxParams& p, DType dt, int k_top, float* thr, int32_t* jcut, float* scratch_logit,
                         int32_t* scratch_key, cudaStream_t stream);

}  // namespace attn
