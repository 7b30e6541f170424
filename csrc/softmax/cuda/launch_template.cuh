// Launcher definitions, included only by the generated instantiation files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <utility>

#include "softmax/cuda/bwd_kernel.cuh"
#include "softmax/cuda/fwd_kernel.cuh"
#include "cuda/launch.h"
#include "softmax/cuda/launchers.h"
#include "softmax/cuda/q8_launch.cuh"
#include "softmax/cuda/simt_kernel.cuh"
#include "softmax/cuda/traits.h"

namespace attn {

// Tr: the tile config (kBlockM, kBlockN, kNWarps): FwdTraits<kD> or a tuning alternative.
// Var: the kernel's schedule (tc::FwdVariant, or tc::FwdSplit of one with num_splits CTAs per
// query block).
template <typename T, int kD, typename Tr, bool kGeneral, typename Var = tc::FwdVariant<>>
void run_fwd_cfg(const SoftmaxParams& p, cudaStream_t stream, int num_splits = 1) {
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kNWarps = Tr::kNWarps;
  constexpr int kSmem = fwd_smem_bytes<kD, kBlockM, kBlockN>();
  auto kernel = tc::fwd_kernel<T, kD, kBlockM, kBlockN, kNWarps, kGeneral, Var>;
  set_smem(kernel, kSmem, "attention fwd");
  dim3 grid((p.sq + kBlockM - 1) / kBlockM * num_splits, p.h, p.b);
  ATTN_LAUNCH(kernel, grid, kNWarps * 32, kSmem, stream)(p);
  check_launch("attention fwd (tensor cores)");
}

// Tr: the tile config (kBlockM, kBlockN, kNWarps): BwdTraits<kD>, BwdTraitsSm90<kD> or a tuning
// alternative; Var: the kernel's schedule (tc::BwdVariant). Defined before tuning.cuh, which
// names it (nvcc's front end needs the template declared there).
template <typename T, int kD, typename Tr, bool kDropout, typename Var = tc::BwdVariant<>>
void run_bwd_dkdv_cfg(const SoftmaxBwdParams& p, cudaStream_t stream) {
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kNWarps = Tr::kNWarps;
  constexpr int kDAcc = BwdTraits<kD>::kDAcc;
  constexpr int kSmem = bwd_smem_bytes<kD, kBlockM, kBlockN>();
  auto kernel = tc::bwd_dkdv_kernel<T, kD, kDAcc, kBlockM, kBlockN, kNWarps, kDropout, Var>;
  set_smem(kernel, kSmem, "attention bwd dk/dv");
  dim3 grid(((p.sk + kBlockN - 1) / kBlockN) * (kD / kDAcc), p.h_k, p.b);
  ATTN_LAUNCH(kernel, grid, kNWarps * 32, kSmem, stream)(p);
  check_launch("attention bwd dk/dv (tensor cores)");
}

}  // namespace attn
#if defined(ATTN_TUNING)
#include "softmax/cuda/tuning.cuh"  // FwdAlt / BwdAlt, run_fwd_alt / run_bwd_alt
#endif
namespace attn {

template <typename T, int kD, bool kGeneral>
void run_fwd_tc_impl(const SoftmaxParams& p, cudaStream_t stream) {
#if defined(ATTN_TUNING)
  // a block-sparse call's tile index is built at FwdTraits' tiles: no candidate takes it
  if (!p.sparse.on() && run_fwd_alt<T, kD, kGeneral>(cuda_kernels().tune_fwd, p, stream,
                                   std::make_integer_sequence<int, kNumFwdAlts + 1>{}))
    return;
#endif
  run_fwd_cfg<T, kD, FwdTraits<kD>, kGeneral>(p, stream);
}

template <typename T, int kD>
void run_fwd_tc(const SoftmaxParams& p, cudaStream_t stream) {
  check_grid(p.h, p.b, "attention fwd");
  if (needs_general_kernel(p)) {
    run_fwd_tc_impl<T, kD, true>(p, stream);
  } else {
    run_fwd_tc_impl<T, kD, false>(p, stream);
  }
}

// Split-KV forward (flash-decoding): the FwdSplit kernel (default tiles, plain or general as
// run_fwd_tc picks) writes num_splits partials per query row into the fp32 scratch, laid out as
// p's tensors with query head h * num_splits + s: O (B_t, H * num_splits, rows, d), LSE
// (B_t, H * num_splits, rows), where (B_t, rows) are q's batch and row dims ((1, total_q) for
// varlen, whose rows are then addressed from SeqInfo::row_q as in p); then fwd_combine_kernel
// merges them into p.o and p.lse. The tuning candidates (-DATTN_TUNING) are unsplit only.
template <typename T, int kD>
void run_fwd_tc_split(const SoftmaxParams& p, const FwdSplitScratch& s, cudaStream_t stream) {
  check_grid(p.h, p.b, "attention fwd (split-KV)");
  using Tr = FwdTraits<kD>;
  SoftmaxParams ps = p;
  ps.o = s.o_accum;
  ps.lse = s.lse_accum;
  ps.o_row_stride = p.d;
  ps.o_head_stride = s.rows * p.d;
  ps.o_batch_stride = int64_t(p.h) * s.num_splits * ps.o_head_stride;
  ps.lse_head_stride = s.rows;
  ps.lse_batch_stride = int64_t(p.h) * s.num_splits * s.rows;
  if (needs_general_kernel(p)) {
    run_fwd_cfg<T, kD, Tr, true, tc::FwdSplit<tc::FwdVariant<>>>(ps, stream, s.num_splits);
  } else {
    run_fwd_cfg<T, kD, Tr, false, tc::FwdSplit<tc::FwdVariant<>>>(ps, stream, s.num_splits);
  }
  dim3 grid((p.sq + tc::kCombineRows - 1) / tc::kCombineRows, p.h, p.b);
  auto combine = tc::fwd_combine_kernel<T, kD>;
  ATTN_LAUNCH(combine, grid, tc::kCombineRows * 32, 0, stream)(p, ps, s.num_splits);
  check_launch("attention fwd split-KV combine");
}

// The forward with the int8 Q K^T (qk_quant, q8.cuh): the quantize pass into p.q8 (which the
// caller allocated at cuda_fwd_q8_blocks' blocks), then the FwdQ8 kernel at the default tiles,
// general policy (one instance per bucket: the plain policy runs through it too).
template <typename T, int kD>
void run_fwd_q8(const SoftmaxParams& p, cudaStream_t stream) {
  static_assert(FwdTraits<kD>::kBlockN <= tc::kQ8MaxBlockK,
                "q8_quant_k_kernel flags a key tile's keys in shared memory");
  run_q8_quantize<T>(p, stream);
  run_fwd_cfg<T, kD, FwdTraits<kD>, true, tc::FwdQ8<tc::FwdVariant<>>>(p, stream);
}

template <typename T, int kD, bool kDropout>
void run_bwd_tc_impl(const SoftmaxBwdParams& p, cudaStream_t stream) {
  {
#if defined(ATTN_TUNING)
    if (!p.sparse.on() && run_bwd_alt<T, kD, kDropout>(cuda_kernels().tune_bwd, p, stream,
                                      std::make_integer_sequence<int, kNumBwdAlts + 1>{})) {
    } else
#endif
    if (device_sm() >= 90) {
      run_bwd_dkdv_cfg<T, kD, BwdTraitsSm90<kD>, kDropout>(p, stream);
    } else {
      run_bwd_dkdv_cfg<T, kD, BwdTraits<kD>, kDropout>(p, stream);
    }
  }
  if (p.deterministic) {
    using Tr = BwdDqTraits<kD>;
    constexpr int kSmem = bwd_dq_smem_bytes<kD, Tr::kBlockM, Tr::kBlockN>();
    auto kernel =
        tc::bwd_dq_kernel<T, kD, Tr::kDAcc, Tr::kBlockM, Tr::kBlockN, Tr::kNWarps, kDropout>;
    set_smem(kernel, kSmem, "attention bwd dq");
    dim3 grid(((p.sq + Tr::kBlockM - 1) / Tr::kBlockM) * (kD / Tr::kDAcc), p.h, p.b);
    ATTN_LAUNCH(kernel, grid, Tr::kNWarps * 32, kSmem, stream)(p);
    check_launch("attention bwd dq (tensor cores)");
  } else {
    run_bwd_convert_dq<T>(p, kD, stream);
  }
}

template <typename T, int kD>
void run_bwd_tc(const SoftmaxBwdParams& p, cudaStream_t stream) {
  check_grid(p.h, p.b, "attention bwd");
  if (p.dropout_p > 0.f) {
    run_bwd_tc_impl<T, kD, true>(p, stream);
  } else {
    run_bwd_tc_impl<T, kD, false>(p, stream);
  }
}

template <typename T>
void run_fwd_simt(const SoftmaxParams& p, cudaStream_t stream) {
  check_grid(p.h, p.b, "attention fwd");
  dim3 grid((p.sq + simt::kRowsPerBlock - 1) / simt::kRowsPerBlock, p.h, p.b);
  ATTN_LAUNCH(simt::fwd_kernel<T>, grid, 32 * simt::kRowsPerBlock, 0, stream)(p);
  check_launch("attention fwd (simt)");
}

template <typename T>
void run_bwd_preprocess(const SoftmaxBwdParams& p, int dq_ld, cudaStream_t stream) {
  check_grid(p.h, p.b, "attention bwd");
  dim3 grid((p.sq + simt::kRowsPerBlock - 1) / simt::kRowsPerBlock, p.h, p.b);
  ATTN_LAUNCH(simt::bwd_preprocess_kernel<T>, grid, 32 * simt::kRowsPerBlock, 0, stream)(p, dq_ld);
  check_launch("attention bwd preprocess");
}

template <typename T>
void run_bwd_convert_dq(const SoftmaxBwdParams& p, int dq_ld, cudaStream_t stream) {
  dim3 grid((p.sq + simt::kRowsPerBlock - 1) / simt::kRowsPerBlock, p.h, p.b);
  ATTN_LAUNCH(simt::bwd_convert_dq_kernel<T>, grid, 32 * simt::kRowsPerBlock, 0, stream)(p, dq_ld);
  check_launch("attention bwd dq convert");
}

template <typename T>
void run_bwd_simt(const SoftmaxBwdParams& p, cudaStream_t stream) {
  check_grid(p.h, p.b, "attention bwd");
  dim3 grid_k((p.sk + simt::kRowsPerBlock - 1) / simt::kRowsPerBlock, p.h_k, p.b);
  ATTN_LAUNCH(simt::bwd_dkdv_kernel<T>, grid_k, 32 * simt::kRowsPerBlock, 0, stream)(p);
  check_launch("attention bwd dk/dv (simt)");
  dim3 grid_q((p.sq + simt::kRowsPerBlock - 1) / simt::kRowsPerBlock, p.h, p.b);
  ATTN_LAUNCH(simt::bwd_dq_kernel<T>, grid_q, 32 * simt::kRowsPerBlock, 0, stream)(p);
  check_launch("attention bwd dq (simt)");
}

}  // namespace attn
