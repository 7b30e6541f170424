// CUDA registration of attention_ext::fwd / attention_ext::bwd: the only CUDA-side file that
// includes torch. Input checks, output allocation and tensors -> params are shared with the
// CPU registration (attention_api.h); this file adds the device guard, the current stream,
// the backward's float32 scratch, and turns kernel errors into Python exceptions.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <nvtx3/nvToolsExt.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <tuple>

#include "../cuda/launch.h"
#include "attention_api.h"

namespace {

using at::Tensor;
using attn::api::OptTensor;
using attn::api::Options;

struct NvtxRange {
  explicit NvtxRange(const char* name) { nvtxRangePushA(name); }
  ~NvtxRange() { nvtxRangePop(); }
};

Options make_options(const OptTensor& bias, const OptTensor& alibi, const OptTensor& sinks,
                     const OptTensor& seqlens_k, const OptTensor& cu_q, const OptTensor& cu_k,
                     int64_t max_q, int64_t max_k, double scale, double softcap, int64_t wl, int64_t wr,
                     bool bottom_right, double dropout_p, int64_t seed, int64_t offset) {
  return Options{bias, alibi, sinks, seqlens_k, cu_q, cu_k, max_q, max_k, scale, softcap, wl, wr,
                 bottom_right, dropout_p, seed, offset};
}

// The CUDA kernels compute in float32; float64 has a kernel on the CPU only.
void check_cuda_dtype(const Tensor& q) {
  TORCH_CHECK_TYPE(q.scalar_type() != at::kDouble,
                   "attention_ext: float64 inputs are supported by the CPU kernels only; on CUDA use float32, "
                   "float16 or bfloat16");
}

// The tensor-core path reads rows as 16-byte chunks; give it a copy when dout is strided oddly.
Tensor chunk_friendly(Tensor t) {
  const bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % 8 == 0 &&
                  t.stride(1) % 8 == 0 && t.stride(2) % 8 == 0;
  return ok ? t : t.contiguous();
}

std::tuple<Tensor, Tensor> fwd_cuda(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const OptTensor& bias, const OptTensor& alibi,
                                    const OptTensor& sinks, const OptTensor& seqlens_k,
                                    const OptTensor& cu_q, const OptTensor& cu_k, int64_t max_q,
                                    int64_t max_k, double scale, double softcap, int64_t wl,
                                    int64_t wr, bool bottom_right, double dropout_p, int64_t seed,
                                    int64_t offset, int64_t num_splits,
                                    bool /*deterministic: read by the autograd backward*/) {
  NvtxRange range("attention_ext::fwd (CUDA)");
  const Options o = make_options(bias, alibi, sinks, seqlens_k, cu_q, cu_k, max_q, max_k, scale,
                                 softcap, wl, wr, bottom_right, dropout_p, seed, offset);
  attn::api::check_inputs(q, k, v, o);
  attn::api::check_num_splits(num_splits);
  check_cuda_dtype(q);
  const c10::cuda::CUDAGuard guard(q.device());
  Tensor out = attn::api::empty_like_layout(q);
  Tensor lse = attn::api::empty_lse(q);
  // rows the kernel does not own (empty inputs, past a varlen pack's end) are 0 / -inf
  if (q.numel() == 0 || cu_q.has_value()) {
    out.zero_();
    lse.fill_(-INFINITY);
  }
  if (q.numel() == 0) return {out, lse};
  const attn::FwdParams p = attn::api::make_fwd_params<float>(q, k, v, out, lse, o);
  const attn::DType dt = attn::api::dtype_of(q);
  try {
    // split-KV scratch (float32, on the current stream's allocator): partial O and LSE per split
    attn::FwdSplitScratch split;
    Tensor o_accum, lse_accum;
    split.num_splits = attn::cuda_fwd_num_splits(p, dt, int(std::min<int64_t>(num_splits, 1 << 20)));
    if (split.num_splits > 1) {
      const auto f32 = q.options().dtype(at::kFloat);
      split.rows = q.size(2);  // (B, H, Sq, D) or the varlen pack (1, H, total_q, D)
      o_accum = at::empty({int64_t(attn::cuda_fwd_split_floats(p, split.num_splits, q.size(0), split.rows, true))}, f32);
      lse_accum = at::empty({int64_t(attn::cuda_fwd_split_floats(p, split.num_splits, q.size(0), split.rows, false))}, f32);
      split.o_accum = o_accum.data_ptr<float>();
      split.lse_accum = lse_accum.data_ptr<float>();
    }
    attn::cuda_fwd(p, dt, c10::cuda::getCurrentCUDAStream().stream(), split);
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, "attention_ext: ", e.what());
  }
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> bwd_cuda(
    const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& lse, const OptTensor& bias, const OptTensor& alibi, const OptTensor& sinks,
    const OptTensor& seqlens_k, const OptTensor& cu_q, const OptTensor& cu_k, int64_t max_q,
    int64_t max_k, double scale, double softcap, int64_t wl, int64_t wr, bool bottom_right,
    double dropout_p, int64_t seed, int64_t offset, bool bias_grad, bool deterministic,
    const OptTensor& dlse) {
  NvtxRange range("attention_ext::bwd (CUDA)");
  const Options o = make_options(bias, alibi, sinks, seqlens_k, cu_q, cu_k, max_q, max_k, scale,
                                 softcap, wl, wr, bottom_right, dropout_p, seed, offset);
  attn::api::check_inputs(q, k, v, o);
  check_cuda_dtype(q);
  attn::api::check_bwd_inputs(dout, q, out, lse, dlse);
  const c10::cuda::CUDAGuard guard(q.device());
  attn::api::Grads g = attn::api::alloc_grads(q, k, v, o, bias_grad);
  // rows no sequence owns (past a varlen pack's end) and empty inputs get zero gradients
  if (cu_q.has_value() || q.numel() == 0 || k.size(2) == 0) {
    g.dq.zero_();
    g.dk.zero_();
    g.dv.zero_();
  }
  if (q.numel() == 0 || k.numel() == 0) return {g.dq, g.dk, g.dv, g.dbias, g.dsinks};
  Tensor dout_c = chunk_friendly(dout.to(q.scalar_type()));
  attn::BwdParams p =
      attn::api::make_bwd_params<float>(dout_c, q, k, v, out, lse, dlse, o, g, deterministic);
  const attn::DType dt = attn::api::dtype_of(q);
  const auto f32 = q.options().dtype(at::kFloat);
  Tensor softmax_d = at::empty({int64_t(attn::cuda_bwd_softmax_d_floats(p))}, f32);
  p.softmax_d = softmax_d.data_ptr<float>();
  Tensor dq_accum;
  const size_t n_accum = attn::cuda_bwd_dq_accum_floats(p, dt);
  if (n_accum > 0) {
    dq_accum = at::empty({int64_t(n_accum)}, f32);
    p.dq_accum = dq_accum.data_ptr<float>();
  } else {
    p.dq_accum = nullptr;
  }
  try {
    attn::cuda_bwd(p, dt, c10::cuda::getCurrentCUDAStream().stream());
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, "attention_ext: ", e.what());
  }
  return {g.dq, g.dk, g.dv, g.dbias, g.dsinks};
}

}  // namespace

TORCH_LIBRARY_IMPL(attention_ext, CUDA, m) {
  m.impl("fwd", &fwd_cuda);
  m.impl("bwd", &bwd_cuda);
}
