// The host steps of the delta rule's CUDA forward and in-place step between the ops' tensors and
// the torch-free backend (csrc/linear/cuda/entry.h cuda_delta_fwd): the checks
// (linear_delta_binding.h), outputs, params, the launch, errors. One copy for the real CUDA
// binding (linear_delta_cuda.cpp) and the CPU emulator's, which differ only in their `Device`:
//
//   struct Device {
//     static constexpr bool kPoison;       // outputs start as NaN where the kernels write (the emulator)
//     static constexpr const char* kWhat;  // error-message prefix
//     void check_device(const Tensor& q) const;  // dtype / device the backend takes
//     <RAII> guard(const Tensor& q) const;       // device guard for the call
//     // the launch; `reads` are the tensors the kernels copy from (the emulator checks cp.async
//     // sources against them and the scratch)
//     void delta_fwd(const DeltaParamsT<float>&, const DeltaCudaKernels&, const at::Tensor& scratch,
//                    std::initializer_list<at::Tensor> reads) const;
//     void delta_bwd(const DeltaBwdParamsT<float>&, const at::Tensor& scratch,
//                    std::initializer_list<at::Tensor> reads) const;
//   };
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <initializer_list>
#include <optional>
#include <tuple>

#include "linear/cuda/entry.h"  // cuda_delta_fwd, its scratch and selection
#include "torch/cuda_steps.h"    // run_backend
#include "torch/linear_delta_binding.h"

namespace attn {
namespace api {

// The forward's launch with its scratch (one selection snapshot sizes and runs it); the emulator's
// scratch starts as 0xff bytes (bf16 NaN), so a tile read before it is written fails the tests.
template <typename Device>
void delta_cuda_launch(const Device& dev, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const DeltaParamsT<float>& p) {
  const DeltaCudaKernels ks = cuda_delta_kernels();
  const size_t bytes = cuda_delta_fwd_scratch_bytes(p, ks);
  at::Tensor scratch;
  if (bytes > 0) {
    scratch = at::empty({int64_t(bytes)}, q.options().dtype(at::kByte));
    if constexpr (Device::kPoison) scratch.fill_(255);
  }
  run_backend<Device>([&] { dev.delta_fwd(p, ks, scratch, {q, k, v}); });
}

// checkpoints (for a backward) come from the CPU kernels only: the CUDA forward serves calls
// without gradients, so it takes checkpoints=False and returns the empty tensor.
template <typename Device>
std::tuple<at::Tensor, at::Tensor, at::Tensor> delta_cuda_fwd_steps(const Device& dev, const at::Tensor& q,
                                                                    const at::Tensor& k, const at::Tensor& v,
                                                                    const at::Tensor& beta, const DeltaOptions& o,
                                                                    bool checkpoints) {
  check_delta_inputs(q, k, v, beta, o);
  dev.check_device(q);
  TORCH_CHECK_VALUE(!checkpoints, Device::kWhat, ": checkpoints=True is for the CPU kernels' backward; the CUDA "
                    "forward serves calls without gradients (pass checkpoints=False)");
  const auto guard = dev.guard(q);
  auto [out, state] = alloc_delta_outputs(q, v, o);
  at::Tensor ck = alloc_delta_checkpoints(q, v, o, false);
  if (delta_fill_unwritten(out, state, q, v, o)) return {out, state, ck};
  if constexpr (Device::kPoison) {  // the rows the kernel owns, and the state
    const int64_t used = o.cu_seqlens.has_value() ? o.cu_seqlens->cpu()[-1].item<int64_t>() : q.size(2);
    out.narrow(2, 0, used).fill_(NAN);
    state.fill_(NAN);
  }
  const DeltaParamsT<float> p = make_delta_params<float>(q, k, v, beta, out, state, o);
  delta_cuda_launch(dev, q, k, v, p);
  return {out, state, ck};
}

// The backward on the chunk kernels (entry.h cuda_delta_bwd): the calls they take, else a
// ValueError naming what they need. dq and dk arrive as float32 sums in the scratch (a GVA group's
// value heads add into them) and are converted here.
template <typename Device>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> delta_cuda_bwd_steps(
    const Device& dev, const at::Tensor& dout, const std::optional<at::Tensor>& dfinal_state, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& beta, const DeltaOptions& o,
    const std::optional<at::Tensor>& checkpoints) {
  check_delta_inputs(q, k, v, beta, o);
  check_delta_bwd_inputs(dout, dfinal_state, q, v, o);
  dev.check_device(q);
  TORCH_CHECK_VALUE(!checkpoints.has_value(), Device::kWhat, ": checkpoints are the CPU kernels' (the CUDA backward "
                    "recomputes the chunk states); pass None");
  const auto guard = dev.guard(q);
  DeltaGrads g = alloc_delta_grads(q, k, v, beta, o);
  const bool empty = q.numel() == 0 || v.numel() == 0 || q.size(2) == 0;
  if (o.cu_seqlens.has_value() || empty) {  // rows no sequence owns; empty calls
    for (at::Tensor* t : {&g.dq, &g.dk, &g.dv, &g.dbeta, &g.dgate}) t->zero_();
  }
  if (empty) {
    if (o.initial_state.has_value()) {
      if (dfinal_state.has_value()) {
        g.dinit_state.copy_(*dfinal_state);
      } else {
        g.dinit_state.zero_();
      }
    }
    return {g.dq, g.dk, g.dv, g.dbeta, g.dgate, g.dinit_state};
  }
  if constexpr (Device::kPoison) {  // the rows the kernels own
    const int64_t used = o.cu_seqlens.has_value() ? o.cu_seqlens->cpu()[-1].item<int64_t>() : q.size(2);
    for (at::Tensor* t : {&g.dv, &g.dbeta, &g.dgate}) {
      if (t->numel() > 0) t->narrow(2, 0, used).fill_(NAN);
    }
    if (g.dinit_state.numel() > 0) g.dinit_state.fill_(NAN);
  }
  DeltaBwdParamsT<float> p = make_delta_bwd_params<float>(dout, dfinal_state, q, k, v, beta, o, g);
  at::Tensor qc = q, kc = k, vc = v, doc = dout;
  const bool per_key = o.gate.has_value() && o.gate->dim() == 4;
  if (!cuda_delta_bwd_fits(p) && delta_chunk_takes(1, p.dt, p.dim_k, p.dim_v, per_key, p.plain, p.s, true)) {
    // rows the 16-byte copies cannot read (strides or offsets off 8 elements): dense copies
    qc = q.clone(at::MemoryFormat::Contiguous);
    kc = k.clone(at::MemoryFormat::Contiguous);
    vc = v.clone(at::MemoryFormat::Contiguous);
    doc = dout.clone(at::MemoryFormat::Contiguous);
    p = make_delta_bwd_params<float>(doc, dfinal_state, qc, kc, vc, beta, o, g);
  }
  TORCH_CHECK_VALUE(cuda_delta_bwd_fits(p), Device::kWhat, ": the CUDA backward kernels take bfloat16 or float16 calls (the plain "
                    "write with per-key gates only), K <= 128, K and V multiples of 8 and 16-byte aligned rows; got ",
                    q.scalar_type(), ", K = ", q.size(3), ", V = ", v.size(3),
                    p.plain && !(o.gate.has_value() && o.gate->dim() == 4) ? ", the plain write without per-key gates"
                                                                            : "");
  size_t zeroed = 0;
  const size_t bytes = cuda_delta_bwd_scratch_bytes(p, &zeroed);
  at::Tensor scratch = at::empty({int64_t(bytes)}, q.options().dtype(at::kByte));
  if constexpr (Device::kPoison) scratch.fill_(255);
  scratch.narrow(0, 0, int64_t(zeroed)).zero_();
  run_backend<Device>([&] { dev.delta_bwd(p, scratch, {qc, kc, vc, doc}); });
  const int64_t rows = o.cu_seqlens.has_value() ? 1 : q.size(0);
  const at::Tensor acc = scratch.narrow(0, 0, int64_t(zeroed)).view(at::kFloat).view({2, rows, q.size(1), q.size(2), q.size(3)});
  g.dq.copy_(acc[0]);
  g.dk.copy_(acc[1]);
  return {g.dq, g.dk, g.dv, g.dbeta, g.dgate, g.dinit_state};
}

// T tokens from `state`, advanced in place: the forward with the state as both its initial and
// its final state (each CTA reads its columns at its start and writes them at its end).
template <typename Device>
at::Tensor delta_cuda_step_steps(const Device& dev, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& beta, at::Tensor& state, const std::optional<at::Tensor>& gate,
                                 double scale, bool qk_l2norm) {
  const DeltaOptions o{gate, state, std::nullopt, scale, qk_l2norm, false};
  check_delta_step_inputs(q, k, v, beta, state, o);
  dev.check_device(q);
  const auto guard = dev.guard(q);
  at::Tensor out = alloc_delta_out(q, v);
  if (out.numel() == 0 || state.numel() == 0) {
    if (out.numel() > 0) out.zero_();
    return out;
  }
  if constexpr (Device::kPoison) out.fill_(NAN);
  const DeltaParamsT<float> p = make_delta_params<float>(q, k, v, beta, out, state, o);
  delta_cuda_launch(dev, q, k, v, p);
  return out;
}

}  // namespace api
}  // namespace attn
