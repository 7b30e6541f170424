// Hopper (sm_90a) backward on wgmma, warp-specialized: dK and dV in registers, dQ through fp32
// atomics into p.dq_accum (then bwd_convert_dq_kernel, as the mma.sync path). Runs when
// the developer selection asks for it (CudaKernels::hopper_bwd, use_hopper_bwd in dispatch.cu); it takes what the wgmma forward
// takes: fp16/bf16, head dims <= 128 that are multiples of 8 (buckets 64 and 128, columns past d
// zero-filled), MHA/GQA/MQA, strided (B, H, S, D) / (B, S, H, D) views, seqlens_k, varlen, ragged
// tails, causal (top-left / bottom-right) and sliding windows through the shared Policy, and sinks
// (they only change the LSE, which this kernel reads, and dsinks, which the preprocess kernel
// computes for every path); softcap, ALiBi, an additive bias and its gradient dbias, bool masks,
// dropout and block-sparse layouts when hopper_bwd 2 selects them (use_hopper_bwd: every tile
// through bwd_point, the dropout factor drawn and dS stored to dbias per element). Deterministic
// mode stays on the mma.sync kernels (bwd_kernel.cuh).
//
// The math is bwd_kernel.cuh's dkdv_kernel, on 128-key blocks split over two warpgroups:
// One CTA per (kBlockN = 128 keys, kv head, batch), 384 threads in warpgroups with one role each:
//   warpgroup 0, producer (setmaxnreg down): cp.async of the K and V tiles once, then, for every
//     query block of every head of the kv group, Q, dO (kBlockM rows each: 64 at D = 128, 128 at
//     D = 64), LSE and dot(dO, O) (kBlockM floats each) into a kStages-deep ring; a slot is announced on its "full"
//     mbarrier and refilled after all 8 consumer warps arrived on its "empty" one.
//   warpgroups 1, 2, consumers (setmaxnreg up), keys [64 cw, 64 cw + 64) of the block each. Per
//   query block:
//     S^T  = K Q^T    (64 keys, kBlockM queries) fp32: kD / 16 x wgmma m64n{kBlockM}k16, A = K,
//                     B = Q, both K-major in shared memory
//     dP^T = V dO^T   likewise (a second commit group: P is computed while dP^T is in flight)
//     P^T  = exp2(S^T scale log2(e) - lse2),  dS^T = P^T (dP^T - D) scale: branch-free on tiles
//            that the window does not cut; partial tiles through bwd_point, as dkdv_kernel
//     dV  += P^T dO   (64 keys, kD): kBlockM / 16 x wgmma m64n{kD}k16, A = P^T from registers (the S^T
//                     accumulators are already A fragments), B = dO N-major (as V in the forward)
//     dK  += dS^T Q   likewise
//     dQ   = dS K     one 64 x 64 tile of the block's (kBlockM, kD) per warpgroup: dS^T goes to
//                     shared memory (both warpgroups' 64 keys), then 8 x wgmma m64n64k16 over all
//                     128 keys with A = dS^T read M-major and B = K read N-major (both transposed
//                     descriptors), then fp32 atomics.
//
// The dQ split. dQ of a query block needs all 128 keys' dS, so the two consumer warpgroups meet at
// a named barrier once per block after writing dS^T. kBlockM makes the block's dQ two 64 x 64
// tiles: D = 128 (kBlockM = 64) gives each warpgroup one 64-column block of the head dim, D = 64
// (kBlockM = 128) one 64-query half. Every dQ element is then one wgmma reduction over all 128
// keys and one atomic per CTA (the same atomic traffic as dkdv_kernel), both warpgroups do the same
// work, no wgmma sits in a branch, and every descriptor starts on a whole 128-byte swizzle row
// (an N = 32 split of D = 64 would start one inside a row). dS^T is double-buffered by the
// block's parity: a warpgroup writes buffer it & 1 only after the barrier of block it - 1, which
// the other warpgroup reaches only after its dQ wgmma of block it - 2 (the last reader of that
// buffer) retired.
//
// Memory ordering as in sm90/fwd_kernel.cuh: the producer's cp.async writes are published with
// cp.async.wait_group, fence.proxy.async and an mbarrier arrive (release); consumers release a
// slot after wgmma.wait_group retired its last reader. The dS^T stores (generic proxy) are read by
// wgmma (async proxy): every storing thread executes fence.proxy.async before the named barrier.
#pragma once

#include "softmax/cuda/sm90/fwd_kernel.cuh"  // RingPos, kmajor_step / mnmajor_step, produce_tile, release_slot
#include "softmax/cuda/kernel_common.cuh"
#include "cuda/mma.cuh"
#include "softmax/cuda/fragment_softmax.cuh"
#include "softmax/cuda/traits.h"
#include "cuda/wgmma.cuh"

namespace attn {
namespace hopper {

// Shared-memory plan, byte offsets from a 1024-aligned base: K, V, the Q and dO rings, the two dS^T
// buffers, the LSE and dot rings, then the mbarriers. Every tile and column block starts on a
// 1024-byte boundary (the swizzle atoms).
template <int kD>
struct BwdPlan {
  using Tr = BwdHopperTraits<kD>;
  static constexpr int kConsumerWGs = 2, kStages = Tr::kStages;
  static constexpr int kBlockM = Tr::kBlockM, kBlockN = 64 * kConsumerWGs;
  static_assert(kBlockN == Tr::kBlockN, "the traits name the tiles (the block-sparse index's grid)");
  // the 64 x 64 dQ tile of consumer warpgroup cw: query block cw % kDqRowBlocks, column block
  // cw / kDqRowBlocks
  static constexpr int kDqRowBlocks = kBlockM / 64;
  // S^T, dP^T, dV and dK run per 64-query sub-block (m64n64 S^T tiles: 32 + 32 fp32 registers)
  static constexpr int kSub = kBlockM / 64;
  static constexpr int kThreads = 128 * (1 + kConsumerWGs);
  using TileKV = wg::Sw128Tile<kBlockN, kD>;      // K, V: (kBlockN keys, kD)
  using TileQ = wg::Sw128Tile<kBlockM, kD>;       // one ring slot of Q or dO: (kBlockM, kD)
  using TileS = wg::Sw128Tile<kBlockN, kBlockM>;  // dS^T: (kBlockN keys, kBlockM queries)
  static constexpr int kK = 0;
  static constexpr int kV = kK + TileKV::kBytes;
  static constexpr int kQ = kV + TileKV::kBytes;
  static constexpr int kdO = kQ + kStages * TileQ::kBytes;
  static constexpr int kdS = kdO + kStages * TileQ::kBytes;
  static constexpr int kLse = kdS + 2 * TileS::kBytes;       // kStages x kBlockM floats
  static constexpr int kDot = kLse + kStages * kBlockM * 4;  // kStages x kBlockM floats
  static constexpr int kBar = kDot + kStages * kBlockM * 4;
  // 8-byte mbarriers: full_kv, full[kStages], empty[kStages]
  static constexpr int kKFix = kBar + 8 * (1 + 2 * kStages);  // nonzero: the producer zeroed K elements
  static constexpr int kQInf = kKFix + 4;  // block it + 1 under softcap: its Q tile holds an inf
  static constexpr int kBytes = kQInf + 4;
  // requested: the kernel rounds the dynamic shared-memory base up to 1024 bytes itself
  static constexpr int kSmemBytes = kBytes + 1024;

  static_assert(kD == 64 || kD == 128, "dK / dV wgmma N is the head-dim bucket: 64 or 128");
  static_assert(TileKV::kBytes % 1024 == 0 && TileQ::kBytes % 1024 == 0 && TileS::kBytes % 1024 == 0,
                "tiles keep the 1024-byte alignment of the swizzle atoms");
  static_assert(kBlockM == 64 || kBlockM == 128, "one or two 64-query sub-blocks");
  static_assert(kDqRowBlocks * (kD / 64) == kConsumerWGs, "dQ is one 64 x 64 tile per consumer");
  static_assert(kSmemBytes <= 227 * 1024, "fits the 227 KB of shared memory of an sm_90 block");
  static_assert(wg::RegisterSplit<kThreads, kConsumerWGs, Tr::kProducerRegs, Tr::kConsumerRegs>::kOk);
};

// The mbarriers of the plan, as shared-memory addresses. "full": one arrival per producer thread
// (each publishes its own copies); "empty": one per consumer warp.
template <int kStages>
struct BwdBars {
  uint32_t base;
  __device__ __forceinline__ uint32_t full_kv() const { return base; }
  __device__ __forceinline__ uint32_t full(int s) const { return base + 8 * (1 + s); }
  __device__ __forceinline__ uint32_t empty(int s) const { return base + 8 * (1 + kStages + s); }
  __device__ __forceinline__ void init(int consumer_warps) const {
    wg::mbar_init(full_kv(), 128);
    for (int s = 0; s < kStages; ++s) {
      wg::mbar_init(full(s), 128);
      wg::mbar_init(empty(s), consumer_warps);
    }
  }
};

// The query blocks of kBlockM rows that any key of [n0, n0 + rows_k) is seen by: [*m_lo, *m_hi).
// The plain policy's window, lengths and diagonal do not depend on the query head (only ALiBi and
// biases would), so one range serves every head of the kv group.
template <int kBlockM>
__device__ __forceinline__ void query_blocks(const Policy& pol, int len_q, int n0, int rows_k,
                                             int* m_lo, int* m_hi) {
  int i0, i1;
  pol.query_range(n0, n0 + rows_k, &i0, &i1);
  i0 = max(i0, 0);
  i1 = min(i1, len_q);
  *m_lo = i0 / kBlockM;
  *m_hi = i0 < i1 ? (i1 + kBlockM - 1) / kBlockM : *m_lo;
}

using wg::opaque;

// The query blocks of head h the CTA of key tile n_block walks: steps [*e_lo, *e_hi) (kSparse:
// entries of the key tile's column of the CSC tile index, clipped to [m_lo, m_hi), query block
// idx[e]; dense: the blocks themselves). The producer and both consumer warpgroups walk the same.
template <bool kSparse>
__device__ __forceinline__ void query_steps(const SoftmaxBwdParams& p, int h, int n_block, int m_lo, int m_hi,
                                            int* e_lo, int* e_hi) {
  *e_lo = m_lo;
  *e_hi = m_hi;
  if constexpr (kSparse) sparse_entries(p.sparse, p.sparse.bwd, h, n_block, m_lo, m_hi, e_lo, e_hi);
}
template <bool kSparse>
__device__ __forceinline__ int query_block_of(const SoftmaxBwdParams& p, int step) {
  if constexpr (kSparse) return int(p.sparse.bwd.idx[step]);
  return step;
}

// Producer warpgroup: all 128 threads issue cp.async (ptid = 0..127). K and V once (one copy
// group, published with the first query block's), then per (head, query block) one ring slot:
// Q, dO, and the block's LSE and dot(dO, O) (kBlockM floats each, one or two per thread). Rows
// past the
// sequence end are zero-filled; their LSE / dot read 0, which only tiles that the consumers
// check per element see (tile_full is false past len_q).
template <typename T, int kD, bool kSparse>
__device__ __forceinline__ void produce_bwd(const SoftmaxBwdParams& p, const SeqInfo& si, int b, int hk,
                                            int n0, int rows_k, int m_lo, int m_hi, uint32_t base,
                                            int ptid) {
  using P = BwdPlan<kD>;
  using TileQ = typename P::TileQ;
  const BwdBars<P::kStages> bars{base + P::kBar};
  const int group = p.h / p.h_k;

  produce_tile<P::kBlockN, kD>(base + P::kK, k_ptr<T>(p, si, b, hk, n0), p.k_row_stride, rows_k,
                               p.d, ptid);
  produce_tile<P::kBlockN, kD>(base + P::kV, v_ptr<T>(p, si, b, hk, n0), p.v_row_stride, rows_k,
                               p.d, ptid);
  tc::cp_async_commit();
  // the barrier of the newest committed copy group, published once a newer group is in flight
  uint32_t pending = bars.full_kv();
  // Publishes pending, its copies landed. K's NaN / inf elements (nonfinite.cuh): each thread
  // zeroes its own chunks of the K tile before the tile is published, for dQ += dS K; the kKFix
  // word tells the consumers, who restore those keys' scores (fix_key_scores).
  auto publish = [&] {
    if (pending == bars.full_kv() && zero_own_nonfinite<P::kBlockN, kD, T>(base + P::kK, ptid))
      wg::st_shared_b32(base + P::kKFix, 1u);
    wg::fence_proxy_async();
    wg::mbar_arrive(pending);
  };
  static_assert(2 * P::kBlockM % 128 == 0, "the LSE and dot rows split evenly");
  RingPos<P::kStages> pos;
  for (int gi = 0; gi < group; ++gi) {
    const int h = hk * group + gi;
    const T* q = q_ptr<T>(p, si, b, h, 0);
    const T* dout = dout_ptr<T>(p, si, b, h, 0);
    const float* lse = p.lse + lse_index(p, si, b, h, 0);
    const float* dot = p.softmax_d + scratch_row(p, b, h, 0);
    int e_lo, e_hi;
    query_steps<kSparse>(p, h, n0 / P::kBlockN, m_lo, m_hi, &e_lo, &e_hi);
    for (int e = e_lo; e < e_hi; ++e) {
      const int m0 = query_block_of<kSparse>(p, e) * P::kBlockM;
      const int rows = min(P::kBlockM, si.len_q - m0);
      const uint32_t slot = uint32_t(pos.stage * TileQ::kBytes);
      // the per-thread addresses below are recomputed for every slot: hoisted out of the loops,
      // they outgrow the producer's 24 registers (56 bytes of spills)
      const int t = opaque(ptid);
      wg::mbar_wait(bars.empty(pos.stage), pos.phase ^ 1u);
      produce_tile<P::kBlockM, kD>(base + P::kQ + slot, q + int64_t(m0) * p.q_row_stride,
                                   p.q_row_stride, rows, p.d, t);
      produce_tile<P::kBlockM, kD>(base + P::kdO + slot, dout + int64_t(m0) * p.do_row_stride,
                                   p.do_row_stride, rows, p.d, t);
#pragma unroll
      for (int x = t; x < 2 * P::kBlockM; x += 128) {
        const bool is_lse = x < P::kBlockM;
        const int r = x % P::kBlockM;
        const float* src = (is_lse ? lse : dot) + m0 + (r < rows ? r : 0);
        tc::cp_async4(base + (is_lse ? P::kLse : P::kDot) + (pos.stage * P::kBlockM + r) * 4, src,
                      r < rows);
      }
      tc::cp_async_commit();
      tc::cp_async_wait<1>();  // everything but the slot just issued has landed
      publish();
      pending = bars.full(pos.stage);
      pos.advance();
    }
  }
  tc::cp_async_wait<0>();
  publish();
}

using wg::ld_shared_f2;

// ---- consumer steps. A consumer warp's registers: acc_s / acc_dp = S^T / dP^T of its 16 keys x
// kBlockM queries as C fragments (s[4 t + e]: key g + 8 (e / 2), query 8 t + 2 c + e % 2);
// acc_dk / acc_dv (16 keys, kD) likewise; acc_dq (16 queries, 64 head-dim columns) of the
// warpgroup's dQ tile.

// Issue acc = A B^T over the head dim, A = 64 keys of K or V (K-major, desc_a at the warpgroup's
// rows), B = 64 rows of a ring slot of Q or dO (K-major): one commit group, the first k-step
// overwrites acc.
template <typename T, int kD>
__device__ __forceinline__ void issue_kt(float (&acc)[32], uint64_t desc_a, uint64_t desc_b) {
  using P = BwdPlan<kD>;
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    wg::Wgmma<64, T>::ss(acc, desc_a + kmajor_step<typename P::TileKV>(kk),
                         desc_b + kmajor_step<typename P::TileQ>(kk), kk > 0 ? 1 : 0);
  }
  wg::commit();
}

// Issue acc += A B over 64 queries, A = P^T or dS^T fragments in registers, B = 64 rows of a ring
// slot of dO or Q (N-major: k-step kk = query rows 16 kk .. 16 kk + 15, two 8-row atoms = 2048
// bytes on): one commit group.
template <typename T, int kD>
__device__ __forceinline__ void issue_kv_grad(float (&acc)[kD / 2], uint32_t (&a)[4][4],
                                              uint64_t desc_b) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    wg::Wgmma<kD, T>::rs(acc, a[kk], desc_b + mnmajor_step(kk), 1);
  }
  wg::commit();
}

// Full tile of the plain policy (every (query, key) inside the window): P^T in place, branch-free.
template <int kQT>
__device__ __forceinline__ void probs_full(float (&s)[4 * kQT], uint32_t s_lse, float scale_log2,
                                           int c) {
#pragma unroll
  for (int t = 0; t < kQT; ++t) {
    const float2 l = ld_shared_f2(s_lse + (8 * t + 2 * c) * 4);
    const float l2[2] = {lse_to_log2(l.x), lse_to_log2(l.y)};
#pragma unroll
    for (int e = 0; e < 4; ++e) s[4 * t + e] = tc::fast_exp2(s[4 * t + e] * scale_log2 - l2[e & 1]);
  }
}

// Full tile: dS^T = P^T (dP^T - D) scale in place (dp), given P^T in s.
template <int kQT>
__device__ __forceinline__ void dscores_full(const float (&s)[4 * kQT], float (&dp)[4 * kQT],
                                             uint32_t s_dot, float scale, int c) {
#pragma unroll
  for (int t = 0; t < kQT; ++t) {
    const float2 dv = ld_shared_f2(s_dot + (8 * t + 2 * c) * 4);
    const float dsum[2] = {dv.x, dv.y};
#pragma unroll
    for (int e = 0; e < 4; ++e) dp[4 * t + e] = s[4 * t + e] * (dp[4 * t + e] - dsum[e & 1]) * scale;
  }
}

// The backward's instantiations by what a call's scores need (launch_bwd.cuh picks): the plain
// policy (the default kernel: full tiles branch-free); any score through the policy (softcap,
// ALiBi, a bias or bool mask: every tile per element); the same drawing the forward's dropout
// and / or writing dbias (each when the call has it).
enum BwdScore { kPlainScore = 0, kPolicyScore = 1, kPolicyHeavy = 2 };

// A tile the window or a sequence end cuts, or any tile of a score that is not plain (softcap,
// ALiBi, a bias or mask) or of a call with dropout: P^T into s and dS^T into dp through bwd_point,
// checked per element, exactly dkdv_kernel's per-element math. i0 / j0: the tile's first query /
// key; (b, h) the batch entry and head. kHeavy: draw the forward's dropout factor z when the call
// has dropout (rdrop = 1 / (1 - p)), and write dS to dbias when it asks for it.
template <int kQT, bool kHeavy>
__device__ __forceinline__ void grads_partial(float (&s)[4 * kQT], float (&dp)[4 * kQT],
                                              const SoftmaxBwdParams& p, const Policy& pol, bool plain,
                                              uint32_t s_lse, uint32_t s_dot, float scale, int b, int h,
                                              float rdrop, int i0, int j0, int lane) {
  const int g = lane >> 2, c = lane & 3;
  // the dropout keep bits first (dropout_keep_mask: element 4 t + e of the fragment)
  const auto keep = kHeavy && p.dropout_p > 0.f
                        ? dropout_keep_mask<4 * kQT>(p, b * p.h + h, [&](int x, int* i, int* j) {
                            *i = i0 + 8 * (x >> 2) + 2 * c + (x & 1);
                            *j = j0 + g + ((x >> 1) & 1) * 8;
                          })
                        : ~0u;
#pragma unroll
  for (int t = 0; t < kQT; ++t) {
    const float2 l = ld_shared_f2(s_lse + (8 * t + 2 * c) * 4);
    const float2 dv = ld_shared_f2(s_dot + (8 * t + 2 * c) * 4);
    const float l2[2] = {lse_to_log2(l.x), lse_to_log2(l.y)};
    const float dsum[2] = {dv.x, dv.y};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = i0 + 8 * t + 2 * c + (e & 1), j = j0 + g + (e >> 1) * 8;
      const float z = kHeavy && p.dropout_p > 0.f ? ((keep >> (4 * t + e)) & 1u ? rdrop : 0.f) : 1.f;
      const BwdPoint bp = bwd_point(pol, plain, true, scale, s[4 * t + e], dp[4 * t + e], l2[e & 1],
                                    dsum[e & 1], z, i, j);
      if (kHeavy && p.dbias != nullptr && i < pol.len_q && j < pol.len_k) store_dbias(p, b, h, i, j, bp.ds);
      s[4 * t + e] = bp.pd;
      dp[4 * t + e] = bp.dx;
    }
  }
}

// dQ columns [col0, col0 + 64) of query rows [i0, i0 + 16) (this warp's rows of acc_dq) added to
// the fp32 scratch (row scratch_row(p, b, h, i), kD floats long). sm_90 vector atomics: lanes c
// and c ^ 1 swap halves so that each lane owns 4 consecutive columns of one row (even c: row g,
// odd c: row g + 8), one 16-byte reduction per n-tile instead of four 4-byte ones.
template <int kD>
__device__ __forceinline__ void add_dq(const SoftmaxBwdParams& p, const SeqInfo& si, int b, int h,
                                       const float (&acc)[32], int i0, int col0, int lane) {
  const int g = lane >> 2, c = lane & 3;
  const bool even = (c & 1) == 0;
  const int i = i0 + g + (even ? 0 : 8);
  float* dst = p.dq_accum + scratch_row(p, b, h, i) * kD;
#pragma unroll
  for (int t = 0; t < 8; ++t) {
    const float s0 = even ? acc[4 * t + 2] : acc[4 * t];
    const float s1 = even ? acc[4 * t + 3] : acc[4 * t + 1];
    const float r0 = __shfl_xor_sync(0xffffffffu, s0, 1);
    const float r1 = __shfl_xor_sync(0xffffffffu, s1, 1);
    const int col = col0 + t * 8 + 2 * (c & ~1);
    if (i < si.len_q && col < p.d) {
      const float4 val = even ? make_float4(acc[4 * t], acc[4 * t + 1], r0, r1)
                              : make_float4(r0, r1, acc[4 * t + 2], acc[4 * t + 3]);
      atomicAdd(reinterpret_cast<float4*>(dst + col), val);
    }
  }
}

// Consumer warpgroup cw (0 or 1) of 128 threads (ctid = 0..127): keys [n0 + 64 cw, n0 + 64 cw + 64).
// pol: the policy of the group's first head, moved to each head when the score is not plain.
// kScore: the instantiation (BwdScore). Template parameters, not run-time flags: the general path's
// registers made ptxas spill the plain kernel's loop (768 bytes at D = 128), and the dropout draw
// the general one's (68 bytes).
template <typename T, int kD, int kScore, bool kSparse>
__device__ __forceinline__ void consume_bwd(const SoftmaxBwdParams& p, const SeqInfo& si, Policy pol,
                                            int b, int hk, int n0, int m_lo, int m_hi,
                                            uint32_t base, int cw, int ctid) {
  using P = BwdPlan<kD>;
  using TileQ = typename P::TileQ;
  using TileKV = typename P::TileKV;
  using TileS = typename P::TileS;
  constexpr int kQT = 64 / 8;          // 8-column n-tiles of S^T / dP^T per warp (sub-block queries)
  constexpr int kDT = kD / 8;          // 8-column n-tiles of dK / dV per warp
  const BwdBars<P::kStages> bars{base + P::kBar};
  const int lane = ctid & 31, warp = ctid >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int wk = cw * 64 + warp * 16;  // this warp's first key inside the block

  float acc_dk[4 * kDT], acc_dv[4 * kDT];
#pragma unroll
  for (int x = 0; x < 4 * kDT; ++x) acc_dk[x] = acc_dv[x] = 0.f;

  if (m_lo < m_hi) {
    // descriptors (slot 0 / buffer 0; offsets added per use):
    //   A of S^T, dP^T: this warpgroup's 64 keys of K, V (K-major: SBO = one 8-row atom)
    //   B of S^T, dP^T: Q, dO slots (K-major)
    //   B of dV, dK:    dO, Q slots (N-major: SBO = 8 query rows, LBO = one 64-column block)
    //   A of dQ:        dS^T at this warpgroup's 64 queries (M-major: SBO = 8 keys; M = 64 is one
    //                   column block, LBO unused)
    //   B of dQ:        K at this warpgroup's 64 head-dim columns (N-major: SBO = 8 keys; N = 64
    //                   is one column block, LBO unused)
    const uint64_t desc_k = wg::make_desc_sw128(base + P::kK + cw * 64 * 128, 16, 1024);
    const uint64_t desc_v = wg::make_desc_sw128(base + P::kV + cw * 64 * 128, 16, 1024);
    const uint64_t desc_q = wg::make_desc_sw128(base + P::kQ, 16, 1024);
    const uint64_t desc_do = wg::make_desc_sw128(base + P::kdO, 16, 1024);
    const uint64_t desc_q_n = wg::make_desc_sw128(base + P::kQ, TileQ::kBlockBytes, 1024);
    const uint64_t desc_do_n = wg::make_desc_sw128(base + P::kdO, TileQ::kBlockBytes, 1024);
    const int dq_row = (cw % P::kDqRowBlocks) * 64, dq_col = (cw / P::kDqRowBlocks) * 64;
    const uint64_t desc_ds = wg::make_desc_sw128(base + P::kdS + (dq_row / 64) * TileS::kBlockBytes,
                                                 TileS::kBlockBytes, 1024);
    const uint64_t desc_k_n = wg::make_desc_sw128(base + P::kK + (dq_col / 64) * TileKV::kBlockBytes,
                                                  TileKV::kBlockBytes, 1024);
    const float scale_log2 = p.scale * kLog2e;
    constexpr bool kPlain = kScore == kPlainScore;
    const float rdrop = kScore == kPolicyHeavy && p.dropout_p > 0.f ? 1.f / (1.f - p.dropout_p) : 1.f;
    const int group = p.h / p.h_k;
    const int j0 = n0 + wk;

    wg::mbar_wait(bars.full_kv(), 0);
    // NaN / inf in K (nonfinite.cuh): the producer zeroed them in the tile (kKFix); this thread's
    // keys that held one (keys j0 + g, j0 + g + 8) get their S^T entries back after each S^T
    const uint32_t kfix = wg::ld_shared_u32(base + P::kKFix) == 0u ? 0u
        : tc::key_fix_bits<T>(k_ptr<T>(p, si, b, hk, j0 + g), p.k_row_stride, si.len_k - (j0 + g), p.d);
    RingPos<P::kStages> pos;
    int it = 0;  // blocks done so far, over every head: the parity picks the dS^T buffer
    for (int gi = 0; gi < group; ++gi) {
      const int h = hk * group + gi;
      // the per-head fields of the policy (ALiBi's slope, the bias of this head; the window,
      // lengths and softcap are the group's)
      if constexpr (!kPlain) pol.set_score_head(p, b, h);
      if constexpr (kSparse) pol.layout = p.sparse.head_layout(h);
      int e_lo, e_hi;
      query_steps<kSparse>(p, h, n0 / P::kBlockN, m_lo, m_hi, &e_lo, &e_hi);
      for (int e = e_lo; e < e_hi; ++e, ++it) {
        // a tile the index does not mark full checks the layout per element (grads_partial)
        const bool layout_full = !kSparse || p.sparse.bwd.full[e] != 0;
        const int m0 = query_block_of<kSparse>(p, e) * P::kBlockM;
        const uint64_t slot = uint64_t(pos.stage * TileQ::kBytes) >> 4;
        const uint32_t s_lse = base + P::kLse + pos.stage * P::kBlockM * 4;
        const uint32_t s_dot = base + P::kDot + pos.stage * P::kBlockM * 4;
        const uint32_t s_ds = base + P::kdS + (it & 1) * TileS::kBytes;
        const uint32_t s_q = base + P::kQ + pos.stage * TileQ::kBytes;
        uint32_t pa[kQT / 2][4], da[kQT / 2][4];
        wg::mbar_wait(bars.full(pos.stage), pos.phase);
        const int tid = cw * 128 + ctid;  // of the two consumer warpgroups
        // poisoned query rows (a NaN / inf in q or dO: nonfinite.cuh): their Q and dO rows zeroed
        // and their lse set to NaN before any wgmma reads the slot (both warpgroups vote the same)
        if (tc::any_poisoned<P::kBlockM>(s_dot, lane)) {
          tc::zero_poisoned_rows<TileQ, P::kBlockM, 256>(s_q, base + P::kdO + pos.stage * TileQ::kBytes, s_lse,
                                                         s_dot, tid);
          wg::fence_proxy_async();
          wg::named_barrier_sync<256>(2);
        }
        // an inf in q under softcap (not poisoned: its logits are +-cap, its dS 0 at every key): its
        // elements are zeroed for dK += dS^T Q once both warpgroups' S^T read them (q_inf; one
        // word, rewritten for block it + 1 only after both passed block it's dQ barrier)
        bool q_inf = false;
        if constexpr (!kPlain) {
          if (p.softcap > 0.f) {
            if (tc::any_nonfinite_smem<T, TileQ, P::kBlockM, 256>(s_q, tid))
              wg::st_shared_b32(base + P::kQInf, uint32_t(it + 1));
            wg::named_barrier_sync<256>(2);
            q_inf = wg::ld_shared_u32(base + P::kQInf) == uint32_t(it + 1);
          }
        }

        // rolled (D = 64: two sub-blocks): unrolled, ptxas keeps the second sub-block's S^T / dP^T
        // and the first one's in-flight P^T / dS^T fragments apart, spills dK / dV around the
        // loop (1 KB) and serializes every wgmma
#pragma unroll 1
        for (int sb = 0; sb < P::kSub; ++sb) {
          // queries [q0, q0 + 64) of the block: rows 64 sb of the Q / dO slot (8 atoms on), in
          // both majors; column block sb of dS^T
          const int q0 = m0 + 64 * sb;
          const uint64_t sub = slot + uint64_t((sb * 64 * 128) >> 4);
          float acc_s[4 * kQT], acc_dp[4 * kQT];

          // ---- S^T = K Q^T and dP^T = V dO^T, two commit groups
          wg::fence();  // earlier register accesses of acc_s / acc_dp (the previous block) first
          issue_kt<T, kD>(acc_s, desc_k, desc_q + sub);
          issue_kt<T, kD>(acc_dp, desc_v, desc_do + sub);

          // ---- P^T while dP^T is still on the tensor cores, then dS^T
          const bool full = kPlain && layout_full && pol.tile_full(q0, q0 + 64, j0, j0 + 16);
          wg::wait<1>();  // S^T, and the previous sub-block's dV / dK, retired
          wg::fence_operands(acc_s);
          tc::fix_key_scores<T, TileQ, kQT>(*reinterpret_cast<float(*)[kQT][4]>(acc_s), kfix, s_q + sb * 64 * 128,
                                            k_ptr<T>(p, si, b, hk, 0), j0 + g, p.k_row_stride, c, p.d);
          if (sb > 0) {
            wg::fence_operands(acc_dv);
            wg::fence_operands(acc_dk);
            wg::fence_operands(pa);
            wg::fence_operands(da);
          }
          if (full) probs_full<kQT>(acc_s, s_lse + sb * 64 * 4, scale_log2, c);
          wg::wait<0>();
          wg::fence_operands(acc_dp);
          if (full) {
            dscores_full<kQT>(acc_s, acc_dp, s_dot + sb * 64 * 4, p.scale, c);
          } else {
            grads_partial<kQT, kScore == kPolicyHeavy>(acc_s, acc_dp, p, pol, kPlain, s_lse + sb * 64 * 4,
                                                       s_dot + sb * 64 * 4, p.scale, b, h, rdrop, q0, j0, lane);
          }

          // ---- P^T, dS^T packed to 16 bits as A fragments (n-tiles 2 kk, 2 kk + 1 -> k-step kk):
          // the fp32 tiles die here. dS^T also goes to shared memory for dQ: word r of da[kk] is
          // n-tile 2 kk + r / 2, row half r % 2. Rows g of 8 lanes land on 8 different chunks
          // (t ^ g), 4 words each: no bank conflicts.
          tc::pack_a_frags<T, kQT>(acc_s, pa);
          tc::pack_a_frags<T, kQT>(acc_dp, da);
#pragma unroll
          for (int kk = 0; kk < kQT / 2; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const int t = 2 * kk + r / 2, hf = r % 2;
              wg::st_shared_b32(s_ds + TileS::offset(wk + g + hf * 8, sb * 64 + t * 8 + 2 * c), da[kk][r]);
            }

          if (q_inf) {
            wg::named_barrier_sync<256>(2);  // both warpgroups' S^T of these 64 queries retired
            tc::zero_nonfinite<T, wg::Sw128Tile<64, kD>, 64, 256>(s_q + sb * 64 * 128, tid);
            wg::fence_proxy_async();
            wg::named_barrier_sync<256>(2);
          }

          // ---- dV += P^T dO, dK += dS^T Q (A from registers), two commit groups
          wg::fence_operands(acc_dv);
          wg::fence_operands(acc_dk);
          wg::fence();  // the packing of pa / da before the async reads
          issue_kv_grad<T, kD>(acc_dv, pa, desc_do_n + sub);
          issue_kv_grad<T, kD>(acc_dk, da, desc_q_n + sub);
        }
        wg::fence_proxy_async();  // the dS^T stores before the async-proxy reads of the dQ wgmma

        // ---- dQ = dS K over all 128 keys for this warpgroup's 64 x 64 tile
        wg::named_barrier_sync<256>(1);  // both warpgroups' dS^T are in buffer it & 1
        float acc_dq[32];
        wg::fence();  // acc_dq's registers may have held other values: order those accesses first
#pragma unroll
        for (int kk = 0; kk < P::kBlockN / 16; ++kk) {
          // k-step kk = keys 16 kk .. 16 kk + 15: two 8-row atoms = 2048 bytes on, in both
          wg::Wgmma<64, T>::ss_t(acc_dq, desc_ds + uint64_t(((it & 1) * TileS::kBytes) >> 4) + mnmajor_step(kk),
                                 desc_k_n + mnmajor_step(kk), kk > 0 ? 1 : 0);
        }
        wg::commit();
        wg::wait<1>();  // dV and dK retired; dQ may still run
        wg::fence_operands(acc_dv);
        wg::fence_operands(acc_dk);
        wg::fence_operands(pa);
        wg::fence_operands(da);
        release_slot(bars.empty(pos.stage), lane);  // Q, dO, LSE, dot of this slot are read
        wg::wait<0>();
        wg::fence_operands(acc_dq);
        add_dq<kD>(p, si, b, h, acc_dq, m0 + dq_row + warp * 16, dq_col, lane);
        pos.advance();
      }
    }
  }

  // ---- epilogue: dK, dV (zeros for keys no query sees) straight from registers. rows_store is
  // recomputed here (as in bwd_kernel): held across the loop, it is the one value that spills.
  const int rows_store = min(P::kBlockN, (p.cu_seqlens_k != nullptr ? si.len_k : p.sk) - n0);
  T* dk = dk_ptr<T>(p, si, b, hk, n0);
  T* dv = dv_ptr<T>(p, si, b, hk, n0);
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = wk + g + hf * 8;
    if (r < rows_store) {
#pragma unroll
      for (int t = 0; t < kDT; ++t) {
        const int col = t * 8 + 2 * c;
        if (col < p.d) {
          *reinterpret_cast<uint32_t*>(dk + int64_t(r) * p.dk_row_stride + col) =
              tc::TypeOps<T>::pack(acc_dk[4 * t + 2 * hf], acc_dk[4 * t + 2 * hf + 1]);
          *reinterpret_cast<uint32_t*>(dv + int64_t(r) * p.dv_row_stride + col) =
              tc::TypeOps<T>::pack(acc_dv[4 * t + 2 * hf], acc_dv[4 * t + 2 * hf + 1]);
        }
      }
    }
  }
}

template <typename T, int kD, int kScore, bool kSparse>
__global__ void __launch_bounds__(BwdPlan<kD>::kThreads, 1)
    bwd_kernel(const __grid_constant__ SoftmaxBwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using P = BwdPlan<kD>;
  ATTN_EXTERN_SMEM(smem);  // the base is rounded up to 1024 bytes below
  const uint32_t base = (tc::smem_u32(smem) + 1023u) & ~1023u;

  const int hk = blockIdx.y, b = blockIdx.z;
  const SeqInfo si(p, b);
  const int n0 = blockIdx.x * P::kBlockN;
  // rows of dK/dV this CTA owns: the padded layout also zeroes keys past seqlens_k
  const int rows_store = min(P::kBlockN, (p.cu_seqlens_k != nullptr ? si.len_k : p.sk) - n0);
  if (rows_store <= 0) return;  // the whole CTA, before any barrier
  const int rows_k = min(P::kBlockN, si.len_k - n0);  // may be <= 0: then only zeros are stored
  const Policy pol(p, si, b, hk * (p.h / p.h_k));
  int m_lo = 0, m_hi = 0;
  if (rows_k > 0) query_blocks<P::kBlockM>(pol, si.len_q, n0, rows_k, &m_lo, &m_hi);

  if (threadIdx.x == 0) {
    BwdBars<P::kStages>{base + P::kBar}.init(4 * P::kConsumerWGs);
    wg::st_shared_b32(base + P::kKFix, 0u);
    wg::st_shared_b32(base + P::kQInf, 0u);
  }
  __syncthreads();  // the barriers are initialized before any thread uses them

  // one role per warpgroup, each one branch of this if/else (what setmaxnreg needs)
  const int wg_idx = threadIdx.x / 128;
  if (wg_idx == 0) {
    wg::setmaxnreg_dec<P::Tr::kProducerRegs>();
    if (m_lo < m_hi) produce_bwd<T, kD, kSparse>(p, si, b, hk, n0, rows_k, m_lo, m_hi, base, threadIdx.x);
  } else {
    wg::setmaxnreg_inc<P::Tr::kConsumerRegs>();
    consume_bwd<T, kD, kScore, kSparse>(p, si, pol, b, hk, n0, m_lo, m_hi, base, wg_idx - 1, threadIdx.x % 128);
  }
#else
  // only sm_90a has wgmma; the dispatcher launches this kernel only where that code was built
  __trap();
#endif
}

}  // namespace hopper
}  // namespace attn
