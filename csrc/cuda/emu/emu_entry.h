// The entry points of one emulated architecture's build of the CUDA backend (emu_kernels.h),
// called by the torch binding (emu_binding.cpp). Params travel as bytes: each kernel TU compiles
// params.h into its own namespace (see emu_kernels.h), with the same layout; `bytes` is
// sizeof(attn::FwdParams) / sizeof(attn::BwdParams) on the caller's side, checked against it.
#pragma once

#include <cstddef>
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

struct Backend {
  // dispatch.cu's cuda_fwd / cuda_bwd / scratch sizes / path name; dtype is attn::DType as int
  // batch_t, rows: q's dim 0 and its rows per head (the varlen pack's total), for split-KV scratch
  // requested_splits: the op's num_splits
  void (*fwd)(const void* params, size_t bytes, int dtype, int64_t batch_t, int64_t rows, int requested_splits);
  void (*bwd)(const void* params, size_t bytes, int dtype);
  size_t (*softmax_d_floats)(const void* params, size_t bytes);
  size_t (*dq_accum_floats)(const void* params, size_t bytes, int dtype);
  const char* (*path_name)(const void* params, size_t bytes, int dtype);
  // dispatch.cu's cuda_set_kernels (this arch's copy)
  void (*set_kernels)(int hopper_fwd, int hopper_bwd, int tune_fwd, int tune_bwd, bool force_simt);
};

Backend backend_sm80();
Backend backend_sm90();

}  // namespace attn_emu
