// The quantize pass of the int8 Q K^T forward (q8.cuh) as launches: shared by the mma.sync
// launcher (launch_template.cuh) and the sm_90a one (sm90/launch_fwd.cuh), each of which then
// runs its own forward on the operands.
#pragma once

#include "cuda/launch.h"
#include "softmax/cuda/q8.cuh"

namespace attn {

// K's mean (partial sums, then the mean), K's blocks, Q's blocks and q . mean into p.q8, at the
// blocks the caller allocated (cuda_fwd_q8_blocks).
template <typename T>
void run_q8_quantize(const SoftmaxParams& p, cudaStream_t stream) {
  check_grid(p.h, p.b, "attention fwd (int8 Q.K^T)");
  ATTN_LAUNCH(tc::q8_mean_kernel<T>, dim3(p.q8.nch, p.h_k, p.b), tc::kQ8Threads, 0, stream)(p);
  check_launch("attention int8 Q.K^T: K sums");
  ATTN_LAUNCH(tc::q8_mean_finalize_kernel<T>, dim3(p.h_k, p.b), tc::kQ8Threads, 0, stream)(p);
  check_launch("attention int8 Q.K^T: K mean");
  ATTN_LAUNCH(tc::q8_quant_k_kernel<T>, dim3(p.q8.nbk, p.h_k, p.b), tc::kQ8Threads, 0, stream)(p);
  check_launch("attention int8 Q.K^T: K blocks");
  ATTN_LAUNCH(tc::q8_quant_q_kernel<T>, dim3(p.q8.nbq, p.h, p.b), tc::kQ8Threads, 0, stream)(p);
  check_launch("attention int8 Q.K^T: Q blocks");
}

}  // namespace attn
