// Tensors -> params for the fused softmax attention, the op schema, and the CPU registration.
#include <Python.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <string>

#include "../cpu/kernels.h"
#if defined(ATTN_WITH_CUDA)
#include "../cuda/launch.h"
#endif
#include "attention_api.h"
#include "attention_api_impl.h"  // the definitions, compiled in this TU

namespace {

using attn::api::OptTensor;
using attn::api::Options;
using at::Tensor;

Options make_options(const OptTensor& bias, const OptTensor& alibi, const OptTensor& sinks, const OptTensor& seqlens_k,
                     const OptTensor& cu_q, const OptTensor& cu_k, int64_t max_q, int64_t max_k, double scale,
                     double softcap, int64_t wl, int64_t wr, bool bottom_right, double dropout_p, int64_t seed,
                     int64_t offset) {
  return Options{bias, alibi, sinks, seqlens_k, cu_q, cu_k, max_q, max_k, scale, softcap, wl, wr, bottom_right,
                 dropout_p, seed, offset};
}

std::tuple<Tensor, Tensor> fwd_cpu(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& bias,
                                   const OptTensor& alibi, const OptTensor& sinks, const OptTensor& seqlens_k,
                                   const OptTensor& cu_q, const OptTensor& cu_k, int64_t max_q, int64_t max_k,
                                   double scale, double softcap, int64_t wl, int64_t wr, bool bottom_right,
                                   double dropout_p, int64_t seed, int64_t offset, int64_t num_splits,
                                   bool /*deterministic: read by the autograd backward*/) {
  const Options o = make_options(bias, alibi, sinks, seqlens_k, cu_q, cu_k, max_q, max_k, scale, softcap, wl, wr,
                                 bottom_right, dropout_p, seed, offset);
  attn::api::check_inputs(q, k, v, o);
  attn::api::check_num_splits(num_splits);
  Tensor out = attn::api::empty_like_layout(q);
  Tensor lse = attn::api::empty_lse(q);
  if (q.numel() == 0) {
    out.zero_();
    lse.fill_(-INFINITY);
    return {out, lse};
  }
  // rows the kernel does not own (past a varlen pack's end) are defined as 0 / -inf
  if (cu_q.has_value()) {
    out.zero_();
    lse.fill_(-INFINITY);
  }
  const attn::DType dt = attn::api::dtype_of(q);
  if (dt == attn::DType::kF64) {
    attn::cpu::fwd(attn::api::make_fwd_params<double>(q, k, v, out, lse, o), dt);
  } else {
    attn::cpu::fwd(attn::api::make_fwd_params<float>(q, k, v, out, lse, o), dt);
  }
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> bwd_cpu(
    const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
    const OptTensor& bias, const OptTensor& alibi, const OptTensor& sinks, const OptTensor& seqlens_k,
    const OptTensor& cu_q, const OptTensor& cu_k, int64_t max_q, int64_t max_k, double scale, double softcap,
    int64_t wl, int64_t wr, bool bottom_right, double dropout_p, int64_t seed, int64_t offset, bool bias_grad,
    bool deterministic, const OptTensor& dlse) {
  const Options o = make_options(bias, alibi, sinks, seqlens_k, cu_q, cu_k, max_q, max_k, scale, softcap, wl, wr,
                                 bottom_right, dropout_p, seed, offset);
  attn::api::check_inputs(q, k, v, o);
  attn::api::check_bwd_inputs(dout, q, out, lse, dlse);
  attn::api::Grads g = attn::api::alloc_grads(q, k, v, o, bias_grad);
  if (q.numel() == 0 || k.numel() == 0) {
    g.dq.zero_();
    g.dk.zero_();
    g.dv.zero_();
  }
  if (q.numel() > 0 && k.numel() > 0) {
    Tensor dout_c = dout.to(q.scalar_type());
    const attn::DType dt = attn::api::dtype_of(q);
    if (dt == attn::DType::kF64) {
      attn::cpu::bwd(attn::api::make_bwd_params<double>(dout_c, q, k, v, out, lse, dlse, o, g, deterministic), dt);
    } else {
      attn::cpu::bwd(attn::api::make_bwd_params<float>(dout_c, q, k, v, out, lse, dlse, o, g, deterministic), dt);
    }
  }
  return {g.dq, g.dk, g.dv, g.dbias, g.dsinks};
}

// Drawn on the CPU from the same Philox function the kernels use, then moved to `device`.
Tensor dropout_mask_cpu(int64_t b, int64_t h, int64_t sq, int64_t sk, double p, int64_t seed, int64_t offset,
                        std::optional<at::Device> device) {
  TORCH_CHECK_VALUE(b >= 0 && h >= 0 && sq >= 0 && sk >= 0, "attention_ext.dropout_mask: sizes must be >= 0");
  TORCH_CHECK_VALUE(p >= 0.0 && p < 1.0, "attention_ext.dropout_mask: p must be in [0, 1), got ", p);
  Tensor keep = at::empty({b, h, sq, sk}, at::TensorOptions().dtype(at::kBool));
  attn::cpu::dropout_mask(reinterpret_cast<uint8_t*>(keep.data_ptr<bool>()), int(b), int(h), int(sq), int(sk), float(p),
                          uint64_t(seed), uint64_t(offset));
  return device.has_value() ? keep.to(*device) : keep;
}

// The developer-only selection of experimental CUDA kernels (attn::CudaKernels); without the
// CUDA kernels it only checks its arguments.
void set_cuda_kernels(int64_t hopper_fwd, int64_t hopper_bwd, int64_t tune_fwd, int64_t tune_bwd, bool force_simt) {
  TORCH_CHECK_VALUE(hopper_fwd >= 0 && hopper_fwd <= 2, "attention_ext.set_cuda_kernels: hopper_fwd must be 0, 1 or 2");
  TORCH_CHECK_VALUE(hopper_bwd >= 0 && hopper_bwd <= 1, "attention_ext.set_cuda_kernels: hopper_bwd must be 0 or 1");
  TORCH_CHECK_VALUE(tune_fwd >= 0 && tune_bwd >= 0, "attention_ext.set_cuda_kernels: tuning candidates are >= 0");
#if defined(ATTN_WITH_CUDA)
  attn::cuda_set_kernels(attn::CudaKernels{int(hopper_fwd), int(hopper_bwd), int(tune_fwd), int(tune_bwd), force_simt});
#endif
}

}  // namespace

#define ATTN_OPTIONS_SCHEMA                                                                                       \
  "Tensor? bias, Tensor? alibi_slopes, Tensor? sinks, Tensor? seqlens_k, Tensor? cu_seqlens_q, "                  \
  "Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float scale, float softcap, int window_left, "      \
  "int window_right, bool bottom_right, float dropout_p, int seed, int offset"

TORCH_LIBRARY(attention_ext, m) {
  m.def("fwd(Tensor q, Tensor k, Tensor v, " ATTN_OPTIONS_SCHEMA
        ", int num_splits=1, bool deterministic=False) -> (Tensor, Tensor)");
  m.def("bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, " ATTN_OPTIONS_SCHEMA
        ", bool bias_grad, bool deterministic, Tensor? dlse=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "dropout_mask(int b, int h, int sq, int sk, float p, int seed, int offset, Device? device=None) -> Tensor");
  m.def("set_cuda_kernels(int hopper_fwd, int hopper_bwd, int tune_fwd, int tune_bwd, bool force_simt) -> ()",
        &set_cuda_kernels);
}

TORCH_LIBRARY_IMPL(attention_ext, CPU, m) {
  m.impl("fwd", &fwd_cpu);
  m.impl("bwd", &bwd_cpu);
}

TORCH_LIBRARY_IMPL(attention_ext, CompositeExplicitAutograd, m) { m.impl("dropout_mask", &dropout_mask_cpu); }

// What was compiled, for `python -m attention_ext info`.
static const char* cpu_isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#elif defined(__AVX__)
  return "avx";
#else
  return "generic";
#endif
}

static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "attention_ext compiled kernels (ops live in torch.ops.attention_ext)", -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* mod = PyModule_Create(&module_def);
  if (mod == nullptr) return nullptr;
  PyModule_AddStringConstant(mod, "cpu_isa", cpu_isa());
  PyModule_AddIntConstant(mod, "simd_width", attn::cpu::simd_width());
#if defined(ATTN_WITH_CUDA)
  PyModule_AddIntConstant(mod, "with_cuda", 1);
  PyModule_AddStringConstant(mod, "cuda_archs", ATTN_CUDA_ARCHS);
#else
  PyModule_AddIntConstant(mod, "with_cuda", 0);
  PyModule_AddStringConstant(mod, "cuda_archs", "");
#endif
  #if defined(_OPENMP)
  PyModule_AddIntConstant(mod, "openmp", 1);
#else
  PyModule_AddIntConstant(mod, "openmp", 0);
#endif
  return mod;
}
