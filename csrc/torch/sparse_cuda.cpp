// CUDA registration of the sparse family's own op: attention_ext::topk_threshold on
// csrc/sparse/cuda, through the host steps it shares with the CPU emulator (sparse_cuda_steps.h),
// on the current stream under a device guard. (Block-sparse attention itself is the softmax ops
// with block_layout, softmax_cuda.cpp.)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <initializer_list>
#include <tuple>

#include "cuda/launch.h"  // NvtxRange
#include "sparse/cuda/entry.h"
#include "torch/cuda_device.h"
#include "torch/sparse_cuda_steps.h"

namespace {

using at::Tensor;

struct CudaSparseDevice : attn::api::CudaDeviceBase<CudaSparseDevice> {
  static constexpr const char* kWhat = "attention_ext";
  size_t topk_scratch_entries(const attn::SoftmaxParams& p, int k_top) const {
    return attn::cuda_topk_scratch_entries(p, k_top);
  }
  void topk_threshold(const attn::SoftmaxParams& p, attn::DType dt, int k_top, float* thr, int32_t* jcut, float* s_logit,
                      int32_t* s_key) const {
    attn::cuda_topk_threshold(p, dt, k_top, thr, jcut, s_logit, s_key, stream());
  }
  void reads(std::initializer_list<const Tensor*>) const {}
};

std::tuple<Tensor, Tensor> topk_threshold_cuda(const Tensor& q, const Tensor& k ATTN_SOFTMAX_OPTIONS_PARAMS,
                                               int64_t k_top) {
  attn::NvtxRange range("attention_ext::sparse::topk_threshold (CUDA)");
  return attn::api::cuda_topk_steps(CudaSparseDevice{}, q, k, ATTN_SOFTMAX_MAKE_OPTIONS(),
                                    k_top);
}

}  // namespace

TORCH_LIBRARY_IMPL(attention_ext, CUDA, m) { m.impl("topk_threshold", &topk_threshold_cuda); }
