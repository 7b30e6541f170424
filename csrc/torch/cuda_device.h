// What every family's CUDA binding tells its host steps about the real device (the CPU
// emulator's bindings answer the same questions for the emulator): outputs start unpoisoned,
// float64 is refused with the family's name (the CUDA kernels compute in float32; float64 has a
// kernel on the CPU only), and the calls run under a device guard on the current stream.
// Derived: the family's device struct, which names itself in kWhat.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace attn {
namespace api {

template <typename Derived>
struct CudaDeviceBase {
  static constexpr bool kPoison = false;
  void check_device(const at::Tensor& q) const {
    TORCH_CHECK_TYPE(q.scalar_type() != at::kDouble, Derived::kWhat,
                     ": float64 inputs are supported by the CPU kernels only; on CUDA use float32, float16 or "
                     "bfloat16");
  }
  c10::cuda::CUDAGuard guard(const at::Tensor& q) const { return c10::cuda::CUDAGuard(q.device()); }
  static cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }
  // the current stream is capturing a CUDA graph (no host syncs allowed)
  static bool capturing() {
    return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
  }
};

}  // namespace api
}  // namespace attn
