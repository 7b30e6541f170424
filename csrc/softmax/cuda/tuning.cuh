// The -DATTN_TUNING candidates of the tensor-core launchers: tile and schedule experiments,
// included by launch_template.cuh (after run_fwd_cfg, whose launches they reuse; they reach
// run_bwd_dkdv_cfg, defined later, at instantiation) only in tuning builds (e.g. NVCC_APPEND_FLAGS=-DATTN_TUNING; the
// CPU emulator's sm_90 build always has them). Each is a numbered version with the reason for it
// beside it; compile-time numbers: benchmarks/results/2026-11-22-tuning-candidates.md.
#pragma once

#include <utility>

#include "common/softmax_params.h"
#include "common/policy.h"
#include "softmax/cuda/entry.h"  // cuda_kernels(): the selected candidate
#include "softmax/cuda/traits.h"

namespace attn {

// Tile and schedule experiments, compiled only with -DATTN_TUNING (e.g. NVCC_APPEND_FLAGS) and
// picked at run time with the developer selection's tune_fwd / tune_bwd = 1 .. kNumFwdAlts /
// kNumBwdAlts (CudaKernels, entry.h); 0: the default. The CUDA benchmark's --tune times them all
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
bool run_fwd_alt1(const SoftmaxParams& p, cudaStream_t stream) {
  using Alt = FwdAlt<kD, kV>;
  if constexpr (kGeneral || kV == 0 || Alt::kSame) {  // the general (bias, dropout ...) kernel is not tuned
    return false;
  } else {
    run_fwd_cfg<T, kD, Alt, false, typename Alt::Var>(p, stream);
    return true;
  }
}
template <typename T, int kD, bool kGeneral, int... kVs>
bool run_fwd_alt(int v, const SoftmaxParams& p, cudaStream_t stream, std::integer_sequence<int, kVs...>) {
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
// plain scores, score_is_plain), else return false.
template <typename T, int kD, bool kDropout, int kV>
bool run_bwd_alt1(const SoftmaxBwdParams& p, cudaStream_t stream) {
  if constexpr (kDropout || kV == 0) {
    return false;
  } else {
    using Alt = BwdAlt<kD, kV>;
    if (Alt::Var::kPlain && !score_is_plain(p)) return false;
    run_bwd_dkdv_cfg<T, kD, Alt, false, typename Alt::Var>(p, stream);
    return true;
  }
}
template <typename T, int kD, bool kDropout, int... kVs>
bool run_bwd_alt(int v, const SoftmaxBwdParams& p, cudaStream_t stream, std::integer_sequence<int, kVs...>) {
  return ((v == kVs && run_bwd_alt1<T, kD, kDropout, kVs>(p, stream)) || ...);
}

}  // namespace attn
