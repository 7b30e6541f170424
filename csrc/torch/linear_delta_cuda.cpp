// CUDA registration of the delta-rule ops: attention_ext::delta_fwd and delta_step on the CUDA
// forward kernels (csrc/linear/cuda/delta_kernel.cuh, delta_chunk_kernel.cuh), delta_bwd on the
// chunk-parallel backward (delta_chunk_bwd_kernel.cuh; the calls it takes, else a ValueError:
// attention_ext.linear.delta routes the others to PyTorch), through the host steps shared with
// the CPU emulator (linear_delta_cuda_steps.h), on the current stream under a device guard.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <initializer_list>
#include <optional>
#include <tuple>

#include "cuda/launch.h"  // NvtxRange
#include "linear/cuda/entry.h"
#include "torch/cuda_device.h"
#include "torch/linear_delta_cuda_steps.h"

namespace {

using at::Tensor;

struct CudaDevice : attn::api::CudaDeviceBase<CudaDevice> {
  static constexpr const char* kWhat = "attention_ext.delta_rule_attention";
  void delta_fwd(const attn::DeltaParamsT<float>& p, const attn::DeltaCudaKernels& k, const Tensor& scratch,
                 std::initializer_list<Tensor>) const {
    attn::cuda_delta_fwd(p, k, scratch.defined() ? scratch.data_ptr() : nullptr, stream());
  }
  void delta_bwd(const attn::DeltaBwdParamsT<float>& p, const Tensor& scratch, std::initializer_list<Tensor>) const {
    attn::cuda_delta_bwd(p, scratch.data_ptr(), stream());
  }
};

std::tuple<Tensor, Tensor, Tensor> delta_fwd_cuda(const Tensor& q, const Tensor& k, const Tensor& v,
                                                  const Tensor& beta ATTN_DELTA_OPTIONS_PARAMS, bool checkpoints) {
  attn::NvtxRange range("attention_ext::delta::fwd (CUDA)");
  return attn::api::delta_cuda_fwd_steps(CudaDevice{}, q, k, v, beta, ATTN_DELTA_MAKE_OPTIONS(), checkpoints);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> delta_bwd_cuda(
    const Tensor& dout, const std::optional<Tensor>& dfinal_state, const Tensor& q, const Tensor& k, const Tensor& v,
    const Tensor& beta ATTN_DELTA_OPTIONS_PARAMS, const std::optional<Tensor>& checkpoints) {
  attn::NvtxRange range("attention_ext::delta::bwd (CUDA)");
  return attn::api::delta_cuda_bwd_steps(CudaDevice{}, dout, dfinal_state, q, k, v, beta, ATTN_DELTA_MAKE_OPTIONS(),
                                         checkpoints);
}

Tensor delta_step_cuda(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta, Tensor& state,
                       const std::optional<Tensor>& gate, double scale, bool qk_l2norm) {
  attn::NvtxRange range("attention_ext::delta::step (CUDA)");
  return attn::api::delta_cuda_step_steps(CudaDevice{}, q, k, v, beta, state, gate, scale, qk_l2norm);
}

}  // namespace

TORCH_LIBRARY_IMPL(attention_ext, CUDA, m) {
  m.impl("delta_fwd", &delta_fwd_cuda);
  m.impl("delta_bwd", &delta_bwd_cuda);
  m.impl("delta_step", &delta_step_cuda);
}
