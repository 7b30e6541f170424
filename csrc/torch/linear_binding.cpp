// Definitions of linear_binding.h: input checks, output allocation, tensors -> params.
#include "torch/linear_binding.h"

#include "torch/alloc.h"
#include "torch/tensor_rules.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <cmath>
#include <vector>

namespace attn {
namespace api {

namespace {

at::ScalarType acc_of(const at::Tensor& q) { return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

void check_side(const std::optional<at::Tensor>& t, const char* name, c10::SymIntArrayRef want, at::ScalarType dtype,
                const at::Tensor& q) {
  if (!t.has_value()) return;
  TORCH_CHECK_TYPE(t->scalar_type() == dtype, "attention_ext.linear: ", name, " must be ", dtype, ", got ",
                   t->scalar_type());
  TORCH_CHECK_VALUE(t->sym_sizes() == want, "attention_ext.linear: ", name, " must have shape ", want, ", got ",
                    t->sym_sizes());
  TORCH_CHECK(t->device() == q.device(), "attention_ext.linear: ", name, " must be on ", q.device(), ", got ",
              t->device());
  TORCH_CHECK_VALUE(t->is_contiguous(), "attention_ext.linear: ", name, " must be contiguous");
}

int64_t num_seqs(const at::Tensor& q, const LinearOptions& o) {
  return o.cu_seqlens.has_value() ? o.cu_seqlens->numel() - 1 : q.size(0);
}

int64_t dv_aug(const at::Tensor& v, const LinearOptions& o) { return v.size(3) + (o.normalize ? 1 : 0); }

// the same two, with sizes as SymInts (the checks, which the Meta kernels run too)
c10::SymInt num_seqs_sym(const at::Tensor& q, const LinearOptions& o) {
  return o.cu_seqlens.has_value() ? o.cu_seqlens->sym_numel() - 1 : q.sym_size(0);
}
c10::SymInt dv_aug_sym(const at::Tensor& v, const LinearOptions& o) { return v.sym_size(3) + (o.normalize ? 1 : 0); }

// The rules q, k, v share in every linear op (`what` prefixes the messages, `seq` names the
// sequence dim: S for a whole sequence, T for a step's tokens): 4-D, one dtype of the four, one device.
void check_qkv_common(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const char* what, const char* seq) {
  TORCH_CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, what, "q, k, v must be 4-D (B, H, ", seq,
                    ", D), got q ", q.sym_sizes(), ", k ", k.sym_sizes(), ", v ", v.sym_sizes());
  TORCH_CHECK_TYPE(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), what,
                   "q, k, v must share a dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ", v.scalar_type());
  const auto st = q.scalar_type();
  TORCH_CHECK_TYPE(st == at::kFloat || st == at::kHalf || st == at::kBFloat16 || st == at::kDouble, what,
                   "q, k, v must be float32, float16, bfloat16 or float64, got ", st);
  TORCH_CHECK(q.device() == k.device() && q.device() == v.device(), what, "q, k, v must be on one device, got ",
              q.device(), ", ", k.device(), ", ", v.device());
}

// The rules linear_fwd and linear_step share after their shape matching, in this order: the
// feature and value widths, heads, a contiguous last dim, then the scalar options.
void check_widths_and_options(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const char* what,
                              int64_t feature_map, double eps, double scale) {
  const c10::SymInt m = q.sym_size(3), dv = v.sym_size(3), h = q.sym_size(1), hk = k.sym_size(1);
  TORCH_CHECK_VALUE(m >= 1 && m <= 1024 && dv >= 1 && dv <= 1024, what,
                    "feature and value widths must be in [1, 1024], got ", m, " and ", dv);
  TORCH_CHECK_VALUE(hk >= 1 && h % hk == 0, what, "query heads (", h, ") must be a multiple of kv heads (", hk, ")");
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK_VALUE(unit_stride_last(*t), what, "the last dim of q, k, v must be contiguous (stride 1), got strides ",
                      t->sym_strides());
  TORCH_CHECK_VALUE(feature_map >= 0 && feature_map <= 2, what,
                    "feature_map must be 0 (identity), 1 (elu + 1) or 2 (relu), got ", feature_map);
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0.0, what, "eps must be finite and >= 0, got ", eps);
  TORCH_CHECK_VALUE(std::isfinite(scale), what, "scale must be finite, got ", scale);
}

}  // namespace

void check_linear_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const LinearOptions& o) {
  check_qkv_common(q, k, v, "attention_ext.linear: ", "S");
  const c10::SymInt b = q.sym_size(0), h = q.sym_size(1), s = q.sym_size(2), m = q.sym_size(3), hk = k.sym_size(1);
  TORCH_CHECK_VALUE(k.sym_size(0) == b && v.sym_size(0) == b, "attention_ext.linear: batch mismatch: q ", q.sym_sizes(), ", k ",
                    k.sym_sizes(), ", v ", v.sym_sizes());
  TORCH_CHECK_VALUE(k.sym_size(2) == s && v.sym_size(2) == s, "attention_ext.linear: q, k, v must have one sequence length, got ",
                    s, ", ", k.sym_size(2), ", ", v.sym_size(2));
  TORCH_CHECK_VALUE(k.sym_size(3) == m, "attention_ext.linear: feature width mismatch: q has ", m, ", k has ", k.sym_size(3));
  TORCH_CHECK_VALUE(v.sym_size(1) == hk, "attention_ext.linear: k and v must have the same heads, got ", hk, " and ",
                    v.sym_size(1));
  check_widths_and_options(q, k, v, "attention_ext.linear: ", o.feature_map, o.eps, o.scale);
  TORCH_CHECK_VALUE(o.causal || !o.decay.has_value(),
                    "attention_ext.linear: decay needs causal=True (a gate orders the positions)");
  const at::ScalarType acc = acc_of(q);
  c10::SymInt nb = b;
  if (o.cu_seqlens.has_value()) {
    const at::Tensor& cu = *o.cu_seqlens;
    TORCH_CHECK_VALUE(b == 1, "attention_ext.linear: varlen inputs are one (1, H, total, D) pack, got batch ", b);
    TORCH_CHECK_TYPE(cu.scalar_type() == at::kInt, "attention_ext.linear: cu_seqlens must be int32, got ",
                     cu.scalar_type());
    TORCH_CHECK_VALUE(cu.dim() == 1 && cu.sym_numel() >= 2 && cu.is_contiguous(),
                      "attention_ext.linear: cu_seqlens must be a contiguous (B + 1) tensor, got ", cu.sym_sizes());
    TORCH_CHECK(cu.device() == q.device(), "attention_ext.linear: cu_seqlens must be on ", q.device());
    TORCH_CHECK_VALUE(o.max_seqlen >= 0, "attention_ext.linear: max_seqlen must be >= 0");
    nb = cu.sym_numel() - 1;
    if (q.device().is_cpu()) {
      const int64_t n = nb.guard_int(__FILE__, __LINE__), len = s.guard_int(__FILE__, __LINE__);
      auto c = cu.accessor<int32_t, 1>();
      TORCH_CHECK_VALUE(c[0] == 0, "attention_ext.linear: cu_seqlens must start at 0");
      for (int64_t i = 0; i < n; ++i) {
        TORCH_CHECK_VALUE(c[i + 1] >= c[i], "attention_ext.linear: cu_seqlens must be non-decreasing");
        TORCH_CHECK_VALUE(c[i + 1] - c[i] <= o.max_seqlen, "attention_ext.linear: a sequence is longer than max_seqlen");
      }
      TORCH_CHECK_VALUE(c[n] <= len, "attention_ext.linear: cu_seqlens end past the pack (", c[n], " > ", len, ")");
    }
  }
  check_side(o.decay, "decay", {b, h, s}, acc, q);
  check_side(o.initial_state, "initial_state", {nb, h, m, dv_aug_sym(v, o)}, acc, q);
  check_side(o.key_mask, "key_mask", {b, s}, at::kBool, q);
}

void check_linear_bwd_inputs(const at::Tensor& dout, const std::optional<at::Tensor>& dfinal_state,
                             const at::Tensor& q, const at::Tensor& v, const at::Tensor& out, const at::Tensor& den,
                             const std::optional<at::Tensor>& out_residual, const LinearOptions& o) {
  const std::vector<c10::SymInt> want_out{q.sym_size(0), q.sym_size(1), q.sym_size(2), v.sym_size(3)};
  TORCH_CHECK_VALUE(dout.sym_sizes() == c10::SymIntArrayRef(want_out) && out.sym_sizes() == c10::SymIntArrayRef(want_out),
                    "attention_ext.linear_bwd: dout and out must be (B, H, S, Dv) = ", c10::SymIntArrayRef(want_out));
  TORCH_CHECK_TYPE(dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
                   "attention_ext.linear_bwd: dout and out must have q's dtype ", q.scalar_type());
  TORCH_CHECK_VALUE(unit_stride_last(dout) && unit_stride_last(out),
                    "attention_ext.linear_bwd: dout and out need a contiguous last dim");
  TORCH_CHECK(dout.device() == q.device() && out.device() == q.device(),
              "attention_ext.linear_bwd: dout and out must be on ", q.device());
  check_side(den, "den", {q.sym_size(0), q.sym_size(1), q.sym_size(2)}, acc_of(q), q);
  if (out_residual.has_value() && out_residual->sym_numel() != 0) {
    TORCH_CHECK_VALUE(out_residual->sym_sizes() == out.sym_sizes(),
                      "attention_ext.linear_bwd: out_residual must be out's shape ", out.sym_sizes(), " (or empty), got ",
                      out_residual->sym_sizes());
    TORCH_CHECK_TYPE(out_residual->scalar_type() == out.scalar_type(),
                     "attention_ext.linear_bwd: out_residual must have out's dtype ", out.scalar_type());
    TORCH_CHECK(out_residual->device() == q.device(), "attention_ext.linear_bwd: out_residual must be on ", q.device());
  }
  check_side(dfinal_state, "dfinal_state", {num_seqs_sym(q, o), q.sym_size(1), q.sym_size(3), dv_aug_sym(v, o)}, acc_of(q), q);
}

bool keep_residual_for(const at::Tensor& q, const LinearOptions& o, bool keep_residual) {
  return keep_residual && o.normalize && (q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16);
}

void check_cuda_residual(const at::Tensor& q, const LinearOptions& o, bool keep_residual) {
  TORCH_CHECK_VALUE(!keep_residual_for(q, o, keep_residual) || q.size(3) > kLinearTensorCoreMaxFeatures,
                    "attention_ext.linear_fwd: keep_residual on CUDA needs feature width M > ",
                    kLinearTensorCoreMaxFeatures, " (got ", q.size(3), "): the tensor-core kernels keep no residual; "
                    "pass keep_residual=False");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> alloc_linear_outputs(const at::Tensor& q,
                                                                               const at::Tensor& v,
                                                                               const LinearOptions& o,
                                                                               bool keep_residual) {
  const auto acc = q.options().dtype(acc_of(q));
  // out keeps q's memory layout: (B, S, H, Dv) storage when q has heads inside rows
  at::Tensor out = q.stride(1) < q.stride(2)
                       ? empty_output({q.size(0), q.size(2), q.size(1), v.size(3)}, q.options()).transpose(1, 2)
                       : empty_output({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
  at::Tensor den = empty_output({q.size(0), q.size(1), q.size(2)}, acc);
  at::Tensor state = at::empty({num_seqs(q, o), q.size(1), q.size(3), dv_aug(v, o)}, acc);
  // rows no sequence owns (a varlen pack's tail) and empty calls
  // the residual shares out's strides (the kernels index both alike)
  at::Tensor res =
      keep_residual_for(q, o, keep_residual) ? at::empty_like(out) : at::empty({0}, q.options());
  if (o.cu_seqlens.has_value() || q.numel() == 0 || v.numel() == 0) {
    out.zero_();
    den.fill_(1.0);
    res.zero_();
  }
  if (q.size(2) == 0 || q.numel() == 0) {
    if (o.initial_state.has_value()) {
      state.copy_(*o.initial_state);
    } else {
      state.zero_();
    }
  }
  return {out, den, state, res};
}

at::Tensor residual_as_out(const at::Tensor& out, const std::optional<at::Tensor>& out_residual) {
  if (!out_residual.has_value() || out_residual->numel() == 0) return at::Tensor();
  if (out_residual->strides() == out.strides()) return *out_residual;
  return at::empty_strided(out.sizes(), out.strides(), out.options()).copy_(*out_residual);
}

template <typename Acc>
LinearParamsT<Acc> make_linear_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& out, const at::Tensor& den, const at::Tensor& final_state,
                                      const LinearOptions& o, const at::Tensor& out_residual) {
  LinearParamsT<Acc> p{};
  const bool varlen = o.cu_seqlens.has_value();
  p.b = int32_t(num_seqs(q, o));
  p.h = int32_t(q.size(1));
  p.h_k = int32_t(k.size(1));
  p.sq = p.sk = int32_t(varlen ? o.max_seqlen : q.size(2));
  p.d = int32_t(q.size(3));
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.data_ptr();
  p.o_res = out_residual.defined() && out_residual.numel() > 0 ? out_residual.data_ptr() : nullptr;
  p.dim_v = int32_t(v.size(3));
  p.dim_v_aug = int32_t(dv_aug(v, o));
  bhs_strides(q, &p.q_batch_stride, &p.q_head_stride, &p.q_row_stride);
  bhs_strides(k, &p.k_batch_stride, &p.k_head_stride, &p.k_row_stride);
  bhs_strides(v, &p.v_batch_stride, &p.v_head_stride, &p.v_row_stride);
  bhs_strides(out, &p.o_batch_stride, &p.o_head_stride, &p.o_row_stride);
  p.cu_seqlens = varlen ? o.cu_seqlens->data_ptr<int32_t>() : nullptr;
  p.key_mask = o.key_mask.has_value() ? reinterpret_cast<const uint8_t*>(o.key_mask->data_ptr<bool>()) : nullptr;
  p.key_mask_batch_stride = o.key_mask.has_value() ? o.key_mask->stride(0) : 0;
  p.decay = o.decay.has_value() ? o.decay->data_ptr<Acc>() : nullptr;
  p.den = den.data_ptr<Acc>();
  p.seq_batch_stride = den.stride(0);
  p.seq_head_stride = den.stride(1);
  p.init_state = o.initial_state.has_value() ? o.initial_state->data_ptr<Acc>() : nullptr;
  p.final_state = final_state.defined() && final_state.numel() > 0 ? final_state.data_ptr<Acc>() : nullptr;
  p.feature_map = FeatureMap(o.feature_map);
  p.causal = o.causal;
  p.normalize = o.normalize;
  p.eps = Acc(o.eps);
  p.scale = Acc(o.scale);
  p.num_threads = 0;
  return p;
}
template LinearParamsT<float> make_linear_params<float>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                        const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                        const LinearOptions&, const at::Tensor&);
template LinearParamsT<double> make_linear_params<double>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                          const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                          const LinearOptions&, const at::Tensor&);

LinearGrads alloc_linear_grads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const LinearOptions& o) {
  LinearGrads g;
  auto like = [](const at::Tensor& t) {
    return t.stride(1) < t.stride(2) ? empty_output({t.size(0), t.size(2), t.size(1), t.size(3)}, t.options()).transpose(1, 2)
                                     : empty_output(t.sizes(), t.options());
  };
  g.dq = like(q);
  g.dk = like(k);
  g.dv = like(v);
  // the kernels write every row inside a sequence; a varlen pack's tail and empty calls get zeros
  if (o.cu_seqlens.has_value() || q.numel() == 0 || k.numel() == 0 || v.numel() == 0) {
    g.dq.zero_();
    g.dk.zero_();
    g.dv.zero_();
  }
  const auto acc = q.options().dtype(acc_of(q));
  g.ddecay = o.decay.has_value() ? at::zeros_like(*o.decay) : at::empty({0}, acc);
  g.dinit_state = o.initial_state.has_value() ? at::zeros_like(*o.initial_state) : at::empty({0}, acc);
  return g;
}

template <typename Acc>
LinearBwdParamsT<Acc> make_linear_bwd_params(const at::Tensor& dout, const std::optional<at::Tensor>& dfinal_state,
                                             const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             const at::Tensor& out, const at::Tensor& den,
                                             const at::Tensor& out_residual, const LinearOptions& o,
                                             LinearGrads& g) {
  LinearBwdParamsT<Acc> p{};
  static_cast<LinearParamsT<Acc>&>(p) = make_linear_params<Acc>(q, k, v, out, den, at::Tensor(), o, out_residual);
  p.final_state = nullptr;
  p.dout = dout.data_ptr();
  bhs_strides(dout, &p.do_batch_stride, &p.do_head_stride, &p.do_row_stride);
  p.dfinal_state = dfinal_state.has_value() ? dfinal_state->data_ptr<Acc>() : nullptr;
  p.dq = g.dq.data_ptr();
  p.dk = g.dk.data_ptr();
  p.dv = g.dv.data_ptr();
  bhs_strides(g.dq, &p.dq_batch_stride, &p.dq_head_stride, &p.dq_row_stride);
  bhs_strides(g.dk, &p.dk_batch_stride, &p.dk_head_stride, &p.dk_row_stride);
  bhs_strides(g.dv, &p.dv_batch_stride, &p.dv_head_stride, &p.dv_row_stride);
  p.ddecay = g.ddecay.numel() > 0 ? g.ddecay.data_ptr<Acc>() : nullptr;
  p.dinit_state = g.dinit_state.numel() > 0 ? g.dinit_state.data_ptr<Acc>() : nullptr;
  return p;
}
template LinearBwdParamsT<float> make_linear_bwd_params<float>(const at::Tensor&, const std::optional<at::Tensor>&,
                                                               const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                               const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                               const LinearOptions&, LinearGrads&);
template LinearBwdParamsT<double> make_linear_bwd_params<double>(const at::Tensor&, const std::optional<at::Tensor>&,
                                                                 const at::Tensor&, const at::Tensor&,
                                                                 const at::Tensor&, const at::Tensor&,
                                                                 const at::Tensor&, const at::Tensor&,
                                                                 const LinearOptions&, LinearGrads&);

void check_linear_step_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& state,
                              const std::optional<at::Tensor>& normalizer, const std::optional<at::Tensor>& decay,
                              int64_t feature_map, double eps, double scale) {
  check_qkv_common(q, k, v, "attention_ext.linear_step: ", "T");
  const c10::SymInt b = q.sym_size(0), h = q.sym_size(1), t = q.sym_size(2), m = q.sym_size(3), hk = k.sym_size(1),
                    dv = v.sym_size(3);
  TORCH_CHECK_VALUE(k.sym_size(0) == b && v.sym_size(0) == b && k.sym_size(2) == t && v.sym_size(2) == t && k.sym_size(3) == m &&
                        v.sym_size(1) == hk,
                    "attention_ext.linear_step: q ", q.sym_sizes(), ", k ", k.sym_sizes(), ", v ", v.sym_sizes(),
                    " do not match (B, H, T, M), (B, H_k, T, M), (B, H_k, T, Dv)");
  check_widths_and_options(q, k, v, "attention_ext.linear_step: ", feature_map, eps, scale);
  const at::ScalarType acc = acc_of(q);
  TORCH_CHECK_TYPE(state.scalar_type() == acc, "attention_ext.linear_step: state must be ", acc, ", got ",
                   state.scalar_type());
  TORCH_CHECK_VALUE(state.sym_sizes() == c10::SymIntArrayRef({b, h, m, dv}), "attention_ext.linear_step: state must have shape ",
                    c10::SymIntArrayRef({b, h, m, dv}), ", got ", state.sym_sizes());
  TORCH_CHECK(state.device() == q.device(), "attention_ext.linear_step: state must be on ", q.device(), ", got ",
              state.device());
  TORCH_CHECK_VALUE(unit_stride_last(state), "attention_ext.linear_step: the last dim of state must be contiguous");
  if (normalizer.has_value()) {
    const at::Tensor& z = *normalizer;
    TORCH_CHECK_TYPE(z.scalar_type() == acc, "attention_ext.linear_step: normalizer must be ", acc, ", got ",
                     z.scalar_type());
    TORCH_CHECK_VALUE(z.sym_sizes() == c10::SymIntArrayRef({b, h, m}), "attention_ext.linear_step: normalizer must have shape ",
                      c10::SymIntArrayRef({b, h, m}), ", got ", z.sym_sizes());
    TORCH_CHECK(z.device() == q.device(), "attention_ext.linear_step: normalizer must be on ", q.device(), ", got ",
                z.device());
    TORCH_CHECK_VALUE(z.sym_stride(2) == 1 || m == 1, "attention_ext.linear_step: the last dim of normalizer must be contiguous");
  }
  // written in place: an element shared by two positions of state (an expanded tensor) or by
  // state and normalizer would be updated twice, in an order the CUDA kernel does not fix
  const bool concrete = !state.unsafeGetTensorImpl()->has_symbolic_sizes_strides() &&
                        (!normalizer.has_value() || !normalizer->unsafeGetTensorImpl()->has_symbolic_sizes_strides());
  if (concrete && state.device().type() != at::kMeta) {
    TORCH_CHECK_VALUE(at::has_internal_overlap(state) != at::MemOverlap::Yes,
                      "attention_ext.linear_step: state is updated in place, so its elements must not overlap (an "
                      "expanded tensor does); pass state.clone() or a contiguous tensor");
    if (normalizer.has_value()) {
      TORCH_CHECK_VALUE(at::has_internal_overlap(*normalizer) != at::MemOverlap::Yes,
                        "attention_ext.linear_step: normalizer is updated in place, so its elements must not overlap (an "
                        "expanded tensor does); pass normalizer.clone()");
      // byte spans of the two views (strides here are >= 0); overlapping spans of one storage
      // are refused, exact for dense views and conservative for strided ones
      auto span = [](const at::Tensor& t) {
        const char* lo = static_cast<const char*>(t.data_ptr());
        int64_t hi = t.element_size();
        for (int64_t i = 0; i < t.dim(); ++i) hi += (t.size(i) - 1) * t.stride(i) * t.element_size();
        return std::make_pair(lo, lo + hi);
      };
      const bool same = state.numel() > 0 && normalizer->numel() > 0 && state.has_storage() &&
                        normalizer->has_storage() && state.storage().is_alias_of(normalizer->storage());
      const bool apart = !same || [&] {
        const auto a = span(state), z = span(*normalizer);
        return a.second <= z.first || z.second <= a.first;
      }();
      TORCH_CHECK_VALUE(apart,
                        "attention_ext.linear_step: state and normalizer share memory; both are updated in place, pass "
                        "separate tensors");
    }
  }
  if (decay.has_value()) {
    TORCH_CHECK_TYPE(decay->scalar_type() == acc, "attention_ext.linear_step: decay must be ", acc, ", got ",
                     decay->scalar_type());
    TORCH_CHECK_VALUE(decay->sym_sizes() == c10::SymIntArrayRef({b, h, t}) ||
                          decay->sym_sizes() == c10::SymIntArrayRef({b, h, t, m}),
                      "attention_ext.linear_step: decay must have shape ", c10::SymIntArrayRef({b, h, t}),
                      " (a log-gate per head) or ", c10::SymIntArrayRef({b, h, t, m}), " (one per feature), got ",
                      decay->sym_sizes());
    TORCH_CHECK(decay->device() == q.device(), "attention_ext.linear_step: decay must be on ", q.device(), ", got ",
                decay->device());
    TORCH_CHECK_VALUE(decay->is_contiguous(), "attention_ext.linear_step: decay must be contiguous");
  }
}

template <typename Acc>
LinearStepParamsT<Acc> make_linear_step_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               const at::Tensor& out, at::Tensor& state,
                                               const std::optional<at::Tensor>& normalizer,
                                               const std::optional<at::Tensor>& decay, int64_t feature_map,
                                               double eps, double scale) {
  LinearStepParamsT<Acc> p{};
  p.b = int32_t(q.size(0));
  p.h = int32_t(q.size(1));
  p.h_k = int32_t(k.size(1));
  p.sq = p.sk = int32_t(q.size(2));
  p.d = int32_t(q.size(3));
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.data_ptr();
  p.dim_v = int32_t(v.size(3));
  bhs_strides(q, &p.q_batch_stride, &p.q_head_stride, &p.q_row_stride);
  bhs_strides(k, &p.k_batch_stride, &p.k_head_stride, &p.k_row_stride);
  bhs_strides(v, &p.v_batch_stride, &p.v_head_stride, &p.v_row_stride);
  bhs_strides(out, &p.o_batch_stride, &p.o_head_stride, &p.o_row_stride);
  p.state = state.data_ptr<Acc>();
  bhs_strides(state, &p.state_batch_stride, &p.state_head_stride, &p.state_row_stride);
  p.normalizer = normalizer.has_value() ? normalizer->data_ptr<Acc>() : nullptr;
  p.z_batch_stride = normalizer.has_value() ? normalizer->stride(0) : 0;
  p.z_head_stride = normalizer.has_value() ? normalizer->stride(1) : 0;
  p.decay = decay.has_value() ? decay->data_ptr<Acc>() : nullptr;
  p.decay_per_feature = decay.has_value() && decay->dim() == 4;
  p.feature_map = FeatureMap(feature_map);
  p.eps = Acc(eps);
  p.scale = Acc(scale);
  return p;
}
template LinearStepParamsT<float> make_linear_step_params<float>(const at::Tensor&, const at::Tensor&,
                                                                 const at::Tensor&, const at::Tensor&, at::Tensor&,
                                                                 const std::optional<at::Tensor>&,
                                                                 const std::optional<at::Tensor>&, int64_t, double,
                                                                 double);
template LinearStepParamsT<double> make_linear_step_params<double>(const at::Tensor&, const at::Tensor&,
                                                                   const at::Tensor&, const at::Tensor&, at::Tensor&,
                                                                   const std::optional<at::Tensor>&,
                                                                   const std::optional<at::Tensor>&, int64_t, double,
                                                                   double);

}  // namespace api
}  // namespace attn
