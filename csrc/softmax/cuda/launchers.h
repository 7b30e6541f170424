// Declarations of the per-instantiation launchers. The definitions live in launch_template.cuh
// and sm90/launch_*.cuh and are instantiated by the generated instantiations/*.cu files
// (tools/gen_cuda_instantiations.py), one translation unit per (dtype, head-dim bucket,
// direction), so the build parallelizes and dispatch.cu compiles no kernel code.
#pragma once

#include <cuda_runtime.h>

#include "common/softmax_params.h"
#include "softmax/cuda/entry.h"  // FwdSplitScratch

namespace attn {

template <typename T, int kD>
void run_fwd_tc(const SoftmaxParams& p, cudaStream_t stream);
// The split-KV forward (launch_template.cuh): FwdSplit kernel, then the combine.
template <typename T, int kD>
void run_fwd_tc_split(const SoftmaxParams& p, const FwdSplitScratch& s, cudaStream_t stream);
template <typename T, int kD>
void run_bwd_tc(const SoftmaxBwdParams& p, cudaStream_t stream);  // after the preprocess
// The int8 Q K^T forward (launch_template.cuh): quantize pass, then the FwdQ8 kernel; kD = 64, 128.
template <typename T, int kD>
void run_fwd_q8(const SoftmaxParams& p, cudaStream_t stream);

// sm_90a wgmma forward (sm90/fwd_kernel.cuh), kD = 64 or 128; only for configs that
// use_hopper_fwd() accepts, on an sm_90 device, in builds with sm_90a code (fwd_hopper_*.cu).
template <typename T, int kD>
void run_fwd_hopper(const SoftmaxParams& p, cudaStream_t stream);
// Its int8 Q K^T form (qk_quant, sm90/launch_fwd.cuh): the quantize pass at its blocks, then the
// kernel; only for configs that use_hopper_q8() accepts.
template <typename T, int kD>
void run_fwd_hopper_q8(const SoftmaxParams& p, cudaStream_t stream);

// sm_90a wgmma backward (sm90/bwd_kernel.cuh), kD = 64 or 128, after the preprocess (dq_accum
// zeroed with kD floats per row); converts dq_accum into dq itself. Only for configs that
// use_hopper_bwd() accepts, on an sm_90 device, in builds with sm_90a code (bwd_hopper_*.cu).
template <typename T, int kD>
void run_bwd_hopper(const SoftmaxBwdParams& p, cudaStream_t stream);

template <typename T>
void run_fwd_simt(const SoftmaxParams& p, cudaStream_t stream);
template <typename T>
void run_bwd_simt(const SoftmaxBwdParams& p, cudaStream_t stream);  // after the preprocess
template <typename T>
void run_bwd_preprocess(const SoftmaxBwdParams& p, int dq_ld, cudaStream_t stream);
template <typename T>
void run_bwd_convert_dq(const SoftmaxBwdParams& p, int dq_ld, cudaStream_t stream);

}  // namespace attn
