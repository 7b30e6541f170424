// torch.ops.attention_ext_emu.fwd / bwd: the CUDA backend's launch sequence (dispatch.cu) and
// kernels run by the host emulator on CPU tensors. Built at test time by tests/cuda_emu.py.
//
// The arguments are those of torch.ops.attention_ext.fwd / bwd (attention_ext/ops.py
// OPTION_NAMES; bwd's dlse comes before) plus `arch` (80 or 90: the emulated device). The bodies mirror fwd_cuda /
// bwd_cuda of csrc/api/attention_cuda.cpp (which needs a CUDA torch) step for step, except that
// every output and scratch buffer the kernels are meant to fill starts as NaN, so an element
// they fail to write fails the tests.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <functional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "../../api/attention_api.h"
#include "../../api/attention_api_impl.h"  // the definitions (this is the module's one torch TU)
#include "emu_entry.h"

namespace {

using at::Tensor;
using attn::api::OptTensor;
using attn::api::Options;

attn_emu::Backend backend(int64_t arch) {
  TORCH_CHECK(arch == 80 || arch == 90, "attention_ext_emu: arch must be 80 or 90, got ", arch);
  return arch == 80 ? attn_emu::backend_sm80() : attn_emu::backend_sm90();
}

void check_cpu(const Tensor& q) {
  TORCH_CHECK(q.device().is_cpu(), "attention_ext_emu: the emulator takes CPU tensors");
  TORCH_CHECK_TYPE(q.scalar_type() != at::kDouble, "attention_ext_emu: the CUDA kernels have no float64 path");
}

// cp.async may read only from the call's tensors
void allow_reads(std::initializer_list<const Tensor*> ts) {
  attn_emu::clear_global_ranges();
  for (const Tensor* t : ts) {
    if (t->defined() && t->numel() > 0) {
      const auto& st = t->storage();
      attn_emu::add_global_range(st.data(), st.nbytes());
    }
  }
}
void run(const char* what, const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, "attention_ext_emu ", what, ": ", e.what());
  }
}

std::tuple<Tensor, Tensor> emu_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& bias,
                                   const OptTensor& alibi, const OptTensor& sinks, const OptTensor& seqlens_k,
                                   const OptTensor& cu_q, const OptTensor& cu_k, int64_t max_q, int64_t max_k,
                                   double scale, double softcap, int64_t wl, int64_t wr, bool bottom_right,
                                   double dropout_p, int64_t seed, int64_t offset, int64_t num_splits,
                                   bool /*deterministic*/, int64_t arch) {
  const Options o{bias, alibi, sinks, seqlens_k, cu_q, cu_k, max_q, max_k, scale, softcap, wl, wr,
                  bottom_right, dropout_p, seed, offset};
  attn::api::check_inputs(q, k, v, o);
  attn::api::check_num_splits(num_splits);
  check_cpu(q);
  Tensor out = attn::api::empty_like_layout(q).fill_(NAN);
  Tensor lse = attn::api::empty_lse(q).fill_(NAN);
  if (q.numel() == 0 || cu_q.has_value()) {
    out.zero_();
    lse.fill_(-INFINITY);
  }
  if (q.numel() == 0) return {out, lse};
  const attn::FwdParams p = attn::api::make_fwd_params<float>(q, k, v, out, lse, o);
  allow_reads({&q, &k, &v});
  const attn_emu::Backend be = backend(arch);
  run("fwd", [&] { be.fwd(&p, sizeof(p), int(attn::api::dtype_of(q)), q.size(0), q.size(2), int(num_splits)); });
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> emu_bwd(
    const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
    const OptTensor& bias, const OptTensor& alibi, const OptTensor& sinks, const OptTensor& seqlens_k,
    const OptTensor& cu_q, const OptTensor& cu_k, int64_t max_q, int64_t max_k, double scale, double softcap,
    int64_t wl, int64_t wr, bool bottom_right, double dropout_p, int64_t seed, int64_t offset, bool bias_grad,
    bool deterministic, const OptTensor& dlse, int64_t arch) {
  const Options o{bias, alibi, sinks, seqlens_k, cu_q, cu_k, max_q, max_k, scale, softcap, wl, wr,
                  bottom_right, dropout_p, seed, offset};
  attn::api::check_inputs(q, k, v, o);
  check_cpu(q);
  attn::api::check_bwd_inputs(dout, q, out, lse, dlse);
  attn::api::Grads g = attn::api::alloc_grads(q, k, v, o, bias_grad);
  // alloc_grads zeroes dq / dk / dv when rows may belong to no sequence; otherwise the kernels
  // own every element. dbias and dsinks are zeroed by cuda_bwd itself.
  if (!seqlens_k.has_value() && !cu_q.has_value()) {
    g.dq.fill_(NAN);
    g.dk.fill_(NAN);
    g.dv.fill_(NAN);
  }
  if (g.dbias.numel() > 0) g.dbias.fill_(NAN);
  if (g.dsinks.numel() > 0) g.dsinks.fill_(NAN);
  if (cu_q.has_value() || q.numel() == 0 || k.size(2) == 0) {
    g.dq.zero_();
    g.dk.zero_();
    g.dv.zero_();
  }
  if (q.numel() == 0 || k.numel() == 0) return {g.dq, g.dk, g.dv, g.dbias, g.dsinks};
  // attention_cuda.cpp's chunk_friendly(): a copy when dout's rows are not 16-byte chunks
  Tensor dout_c = dout.to(q.scalar_type());
  const bool chunky = reinterpret_cast<uintptr_t>(dout_c.data_ptr()) % 16 == 0 && dout_c.stride(0) % 8 == 0 &&
                      dout_c.stride(1) % 8 == 0 && dout_c.stride(2) % 8 == 0;
  if (!chunky) dout_c = dout_c.contiguous();
  attn::BwdParams p = attn::api::make_bwd_params<float>(dout_c, q, k, v, out, lse, dlse, o, g, deterministic);
  const int dt = int(attn::api::dtype_of(q));
  const attn_emu::Backend be = backend(arch);
  const auto f32 = q.options().dtype(at::kFloat);
  Tensor softmax_d = at::full({int64_t(be.softmax_d_floats(&p, sizeof(p)))}, NAN, f32);
  p.softmax_d = softmax_d.data_ptr<float>();
  Tensor dq_accum;
  const size_t n_accum = be.dq_accum_floats(&p, sizeof(p), dt);
  if (n_accum > 0) {
    dq_accum = at::full({int64_t(n_accum)}, NAN, f32);
    p.dq_accum = dq_accum.data_ptr<float>();
  } else {
    p.dq_accum = nullptr;
  }
  allow_reads({&q, &k, &v, &dout_c, &out, &lse, &softmax_d});
  run("bwd", [&] { be.bwd(&p, sizeof(p), dt); });
  return {g.dq, g.dk, g.dv, g.dbias, g.dsinks};
}

// Which kernel family the forward of this config takes: "tensor-core" or "simt".
std::string emu_path(const Tensor& q, const Tensor& k, const Tensor& v, int64_t arch) {
  const Options o{std::nullopt, std::nullopt, std::nullopt, std::nullopt, std::nullopt, std::nullopt, 0, 0, 1.0,
                  0.0, -1, -1, false, 0.0, 0, 0};
  Tensor out = attn::api::empty_like_layout(q);
  Tensor lse = attn::api::empty_lse(q);
  const attn::FwdParams p = attn::api::make_fwd_params<float>(q, k, v, out, lse, o);
  return backend(arch).path_name(&p, sizeof(p), int(attn::api::dtype_of(q)));
}

std::vector<std::string> emu_launches() { return attn_emu::take_launches(); }

// set_cuda_kernels for both emulated archs
void emu_set_kernels(int64_t hopper_fwd, int64_t hopper_bwd, int64_t tune_fwd, int64_t tune_bwd, bool force_simt) {
  for (int64_t arch : {80, 90}) backend(arch).set_kernels(int(hopper_fwd), int(hopper_bwd), int(tune_fwd), int(tune_bwd), force_simt);
}

}  // namespace

TORCH_LIBRARY(attention_ext_emu, m) {
  m.def("fwd", &emu_fwd);
  m.def("bwd", &emu_bwd);
  m.def("path", &emu_path);
  m.def("launches", &emu_launches);
  m.def("set_cuda_kernels", &emu_set_kernels);
  m.def("set_schedule", [](bool warp_serial, bool reverse) { attn_emu::set_schedule(warp_serial, reverse); });
}
