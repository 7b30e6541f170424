// Tile sizes of the tensor-core kernels per head-dim bucket (64, 128, 256).
//
// Head dims that are not a bucket (32, 40, 80, 96, ...) run in the next bucket up: the loads
// zero-fill columns >= d, the k-steps past d are skipped at run time and stores are
// predicated, so the padding costs shared memory but few tensor-core cycles.
//
// One set of tiles serves sm_80 and sm_90: both run the same mma.sync code, and the shared
// memory asked for (<= 136 KB) fits either (sm_80: 163 KB, sm_90: 227 KB per block).
#pragma once

#include "cuda/static_switch.h"  // bucket_for_head_dim

namespace attn {

constexpr int kSmemLimitSm80 = 163 * 1024;

template <int kD>
struct FwdTraits;
// kBlockM query rows per CTA, kBlockN keys per step, kNWarps warps of 16 * kMT rows each.
template <>
struct FwdTraits<64> {
  static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 4;  // kMT = 2
};
template <>
struct FwdTraits<128> {
  static constexpr int kBlockM = 128, kBlockN = 48, kNWarps = 4;  // kMT = 2; BN 48 > 64 > 32
};
template <>
struct FwdTraits<256> {
  static constexpr int kBlockM = 64, kBlockN = 32, kNWarps = 4;   // O alone is 128 regs
};

// sm_90a wgmma forward (sm90/fwd_kernel.cuh), buckets 64 and 128 only (256 stays on mma.sync):
// one producer warpgroup + kConsumerWGs consumer warpgroups of 64 query rows each (kBlockM =
// 64 * kConsumerWGs), kBlockN keys per step, K and V tiles each kStages deep. setmaxnreg moves
// registers from the producer (kProducerRegs: cp.async addressing only) to the consumers
// (kConsumerRegs: O + S accumulators, 64 + 64 fp32 at D = 128, and the 16-bit P).
//   D = 128: 128 x 128 tiles, 2 stages: Q 32 KB + K, V 2 x 2 x 32 KB = 160 KB of 227 KB.
//   D =  64: 128 x 128 tiles, 3 stages (the tiles are half as large, and at D = 64 there is
//            half the math per loaded byte, so the extra stage hides more latency): 112 KB.
// Starting points for tuning: 3 consumer warpgroups at D = 64, 2 stages at 128 ...
// (docs/design/hopper-fwd-notes.md).
template <int kD>
struct FwdHopperTraits;
template <>
struct FwdHopperTraits<64> {
  static constexpr int kBlockN = 128, kConsumerWGs = 2, kStages = 3;
  static constexpr int kProducerRegs = 40, kConsumerRegs = 232;
};
template <>
struct FwdHopperTraits<128> {
  static constexpr int kBlockN = 128, kConsumerWGs = 2, kStages = 2;
  static constexpr int kProducerRegs = 40, kConsumerRegs = 232;
};

// sm_90a wgmma backward (sm90/bwd_kernel.cuh), buckets 64 and 128: one CTA per (128 keys, kv
// head, batch), one producer warpgroup + 2 consumer warpgroups of 64 keys each (fixed: the dQ
// split assumes two), query blocks of kBlockM rows streamed through a kStages-deep ring of Q, dO,
// LSE and dot(dO, O). kBlockM is chosen so that dQ = dS K of a block, (kBlockM, kD), is two
// 64 x 64 tiles, one per consumer warpgroup: D = 128 splits the head dim, D = 64 the queries.
// Consumer registers at the peak (S^T and dP^T accumulated, dK and dV live): D = 128: 64 + 64 +
// 2 x 32 fp32, D = 64: 32 + 32 + 2 x 64; both 192 + addresses, hence 240 (FA3's split too) and
// the producer at the minimum, 24.
//   D = 128: K, V 2 x 32 KB + 2 stages x (Q, dO) 2 x 16 KB + dS^T 2 x 16 KB = 161 KB.
//   D =  64: K, V 2 x 16 KB + 2 stages x (Q, dO) 2 x 16 KB + dS^T 2 x 32 KB = 162 KB.
// Starting points for tuning (docs/design/hopper-bwd-notes.md).
template <int kD>
struct BwdHopperTraits;
template <>
struct BwdHopperTraits<64> {
  static constexpr int kBlockM = 128, kBlockN = 128, kStages = 2;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
};
template <>
struct BwdHopperTraits<128> {
  static constexpr int kBlockM = 64, kBlockN = 128, kStages = 2;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
};

// Backward. dK/dV kernel: one CTA per (kBlockN keys, kv head, batch), warps own 16 keys each
// (kBlockN = 16 * kNWarps) and loop over kBlockM-row query blocks of every head of the group.
// kDAcc columns of dK/dV (and of dQ) per CTA: D = 256 splits into two CTAs that each
// recompute S and dP but keep half of the accumulators, so dK + dV stay at 128 registers.
template <int kD>
struct BwdTraits;
template <>
struct BwdTraits<64> {
  static constexpr int kBlockM = 64, kBlockN = 128, kNWarps = 8, kDAcc = 64;
};
template <>
struct BwdTraits<128> {
  static constexpr int kBlockM = 64, kBlockN = 128, kNWarps = 8, kDAcc = 128;
};
template <>
struct BwdTraits<256> {
  static constexpr int kBlockM = 32, kBlockN = 64, kNWarps = 4, kDAcc = 128;
};
// sm_90 has 227 KB of shared memory per block: D = 256 takes twice the keys per CTA there,
// which measured faster (benchmarks/results/2026-11-29-figures-from-comments.md).
template <int kD>
struct BwdTraitsSm90 : BwdTraits<kD> {};
template <>
struct BwdTraitsSm90<256> {
  static constexpr int kBlockM = 32, kBlockN = 128, kNWarps = 8, kDAcc = 128;
};

// Deterministic dQ kernel: one CTA per query block, warps own 16 query rows.
template <int kD>
struct BwdDqTraits {
  static constexpr int kBlockM = 64, kBlockN = 64, kNWarps = 4;
  static constexpr int kDAcc = kD < 128 ? kD : 128;
};

template <int kD, int kBlockM, int kBlockN>
constexpr int fwd_smem_bytes() {
  return (kBlockM + 2 * kBlockN) * kD * 2;
}
template <int kD, int kBlockM, int kBlockN>
constexpr int bwd_smem_bytes() {
  // K, V (kBlockN, D); 2 x Q, dO (kBlockM, D); dS^T (kBlockN, kBlockM); 2 x lse, dot(dO, O)
  return (2 * kBlockN + 4 * kBlockM) * kD * 2 + kBlockN * kBlockM * 2 + 4 * kBlockM * 4;
}
template <int kD, int kBlockM, int kBlockN>
constexpr int bwd_dq_smem_bytes() {
  return (2 * kBlockM + 2 * kBlockN) * kD * 2;  // Q, dO, K, V
}

#define ATTN_CHECK_TRAITS(D)                                                                      \
  static_assert(fwd_smem_bytes<D, FwdTraits<D>::kBlockM, FwdTraits<D>::kBlockN>() <=             \
                    kSmemLimitSm80,                                                               \
                "forward tiles must fit sm_80 shared memory");                                    \
  static_assert(bwd_smem_bytes<D, BwdTraits<D>::kBlockM, BwdTraits<D>::kBlockN>() <=             \
                    kSmemLimitSm80,                                                               \
                "backward tiles must fit sm_80 shared memory");                                   \
  static_assert(BwdTraits<D>::kBlockN == 16 * BwdTraits<D>::kNWarps,                              \
                "backward warps own 16 keys each");                                               \
  static_assert(D % BwdTraits<D>::kDAcc == 0, "dK/dV column slices tile the head dim");          \
  static_assert(BwdTraits<D>::kBlockM % 64 == 0 || BwdTraits<D>::kBlockM == 32,                   \
                "dS^T rows are swizzled as 64 bytes or multiples of 128")

ATTN_CHECK_TRAITS(64);
ATTN_CHECK_TRAITS(128);
ATTN_CHECK_TRAITS(256);

}  // namespace attn
