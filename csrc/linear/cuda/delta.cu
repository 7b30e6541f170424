// cuda_delta_fwd (entry.h): the delta rule's forward on CUDA, delta_kernel.cuh's recurrent kernel.
// The key width K picks how many lanes share a column (KS) and how many rows each holds (kRows),
// so that a column's K rows fit in registers: 16 rows per lane up to K = 512, 32 beyond.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "cuda/launch.h"
#include "linear/cuda/delta_kernel.cuh"
#include "linear/cuda/entry.h"

namespace attn {

namespace {

template <typename T, int KS, int kRows>
void launch_delta_fwd(const DeltaParamsT<float>& p, cudaStream_t stream, const char* what) {
  constexpr int kBV = delta_cuda::kWarps * (32 / KS), kKp = KS * kRows;
  const bool per_key = p.gate != nullptr && p.gate_per_key;
  const int per_token = delta_cuda::token_floats(kKp, kBV, per_key);
  const int tokens = std::clamp(delta_cuda::kSmemBudget / 4 / per_token - 1, 1, delta_cuda::kMaxTokens);
  const int bytes = (tokens * per_token + 4) * 4;
  const dim3 grid(unsigned((p.dim_v + kBV - 1) / kBV), unsigned(p.h_v), unsigned(p.b));
  auto kernel = &delta_cuda::delta_fwd_kernel<T, KS, kRows>;
  set_smem(kernel, bytes, what);
  ATTN_LAUNCH(kernel, grid, dim3(delta_cuda::kThreads), size_t(bytes), stream)(p, tokens);
  check_launch(what);
}

template <typename T>
void delta_fwd_dtype(const DeltaParamsT<float>& p, cudaStream_t stream, const char* what) {
  const int k = p.dim_k;
  if (k <= 16) return launch_delta_fwd<T, 1, 16>(p, stream, what);
  if (k <= 32) return launch_delta_fwd<T, 2, 16>(p, stream, what);
  if (k <= 64) return launch_delta_fwd<T, 4, 16>(p, stream, what);
  if (k <= 128) return launch_delta_fwd<T, 8, 16>(p, stream, what);
  if (k <= 256) return launch_delta_fwd<T, 16, 16>(p, stream, what);
  if (k <= 512) return launch_delta_fwd<T, 32, 16>(p, stream, what);
  return launch_delta_fwd<T, 32, 32>(p, stream, what);
}

}  // namespace

void cuda_delta_fwd(const DeltaParamsT<float>& p, cudaStream_t stream) {
  const char* what = "attention_ext.delta_rule_attention (CUDA)";
  check_grid(p.h_v, p.b, what);
  if (p.dim_k > 1024) throw std::runtime_error(std::string(what) + ": K must be <= 1024");
  switch (p.dt) {
    case DType::kF32: return delta_fwd_dtype<float>(p, stream, what);
    case DType::kF16: return delta_fwd_dtype<__half>(p, stream, what);
    case DType::kBF16: return delta_fwd_dtype<__nv_bfloat16>(p, stream, what);
    default: throw std::runtime_error(std::string(what) + ": the CUDA kernels take float32, float16 or bfloat16");
  }
}

}  // namespace attn
