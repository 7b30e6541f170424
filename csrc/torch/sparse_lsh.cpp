// Reformer's shared-QK LSH attention (Kitaev et al. 2020) as composite ops over the fused softmax
// forward: attention_ext::lsh_buckets and attention_ext::lsh_attention, CompositeImplicitAutograd,
// so autograd, torch.compile and every device take the registrations of the ops they call (the
// hash, sort and gathers are ATen; the chunked attention is softmax_fwd with a bool mask).
//
// The semantics, per (batch, head) and hash round r (attention_ext.sparse.reference.lsh_attention_ref
// is the float64 oracle):
//   - queries are qk_i, keys k_j = qk_j / max(|qk_j|, 1e-12), scale 1 / sqrt(D);
//   - bucket(x) = argmax([x R_r ; -x R_r]) (first maximum on ties), R_r = rotations[r] (D, n_buckets / 2),
//     computed in the float side dtype (float32; float64 for float64 inputs); n_buckets = 1 puts
//     every position in bucket 0;
//   - positions sorted by (bucket, position), cut into chunks of chunk_size; query i attends key j
//     when both share a bucket, j lies in i's chunk or the one before it, j <= i when causal, and
//     j != i unless i has no other key: then i attends itself alone with logit -1e5 (so
//     out_{i,r} = v_i and lse_{i,r} = -1e5);
//   - the rounds combine by their LSEs: out_i = sum_r softmax_r(lse_{i,r}) out_{i,r}.
//
// Why a bool mask over chunk pairs: in sorted order each query's allowed keys lie in a window of
// 2 * chunk_size rows, but the window's bucket and self rules are per element and do not align
// with the kernels' diagonal-relative masks. So every chunk becomes one head of a (C, 2C)
// attention with an explicit (C, 2C) mask: memory O(S * C) per round (the mask, the chunk pairs'
// keys and values twice), compute O(S * C * D), never S^2.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>

#include "torch/softmax_binding.h"  // Options, routed_fwd
#include "torch/tensor_rules.h"     // acc_dtype

namespace {

using at::Tensor;
using c10::SymInt;

// The logit a query with no other key gives itself (the paper's self-mask value).
constexpr double kSelfLogit = -1e5;

// lsh_attention's and lsh_buckets' input rules: the one statement (attention_ext.sparse.lsh
// calls these ops, and the reference fallback runs them on meta tensors).
// v == nullptr: lsh_buckets' rules (qk, rotations, n_buckets), named as its own.
void check_lsh(const Tensor& qk, const Tensor* v, const std::optional<Tensor>& rotations_in, int64_t n_buckets,
               int64_t n_hashes, int64_t chunk_size) {
  const char* fn = v == nullptr ? "attention_ext.lsh_buckets: " : "attention_ext.lsh_attention: ";
  TORCH_CHECK_VALUE(qk.dim() == 4, fn, "qk must be 4-D (B, H, S, D) (or (B, S, H, D) with "
                    "layout='bshd'), got shape ", qk.sym_sizes());
  TORCH_CHECK_TYPE(qk.is_floating_point(), fn, "qk must be floating point, got ",
                   qk.scalar_type());
  TORCH_CHECK_VALUE(qk.sym_size(3) > 0, fn, "qk's head dim D must be >= 1");
  TORCH_CHECK_VALUE(n_buckets == 1 || (n_buckets >= 2 && n_buckets % 2 == 0),
                    fn, "n_buckets must be 1 or an even number >= 2 (the hash is the argmax "
                    "of [xR; -xR] over n_buckets / 2 rotations), got ", n_buckets);
  TORCH_CHECK_VALUE(n_hashes >= 1, fn, "n_hashes must be >= 1, got ", n_hashes);
  TORCH_CHECK_VALUE(rotations_in.has_value(), fn, "rotations (n_hashes, D, n_buckets // 2) "
                    "are required by the op (attention_ext.lsh_attention draws them when not given)");
  const Tensor& rotations = *rotations_in;
  TORCH_CHECK_VALUE(rotations.dim() == 3 && rotations.sym_size(0) == n_hashes &&
                        rotations.sym_size(1) == qk.sym_size(3) && rotations.sym_size(2) == n_buckets / 2,
                    fn, "rotations must be (n_hashes, D, n_buckets // 2) = (", n_hashes, ", ",
                    qk.sym_size(3), ", ", n_buckets / 2, "), got shape ", rotations.sym_sizes());
  TORCH_CHECK_TYPE(rotations.is_floating_point(), fn, "rotations must be floating point, got ",
                   rotations.scalar_type());
  TORCH_CHECK_VALUE(rotations.device() == qk.device(), fn, "rotations must be on qk's device ",
                    qk.device(), ", got ", rotations.device());
  if (v == nullptr) return;
  TORCH_CHECK_VALUE(chunk_size >= 1 && chunk_size < (int64_t(1) << 30), fn,
                    "chunk_size must be in [1, 2^30), got ", chunk_size);
  TORCH_CHECK_VALUE(v->dim() == 4, fn, "v must be 4-D like qk, got shape ", v->sym_sizes());
  TORCH_CHECK_VALUE(v->sym_sizes() == qk.sym_sizes(),
                    fn, "v must have qk's shape (one key and one value per position, the "
                    "fused kernel's head dim for both), got qk ", qk.sym_sizes(), " and v ", v->sym_sizes());
  TORCH_CHECK_TYPE(v->scalar_type() == qk.scalar_type(), fn, "qk and v must have one dtype, "
                   "got ", qk.scalar_type(), " and ", v->scalar_type());
  TORCH_CHECK_VALUE(v->device() == qk.device(), fn, "qk and v must be on one device, got ",
                    qk.device(), " and ", v->device());
}

// The rotation columns one hash product takes at a time: its (.., S, kHashCols) block is O(S)
// memory whatever n_buckets (with Reformer's n_buckets ~ S / chunk_size the whole product would be
// S^2 / (2 chunk_size) per head and round), and the blocks are static, so symbolic lengths
// (torch.compile) keep the same bound.
constexpr int64_t kHashCols = 32;

// (B, H, n_hashes, S) int64 buckets of qk's rows: argmax over [x ; -x], x = the rows times a
// rotation (.., n_buckets / 2), without the concatenation. The first maximum is in x (at argmax x)
// unless max(-x) = -min(x) is strictly larger (at n_buckets / 2 + argmin x), as argmax's
// first-maximum rule decides; over column blocks, a later block takes the maximum (minimum) only
// when strictly larger (smaller), which keeps the first one. The work is S * D * n_buckets / 2
// multiply-adds per head and round: linear in S for a fixed bucket count, quadratic for n_buckets ~ S.
Tensor buckets_of(const Tensor& qk, const Tensor& rotations, int64_t n_buckets) {
  const auto acc = attn::api::acc_dtype(qk);
  if (n_buckets == 1) {
    return at::zeros_symint({qk.sym_size(0), qk.sym_size(1), rotations.sym_size(0), qk.sym_size(2)},
                            qk.options().dtype(at::kLong));
  }
  const int64_t half = n_buckets / 2;
  const Tensor x = qk.detach().to(acc).unsqueeze(2), rot = rotations.detach().to(acc);  // (B, H, 1, S, D)
  Tensor hi_v, hi_i, lo_v, lo_i;  // running max / argmax and min / argmin, (B, H, n_hashes, S)
  for (int64_t c0 = 0; c0 < half; c0 += kHashCols) {
    // (B, H, 1, S, D) @ (n_hashes, D, cols) -> (B, H, n_hashes, S, cols)
    const Tensor xb = at::matmul(x, rot.slice(2, c0, std::min(half, c0 + kHashCols)));
    auto [bh_v, bh_i] = xb.max(-1);
    auto [bl_v, bl_i] = xb.min(-1);
    if (c0 == 0) {
      hi_v = bh_v, hi_i = bh_i, lo_v = bl_v, lo_i = bl_i;
      continue;
    }
    const Tensor up = bh_v.gt(hi_v), down = bl_v.lt(lo_v);
    hi_v = at::where(up, bh_v, hi_v), hi_i = at::where(up, bh_i + c0, hi_i);
    lo_v = at::where(down, bl_v, lo_v), lo_i = at::where(down, bl_i + c0, lo_i);
  }
  return at::where(hi_v.ge(lo_v.neg()), hi_i, lo_i + half);
}

Tensor lsh_buckets(const Tensor& qk, const std::optional<Tensor>& rotations, int64_t n_buckets) {
  // n_hashes is the rotations' first dim here (a 3-D check first, so that a wrong rank is named)
  const int64_t n_hashes =
      rotations.has_value() && rotations->dim() == 3 ? rotations->sym_size(0).guard_int(__FILE__, __LINE__) : 1;
  check_lsh(qk, nullptr, rotations, n_buckets, n_hashes, 1);
  return buckets_of(qk, *rotations, n_buckets);
}

// t's rows (.., S, X), n = the leading dims' product, picked per leading index i by idx (n, R, S')
// (row numbers within i's S rows) -> (n, R, S', X). One index_select over the flattened rows:
// its backward is one index_add.
Tensor pick_rows(const Tensor& t, const Tensor& idx) {
  const SymInt n = idx.sym_size(0), S = t.sym_size(-2), X = t.sym_size(-1);
  const Tensor base = at::arange(c10::Scalar(n), idx.options()).mul(c10::Scalar(S)).view_symint({n, 1, 1});
  return t.reshape_symint({n * S, X})
      .index_select(0, (idx + base).reshape({-1}))
      .view_symint({n, idx.sym_size(1), idx.sym_size(2), X});
}

std::tuple<Tensor, Tensor> lsh_attention(const Tensor& qk, const Tensor& v, const std::optional<Tensor>& rotations_in,
                                         int64_t n_buckets, int64_t n_hashes, int64_t chunk_size, bool causal) {
  check_lsh(qk, &v, rotations_in, n_buckets, n_hashes, chunk_size);
  const Tensor& rotations = *rotations_in;
  const SymInt B = qk.sym_size(0), H = qk.sym_size(1), S = qk.sym_size(2), D = qk.sym_size(3);
  const SymInt R = rotations.sym_size(0);
  const auto acc = attn::api::acc_dtype(qk);
  const auto lopts = qk.options().dtype(at::kLong);
  const auto s = S.maybe_as_int();
  if (s.has_value() && *s == 0) {  // no positions: nothing to hash or attend
    return {at::empty_symint(qk.sym_sizes(), qk.options()),
            at::empty_symint({B, H, S}, qk.options().dtype(acc))};
  }
  // a chunk longer than the sequence is one chunk: the same pairs from a (S, 2S) mask, not (C, 2C)
  const int64_t C = s.has_value() ? std::min(chunk_size, *s) : chunk_size;
  const SymInt nc = (S + (C - 1)) / C, tail = nc * C - S;  // chunks; pad rows after the last position
  if (qk.is_cuda()) {  // the fused call's grid: (B * H * n_hashes) batches of nc heads, each at most 65535
    TORCH_CHECK_VALUE(B * H * R <= 65535 && nc <= 65535, "attention_ext.lsh_attention: on CUDA, batch * heads * "
                      "n_hashes (", B * H * R, ") and the chunks per sequence, ceil(S / chunk_size) (", nc,
                      "), must each be <= 65535 (the kernel's grid): split the batch or raise chunk_size");
  }

  // sort each round's positions by (bucket, position)
  const Tensor buckets = buckets_of(qk, rotations, n_buckets);  // (B, H, R, S)
  const Tensor pos = at::arange(c10::Scalar(S), lopts);
  const Tensor perm = std::get<1>((buckets * c10::Scalar(S) + pos).sort(-1));
  const Tensor sb = buckets.gather(3, perm);  // sorted buckets; perm = sorted positions

  // queries, unit keys and values in sorted order, (B, H, R, S, D)
  const Tensor perm_n = perm.flatten(0, 1);  // (B * H, R, S)
  const Tensor qs = pick_rows(qk, perm_n).unflatten_symint(0, {B, H});
  const Tensor ks = qs / qs.norm(2, {-1}, true).clamp_min(1e-12);
  const Tensor vs = pick_rows(v, perm_n).unflatten_symint(0, {B, H});

  // Chunk c's queries are sorted rows [cC, (c+1)C) and its keys rows [(c-1)C, (c+1)C): every
  // sorted tensor gets C rows in front (chunk 0 looks back at nothing) and `tail` behind, their
  // bucket -1 (never a real bucket).
  const auto padded = [&](const Tensor& t, int64_t front, double value) {  // along dim 3 (S)
    return t.dim() == 4 ? at::constant_pad_nd_symint(t, {SymInt(front), tail}, value)
                        : at::constant_pad_nd_symint(t, {0, 0, SymInt(front), tail}, value);
  };
  const auto chunks = [&](const Tensor& t) {  // (B, H, R, nc * C, ..) -> (B, H, R, nc, C, ..)
    return t.unflatten_symint(3, {nc, SymInt(C)});
  };
  const auto pairs = [&](const Tensor& t, double value) {  // (B, H, R, S, ..) -> (B, H, R, nc, 2C, ..)
    const Tensor p = padded(t, C, value);
    return at::cat({chunks(p.slice_symint(3, 0, nc * C)), chunks(p.slice_symint(3, SymInt(C)))}, 4);
  };
  const Tensor bq = chunks(padded(sb, 0, -1)), bk = pairs(sb, -1);    // (B, H, R, nc, C) / (.., 2C)
  const Tensor pq = chunks(padded(perm, 0, -1)), pk = pairs(perm, -1);
  // (B, H, R, nc, C, 2C): same bucket, not itself, and not later when causal; a query with no
  // other key attends itself alone (the kernel then gives out = v_i exactly, and no gradient to
  // qk: its one probability is 1 whatever its logit), its lse set to the self logit below
  const Tensor self = pq.unsqueeze(-1).eq(pk.unsqueeze(-2));
  Tensor allowed = bq.unsqueeze(-1).eq(bk.unsqueeze(-2)).logical_and_(self.logical_not());
  if (causal) allowed.logical_and_(pk.unsqueeze(-2).le(pq.unsqueeze(-1)));
  const Tensor has_other = allowed.any(-1);  // (B, H, R, nc, C)
  allowed.logical_or_(self.logical_and(has_other.logical_not().unsqueeze(-1)));

  // every (batch, head, round) is one batch of the fused call and each of its chunks one head:
  // a CUDA grid holds up to 65535 of each (S up to 4M rows at chunk_size 64)
  const SymInt n = B * H * R;
  const Tensor qc = padded(qs, 0, 0).reshape_symint({n, nc, SymInt(C), D});
  const Tensor kc = pairs(ks, 0).reshape_symint({n, nc, SymInt(2 * C), D});
  const Tensor vc = pairs(vs, 0).reshape_symint({n, nc, SymInt(2 * C), D});

  attn::api::Options o{};
  o.bias = allowed.reshape_symint({n, nc, SymInt(C), SymInt(2 * C)});
  o.scale = 1.0 / std::sqrt(double(D.guard_int(__FILE__, __LINE__)));
  o.window_left = o.window_right = -1;
  o.block_size = 64;
  try {  // the fused kernel's own rules (the head dim, the dtype), here so that an error says whose call
    attn::api::check_inputs(qc, kc, vc, o);
  } catch (c10::Error& e) {
    e.add_context("in attention_ext.lsh_attention: the chunks of qk and v on the fused softmax kernel");
    throw;
  }
  auto [oc, lc] = attn::api::routed_fwd(qc, kc, vc, o, /*num_splits=*/1, /*deterministic=*/false);

  Tensor out = oc.reshape_symint({B, H, R, nc, SymInt(C), D});
  Tensor lse = at::where(has_other, lc.reshape_symint({B, H, R, nc, SymInt(C)}), kSelfLogit);
  // back to positions: drop the tail, undo the sort
  const Tensor inv = std::get<1>(perm.sort(-1));  // sorted row of each position
  out = pick_rows(out.flatten(3, 4).flatten(0, 2), inv.flatten(0, 2).unsqueeze(1))  // (B, H, R, S, D)
            .view_symint({B, H, R, S, D});
  lse = lse.flatten(3, 4).slice_symint(3, 0, S).gather(3, inv);    // (B, H, R, S)
  if (R == 1) return {out.squeeze(2), lse.squeeze(2)};
  const Tensor total = lse.logsumexp(2);  // (B, H, S)
  // the weights as a softmax over the rounds (max subtracted), not exp(lse - total): a query alone
  // in every round has lse -1e5 in each, where float32 rounds total = -1e5 + log R to a step of
  // 2^-7 and the weights would sum to 0.997
  const Tensor w = lse.softmax(2).unsqueeze(-1);
  return {(w * out.to(acc)).sum(2).to(qk.scalar_type()), total};
}

}  // namespace

TORCH_LIBRARY_IMPL(attention_ext, CompositeImplicitAutograd, m) {
  m.impl("lsh_buckets", &lsh_buckets);
  m.impl("lsh_attention", &lsh_attention);
}
