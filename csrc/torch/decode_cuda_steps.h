// The host steps of the CUDA decode op between the op's tensors and the torch-free backend
// (csrc/decode/cuda/entry.h): checks (decode_binding.h), outputs, params, the split count and its
// fp32 scratch, the launch, errors. One copy for the real CUDA binding (decode_cuda.cpp) and the
// CPU emulator's, which differ only in their `Device`:
//
//   struct Device {
//     static constexpr bool kPoison;       // outputs and scratch start as NaN (the emulator)
//     static constexpr const char* kWhat;  // error-message prefix
//     void check_device(const Tensor& q) const;  // dtype / device the backend takes
//     <RAII> guard(const Tensor& q) const;       // device guard for the call
//     int sm_count() const;                      // SMs of the device (the split heuristic)
//     bool capturing() const;                    // the current stream is capturing a CUDA graph
//     void decode_fwd(const DecodeParams&, DType, int splits, float* part_o, float* part_lse) const;
//   };
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <tuple>

#include "common/decode_params.h"
#include "decode/cuda/entry.h"  // cuda_decode_kernels
#include "decode/cuda/heuristics.h"
#include "torch/decode_binding.h"
#include "torch/cuda_steps.h"  // run_backend
#include "torch/tensor_rules.h"  // dtype_of

namespace attn {
namespace api {

template <typename Device>
std::tuple<at::Tensor, at::Tensor> decode_cuda_steps(const Device& dev, const DecodeArgs& args) {
  // While a CUDA graph is captured the index values cannot be copied to the host (a sync): they
  // go unchecked, the split heuristic sees the capacity (an upper bound of every replay's
  // lengths), and cache_batch_idx is clamped into the cache here, on the device, as the kernels
  // clamp seqlens_k, leftpad_k and the pages (common/decode_params.h): nothing is read out of
  // bounds. flash_attn_with_kvcache (attention_ext/decode/kvcache.py) turns such values into
  // NaN rows instead.
  dev.check_device(args.q);
  const auto guard = dev.guard(args.q);
  const bool capturing = dev.capturing();  // on q's device, under the guard
  const int64_t max_keys = check_decode_inputs(args, !capturing);
  TORCH_CHECK_VALUE(!quantized_cache(args) || cuda_decode_kernels().quantized,
                    "attention_ext.decode: int8 / float8_e4m3fn caches on CUDA need "
                    "attention_ext.decode.set_cuda_kernels(quantized=True) (the CUDA-core kernel's 8-bit build, not "
                    "yet run on a GPU); without it decode_fwd and flash_attn_with_kvcache run them through the "
                    "dequantized reference");
  auto [out, lse] = alloc_decode_outputs(args.q);
  if (args.q.numel() == 0) return {out, lse};
  DecodeArgs a = args;
  if (capturing && a.cache_batch_idx.has_value()) a.cache_batch_idx = a.cache_batch_idx->clamp(0, a.k.size(0) - 1);
  if constexpr (Device::kPoison) {
    out.fill_(NAN);
    lse.fill_(NAN);
  }
  const DecodeParams p = make_decode_params<float>(a, out, lse);
  const int splits = decode_num_splits_heuristic(int64_t(p.b) * p.h_k, dev.sm_count(), max_keys, p.num_splits);
  at::Tensor part_o, part_lse;
  if (splits > 1) {
    // (B, H, Sq, splits, D) and (B, H, Sq, splits) fp32 partials, from the caching allocator
    const auto f32 = a.q.options().dtype(at::kFloat);
    part_o = at::empty({int64_t(p.b) * p.h * p.sq * splits * p.d}, f32);
    part_lse = at::empty({int64_t(p.b) * p.h * p.sq * splits}, f32);
    if constexpr (Device::kPoison) {
      part_o.fill_(NAN);
      part_lse.fill_(NAN);
    }
  }
  const DType dt = dtype_of(a.q);
  run_backend<Device>([&] {
    dev.decode_fwd(p, dt, splits, splits > 1 ? part_o.data_ptr<float>() : nullptr,
                   splits > 1 ? part_lse.data_ptr<float>() : nullptr);
  });
  return {out, lse};
}

}  // namespace api
}  // namespace attn
