// The host steps of the CUDA topk_threshold op between the op's tensors and the torch-free backend
// (csrc/sparse/cuda/entry.h): checks, outputs, params, scratch, the launch. One copy for the real
// CUDA binding (sparse_cuda.cpp) and the CPU emulator's, which differ only in
// their `Device`:
//
//   struct Device {
//     static constexpr bool kPoison;              // scratch starts as NaN (the emulator)
//     static constexpr const char* kWhat;         // error-message prefix
//     void check_device(const Tensor& q) const;   // dtype / device the backend takes
//     <RAII> guard(const Tensor& q) const;
//     size_t topk_scratch_entries(const SoftmaxParams&, int k_top) const;
//     void topk_threshold(const SoftmaxParams&, DType, int k_top, float* thr, int32_t* jcut, float* s_logit,
//                         int32_t* s_key) const;
//     void reads(std::initializer_list<const Tensor*>) const;
//   };
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>

#include "torch/cuda_steps.h"  // cuda_scratch, run_backend
#include "torch/sparse_topk.h"

namespace attn {
namespace api {

template <typename Device>
std::tuple<Tensor, Tensor> cuda_topk_steps(const Device& dev, const Tensor& q, const Tensor& k, const Options& o,
                                           int64_t k_top) {
  check_topk_inputs(q, k, o, k_top);
  dev.check_device(q);
  const auto guard = dev.guard(q);
  auto [thr, jcut] = alloc_topk_outputs(q);
  if (is_empty_call(q, k)) return {thr, jcut};
  // v = k and out = q stand in for tensors the pass never reads; thr has lse's layout
  const SoftmaxParams p = make_fwd_params<float>(q, k, k, q, thr, o);
  const DType dt = dtype_of(q);
  const size_t n = dev.topk_scratch_entries(p, int(k_top));
  if (n == 0) return {thr, jcut};
  Tensor s_logit = cuda_scratch(q, n, Device::kPoison);
  Tensor s_key = at::empty({int64_t(n)}, q.options().dtype(at::kInt));
  dev.reads({&q, &k});
  run_backend<Device>([&] {
    dev.topk_threshold(p, dt, int(k_top), thr.data_ptr<float>(), jcut.data_ptr<int32_t>(), s_logit.data_ptr<float>(),
                       s_key.data_ptr<int32_t>());
  });
  return {thr, jcut};
}

}  // namespace api
}  // namespace attn
