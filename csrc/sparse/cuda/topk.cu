// cuda_topk_threshold (entry.h): the launch of topk_kernel.cuh's threshold pass.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdexcept>
#include <string>

#include "cuda/launch.h"
#include "sparse/cuda/entry.h"
#include "sparse/cuda/topk_kernel.cuh"

namespace attn {

namespace {

// k's buffer size: no row keeps more than Sk keys
int topk_kcap(const SoftmaxParams& p, int k_top) { return k_top < p.sk ? k_top : (p.sk > 0 ? p.sk : 1); }

// Blocks of the persistent grid: one warp per row, at most one wave of 16 blocks (2048 threads)
// per SM and a scratch of about 2^24 pairs (128 MB), at least 64 warps (k ~ Sk only comes with
// short rows).
int64_t topk_blocks(const SoftmaxParams& p, int k_top) {
  const int64_t rows = int64_t(p.b) * p.h * p.sq;
  const int64_t per_warp = 3 * int64_t(topk_kcap(p, k_top));
  int64_t warps = (int64_t(1) << 24) / per_warp;
  warps = warps < 64 ? 64 : warps;
  const int64_t wave = int64_t(device_sm_count()) * 16 * topk::kWarps;
  warps = warps < wave ? warps : wave;
  warps = warps < rows ? warps : rows;
  return (warps + topk::kWarps - 1) / topk::kWarps;
}

bool nothing_to_do(const SoftmaxParams& p, int k_top) {
  return p.b == 0 || p.h == 0 || p.sq == 0 || p.sk == 0 || k_top >= p.sk;
}

}  // namespace

size_t cuda_topk_scratch_entries(const SoftmaxParams& p, int k_top) {
  if (nothing_to_do(p, k_top)) return 0;
  return size_t(topk_blocks(p, k_top)) * topk::kWarps * 3 * topk_kcap(p, k_top);
}

void cuda_topk_threshold(const SoftmaxParams& p, DType dt, int k_top, float* thr, int32_t* jcut, float* scratch_logit,
                         int32_t* scratch_key, cudaStream_t stream) {
  NvtxRange range("attention_ext::sparse::cuda_topk_threshold");
  if (p.d < 1 || p.d > simt::kSimtMaxD) {
    throw std::runtime_error("topk_threshold: head dim " + std::to_string(p.d) +
                             " is outside the CUDA kernels' range [1, 256]");
  }
  if (p.h_k < 1 || p.h % p.h_k != 0) throw std::runtime_error("topk_threshold: query heads must be a multiple of kv heads");
  if (k_top < 1) throw std::runtime_error("topk_threshold: k_top must be >= 1");
  if (nothing_to_do(p, k_top)) return;
  if (scratch_logit == nullptr || scratch_key == nullptr) throw std::runtime_error("topk_threshold: scratch is missing");
  const dim3 grid(unsigned(topk_blocks(p, k_top)));
  const int kcap = topk_kcap(p, k_top);
  switch (dt) {
    case DType::kF32:
      ATTN_LAUNCH(topk::threshold_kernel<float>, grid, 32 * topk::kWarps, 0, stream)(p, k_top, kcap, thr, jcut,
                                                                                    scratch_logit, scratch_key);
      break;
    case DType::kF16:
      ATTN_LAUNCH(topk::threshold_kernel<__half>, grid, 32 * topk::kWarps, 0, stream)(p, k_top, kcap, thr, jcut,
                                                                                     scratch_logit, scratch_key);
      break;
    case DType::kBF16:
      ATTN_LAUNCH(topk::threshold_kernel<__nv_bfloat16>, grid, 32 * topk::kWarps, 0, stream)(
          p, k_top, kcap, thr, jcut, scratch_logit, scratch_key);
      break;
    default:
      throw std::runtime_error("topk_threshold: float64 has a kernel on the CPU only");
  }
  check_launch("topk_threshold");
}

}  // namespace attn
