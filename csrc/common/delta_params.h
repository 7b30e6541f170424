// Parameters of the delta-rule kernels (DeltaNet, Gated DeltaNet, Kimi Delta Attention; part of
// the `linear` family): plain data, strides in elements, as linear_params.h.
//
// Per sequence n, value head hv and its q / k head hk = hv / (h_v / h_k), with k^, q^ the rows
// of k and q (L2-normalized over K when qk_l2norm: x / sqrt(sum x^2 + l2_eps)), a_t = exp(g_t)
// (a scalar per head, or a K-vector with gate_per_key: KDA) and h the (K, V) state:
//   h'  = Diag(a_t) h_{t-1}                    h_{-1} = init_state or 0
//   u_t = beta_t (v_t - h'^T k^_t)             (V)
//   h_t = h' + k^_t u_t^T
//   o_t = h_t^T (scale q^_t)                   (V)
// A gate of -inf is a hard reset (a_t = 0): the recurrence never subtracts log-gates, so it
// stays exact there, where a chunked form's exp(G_i - G_j) gives NaN.
// With `plain` the write is linear attention's, u_t = v_t (beta unread): h_t = Diag(a_t) h_{t-1}
// + k^_t v_t^T, GLA's per-key-channel gates (linear_attention with a (B, H, S, M) decay).
#pragma once

#include <cstdint>

#include "common/qkv_params.h"

namespace attn {

// The states kept for the backward (delta_fwd's `checkpoints`): the state entering every chunk of
// kDeltaChunk tokens, h_{64 c - 1} of sequence n at slot delta_checkpoint_slot(n, c), each
// (h_v, V, K), the state transposed (the CPU backward's rows are value columns).
inline constexpr int kDeltaChunk = 64;
// Slots of a call: ceil(S / 64) per batch row; for a varlen pack, floor(S / 64) + N (sequence n
// starts at slot floor(row0 / 64) + n, so no two sequences share one).
inline int64_t delta_checkpoint_slots(int64_t b, int64_t s, bool varlen) {
  return varlen ? s / kDeltaChunk + b : b * ((s + kDeltaChunk - 1) / kDeltaChunk);
}

// Whether the CUDA chunk-parallel kernels (linear/cuda/delta_chunk_kernel.cuh, its backwards) run
// a call, by its dtype and sizes, under the selection `chunked` (linear/cuda/entry.h
// DeltaCudaKernels: 0 never, 1 every call they take, -1 from kDeltaChunkRows rows on): bf16 or
// fp16, K <= 128, K and V multiples of 8; every gate (none, per head, per key: DeltaNet, Gated
// DeltaNet, KDA) with the delta write, per-key gates with the plain one (GLA's). The kernels also
// need 16-byte aligned rows (checked on the pointers by delta.cu). Stated here, without CUDA, so
// that Python (attention_ext._ext.delta_chunked) routes a CUDA call needing gradients by the same
// rule.
inline constexpr int kDeltaChunkRows = 256;
inline bool delta_chunk_takes(int chunked, DType dt, int dim_k, int dim_v, bool gate_per_key, bool plain, int64_t s,
                              bool backward) {
  if (chunked == 0 || (dt != DType::kBF16 && dt != DType::kF16)) return false;
  if (plain && !gate_per_key) return false;
  if (dim_k > 128 || dim_k % 8 != 0 || dim_v % 8 != 0) return false;
  return chunked == 1 || s >= kDeltaChunkRows;
}

template <typename Acc>
struct DeltaParamsT {
  int32_t b;         // batch (varlen: the number of sequences)
  int32_t h_k, h_v;  // heads of q / k, heads of v (h_v % h_k == 0)
  int32_t s;         // sequence length (varlen: the pack's length)
  int32_t dim_k, dim_v;  // K (q, k width), V (v width)
  DType dt;          // q, k, v, out (and dout, dq, dk, dv)
  const void* q;     // (B, h_k, S, K) through strides, last dim contiguous
  const void* k;
  const void* v;     // (B, h_v, S, V)
  void* o;           // (B, h_v, S, V)
  int64_t q_batch_stride, q_head_stride, q_row_stride;
  int64_t k_batch_stride, k_head_stride, k_row_stride;
  int64_t v_batch_stride, v_head_stride, v_row_stride;
  int64_t o_batch_stride, o_head_stride, o_row_stride;
  // varlen: (b + 1) offsets into one (1, ., S, .) pack; batch strides unused
  const int32_t* cu_seqlens;
  // (B, h_v, S) contiguous, of dtype beta_dt
  const void* beta;
  DType beta_dt;
  // log-gates: (B, h_v, S) or (B, h_v, S, K) (gate_per_key), contiguous, of dtype gate_dt;
  // nullptr = none
  const void* gate;
  DType gate_dt;
  bool gate_per_key;
  // (b, h_v, K, V) contiguous; nullptr = zeros / not wanted
  const Acc* init_state;
  Acc* final_state;
  // (delta_checkpoint_slots, h_v, V, K) contiguous: the forward writes it when not null, the
  // backward reads it when not null (else it runs a forward pass of its own)
  Acc* checkpoints;
  Acc scale;
  bool qk_l2norm;
  Acc l2_eps;
  bool plain;  // u_t = v_t (GLA), not beta_t (v_t - h'^T k^_t)
};

template <typename Acc>
struct DeltaBwdParamsT : DeltaParamsT<Acc> {
  const void* dout;  // (B, h_v, S, V), dt, last dim contiguous
  int64_t do_batch_stride, do_head_stride, do_row_stride;
  const Acc* dfinal_state;  // like final_state; nullptr = zeros
  void* dq;                 // like q, dt (every row of every sequence written)
  void* dk;                 // like k
  void* dv;                 // like v
  int64_t dq_batch_stride, dq_head_stride, dq_row_stride;
  int64_t dk_batch_stride, dk_head_stride, dk_row_stride;
  int64_t dv_batch_stride, dv_head_stride, dv_row_stride;
  void* dbeta;        // like beta (contiguous, beta_dt)
  void* dgate;        // like gate (contiguous, gate_dt); nullptr when no gate
  Acc* dinit_state;   // like init_state; nullptr = not wanted
};

}  // namespace attn
