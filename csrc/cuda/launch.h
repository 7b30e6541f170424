// Host utilities of every CUDA launcher, torch-free: the launch macro (cuda/target.cuh), grid
// and shared-memory checks, launch errors, device queries and NVTX ranges. Errors are thrown as
// std::runtime_error naming `what`; the torch layer turns them into Python exceptions.
#pragma once

#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>

#include <atomic>
#include <stdexcept>
#include <string>

#include "cuda/target.cuh"  // ATTN_LAUNCH

namespace attn {

// gridDim.y and gridDim.z hold heads and batch
inline void check_grid(int y, int z, const char* what) {
  if (y > 65535 || z > 65535) {
    throw std::runtime_error(std::string(what) + ": heads and batch must each be <= 65535");
  }
}

template <typename Kernel>
inline void set_smem(Kernel kernel, int bytes, const char* what) {
  if (bytes > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e != cudaSuccess) {
      throw std::runtime_error(std::string(what) + ": cannot reserve " + std::to_string(bytes) +
                               " bytes of shared memory: " + cudaGetErrorString(e));
    }
  }
}

// Throws naming `what` if the last launch failed.
inline void check_launch(const char* what) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": CUDA launch failed: " + cudaGetErrorString(e));
  }
}

// Compute capability of the current device as 10 * major + minor (80, 90, ...).
inline int device_sm() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    throw std::runtime_error("attention: cannot query the current CUDA device");
  }
  return major * 10 + minor;
}

// A positive attribute of the current device, queried once per device (what: its name in the error).
template <cudaDeviceAttr kAttr>
inline int device_attribute(const char* what) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) throw std::runtime_error("attention: cannot query the current CUDA device");
  if (dev >= 0 && dev < kMaxDevices) {
    const int n = cache[dev].load(std::memory_order_relaxed);
    if (n > 0) return n;
  }
  int n = 0;
  if (cudaDeviceGetAttribute(&n, kAttr, dev) != cudaSuccess || n < 1) {
    throw std::runtime_error(std::string("attention: cannot query ") + what + " of the current CUDA device");
  }
  if (dev >= 0 && dev < kMaxDevices) cache[dev].store(n, std::memory_order_relaxed);
  return n;
}

// Streaming multiprocessors of the current device.
inline int device_sm_count() { return device_attribute<cudaDevAttrMultiProcessorCount>("the SM count"); }

// The most dynamic shared memory one block may opt in to (99 KB on sm_86 / sm_89, 163 KB on sm_80,
// 227 KB on sm_90).
inline int device_max_smem_optin() {
  return device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>("the shared memory per block");
}

// An NVTX range for the lifetime of the object (Nsight Systems / Compute group by these names).
struct NvtxRange {
  explicit NvtxRange(const char* name) { nvtxRangePushA(name); }
  ~NvtxRange() { nvtxRangePop(); }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

}  // namespace attn
