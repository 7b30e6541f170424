// CUDA registration of the linear family: attention_ext::linear_fwd / linear_bwd / linear_step on the CUDA
// backend (csrc/linear/cuda), through the host steps it shares with the CPU emulator
// (linear_cuda_steps.h), on the current stream under a device guard.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "cuda/launch.h"  // NvtxRange
#include "linear/cuda/entry.h"
#include "torch/cuda_device.h"
#include "torch/linear_cuda_steps.h"

namespace {

using at::Tensor;

struct CudaDevice : attn::api::CudaDeviceBase<CudaDevice> {
  static constexpr const char* kWhat = "attention_ext.linear";
  attn::LinearCudaKernels linear_kernels() const { return attn::cuda_linear_kernels(); }
  void reads(std::initializer_list<const Tensor*>) const {}
  size_t linear_fwd_scratch_floats(const attn::LinearParamsT<float>& p, attn::DType dt,
                                   const attn::LinearCudaKernels& k) const {
    return attn::cuda_linear_fwd_scratch_floats(p, dt, k);
  }
  void linear_fwd(const attn::LinearParamsT<float>& p, attn::DType dt, const attn::LinearCudaKernels& k,
                  float* scratch) const {
    attn::cuda_linear_fwd(p, dt, k, scratch, stream());
  }
  void linear_step(const attn::LinearStepParamsT<float>& p, attn::DType dt) const {
    attn::cuda_linear_step(p, dt, stream());
  }
  size_t linear_bwd_scratch_floats(const attn::LinearBwdParamsT<float>& p, attn::DType dt,
                                   const attn::LinearCudaKernels& k) const {
    return attn::cuda_linear_bwd_scratch_floats(p, dt, k);
  }
  void linear_bwd(const attn::LinearBwdParamsT<float>& p, attn::DType dt, const attn::LinearCudaKernels& k,
                  float* scratch) const {
    attn::cuda_linear_bwd(p, dt, k, scratch, stream());
  }
};

std::tuple<Tensor, Tensor, Tensor, Tensor> linear_fwd_cuda(const Tensor& q, const Tensor& k, const Tensor& v
                                                           ATTN_LINEAR_OPTIONS_PARAMS, bool keep_residual) {
  attn::NvtxRange range("attention_ext::linear::fwd (CUDA)");
  return attn::api::linear_cuda_fwd_steps(CudaDevice{}, q, k, v, ATTN_LINEAR_MAKE_OPTIONS(), keep_residual);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> linear_bwd_cuda(const Tensor& dout,
                                                                   const std::optional<Tensor>& dfinal_state,
                                                                   const Tensor& q, const Tensor& k, const Tensor& v,
                                                                   const Tensor& out, const Tensor& den
                                                                       ATTN_LINEAR_OPTIONS_PARAMS,
                                                                   const std::optional<Tensor>& out_residual) {
  attn::NvtxRange range("attention_ext::linear::bwd (CUDA)");
  return attn::api::linear_cuda_bwd_steps(CudaDevice{}, dout, dfinal_state, q, k, v, out, den, out_residual,
                                          ATTN_LINEAR_MAKE_OPTIONS());
}

Tensor linear_step_cuda(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& state,
                        const std::optional<Tensor>& normalizer, const std::optional<Tensor>& decay,
                        int64_t feature_map, double eps, double scale) {
  attn::NvtxRange range("attention_ext::linear::step (CUDA)");
  return attn::api::linear_cuda_step_steps(CudaDevice{}, q, k, v, state, normalizer, decay, feature_map, eps, scale);
}

}  // namespace

TORCH_LIBRARY_IMPL(attention_ext, CUDA, m) {
  m.impl("linear_fwd", &linear_fwd_cuda);
  m.impl("linear_bwd", &linear_bwd_cuda);
  m.impl("linear_step", &linear_step_cuda);
}
