// Linformer attention (Wang et al. 2020) as a composite op over the fused softmax forward:
// attention_ext::linformer_attention, CompositeImplicitAutograd, so autograd, torch.compile and
// every device take the registrations of the ops it calls.
//
// K and V are projected along the sequence, k' = proj_k k and v' = proj_v v, each one batched
// matmul ((r, S) shared by every head, or (H_k, r, S) per head), then q attends the r projected
// keys on the fused kernel (non-causal, as in the paper: a projection mixes every position).
// Cost O(S * r * D) for the projections and O(Sq * r * D) for the attention: linear in S for a
// fixed r, and no S x S tensor.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>

#include "torch/softmax_binding.h"  // Options, routed_fwd

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// proj (r, S) or (H_k, r, S) against x (B, H_k, S, X): the rules, stated once
void check_proj(const char* name, const Tensor& proj, const char* of, const Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() == 4, "attention_ext.linformer_attention: ", of, " must be 4-D (B, H_k, S, D) (or "
                    "(B, S, H_k, D) with layout='bshd'), got shape ", x.sym_sizes());
  TORCH_CHECK_VALUE(proj.dim() == 2 || proj.dim() == 3, "attention_ext.linformer_attention: ", name,
                    " must be (r, S) (shared by the heads) or (H_k, r, S) (per head) with S = ", of,
                    "'s length ", x.sym_size(2), ", got shape ", proj.sym_sizes());
  TORCH_CHECK_VALUE(proj.sym_size(-1) == x.sym_size(2), "attention_ext.linformer_attention: ", name,
                    "'s last dim must be ", of, "'s length S = ", x.sym_size(2), ", got shape ", proj.sym_sizes(),
                    " (a model built for a maximum length slices proj[..., :S])");
  TORCH_CHECK_VALUE(proj.dim() == 2 || proj.sym_size(0) == x.sym_size(1), "attention_ext.linformer_attention: ", name,
                    " per head must be (H_k, r, S) with H_k = ", x.sym_size(1), ", got shape ", proj.sym_sizes());
  TORCH_CHECK_VALUE(proj.sym_size(-2) >= 1, "attention_ext.linformer_attention: ", name,
                    " must project to r >= 1 rows, got shape ", proj.sym_sizes());
  TORCH_CHECK_TYPE(proj.scalar_type() == x.scalar_type(), "attention_ext.linformer_attention: ", name, " must have ",
                   of, "'s dtype ", x.scalar_type(), ", got ", proj.scalar_type(), " (cast it: ", name, ".to(", of,
                   ".dtype))");
  TORCH_CHECK_VALUE(proj.device() == x.device(), "attention_ext.linformer_attention: ", name, " must be on ", of,
                    "'s device ", x.device(), ", got ", proj.device());
}

Tensor linformer_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& proj_k,
                           const OptTensor& proj_v_in, std::optional<double> scale) {
  const Tensor& proj_v = proj_v_in.has_value() ? *proj_v_in : proj_k;
  check_proj("proj_k", proj_k, "k", k);
  check_proj(proj_v_in.has_value() ? "proj_v" : "proj_k (standing in for proj_v)", proj_v, "v", v);
  TORCH_CHECK_VALUE(proj_v.sym_size(-2) == proj_k.sym_size(-2), "attention_ext.linformer_attention: proj_k and "
                    "proj_v must project to the same r, got ", proj_k.sym_sizes(), " and ", proj_v.sym_sizes());
  TORCH_CHECK_VALUE(q.dim() == 4, "attention_ext.linformer_attention: q must be 4-D (B, H, Sq, D), got shape ",
                    q.sym_sizes());
  // (r, S) @ (B, H_k, S, D) and (H_k, r, S) @ (B, H_k, S, D) both broadcast to (B, H_k, r, D)
  const Tensor kp = at::matmul(proj_k, k), vp = at::matmul(proj_v, v);
  attn::api::Options o{};
  const int64_t d = q.sym_size(3).guard_int(__FILE__, __LINE__);
  o.scale = scale.has_value() ? *scale : 1.0 / std::sqrt(double(std::max<int64_t>(d, 1)));
  o.window_left = o.window_right = -1;
  o.block_size = 64;
  try {  // the fused kernel's rules on q and the projected k', v' (r rows), here so that an error says whose call
    attn::api::check_inputs(q, kp, vp, o);
  } catch (c10::Error& e) {
    e.add_context("in attention_ext.linformer_attention: q over k' = proj_k @ k and v' = proj_v @ v (r = "
                  "proj_k's rows) on the fused softmax kernel");
    throw;
  }
  return std::get<0>(attn::api::routed_fwd(q, kp, vp, o, /*num_splits=*/0, /*deterministic=*/false));
}

}  // namespace

TORCH_LIBRARY_IMPL(attention_ext, CompositeImplicitAutograd, m) { m.impl("linformer_attention", &linformer_attention); }
