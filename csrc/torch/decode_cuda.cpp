// CUDA registration of the decode family: attention_ext::decode_fwd on csrc/decode/cuda, through
// the host steps it shares with the CPU emulator (decode_cuda_steps.h), on the current stream
// under a device guard. The index tensors' values are checked on the host (one copy and sync,
// check_decode_inputs), which also yields the longest sequence for the split heuristic; while a
// CUDA graph is captured they are not (decode_cuda_steps.h).
#include <torch/library.h>

#include <cstdint>
#include <tuple>

#include "cuda/launch.h"  // NvtxRange, device_sm_count
#include "decode/cuda/entry.h"
#include "torch/cuda_device.h"
#include "torch/decode_cuda_steps.h"

namespace {

using at::Tensor;
using attn::api::OptTensor;

struct CudaDevice : attn::api::CudaDeviceBase<CudaDevice> {
  static constexpr const char* kWhat = "attention_ext.decode";
  int sm_count() const { return attn::device_sm_count(); }
  void decode_fwd(const attn::DecodeParams& p, attn::DType dt, int splits, float* part_o, float* part_lse) const {
    attn::cuda_decode_fwd(p, dt, splits, part_o, part_lse, stream());
  }
};

std::tuple<Tensor, Tensor> decode_fwd_cuda(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                           const OptTensor& seqlens_k, const OptTensor& block_table,
                                           const OptTensor& cache_batch_idx, const OptTensor& leftpad_k,
                                           const OptTensor& alibi_slopes, const OptTensor& sinks, double scale,
                                           double softcap, int64_t window_left, int64_t window_right,
                                           int64_t num_splits, const OptTensor& k_descale,
                                           const OptTensor& v_descale) {
  attn::NvtxRange range("attention_ext::decode::fwd (CUDA)");
  const attn::api::DecodeArgs a{q,         k_cache,      v_cache, seqlens_k, block_table, cache_batch_idx,
                                leftpad_k, alibi_slopes, sinks,   scale,     softcap,     window_left,
                                window_right, num_splits, k_descale, v_descale};
  return attn::api::decode_cuda_steps(CudaDevice{}, a);
}

}  // namespace

TORCH_LIBRARY_IMPL(attention_ext, CUDA, m) { m.impl("decode_fwd", &decode_fwd_cuda); }
