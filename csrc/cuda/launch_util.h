// Host helpers shared by the launchers (launch_template.cuh, launch_hopper.cuh).
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

// kernel<<<grid, block, smem, stream>>>, or the host emulator's launch (csrc/cuda/emu/cuda_emu.h)
#if defined(ATTN_CUDA_EMULATE)
#define ATTN_LAUNCH(kernel, grid, block, smem, stream) ::attn_emu::launch(kernel, grid, block, smem, stream)
#else
#define ATTN_LAUNCH(kernel, grid, block, smem, stream) kernel<<<grid, block, smem, stream>>>
#endif

namespace attn {

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

}  // namespace attn
