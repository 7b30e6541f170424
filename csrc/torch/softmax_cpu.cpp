// CPU registration of the softmax family: attention_ext::softmax_fwd / bwd on the CPU kernels
// (csrc/softmax/cpu), float64 included, and dropout_mask for every device.
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "softmax/cpu/entry.h"
#include "torch/softmax_binding.h"
#include "torch/block_index.h"

namespace {

using at::Tensor;
using attn::api::OptTensor;
using attn::api::Options;
using attn::api::TileIndexTensors;

// The CPU kernels walk a block layout at its own granularity (tiles = blocks; softmax/cpu/tile.h
// cuts them further): CSR for the forward, CSC for the backward. The returned tensors keep the
// index alive for the call.
template <typename Params>
TileIndexTensors attach_index(Params& p, const Options& o, bool csc) {
  if (!o.block_layout.has_value()) return {};
  TileIndexTensors t = attn::api::tile_index(*o.block_layout, o.block_size, p.sq, p.sk, o.block_size, o.block_size, csc);
  (csc ? p.sparse.bwd : p.sparse.fwd) = t.view();
  return t;
}

std::tuple<Tensor, Tensor> fwd_cpu(const Tensor& q, const Tensor& k, const Tensor& v ATTN_SOFTMAX_OPTIONS_PARAMS,
                                   int64_t num_splits, bool /*deterministic: read by the autograd backward*/) {
  const Options o = ATTN_SOFTMAX_MAKE_OPTIONS();
  attn::api::check_inputs(q, k, v, o);
  attn::api::check_num_splits(num_splits);
  auto [out, lse] = attn::api::alloc_fwd_outputs(q, o);
  if (q.numel() == 0) return {out, lse};
  const attn::DType dt = attn::api::dtype_of(q);
  if (dt == attn::DType::kF64) {
    auto p = attn::api::make_fwd_params<double>(q, k, v, out, lse, o);
    const TileIndexTensors index = attach_index(p, o, false);
    attn::cpu::softmax_fwd_stub<double>(p, dt);
  } else {
    auto p = attn::api::make_fwd_params<float>(q, k, v, out, lse, o);
    const TileIndexTensors index = attach_index(p, o, false);
    attn::cpu::softmax_fwd_stub<float>(p, dt);
  }
  return {out, lse};
}

// The forward with the int8 Q K^T (SoftmaxParams::qk_quant): float inputs only (check_qk_quant).
// fp8 has no CPU kernel: no x86 CPU has e4m3 dot products, and the format's only use, a tensor-core
// rate on Hopper, is no use here (the Python layer runs the method's reference, with a warning).
std::tuple<Tensor, Tensor> fwd_quant_cpu(const Tensor& q, const Tensor& k, const Tensor& v ATTN_SOFTMAX_OPTIONS_PARAMS,
                                         c10::string_view qk_quant) {
  const Options o = ATTN_SOFTMAX_MAKE_OPTIONS();
  const int32_t code = attn::api::check_qk_quant(q, o, qk_quant);
  TORCH_CHECK_NOT_IMPLEMENTED(code == attn::kQkInt8, "attention_ext: qk_quant='fp8' runs on the CUDA sm_90 kernel ",
                              "(e4m3 on wgmma) only; on the CPU use qk_quant='int8' (more accurate, VNNI dot ",
                              "products)");
  attn::api::check_inputs(q, k, v, o);
  auto [out, lse] = attn::api::alloc_fwd_outputs(q, o);
  if (q.numel() == 0) return {out, lse};
  auto p = attn::api::make_fwd_params<float>(q, k, v, out, lse, o);
  p.qk_quant = code;
  const TileIndexTensors index = attach_index(p, o, false);
  attn::cpu::softmax_fwd_stub<float>(p, attn::api::dtype_of(q));
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> bwd_cpu(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                           const Tensor& v, const Tensor& out, const Tensor& lse
                                                               ATTN_SOFTMAX_OPTIONS_PARAMS, bool bias_grad,
                                                           bool deterministic, const OptTensor& dlse) {
  const Options o = ATTN_SOFTMAX_MAKE_OPTIONS();
  attn::api::check_inputs(q, k, v, o);
  attn::api::check_bwd_inputs(dout, q, out, lse, dlse);
  attn::api::Grads g = attn::api::alloc_grads(q, k, v, o, bias_grad);
  if (attn::api::is_empty_call(q, k)) return {g.dq, g.dk, g.dv, g.dbias, g.dsinks};
  Tensor dout_c = dout.to(q.scalar_type());
  const attn::DType dt = attn::api::dtype_of(q);
  if (dt == attn::DType::kF64) {
    auto p = attn::api::make_bwd_params<double>(dout_c, q, k, v, out, lse, dlse, o, g, deterministic);
    const TileIndexTensors index = attach_index(p, o, true);
    attn::cpu::softmax_bwd_stub<double>(p, dt);
  } else {
    auto p = attn::api::make_bwd_params<float>(dout_c, q, k, v, out, lse, dlse, o, g, deterministic);
    const TileIndexTensors index = attach_index(p, o, true);
    attn::cpu::softmax_bwd_stub<float>(p, dt);
  }
  return {g.dq, g.dk, g.dv, g.dbias, g.dsinks};
}

// Drawn on the CPU from the same Philox function the kernels use, then moved to `device`.
Tensor dropout_mask_cpu(int64_t b, int64_t h, int64_t sq, int64_t sk, double p, int64_t seed, int64_t offset,
                        std::optional<at::Device> device) {
  TORCH_CHECK_VALUE(b >= 0 && h >= 0 && sq >= 0 && sk >= 0, "attention_ext.dropout_mask: sizes must be >= 0");
  TORCH_CHECK_VALUE(p >= 0.0 && p < 1.0, "attention_ext.dropout_mask: p must be in [0, 1), got ", p);
  Tensor keep = at::empty({b, h, sq, sk}, at::TensorOptions().dtype(at::kBool));
  attn::cpu::dropout_mask_stub(reinterpret_cast<uint8_t*>(keep.data_ptr<bool>()), int(b), int(h), int(sq), int(sk),
                               float(p), uint64_t(seed), uint64_t(offset));
  return device.has_value() ? keep.to(*device) : keep;
}

}  // namespace

TORCH_LIBRARY_IMPL(attention_ext, CPU, m) {
  m.impl("softmax_fwd", &fwd_cpu);
  m.impl("softmax_fwd_quant", &fwd_quant_cpu);
  m.impl("softmax_bwd", &bwd_cpu);
}

TORCH_LIBRARY_IMPL(attention_ext, CompositeExplicitAutograd, m) {
  m.impl("dropout_mask", &dropout_mask_cpu);
}
