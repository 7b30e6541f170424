// The host steps of the CUDA softmax forward and backward between the op's tensors and the
// torch-free backend (csrc/softmax/cuda/entry.h): checks, outputs, params, the scratch the
// backend sizes, the launch, errors. One copy for the real CUDA binding (softmax_cuda.cpp) and
// the CPU emulator's, which differ only in their `Device`:
//
//   struct Device {
//     static constexpr bool kPoison;   // outputs and scratch start as NaN (the emulator)
//     static constexpr const char* kWhat;  // error-message prefix
//     void check_device(const Tensor& q) const;   // dtype / device the backend takes
//     <RAII> guard(const Tensor& q) const;         // device guard for the call
//     int fwd_num_splits(const SoftmaxParams&, DType, int requested) const;
//     size_t fwd_split_floats(const SoftmaxParams&, int num_splits, int64_t batch_t, int64_t rows, bool o) const;
//     void fwd(const SoftmaxParams&, DType, const FwdSplitScratch&) const;
//     std::pair<int, int> fwd_q8_blocks(const SoftmaxParams&, DType) const;  // entry.h's int8 Q.K^T
//     void fwd_q8(const SoftmaxParams&, DType) const;                         //   forward
//     size_t bwd_softmax_d_floats(const SoftmaxBwdParams&) const;
//     size_t bwd_dq_accum_floats(const SoftmaxBwdParams&, DType) const;
//     void bwd(const SoftmaxBwdParams&, DType) const;
//     std::pair<int, int> fwd_sparse_tiles(const SoftmaxParams&, DType) const;  // entry.h: the tiles
//     std::pair<int, int> bwd_sparse_tiles(const SoftmaxBwdParams&, DType) const;  //   to index a layout at
//     void reads(std::initializer_list<const Tensor*>) const;  // the tensors kernels may read
//     bool capturing() const;  // the current stream is capturing a CUDA graph (tile_index's rule)
//   };
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <tuple>
#include <utility>

#include "softmax/cuda/entry.h"  // FwdSplitScratch
#include "torch/block_index.h"
#include "torch/cuda_steps.h"  // cuda_scratch, run_backend
#include "torch/softmax_binding.h"

namespace attn {
namespace api {

// The tensor-core path reads rows as 16-byte chunks; give it a copy when dout is strided oddly.
inline Tensor chunk_friendly(Tensor t) {
  const bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % 8 == 0 &&
                  t.stride(1) % 8 == 0 && t.stride(2) % 8 == 0;
  return ok ? t : t.contiguous();
}

// Block-sparse calls: the layout's tile index at the tiles of the kernel that will run (csc = false:
// the forward's CSR, true: the backward's CSC), attached to p. The returned tensors must outlive
// the launch. (0, 0) tiles: that kernel reads the layout itself. Under a CUDA-graph capture the
// index must come from tile_index's cache (see there); asked only for block-sparse calls.
template <typename Device, typename P>
TileIndexTensors attach_tile_index(const Device& dev, P& p, const Options& o, std::pair<int, int> tiles, bool csc) {
  if (!o.block_layout.has_value() || tiles.first <= 0) return {};
  TileIndexTensors t =
      tile_index(*o.block_layout, o.block_size, p.sq, p.sk, tiles.first, tiles.second, csc, dev.capturing());
  (csc ? p.sparse.bwd : p.sparse.fwd) = t.view();
  return t;
}

// dropout's (seed, offset) is a host value read at launch, so a captured graph would replay one
// mask on every replay. Here, not in Python: a torch.compile'd graph run inside a capture reaches
// only the op. Every forward's steps check it.
template <typename Device>
void check_capture_dropout(const Device& dev, const Options& o) {
  TORCH_CHECK(!(o.dropout_p > 0.0 && dev.capturing()),
              "attention_ext: dropout_p > 0 inside a CUDA-graph capture would replay one dropout mask on every "
              "replay: capture without dropout, or run the step eagerly");
}

template <typename Device>
std::tuple<Tensor, Tensor> cuda_fwd_steps(const Device& dev, const Tensor& q, const Tensor& k, const Tensor& v,
                                          const Options& o, int64_t num_splits) {
  check_inputs(q, k, v, o);
  check_num_splits(num_splits);
  dev.check_device(q);
  const auto guard = dev.guard(q);
  check_capture_dropout(dev, o);
  auto [out, lse] = alloc_fwd_outputs(q, o, Device::kPoison);
  if (q.numel() == 0) return {out, lse};
  SoftmaxParams p = make_fwd_params<float>(q, k, v, out, lse, o);
  const DType dt = dtype_of(q);
  const TileIndexTensors index = attach_tile_index(dev, p, o, dev.fwd_sparse_tiles(p, dt), false);
  // split-KV: partial O and LSE per split, float32, on the call's device and stream
  FwdSplitScratch split;
  Tensor o_accum, lse_accum;
  split.num_splits = dev.fwd_num_splits(p, dt, int(std::min<int64_t>(num_splits, 1 << 20)));
  if (split.num_splits > 1) {
    split.rows = q.size(2);  // (B, H, Sq, D) or the varlen pack (1, H, total_q, D)
    o_accum = cuda_scratch(q, dev.fwd_split_floats(p, split.num_splits, q.size(0), split.rows, true), Device::kPoison);
    lse_accum = cuda_scratch(q, dev.fwd_split_floats(p, split.num_splits, q.size(0), split.rows, false), Device::kPoison);
    split.o_accum = o_accum.data_ptr<float>();
    split.lse_accum = lse_accum.data_ptr<float>();
  }
  dev.reads({&q, &k, &v});
  run_backend<Device>([&] { dev.fwd(p, dt, split); });
  return {out, lse};
}

// The forward with the 8-bit Q.K^T (softmax_fwd_quant): the op's rules (check_qk_quant, then the
// forward's), the 8-bit operands and scales at the kernel's blocks, the launch. A config the
// kernel does not take raises NotImplementedError naming what it takes (the Python layer then
// runs reference.attention_qk_int8, with a warning).
template <typename Device>
std::tuple<Tensor, Tensor> cuda_fwd_quant_steps(const Device& dev, const Tensor& q, const Tensor& k, const Tensor& v,
                                                const Options& o, c10::string_view qk_quant) {
  const int32_t code = check_qk_quant(q, o, qk_quant);
  check_inputs(q, k, v, o);
  dev.check_device(q);
  const auto guard = dev.guard(q);
  check_capture_dropout(dev, o);
  auto [out, lse] = alloc_fwd_outputs(q, o, Device::kPoison);
  if (q.numel() == 0) return {out, lse};
  SoftmaxParams p = make_fwd_params<float>(q, k, v, out, lse, o);
  p.qk_quant = code;
  const DType dt = dtype_of(q);
  const auto [bq, bk] = dev.fwd_q8_blocks(p, dt);
  TORCH_CHECK_NOT_IMPLEMENTED(bq > 0, Device::kWhat, ": qk_quant='", qk_quant, "' on CUDA runs on the tensor-core ",
                              "kernels: float16 / bfloat16 q, k, v with a head dim that is a multiple of 16 up to ",
                              "128, 16-byte aligned rows, no block_layout, on ",
                              code == kQkFp8 ? "sm_90 (the wgmma kernel: an extension built with sm_90a code, "
                                               "not turned off by set_cuda_kernels)"
                                             : "sm_80 or newer",
                              "; this call (", q.scalar_type(), ", head dim ", p.d, ") has no such kernel");
  // 8-bit q / k (int8, or e4m3 bits) in q's / k's shapes, contiguous (rows of d bytes: 16-byte aligned, see
  // Q8Operands), the scales, q . mean in lse's layout and the K means: one float32 scratch. At
  // least one key block and mean chunk, so an empty key range still has its mean written.
  Tensor q8 = at::empty(q.sizes(), q.options().dtype(at::kChar));
  Tensor k8 = at::empty(k.sizes(), k.options().dtype(at::kChar));
  p.q8.q_batch_stride = q8.stride(0);
  p.q8.q_head_stride = q8.stride(1);
  p.q8.q_row_stride = q8.stride(2);
  p.q8.k_batch_stride = k8.stride(0);
  p.q8.k_head_stride = k8.stride(1);
  p.q8.k_row_stride = k8.stride(2);
  p.q8.block_q = bq;
  p.q8.block_k = bk;
  p.q8.nbq = (p.sq + bq - 1) / bq;
  p.q8.nbk = std::max(1, (p.sk + bk - 1) / bk);
  const int64_t n_qs = int64_t(p.b) * p.h * p.q8.nbq, n_ks = int64_t(p.b) * p.h_k * p.q8.nbk;
  const int64_t n_mean = int64_t(p.b) * p.h_k * p.d;
  p.q8.nch = std::max(1, (p.sk + kQ8MeanKeys - 1) / kQ8MeanKeys);
  Tensor scratch = cuda_scratch(q, size_t(n_qs + n_ks + n_mean), Device::kPoison);
  Tensor k_sum = at::empty({int64_t(p.b) * p.h_k * p.q8.nch * p.d}, q.options().dtype(at::kDouble));
  Tensor k_count = at::empty({int64_t(p.b) * p.h_k * p.q8.nch}, q.options().dtype(at::kInt));
  Tensor q_mean = cuda_scratch(q, size_t(lse.numel()), Device::kPoison).view(lse.sizes());
  p.q8.q = q8.data_ptr<int8_t>();
  p.q8.k = k8.data_ptr<int8_t>();
  p.q8.q_scale = scratch.data_ptr<float>();
  p.q8.k_scale = p.q8.q_scale + n_qs;
  p.q8.k_mean = p.q8.k_scale + n_ks;
  p.q8.q_mean = q_mean.data_ptr<float>();
  p.q8.k_sum = k_sum.data_ptr<double>();
  p.q8.k_count = k_count.data_ptr<int32_t>();
  dev.reads({&q, &k, &v, &q8, &k8});
  run_backend<Device>([&] { dev.fwd_q8(p, dt); });
  return {out, lse};
}

template <typename Device>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> cuda_bwd_steps(const Device& dev, const Tensor& dout,
                                                                  const Tensor& q, const Tensor& k, const Tensor& v,
                                                                  const Tensor& out, const Tensor& lse,
                                                                  const Options& o, bool bias_grad,
                                                                  bool deterministic, const OptTensor& dlse) {
  check_inputs(q, k, v, o);
  dev.check_device(q);
  check_bwd_inputs(dout, q, out, lse, dlse);
  const auto guard = dev.guard(q);
  Grads g = alloc_grads(q, k, v, o, bias_grad, Device::kPoison);
  if (is_empty_call(q, k)) return {g.dq, g.dk, g.dv, g.dbias, g.dsinks};
  Tensor dout_c = chunk_friendly(dout.to(q.scalar_type()));
  SoftmaxBwdParams p = make_bwd_params<float>(dout_c, q, k, v, out, lse, dlse, o, g, deterministic);
  const DType dt = dtype_of(q);
  const TileIndexTensors index = attach_tile_index(dev, p, o, dev.bwd_sparse_tiles(p, dt), true);
  Tensor softmax_d = cuda_scratch(q, dev.bwd_softmax_d_floats(p), Device::kPoison);
  p.softmax_d = softmax_d.data_ptr<float>();
  Tensor dq_accum;
  const size_t n_accum = dev.bwd_dq_accum_floats(p, dt);
  if (n_accum > 0) {
    dq_accum = cuda_scratch(q, n_accum, Device::kPoison);
    p.dq_accum = dq_accum.data_ptr<float>();
  } else {
    p.dq_accum = nullptr;
  }
  dev.reads({&q, &k, &v, &dout_c, &out, &lse, &softmax_d});
  run_backend<Device>([&] { dev.bwd(p, dt); });
  return {g.dq, g.dk, g.dv, g.dbias, g.dsinks};
}

}  // namespace api
}  // namespace attn
