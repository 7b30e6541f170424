// The torch side of the fused softmax attention op, shared by its CPU and CUDA bindings (and the
// CPU emulator's): the op's option list, input checks with clear messages, output allocation
// with the rule for rows no kernel writes, and tensors -> attn::SoftmaxParams / attn::SoftmaxBwdParams.
// Kernels never see a tensor.
//
// Op schemas (library.cpp): softmax_fwd(q, k, v, <options>, num_splits, deterministic) and
// softmax_bwd(dout, q, k, v, out, lse, <options>, bias_grad, deterministic, dlse?), <options> the
// list ATTN_SOFTMAX_OPTIONS below.
// block_layout / block_size: the block-sparse layout (csrc/common/block_sparse.h); the bindings
// attach its tile indices (torch/block_index.h). topk_thr / topk_jcut: top-k attention's rows
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
#include <type_traits>

#include "common/softmax_params.h"
#include "torch/tensor_rules.h"  // dtype_of, acc_dtype, empty_like_layout

// The options every softmax-type entry point takes after its tensors, in schema order: the one
// list. X(schema type, C++ parameter type, name); the schema text, the C++ parameters and
// arguments of every binding, and the Options struct are generated from it.
//   rng_state: (seed, offset) on the host; overrides seed / offset when given
//   dropout_coords: (B * H + Sq + Sk) int32 global dropout coordinates, or none
//   block_layout: block-sparse, (H or 1, ceil(Sq / block_size), ceil(Sk / block_size)) bool, or none
//   topk_thr / topk_jcut: top-k, the (B, H, Sq) thresholds (acc dtype) and cut keys (int32) of the
//   threshold pass
#define ATTN_SOFTMAX_OPTIONS(X)                                                                            \
  X("Tensor?", const ::attn::api::OptTensor&, bias) X("Tensor?", const ::attn::api::OptTensor&, alibi_slopes) \
  X("Tensor?", const ::attn::api::OptTensor&, sinks) X("Tensor?", const ::attn::api::OptTensor&, seqlens_k)   \
  X("Tensor?", const ::attn::api::OptTensor&, cu_seqlens_q)                                                   \
  X("Tensor?", const ::attn::api::OptTensor&, cu_seqlens_k) X("int", int64_t, max_seqlen_q)                   \
  X("int", int64_t, max_seqlen_k) X("float", double, scale) X("float", double, softcap)                       \
  X("int", int64_t, window_left) X("int", int64_t, window_right) X("bool", bool, bottom_right)                \
  X("float", double, dropout_p) X("int", int64_t, seed) X("int", int64_t, offset)                            \
  X("Tensor?", const ::attn::api::OptTensor&, rng_state)                                                      \
  X("Tensor?", const ::attn::api::OptTensor&, dropout_coords)                                                 \
  X("Tensor?", const ::attn::api::OptTensor&, block_layout) X("int", int64_t, block_size)                     \
  X("Tensor?", const ::attn::api::OptTensor&, topk_thr) X("Tensor?", const ::attn::api::OptTensor&, topk_jcut)

// Each with a leading comma, to follow a binding's tensors: "..., Tensor v" ATTN_SOFTMAX_OPTIONS_SCHEMA
// in a schema, `const Tensor& v ATTN_SOFTMAX_OPTIONS_PARAMS` in a kernel's parameters.
#define ATTN_SOFTMAX_OPTION_SCHEMA_(s, t, n) ", " s " " #n
#define ATTN_SOFTMAX_OPTION_PARAM_(s, t, n) , t n
#define ATTN_SOFTMAX_OPTION_ARG_(s, t, n) n,
#define ATTN_SOFTMAX_OPTION_FIELD_(s, t, n) std::decay_t<t> n;
#define ATTN_SOFTMAX_OPTION_TYPE_(s, t, n) , t
#define ATTN_SOFTMAX_OPTION_OF_(s, t, n) , ATTN_SOFTMAX_OPTIONS_OBJ.n
#define ATTN_SOFTMAX_OPTIONS_SCHEMA ATTN_SOFTMAX_OPTIONS(ATTN_SOFTMAX_OPTION_SCHEMA_)
#define ATTN_SOFTMAX_OPTIONS_PARAMS ATTN_SOFTMAX_OPTIONS(ATTN_SOFTMAX_OPTION_PARAM_)
// The options' C++ types, for a typed dispatcher call's signature.
#define ATTN_SOFTMAX_OPTIONS_TYPES ATTN_SOFTMAX_OPTIONS(ATTN_SOFTMAX_OPTION_TYPE_)
// The fields of the Options named ATTN_SOFTMAX_OPTIONS_OBJ, as a call's arguments.
#define ATTN_SOFTMAX_OPTIONS_OF ATTN_SOFTMAX_OPTIONS(ATTN_SOFTMAX_OPTION_OF_)
// The Options of a kernel that took ATTN_SOFTMAX_OPTIONS_PARAMS.
#define ATTN_SOFTMAX_MAKE_OPTIONS() ::attn::api::Options{ATTN_SOFTMAX_OPTIONS(ATTN_SOFTMAX_OPTION_ARG_)}

namespace attn {
namespace api {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// A CPU call with at most this many query rows (route_fwd) can run on the decode kernel: key
// splits across threads and a GQA group's heads packed as rows, where the fused forward's tiles
// would hold mostly padding (benchmarks/results: faster at 1-8 rows, slower from 16).
constexpr int64_t kDecodeMaxQ = 8;

// The options every entry point takes, after the tensors (ATTN_SOFTMAX_OPTIONS).
struct Options {
  ATTN_SOFTMAX_OPTIONS(ATTN_SOFTMAX_OPTION_FIELD_)
};

// Checks q / k / v and the options; throws c10::Error (RuntimeError / ValueError in Python)
// naming the bad argument.
void check_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const Options& o);

// Which kernel a routed softmax forward (softmax_fwd_routed, the functional API's) runs: the fused
// forward (softmax_fwd), or the decode kernel (decode_fwd) for a CPU call of at most kDecodeMaxQ
// query rows that it computes the same way (no mask, dropout, block layout, top-k or varlen
// pack; positions aligned bottom-right as it aligns them, unless nothing depends on positions or
// Sq = Sk) and that has nothing to differentiate (the decode kernel has no backward, and the fused
// backward recomputes the fused forward's logits). softmax_fwd itself always runs the fused
// kernels, so callers that pair it with softmax_bwd (context parallelism) keep that pairing. The
// one statement of the rule (softmax_route.cpp); `why` says what decided, and
// attention_ext.softmax.ops.fwd_route reports it. Read above the Autograd key (grad mode and
// requires_grad are the caller's).
struct FwdRoute {
  bool decode;
  const char* why;
};
FwdRoute route_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Options& o);

// The routed forward: the decode kernel where route_fwd sends the call (below the Autograd key),
// else softmax_fwd through the dispatcher. q, k, v (B, H, S, D) views. fused_errors: check the
// inputs by softmax_fwd's rules before a call goes to the decode kernel, so that an error names
// them as softmax_fwd would (the plain call, whose caller rewords any error, skips it).
std::tuple<Tensor, Tensor> routed_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Options& o,
                                      int64_t num_splits, bool deterministic, bool fused_errors = true);

// num_splits of the forward: 0 = the split-KV heuristic, N >= 1 = N splits (1 = none; CUDA
// clamps to its maximum, the CPU ignores it).
void check_num_splits(int64_t num_splits);

// The quantized Q K^T of a forward (softmax_fwd_quant): qk_quant "int8" / "fp8" -> kQkInt8 /
// kQkFp8 (SoftmaxParams::qk_quant), after its rules: float32 / float16 / bfloat16 inputs, no
// top-k; any other string is an error. Checked before check_inputs (whose rules then apply as to
// softmax_fwd). Which devices run which format is each backend's rule (the CPU: int8 only).
int32_t check_qk_quant(const Tensor& q, const Options& o, c10::string_view qk_quant);

// Checks the backward's extra inputs (dout, out, lse and the optional dlse) against q.
void check_bwd_inputs(const Tensor& dout, const Tensor& q, const Tensor& out, const Tensor& lse,
                      const OptTensor& dlse);

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

// The window's sides into p, once p.sq / p.sk are final: -1 (unbounded) for a side at least
// max(Sq, Sk) wide.
template <typename Acc>
void set_window(SoftmaxParamsT<Acc>& p, int64_t left, int64_t right);
// Acc = float, or double for float64 inputs (instantiated for both).
template <typename Acc>
SoftmaxParamsT<Acc> make_fwd_params(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                const Tensor& lse, const Options& o);
template <typename Acc>
SoftmaxBwdParamsT<Acc> make_bwd_params(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& out, const Tensor& lse, const OptTensor& dlse, const Options& o,
                                Grads& g, bool deterministic);

}  // namespace api
}  // namespace attn
