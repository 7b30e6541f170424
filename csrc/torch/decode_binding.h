// The torch side of the decode op (attention over a KV cache), shared by its CPU and CUDA
// bindings (and the CPU emulator's): the schema, input checks with clear messages, output
// allocation and tensors -> attn::DecodeParamsT (common/decode_params.h).
//
// Op schema (registered in library.cpp):
//   decode_fwd(q, k_cache, v_cache, seqlens_k?, block_table?, cache_batch_idx?, leftpad_k?,
//              alibi_slopes?, sinks?, scale, softcap, window_left, window_right, num_splits=0,
//              k_descale?, v_descale?) -> (out, lse)
// q (B, H, Sq, D) through strides (flash-attn's (B, Sq, H, D) transposed); k_cache / v_cache
// (B_cache, H_k, S_cache, D), or paged (num_pages, H_k, page_size, D) with block_table
// (B, max_pages) int32. seqlens_k (B) int32: cache rows in use per sequence (absent = all);
// leftpad_k (B) int32: the first valid row. Causal is window_right = 0, always bottom-right.
// int8 / float8_e4m3fn caches (with q float32 / float16 / bfloat16) come with float32
// k_descale and v_descale: (B, H_k) per batch entry and kv head, or per row, (B_cache, S_cache,
// H_k) / paged (num_pages, page_size, H_k) (common/decode_params.h); the CPU kernel reads them.
// out keeps q's memory layout; lse is (B, H, Sq) float32 (float64 for float64 inputs).
// Forward only: the cache is not differentiated (flash-attn's function has no backward either).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "common/decode_params.h"

// decode_fwd's arguments: the op's schema, and its check-only twin decode_check's (the reference
// fallback's: the op's rules on a device without a kernel)
#define ATTN_DECODE_ARGS_SCHEMA                                                                        \
  "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? seqlens_k, Tensor? block_table, "                \
  "Tensor? cache_batch_idx, Tensor? leftpad_k, Tensor? alibi_slopes, Tensor? sinks, float scale, "     \
  "float softcap, int window_left, int window_right, int num_splits=0, Tensor? k_descale=None, "        \
  "Tensor? v_descale=None)"
#define ATTN_DECODE_SCHEMA "decode_fwd" ATTN_DECODE_ARGS_SCHEMA " -> (Tensor, Tensor)"

namespace attn {
namespace api {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

struct DecodeArgs {
  Tensor q, k, v;
  OptTensor seqlens_k, block_table, cache_batch_idx, leftpad_k, alibi_slopes, sinks;
  double scale, softcap;
  int64_t window_left, window_right, num_splits;
  OptTensor k_descale, v_descale;  // quantized caches only
};

// Whether the caches are int8 / float8_e4m3fn (quantized, with descales).
bool quantized_cache(const DecodeArgs& a);

// Shapes, dtypes and devices, then the values of the index tensors: seqlens_k in
// [0, capacity], leftpad_k in [0, seqlens_k], cache_batch_idx in [0, B_cache), and every
// block_table entry a sequence uses in [0, num_pages). CPU tensors are read in place; CUDA ones
// with one reduction and one host sync. Throws c10::Error (ValueError / RuntimeError / TypeError
// in Python) naming the bad argument. Returns the most keys any sequence sees (seqlens_k - leftpad,
// read with those values), for the CUDA backend's split heuristic. With read_values = false (a CUDA
// graph being captured, where a host copy is not allowed) the values go unread and unchecked and
// the capacity is returned: the kernels clamp every index into the cache (common/decode_params.h;
// cache_batch_idx by the CUDA host steps), so a bad value reads nothing out of bounds.
int64_t check_decode_inputs(const DecodeArgs& a, bool read_values = true);

// The shapes, dtypes and devices part of check_decode_inputs, with sizes as SymInts: what the
// op's Meta kernel (torch.compile's fake tensors, meta tensors) checks.
void check_decode_shapes(const DecodeArgs& a);

// out (q's shape and layout) and lse (B, H, Sq) of q's acc dtype.
std::tuple<Tensor, Tensor> alloc_decode_outputs(const Tensor& q);

template <typename Acc>
DecodeParamsT<Acc> make_decode_params(const DecodeArgs& a, const Tensor& out, const Tensor& lse);

}  // namespace api
}  // namespace attn
