// Parameters of the linear attention kernels (the `linear` family), shared by the CPU and CUDA
// backends: plain data, strides in elements, as softmax_params.h.
//
// Per batch b, query head h and kv head h / (h / h_k), with phi the feature map applied in the
// kernel (feature_map.h) and Q~ = scale * phi(q), K~ = phi(k) (0 for a padded key):
//   v'_j  = [v_j, 1] when normalize (width Dv + 1 = dim_v_aug: the last column carries the
//           normalizer), else v_j
//   S_t   = exp(decay_t) S_{t-1} + K~_t v'_t^T      (M x dim_v_aug), S_{-1} = init_state or 0
//   O'_i  = Q~_i^T S_i (causal), or Q~_i^T S_last (non-causal, no decay)
//   out_i = O'_i[:Dv] / den_i, den_i = O'_i[Dv] + eps   (normalize), else out_i = O'_i
// so the causal form is also the quadratic sum_{j <= i} exp(G_i - G_j) (Q~_i . K~_j) v'_j with
// G the running sum of decay.
#pragma once

#include <cstdint>

#include "common/qkv_params.h"

namespace attn {

// A log-gate at or below kResetGate is a reset in the chunked kernels (linear attention's decay
// and the delta rule's gates): e^{gate} is 0 in float32 (e^-104 is below the smallest subnormal),
// so every weight across it is exactly 0, and the chunk sums restart there.
inline constexpr float kResetGate = -104.f;

enum class FeatureMap : int32_t { kIdentity = 0, kElu = 1, kRelu = 2 };

// The CUDA tensor-core kernels take fp16 / bf16 calls with M <= this (on sm_80 and later); wider
// calls, float32 and older devices run the SIMT kernels.
inline constexpr int kLinearTensorCoreMaxFeatures = 128;

// LinearParamsT::o_res holds the residual times 2^11 (fp16) or 2^8 (bf16), powers of two (exact
// both ways): at most |out| then, so it keeps its bits wherever out does, where an unscaled fp16
// residual of an output below ~0.1 is subnormal and keeps few.
inline constexpr float kResidualScaleF16 = 2048.f, kResidualScaleBF16 = 256.f;

// QkvParams' sq = sk = the sequence length (varlen: the longest), d = M, the feature width of
// q and k; o is (B, H, S, Dv) in q's dtype.
template <typename Acc>
struct LinearParamsT : QkvParams {
  int32_t dim_v;      // value width Dv
  int32_t dim_v_aug;  // Dv + normalize
  int64_t q_batch_stride, q_head_stride, q_row_stride;
  int64_t k_batch_stride, k_head_stride, k_row_stride;
  int64_t v_batch_stride, v_head_stride, v_row_stride;
  int64_t o_batch_stride, o_head_stride, o_row_stride;
  // out's rounding residual, (out_i in Acc) - out_i rounded to out's dtype, times
  // kResidualScale*, in out's dtype and strides; nullptr = none. Kept for a 16-bit normalized call that needs gradients: the backward
  // forms d den_i = -(dout_i . out_i) / den_i, and dk_j's dout_i . (v_j - out_i) / den_i cancels
  // on a row that sees one key (or keys with near-equal values), so the output's 16-bit rounding
  // (2^-9 relative) would swamp the gradient there, while out + residual is good to ~2^-17.
  // The CPU kernels and the CUDA SIMT kernels use it. The CUDA tensor-core kernels do not: their
  // backward takes dO' = dout / den as a 16-bit mma operand, whose rounding is out's own, so a
  // residual would add bytes and no accuracy (the CUDA binding refuses one there:
  // torch/linear_cuda_steps.h).
  void* o_res;
  // varlen: (B + 1) offsets into one (1, H, total, .) pack; batch strides unused
  const int32_t* cu_seqlens;
  // (B, S) key mask, nonzero = a real key; nullptr = every key. Varlen: (1, total).
  const uint8_t* key_mask;
  int64_t key_mask_batch_stride;
  // (B, H, S) Acc tensors, contiguous (varlen: (1, H, total)), element (b, h, row) at
  // b * seq_batch_stride + h * seq_head_stride + row:
  const Acc* decay;  // log-gates; nullptr = none
  Acc* den;          // den_i (normalize; 1 otherwise), kept for the backward
  int64_t seq_batch_stride, seq_head_stride;
  // (B, H, M, dim_v_aug) Acc, contiguous: the state before the first / after the last position
  const Acc* init_state;  // nullptr = zeros
  Acc* final_state;
  FeatureMap feature_map;
  bool causal, normalize;
  Acc eps, scale;
  int32_t num_threads;  // CPU: 0 = the pool's
};

template <typename Acc>
struct LinearBwdParamsT : LinearParamsT<Acc> {
  const void* dout;  // (B, H, S, Dv) like out
  int64_t do_batch_stride, do_head_stride, do_row_stride;
  const Acc* dfinal_state;  // (B, H, M, dim_v_aug) or nullptr
  void* dq;
  void* dk;
  void* dv;
  int64_t dq_batch_stride, dq_head_stride, dq_row_stride;
  int64_t dk_batch_stride, dk_head_stride, dk_row_stride;
  int64_t dv_batch_stride, dv_head_stride, dv_row_stride;
  Acc* ddecay;       // (B, H, S) like decay, or nullptr
  Acc* dinit_state;  // (B, H, M, dim_v_aug) or nullptr
};

// The recurrent step (linear_step): T positions (1 or a few) of causal linear attention on a
// state that is read and written in place, one pass over it. Per batch b, query head h (kv head
// h / (h / h_k)) and position t, with Q~ = scale * phi(q), K~ = phi(k):
//   S <- exp(decay_t) S + K~_t v_t^T     (M x Dv)
//   z <- exp(decay_t) z + K~_t           (M), the normalizer; absent without normalize
// with decay_t a scalar per head, or per feature (GLA: Diag(exp(decay_t)) S, row m by
// exp(decay_t[m]), and z likewise)
//   out_t = Q~_t^T S / (Q~_t . z + eps)  (normalize), else Q~_t^T S
// The state keeps S and z apart (the Python LinearAttentionState's S and z), not the augmented
// (M, Dv + 1) tensor of LinearParamsT: a step then needs no concatenation.
// QkvParams' sq = sk = T, d = M; o is (B, H, T, Dv) in q's dtype.
template <typename Acc>
struct LinearStepParamsT : QkvParams {
  int32_t dim_v;  // Dv
  int64_t q_batch_stride, q_head_stride, q_row_stride;
  int64_t k_batch_stride, k_head_stride, k_row_stride;
  int64_t v_batch_stride, v_head_stride, v_row_stride;
  int64_t o_batch_stride, o_head_stride, o_row_stride;
  Acc* state;  // (B, H, M, Dv), last dim contiguous
  int64_t state_batch_stride, state_head_stride, state_row_stride;
  Acc* normalizer;  // (B, H, M), last dim contiguous; nullptr = no normalization
  int64_t z_batch_stride, z_head_stride;
  const Acc* decay;  // (B, H, T) log-gates, or (B, H, T, M); contiguous; nullptr = none
  bool decay_per_feature;  // decay is (B, H, T, M)
  FeatureMap feature_map;
  Acc eps, scale;
};

}  // namespace attn
