// Host steps every family's CUDA binding shares (and the CPU emulator's, which differs only in
// its `Device`; see torch/softmax_cuda_steps.h): scratch on q's device and the launch's errors.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstddef>
#include <stdexcept>

namespace attn {
namespace api {

// float32 scratch of n elements on q's device: uninitialized, or NaN when poisoned
inline at::Tensor cuda_scratch(const at::Tensor& q, size_t n, bool poison) {
  at::Tensor t = at::empty({int64_t(n)}, q.options().dtype(at::kFloat));
  if (poison) t.fill_(NAN);
  return t;
}

// Runs a backend call, turning the std::runtime_error a torch-free backend throws (a launch or
// configuration error) into a c10::Error prefixed by Device::kWhat.
template <typename Device, typename Fn>
void run_backend(const Fn& fn) {
  try {
    fn();
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, Device::kWhat, ": ", e.what());
  }
}

}  // namespace api
}  // namespace attn
