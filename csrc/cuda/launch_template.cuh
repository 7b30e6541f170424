// Launcher definitions, included only by the generated instantiation files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdexcept>
#include <string>

#include "bwd_kernel.cuh"
#include "fwd_kernel.cuh"
#include "launch_impl.h"
#include "simt_kernel.cuh"
#include "traits.h"

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

template <typename T, int kD>
void run_fwd_tc(const FwdParams& p, cudaStream_t stream) {
  using Tr = FwdTraits<kD>;
  constexpr int kSmem = fwd_smem_bytes<kD, Tr::kBlockM, Tr::kBlockN>();
  auto kernel = tc::fwd_kernel<T, kD, Tr::kBlockM, Tr::kBlockN, Tr::kNWarps>;
  set_smem(kernel, kSmem, "attention fwd");
  check_grid(p.h, p.b, "attention fwd");
  dim3 grid((p.sq + Tr::kBlockM - 1) / Tr::kBlockM, p.h, p.b);
  kernel<<<grid, Tr::kNWarps * 32, kSmem, stream>>>(p);
  check_launch("attention fwd (tensor cores)");
}

template <typename T, int kD, bool kDropout>
void run_bwd_tc_impl(const BwdParams& p, cudaStream_t stream) {
  {
    using Tr = BwdTraits<kD>;
    constexpr int kSmem = bwd_smem_bytes<kD, Tr::kBlockM, Tr::kBlockN>();
    auto kernel =
        tc::bwd_dkdv_kernel<T, kD, Tr::kDAcc, Tr::kBlockM, Tr::kBlockN, Tr::kNWarps, kDropout>;
    set_smem(kernel, kSmem, "attention bwd dk/dv");
    dim3 grid(((p.sk + Tr::kBlockN - 1) / Tr::kBlockN) * (kD / Tr::kDAcc), p.h_k, p.b);
    kernel<<<grid, Tr::kNWarps * 32, kSmem, stream>>>(p);
    check_launch("attention bwd dk/dv (tensor cores)");
  }
  if (p.deterministic) {
    using Tr = BwdDqTraits<kD>;
    constexpr int kSmem = bwd_dq_smem_bytes<kD, Tr::kBlockM, Tr::kBlockN>();
    auto kernel =
        tc::bwd_dq_kernel<T, kD, Tr::kDAcc, Tr::kBlockM, Tr::kBlockN, Tr::kNWarps, kDropout>;
    set_smem(kernel, kSmem, "attention bwd dq");
    dim3 grid(((p.sq + Tr::kBlockM - 1) / Tr::kBlockM) * (kD / Tr::kDAcc), p.h, p.b);
    kernel<<<grid, Tr::kNWarps * 32, kSmem, stream>>>(p);
    check_launch("attention bwd dq (tensor cores)");
  } else {
    run_bwd_convert_dq<T>(p, kD, stream);
  }
}

template <typename T, int kD>
void run_bwd_tc(const BwdParams& p, cudaStream_t stream) {
  check_grid(p.h, p.b, "attention bwd");
  if (p.dropout_p > 0.f) {
    run_bwd_tc_impl<T, kD, true>(p, stream);
  } else {
    run_bwd_tc_impl<T, kD, false>(p, stream);
  }
}

template <typename T>
void run_fwd_simt(const FwdParams& p, cudaStream_t stream) {
  check_grid(p.h, p.b, "attention fwd");
  dim3 grid((p.sq + simt::kRowsPerBlock - 1) / simt::kRowsPerBlock, p.h, p.b);
  simt::fwd_kernel<T><<<grid, 32 * simt::kRowsPerBlock, 0, stream>>>(p);
  check_launch("attention fwd (simt)");
}

template <typename T>
void run_bwd_preprocess(const BwdParams& p, int dq_ld, cudaStream_t stream) {
  check_grid(p.h, p.b, "attention bwd");
  dim3 grid((p.sq + simt::kRowsPerBlock - 1) / simt::kRowsPerBlock, p.h, p.b);
  simt::bwd_preprocess_kernel<T><<<grid, 32 * simt::kRowsPerBlock, 0, stream>>>(p, dq_ld);
  check_launch("attention bwd preprocess");
}

template <typename T>
void run_bwd_convert_dq(const BwdParams& p, int dq_ld, cudaStream_t stream) {
  dim3 grid((p.sq + simt::kRowsPerBlock - 1) / simt::kRowsPerBlock, p.h, p.b);
  simt::bwd_convert_dq_kernel<T><<<grid, 32 * simt::kRowsPerBlock, 0, stream>>>(p, dq_ld);
  check_launch("attention bwd dq convert");
}

template <typename T>
void run_bwd_simt(const BwdParams& p, cudaStream_t stream) {
  check_grid(p.h, p.b, "attention bwd");
  dim3 grid_k((p.sk + simt::kRowsPerBlock - 1) / simt::kRowsPerBlock, p.h_k, p.b);
  simt::bwd_dkdv_kernel<T><<<grid_k, 32 * simt::kRowsPerBlock, 0, stream>>>(p);
  check_launch("attention bwd dk/dv (simt)");
  dim3 grid_q((p.sq + simt::kRowsPerBlock - 1) / simt::kRowsPerBlock, p.h, p.b);
  simt::bwd_dq_kernel<T><<<grid_q, 32 * simt::kRowsPerBlock, 0, stream>>>(p);
  check_launch("attention bwd dq (simt)");
}

}  // namespace attn
