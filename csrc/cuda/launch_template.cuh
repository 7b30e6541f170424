// Launcher definitions, included only by the generated instantiation files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

#include "bwd_kernel.cuh"
#include "fwd_kernel.cuh"
#include "launch_impl.h"
#include "launch_util.h"
#include "simt_kernel.cuh"
#include "traits.h"

namespace attn {

inline int current_sm() {
  int dev = 0, major = 0, minor = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  return major * 10 + minor;
}

// Tr: the tile config (kBlockM, kBlockN, kNWarps): FwdTraits<kD> or a tuning alternative.
template <typename T, int kD, typename Tr, bool kGeneral>
void run_fwd_cfg(const FwdParams& p, cudaStream_t stream) {
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kNWarps = Tr::kNWarps;
  constexpr int kSmem = fwd_smem_bytes<kD, kBlockM, kBlockN>();
  auto kernel = tc::fwd_kernel<T, kD, kBlockM, kBlockN, kNWarps, kGeneral>;
  set_smem(kernel, kSmem, "attention fwd");
  dim3 grid((p.sq + kBlockM - 1) / kBlockM, p.h, p.b);
  kernel<<<grid, kNWarps * 32, kSmem, stream>>>(p);
  check_launch("attention fwd (tensor cores)");
}

#if defined(ATTN_TUNING)
// Tile experiments, compiled only with -DATTN_TUNING (e.g. NVCC_APPEND_FLAGS) and picked at
// run time with ATTN_TUNE_FWD / ATTN_TUNE_BWD = 1, 2 by benchmarks/bench_cuda.py --tune.
inline int tune_env(const char* name) {
  const char* e = std::getenv(name);
  return e != nullptr ? std::atoi(e) : 0;
}
template <int kD, int kV>
struct FwdAlt;
template <> struct FwdAlt<64, 1> { static constexpr int kBlockM = 128, kBlockN = 32, kNWarps = 4; };
template <> struct FwdAlt<64, 2> { static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 8; };
template <> struct FwdAlt<128, 1> { static constexpr int kBlockM = 128, kBlockN = 48, kNWarps = 4; };
template <> struct FwdAlt<128, 2> { static constexpr int kBlockM = 128, kBlockN = 32, kNWarps = 4; };
template <> struct FwdAlt<256, 1> { static constexpr int kBlockM = 64, kBlockN = 48, kNWarps = 4; };
template <> struct FwdAlt<256, 2> { static constexpr int kBlockM = 64, kBlockN = 16, kNWarps = 4; };
// backward: the default tiles with the S^T / dP^T k-loop unrolled 2x (v1) or fully (v2)
template <int kD, int kV>
struct BwdAlt : BwdTraitsSm90<kD> {
  static constexpr int kSUnroll = kV == 1 ? 2 : kD / 16;
};
#endif

template <typename T, int kD, bool kGeneral>
void run_fwd_tc_impl(const FwdParams& p, cudaStream_t stream) {
#if defined(ATTN_TUNING)
  const int v = tune_env("ATTN_TUNE_FWD");
  if (v == 1) return run_fwd_cfg<T, kD, FwdAlt<kD, 1>, kGeneral>(p, stream);
  if (v == 2) return run_fwd_cfg<T, kD, FwdAlt<kD, 2>, kGeneral>(p, stream);
#endif
  run_fwd_cfg<T, kD, FwdTraits<kD>, kGeneral>(p, stream);
}

template <typename T, int kD>
void run_fwd_tc(const FwdParams& p, cudaStream_t stream) {
  check_grid(p.h, p.b, "attention fwd");
  const bool general = p.softcap > 0.f || p.alibi_slopes != nullptr ||
                       p.bias_kind != BiasKind::kNone || p.dropout_p > 0.f;
  if (general) {
    run_fwd_tc_impl<T, kD, true>(p, stream);
  } else {
    run_fwd_tc_impl<T, kD, false>(p, stream);
  }
}

// Tr: the tile config (kBlockM, kBlockN, kNWarps): BwdTraits<kD>, BwdTraitsSm90<kD> or a tuning
// alternative.
template <typename T, int kD, typename Tr, bool kDropout, int kSUnroll = 1>
void run_bwd_dkdv_cfg(const BwdParams& p, cudaStream_t stream) {
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kNWarps = Tr::kNWarps;
  constexpr int kDAcc = BwdTraits<kD>::kDAcc;
  constexpr int kSmem = bwd_smem_bytes<kD, kBlockM, kBlockN>();
  auto kernel = tc::bwd_dkdv_kernel<T, kD, kDAcc, kBlockM, kBlockN, kNWarps, kDropout, kSUnroll>;
  set_smem(kernel, kSmem, "attention bwd dk/dv");
  dim3 grid(((p.sk + kBlockN - 1) / kBlockN) * (kD / kDAcc), p.h_k, p.b);
  kernel<<<grid, kNWarps * 32, kSmem, stream>>>(p);
  check_launch("attention bwd dk/dv (tensor cores)");
}

template <typename T, int kD, bool kDropout>
void run_bwd_tc_impl(const BwdParams& p, cudaStream_t stream) {
  {
#if defined(ATTN_TUNING)
    const int v = tune_env("ATTN_TUNE_BWD");
    if (v == 1) {
      run_bwd_dkdv_cfg<T, kD, BwdAlt<kD, 1>, kDropout, BwdAlt<kD, 1>::kSUnroll>(p, stream);
    } else if (v == 2) {
      run_bwd_dkdv_cfg<T, kD, BwdAlt<kD, 2>, kDropout, BwdAlt<kD, 2>::kSUnroll>(p, stream);
    } else
#endif
    if (current_sm() >= 90) {
      run_bwd_dkdv_cfg<T, kD, BwdTraitsSm90<kD>, kDropout>(p, stream);
    } else {
      run_bwd_dkdv_cfg<T, kD, BwdTraits<kD>, kDropout>(p, stream);
    }
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
