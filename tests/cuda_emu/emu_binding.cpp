// torch.ops.attention_ext_emu: the CUDA backend's host steps (csrc/torch/softmax_cuda_steps.h,
// the same code as the real CUDA binding), launch sequence (dispatch.cu) and kernels run by the
// host emulator on CPU tensors. Built at test time by build.py.
//
// topk_threshold those of torch.ops.attention_ext.topk_threshold plus `arch` (sparse_cuda_steps.h);
// fwd / bwd take the arguments of torch.ops.attention_ext.softmax_fwd / softmax_bwd plus `arch` (80 or 90: the
// emulated device); linear_fwd / linear_bwd those of torch.ops.attention_ext.linear_fwd /
// linear_bwd plus `arch` (csrc/torch/linear_cuda_steps.h). Unlike the real binding, every output and scratch buffer the kernels are
// meant to fill starts as NaN (Device::kPoison), so an element they fail to write fails the tests.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <initializer_list>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/fp8.h"
#include "emu_entry.h"
#include "torch/linear_cuda_steps.h"
#include "torch/softmax_cuda_steps.h"
#include "torch/sparse_cuda_steps.h"
#include "torch/softmax_binding.h"

namespace {

using at::Tensor;
using attn::api::OptTensor;

attn_emu::Backend backend(int64_t arch) {
  TORCH_CHECK(arch == 80 || arch == 90, "attention_ext_emu: arch must be 80 or 90, got ", arch);
  return arch == 80 ? attn_emu::backend_sm80() : attn_emu::backend_sm90();
}

bool g_capturing = false;

// Params cross to the emulated build as bytes (emu_entry.h).
struct EmuDevice {
  static constexpr bool kPoison = true;
  static constexpr const char* kWhat = "attention_ext_emu";
  attn_emu::Backend be;

  void check_device(const Tensor& q) const {
    TORCH_CHECK(q.device().is_cpu(), "attention_ext_emu: the emulator takes CPU tensors");
    TORCH_CHECK_TYPE(q.scalar_type() != at::kDouble, "attention_ext_emu: the CUDA kernels have no float64 path");
  }
  int guard(const Tensor&) const { return 0; }
  int fwd_num_splits(const attn::SoftmaxParams& p, attn::DType dt, int requested) const {
    return be.fwd_num_splits(&p, sizeof(p), int(dt), requested);
  }
  size_t fwd_split_floats(const attn::SoftmaxParams& p, int n, int64_t batch_t, int64_t rows, bool o) const {
    return be.fwd_split_floats(&p, sizeof(p), n, batch_t, rows, o);
  }
  void fwd(const attn::SoftmaxParams& p, attn::DType dt, const attn::FwdSplitScratch& s) const {
    be.fwd(&p, sizeof(p), int(dt), s.num_splits, s.rows, s.o_accum, s.lse_accum);
  }
  std::pair<int, int> fwd_q8_blocks(const attn::SoftmaxParams& p, attn::DType dt) const {
    int bq = 0, bk = 0;
    be.fwd_q8_blocks(&p, sizeof(p), int(dt), &bq, &bk);
    return {bq, bk};
  }
  void fwd_q8(const attn::SoftmaxParams& p, attn::DType dt) const { be.fwd_q8(&p, sizeof(p), int(dt)); }
  size_t bwd_softmax_d_floats(const attn::SoftmaxBwdParams& p) const { return be.softmax_d_floats(&p, sizeof(p)); }
  size_t bwd_dq_accum_floats(const attn::SoftmaxBwdParams& p, attn::DType dt) const {
    return be.dq_accum_floats(&p, sizeof(p), int(dt));
  }
  void bwd(const attn::SoftmaxBwdParams& p, attn::DType dt) const { be.bwd(&p, sizeof(p), int(dt)); }
  std::pair<int, int> fwd_sparse_tiles(const attn::SoftmaxParams& p, attn::DType dt) const {
    int m = 0, n = 0;
    be.sparse_tiles(&p, sizeof(p), int(dt), false, &m, &n);
    return {m, n};
  }
  std::pair<int, int> bwd_sparse_tiles(const attn::SoftmaxBwdParams& p, attn::DType dt) const {
    int m = 0, n = 0;
    be.sparse_tiles(&p, sizeof(p), int(dt), true, &m, &n);
    return {m, n};
  }
  // set_capturing (emulator.capture in the tests): the host steps act as under a CUDA-graph capture
  bool capturing() const { return g_capturing; }
  // cp.async may read only from the call's tensors
  void reads(std::initializer_list<const Tensor*> ts) const {
    attn_emu::clear_global_ranges();
    for (const Tensor* t : ts) {
      if (t->defined() && t->numel() > 0) {
        const auto& st = t->storage();
        attn_emu::add_global_range(st.data(), st.nbytes());
      }
    }
  }
};

// The sparse family's Device (sparse_cuda_steps.h) on the emulated backend.
struct EmuSparseDevice {
  static constexpr bool kPoison = true;
  static constexpr const char* kWhat = "attention_ext_emu";
  attn_emu::Backend be;

  void check_device(const Tensor& q) const {
    TORCH_CHECK(q.device().is_cpu(), "attention_ext_emu: the emulator takes CPU tensors");
    TORCH_CHECK_TYPE(q.scalar_type() != at::kDouble, "attention_ext_emu: the CUDA kernels have no float64 path");
  }
  int guard(const Tensor&) const { return 0; }
  size_t topk_scratch_entries(const attn::SoftmaxParams& p, int k_top) const {
    return be.topk_scratch_entries(&p, sizeof(p), k_top);
  }
  void topk_threshold(const attn::SoftmaxParams& p, attn::DType dt, int k_top, float* thr, int32_t* jcut, float* s_logit,
                      int32_t* s_key) const {
    be.topk_threshold(&p, sizeof(p), int(dt), k_top, thr, jcut, s_logit, s_key);
  }
  void reads(std::initializer_list<const Tensor*>) const {}
};

std::tuple<Tensor, Tensor> emu_topk_threshold(const Tensor& q, const Tensor& k ATTN_SOFTMAX_OPTIONS_PARAMS,
                                              int64_t k_top, int64_t arch) {
  return attn::api::cuda_topk_steps(EmuSparseDevice{backend(arch)}, q, k,
                                    ATTN_SOFTMAX_MAKE_OPTIONS(), k_top);
}

// The linear family's Device (linear_cuda_steps.h) on the emulated backend.
struct EmuLinearDevice {
  static constexpr bool kPoison = true;
  static constexpr const char* kWhat = "attention_ext_emu";
  attn_emu::Backend be;

  void check_device(const Tensor& q) const {
    TORCH_CHECK(q.device().is_cpu(), "attention_ext_emu: the emulator takes CPU tensors");
    TORCH_CHECK_TYPE(q.scalar_type() != at::kDouble, "attention_ext_emu: the CUDA kernels have no float64 path");
  }
  int guard(const Tensor&) const { return 0; }
  attn::LinearCudaKernels linear_kernels() const {
    attn::LinearCudaKernels k;
    be.linear_kernels(&k.chunk_parallel, &k.segment_chunks, &k.chunk_states);
    return k;
  }
  size_t linear_fwd_scratch_floats(const attn::LinearParamsT<float>& p, attn::DType dt,
                                   const attn::LinearCudaKernels& k) const {
    return be.linear_fwd_scratch_floats(&p, sizeof(p), int(dt), k.chunk_parallel, k.segment_chunks, k.chunk_states);
  }
  void linear_fwd(const attn::LinearParamsT<float>& p, attn::DType dt, const attn::LinearCudaKernels& k,
                  float* scratch) const {
    be.linear_fwd(&p, sizeof(p), int(dt), k.chunk_parallel, k.segment_chunks, k.chunk_states, scratch);
  }
  size_t linear_bwd_scratch_floats(const attn::LinearBwdParamsT<float>& p, attn::DType dt,
                                   const attn::LinearCudaKernels& k) const {
    return be.linear_bwd_scratch_floats(&p, sizeof(p), int(dt), k.chunk_parallel, k.segment_chunks, k.chunk_states);
  }
  void linear_bwd(const attn::LinearBwdParamsT<float>& p, attn::DType dt, const attn::LinearCudaKernels& k,
                  float* scratch) const {
    be.linear_bwd(&p, sizeof(p), int(dt), k.chunk_parallel, k.segment_chunks, k.chunk_states, scratch);
  }
  void linear_step(const attn::LinearStepParamsT<float>& p, attn::DType dt) const {
    be.linear_step(&p, sizeof(p), int(dt));
  }
  // cp.async may read only from the call's tensors (the chunk-state forward's)
  void reads(std::initializer_list<const Tensor*> ts) const {
    attn_emu::clear_global_ranges();
    for (const Tensor* t : ts) {
      if (t->defined() && t->numel() > 0) attn_emu::add_global_range(t->storage().data(), t->storage().nbytes());
    }
  }
};

Tensor emu_linear_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor state, const OptTensor& normalizer,
                       const OptTensor& decay, int64_t feature_map, double eps, double scale, int64_t arch) {
  return attn::api::linear_cuda_step_steps(EmuLinearDevice{backend(arch)}, q, k, v, state, normalizer, decay,
                                           feature_map, eps, scale);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> emu_linear_fwd(const Tensor& q, const Tensor& k, const Tensor& v
                                                          ATTN_LINEAR_OPTIONS_PARAMS, int64_t arch,
                                                          bool keep_residual) {
  return attn::api::linear_cuda_fwd_steps(EmuLinearDevice{backend(arch)}, q, k, v, ATTN_LINEAR_MAKE_OPTIONS(),
                                          keep_residual);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> emu_linear_bwd(const Tensor& dout, const OptTensor& dfinal_state,
                                                                  const Tensor& q, const Tensor& k, const Tensor& v,
                                                                  const Tensor& out, const Tensor& den
                                                                      ATTN_LINEAR_OPTIONS_PARAMS, int64_t arch,
                                                                  const OptTensor& out_residual) {
  return attn::api::linear_cuda_bwd_steps(EmuLinearDevice{backend(arch)}, dout, dfinal_state, q, k, v, out, den,
                                          out_residual, ATTN_LINEAR_MAKE_OPTIONS());
}

std::tuple<Tensor, Tensor> emu_fwd(const Tensor& q, const Tensor& k, const Tensor& v ATTN_SOFTMAX_OPTIONS_PARAMS,
                                   int64_t num_splits, bool /*deterministic*/, int64_t arch) {
  return attn::api::cuda_fwd_steps(EmuDevice{backend(arch)}, q, k, v,
                                   ATTN_SOFTMAX_MAKE_OPTIONS(), num_splits);
}

std::tuple<Tensor, Tensor> emu_fwd_quant(const Tensor& q, const Tensor& k, const Tensor& v ATTN_SOFTMAX_OPTIONS_PARAMS,
                                         c10::string_view qk_quant, int64_t arch) {
  return attn::api::cuda_fwd_quant_steps(EmuDevice{backend(arch)}, q, k, v, ATTN_SOFTMAX_MAKE_OPTIONS(), qk_quant);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> emu_bwd(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                           const Tensor& v, const Tensor& out, const Tensor& lse
                                                               ATTN_SOFTMAX_OPTIONS_PARAMS, bool bias_grad,
                                                           bool deterministic, const OptTensor& dlse, int64_t arch) {
  return attn::api::cuda_bwd_steps(EmuDevice{backend(arch)}, dout, q, k, v, out, lse,
                                   ATTN_SOFTMAX_MAKE_OPTIONS(), bias_grad, deterministic,
                                   dlse);
}

// Which kernel family the forward of a default-options call takes: "tensor-core" or "simt".
std::string emu_path(const Tensor& q, const Tensor& k, const Tensor& v, int64_t arch) {
  const attn::api::Options o{std::nullopt, std::nullopt, std::nullopt, std::nullopt, std::nullopt, std::nullopt,
                             0, 0, 1.0, 0.0, -1, -1, false, 0.0, 0, 0, std::nullopt};
  auto [out, lse] = attn::api::alloc_fwd_outputs(q, o);
  const attn::SoftmaxParams p = attn::api::make_fwd_params<float>(q, k, v, out, lse, o);
  return backend(arch).path_name(&p, sizeof(p), int(attn::api::dtype_of(q)));
}

std::vector<std::string> emu_launches() { return attn_emu::take_launches(); }

// (launches, 5) int64: take_launch_stats()'s fields per launch since the last call
Tensor emu_launch_stats() {
  const std::vector<attn_emu::LaunchStats> st = attn_emu::take_launch_stats();
  Tensor t = at::empty({int64_t(st.size()), 5}, at::kLong);
  for (size_t i = 0; i < st.size(); ++i) {
    const uint64_t f[5] = {st[i].ctas, st[i].threads, st[i].mma, st[i].barriers, st[i].cp_async_bytes};
    for (int j = 0; j < 5; ++j) t[int64_t(i)][j] = int64_t(f[j]);
  }
  return t;
}

// set_cuda_kernels for both emulated archs
void emu_set_kernels(int64_t hopper_fwd, int64_t hopper_bwd, int64_t tune_fwd, int64_t tune_bwd, bool force_simt) {
  for (int64_t arch : {80, 90})
    backend(arch).set_kernels(int(hopper_fwd), int(hopper_bwd), int(tune_fwd), int(tune_bwd), force_simt);
}

// d = a b + c through the emulated wgmma (wgmma_test_kernel.cuh), variant 0..4
// common/fp8.h's float_to_e4m3 on each element of a float32 tensor: the bytes (uint8), for a
// comparison with torch's float8_e4m3fn conversion
Tensor emu_e4m3_encode(const Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "e4m3_encode takes float32");
  const Tensor xc = x.contiguous();
  Tensor out = at::empty(xc.sizes(), xc.options().dtype(at::kByte));
  const float* src = xc.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t i = 0; i < xc.numel(); ++i) dst[i] = uint8_t(attn::float_to_e4m3(src[i]));
  return out;
}

Tensor emu_wgmma_test(const Tensor& a, const Tensor& b, const Tensor& c, int64_t variant) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && c.dim() == 2 && a.size(0) == 64 && a.size(1) == b.size(0) &&
                  c.size(0) == 64 && c.size(1) == b.size(1),
              "wgmma_test: a (64, k), b (k, n), c (64, n)");
  const int64_t k = a.size(1), n = b.size(1);
  TORCH_CHECK((k == 64 || k == 128) && (n == 64 || n == 128), "wgmma_test: k and n in {64, 128}");
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && (a.scalar_type() == at::kHalf || a.scalar_type() == at::kBFloat16),
              "wgmma_test: a, b float16 or bfloat16");
  TORCH_CHECK(variant >= 0 && variant <= 4, "wgmma_test: variant 0..4");
  const Tensor ac = a.contiguous(), bc = b.contiguous(), cc = c.to(at::kFloat).contiguous();
  Tensor d = at::empty({64, n}, c.options().dtype(at::kFloat));
  backend(90).wgmma_test(ac.data_ptr(), bc.data_ptr(), cc.data_ptr<float>(), d.data_ptr<float>(),
                         int(attn::api::dtype_of(ac)), int(n), int(k), int(variant));
  return d;
}

// linear_set_cuda_kernels for both emulated archs
void emu_linear_set_kernels(bool chunk_parallel, int64_t segment_chunks, bool chunk_states) {
  for (int64_t arch : {80, 90}) backend(arch).linear_set_kernels(chunk_parallel, int(segment_chunks), chunk_states);
}

// the current linear selection of the sm_80 build (both archs are always set together)
std::tuple<bool, int64_t, bool> emu_linear_kernels() {
  bool chunk_parallel = false, chunk_states = false;
  int segment_chunks = 0;
  backend(80).linear_kernels(&chunk_parallel, &segment_chunks, &chunk_states);
  return {chunk_parallel, int64_t(segment_chunks), chunk_states};
}

void emu_set_schedule(bool warp_serial, bool reverse) { attn_emu::set_schedule(warp_serial, reverse); }

void emu_set_capturing(bool capturing) { g_capturing = capturing; }

}  // namespace

TORCH_LIBRARY(attention_ext_emu, m) {
  m.def("fwd(Tensor q, Tensor k, Tensor v" ATTN_SOFTMAX_OPTIONS_SCHEMA
        ", int num_splits, bool deterministic, int arch) -> (Tensor, Tensor)",
        &emu_fwd);
  m.def("fwd_quant(Tensor q, Tensor k, Tensor v" ATTN_SOFTMAX_OPTIONS_SCHEMA ", str qk_quant, int arch) -> (Tensor, Tensor)",
        &emu_fwd_quant);
  m.def("bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse" ATTN_SOFTMAX_OPTIONS_SCHEMA
        ", bool bias_grad, bool deterministic, Tensor? dlse, int arch) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
        &emu_bwd);
  m.def("path(Tensor q, Tensor k, Tensor v, int arch) -> str", &emu_path);
  m.def("topk_threshold(Tensor q, Tensor k" ATTN_SOFTMAX_OPTIONS_SCHEMA ", int k_top, int arch) -> (Tensor, Tensor)",
        &emu_topk_threshold);
  m.def("launches() -> str[]", &emu_launches);
  m.def("launch_stats() -> Tensor", &emu_launch_stats);
  m.def("wgmma_test(Tensor a, Tensor b, Tensor c, int variant) -> Tensor", &emu_wgmma_test);
  m.def("e4m3_encode(Tensor x) -> Tensor", &emu_e4m3_encode);
  m.def("set_cuda_kernels(int hopper_fwd, int hopper_bwd, int tune_fwd, int tune_bwd, bool force_simt) -> ()",
        &emu_set_kernels);
  m.def("set_schedule(bool warp_serial, bool reverse) -> ()", &emu_set_schedule);
  m.def("linear_set_cuda_kernels(bool chunk_parallel, int segment_chunks, bool chunk_states=False) -> ()", &emu_linear_set_kernels);
  m.def("linear_cuda_kernels() -> (bool, int, bool)", &emu_linear_kernels);
  m.def("linear_step(Tensor q, Tensor k, Tensor v, Tensor(a!) state, Tensor(b!)? normalizer, Tensor? decay, "
        "int feature_map, float eps, float scale, int arch) -> Tensor",
        &emu_linear_step);
  m.def("set_capturing(bool capturing) -> ()", &emu_set_capturing);
  m.def("linear_fwd(Tensor q, Tensor k, Tensor v" ATTN_LINEAR_OPTIONS_SCHEMA ", int arch, bool keep_residual=False) -> (Tensor, Tensor, Tensor, Tensor)",
        &emu_linear_fwd);
  m.def("linear_bwd(Tensor dout, Tensor? dfinal_state, Tensor q, Tensor k, Tensor v, Tensor out, Tensor den"
        ATTN_LINEAR_OPTIONS_SCHEMA ", int arch, Tensor? out_residual=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
        &emu_linear_bwd);
}
