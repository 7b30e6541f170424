// The torch side of the fused softmax attention op, shared by its CPU and CUDA bindings (and the
// CPU emulator's): the op's option list, input checks with clear messages, output allocation
// with the rule for rows no kernel writes, and tensors -> attn::FwdParams / attn::BwdParams.
// Kernels never see a tensor.
//
// Op schema (registered in library.cpp):
//   fwd(q, k, v, <options>, num_splits=1, deterministic=False) -> (out, lse)
//   bwd(dout, q, k, v, out, lse, <options>, bias_grad, deterministic, dlse?)
//       -> (dq, dk, dv, dbias, dsinks)
//   <options> = bias?, alibi_slopes?, sinks?, seqlens_k?, cu_seqlens_q?, cu_seqlens_k?,
//       max_seqlen_q, max_seqlen_k, scale, softcap, window_left, window_right, bottom_right,
//       dropout_p, seed, offset, rng_state?, dropout_coords?, block_layout?, block_size, topk_thr?,
//       topk_jcut?
// block_layout / block_size: the block-sparse layout (csrc/common/block_sparse.h); the bindings
// attach its tile indices (torch/sparse_index.h). topk_thr / topk_jcut: top-k attention's rows
// from the threshold pass (torch.ops.attention_ext.topk_threshold).
// rng_state: an optional CPU int64 (2) tensor (seed, offset) that overrides the int seed / offset.
// The functional API draws it with torch.randint, so that torch.compile traces the draw (no
// .item(), no recompile per seed) and the backward reuses the forward's tensor; the bindings
// read it on the host (no device sync).
// dropout_coords: an optional int32 (B * H + Sq + Sk) tensor on q's device, the global
// (b * H_global + h, query row, key column) of every local one, concatenated: the call is one
// piece of a larger problem and draws that problem's dropout mask (attn::DropoutCoords;
// context parallelism). Not with varlen.
// q (B, H, Sq, D), k / v (B, H_k, Sk, D) through strides (head-dim stride 1); varlen packs are
// (1, H, total, D) with cu_seqlens. out / dq / dk / dv keep their input's memory layout.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "common/params.h"

// The options, as schema text and as C++ parameters / arguments of every binding.
#define ATTN_SOFTMAX_OPTIONS_SCHEMA                                                                    \
  "Tensor? bias, Tensor? alibi_slopes, Tensor? sinks, Tensor? seqlens_k, Tensor? cu_seqlens_q, "        \
  "Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float scale, float softcap, int window_left, " \
  "int window_right, bool bottom_right, float dropout_p, int seed, int offset, Tensor? rng_state, "      \
  "Tensor? dropout_coords, Tensor? block_layout, int block_size, Tensor? topk_thr, Tensor? topk_jcut"
#define ATTN_SOFTMAX_OPTIONS_PARAMS                                                                        \
  const ::attn::api::OptTensor &bias, const ::attn::api::OptTensor &alibi_slopes,                         \
      const ::attn::api::OptTensor &sinks, const ::attn::api::OptTensor &seqlens_k,                       \
      const ::attn::api::OptTensor &cu_seqlens_q, const ::attn::api::OptTensor &cu_seqlens_k,             \
      int64_t max_seqlen_q, int64_t max_seqlen_k, double scale, double softcap, int64_t window_left,      \
      int64_t window_right, bool bottom_right, double dropout_p, int64_t seed, int64_t offset,            \
      const ::attn::api::OptTensor &rng_state, const ::attn::api::OptTensor &dropout_coords,              \
      const ::attn::api::OptTensor &block_layout, int64_t block_size,                                     \
      const ::attn::api::OptTensor &topk_thr, const ::attn::api::OptTensor &topk_jcut
#define ATTN_SOFTMAX_OPTIONS_ARGS                                                                      \
  bias, alibi_slopes, sinks, seqlens_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, \
      softcap, window_left, window_right, bottom_right, dropout_p, seed, offset, rng_state, dropout_coords, \
      block_layout, block_size, topk_thr, topk_jcut

namespace attn {
namespace api {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// A CPU call with at most this many query rows, no tensor option (a mask, lengths, dropout, a
// block layout, top-k, varlen) and nothing to differentiate runs on the decode kernel (key
// splits across threads, a GQA group's heads packed as rows) instead of the fused forward's
// tiles: measured 1.4-5.4x faster at 1-8 rows (one thread, B1, S_k 2048-4096, fp32 and bf16),
// slower from 16. fwd_plain routes by it (softmax_plain.cpp); attention_ext._C.decode_max_q
// gives it to the general path in Python.
constexpr int64_t kDecodeMaxQ = 8;

// The options every entry point takes, after the tensors.
struct Options {
  OptTensor bias, alibi_slopes, sinks, seqlens_k, cu_seqlens_q, cu_seqlens_k;
  int64_t max_seqlen_q, max_seqlen_k;
  double scale, softcap;
  int64_t window_left, window_right;
  bool bottom_right;
  double dropout_p;
  int64_t seed, offset;
  OptTensor rng_state;  // (seed, offset) on the host; overrides seed / offset when given
  OptTensor dropout_coords;  // (B * H + Sq + Sk) int32: global dropout coordinates, or none
  // block-sparse: (H or 1, ceil(Sq / block_size), ceil(Sk / block_size)) bool, or none (dense)
  OptTensor block_layout;
  int64_t block_size;
  // top-k: (B, H, Sq) thresholds (acc dtype) and cut keys (int32) of the threshold pass
  OptTensor topk_thr, topk_jcut;
};

inline Options make_options(ATTN_SOFTMAX_OPTIONS_PARAMS) { return Options{ATTN_SOFTMAX_OPTIONS_ARGS}; }

DType dtype_of(const Tensor& t);

// The dtype of the float side tensors (lse, an additive bias, ALiBi slopes, sinks and their
// gradients): float64 for float64 inputs, else float32 (attn::FwdParamsT's Acc).
at::ScalarType acc_dtype(const Tensor& q);

// Checks q / k / v and the options; throws c10::Error (RuntimeError / ValueError in Python)
// naming the bad argument.
void check_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const Options& o);

// num_splits of the forward: 0 = the split-KV heuristic, N >= 1 = N splits (1 = none; CUDA
// clamps to its maximum, the CPU ignores it).
void check_num_splits(int64_t num_splits);

// Checks the backward's extra inputs (dout, out, lse and the optional dlse) against q.
void check_bwd_inputs(const Tensor& dout, const Tensor& q, const Tensor& out, const Tensor& lse,
                      const OptTensor& dlse);

// An uninitialized (B, H, S, D) tensor with the same memory layout as `like`: (B, S, H, D)
// storage when `like` has heads inside rows, else contiguous (B, H, S, D).
Tensor empty_like_layout(const Tensor& like);

// The forward's outputs: out (q's shape and layout) and lse (B, H, Sq) of acc_dtype(q) (varlen:
// (1, H, total_q)). Rows no kernel writes (all of an empty call, a varlen pack past its last
// sequence) hold out = 0, lse = -inf. poison: every other element starts as NaN, so that an
// element a kernel fails to write shows (the CPU emulator's bindings).
std::tuple<Tensor, Tensor> alloc_fwd_outputs(const Tensor& q, const Options& o, bool poison = false);

// A call with nothing to compute: its outputs are the zeros / -inf of the allocation rules.
inline bool is_empty_call(const Tensor& q, const Tensor& k) { return q.numel() == 0 || k.numel() == 0; }

// Outputs of the backward, allocated: dq, dk, dv like q, k, v; dbias (B, H, Sq_b, Sk) when
// bias_grad; dsinks (B, H) when sinks are given (both acc_dtype(q)); else empty tensors.
// dq / dk / dv rows that no sequence owns (keys past seqlens_k, a varlen pack's tail) and every
// row of an empty call are zero; the kernels write only the rows inside sequences. dbias and
// dsinks start at zero (the kernels accumulate into them). poison: what the kernels are meant
// to write starts as NaN instead (dbias / dsinks included: the CUDA backward zeroes them itself).
struct Grads {
  Tensor dq, dk, dv, dbias, dsinks;
};
Grads alloc_grads(const Tensor& q, const Tensor& k, const Tensor& v, const Options& o, bool bias_grad,
                  bool poison = false);

// Acc = float, or double for float64 inputs (instantiated for both).
template <typename Acc>
FwdParamsT<Acc> make_fwd_params(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                const Tensor& lse, const Options& o);
template <typename Acc>
BwdParamsT<Acc> make_bwd_params(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& out, const Tensor& lse, const OptTensor& dlse, const Options& o,
                                Grads& g, bool deterministic);

}  // namespace api
}  // namespace attn
