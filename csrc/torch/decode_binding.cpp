// The decode op's checks and params (decode_binding.h).
#include "torch/decode_binding.h"
#include "torch/tensor_rules.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

#include "torch/softmax_binding.h"  // the score policy decode shares: Options, make_fwd_params

namespace attn {
namespace api {

namespace {

void check_index(const OptTensor& t, const char* name, const c10::SymInt& n, const Tensor& q) {
  if (!t.has_value()) return;
  TORCH_CHECK_TYPE(t->scalar_type() == at::kInt, "attention_ext.decode: ", name, " must be int32, got ",
                   t->scalar_type());
  TORCH_CHECK_VALUE(t->dim() == 1 && t->sym_numel() == n, "attention_ext.decode: ", name, " must have shape (", n,
                    "), got ", t->sym_sizes());
  TORCH_CHECK(t->device() == q.device(), "attention_ext.decode: ", name, " must be on ", q.device(), ", got ",
              t->device());
  // the kernels read it as a dense int32 array
  TORCH_CHECK_VALUE(t->is_contiguous(), "attention_ext.decode: ", name, " must be contiguous (a strided view: pass ",
                    name, ".contiguous()), got strides ", t->sym_strides());
}

// Values of the index tensors, read on the host (CPU tensors: in place; CUDA: copied once).
int64_t check_values(const DecodeArgs& a, int64_t b, int64_t cap, int64_t n_cache, int64_t num_pages, int64_t page) {
  auto host = [](const OptTensor& t) -> Tensor { return t.has_value() ? t->to(at::kCPU).contiguous() : Tensor(); };
  const Tensor sl = host(a.seqlens_k), lp = host(a.leftpad_k), bi = host(a.cache_batch_idx), bt = host(a.block_table);
  int64_t max_keys = 0;
  for (int64_t i = 0; i < b; ++i) {
    const int64_t len = sl.defined() ? sl.data_ptr<int32_t>()[i] : cap;
    max_keys = std::max(max_keys, len - (lp.defined() ? std::clamp<int64_t>(lp.data_ptr<int32_t>()[i], 0, len) : 0));
    TORCH_CHECK_VALUE(len >= 0 && len <= cap, "attention_ext.decode: seqlens_k[", i, "] = ", len,
                      " is outside [0, ", cap, "] (the cache holds ", cap, " rows per sequence)");
    if (lp.defined()) {
      const int64_t pad = lp.data_ptr<int32_t>()[i];
      TORCH_CHECK_VALUE(pad >= 0 && pad <= len, "attention_ext.decode: cache_leftpad[", i, "] = ", pad,
                        " is outside [0, seqlens_k[", i, "] = ", len, "]");
    }
    if (bi.defined()) {
      const int64_t c = bi.data_ptr<int32_t>()[i];
      TORCH_CHECK_VALUE(c >= 0 && c < n_cache, "attention_ext.decode: cache_batch_idx[", i, "] = ", c,
                        " is outside [0, ", n_cache, ")");
    }
    if (bt.defined()) {  // the pages holding rows [0, len) of sequence i
      const int32_t* row = bt.data_ptr<int32_t>() + i * bt.stride(0);
      for (int64_t pg = 0; pg < (len + page - 1) / page; ++pg) {
        TORCH_CHECK_VALUE(row[pg] >= 0 && row[pg] < num_pages, "attention_ext.decode: block_table[", i, ", ", pg,
                          "] = ", row[pg], " is not a page of the pool [0, ", num_pages, ") (sequence ", i,
                          " uses ", len, " rows, so pages 0..", (len + page - 1) / page - 1, " must be valid)");
      }
    }
  }
  return max_keys;
}

}  // namespace

bool quantized_cache(const DecodeArgs& a) {
  const at::ScalarType t = a.k.scalar_type();
  return t == at::kChar || t == at::kFloat8_e4m3fn || a.v.scalar_type() == at::kChar ||
         a.v.scalar_type() == at::kFloat8_e4m3fn;
}

namespace {
// k_descale / v_descale of a quantized cache: float32, contiguous, on q's device, (B, H_k) or
// per row (the cache's leading two dims, then H_k). Returns whether they are per row.
bool check_descales(const DecodeArgs& a) {
  const Tensor& k = a.k;
  const bool paged = a.block_table.has_value();
  // the cache is (B_cache, H_k, S_cache, D) here (paged: (num_pages, H_k, page_size, D))
  const c10::SymInt b = a.q.sym_size(0), hk = k.sym_size(1), n0 = k.sym_size(0), n1 = k.sym_size(2);
  bool per_row = false;
  for (const auto& [name, t] : {std::pair<const char*, const OptTensor*>{"k_descale", &a.k_descale},
                                {"v_descale", &a.v_descale}}) {
    TORCH_CHECK_VALUE(t->has_value(), "attention_ext.decode: ",
                      k.scalar_type() == at::kChar ? "an int8" : "a float8_e4m3fn", " cache needs ", name,
                      " (float32 scales, cache value = stored value x scale): (B, H_k) = (", b, ", ", hk,
                      ") per sequence and kv head, or per row ", paged ? "(num_pages, page_size, H_k) = (" :
                      "(B_cache, S_cache, H_k) = (", n0, ", ", n1, ", ", hk, "); attention_ext.decode.quantize_kv ",
                      "makes both");
    const Tensor& s = **t;
    TORCH_CHECK_TYPE(s.scalar_type() == at::kFloat, "attention_ext.decode: ", name, " must be float32, got ",
                     s.scalar_type());
    TORCH_CHECK(s.device() == a.q.device(), "attention_ext.decode: ", name, " must be on ", a.q.device(), ", got ",
                s.device());
    const bool row = s.dim() == 3;
    TORCH_CHECK_VALUE((s.dim() == 2 && s.sym_size(0) == b && s.sym_size(1) == hk) ||
                          (row && s.sym_size(0) == n0 && s.sym_size(1) == n1 && s.sym_size(2) == hk),
                      "attention_ext.decode: ", name, " must be (B, H_k) = (", b, ", ", hk, ") or per row ",
                      paged ? "(num_pages, page_size, H_k) = (" : "(B_cache, S_cache, H_k) = (", n0, ", ", n1, ", ",
                      hk, "), got ", s.sym_sizes());
    TORCH_CHECK_VALUE(s.is_contiguous(), "attention_ext.decode: ", name, " must be contiguous (a strided view: pass ",
                      name, ".contiguous()), got strides ", s.sym_strides());
    if (t == &a.k_descale) per_row = row;
    TORCH_CHECK_VALUE(row == per_row, "attention_ext.decode: k_descale and v_descale must both be per row or ",
                      "both per (batch, kv head), got ", a.k_descale->sym_sizes(), " and ", s.sym_sizes());
  }
  return per_row;
}
}  // namespace

void check_decode_shapes(const DecodeArgs& a) {
  const Tensor &q = a.q, &k = a.k, &v = a.v;
  TORCH_CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
                    "attention_ext.decode: q must be (B, H, Sq, D) and the caches 4-D, got q ", q.sym_sizes(), ", k_cache ",
                    k.sym_sizes(), ", v_cache ", v.sym_sizes());
  const bool quant = quantized_cache(a);
  if (quant) {
    TORCH_CHECK_TYPE(k.scalar_type() == v.scalar_type(), "attention_ext.decode: k_cache and v_cache must share a ",
                     "dtype, got ", k.scalar_type(), " and ", v.scalar_type());
    TORCH_CHECK_TYPE(q.scalar_type() == at::kFloat || q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
                     "attention_ext.decode: with an ", k.scalar_type(), " cache q must be float32, float16 or ",
                     "bfloat16, got ", q.scalar_type());
  } else {
    TORCH_CHECK_TYPE(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
                     "attention_ext.decode: q and the caches must share a dtype (or the caches be int8 / "
                     "float8_e4m3fn with k_descale and v_descale), got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
                     v.scalar_type());
    TORCH_CHECK_VALUE(!a.k_descale.has_value() && !a.v_descale.has_value(),
                      "attention_ext.decode: k_descale / v_descale go with int8 or float8_e4m3fn caches; the caches ",
                      "are ", k.scalar_type());
  }
  dtype_of(q);  // float32 / float16 / bfloat16 / float64
  TORCH_CHECK(q.device() == k.device() && q.device() == v.device(),
              "attention_ext.decode: q and the caches must be on one device, got ", q.device(), ", ", k.device(), ", ",
              v.device());
  TORCH_CHECK_VALUE(k.sym_sizes() == v.sym_sizes(), "attention_ext.decode: k_cache and v_cache must have the same shape, got ",
                    k.sym_sizes(), " and ", v.sym_sizes());
  const c10::SymInt b = q.sym_size(0), h = q.sym_size(1), d = q.sym_size(3), hk = k.sym_size(1);
  TORCH_CHECK_VALUE(k.sym_size(3) == d, "attention_ext.decode: head dim mismatch: q has ", d, ", the caches ", k.sym_size(3));
  TORCH_CHECK_VALUE(d >= 1 && d <= 256, "attention_ext.decode: head dim must be in [1, 256], got ", d);
  TORCH_CHECK_VALUE(hk >= 1 && h % hk == 0, "attention_ext.decode: query heads (", h, ") must be a multiple of kv heads (",
                    hk, ")");
  for (const Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK_VALUE(unit_stride_last(*t),
                      "attention_ext.decode: the head dim of q and the caches must be contiguous, got strides ",
                      t->sym_strides());
  }
  if (quant) check_descales(a);
  TORCH_CHECK_VALUE(a.window_left >= -1 && a.window_right >= -1, "attention_ext.decode: window_left and window_right must be >= -1 (-1 = unbounded), got (",
                    a.window_left, ", ", a.window_right, ")");
  TORCH_CHECK_VALUE(a.softcap >= 0.0 && std::isfinite(a.softcap),
                    "attention_ext.decode: softcap must be finite and >= 0 (0 = off), got ", a.softcap);
  TORCH_CHECK_VALUE(std::isfinite(a.scale), "attention_ext.decode: scale must be finite, got ", a.scale);
  TORCH_CHECK_VALUE(a.num_splits >= 0, "attention_ext.decode: num_splits must be >= 0 (0 = heuristic), got ",
                    a.num_splits);
  const bool paged = a.block_table.has_value();
  if (paged) {
    const Tensor& bt = *a.block_table;
    TORCH_CHECK_TYPE(bt.scalar_type() == at::kInt, "attention_ext.decode: block_table must be int32, got ",
                     bt.scalar_type());
    TORCH_CHECK_VALUE(bt.dim() == 2 && bt.sym_size(0) == b && bt.sym_size(1) >= 1,
                      "attention_ext.decode: block_table must be (B, max_pages) = (", b, ", >= 1), got ", bt.sym_sizes());
    TORCH_CHECK_VALUE(bt.sym_stride(1) == 1,
                      "attention_ext.decode: block_table rows must be contiguous (a strided view: pass "
                      "block_table.contiguous()), got strides ",
                      bt.sym_strides());
    TORCH_CHECK(bt.device() == q.device(), "attention_ext.decode: block_table must be on ", q.device());
    TORCH_CHECK_VALUE(!a.cache_batch_idx.has_value(),
                      "attention_ext.decode: cache_batch_idx is for a contiguous cache; a paged one names its pages "
                      "in block_table");
    TORCH_CHECK_VALUE(k.sym_size(2) >= 1 && k.sym_size(0) >= 1, "attention_ext.decode: the page pool is empty: ",
                      k.sym_sizes());
    TORCH_CHECK_VALUE(bt.sym_size(1) * k.sym_size(2) < (int64_t(1) << 30),
                      "attention_ext.decode: block_table covers too many rows");
  } else {
    if (a.cache_batch_idx.has_value()) {
      check_index(a.cache_batch_idx, "cache_batch_idx", b, q);
    } else {
      TORCH_CHECK_VALUE(k.sym_size(0) == b, "attention_ext.decode: the cache has ", k.sym_size(0), " sequences and q ", b,
                        " (pass cache_batch_idx to pick cache rows)");
    }
  }
  check_index(a.seqlens_k, "cache_seqlens", b, q);
  check_index(a.leftpad_k, "cache_leftpad", b, q);
  const at::ScalarType acc = acc_dtype(q);
  if (a.alibi_slopes.has_value()) {
    const Tensor& s = *a.alibi_slopes;
    TORCH_CHECK_TYPE(s.scalar_type() == acc, "attention_ext.decode: alibi_slopes must be ", acc, ", got ",
                     s.scalar_type());
    TORCH_CHECK(s.device() == q.device(), "attention_ext.decode: alibi_slopes must be on ", q.device());
    TORCH_CHECK_VALUE((s.dim() == 1 && s.sym_size(0) == h) || (s.dim() == 2 && s.sym_size(0) == b && s.sym_size(1) == h),
                      "attention_ext.decode: alibi_slopes must be (H) or (B, H) = (", b, ", ", h, "), got ", s.sym_sizes());
    TORCH_CHECK_VALUE(s.sym_stride(-1) == 1,
                      "attention_ext.decode: alibi_slopes must be contiguous over heads (a strided view: pass "
                      "alibi_slopes.contiguous()), got strides ",
                      s.sym_strides());
  }
  if (a.sinks.has_value()) {
    const Tensor& s = *a.sinks;
    TORCH_CHECK_TYPE(s.scalar_type() == acc, "attention_ext.decode: sinks must be ", acc, ", got ", s.scalar_type());
    TORCH_CHECK(s.device() == q.device(), "attention_ext.decode: sinks must be on ", q.device());
    TORCH_CHECK_VALUE(s.dim() == 1 && s.sym_size(0) == h && s.is_contiguous(),
                      "attention_ext.decode: sinks must be a contiguous (H) = (", h, ") tensor, got ", s.sym_sizes());
  }
}

int64_t check_decode_inputs(const DecodeArgs& a, bool read_values) {
  check_decode_shapes(a);
  const Tensor& k = a.k;
  const bool paged = a.block_table.has_value();
  // a pool of pages (num_pages, page_size, ...) or one contiguous row of S_cache keys per sequence
  const int64_t num_pages = paged ? k.size(0) : 0, page = paged ? k.size(2) : 0;
  const int64_t cap = paged ? a.block_table->size(1) * page : k.size(2);
  if (!read_values) return cap;
  return check_values(a, a.q.size(0), cap, k.size(0), num_pages, page);
}

std::tuple<Tensor, Tensor> alloc_decode_outputs(const Tensor& q) {
  return {empty_like_layout(q),
          at::empty_symint({q.sym_size(0), q.sym_size(1), q.sym_size(2)}, q.options().dtype(acc_dtype(q)))};
}

template <typename Acc>
DecodeParamsT<Acc> make_decode_params(const DecodeArgs& a, const Tensor& out, const Tensor& lse) {
  Options o{};
  o.seqlens_k = a.seqlens_k;
  o.alibi_slopes = a.alibi_slopes;
  o.sinks = a.sinks;
  o.scale = a.scale;
  o.softcap = a.softcap;
  o.window_left = a.window_left;
  o.window_right = a.window_right;
  o.bottom_right = true;
  DecodeParamsT<Acc> p{};
  static_cast<SoftmaxParamsT<Acc>&>(p) = make_fwd_params<Acc>(a.q, a.k, a.v, out, lse, o);
  p.num_splits = int32_t(a.num_splits);
  if (a.block_table.has_value()) {
    const Tensor& bt = *a.block_table;
    p.block_table = bt.data_ptr<int32_t>();
    p.block_table_stride = bt.stride(0);
    p.page_size = int32_t(a.k.size(2));
    p.num_pages = int32_t(a.k.size(0));
    p.sk = int32_t(bt.size(1) * a.k.size(2));  // a sequence's capacity
    set_window(p, a.window_left, a.window_right);  // against that capacity
  }
  p.cache_batch_idx = a.cache_batch_idx.has_value() ? a.cache_batch_idx->data_ptr<int32_t>() : nullptr;
  p.leftpad_k = a.leftpad_k.has_value() ? a.leftpad_k->data_ptr<int32_t>() : nullptr;
  p.kv_quant = kKvNone;
  if (quantized_cache(a)) {
    p.kv_quant = a.k.scalar_type() == at::kChar ? kKvInt8 : kKvFp8;
    p.k_descale = a.k_descale->data_ptr<float>();
    p.v_descale = a.v_descale->data_ptr<float>();
    p.descale_per_token = a.k_descale->dim() == 3;
  }
  return p;
}
template DecodeParamsT<float> make_decode_params<float>(const DecodeArgs&, const Tensor&, const Tensor&);
template DecodeParamsT<double> make_decode_params<double>(const DecodeArgs&, const Tensor&, const Tensor&);

}  // namespace api
}  // namespace attn
