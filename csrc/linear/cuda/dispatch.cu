// cuda_linear_fwd / cuda_linear_bwd (entry.h): launch the SIMT kernels of simt_kernel.cuh for
// float32, float16 and bfloat16 inputs. The backward is three steps on one stream: the chunked
// kernel (atomics into the zeroed scratch), the conversion of dq / dk / dv, and ddecay's
// reverse running sum.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda/launch.h"
#include "linear/cuda/entry.h"
#include "linear/cuda/simt_kernel.cuh"

namespace attn {

namespace linear_cuda {

using linear_simt::kThreads;

int num_tiles(const LinearParamsT<float>& p) {
  const int w = linear_simt::tile_cols(p.d);
  return (p.dim_v + w - 1) / w;
}

// B_t * heads * rows of a scratch part (entry.h)
int64_t scratch_rows(const LinearParamsT<float>& p, int heads) {
  const int64_t bt = p.cu_seqlens != nullptr ? 1 : p.b;
  return bt * heads * p.seq_head_stride;
}

template <typename T>
void run_fwd(const LinearParamsT<float>& p, cudaStream_t stream) {
  const char* what = "attention_ext.linear (CUDA forward)";
  check_grid(p.h, p.b, what);
  const int smem = linear_simt::fwd_smem_floats(p.d) * int(sizeof(float));
  auto kernel = &linear_simt::fwd_kernel<T>;
  set_smem(kernel, smem, what);
  const dim3 grid(num_tiles(p), p.h, p.b);
  ATTN_LAUNCH(kernel, grid, dim3(kThreads), smem, stream)(p);
  check_launch(what);
}

template <typename T>
void run_bwd(const LinearBwdParamsT<float>& p, float* scratch, cudaStream_t stream) {
  const char* what = "attention_ext.linear (CUDA backward)";
  check_grid(p.h, p.b, what);
  linear_simt::BwdScratch sc;
  sc.dq = scratch;
  sc.dk = sc.dq + scratch_rows(p, p.h) * p.d;
  sc.dv = sc.dk + scratch_rows(p, p.h_k) * p.d;
  sc.dg = sc.dv + scratch_rows(p, p.h_k) * p.dim_v;
  const int smem = linear_simt::bwd_smem_floats(p.d) * int(sizeof(float));
  auto kernel = &linear_simt::bwd_kernel<T>;
  set_smem(kernel, smem, what);
  const dim3 grid(num_tiles(p), p.h, p.b);
  ATTN_LAUNCH(kernel, grid, dim3(kThreads), smem, stream)(p, sc);
  check_launch(what);
  // grid-stride loops: enough blocks to fill the device, no more
  const int64_t max_blocks = 4096;
  for (int which = 0; which < 3; ++which) {
    const int heads = which == 0 ? p.h : p.h_k;
    const int64_t n = scratch_rows(p, heads) * (which == 2 ? p.dim_v : p.d);
    const int blocks = int(std::max<int64_t>(1, std::min<int64_t>(max_blocks, (n + kThreads - 1) / kThreads)));
    ATTN_LAUNCH(linear_simt::finalize_kernel<T>, dim3(blocks), dim3(kThreads), 0, stream)(p, sc, which);
    check_launch(what);
  }
  if (p.ddecay != nullptr) {
    const int blocks = int((int64_t(p.b) * p.h + kThreads - 1) / kThreads);
    ATTN_LAUNCH(linear_simt::ddecay_kernel, dim3(blocks), dim3(kThreads), 0, stream)(p, sc);
    check_launch(what);
  }
}

}  // namespace linear_cuda

void cuda_linear_fwd(const LinearParamsT<float>& p, DType dt, cudaStream_t stream) {
  switch (dt) {
    case DType::kF32: linear_cuda::run_fwd<float>(p, stream); break;
    case DType::kF16: linear_cuda::run_fwd<__half>(p, stream); break;
    case DType::kBF16: linear_cuda::run_fwd<__nv_bfloat16>(p, stream); break;
    default: throw std::runtime_error("attention_ext.linear: the CUDA kernels take float32, float16 or bfloat16");
  }
}

size_t cuda_linear_bwd_scratch_floats(const LinearBwdParamsT<float>& p) {
  return size_t(linear_cuda::scratch_rows(p, p.h) * (p.d + 1) + linear_cuda::scratch_rows(p, p.h_k) * (p.d + p.dim_v));
}

void cuda_linear_bwd(const LinearBwdParamsT<float>& p, DType dt, float* scratch, cudaStream_t stream) {
  switch (dt) {
    case DType::kF32: linear_cuda::run_bwd<float>(p, scratch, stream); break;
    case DType::kF16: linear_cuda::run_bwd<__half>(p, scratch, stream); break;
    case DType::kBF16: linear_cuda::run_bwd<__nv_bfloat16>(p, scratch, stream); break;
    default: throw std::runtime_error("attention_ext.linear: the CUDA kernels take float32, float16 or bfloat16");
  }
}

}  // namespace attn
