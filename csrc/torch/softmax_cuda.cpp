// CUDA registration of the softmax family: attention_ext::softmax_fwd / bwd on the CUDA backend
// (csrc/softmax/cuda), through the host steps it shares with the CPU emulator
// (softmax_cuda_steps.h), on the current stream under a device guard.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <initializer_list>
#include <tuple>
#include <utility>

#include "cuda/launch.h"  // NvtxRange
#include "softmax/cuda/entry.h"
#include "torch/cuda_device.h"
#include "torch/softmax_cuda_steps.h"

namespace {

using at::Tensor;
using attn::api::OptTensor;

struct CudaDevice : attn::api::CudaDeviceBase<CudaDevice> {
  static constexpr const char* kWhat = "attention_ext";
  int fwd_num_splits(const attn::SoftmaxParams& p, attn::DType dt, int requested) const {
    return attn::cuda_fwd_num_splits(p, dt, requested);
  }
  size_t fwd_split_floats(const attn::SoftmaxParams& p, int n, int64_t batch_t, int64_t rows, bool o) const {
    return attn::cuda_fwd_split_floats(p, n, batch_t, rows, o);
  }
  void fwd(const attn::SoftmaxParams& p, attn::DType dt, const attn::FwdSplitScratch& split) const {
    attn::cuda_fwd(p, dt, stream(), split);
  }
  std::pair<int, int> fwd_q8_blocks(const attn::SoftmaxParams& p, attn::DType dt) const {
    int bq = 0, bk = 0;
    attn::cuda_fwd_q8_blocks(p, dt, &bq, &bk);
    return {bq, bk};
  }
  void fwd_q8(const attn::SoftmaxParams& p, attn::DType dt) const { attn::cuda_fwd_q8(p, dt, stream()); }
  size_t bwd_softmax_d_floats(const attn::SoftmaxBwdParams& p) const { return attn::cuda_bwd_softmax_d_floats(p); }
  size_t bwd_dq_accum_floats(const attn::SoftmaxBwdParams& p, attn::DType dt) const {
    return attn::cuda_bwd_dq_accum_floats(p, dt);
  }
  void bwd(const attn::SoftmaxBwdParams& p, attn::DType dt) const { attn::cuda_bwd(p, dt, stream()); }
  std::pair<int, int> fwd_sparse_tiles(const attn::SoftmaxParams& p, attn::DType dt) const {
    int m = 0, n = 0;
    attn::cuda_fwd_sparse_tiles(p, dt, &m, &n);
    return {m, n};
  }
  std::pair<int, int> bwd_sparse_tiles(const attn::SoftmaxBwdParams& p, attn::DType dt) const {
    int m = 0, n = 0;
    attn::cuda_bwd_sparse_tiles(p, dt, &m, &n);
    return {m, n};
  }
  void reads(std::initializer_list<const Tensor*>) const {}
};

std::tuple<Tensor, Tensor> fwd_cuda(const Tensor& q, const Tensor& k, const Tensor& v ATTN_SOFTMAX_OPTIONS_PARAMS,
                                    int64_t num_splits, bool /*deterministic: read by the autograd backward*/) {
  attn::NvtxRange range("attention_ext::softmax::fwd (CUDA)");
  return attn::api::cuda_fwd_steps(CudaDevice{}, q, k, v, ATTN_SOFTMAX_MAKE_OPTIONS(),
                                   num_splits);
}

// The forward with the int8 Q.K^T (qk_quant): softmax/cuda/q8.cuh, then the FwdQ8 kernel.
std::tuple<Tensor, Tensor> fwd_quant_cuda(const Tensor& q, const Tensor& k, const Tensor& v ATTN_SOFTMAX_OPTIONS_PARAMS,
                                          c10::string_view qk_quant) {
  attn::NvtxRange range("attention_ext::softmax::fwd_quant (CUDA)");
  return attn::api::cuda_fwd_quant_steps(CudaDevice{}, q, k, v, ATTN_SOFTMAX_MAKE_OPTIONS(), qk_quant);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> bwd_cuda(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                            const Tensor& v, const Tensor& out, const Tensor& lse
                                                                ATTN_SOFTMAX_OPTIONS_PARAMS, bool bias_grad,
                                                            bool deterministic, const OptTensor& dlse) {
  attn::NvtxRange range("attention_ext::softmax::bwd (CUDA)");
  return attn::api::cuda_bwd_steps(CudaDevice{}, dout, q, k, v, out, lse,
                                   ATTN_SOFTMAX_MAKE_OPTIONS(), bias_grad, deterministic,
                                   dlse);
}

}  // namespace

TORCH_LIBRARY_IMPL(attention_ext, CUDA, m) {
  m.impl("softmax_fwd", &fwd_cuda);
  m.impl("softmax_fwd_quant", &fwd_quant_cuda);
  m.impl("softmax_bwd", &bwd_cuda);
}
