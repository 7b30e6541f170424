// The host steps of the CUDA linear attention forward and backward between the op's tensors and
// the torch-free backend (csrc/linear/cuda/entry.h): checks (linear_binding.h), outputs, params,
// the backward's scratch, the launch, errors. One copy for the real CUDA binding
// (linear_cuda.cpp) and the CPU emulator's, which differ only in their `Device`:
//
//   struct Device {
//     static constexpr bool kPoison;       // outputs start as NaN where the kernels write (the emulator)
//     static constexpr const char* kWhat;  // error-message prefix
//     void check_device(const Tensor& q) const;  // dtype / device the backend takes
//     <RAII> guard(const Tensor& q) const;       // device guard for the call
//     LinearCudaKernels linear_kernels() const;  // the selection's snapshot, one per call
//     size_t linear_fwd_scratch_floats(const LinearParamsT<float>&, DType, const LinearCudaKernels&) const;
//     void linear_fwd(const LinearParamsT<float>&, DType, const LinearCudaKernels&, float* scratch) const;
//     size_t linear_bwd_scratch_floats(const LinearBwdParamsT<float>&, DType, const LinearCudaKernels&) const;
//     void linear_bwd(const LinearBwdParamsT<float>&, DType, const LinearCudaKernels&, float* scratch) const;
//     void linear_step(const LinearStepParamsT<float>&, DType) const;
//     void reads(std::initializer_list<const Tensor*>) const;  // the tensors kernels may cp.async from
//   };
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <optional>
#include <tuple>

#include "linear/cuda/entry.h"  // LinearCudaKernels
#include "torch/linear_binding.h"
#include "torch/cuda_steps.h"  // run_backend
#include "torch/tensor_rules.h"  // dtype_of

namespace attn {
namespace api {

// Rows the kernels write: the whole sequence dim, or a varlen pack's [0, cu_seqlens[-1]) (the
// tail stays the zeros alloc_* gave it). Poisoning reads cu_seqlens on the host: emulator only.
inline void poison_rows(at::Tensor t, const LinearOptions& o) {
  if (!t.defined() || t.numel() == 0) return;
  if (o.cu_seqlens.has_value()) {
    const int64_t used = o.cu_seqlens->cpu()[-1].item<int64_t>();
    t.narrow(2, 0, used).fill_(NAN);
  } else {
    t.fill_(NAN);
  }
}

inline bool linear_empty_call(const at::Tensor& q, const at::Tensor& v) {
  return q.numel() == 0 || v.numel() == 0 || q.size(2) == 0;
}

template <typename Device>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_cuda_fwd_steps(const Device& dev, const at::Tensor& q,
                                                                     const at::Tensor& k, const at::Tensor& v,
                                                                     const LinearOptions& o, bool keep_residual) {
  check_linear_inputs(q, k, v, o);
  dev.check_device(q);
  check_cuda_residual(q, o, keep_residual);
  const auto guard = dev.guard(q);
  auto [out, den, state, res] = alloc_linear_outputs(q, v, o, keep_residual);
  if (linear_empty_call(q, v)) return {out, den, state, res};
  if constexpr (Device::kPoison) {
    poison_rows(out, o);
    poison_rows(res, o);
    poison_rows(den.unsqueeze(-1), o);
    state.fill_(NAN);
  }
  const LinearParamsT<float> p = make_linear_params<float>(q, k, v, out, den, state, o, res);
  const DType dt = dtype_of(q);
  // the chunk-parallel forward's segment states (entry.h); every element is written before it is read
  const LinearCudaKernels kern = dev.linear_kernels();  // one snapshot sizes and launches
  const int64_t scratch_floats = int64_t(dev.linear_fwd_scratch_floats(p, dt, kern));
  at::Tensor scratch;
  if (scratch_floats > 0) scratch = at::empty({scratch_floats}, q.options().dtype(at::kFloat));
  if constexpr (Device::kPoison) {  // all-ones bits: NaN as float32 and as the 16-bit chunk states
    if (scratch.defined()) scratch.view(at::kInt).fill_(-1);
  }
  dev.reads({&q, &k, &v, &scratch});
  run_backend<Device>([&] { dev.linear_fwd(p, dt, kern, scratch.defined() ? scratch.data_ptr<float>() : nullptr); });
  return {out, den, state, res};
}

template <typename Device>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_cuda_bwd_steps(
    const Device& dev, const at::Tensor& dout, const std::optional<at::Tensor>& dfinal_state, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& den,
    const std::optional<at::Tensor>& out_residual, const LinearOptions& o) {
  check_linear_inputs(q, k, v, o);
  dev.check_device(q);
  check_linear_bwd_inputs(dout, dfinal_state, q, v, out, den, out_residual, o);
  const auto guard = dev.guard(q);
  LinearGrads g = alloc_linear_grads(q, k, v, o);
  if (linear_empty_call(q, v)) {
    if (o.initial_state.has_value() && dfinal_state.has_value()) {
      g.dinit_state.copy_(*dfinal_state);  // an empty sequence passes the state through
    }
    return {g.dq, g.dk, g.dv, g.ddecay, g.dinit_state};
  }
  if constexpr (Device::kPoison) {
    for (at::Tensor* t : {&g.dq, &g.dk, &g.dv}) poison_rows(*t, o);
    if (g.ddecay.numel() > 0) poison_rows(g.ddecay.unsqueeze(-1), o);
    if (g.dinit_state.numel() > 0) g.dinit_state.fill_(NAN);
  }
  const at::Tensor res = residual_as_out(out, out_residual);
  const LinearBwdParamsT<float> p = make_linear_bwd_params<float>(dout, dfinal_state, q, k, v, out, den, res, o, g);
  const DType dt = dtype_of(q);
  // fp32 accumulators the kernels add into (entry.h): zeroed, never poisoned
  const LinearCudaKernels kern = dev.linear_kernels();  // one snapshot sizes and launches
  at::Tensor scratch = at::zeros({int64_t(dev.linear_bwd_scratch_floats(p, dt, kern))}, q.options().dtype(at::kFloat));
  dev.reads({&q, &k, &v, &dout, &scratch});
  run_backend<Device>([&] { dev.linear_bwd(p, dt, kern, scratch.data_ptr<float>()); });
  return {g.dq, g.dk, g.dv, g.ddecay, g.dinit_state};
}

// linear_step: out (B, H, T, Dv) in q's dtype; state and normalizer advanced in place.
template <typename Device>
at::Tensor linear_cuda_step_steps(const Device& dev, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  at::Tensor& state, const std::optional<at::Tensor>& normalizer,
                                  const std::optional<at::Tensor>& decay, int64_t feature_map, double eps,
                                  double scale) {
  check_linear_step_inputs(q, k, v, state, normalizer, decay, feature_map, eps, scale);
  dev.check_device(q);
  const auto guard = dev.guard(q);
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
  if (out.numel() == 0 || q.size(3) == 0) {
    // no feature: Q~ . anything is 0 and the state has no rows; out is 0 / eps
    if (out.numel() > 0) out.zero_();
    return out;
  }
  if constexpr (Device::kPoison) out.fill_(NAN);
  const LinearStepParamsT<float> p =
      make_linear_step_params<float>(q, k, v, out, state, normalizer, decay, feature_map, eps, scale);
  const DType dt = dtype_of(q);
  run_backend<Device>([&] { dev.linear_step(p, dt); });
  return out;
}

}  // namespace api
}  // namespace attn
