// Definitions of linear_delta_binding.h: input checks, output allocation, tensors -> params.
#include "torch/linear_delta_binding.h"

#include <cmath>
#include <vector>

#include "torch/tensor_rules.h"

namespace attn {
namespace api {

namespace {

// the rules of the delta-rule ops, which delta_rule_attention and delta_rule_step share
constexpr const char* kWhat = "attention_ext.delta_rule (delta_rule_attention / delta_rule_step): ";

c10::SymInt num_seqs_sym(const at::Tensor& q, const DeltaOptions& o) {
  return o.cu_seqlens.has_value() ? o.cu_seqlens->sym_numel() - 1 : q.sym_size(0);
}

std::vector<c10::SymInt> state_shape(const at::Tensor& q, const at::Tensor& v, const DeltaOptions& o) {
  return {num_seqs_sym(q, o), v.sym_size(1), q.sym_size(3), v.sym_size(3)};
}

// beta or gate: contiguous, of q's dtype or the accumulation dtype, on q's device
void check_side(const at::Tensor& t, const char* name, c10::SymIntArrayRef want, const at::Tensor& q,
                const char* shape_text) {
  TORCH_CHECK_TYPE(t.scalar_type() == q.scalar_type() || t.scalar_type() == acc_dtype(q), kWhat, name, " must be ",
                   q.scalar_type(), " (q's dtype) or ", acc_dtype(q), ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.sym_sizes() == want, kWhat, name, " must have shape ", shape_text, " = ", want, ", got ",
                    t.sym_sizes(), " (always (B, H_v, S, ...) whatever the layout of q, k, v)");
  TORCH_CHECK(t.device() == q.device(), kWhat, name, " must be on ", q.device(), ", got ", t.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), kWhat, name, " must be contiguous (call .contiguous())");
}

void check_state(const std::optional<at::Tensor>& t, const char* name, const std::vector<c10::SymInt>& want,
                 const at::Tensor& q) {
  if (!t.has_value()) return;
  TORCH_CHECK_TYPE(t->scalar_type() == acc_dtype(q), kWhat, name, " must be ", acc_dtype(q), ", got ",
                   t->scalar_type());
  TORCH_CHECK_VALUE(t->sym_sizes() == c10::SymIntArrayRef(want), kWhat, name, " must have shape (N, H_v, K, V) = ",
                    c10::SymIntArrayRef(want), ", got ", t->sym_sizes());
  TORCH_CHECK(t->device() == q.device(), kWhat, name, " must be on ", q.device(), ", got ", t->device());
  TORCH_CHECK_VALUE(t->is_contiguous(), kWhat, name, " must be contiguous (call .contiguous())");
}

}  // namespace

void check_delta_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& beta,
                        const DeltaOptions& o) {
  TORCH_CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, kWhat,
                    "q, k, v must be 4-D ((B, H, S, D) here; layout='bshd' is transposed in Python), got q ",
                    q.sym_sizes(), ", k ", k.sym_sizes(), ", v ", v.sym_sizes());
  TORCH_CHECK_TYPE(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), kWhat,
                   "q, k, v must share a dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ", v.scalar_type());
  const auto st = q.scalar_type();
  TORCH_CHECK_TYPE(st == at::kFloat || st == at::kHalf || st == at::kBFloat16 || st == at::kDouble, kWhat,
                   "q, k, v must be float32, float16, bfloat16 or float64, got ", st);
  TORCH_CHECK(q.device() == k.device() && q.device() == v.device(), kWhat, "q, k, v must be on one device, got ",
              q.device(), ", ", k.device(), ", ", v.device());
  const c10::SymInt b = q.sym_size(0), hk = q.sym_size(1), s = q.sym_size(2), kd = q.sym_size(3);
  const c10::SymInt hv = v.sym_size(1), vd = v.sym_size(3);
  TORCH_CHECK_VALUE(k.sym_sizes() == q.sym_sizes(), kWhat, "k must have q's shape (B, H_k, S, K) = ", q.sym_sizes(),
                    ", got ", k.sym_sizes());
  TORCH_CHECK_VALUE(v.sym_size(0) == b && v.sym_size(2) == s, kWhat, "v must be (B, H_v, S, V) with q's B = ", b,
                    " and S = ", s, ", got ", v.sym_sizes());
  TORCH_CHECK_VALUE(hk >= 1 && hv % hk == 0, kWhat, "value heads H_v (", hv, ") must be a multiple of the q / k heads H_k (",
                    hk, ")");
  TORCH_CHECK_VALUE(kd >= 1 && kd <= 1024 && vd >= 1 && vd <= 1024, kWhat,
                    "key and value widths K, V must be in [1, 1024], got ", kd, " and ", vd);
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK_VALUE(unit_stride_last(*t), kWhat, "the last dim of q, k, v must be contiguous (stride 1), got strides ",
                      t->sym_strides());
  TORCH_CHECK_VALUE(std::isfinite(o.scale) && o.scale != 0.0, kWhat, "scale must be finite and nonzero, got ", o.scale);
  check_side(beta, "beta", {b, hv, s}, q, "(B, H_v, S)");
  if (o.gate.has_value()) {
    const bool per_key = o.gate->dim() == 4;
    if (per_key) {
      check_side(*o.gate, "gate", {b, hv, s, kd}, q, "(B, H_v, S, K)");
    } else {
      check_side(*o.gate, "gate", {b, hv, s}, q, "(B, H_v, S) or (B, H_v, S, K)");
    }
  }
  if (o.cu_seqlens.has_value()) {
    const at::Tensor& cu = *o.cu_seqlens;
    TORCH_CHECK_VALUE(b == 1, kWhat, "with cu_seqlens, q, k, v are one (1, H, total, D) pack, got batch ", b);
    TORCH_CHECK_TYPE(cu.scalar_type() == at::kInt, kWhat, "cu_seqlens must be int32, got ", cu.scalar_type());
    TORCH_CHECK_VALUE(cu.dim() == 1 && cu.sym_numel() >= 2 && cu.is_contiguous(), kWhat,
                      "cu_seqlens must be a contiguous 1-D tensor of N + 1 offsets, got ", cu.sym_sizes());
    TORCH_CHECK(cu.device() == q.device(), kWhat, "cu_seqlens must be on ", q.device(), ", got ", cu.device());
    // the offsets' values, wherever they are real numbers (not meta / fake tensors): a device
    // copy to the host for the check (the only device call today is the PyTorch recurrence's,
    // a host loop over the offsets anyway)
    const bool concrete = !cu.unsafeGetTensorImpl()->has_symbolic_sizes_strides() && cu.device().type() != at::kMeta &&
                          !q.unsafeGetTensorImpl()->has_symbolic_sizes_strides();
    if (concrete && cu.has_storage()) {
      const at::Tensor host = cu.device().is_cpu() ? cu : cu.to(at::kCPU);
      const int64_t n = host.numel() - 1, len = s.guard_int(__FILE__, __LINE__);
      auto c = host.accessor<int32_t, 1>();
      TORCH_CHECK_VALUE(c[0] == 0, kWhat, "cu_seqlens must start at 0, got ", c[0]);
      for (int64_t i = 0; i < n; ++i)
        TORCH_CHECK_VALUE(c[i + 1] >= c[i], kWhat, "cu_seqlens must be non-decreasing, got ", c[i], " then ", c[i + 1]);
      TORCH_CHECK_VALUE(c[n] <= len, kWhat, "cu_seqlens ends past the pack (", c[n], " > S = ", len, ")");
    }
  }
  check_state(o.initial_state, "initial_state", state_shape(q, v, o), q);
}

void check_delta_bwd_inputs(const at::Tensor& dout, const std::optional<at::Tensor>& dfinal_state,
                            const at::Tensor& q, const at::Tensor& v, const DeltaOptions& o) {
  const std::vector<c10::SymInt> want{q.sym_size(0), v.sym_size(1), q.sym_size(2), v.sym_size(3)};
  TORCH_CHECK_VALUE(dout.sym_sizes() == c10::SymIntArrayRef(want), "attention_ext.delta_bwd: dout must be (B, H_v, S, V) = ",
                    c10::SymIntArrayRef(want), ", got ", dout.sym_sizes());
  TORCH_CHECK_TYPE(dout.scalar_type() == q.scalar_type(), "attention_ext.delta_bwd: dout must have q's dtype ",
                   q.scalar_type(), ", got ", dout.scalar_type());
  TORCH_CHECK_VALUE(unit_stride_last(dout), "attention_ext.delta_bwd: dout needs a contiguous last dim");
  TORCH_CHECK(dout.device() == q.device(), "attention_ext.delta_bwd: dout must be on ", q.device());
  check_state(dfinal_state, "dfinal_state", state_shape(q, v, o), q);
}

void check_delta_step_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& beta,
                             const at::Tensor& state, const DeltaOptions& o) {
  TORCH_CHECK_VALUE(!o.cu_seqlens.has_value(), "attention_ext.delta_rule_step: cu_seqlens is not taken (one state per batch row)");
  DeltaOptions without = o;
  without.initial_state = std::nullopt;
  check_delta_inputs(q, k, v, beta, without);
  // the state is read and written in place: contiguous, so no two positions share an element
  const std::vector<c10::SymInt> want = state_shape(q, v, without);
  TORCH_CHECK_TYPE(state.scalar_type() == acc_dtype(q), "attention_ext.delta_rule_step: state must be ", acc_dtype(q),
                   ", got ", state.scalar_type());
  TORCH_CHECK_VALUE(state.sym_sizes() == c10::SymIntArrayRef(want), "attention_ext.delta_rule_step: state must have shape "
                    "(B, H_v, K, V) = ", c10::SymIntArrayRef(want), ", got ", state.sym_sizes());
  TORCH_CHECK(state.device() == q.device(), "attention_ext.delta_rule_step: state must be on ", q.device(), ", got ",
              state.device());
  TORCH_CHECK_VALUE(state.is_contiguous(), "attention_ext.delta_rule_step: state is updated in place and must be "
                    "contiguous (an expanded or strided view is not); pass state.contiguous() and keep that tensor");
}

namespace {
// (delta_checkpoint_slots, H_v, V, K) (delta_params.h), in SymInts for the Meta kernels
std::vector<c10::SymInt> checkpoint_shape(const at::Tensor& q, const at::Tensor& v, const DeltaOptions& o) {
  const c10::SymInt s = q.sym_size(2), chunk = kDeltaChunk;
  const c10::SymInt slots = o.cu_seqlens.has_value() ? s / chunk + (o.cu_seqlens->sym_numel() - 1)
                                                     : q.sym_size(0) * ((s + chunk - 1) / chunk);
  return {slots, v.sym_size(1), v.sym_size(3), q.sym_size(3)};
}
}  // namespace

at::Tensor alloc_delta_checkpoints(const at::Tensor& q, const at::Tensor& v, const DeltaOptions& o, bool want) {
  const auto acc = q.options().dtype(acc_dtype(q));
  if (!want) return at::empty({0}, acc);
  // a pack's slots between its sequences are never written: zeros rather than stale memory
  return o.cu_seqlens.has_value() ? at::zeros_symint(checkpoint_shape(q, v, o), acc)
                                  : at::empty_symint(checkpoint_shape(q, v, o), acc);
}

void check_delta_checkpoints(const std::optional<at::Tensor>& checkpoints, const at::Tensor& q, const at::Tensor& v,
                             const DeltaOptions& o) {
  if (!checkpoints.has_value()) return;
  const std::vector<c10::SymInt> want = checkpoint_shape(q, v, o);
  TORCH_CHECK_VALUE(checkpoints->sym_sizes() == c10::SymIntArrayRef(want) && checkpoints->scalar_type() == acc_dtype(q) &&
                        checkpoints->is_contiguous() && checkpoints->device() == q.device(),
                    "attention_ext.delta_bwd: checkpoints must be delta_fwd's (checkpoints=True) of the same call: ",
                    acc_dtype(q), " ", c10::SymIntArrayRef(want), " contiguous on ", q.device(), ", got ",
                    checkpoints->scalar_type(), " ", checkpoints->sym_sizes());
}

bool delta_fill_unwritten(at::Tensor& out, at::Tensor& state, const at::Tensor& q, const at::Tensor& v,
                          const DeltaOptions& o) {
  if (o.cu_seqlens.has_value() || out.numel() == 0) out.zero_();
  const bool empty = q.numel() == 0 || v.numel() == 0 || q.size(2) == 0;
  if (empty) {
    if (o.initial_state.has_value()) {
      state.copy_(*o.initial_state);
    } else {
      state.zero_();
    }
  }
  return empty || state.numel() == 0;
}

at::Tensor alloc_delta_out(const at::Tensor& q, const at::Tensor& v) {
  return empty_like_layout(q, v.sym_size(1), v.sym_size(3), q.options());
}

std::tuple<at::Tensor, at::Tensor> alloc_delta_outputs(const at::Tensor& q, const at::Tensor& v,
                                                       const DeltaOptions& o) {
  at::Tensor out = alloc_delta_out(q, v);
  at::Tensor state = at::empty_symint(state_shape(q, v, o), q.options().dtype(acc_dtype(q)));
  return {out, state};
}

template <typename Acc>
DeltaParamsT<Acc> make_delta_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& beta, const at::Tensor& out, const at::Tensor& final_state,
                                    const DeltaOptions& o) {
  DeltaParamsT<Acc> p{};
  const bool varlen = o.cu_seqlens.has_value();
  p.b = int32_t(varlen ? o.cu_seqlens->numel() - 1 : q.size(0));
  p.h_k = int32_t(q.size(1));
  p.h_v = int32_t(v.size(1));
  p.s = int32_t(q.size(2));
  p.dim_k = int32_t(q.size(3));
  p.dim_v = int32_t(v.size(3));
  p.dt = dtype_of(q);
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.defined() ? out.data_ptr() : nullptr;
  bhs_strides(q, &p.q_batch_stride, &p.q_head_stride, &p.q_row_stride);
  bhs_strides(k, &p.k_batch_stride, &p.k_head_stride, &p.k_row_stride);
  bhs_strides(v, &p.v_batch_stride, &p.v_head_stride, &p.v_row_stride);
  if (out.defined()) bhs_strides(out, &p.o_batch_stride, &p.o_head_stride, &p.o_row_stride);
  p.cu_seqlens = varlen ? o.cu_seqlens->data_ptr<int32_t>() : nullptr;
  p.beta = beta.data_ptr();
  p.beta_dt = dtype_of(beta);
  p.gate = o.gate.has_value() ? o.gate->data_ptr() : nullptr;
  p.gate_dt = o.gate.has_value() ? dtype_of(*o.gate) : DType::kF32;
  p.gate_per_key = o.gate.has_value() && o.gate->dim() == 4;
  p.init_state = o.initial_state.has_value() ? o.initial_state->data_ptr<Acc>() : nullptr;
  p.final_state = final_state.defined() ? final_state.data_ptr<Acc>() : nullptr;
  p.scale = Acc(o.scale);
  p.qk_l2norm = o.qk_l2norm;
  p.l2_eps = Acc(kDeltaL2Eps);
  p.plain = o.plain;
  return p;
}
template DeltaParamsT<float> make_delta_params<float>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                      const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                      const DeltaOptions&);
template DeltaParamsT<double> make_delta_params<double>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                        const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                        const DeltaOptions&);

DeltaGrads alloc_delta_grads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& beta,
                             const DeltaOptions& o) {
  DeltaGrads g;
  g.dq = empty_like_layout(q);
  g.dk = empty_like_layout(k);
  g.dv = empty_like_layout(v);
  g.dbeta = at::empty_symint(beta.sym_sizes(), beta.options());
  const auto acc = q.options().dtype(acc_dtype(q));
  g.dgate = o.gate.has_value() ? at::empty_symint(o.gate->sym_sizes(), o.gate->options()) : at::empty({0}, acc);
  g.dinit_state = o.initial_state.has_value() ? at::empty_symint(state_shape(q, v, o), acc) : at::empty({0}, acc);
  return g;
}

template <typename Acc>
DeltaBwdParamsT<Acc> make_delta_bwd_params(const at::Tensor& dout, const std::optional<at::Tensor>& dfinal_state,
                                           const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& beta, const DeltaOptions& o, DeltaGrads& g) {
  DeltaBwdParamsT<Acc> p{};
  static_cast<DeltaParamsT<Acc>&>(p) = make_delta_params<Acc>(q, k, v, beta, at::Tensor(), at::Tensor(), o);
  p.dout = dout.data_ptr();
  bhs_strides(dout, &p.do_batch_stride, &p.do_head_stride, &p.do_row_stride);
  p.dfinal_state = dfinal_state.has_value() ? dfinal_state->data_ptr<Acc>() : nullptr;
  p.dq = g.dq.data_ptr();
  p.dk = g.dk.data_ptr();
  p.dv = g.dv.data_ptr();
  bhs_strides(g.dq, &p.dq_batch_stride, &p.dq_head_stride, &p.dq_row_stride);
  bhs_strides(g.dk, &p.dk_batch_stride, &p.dk_head_stride, &p.dk_row_stride);
  bhs_strides(g.dv, &p.dv_batch_stride, &p.dv_head_stride, &p.dv_row_stride);
  p.dbeta = g.dbeta.data_ptr();
  p.dgate = o.gate.has_value() ? g.dgate.data_ptr() : nullptr;
  p.dinit_state = o.initial_state.has_value() ? g.dinit_state.data_ptr<Acc>() : nullptr;
  return p;
}
template DeltaBwdParamsT<float> make_delta_bwd_params<float>(const at::Tensor&, const std::optional<at::Tensor>&,
                                                             const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                             const at::Tensor&, const DeltaOptions&, DeltaGrads&);
template DeltaBwdParamsT<double> make_delta_bwd_params<double>(const at::Tensor&, const std::optional<at::Tensor>&,
                                                               const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                               const at::Tensor&, const DeltaOptions&, DeltaGrads&);

}  // namespace api
}  // namespace attn
