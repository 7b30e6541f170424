// The fused softmax attention's params (SoftmaxParamsT, SoftmaxBwdParamsT), shared by the CPU and
// CUDA backends and by the families that compute a softmax over scores: sparse (block layouts,
// top-k) and decode (DecodeParamsT extends SoftmaxParamsT with the cache).
//
// Plain old data: raw pointers, strides in elements, sizes. No ATen or CUDA types, so both
// backends and plain C++ tests can fill and read it (the role of FA2's flash.h).
//
// Tensors are addressed in the logical layout (B, H, S, D) through strides, so (B, S, H, D)
// inputs, slices of a packed QKV projection and varlen packs all reach the kernels without a
// copy. The head-dim stride is always 1.
#pragma once

#include <cstdint>

#include "block_sparse.h"
#include "philox.h"
#include "qkv_params.h"

namespace attn {

// How the optional `bias` tensor is read.
enum class BiasKind : int32_t {
  kNone = 0,
  kAdditive = 1,  // Acc (see SoftmaxParamsT), added to the score
  kBool = 2,      // uint8 (torch.bool): nonzero = attend, zero = masked
};

// The fused softmax attention's params. Its members follow QkvParams' in the same order as one
// flat struct, so kernels see the layout they were tuned with.
// Acc is the type the softmax runs in and the type of every float side tensor and constant:
// the LSE, ALiBi slopes, an additive bias, sinks, their gradients, scale and softcap. It is
// float for fp32 / fp16 / bf16 inputs (both backends) and double for float64 inputs (CPU
// only), so a float64 call is float64 end to end and gradcheck can test it.
// Keys per partial sum of the CUDA int8 forward's K mean (SoftmaxParamsT::Q8Operands): a long
// sequence's mean spread over that many CTAs per kv head.
constexpr int kQ8MeanKeys = 256;

// SoftmaxParamsT::qk_quant, the quantized Q K^T's number format
enum QkQuant : int32_t { kQkNone = 0, kQkInt8 = 1, kQkFp8 = 2 };

template <typename Acc>
struct SoftmaxParamsT : QkvParams {
  // (B, H, Sq) Acc, contiguous; varlen: (1, H, total_q) with lse_batch_stride 0. Element (b, h, i) of sequence b
  // is lse[b * lse_batch_stride + h * lse_head_stride + row_q + i] (SeqInfo::row_q).
  // softmax_d in the backward shares this layout.
  Acc* lse;
  int64_t lse_batch_stride, lse_head_stride;
  int64_t q_batch_stride, q_head_stride, q_row_stride;
  int64_t k_batch_stride, k_head_stride, k_row_stride;
  int64_t v_batch_stride, v_head_stride, v_row_stride;
  int64_t o_batch_stride, o_head_stride, o_row_stride;

  // ---------------------------------------------------------------- lengths
  // varlen: (B + 1) prefix sums; sequence b holds rows [cu[b], cu[b+1]) of a (1, H, total, D)
  // pack, and the batch strides are unused.
  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_k;
  // padded layout: (B) number of valid keys per batch (key padding); nullptr = all sk
  const int32_t* seqlens_k;

  // ---------------------------------------------------------------- score policy
  Acc scale;            // multiplies q.k
  Acc softcap;          // 0 = off, else s = softcap * tanh(s / softcap)
  int32_t window_left;  // -1 = unbounded; causal is window_right = 0
  int32_t window_right;
  bool bottom_right;    // diagonal aligned at the end (flash-attn) rather than the start (SDPA)
  // ALiBi: (B, H) or (H) Acc slopes (batch stride 0); score -= slope * |i + diag - j|
  const Acc* alibi_slopes;
  int64_t alibi_batch_stride;
  // bias / mask, broadcastable to (B, H, Sq, Sk): broadcast dims have stride 0
  const void* bias;
  BiasKind bias_kind;
  int64_t bias_batch_stride, bias_head_stride, bias_row_stride, bias_col_stride;
  // (H) Acc sink logits: join the softmax denominator, carry no value
  const Acc* sinks;

  // ---------------------------------------------------------------- sparsity (block_sparse.h)
  BlockSparseParams sparse;  // sparse.layout == nullptr: dense
  // top-k: (B, H, Sq) in lse's layout (thr Acc, jcut int32), or nullptr: keep every key
  const Acc* topk_thr;
  const int32_t* topk_jcut;

  // ---------------------------------------------------------------- dropout on the probabilities
  // probability of dropping; 0 = off. Acc, so the float64 kernels rescale the kept entries by
  // 1 / (1 - p) with p as given (a float32 p is off by up to 3e-8 relative); the keep decision
  // is drawn against float(p) in every precision (philox.h), the mask of reference.dropout_mask.
  Acc dropout_p;
  uint64_t seed;
  uint64_t offset;
  DropoutCoords dropout_coords;  // identity, or this call's place in a larger problem (philox.h)

  // ---------------------------------------------------------------- quantized Q K^T (forward only)
  // QkQuant: kQkNone = off; kQkInt8: Q per block of query rows and the mean-smoothed K per block
  // of keys rounded to int8, q . k summed in int32 (cpu/q8dot.h; CUDA: softmax/cuda/q8.cuh);
  // kQkFp8: the same blocks rounded to fp8 e4m3 (amax to 448), summed in float32 on Hopper's
  // wgmma (CUDA sm_90a only).
  int32_t qk_quant;
  // The CUDA forward's 8-bit operands (int8, or e4m3 bits), filled by its quantize pass
  // (softmax/cuda/q8.cuh): q8 / k8
  // in q's / k's shapes, contiguous (their own strides below: multiples of d, so every row is
  // 16-byte aligned, and a k expanded over the batch gets rows of its own per sequence, whose
  // mean differs with its length); q_scale (B, H, nbq) per q8_block_q
  // rows of a sequence, k_scale (B, H_k, nbk) per q8_block_k keys; q_mean (q . mean of its kv
  // head) in lse's layout; k_mean (B, H_k, d); k_sum / k_count the K mean's float64 partial sums
  // and key counts per (B, H_k, chunk of kQ8MeanKeys keys, below) (nch >= 1 chunks; nbk >= 1 too,
  // so an empty key range still writes its mean). Unused (null) elsewhere.
  struct Q8Operands {
    int8_t* q;
    int8_t* k;
    float* q_scale;
    float* k_scale;
    float* q_mean;
    float* k_mean;
    double* k_sum;
    int32_t* k_count;
    int64_t q_batch_stride, q_head_stride, q_row_stride;
    int64_t k_batch_stride, k_head_stride, k_row_stride;
    int32_t block_q, block_k, nbq, nbk, nch;
  } q8;

  // threads for the CPU backend (0 = the intra-op pool's, cpu/parallel.h)
  int32_t num_threads;
};

template <typename Acc>
struct SoftmaxBwdParamsT : SoftmaxParamsT<Acc> {
  const void* dout;
  int64_t do_batch_stride, do_head_stride, do_row_stride;
  void* dq;
  void* dk;
  void* dv;
  int64_t dq_batch_stride, dq_head_stride, dq_row_stride;
  int64_t dk_batch_stride, dk_head_stride, dk_row_stride;
  int64_t dv_batch_stride, dv_head_stride, dv_row_stride;
  // (B, H, Sq) Acc, lse's layout, or nullptr: the gradient flowing into the returned LSE.
  // d lse_i / d s_ij = P_ij, so it enters every backward as D_i = dot(dO_i, O_i) - dlse_i.
  const Acc* dlse;
  // (B, H, Sq) float32 scratch of the CUDA backward: rowwise dot(dO, O) - dlse
  float* softmax_d;
  // (B, H, Sq) or (B, H, Sq, D) float32 scratch as each backend needs (may be nullptr)
  float* dq_accum;
  // (B, H, Sq_b, Sk) Acc, Sq_b in {1, Sq}: the gradient of an additive bias before the
  // reduction over broadcast batch/head dims (done by the caller). nullptr = not wanted.
  Acc* dbias;
  int64_t dbias_batch_stride, dbias_head_stride, dbias_row_stride;  // row stride 0 if Sq_b == 1
  // (B, H) Acc: d loss / d sink, before the sum over the batch (done by the caller)
  Acc* dsinks;
  bool deterministic;
};

using SoftmaxParams = SoftmaxParamsT<float>;
using SoftmaxBwdParams = SoftmaxBwdParamsT<float>;

}  // namespace attn
