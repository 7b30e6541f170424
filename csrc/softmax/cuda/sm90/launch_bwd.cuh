// Launcher of the sm_90a wgmma backward, included only by the generated instantiations/bwd_hopper_*.cu
// files (and not launch_template.cuh, so those TUs compile no mma.sync kernel).
#pragma once

#include <stdexcept>
#include <type_traits>

#include "softmax/cuda/sm90/bwd_kernel.cuh"
#include "softmax/cuda/launchers.h"
#include "cuda/launch.h"

namespace attn {

// After run_bwd_preprocess (softmax_d, dq_accum zeroed with kD floats per row): the dK/dV/dQ
// kernel, then the conversion of dq_accum into dq.
template <typename T, int kD>
void run_bwd_hopper(const SoftmaxBwdParams& p, cudaStream_t stream) {
  using P = hopper::BwdPlan<kD>;
  check_grid(p.h_k, p.b, "attention bwd (wgmma)");
  // the kernel adds dQ atomically; use_hopper_bwd() never sends a deterministic call here
  if (p.deterministic || p.dq_accum == nullptr) {
    throw std::runtime_error("attention bwd (wgmma): deterministic mode is not supported");
  }
  // the plain kernel (the default), and for hopper_bwd 2 the general one, without or with
  // dropout / dbias; each also walking a block-sparse CSC tile index at its own tiles (hopper_bwd 2)
  auto pick = [&](auto sparse) {
    constexpr bool kSparse = decltype(sparse)::value;
    return p.dropout_p > 0.f || p.dbias != nullptr ? hopper::bwd_kernel<T, kD, hopper::kPolicyHeavy, kSparse>
           : score_is_plain(p) ? hopper::bwd_kernel<T, kD, hopper::kPlainScore, kSparse>
                               : hopper::bwd_kernel<T, kD, hopper::kPolicyScore, kSparse>;
  };
  auto kernel = p.sparse.on() ? pick(std::true_type{}) : pick(std::false_type{});
  set_smem(kernel, P::kSmemBytes, "attention bwd (wgmma)");
  dim3 grid((p.sk + P::kBlockN - 1) / P::kBlockN, p.h_k, p.b);
  ATTN_LAUNCH(kernel, grid, dim3(P::kThreads), P::kSmemBytes, stream)(p);
  check_launch("attention bwd (wgmma, sm_90a)");
  run_bwd_convert_dq<T>(p, kD, stream);
}

}  // namespace attn
