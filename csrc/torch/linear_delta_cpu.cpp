// CPU registration of the delta-rule ops: attention_ext::delta_fwd / delta_bwd on the CPU
// kernels (csrc/linear/cpu/delta.cpp), float64 included.
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "linear/cpu/entry.h"
#include "torch/alloc.h"
#include "torch/linear_delta_binding.h"
#include "torch/tensor_rules.h"  // acc_dtype

namespace {

using at::Tensor;

template <typename Acc>
attn::DeltaParamsT<Acc> with_checkpoints(attn::DeltaParamsT<Acc> p, const Tensor& ck) {
  p.checkpoints = ck.numel() > 0 ? ck.data_ptr<Acc>() : nullptr;
  return p;
}

std::tuple<Tensor, Tensor, Tensor> delta_fwd_cpu(const Tensor& q, const Tensor& k, const Tensor& v,
                                                 const Tensor& beta ATTN_DELTA_OPTIONS_PARAMS, bool checkpoints) {
  const attn::api::DeltaOptions o = ATTN_DELTA_MAKE_OPTIONS();
  attn::api::check_delta_inputs(q, k, v, beta, o);
  auto [out, state] = attn::api::alloc_delta_outputs(q, v, o);
  // alloc_delta_checkpoints' tensor, from the recycled output blocks (alloc.h): tens of MB of
  // fresh pages would fault on every call
  const auto acc = q.options().dtype(attn::api::acc_dtype(q));
  const bool varlen = o.cu_seqlens.has_value();
  const int64_t slots = attn::delta_checkpoint_slots(varlen ? o.cu_seqlens->numel() - 1 : q.size(0), q.size(2), varlen);
  Tensor ck = checkpoints ? attn::api::empty_output({slots, v.size(1), v.size(3), q.size(3)}, acc) : at::empty({0}, acc);
  if (checkpoints && varlen) ck.zero_();  // a pack's slots between its sequences
  if (attn::api::delta_fill_unwritten(out, state, q, v, o)) return {out, state, ck};
  if (q.scalar_type() == at::kDouble) {
    attn::cpu::delta_fwd_stub<double>(with_checkpoints(attn::api::make_delta_params<double>(q, k, v, beta, out, state, o), ck));
  } else {
    attn::cpu::delta_fwd_stub<float>(with_checkpoints(attn::api::make_delta_params<float>(q, k, v, beta, out, state, o), ck));
  }
  return {out, state, ck};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> delta_bwd_cpu(const Tensor& dout,
                                                                         const std::optional<Tensor>& dfinal_state,
                                                                         const Tensor& q, const Tensor& k,
                                                                         const Tensor& v,
                                                                         const Tensor& beta ATTN_DELTA_OPTIONS_PARAMS,
                                                                         const std::optional<Tensor>& checkpoints) {
  const attn::api::DeltaOptions o = ATTN_DELTA_MAKE_OPTIONS();
  attn::api::check_delta_inputs(q, k, v, beta, o);
  attn::api::check_delta_bwd_inputs(dout, dfinal_state, q, v, o);
  attn::api::check_delta_checkpoints(checkpoints, q, v, o);
  const Tensor ck = checkpoints.has_value() ? *checkpoints : Tensor();
  attn::api::DeltaGrads g = attn::api::alloc_delta_grads(q, k, v, beta, o);
  const bool empty = q.numel() == 0 || v.numel() == 0 || q.size(2) == 0;
  if (o.cu_seqlens.has_value() || empty) {  // rows no sequence owns; empty calls
    for (Tensor* t : {&g.dq, &g.dk, &g.dv, &g.dbeta, &g.dgate}) t->zero_();
  }
  if (empty) {
    if (o.initial_state.has_value()) {  // an empty sequence passes the state through
      if (dfinal_state.has_value()) {
        g.dinit_state.copy_(*dfinal_state);
      } else {
        g.dinit_state.zero_();
      }
    }
    return {g.dq, g.dk, g.dv, g.dbeta, g.dgate, g.dinit_state};
  }
  if (q.scalar_type() == at::kDouble) {
    auto p = attn::api::make_delta_bwd_params<double>(dout, dfinal_state, q, k, v, beta, o, g);
    p.checkpoints = ck.defined() && ck.numel() > 0 ? ck.data_ptr<double>() : nullptr;
    attn::cpu::delta_bwd_stub<double>(p);
  } else {
    auto p = attn::api::make_delta_bwd_params<float>(dout, dfinal_state, q, k, v, beta, o, g);
    p.checkpoints = ck.defined() && ck.numel() > 0 ? ck.data_ptr<float>() : nullptr;
    attn::cpu::delta_bwd_stub<float>(p);
  }
  return {g.dq, g.dk, g.dv, g.dbeta, g.dgate, g.dinit_state};
}

// T tokens from state, advanced in place: the forward with the state as both its initial and its
// final state. Each task reads its block of columns at its start and writes it at its end, and
// no two tasks share a block, so the in-place update is safe.
Tensor delta_step_cpu(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta, Tensor& state,
                      const std::optional<Tensor>& gate, double scale, bool qk_l2norm) {
  const attn::api::DeltaOptions o{gate, state, std::nullopt, scale, qk_l2norm, false};
  attn::api::check_delta_step_inputs(q, k, v, beta, state, o);
  Tensor out = attn::api::alloc_delta_out(q, v);
  if (out.numel() == 0 || state.numel() == 0) {
    if (out.numel() > 0) out.zero_();
    return out;
  }
  if (q.scalar_type() == at::kDouble) {
    attn::cpu::delta_fwd_stub<double>(attn::api::make_delta_params<double>(q, k, v, beta, out, state, o));
  } else {
    attn::cpu::delta_fwd_stub<float>(attn::api::make_delta_params<float>(q, k, v, beta, out, state, o));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(attention_ext, CPU, m) {
  m.impl("delta_fwd", &delta_fwd_cpu);
  m.impl("delta_bwd", &delta_bwd_cpu);
  m.impl("delta_step", &delta_step_cpu);
}
