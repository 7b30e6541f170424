// The torch side of the delta-rule ops (the `linear` family): input checks with clear messages,
// output allocation, tensors -> attn::DeltaParams. The rules are stated here once; the CPU
// kernels, the Meta kernels and the check-only op (the Python reference's check) all run them.
//
// Op schema (registered in library.cpp):
//   delta_fwd(q, k, v, beta, <options>, checkpoints=False) -> (out, final_state, checkpoints)
//   delta_bwd(dout, dfinal_state?, q, k, v, beta, <options>, checkpoints?)
//       -> (dq, dk, dv, dbeta, dgate, dinitial_state)
//   delta_check(q, k, v, beta, <options>) -> ()
//   delta_step(q, k, v, beta, state!, gate?, scale, qk_l2norm) -> out
//       T tokens from `state`, advanced in place (decode)
//   <options> = gate?, initial_state?, cu_seqlens?, scale, qk_l2norm, plain
//   (plain: linear attention's write u = v with per-key gates, GLA; beta is checked, not read)
// q, k (B, H_k, S, K), v (B, H_v, S, V) through strides (last dim stride 1); beta (B, H_v, S),
// gate (B, H_v, S) or (B, H_v, S, K); states (B or the varlen sequences, H_v, K, V) in float32
// (float64 for float64 inputs). common/delta_params.h states the math.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <type_traits>

#include "common/delta_params.h"

#define ATTN_DELTA_OPTIONS(X)                                                                         \
  X("Tensor?", const std::optional<at::Tensor>&, gate)                                                \
  X("Tensor?", const std::optional<at::Tensor>&, initial_state)                                       \
  X("Tensor?", const std::optional<at::Tensor>&, cu_seqlens) X("float", double, scale) X("bool", bool, qk_l2norm) \
  X("bool", bool, plain)

#define ATTN_DELTA_OPTION_SCHEMA_(s, t, n) ", " s " " #n
#define ATTN_DELTA_OPTION_PARAM_(s, t, n) , t n
#define ATTN_DELTA_OPTION_ARG_(s, t, n) n,
#define ATTN_DELTA_OPTION_FIELD_(s, t, n) std::decay_t<t> n;
#define ATTN_DELTA_OPTIONS_SCHEMA ATTN_DELTA_OPTIONS(ATTN_DELTA_OPTION_SCHEMA_)
#define ATTN_DELTA_OPTIONS_PARAMS ATTN_DELTA_OPTIONS(ATTN_DELTA_OPTION_PARAM_)
#define ATTN_DELTA_MAKE_OPTIONS() ::attn::api::DeltaOptions{ATTN_DELTA_OPTIONS(ATTN_DELTA_OPTION_ARG_)}

namespace attn {
namespace api {

struct DeltaOptions {
  ATTN_DELTA_OPTIONS(ATTN_DELTA_OPTION_FIELD_)
};

// The L2 norm's epsilon under the square root (qk_l2norm), as the published layers use.
inline constexpr double kDeltaL2Eps = 1e-6;

// Checks q, k, v, beta and the options; throws c10::Error naming the bad argument.
void check_delta_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& beta,
                        const DeltaOptions& o);
// The backward's extra inputs.
void check_delta_bwd_inputs(const at::Tensor& dout, const std::optional<at::Tensor>& dfinal_state,
                            const at::Tensor& q, const at::Tensor& v, const DeltaOptions& o);

// out (B, H_v, S, V) in q's layout and dtype, final_state (B or sequences, H_v, K, V) in the
// accumulation dtype. Both may be meta / symbolic (the Meta kernels use them too).
std::tuple<at::Tensor, at::Tensor> alloc_delta_outputs(const at::Tensor& q, const at::Tensor& v,
                                                       const DeltaOptions& o);

// delta_fwd's checkpoints output: (delta_checkpoint_slots, H_v, V, K) in the accumulation dtype
// when wanted, else an empty tensor. delta_bwd's checkpoints input is checked against the same.
at::Tensor alloc_delta_checkpoints(const at::Tensor& q, const at::Tensor& v, const DeltaOptions& o, bool want);
void check_delta_checkpoints(const std::optional<at::Tensor>& checkpoints, const at::Tensor& q, const at::Tensor& v,
                             const DeltaOptions& o);

// What no kernel writes, on any device: out's rows that no sequence owns (a varlen pack's tail)
// become 0, and a call with no tokens passes the initial state (or zeros) to the final state.
// Returns true when nothing is left for a kernel (an empty call).
bool delta_fill_unwritten(at::Tensor& out, at::Tensor& state, const at::Tensor& q, const at::Tensor& v,
                          const DeltaOptions& o);

// delta_step's rules: delta_fwd's, and a contiguous state of the initial state's shape and dtype
// (it is written in place).
void check_delta_step_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& beta,
                             const at::Tensor& state, const DeltaOptions& o);
// out alone (delta_step's output)
at::Tensor alloc_delta_out(const at::Tensor& q, const at::Tensor& v);

template <typename Acc>
DeltaParamsT<Acc> make_delta_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& beta, const at::Tensor& out, const at::Tensor& final_state,
                                    const DeltaOptions& o);

struct DeltaGrads {
  at::Tensor dq, dk, dv, dbeta, dgate, dinit_state;
};
// like their inputs (dgate, dinit_state (0) tensors when the input is absent); zeros where no
// kernel writes (a varlen pack's tail, empty calls)
DeltaGrads alloc_delta_grads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& beta,
                             const DeltaOptions& o);

template <typename Acc>
DeltaBwdParamsT<Acc> make_delta_bwd_params(const at::Tensor& dout, const std::optional<at::Tensor>& dfinal_state,
                                           const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& beta, const DeltaOptions& o, DeltaGrads& g);

}  // namespace api
}  // namespace attn
