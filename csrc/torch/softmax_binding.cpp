// Definitions of softmax_binding.h: input checks, output allocation, tensors -> params. Compiled
// into attention_ext._C and into the CPU emulator's module.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "torch/softmax_binding.h"
#include "torch/tensor_rules.h"

namespace attn {
namespace api {

// Whether t's values can be read here: a CPU tensor with data (torch.compile's fake tensors say
// CPU but hold none; their call is checked when the compiled graph runs).
static bool values_on_host(const Tensor& t) {
  return t.device().is_cpu() && t.has_storage() && (t.numel() == 0 || t.storage().data() != nullptr);
}

static void check_index_tensor(const OptTensor& t, const char* name, const c10::SymInt& numel, const Tensor& q) {
  if (!t.has_value()) return;
  TORCH_CHECK_TYPE(t->scalar_type() == at::kInt, "attention_ext: ", name, " must be int32, got ", t->scalar_type());
  TORCH_CHECK(t->dim() == 1 && t->sym_numel() == numel, "attention_ext: ", name, " must have shape (", numel, "), got ",
              t->sizes());
  TORCH_CHECK(t->device() == q.device(), "attention_ext: ", name, " must be on ", q.device(), ", got ", t->device());
  TORCH_CHECK(t->is_contiguous(), "attention_ext: ", name, " must be contiguous");
}

void check_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const Options& o) {
  TORCH_CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
                    "attention_ext: q, k, v must be 4-D (B, H, S, D), got q ", q.sym_sizes(), ", k ", k.sym_sizes(), ", v ",
                    v.sym_sizes());
  TORCH_CHECK_TYPE(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
                   "attention_ext: q, k, v must share a dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
                   v.scalar_type());
  dtype_of(q);
  TORCH_CHECK(q.device() == k.device() && q.device() == v.device(), "attention_ext: q, k, v must be on one device, got ",
              q.device(), ", ", k.device(), ", ", v.device());
  const c10::SymInt b = q.sym_size(0), h = q.sym_size(1), d = q.sym_size(3), hk = k.sym_size(1);
  TORCH_CHECK_VALUE(k.sym_size(0) == b && v.sym_size(0) == b, "attention_ext: batch mismatch: q ", q.sym_sizes(), ", k ",
                    k.sym_sizes(), ", v ", v.sym_sizes());
  TORCH_CHECK_VALUE(k.sym_sizes() == v.sym_sizes(), "attention_ext: k and v must have the same shape, got ", k.sym_sizes(), " and ",
                    v.sym_sizes());
  TORCH_CHECK_VALUE(k.sym_size(3) == d, "attention_ext: head dim mismatch: q has ", d, ", k and v have ", k.sym_size(3));
  TORCH_CHECK_VALUE(d >= 1 && d <= 256, "attention_ext: head dim must be in [1, 256], got ", d);
  TORCH_CHECK_VALUE(hk >= 1 && h % hk == 0, "attention_ext: query heads (", h, ") must be a multiple of kv heads (", hk,
                    ")");
  for (const Tensor* t : {&q, &k, &v})
    TORCH_CHECK_VALUE(unit_stride_last(*t),
                      "attention_ext: the head dim of q, k, v must be contiguous (stride 1), got strides ",
                      t->sym_strides());
  TORCH_CHECK_VALUE(o.window_left >= -1 && o.window_right >= -1, "attention_ext: window sizes must be >= -1, got (",
                    o.window_left, ", ", o.window_right, ")");
  TORCH_CHECK_VALUE(o.dropout_p >= 0.0 && o.dropout_p < 1.0, "attention_ext: dropout_p must be in [0, 1), got ",
                    o.dropout_p);
  TORCH_CHECK_VALUE(o.softcap >= 0.0 && std::isfinite(o.softcap),
                    "attention_ext: softcap must be finite and >= 0 (0 = off), got ", o.softcap);
  TORCH_CHECK_VALUE(std::isfinite(o.scale), "attention_ext: scale must be finite, got ", o.scale);
  const bool varlen = o.cu_seqlens_q.has_value();
  TORCH_CHECK_VALUE(varlen == o.cu_seqlens_k.has_value(), "attention_ext: cu_seqlens_q and cu_seqlens_k go together");
  c10::SymInt nb = b;
  if (varlen) {
    TORCH_CHECK_VALUE(b == 1, "attention_ext: varlen inputs are one (1, H, total, D) pack, got batch ", b);
    nb = o.cu_seqlens_q->sym_numel() - 1;
    TORCH_CHECK_VALUE(nb >= 1, "attention_ext: cu_seqlens_q needs at least 2 entries");
    check_index_tensor(o.cu_seqlens_q, "cu_seqlens_q", nb + 1, q);
    check_index_tensor(o.cu_seqlens_k, "cu_seqlens_k", nb + 1, q);
    TORCH_CHECK_VALUE(!o.seqlens_k.has_value(), "attention_ext: seqlens_k is for padded batches, not varlen");
    TORCH_CHECK_VALUE(o.max_seqlen_q >= 0 && o.max_seqlen_k >= 0 && o.max_seqlen_q <= INT32_MAX &&
                          o.max_seqlen_k <= INT32_MAX,
                      "attention_ext: max_seqlen_q/k must be in [0, 2^31 - 1], got ", o.max_seqlen_q, ", ",
                      o.max_seqlen_k);
    if (values_on_host(*o.cu_seqlens_q) && values_on_host(*o.cu_seqlens_k)) {
      // validated here on the CPU; CUDA callers validate in Python (no sync in the op)
      const int64_t n = nb.guard_int(__FILE__, __LINE__), tq = q.sym_size(2).guard_int(__FILE__, __LINE__),
                    tk = k.sym_size(2).guard_int(__FILE__, __LINE__);
      auto cq = o.cu_seqlens_q->accessor<int32_t, 1>(), ck = o.cu_seqlens_k->accessor<int32_t, 1>();
      TORCH_CHECK_VALUE(cq[0] == 0 && ck[0] == 0, "attention_ext: cu_seqlens must start at 0");
      for (int64_t i = 0; i < n; ++i) {
        TORCH_CHECK_VALUE(cq[i + 1] >= cq[i] && ck[i + 1] >= ck[i], "attention_ext: cu_seqlens must be non-decreasing");
        TORCH_CHECK_VALUE(cq[i + 1] - cq[i] <= o.max_seqlen_q && ck[i + 1] - ck[i] <= o.max_seqlen_k,
                          "attention_ext: a sequence is longer than max_seqlen_q/k");
      }
      TORCH_CHECK_VALUE(cq[n] <= tq && ck[n] <= tk, "attention_ext: cu_seqlens end past the packed tensors (", cq[n],
                        " > ", tq, " or ", ck[n], " > ", tk, ")");
    }
  }
  check_index_tensor(o.seqlens_k, "seqlens_k", nb, q);
  const c10::SymInt sq = varlen ? c10::SymInt(o.max_seqlen_q) : q.sym_size(2),
                    sk = varlen ? c10::SymInt(o.max_seqlen_k) : k.sym_size(2);
  if (o.seqlens_k.has_value() && values_on_host(*o.seqlens_k)) {
    // each length in [0, Sk] (validated here on the CPU, as cu_seqlens above; no sync in the op on
    // CUDA): a longer one would read as Sk and move the bottom-right diagonal (seqlens_k - Sq)
    // without a word, a negative one hide every key
    const int64_t n = nb.guard_int(__FILE__, __LINE__), tk = sk.guard_int(__FILE__, __LINE__);
    auto sl = o.seqlens_k->accessor<int32_t, 1>();
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK_VALUE(sl[i] >= 0 && sl[i] <= tk, "attention_ext: seqlens_k[", i, "] = ", sl[i], " is outside [0, ",
                        tk, "] (the keys of k: Sk = ", tk, ")");
    }
  }
  const at::ScalarType acc = acc_dtype(q);
  if (o.bias.has_value()) {
    const Tensor& bias = *o.bias;
    TORCH_CHECK_TYPE(bias.scalar_type() == acc || bias.scalar_type() == at::kBool, "attention_ext: bias must be ",
                     acc, " (additive; float64 goes with float64 inputs, float32 with the others) or bool (True = "
                     "attend), got ", bias.scalar_type());
    TORCH_CHECK(bias.device() == q.device(), "attention_ext: bias must be on ", q.device(), ", got ", bias.device());
    TORCH_CHECK_VALUE(bias.dim() == 4, "attention_ext: bias must be 4-D, broadcastable to (B, H, Sq, Sk) = (", nb, ", ",
                      h, ", ", sq, ", ", sk, "), got ", bias.sym_sizes());
    const c10::SymInt want[4] = {nb, h, sq, sk};
    for (int i = 0; i < 4; ++i)
      // sym_or + expect_true: a data-dependent size (torch.export) becomes a run-time assert, not a guard
      TORCH_CHECK_VALUE(bias.sym_size(i).sym_eq(1).sym_or(bias.sym_size(i).sym_eq(want[i])).expect_true(__FILE__, __LINE__),
                        "attention_ext: bias of shape ", bias.sym_sizes(), " does not broadcast to (B, H, Sq, Sk) = (", nb,
                        ", ", h, ", ", sq, ", ", sk, ")");
  }
  if (o.alibi_slopes.has_value()) {
    const Tensor& a = *o.alibi_slopes;
    TORCH_CHECK_TYPE(a.scalar_type() == acc, "attention_ext: alibi_slopes must be ", acc, ", got ", a.scalar_type());
    TORCH_CHECK(a.device() == q.device(), "attention_ext: alibi_slopes must be on ", q.device());
    TORCH_CHECK_VALUE((a.dim() == 1 && a.sym_size(0) == h) || (a.dim() == 2 && a.sym_size(0) == nb && a.sym_size(1) == h),
                      "attention_ext: alibi_slopes must be (H) or (B, H) = (", nb, ", ", h, "), got ", a.sym_sizes());
    TORCH_CHECK_VALUE(a.sym_stride(-1) == 1, "attention_ext: alibi_slopes must be contiguous over heads");
  }
  if (o.rng_state.has_value()) {
    // checked in this order (dtype, shape, device) by ops.check_inputs too
    const Tensor& r = *o.rng_state;
    TORCH_CHECK_TYPE(r.scalar_type() == at::kLong, "attention_ext: rng_state must be int64, got ", r.scalar_type());
    TORCH_CHECK_VALUE(r.dim() == 1 && r.sym_size(0) == 2 && r.is_contiguous(),
                      "attention_ext: rng_state must be a contiguous (2) tensor (seed, offset), got ", r.sym_sizes());
    TORCH_CHECK(r.device().is_cpu() || r.is_meta(), "attention_ext: rng_state must be a CPU tensor (read on the host), got ",
                r.device());
  }
  if (o.dropout_coords.has_value()) {
    // values are Philox counters, never addresses: any int32 is safe to read
    TORCH_CHECK_VALUE(!varlen, "attention_ext: dropout_coords do not combine with varlen (cu_seqlens)");
    check_index_tensor(o.dropout_coords, "dropout_coords", nb * h + sq + sk, q);
  }
  if (o.sinks.has_value()) {
    const Tensor& s = *o.sinks;
    TORCH_CHECK_TYPE(s.scalar_type() == acc, "attention_ext: sinks must be ", acc, ", got ", s.scalar_type());
    TORCH_CHECK(s.device() == q.device(), "attention_ext: sinks must be on ", q.device());
    TORCH_CHECK_VALUE(s.dim() == 1 && s.sym_size(0) == h && s.is_contiguous(),
                      "attention_ext: sinks must be a contiguous (H) = (", h, ") tensor, got ", s.sym_sizes());
  }
  if (o.block_layout.has_value()) {
    const Tensor& l = *o.block_layout;
    const int64_t bs = o.block_size;
    TORCH_CHECK_VALUE(bs >= 16 && bs % 16 == 0 && bs <= (int64_t(1) << 30),
                      "attention_ext: block_size must be a positive multiple of 16 up to 2^30, got ", bs);
    TORCH_CHECK_TYPE(l.scalar_type() == at::kBool, "attention_ext: block_layout must be bool, got ", l.scalar_type());
    TORCH_CHECK(l.device() == q.device(), "attention_ext: block_layout must be on ", q.device(), ", got ", l.device());
    TORCH_CHECK_VALUE(l.is_contiguous(), "attention_ext: block_layout must be contiguous");
    const c10::SymInt nqb = (sq + bs - 1) / bs, nkb = (sk + bs - 1) / bs;
    TORCH_CHECK_VALUE(l.dim() == 3 && (l.sym_size(0) == 1 || l.sym_size(0) == h) && l.sym_size(1) == nqb && l.sym_size(2) == nkb,
                      "attention_ext: block_layout must be (H or 1, ceil(Sq / block_size), ceil(Sk / block_size)) = (",
                      h, " or 1, ", nqb, ", ", nkb, "), got ", l.sym_sizes());
  }
  TORCH_CHECK_VALUE(o.topk_thr.has_value() == o.topk_jcut.has_value(),
                    "attention_ext: topk_thr and topk_jcut go together");
  if (o.topk_thr.has_value()) {
    const Tensor &t = *o.topk_thr, &c = *o.topk_jcut;
    TORCH_CHECK_TYPE(t.scalar_type() == acc && c.scalar_type() == at::kInt, "attention_ext: topk_thr must be ", acc,
                     " and topk_jcut int32, got ", t.scalar_type(), " and ", c.scalar_type());
    for (const Tensor* x : {&t, &c}) {
      TORCH_CHECK(x->device() == q.device(), "attention_ext: topk_thr / topk_jcut must be on ", q.device());
      TORCH_CHECK_VALUE(x->dim() == 3 && x->sym_size(0) == q.sym_size(0) && x->sym_size(1) == h && x->sym_size(2) == q.sym_size(2) &&
                            x->is_contiguous(),
                        "attention_ext: topk_thr / topk_jcut must be contiguous (B, H, Sq) = (", q.sym_size(0), ", ", h,
                        ", ", q.sym_size(2), "), got ", x->sym_sizes());
    }
  }
}

void check_num_splits(int64_t num_splits) {
  TORCH_CHECK_VALUE(num_splits >= 0, "attention_ext: num_splits must be >= 0 (0 = heuristic), got ", num_splits);
}

int32_t check_qk_quant(const Tensor& q, const Options& o, c10::string_view qk_quant) {
  TORCH_CHECK_VALUE(qk_quant == "int8" || qk_quant == "fp8",
                    "attention_ext: qk_quant must be None, 'int8' or 'fp8', got '", qk_quant, "'");
  const at::ScalarType dt = q.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, "attention_ext: qk_quant='",
                   qk_quant, "' takes float32, float16 or bfloat16 q / k / v, got ", dt,
                   " (float64 is for checking: leave qk_quant=None)");
  TORCH_CHECK_VALUE(!o.topk_thr.has_value(), "attention_ext: qk_quant='", qk_quant,
                    "' does not compose with top-k (its threshold pass selects keys by the float logits); leave "
                    "qk_quant=None");
  return qk_quant == "int8" ? attn::kQkInt8 : attn::kQkFp8;
}

std::tuple<Tensor, Tensor> alloc_fwd_outputs(const Tensor& q, const Options& o, bool poison) {
  Tensor out = empty_like_layout(q);
  Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(acc_dtype(q)));
  if (q.numel() == 0 || o.cu_seqlens_q.has_value()) {
    out.zero_();
    lse.fill_(-INFINITY);
  } else if (poison) {
    out.fill_(NAN);
    lse.fill_(NAN);
  }
  return {out, lse};
}

static void set_strides(const Tensor& t, int64_t* bs, int64_t* hs, int64_t* rs) {
  *bs = t.stride(0);
  *hs = t.stride(1);
  *rs = t.stride(2);
}

template <typename Acc>
void set_window(SoftmaxParamsT<Acc>& p, int64_t left, int64_t right) {
  // A side at least max(Sq, Sk) wide reaches every key of every row (|i + diag - j| < max(Sq, Sk)
  // for either alignment and any lengths up to Sq, Sk): it is the unbounded one (-1), exactly, and
  // narrower sides fit int32, so the kernels' sums (row + diagonal + window) stay below 2^31 for
  // sequences under 2^30 keys.
  const auto side = [&](int64_t w) { return w >= std::max<int64_t>(p.sq, p.sk) ? int32_t(-1) : int32_t(w); };
  p.window_left = side(left);
  p.window_right = side(right);
}
template void set_window<float>(SoftmaxParamsT<float>&, int64_t, int64_t);
template void set_window<double>(SoftmaxParamsT<double>&, int64_t, int64_t);

template <typename Acc>
SoftmaxParamsT<Acc> make_fwd_params(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                const Tensor& lse, const Options& o) {
  SoftmaxParamsT<Acc> p{};
  const bool varlen = o.cu_seqlens_q.has_value();
  p.b = int32_t(varlen ? o.cu_seqlens_q->numel() - 1 : q.size(0));
  p.h = int32_t(q.size(1));
  p.h_k = int32_t(k.size(1));
  p.sq = int32_t(varlen ? o.max_seqlen_q : q.size(2));
  p.sk = int32_t(varlen ? o.max_seqlen_k : k.size(2));
  p.d = int32_t(q.size(3));
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.data_ptr();
  p.lse = lse.data_ptr<Acc>();
  p.lse_batch_stride = varlen ? 0 : lse.stride(0);  // varlen: one (1, H, total_q) pack
  p.lse_head_stride = lse.stride(1);
  set_strides(q, &p.q_batch_stride, &p.q_head_stride, &p.q_row_stride);
  set_strides(k, &p.k_batch_stride, &p.k_head_stride, &p.k_row_stride);
  set_strides(v, &p.v_batch_stride, &p.v_head_stride, &p.v_row_stride);
  set_strides(out, &p.o_batch_stride, &p.o_head_stride, &p.o_row_stride);
  p.cu_seqlens_q = varlen ? o.cu_seqlens_q->data_ptr<int32_t>() : nullptr;
  p.cu_seqlens_k = varlen ? o.cu_seqlens_k->data_ptr<int32_t>() : nullptr;
  p.seqlens_k = o.seqlens_k.has_value() ? o.seqlens_k->data_ptr<int32_t>() : nullptr;
  p.scale = Acc(o.scale);
  p.softcap = Acc(o.softcap);
  set_window(p, o.window_left, o.window_right);
  p.bottom_right = o.bottom_right;
  if (o.alibi_slopes.has_value()) {
    p.alibi_slopes = o.alibi_slopes->data_ptr<Acc>();
    p.alibi_batch_stride = o.alibi_slopes->dim() == 2 ? o.alibi_slopes->stride(0) : 0;
  }
  p.bias_kind = BiasKind::kNone;
  if (o.bias.has_value()) {
    const Tensor& bias = *o.bias;
    p.bias = bias.data_ptr();
    p.bias_kind = bias.scalar_type() == at::kBool ? BiasKind::kBool : BiasKind::kAdditive;
    // broadcast dims read with stride 0
    auto st = [&](int i) { return bias.size(i) == 1 ? int64_t(0) : bias.stride(i); };
    p.bias_batch_stride = st(0);
    p.bias_head_stride = st(1);
    p.bias_row_stride = st(2);
    p.bias_col_stride = st(3);
  }
  p.sinks = o.sinks.has_value() ? o.sinks->data_ptr<Acc>() : nullptr;
  p.dropout_p = Acc(o.dropout_p);
  if (o.rng_state.has_value()) {  // a CPU tensor: read on the host, no device sync
    const int64_t* r = o.rng_state->data_ptr<int64_t>();
    p.seed = uint64_t(r[0]);
    p.offset = uint64_t(r[1]);
  } else {
    p.seed = uint64_t(o.seed);
    p.offset = uint64_t(o.offset);
  }
  if (o.dropout_coords.has_value()) {  // (B * H + Sq + Sk): bh, rows, cols
    const int32_t* c = o.dropout_coords->data_ptr<int32_t>();
    const int64_t nbh = int64_t(p.b) * p.h;
    p.dropout_coords = DropoutCoords{c, c + nbh, c + nbh + p.sq, p.sq, p.sk};
  }
  if (o.block_layout.has_value()) {  // the tile indices are the binding's (block_index.h)
    const Tensor& l = *o.block_layout;
    p.sparse.layout = reinterpret_cast<const uint8_t*>(l.data_ptr<bool>());
    p.sparse.heads = int32_t(l.size(0));
    p.sparse.n_qb = int32_t(l.size(1));
    p.sparse.n_kb = int32_t(l.size(2));
    p.sparse.block = int32_t(o.block_size);
  }
  if (o.topk_thr.has_value()) {
    p.topk_thr = o.topk_thr->data_ptr<Acc>();
    p.topk_jcut = o.topk_jcut->data_ptr<int32_t>();
  }
  p.num_threads = 0;
  return p;
}
template SoftmaxParamsT<float> make_fwd_params<float>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                  const Tensor&, const Options&);
template SoftmaxParamsT<double> make_fwd_params<double>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                    const Tensor&, const Options&);

Grads alloc_grads(const Tensor& q, const Tensor& k, const Tensor& v, const Options& o, bool bias_grad,
                  bool poison) {
  Grads g;
  g.dq = empty_like_layout(q);
  g.dk = empty_like_layout(k);
  g.dv = empty_like_layout(v);
  const bool some_rows_unowned = o.seqlens_k.has_value() || o.cu_seqlens_q.has_value() || is_empty_call(q, k);
  for (Tensor* t : {&g.dq, &g.dk, &g.dv}) {
    if (some_rows_unowned) {
      t->zero_();
    } else if (poison) {
      t->fill_(NAN);
    }
  }
  const auto acc = q.options().dtype(acc_dtype(q));
  const bool varlen = o.cu_seqlens_q.has_value();
  const int64_t nb = varlen ? o.cu_seqlens_q->numel() - 1 : q.size(0);
  if (bias_grad && o.bias.has_value() && o.bias->is_floating_point()) {
    const int64_t sq = varlen ? o.max_seqlen_q : q.size(2), sk = varlen ? o.max_seqlen_k : k.size(2);
    g.dbias = at::zeros({nb, q.size(1), o.bias->size(2) == 1 ? 1 : sq, sk}, acc);
  } else {
    g.dbias = at::empty({0}, acc);
  }
  g.dsinks = o.sinks.has_value() ? at::zeros({nb, q.size(1)}, acc) : at::empty({0}, acc);
  if (poison) {
    g.dbias.fill_(NAN);
    g.dsinks.fill_(NAN);
  }
  return g;
}

void check_bwd_inputs(const Tensor& dout, const Tensor& q, const Tensor& out, const Tensor& lse,
                      const OptTensor& dlse) {
  TORCH_CHECK_VALUE(dout.sym_sizes() == q.sym_sizes() && out.sym_sizes() == q.sym_sizes(),
                    "attention_ext.softmax_bwd: dout and out must have q's shape ", q.sym_sizes());
  TORCH_CHECK_VALUE(unit_stride_last(dout) && unit_stride_last(out),
                    "attention_ext.softmax_bwd: dout and out need a contiguous head dim");
  for (const Tensor* t : {&lse, dlse.has_value() ? &*dlse : &lse}) {
    TORCH_CHECK_VALUE(t->dim() == 3 && t->sym_size(0) == q.sym_size(0) && t->sym_size(1) == q.sym_size(1) && t->sym_size(2) == q.sym_size(2) &&
                          t->scalar_type() == acc_dtype(q) && t->is_contiguous(),
                      "attention_ext.softmax_bwd: lse and dlse must be contiguous ", acc_dtype(q), " (B, H, Sq) tensors");
  }
  for (const Tensor* t : {&dout, &out, &lse, dlse.has_value() ? &*dlse : &lse})
    TORCH_CHECK(t->device() == q.device(), "attention_ext.softmax_bwd: dout, out, lse and dlse must be on ", q.device());
}

template <typename Acc>
SoftmaxBwdParamsT<Acc> make_bwd_params(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& out, const Tensor& lse, const OptTensor& dlse, const Options& o,
                                Grads& g, bool deterministic) {
  SoftmaxBwdParamsT<Acc> p{};
  static_cast<SoftmaxParamsT<Acc>&>(p) = make_fwd_params<Acc>(q, k, v, out, lse, o);
  p.dlse = dlse.has_value() ? dlse->data_ptr<Acc>() : nullptr;
  p.dout = dout.data_ptr();
  set_strides(dout, &p.do_batch_stride, &p.do_head_stride, &p.do_row_stride);
  p.dq = g.dq.data_ptr();
  p.dk = g.dk.data_ptr();
  p.dv = g.dv.data_ptr();
  set_strides(g.dq, &p.dq_batch_stride, &p.dq_head_stride, &p.dq_row_stride);
  set_strides(g.dk, &p.dk_batch_stride, &p.dk_head_stride, &p.dk_row_stride);
  set_strides(g.dv, &p.dv_batch_stride, &p.dv_head_stride, &p.dv_row_stride);
  if (g.dbias.numel() > 0) {
    p.dbias = g.dbias.data_ptr<Acc>();
    p.dbias_batch_stride = g.dbias.stride(0);
    p.dbias_head_stride = g.dbias.stride(1);
    p.dbias_row_stride = g.dbias.size(2) == 1 ? 0 : g.dbias.stride(2);
  }
  p.dsinks = g.dsinks.numel() > 0 ? g.dsinks.data_ptr<Acc>() : nullptr;
  p.deterministic = deterministic;
  return p;
}
template SoftmaxBwdParamsT<float> make_bwd_params<float>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                  const Tensor&, const Tensor&, const OptTensor&, const Options&,
                                                  Grads&, bool);
template SoftmaxBwdParamsT<double> make_bwd_params<double>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                    const Tensor&, const Tensor&, const OptTensor&, const Options&,
                                                    Grads&, bool);

}  // namespace api
}  // namespace attn
