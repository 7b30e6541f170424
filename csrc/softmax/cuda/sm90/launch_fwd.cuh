// Launcher of the sm_90a wgmma forward, included only by the generated instantiations/fwd_hopper_*.cu
// files (and not launch_template.cuh, so those TUs compile no mma.sync kernel).
#pragma once

#include <stdexcept>

#include "softmax/cuda/sm90/fwd_kernel.cuh"
#include "softmax/cuda/launchers.h"
#include "softmax/cuda/q8_launch.cuh"
#include "cuda/launch.h"

namespace attn {

template <typename T, int kD>
void run_fwd_hopper(const SoftmaxParams& p, cudaStream_t stream) {
  using P = hopper::FwdPlan<kD>;
  check_grid(p.h, p.b, "attention fwd (wgmma)");
  auto kernel = p.dropout_p > 0.f ? hopper::fwd_kernel<T, kD, true> : hopper::fwd_kernel<T, kD, false>;
  set_smem(kernel, P::kSmemBytes, "attention fwd (wgmma)");
  dim3 grid((p.sq + P::kBlockM - 1) / P::kBlockM, p.h, p.b);
  ATTN_LAUNCH(kernel, grid, dim3(P::kThreads), P::kSmemBytes, stream)(p);
  check_launch("attention fwd (wgmma, sm_90a)");
}

// The 8-bit Q K^T forward on wgmma (qk_quant int8 / fp8; use_hopper_q8 in dispatch.cu): the
// quantize pass at this kernel's blocks (a q scale per warp's 16 rows, a k scale per key tile),
// then the kernel's instance of the format.
template <typename T, int kD>
void run_fwd_hopper_q8(const SoftmaxParams& p, cudaStream_t stream) {
  using P = hopper::FwdPlan<kD>;
  static_assert(P::kBlockN <= tc::kQ8MaxBlockK, "q8_quant_k_kernel flags a key tile's keys in shared memory");
  run_q8_quantize<T>(p, stream);
  const bool drop = p.dropout_p > 0.f;
  auto kernel = p.qk_quant == kQkFp8
                    ? (drop ? hopper::fwd_kernel<T, kD, true, kQkFp8> : hopper::fwd_kernel<T, kD, false, kQkFp8>)
                    : (drop ? hopper::fwd_kernel<T, kD, true, kQkInt8> : hopper::fwd_kernel<T, kD, false, kQkInt8>);
  const char* what = p.qk_quant == kQkFp8 ? "attention fwd (wgmma, fp8 Q.K^T, sm_90a)"
                                          : "attention fwd (wgmma, int8 Q.K^T, sm_90a)";
  set_smem(kernel, P::kSmemBytes, what);
  dim3 grid((p.sq + P::kBlockM - 1) / P::kBlockM, p.h, p.b);
  ATTN_LAUNCH(kernel, grid, dim3(P::kThreads), P::kSmemBytes, stream)(p);
  check_launch(what);
}

}  // namespace attn
