// CPU registration of the decode family: attention_ext::decode_fwd on csrc/decode/cpu.
#include <torch/library.h>

#include <cstdint>
#include <tuple>

#include "decode/cpu/entry.h"
#include "torch/decode_binding.h"
#include "torch/tensor_rules.h"  // dtype_of

namespace {

using at::Tensor;
using attn::api::OptTensor;

std::tuple<Tensor, Tensor> decode_fwd_cpu(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                          const OptTensor& seqlens_k, const OptTensor& block_table,
                                          const OptTensor& cache_batch_idx, const OptTensor& leftpad_k,
                                          const OptTensor& alibi_slopes, const OptTensor& sinks, double scale,
                                          double softcap, int64_t window_left, int64_t window_right,
                                          int64_t num_splits, const OptTensor& k_descale,
                                          const OptTensor& v_descale) {
  const attn::api::DecodeArgs a{q,           k_cache, v_cache,     seqlens_k,    block_table, cache_batch_idx,
                                leftpad_k,   alibi_slopes, sinks,  scale,        softcap,     window_left,
                                window_right, num_splits, k_descale, v_descale};
  attn::api::check_decode_inputs(a);
  auto [out, lse] = attn::api::alloc_decode_outputs(q);
  if (q.numel() == 0) return {out, lse};
  const attn::DType dt = attn::api::dtype_of(q);
  if (dt == attn::DType::kF64) {
    attn::cpu::decode_fwd_stub<double>(attn::api::make_decode_params<double>(a, out, lse), dt);
  } else {
    attn::cpu::decode_fwd_stub<float>(attn::api::make_decode_params<float>(a, out, lse), dt);
  }
  return {out, lse};
}

// The Meta kernel (torch.compile's fake tensors, meta tensors): the op's shape, dtype and device
// rules (its index values are read by the kernels' calls only), then the outputs.
std::tuple<Tensor, Tensor> decode_fwd_meta(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                           const OptTensor& seqlens_k, const OptTensor& block_table,
                                           const OptTensor& cache_batch_idx, const OptTensor& leftpad_k,
                                           const OptTensor& alibi_slopes, const OptTensor& sinks, double scale,
                                           double softcap, int64_t window_left, int64_t window_right,
                                           int64_t num_splits, const OptTensor& k_descale,
                                           const OptTensor& v_descale) {
  attn::api::check_decode_shapes({q, k_cache, v_cache, seqlens_k, block_table, cache_batch_idx, leftpad_k,
                                  alibi_slopes, sinks, scale, softcap, window_left, window_right, num_splits,
                                  k_descale, v_descale});
  return attn::api::alloc_decode_outputs(q);
}

// decode_check: the op's shape, dtype and device rules for a call no kernel serves (the Python
// reference fallback), on any device
void decode_check(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const OptTensor& seqlens_k,
                  const OptTensor& block_table, const OptTensor& cache_batch_idx, const OptTensor& leftpad_k,
                  const OptTensor& alibi_slopes, const OptTensor& sinks, double scale, double softcap,
                  int64_t window_left, int64_t window_right, int64_t num_splits, const OptTensor& k_descale,
                  const OptTensor& v_descale) {
  attn::api::check_decode_shapes({q, k_cache, v_cache, seqlens_k, block_table, cache_batch_idx, leftpad_k,
                                  alibi_slopes, sinks, scale, softcap, window_left, window_right, num_splits,
                                  k_descale, v_descale});
}

}  // namespace

TORCH_LIBRARY_IMPL(attention_ext, CPU, m) { m.impl("decode_fwd", &decode_fwd_cpu); }
TORCH_LIBRARY_IMPL(attention_ext, CompositeExplicitAutograd, m) { m.impl("decode_check", &decode_check); }
TORCH_LIBRARY_IMPL(attention_ext, Meta, m) { m.impl("decode_fwd", &decode_fwd_meta); }
