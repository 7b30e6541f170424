// The entry points of one emulated architecture's build of the CUDA backend (emu_kernels.h),
// called by the torch binding (emu_binding.cpp) through the host steps of the real binding. Params travel as bytes: each kernel TU compiles
// params.h into its own namespace (see emu_kernels.h), with the same layout; `bytes` is
// sizeof(attn::SoftmaxParams) / sizeof(attn::SoftmaxBwdParams) on the caller's side, checked against it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace attn_emu {

// Global memory the kernels may read with cp.async (the tensors of one call); other sources
// are an error (emu_runtime.cpp).
void add_global_range(const void* ptr, size_t bytes);
void clear_global_ranges();
// The interleaving of a block's warps (cuda_emu.h): warp-serial (the default) runs one warp to its
// next scheduling point before the next starts, lockstep (false) advances every warp one point
// per round; reverse takes the warps last-first.
void set_schedule(bool warp_serial, bool reverse);
// The kernels launched since the last call, demangled, in launch order.
std::vector<std::string> take_launches();
// What each launch since the last call executed (the static cost report's counts,
// benchmarks/gpu_cost.py): CTAs, threads per CTA, warp-level mma.sync m16n8k16 instructions,
// completed block barriers (summed over CTAs), bytes copied from global memory by cp.async.
struct LaunchStats {
  uint64_t ctas, threads, mma, barriers, cp_async_bytes;
};
std::vector<LaunchStats> take_launch_stats();

struct Backend {
  // the backend's entry points (csrc/softmax/cuda/entry.h); dtype is attn::DType as int
  int (*fwd_num_splits)(const void* params, size_t bytes, int dtype, int requested);
  size_t (*fwd_split_floats)(const void* params, size_t bytes, int num_splits, int64_t batch_t, int64_t rows, bool o);
  // split: FwdSplitScratch's fields
  void (*fwd)(const void* params, size_t bytes, int dtype, int num_splits, int64_t rows, float* o_accum,
              float* lse_accum);
  void (*bwd)(const void* params, size_t bytes, int dtype);
  // the int8 Q.K^T forward: cuda_fwd_q8_blocks, cuda_fwd_q8
  void (*fwd_q8_blocks)(const void* params, size_t bytes, int dtype, int* block_q, int* block_k);
  void (*fwd_q8)(const void* params, size_t bytes, int dtype);
  size_t (*softmax_d_floats)(const void* params, size_t bytes);
  size_t (*dq_accum_floats)(const void* params, size_t bytes, int dtype);
  const char* (*path_name)(const void* params, size_t bytes, int dtype);
  // cuda_fwd_sparse_tiles (bwd = false, params as SoftmaxParams) / cuda_bwd_sparse_tiles (SoftmaxBwdParams)
  void (*sparse_tiles)(const void* params, size_t bytes, int dtype, bool bwd, int* tile_m, int* tile_n);
  // the sparse family's entry points (csrc/sparse/cuda/entry.h), params as SoftmaxParams
  size_t (*topk_scratch_entries)(const void* params, size_t bytes, int k_top);
  void (*topk_threshold)(const void* params, size_t bytes, int dtype, int k_top, float* thr, int32_t* jcut,
                         float* s_logit, int32_t* s_key);
  void (*set_kernels)(int hopper_fwd, int hopper_bwd, int tune_fwd, int tune_bwd, bool force_simt);
  // the linear family's entry points (csrc/linear/cuda/entry.h), params as
  // attn::LinearParamsT<float> / attn::LinearBwdParamsT<float>
  // the selection (attn::LinearCudaKernels) travels as its two fields
  void (*linear_set_kernels)(bool chunk_parallel, int segment_chunks, bool chunk_states);
  void (*linear_kernels)(bool* chunk_parallel, int* segment_chunks, bool* chunk_states);
  size_t (*linear_fwd_scratch_floats)(const void* params, size_t bytes, int dtype, bool cp, int seg, bool states);
  void (*linear_fwd)(const void* params, size_t bytes, int dtype, bool cp, int seg, bool states, float* scratch);
  size_t (*linear_bwd_scratch_floats)(const void* params, size_t bytes, int dtype, bool cp, int seg, bool states);
  void (*linear_bwd)(const void* params, size_t bytes, int dtype, bool cp, int seg, bool states, float* scratch);
  void (*linear_step)(const void* params, size_t bytes, int dtype);
  // wgmma_test_kernel.cuh (sm_90 backend only; null on sm_80): d = a b + c through the emulated
  // wgmma, a (64, k), b (k, n) of dtype, c and d (64, n) fp32 row-major
  void (*wgmma_test)(const void* a, const void* b, const float* c, float* d, int dtype, int n, int k, int variant);
};

Backend backend_sm80();
Backend backend_sm90();

}  // namespace attn_emu
