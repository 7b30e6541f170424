// Launcher definitions, included only by the generated instantiation files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <utility>

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
// Var: the kernel's schedule (tc::FwdVariant, or tc::FwdSplit of one with num_splits CTAs per
// query block).
template <typename T, int kD, typename Tr, bool kGeneral, typename Var = tc::FwdVariant<>>
void run_fwd_cfg(const FwdParams& p, cudaStream_t stream, int num_splits = 1) {
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kNWarps = Tr::kNWarps;
  constexpr int kSmem = fwd_smem_bytes<kD, kBlockM, kBlockN>();
  auto kernel = tc::fwd_kernel<T, kD, kBlockM, kBlockN, kNWarps, kGeneral, Var>;
  set_smem(kernel, kSmem, "attention fwd");
  dim3 grid((p.sq + kBlockM - 1) / kBlockM * num_splits, p.h, p.b);
  ATTN_LAUNCH(kernel, grid, kNWarps * 32, kSmem, stream)(p);
  check_launch("attention fwd (tensor cores)");
}

#if defined(ATTN_TUNING)
// Tile and schedule experiments, compiled only with -DATTN_TUNING (e.g. NVCC_APPEND_FLAGS) and
// picked at run time with the developer selection's tune_fwd / tune_bwd = 1 .. kNumFwdAlts /
// kNumBwdAlts (CudaKernels, launch.h); 0: the default. The CUDA benchmark's --tune times them all
// and the CUDA tests check them. Compile-time numbers and the reasons for each:
// benchmarks/results/2026-11-22-tuning-candidates.md.
// Forward candidates: FwdTraits tiles unless named; the head-dim buckets where a candidate
// changes nothing (FwdSame) fall back to the default kernel.
template <typename Tiles, typename V, int kBM = Tiles::kBlockM, int kBN = Tiles::kBlockN,
          int kW = Tiles::kNWarps>
struct FwdCfg {
  static constexpr int kBlockM = kBM, kBlockN = kBN, kNWarps = kW;
  using Var = V;
  static constexpr bool kSame = false;
};
template <int kD>
struct FwdSame : FwdCfg<FwdTraits<kD>, tc::FwdVariant<>> {
  static constexpr bool kSame = true;
};
using tc::FwdVariant;
template <int kD, int kV>
struct FwdAlt : FwdSame<kD> {};
// v1, v2: other key-block widths (D = 64: 32 keys / 8 warps x 16 rows; D = 128: 32 / 16 keys;
// D = 256: 48 / 16 keys)
template <> struct FwdAlt<64, 1> : FwdCfg<FwdTraits<64>, FwdVariant<>, 128, 32, 4> {};
template <> struct FwdAlt<64, 2> : FwdCfg<FwdTraits<64>, FwdVariant<>, 128, 64, 8> {};
template <> struct FwdAlt<128, 1> : FwdCfg<FwdTraits<128>, FwdVariant<>, 128, 32, 4> {};
template <> struct FwdAlt<128, 2> : FwdCfg<FwdTraits<128>, FwdVariant<>, 128, 16, 4> {};
template <> struct FwdAlt<256, 1> : FwdCfg<FwdTraits<256>, FwdVariant<>, 64, 48, 4> {};
template <> struct FwdAlt<256, 2> : FwdCfg<FwdTraits<256>, FwdVariant<>, 64, 16, 4> {};
// v3, v4: the default tiles with the Q K^T loop rolled / unrolled 2x
template <int kD> struct FwdAlt<kD, 3> : FwdCfg<FwdTraits<kD>, FwdVariant<1>> {};
template <int kD> struct FwdAlt<kD, 4> : FwdCfg<FwdTraits<kD>, FwdVariant<2>> {};
// v5, v6: 32 keys with the Q K^T loop rolled / unrolled 2x (D = 128)
template <> struct FwdAlt<128, 5> : FwdCfg<FwdTraits<128>, FwdVariant<1>, 128, 32, 4> {};
template <> struct FwdAlt<128, 6> : FwdCfg<FwdTraits<128>, FwdVariant<2>, 128, 32, 4> {};
// v7: the default tiles and loops, query blocks launched heaviest-first (causal tail)
template <int kD> struct FwdAlt<kD, 7> : FwdCfg<FwdTraits<kD>, tc::FwdReverseM<FwdVariant<>>> {};
constexpr int kNumFwdAlts = 7;

template <typename T, int kD, bool kGeneral, int kV>
bool run_fwd_alt1(const FwdParams& p, cudaStream_t stream) {
  using Alt = FwdAlt<kD, kV>;
  if constexpr (kGeneral || kV == 0 || Alt::kSame) {  // the general (bias, dropout ...) kernel is not tuned
    return false;
  } else {
    run_fwd_cfg<T, kD, Alt, false, typename Alt::Var>(p, stream);
    return true;
  }
}
template <typename T, int kD, bool kGeneral, int... kVs>
bool run_fwd_alt(int v, const FwdParams& p, cudaStream_t stream, std::integer_sequence<int, kVs...>) {
  return ((v == kVs && run_fwd_alt1<T, kD, kGeneral, kVs>(p, stream)) || ...);
}

// Backward dK/dV candidates: the sm_90 default tiles (BwdTraitsSm90) unless a tile is named.
template <typename Tiles, typename V, int kBM = Tiles::kBlockM, int kBN = Tiles::kBlockN,
          int kW = Tiles::kNWarps>
struct BwdCfg {
  static constexpr int kBlockM = kBM, kBlockN = kBN, kNWarps = kW;
  using Var = V;
};
using tc::BwdVariant;
template <int kD, int kV>
struct BwdAlt;
// v1, v2: the S^T / dP^T head-dim loop unrolled 2x / fully (the default keeps it rolled)
template <int kD> struct BwdAlt<kD, 1> : BwdCfg<BwdTraitsSm90<kD>, BwdVariant<2>> {};
template <int kD> struct BwdAlt<kD, 2> : BwdCfg<BwdTraitsSm90<kD>, BwdVariant<kD / 16>> {};
// v3: plain policies only (no bias / ALiBi / softcap / dbias code competing for registers)
template <int kD> struct BwdAlt<kD, 3> : BwdCfg<BwdTraitsSm90<kD>, BwdVariant<1, true>> {};
// v4, v5: sequential S^T -> P^T (16 bits) -> dV, then dP^T -> dS^T; v5 with 8-byte dQ atomics
template <int kD> struct BwdAlt<kD, 4> : BwdCfg<BwdTraitsSm90<kD>, BwdVariant<1, true, true>> {};
template <int kD> struct BwdAlt<kD, 5> : BwdCfg<BwdTraitsSm90<kD>, BwdVariant<1, true, true, 8>> {};
// v6, v7: 8-byte (float2) / 4-byte dQ atomics on sm_90 instead of the 16-byte quad swap
template <int kD> struct BwdAlt<kD, 6> : BwdCfg<BwdTraitsSm90<kD>, BwdVariant<1, false, false, 8>> {};
template <int kD> struct BwdAlt<kD, 7> : BwdCfg<BwdTraitsSm90<kD>, BwdVariant<1, false, false, 4>> {};
// v8, v9: 32-query blocks (half the S^T / dP^T registers; twice the block loop and dQ atomics
// per key), v9 also sequential (D = 256 already runs 32-query blocks: v8 = default there)
template <int kD> struct BwdAlt<kD, 8> : BwdCfg<BwdTraitsSm90<kD>, BwdVariant<>, 32> {};
template <int kD> struct BwdAlt<kD, 9> : BwdCfg<BwdTraitsSm90<kD>, BwdVariant<1, true, true>, 32> {};
// v10: 64 keys and 4 warps per CTA: the same registers per warp, but two CTAs per SM (sm_90
// shared memory) that hide each other's barriers; twice the Q / dO reads and dQ atomics
template <int kD> struct BwdAlt<kD, 10> : BwdCfg<BwdTraitsSm90<kD>, BwdVariant<>, BwdTraits<kD>::kBlockM, 64, 4> {};
// v11, v12: the sequential schedule with 64 keys / 4 warps per CTA (v10's tiles), and with the
// S^T / dP^T loops unrolled 2x (registers the sequential schedule freed, spent on prefetch)
template <int kD> struct BwdAlt<kD, 11> : BwdCfg<BwdTraitsSm90<kD>, BwdVariant<1, true, true>, BwdTraits<kD>::kBlockM, 64, 4> {};
template <int kD> struct BwdAlt<kD, 12> : BwdCfg<BwdTraitsSm90<kD>, BwdVariant<2, true, true>> {};
constexpr int kNumBwdAlts = 12;

// Run candidate kV if it applies (no dropout: the benchmarked path; kPlain candidates only for
// plain policies, the launcher's check mirroring policy_is_plain), else return false.
template <typename T, int kD, bool kDropout, int kV>
bool run_bwd_alt1(const BwdParams& p, cudaStream_t stream) {
  if constexpr (kDropout || kV == 0) {
    return false;
  } else {
    using Alt = BwdAlt<kD, kV>;
    const bool plain = p.softcap <= 0.f && p.alibi_slopes == nullptr && p.bias_kind == BiasKind::kNone;
    if (Alt::Var::kPlain && !plain) return false;
    run_bwd_dkdv_cfg<T, kD, Alt, false, typename Alt::Var>(p, stream);
    return true;
  }
}
template <typename T, int kD, bool kDropout, int... kVs>
bool run_bwd_alt(int v, const BwdParams& p, cudaStream_t stream, std::integer_sequence<int, kVs...>) {
  return ((v == kVs && run_bwd_alt1<T, kD, kDropout, kVs>(p, stream)) || ...);
}
#endif

template <typename T, int kD, bool kGeneral>
void run_fwd_tc_impl(const FwdParams& p, cudaStream_t stream) {
#if defined(ATTN_TUNING)
  if (run_fwd_alt<T, kD, kGeneral>(cuda_kernels().tune_fwd, p, stream,
                                   std::make_integer_sequence<int, kNumFwdAlts + 1>{}))
    return;
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

// Split-KV forward (flash-decoding): the FwdSplit kernel (default tiles, plain or general as
// run_fwd_tc picks) writes num_splits partials per query row into the fp32 scratch, laid out as
// p's tensors with query head h * num_splits + s: O (B_t, H * num_splits, rows, d), LSE
// (B_t, H * num_splits, rows), where (B_t, rows) are q's batch and row dims ((1, total_q) for
// varlen, whose rows are then addressed from SeqInfo::row_q as in p); then fwd_combine_kernel
// merges them into p.o and p.lse. The tuning candidates (-DATTN_TUNING) are unsplit only.
template <typename T, int kD>
void run_fwd_tc_split(const FwdParams& p, const FwdSplitScratch& s, cudaStream_t stream) {
  check_grid(p.h, p.b, "attention fwd (split-KV)");
  using Tr = FwdTraits<kD>;
  FwdParams ps = p;
  ps.o = s.o_accum;
  ps.lse = s.lse_accum;
  ps.o_row_stride = p.d;
  ps.o_head_stride = s.rows * p.d;
  ps.o_batch_stride = int64_t(p.h) * s.num_splits * ps.o_head_stride;
  ps.lse_head_stride = s.rows;
  ps.lse_batch_stride = int64_t(p.h) * s.num_splits * s.rows;
  const bool general = p.softcap > 0.f || p.alibi_slopes != nullptr ||
                       p.bias_kind != BiasKind::kNone || p.dropout_p > 0.f;
  if (general) {
    run_fwd_cfg<T, kD, Tr, true, tc::FwdSplit<tc::FwdVariant<>>>(ps, stream, s.num_splits);
  } else {
    run_fwd_cfg<T, kD, Tr, false, tc::FwdSplit<tc::FwdVariant<>>>(ps, stream, s.num_splits);
  }
  dim3 grid((p.sq + tc::kCombineRows - 1) / tc::kCombineRows, p.h, p.b);
  auto combine = tc::fwd_combine_kernel<T, kD>;
  ATTN_LAUNCH(combine, grid, tc::kCombineRows * 32, 0, stream)(p, ps, s.num_splits);
  check_launch("attention fwd split-KV combine");
}

// Tr: the tile config (kBlockM, kBlockN, kNWarps): BwdTraits<kD>, BwdTraitsSm90<kD> or a tuning
// alternative; Var: the kernel's schedule (tc::BwdVariant).
template <typename T, int kD, typename Tr, bool kDropout, typename Var = tc::BwdVariant<>>
void run_bwd_dkdv_cfg(const BwdParams& p, cudaStream_t stream) {
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kNWarps = Tr::kNWarps;
  constexpr int kDAcc = BwdTraits<kD>::kDAcc;
  constexpr int kSmem = bwd_smem_bytes<kD, kBlockM, kBlockN>();
  auto kernel = tc::bwd_dkdv_kernel<T, kD, kDAcc, kBlockM, kBlockN, kNWarps, kDropout, Var>;
  set_smem(kernel, kSmem, "attention bwd dk/dv");
  dim3 grid(((p.sk + kBlockN - 1) / kBlockN) * (kD / kDAcc), p.h_k, p.b);
  ATTN_LAUNCH(kernel, grid, kNWarps * 32, kSmem, stream)(p);
  check_launch("attention bwd dk/dv (tensor cores)");
}

template <typename T, int kD, bool kDropout>
void run_bwd_tc_impl(const BwdParams& p, cudaStream_t stream) {
  {
#if defined(ATTN_TUNING)
    if (run_bwd_alt<T, kD, kDropout>(cuda_kernels().tune_bwd, p, stream,
                                      std::make_integer_sequence<int, kNumBwdAlts + 1>{})) {
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
    ATTN_LAUNCH(kernel, grid, Tr::kNWarps * 32, kSmem, stream)(p);
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
  ATTN_LAUNCH(simt::fwd_kernel<T>, grid, 32 * simt::kRowsPerBlock, 0, stream)(p);
  check_launch("attention fwd (simt)");
}

template <typename T>
void run_bwd_preprocess(const BwdParams& p, int dq_ld, cudaStream_t stream) {
  check_grid(p.h, p.b, "attention bwd");
  dim3 grid((p.sq + simt::kRowsPerBlock - 1) / simt::kRowsPerBlock, p.h, p.b);
  ATTN_LAUNCH(simt::bwd_preprocess_kernel<T>, grid, 32 * simt::kRowsPerBlock, 0, stream)(p, dq_ld);
  check_launch("attention bwd preprocess");
}

template <typename T>
void run_bwd_convert_dq(const BwdParams& p, int dq_ld, cudaStream_t stream) {
  dim3 grid((p.sq + simt::kRowsPerBlock - 1) / simt::kRowsPerBlock, p.h, p.b);
  ATTN_LAUNCH(simt::bwd_convert_dq_kernel<T>, grid, 32 * simt::kRowsPerBlock, 0, stream)(p, dq_ld);
  check_launch("attention bwd dq convert");
}

template <typename T>
void run_bwd_simt(const BwdParams& p, cudaStream_t stream) {
  check_grid(p.h, p.b, "attention bwd");
  dim3 grid_k((p.sk + simt::kRowsPerBlock - 1) / simt::kRowsPerBlock, p.h_k, p.b);
  ATTN_LAUNCH(simt::bwd_dkdv_kernel<T>, grid_k, 32 * simt::kRowsPerBlock, 0, stream)(p);
  check_launch("attention bwd dk/dv (simt)");
  dim3 grid_q((p.sq + simt::kRowsPerBlock - 1) / simt::kRowsPerBlock, p.h, p.b);
  ATTN_LAUNCH(simt::bwd_dq_kernel<T>, grid_q, 32 * simt::kRowsPerBlock, 0, stream)(p);
  check_launch("attention bwd dq (simt)");
}

}  // namespace attn
