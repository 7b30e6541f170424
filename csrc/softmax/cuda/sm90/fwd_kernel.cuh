// Hopper (sm_90a) forward on wgmma, warp-specialized. Runs when the developer selection asks for
// it (CudaKernels::hopper_fwd, use_hopper_fwd in dispatch.cu); for what it takes it computes what fwd_kernel.cuh computes:
// fp16/bf16, head dims <= 128 that are multiples of 8 (buckets 64 and 128, columns past d
// zero-filled), MHA/GQA/MQA, any strides that are multiples of 8 elements ((B, H, S, D) and
// (B, S, H, D) views), per-batch seqlens_k and varlen packs, ragged tails, causal (top-left or
// bottom-right) and sliding windows through the shared Policy, and sinks; softcap, ALiBi, an
// additive bias, bool masks, dropout (the mma.sync kernels' Philox stream, tc::dropout_tile) and
// block-sparse layouts (the CSR tile index at this kernel's tiles, FlexAttention's full / partial
// tiles: only partial ones check the layout per element) when hopper_fwd 2 selects them
// (use_hopper_fwd).
//
// One CTA per (kBlockM = 64 * kConsumerWGs query rows, head, batch), 128 * (1 + kConsumerWGs)
// threads in warpgroups with one role each:
//   warpgroup 0, producer (setmaxnreg down): cp.async of the Q block once, then of the K and V
//     tiles of every visible key block into kStages-deep rings; a slot is announced on its "full"
//     mbarrier and refilled after every consumer warp arrived on its "empty" mbarrier.
//   warpgroups 1.., consumers (setmaxnreg up), 64 query rows each. Per key block, last to first
//   (the partially masked diagonal block first, as in fwd_kernel.cuh):
//     S = Q K^T   (64, kBlockN) fp32 in registers: kD / 16 wgmma m64n{kBlockN}k16, A = Q and
//                 B = K read from shared memory (both K-major)
//     softmax     logits in the log2 domain with the scale folded in, the window checked only on
//                 tiles that cross it or the sequence end, online max / sum in registers
//     O += P V    (64, kD) fp32 in registers: kBlockN / 16 wgmma m64n{kD}k16, A = P packed to 16
//                 bits in registers (the S accumulators already are A fragments), B = V (N-major)
//   then normalize, write the LSE (lse_index, as fwd_kernel.cuh) and stage O through the Q tile
//   for 16-byte stores.
// The two consumer warpgroups work independently, so one's softmax overlaps the other's wgmma.
// The quantized instances (kQuant, SoftmaxParams::qk_quant: int8 at hopper_fwd 2, fp8 at 1 and 2)
// read Q and K as the quantize pass's 8-bit copies (q8.cuh) and run S = Q K^T on wgmma
// m64n{kBlockN}k32.s32.s8.s8 (int8) or .f32.e4m3.e4m3 (fp8), each sum turned into its score with
// one FMA (q scale x k scale, plus q . mean of the row), as FwdQ8 does.
//
// Why cp.async and not TMA (cp.async.bulk.tensor): a tensor map zero-fills only outside its
// global bounds, but here a tile must be zero past its own sequence's end (varlen packs hold the
// next sequence there, padded KV caches whatever was left, possibly NaN, which 0 * NaN would carry
// into O) and past the head dim d inside a wider row. cp.async with src-size 0 gives exactly the
// zero fill of the mma.sync kernel for every such case, needs no per-call tensor maps on the host,
// and keeps one loader (load_tile_async) for both kernels. The cost is a producer warpgroup that
// issues 16-byte copies instead of one thread issuing bulk ones; a TMA producer can replace
// produce() later without touching the consumers.
//
// Hidden keys (nonfinite.cuh's rule for the mma.sync forward): before it publishes a V tile in
// which the policy may hide a key from some row of the block, each producer thread zeroes the NaN
// / inf elements among the chunks it copied and, if it found one, writes the step into the slot's
// kVFix word; the consumers read that word with the tile and give such elements back to the rows
// that read them, so a hidden key's P = 0 adds exact zeros. The scan costs the producer one pass
// over its chunks on the tiles that cross a window, a sequence end or a mask, none elsewhere.
//
// Memory ordering. cp.async writes shared memory through the generic proxy and wgmma reads it
// through the async proxy, so each producer thread waits for its own copies
// (cp.async.wait_group), zeroes what it must (generic stores, the same proxy), executes
// fence.proxy.async, and only then arrives (release) on the "full" barrier that consumers wait
// on (acquire). It keeps the newest copy group in flight while
// it publishes the one before (wait_group 1). A consumer warp arrives on "empty" only after
// wgmma.wait_group 0 retired the products that read the slot; once a wgmma has completed, the
// generic-proxy cp.async may overwrite its operands without a proxy fence.
#pragma once

#include "softmax/cuda/kernel_common.cuh"
#include "cuda/mma.cuh"
#include "softmax/cuda/fragment_softmax.cuh"
#include "softmax/cuda/nonfinite.cuh"
#include "softmax/cuda/traits.h"
#include "cuda/wgmma.cuh"

namespace attn {
namespace hopper {

// Shared-memory plan, byte offsets from a 1024-aligned base: Q, the K ring, the V ring, then the
// mbarriers. Every tile and column block starts on a 1024-byte boundary (the swizzle atoms).
template <int kD>
struct FwdPlan {
  using Tr = FwdHopperTraits<kD>;
  static constexpr int kConsumerWGs = Tr::kConsumerWGs, kStages = Tr::kStages;
  static constexpr int kBlockM = 64 * kConsumerWGs, kBlockN = Tr::kBlockN;
  static constexpr int kThreads = 128 * (1 + kConsumerWGs);
  using TileQ = wg::Sw128Tile<kBlockM, kD>;   // (kBlockM, kD); O is staged here at the end
  using TileKV = wg::Sw128Tile<kBlockN, kD>;  // (kBlockN, kD), one ring slot of K or V
  // the 8-bit Q K^T (qk_quant): Q and K of D <= 128 bytes per row, one 128-byte column block,
  // in the first bytes of the Q region and of each K slot
  using TileQ8 = wg::Sw128Tile<kBlockM, 64>;
  using TileK8 = wg::Sw128Tile<kBlockN, 64>;
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + TileQ::kBytes;
  static constexpr int kV = kK + kStages * TileKV::kBytes;
  static constexpr int kBar = kV + kStages * TileKV::kBytes;
  // 8-byte mbarriers: full_q, full_k[kStages], full_v[kStages], empty_k[kStages], empty_v[kStages]
  static constexpr int kVFix = kBar + 8 * (1 + 4 * kStages);
  // per V slot, a word: step + 1 of the last step whose V tile the producer zeroed non-finite
  // elements of (hidden keys, below)
  static constexpr int kBytes = kVFix + 4 * kStages;
  // requested: the kernel rounds the dynamic shared-memory base up to 1024 bytes itself rather
  // than rely on the alignment of the window
  static constexpr int kSmemBytes = kBytes + 1024;

  static_assert(kD == 64 || kD == 128, "wgmma N of P V is the head-dim bucket: 64 or 128");
  static_assert(kBlockN == 64 || kBlockN == 128, "wgmma N of Q K^T is kBlockN: 64 or 128");
  static_assert(TileQ::kBytes % 1024 == 0 && TileKV::kBytes % 1024 == 0,
                "tiles keep the 1024-byte alignment of the swizzle atoms");
  static_assert(kSmemBytes <= 227 * 1024, "fits the 227 KB of shared memory of an sm_90 block");
  static_assert(kThreads <= 1024 && kConsumerWGs >= 1, "one producer and 1..7 consumer warpgroups");
  static_assert(wg::RegisterSplit<kThreads, kConsumerWGs, Tr::kProducerRegs, Tr::kConsumerRegs>::kOk);
};

// The mbarriers of the plan, as shared-memory addresses.
template <int kStages>
struct Bars {
  uint32_t base;
  __device__ __forceinline__ uint32_t full_q() const { return base; }
  __device__ __forceinline__ uint32_t full_k(int s) const { return base + 8 * (1 + s); }
  __device__ __forceinline__ uint32_t full_v(int s) const { return base + 8 * (1 + kStages + s); }
  __device__ __forceinline__ uint32_t empty_k(int s) const { return base + 8 * (1 + 2 * kStages + s); }
  __device__ __forceinline__ uint32_t empty_v(int s) const { return base + 8 * (1 + 3 * kStages + s); }
  // "full": one arrival per producer thread (each publishes its own copies);
  // "empty": one per consumer warp
  __device__ __forceinline__ void init(int consumer_warps) const {
    wg::mbar_init(full_q(), 128);
    for (int s = 0; s < kStages; ++s) {
      wg::mbar_init(full_k(s), 128);
      wg::mbar_init(full_v(s), 128);
      wg::mbar_init(empty_k(s), consumer_warps);
      wg::mbar_init(empty_v(s), consumer_warps);
    }
  }
};

// Position in a kStages-deep ring: the slot, and the parity of the slot's current phase (it flips
// each time the ring wraps).
template <int kStages>
struct RingPos {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

using wg::kmajor_step;
using wg::mnmajor_step;

// Producer copy of rows [0, kRows) x cols [0, kD) of a global tile (row stride in elements) into
// an Sw128Tile by 128 threads; rows >= valid_rows and cols >= valid_cols are zero-filled. Thread t
// always copies 16-byte chunk t % kChunks, of rows t / kChunks + kRowStep * i, so one source
// pointer and one shared address advance by constants through a rolled loop. (load_tile_async's
// unrolled loop hoists an address per chunk out of the producer's key loop: 1.4 KB of spills
// within the producer's 40 registers.)
template <int kRows, int kD, typename T>
__device__ __forceinline__ void produce_tile(uint32_t smem, const T* gmem, int64_t row_stride,
                                             int valid_rows, int valid_cols, int ptid) {
  using Tile = wg::Sw128Tile<kRows, kD>;
  constexpr int kChunks = Tile::kChunks;    // 8 (D = 64) or 16 (D = 128)
  constexpr int kRowStep = 128 / kChunks;   // 16 or 8 rows per pass of the warpgroup
  static_assert(128 % kChunks == 0 && kRowStep % 8 == 0 && kRows % kRowStep == 0,
                "a row step of whole swizzle atoms keeps each thread's chunk column");
  const int c = ptid % kChunks;
  const bool col_ok = c * 8 < valid_cols;
  int r = ptid / kChunks;
  const T* src = gmem + int64_t(r) * row_stride + c * 8;
  uint32_t dst = smem + Tile::offset(r, c * 8);
#pragma unroll 1
  for (; r < kRows; r += kRowStep) {
    const bool ok = col_ok && r < valid_rows;
    tc::cp_async16(dst, ok ? src : gmem, ok);
    src += int64_t(kRowStep) * row_stride;
    dst += kRowStep * 128;  // offset(r + kRowStep, col) = offset(r, col) + kRowStep * 128
  }
}

// The non-finite elements of this producer thread's own chunks of a (kRows, kD) tile of T (the
// ones produce_tile copied for it) set to +0; returns whether it held any. No barrier: each thread
// touches only what it copied and waited for, before it publishes the tile.
template <int kRows, int kD, typename T>
__device__ __forceinline__ bool zero_own_nonfinite(uint32_t smem, int ptid) {
  using Tile = wg::Sw128Tile<kRows, kD>;
  constexpr int kChunks = Tile::kChunks, kRowStep = 128 / kChunks;
  const int c = ptid % kChunks;
  uint32_t addr = smem + Tile::offset(ptid / kChunks, c * 8);
  bool any = false;
#pragma unroll 1
  for (int r = ptid / kChunks; r < kRows; r += kRowStep, addr += kRowStep * 128) {
    any |= tc::scan_chunk<T, true>(addr);  // offset(r + kRowStep, col) = offset(r, col) + kRowStep * 128
  }
  return any;
}

// Key block of step `step` of the kernel's walk (see fwd_kernel below).
__device__ __forceinline__ int key_block(const SoftmaxParams& p, int step) {
  return p.sparse.on() ? int(p.sparse.fwd.idx[step]) : step;
}

// Producer warpgroup: all 128 threads issue cp.async (ptid = 0..127). kQ8: Q and K come from
// the quantize pass's 8-bit copies (p.q8), D bytes per row copied as D / 2 16-bit columns into
// tiles of 128-byte rows (FwdPlan::TileQ8 / TileK8, zero past D bytes: 0 in int8 and in e4m3),
// inside the 16-bit regions of the plan.
template <typename T, int kD, bool kQ8>
__device__ __forceinline__ void produce(const SoftmaxParams& p, const SeqInfo& si, int b, int h,
                                        int m0, int rows_q, int n_lo, int n_hi, uint32_t base,
                                        int ptid) {
  using P = FwdPlan<kD>;
  using TileKV = typename P::TileKV;
  const Bars<P::kStages> bars{base + P::kBar};
  const int hk = h / (p.h / p.h_k);
  const T* q = q_ptr<T>(p, si, b, h, m0);
  const T* k = k_ptr<T>(p, si, b, hk, 0);
  const T* v = v_ptr<T>(p, si, b, hk, 0);
  const uint16_t* k8 = nullptr;
  const int64_t k8_stride = p.q8.k_row_stride / 2;

  if constexpr (kQ8) {
    const auto* q8 = reinterpret_cast<const uint16_t*>(
        p.q8.q + si.q_offset(p, b, h, m0, p.q8.q_batch_stride, p.q8.q_head_stride, p.q8.q_row_stride));
    k8 = reinterpret_cast<const uint16_t*>(
        p.q8.k + si.k_offset(p, b, hk, 0, p.q8.k_batch_stride, p.q8.k_head_stride, p.q8.k_row_stride));
    produce_tile<P::kBlockM, 64>(base + P::kQ, q8, p.q8.q_row_stride / 2, rows_q, p.d / 2, ptid);
  } else {
    produce_tile<P::kBlockM, kD>(base + P::kQ, q, p.q_row_stride, rows_q, p.d, ptid);
  }
  tc::cp_async_commit();
  // Hidden keys (nonfinite.cuh's rule, as in fwd_kernel.cuh): a V tile in which the policy may
  // hide a key from some row of the block has its NaN / inf elements zeroed by the thread that
  // copied them, before it is published, so a hidden key adds exact zeros to P V; the slot's
  // kVFix word then names the step, and the consumers give the elements back to the rows that
  // read them. A policy of the block's first head: the window, the lengths and whether a bool
  // mask exists are the kv group's.
  const Policy pol(p, si, b, h);
  auto fix_v = [&](int step, int stage) {
    const int n0 = key_block(p, step) * P::kBlockN;
    const bool layout_full = !p.sparse.on() || p.sparse.fwd.full[step] != 0;
    if (tc::tile_may_hide(pol, layout_full, m0, m0 + rows_q, n0, n0 + P::kBlockN) &&
        zero_own_nonfinite<P::kBlockN, kD, T>(base + P::kV + uint32_t(stage * TileKV::kBytes), ptid)) {
      wg::st_shared_b32(base + P::kVFix + 4 * stage, uint32_t(step + 1));  // every hit writes the same
    }
  };
  // the barrier of the newest committed copy group, published once a newer group is in flight;
  // pend_step >= 0: it is the V tile of that step, in slot pend_stage
  uint32_t pending = bars.full_q();
  int pend_step = -1, pend_stage = 0;
  RingPos<P::kStages> pos;
  for (int step = n_hi - 1; step >= n_lo; --step) {
    const int n0 = key_block(p, step) * P::kBlockN;
    const uint32_t slot = uint32_t(pos.stage * TileKV::kBytes);

    wg::mbar_wait(bars.empty_k(pos.stage), pos.phase ^ 1u);
    if constexpr (kQ8) {
      produce_tile<P::kBlockN, 64>(base + P::kK + slot, k8 + int64_t(n0) * k8_stride, k8_stride, si.len_k - n0,
                                   p.d / 2, ptid);
    } else {
      produce_tile<P::kBlockN, kD>(base + P::kK + slot, k + int64_t(n0) * p.k_row_stride,
                                   p.k_row_stride, si.len_k - n0, p.d, ptid);
    }
    tc::cp_async_commit();
    tc::cp_async_wait<1>();  // everything but the K tile just issued has landed
    if (pend_step >= 0) fix_v(pend_step, pend_stage);
    wg::fence_proxy_async();
    wg::mbar_arrive(pending);
    pending = bars.full_k(pos.stage);

    wg::mbar_wait(bars.empty_v(pos.stage), pos.phase ^ 1u);
    produce_tile<P::kBlockN, kD>(base + P::kV + slot, v + int64_t(n0) * p.v_row_stride,
                                 p.v_row_stride, si.len_k - n0, p.d, ptid);
    tc::cp_async_commit();
    tc::cp_async_wait<1>();
    wg::fence_proxy_async();
    wg::mbar_arrive(pending);
    pending = bars.full_v(pos.stage);
    pend_step = step;
    pend_stage = pos.stage;
    pos.advance();
  }
  tc::cp_async_wait<0>();
  if (pend_step >= 0) fix_v(pend_step, pend_stage);
  wg::fence_proxy_async();
  wg::mbar_arrive(pending);
}

// ---- consumer steps. A consumer warpgroup's registers: acc_s (64, kBlockN) and acc_o (64, kD)
// fp32 as C fragments (per warp 16 rows: [4 kNT] and [4 kDT] floats), pa = P as 16-bit A
// fragments ([kBlockN / 16][4]).

// Issue S = Q K^T against ring slot `stage` (asynchronous, one commit group; the first k-step
// overwrites acc_s). K-major k-step kk: 32 bytes on inside a 128-byte row, a column block on
// every 4 steps.
template <typename T, int kD>
__device__ __forceinline__ void issue_s(float (&acc_s)[FwdPlan<kD>::kBlockN / 2], uint64_t desc_q,
                                        uint64_t desc_k, int stage) {
  using P = FwdPlan<kD>;
  const uint64_t slot = uint64_t(stage * P::TileKV::kBytes) >> 4;
  wg::fence_operands(acc_s);  // pins the last reads of acc_s (packing) above wgmma.fence
  wg::fence();  // earlier register reads of acc_s (softmax, packing) before the async writes
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    wg::Wgmma<P::kBlockN, T>::ss(acc_s, desc_q + kmajor_step<typename P::TileQ>(kk),
                                 desc_k + slot + kmajor_step<typename P::TileKV>(kk), kk > 0 ? 1 : 0);
  }
  wg::commit();
}

// The 8-bit Q K^T's instruction and accumulator type: int8 (int32 sums), fp8 e4m3 (float32)
template <int kQuant, int kN>
struct QkOp;
template <int kN>
struct QkOp<kQkInt8, kN> {
  using Acc = int32_t;
  using Op = wg::WgmmaS8<kN>;
};
template <int kN>
struct QkOp<kQkFp8, kN> {
  using Acc = float;
  using Op = wg::WgmmaE4M3<kN>;
};

// kQuant: S = Q K^T from the 8-bit tiles (kD / 32 k-steps of 32 bytes: the 16-bit form's byte
// offsets), asynchronous, one commit group.
template <int kD, int kQuant, typename Acc>
__device__ __forceinline__ void issue_s8(Acc (&acc_i)[FwdPlan<kD>::kBlockN / 2], uint64_t desc_q,
                                         uint64_t desc_k, int stage) {
  using P = FwdPlan<kD>;
  const uint64_t slot = uint64_t(stage * P::TileKV::kBytes) >> 4;
  wg::fence_operands(acc_i);
  wg::fence();
#pragma unroll
  for (int kk = 0; kk < kD / 32; ++kk) {
    QkOp<kQuant, P::kBlockN>::Op::ss(acc_i, desc_q + kmajor_step<typename P::TileQ8>(kk),
                                     desc_k + slot + kmajor_step<typename P::TileK8>(kk), kk > 0 ? 1 : 0);
  }
  wg::commit();
}

// Issue O += P V against ring slot `stage` (asynchronous, one commit group). N-major k-step kk:
// keys 16 kk .. 16 kk + 15, two 8-key atoms = 2048 bytes on.
template <typename T, int kD>
__device__ __forceinline__ void issue_pv(float (&acc_o)[kD / 2],
                                         uint32_t (&pa)[FwdPlan<kD>::kBlockN / 16][4],
                                         uint64_t desc_v, int stage) {
  using P = FwdPlan<kD>;
  const uint64_t slot = uint64_t(stage * P::TileKV::kBytes) >> 4;
  wg::fence_operands(acc_o);
  wg::fence_operands(pa);  // pins the packing of pa above wgmma.fence as well
  wg::fence();  // the rescale of acc_o and the packing of pa before the async reads
#pragma unroll
  for (int kk = 0; kk < P::kBlockN / 16; ++kk) {
    wg::Wgmma<kD, T>::rs(acc_o, pa[kk], desc_v + slot + mnmajor_step(kk), 1);
  }
  wg::commit();
}

// Logits and the softmax of this warp's (16, kBlockN) tile of block n0, in place; alpha gets
// the rescale factors of O. A plain policy (lengths, causal, window) is checked per element only
// on tiles that cross the window or a sequence end, or (block-sparse) that the tile index does not
// mark full (layout_full false: the layout per element); softcap and ALiBi (plain = false,
// hopper_fwd 2 in use_hopper_fwd) go through the policy on every element, as in fwd_kernel.cuh.
template <int kD>
__device__ __forceinline__ void scores_to_probs(float (&acc_s)[FwdPlan<kD>::kBlockN / 2],
                                                const Policy& pol, bool plain, bool layout_full, float scale_log2,
                                                int i0, int n0, int lane, float* row_m, float* row_l, float* alpha) {
  constexpr int kBlockN = FwdPlan<kD>::kBlockN;
  const bool check = !plain || !layout_full || !pol.tile_full(i0, i0 + 16, n0, n0 + kBlockN);
  tc::tile_logits<kBlockN / 8>(acc_s, pol, plain, check, scale_log2, i0, n0, lane);
  tc::softmax_rows<kBlockN / 8>(acc_s, row_m, row_l, alpha);
}

// A consumer warp is done with a ring slot: one arrival per warp on its "empty" barrier.
__device__ __forceinline__ void release_slot(uint32_t bar, int lane) {
  __syncwarp();
  if (lane == 0) wg::mbar_arrive(bar);
}

// S = Q K^T against ring slot pos, waited for at once; then the slot's K is released.
template <typename T, int kD>
__device__ __forceinline__ void qk_now(float (&acc_s)[FwdPlan<kD>::kBlockN / 2], uint64_t desc_q,
                                       uint64_t desc_k, const Bars<FwdPlan<kD>::kStages>& bars,
                                       const RingPos<FwdPlan<kD>::kStages>& pos, int lane) {
  wg::mbar_wait(bars.full_k(pos.stage), pos.phase);
  issue_s<T, kD>(acc_s, desc_q, desc_k, pos.stage);
  wg::wait<0>();
  wg::fence_operands(acc_s);
  release_slot(bars.empty_k(pos.stage), lane);
}

// kQuant: qk_now's 8-bit form, the sums in acc_i.
template <int kD, int kQuant, typename Acc>
__device__ __forceinline__ void qk8_now(Acc (&acc_i)[FwdPlan<kD>::kBlockN / 2], uint64_t desc_q,
                                        uint64_t desc_k, const Bars<FwdPlan<kD>::kStages>& bars,
                                        const RingPos<FwdPlan<kD>::kStages>& pos, int lane) {
  wg::mbar_wait(bars.full_k(pos.stage), pos.phase);
  issue_s8<kD, kQuant>(acc_i, desc_q, desc_k, pos.stage);
  wg::wait<0>();
  wg::fence_operands(acc_i);
  release_slot(bars.empty_k(pos.stage), lane);
}

// O += P V against ring slot pos, waited for at once; then the slot's V is released. Returns the
// slot's kVFix word (read before the release: the producer rewrites it for the slot's next tile).
template <typename T, int kD>
__device__ __forceinline__ uint32_t pv_now(float (&acc_o)[kD / 2],
                                           uint32_t (&pa)[FwdPlan<kD>::kBlockN / 16][4], uint64_t desc_v,
                                           const Bars<FwdPlan<kD>::kStages>& bars,
                                           const RingPos<FwdPlan<kD>::kStages>& pos, uint32_t vfix, int lane) {
  wg::mbar_wait(bars.full_v(pos.stage), pos.phase);
  issue_pv<T, kD>(acc_o, pa, desc_v, pos.stage);
  const uint32_t fixed = wg::ld_shared_u32(vfix + 4 * pos.stage);
  wg::wait<0>();
  wg::fence_operands(acc_o);
  wg::fence_operands(pa);
  release_slot(bars.empty_v(pos.stage), lane);
  return fixed;
}

// Consumer warpgroup cw (0-based) of 128 threads (ctid = 0..127): query rows
// [m0 + 64 cw, m0 + 64 cw + 64) of the block. kDropout: the instantiation that draws dropout
// (hopper_fwd 2); the default one has none of its code (its Philox left a local frame in it).
// Per key block S -> softmax -> P V, each product waited for at once; the two consumer
// warpgroups overlap each other. (An intra-warpgroup variant that issued S of block n with P V of
// block n + 1 measured slower at every shape but one and was deleted: see
// benchmarks/results/2026-11-24-h100.md.)
// kQuant (int8 / fp8; 0 = none): S from the 8-bit tiles (qk8_now), each sum turned into the
// score with one FMA, sum x (q scale of this warp's 16 rows x k scale of the key tile) + q . mean
// of its row, as FwdQ8 does.
template <typename T, int kD, bool kDropout, int kQuant>
__device__ __forceinline__ void consume(const SoftmaxParams& p, const SeqInfo& si, const Policy& pol,
                                        int b, int h, int m0, int rows_q, int n_lo, int n_hi,
                                        uint32_t base, int cw, int ctid) {
  using P = FwdPlan<kD>;
  using TileQ = typename P::TileQ;
  using TileKV = typename P::TileKV;
  constexpr int kNT = P::kBlockN / 8;     // 8-column n-tiles of S per warp
  constexpr int kDT = kD / 8;             // 8-column n-tiles of O per warp
  const Bars<P::kStages> bars{base + P::kBar};
  const int lane = ctid & 31;
  const int wm = cw * 64 + (ctid >> 5) * 16;  // this warp's first row inside the block

  // (16, kD) of O per warp as C fragments; row max (log2 domain) and partial sum of rows g, g + 8
  float acc_o[4 * kDT];
#pragma unroll
  for (int x = 0; x < 4 * kDT; ++x) acc_o[x] = 0.f;
  float row_m[2] = {-INFINITY, -INFINITY}, row_l[2] = {0.f, 0.f};

  if (n_lo < n_hi) {
    // descriptors of this warpgroup's 64 rows of Q and of ring slot 0 of K (both K-major: SBO =
    // one 8-row atom) and of V (N-major: SBO = 8 keys, LBO = one 64-column block of the head dim)
    const uint64_t desc_q = wg::make_desc_sw128(base + P::kQ + cw * 64 * 128, 16, 1024);
    const uint64_t desc_k = wg::make_desc_sw128(base + P::kK, 16, 1024);
    const uint64_t desc_v = wg::make_desc_sw128(base + P::kV, TileKV::kBlockBytes, 1024);
    const float scale_log2 = p.scale * kLog2e;
    const bool plain = score_is_plain(p);
    const int i0 = m0 + wm;
    const float* q8_ks = nullptr;  // kQuant: the k scales of (b, kv head), one per key tile
    float acc_s[4 * kNT];
    uint32_t pa[kNT / 2][4];
    float alpha[2];
    // kQuant: this warp's q scale (a q block is one warp's 16 rows) and q . mean of its rows g,
    // g + 8 (rows past the sequence: 0; a warp with none reads no scale, which was not written)
    float q8_qs = 0.f, q8_qm[2] = {0.f, 0.f};
    if constexpr (kQuant != kQkNone) {
      const int hk = h / (p.h / p.h_k);
      if (i0 < si.len_q) q8_qs = p.q8.q_scale[(int64_t(b) * p.h + h) * p.q8.nbq + i0 / p.q8.block_q];
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = i0 + (lane >> 2) + hf * 8;
        q8_qm[hf] = i < si.len_q ? p.q8.q_mean[lse_index(p, si, b, h, i)] : 0.f;
      }
      q8_ks = p.q8.k_scale + (int64_t(b) * p.h_k + hk) * p.q8.nbk;
    }
    wg::mbar_wait(bars.full_q(), 0);

    RingPos<P::kStages> pos;
    for (int step = n_hi - 1; step >= n_lo; --step) {
      const int n0 = key_block(p, step) * P::kBlockN;
      if constexpr (kQuant != kQkNone) {
        typename QkOp<kQuant, P::kBlockN>::Acc acc_i[4 * kNT];
        qk8_now<kD, kQuant>(acc_i, desc_q, desc_k, bars, pos, lane);
        const float sa = q8_qs * q8_ks[n0 / p.q8.block_k];
#pragma unroll
        for (int x = 0; x < 4 * kNT; ++x) acc_s[x] = fmaf(float(acc_i[x]), sa, q8_qm[(x >> 1) & 1]);
      } else {
        qk_now<T, kD>(acc_s, desc_q, desc_k, bars, pos, lane);
      }
      const bool layout_full = !p.sparse.on() || p.sparse.fwd.full[step] != 0;
      scores_to_probs<kD>(acc_s, pol, plain, layout_full, scale_log2, i0, n0, lane, row_m, row_l, alpha);
      if constexpr (kDropout) tc::dropout_tile<P::kBlockN / 8>(acc_s, p, b * p.h + h, i0, n0, lane);
      tc::rescale_rows<kDT>(acc_o, alpha);
      tc::pack_a_frags<T, kNT>(acc_s, pa);
      if (pv_now<T, kD>(acc_o, pa, desc_v, bars, pos, base + P::kVFix, lane) == uint32_t(step + 1)) {
        // the producer zeroed non-finite elements of this V tile: the rows that read such an
        // element v(j, c) get it back from global memory (tc::add_back_nonfinite), as the
        // mma.sync forward does
        const T* vg = v_ptr<T>(p, si, b, h / (p.h / p.h_k), 0);
#pragma unroll 1
        for (int jl = 0; jl < P::kBlockN && n0 + jl < si.len_k; ++jl) {
          const int j = n0 + jl;
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const int i = i0 + (lane >> 2) + hf * 8;
            if (i < si.len_q && pol.allowed(i, j)) {
              tc::add_back_nonfinite<T, kDT>(*reinterpret_cast<float(*)[kDT][4]>(acc_o),  // its C fragments
                                             vg + int64_t(j) * p.v_row_stride, hf, lane & 3, p.d);
            }
          }
        }
      }
      pos.advance();
    }
  }

  // ---- epilogue: normalize, LSE, stage O in this warpgroup's 64 rows of the Q tile (read only
  // by this warpgroup's wgmmas, all retired) for 16-byte stores
  const int g = lane >> 2, c = lane & 3;
  const float sink = p.sinks != nullptr ? p.sinks[h] : -INFINITY;
  const float rdrop = kDropout ? 1.f / (1.f - p.dropout_p) : 1.f;  // the kept probabilities' rescale
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float lse, factor;
    finish_row(row_m[hf], row_l[hf], p.sinks != nullptr, sink, rdrop, &lse, &factor);
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      acc_o[4 * dt + 2 * hf] *= factor;
      acc_o[4 * dt + 2 * hf + 1] *= factor;
    }
    const int i = wm + g + hf * 8;
    if (c == 0 && i < rows_q && p.lse != nullptr) p.lse[lse_index(p, si, b, h, m0 + i)] = lse;
  }
  const uint32_t sO = base + P::kQ;
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      // rows g of 8 lanes land on 8 different chunks (dt ^ g): no bank conflicts
      const uint32_t val = tc::TypeOps<T>::pack(acc_o[4 * dt + 2 * hf], acc_o[4 * dt + 2 * hf + 1]);
      wg::st_shared_b32(sO + TileQ::offset(wm + g + hf * 8, dt * 8 + 2 * c), val);
    }
  wg::named_barrier_sync<128>(1 + cw);  // this warpgroup's rows are complete
  T* o = o_ptr<T>(p, si, b, h, m0);
  constexpr int kChunks = TileQ::kChunks;
  static_assert((64 * kChunks) % 128 == 0, "the copy-out splits evenly over the warpgroup");
#pragma unroll
  for (int it = 0; it < 64 * kChunks / 128; ++it) {
    const int idx = it * 128 + ctid;
    const int r = cw * 64 + idx / kChunks, ch = idx % kChunks;
    if (r < rows_q && ch * 8 < p.d) {
      const uint4 val = wg::ld_shared_v4(sO + TileQ::offset(r, ch * 8));
      *reinterpret_cast<uint4*>(o + int64_t(r) * p.o_row_stride + ch * 8) = val;
    }
  }
}

template <typename T, int kD, bool kDropout, int kQuant = kQkNone>
__global__ void __launch_bounds__(FwdPlan<kD>::kThreads, 1)
    fwd_kernel(const __grid_constant__ SoftmaxParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using P = FwdPlan<kD>;
  ATTN_EXTERN_SMEM(smem);  // the base is rounded up to 1024 bytes below
  const uint32_t base = (tc::smem_u32(smem) + 1023u) & ~1023u;

  // heaviest query blocks (causal: the last ones) first, so the grid's tail is short
  const int m_block = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const SeqInfo si(p, b);
  const int m0 = m_block * P::kBlockM;
  if (m0 >= si.len_q) return;  // the whole CTA, before any barrier
  const Policy pol(p, si, b, h);
  const int rows_q = min(P::kBlockM, si.len_q - m0);
  // the steps [n_lo, n_hi), run high to low: dense, step n is key block n; block-sparse (hopper_fwd
  // 2), step e is entry e of this query tile's row of the CSR tile index (key block idx[e],
  // ascending), clipped to the visible blocks (key_block)
  int n_lo, n_hi;
  pol.key_blocks(m0, m0 + rows_q, P::kBlockN, &n_lo, &n_hi);
  if (p.sparse.on()) sparse_entries(p.sparse, p.sparse.fwd, h, m_block, n_lo, n_hi, &n_lo, &n_hi);

  if (threadIdx.x == 0) {
    Bars<P::kStages>{base + P::kBar}.init(4 * P::kConsumerWGs);
    for (int s = 0; s < P::kStages; ++s) wg::st_shared_b32(base + P::kVFix + 4 * s, 0u);  // no step yet
  }
  __syncthreads();  // the barriers are initialized before any thread uses them

  // one role per warpgroup, each one branch of this if/else (what setmaxnreg needs)
  const int wg_idx = threadIdx.x / 128;
  if (wg_idx == 0) {
    wg::setmaxnreg_dec<P::Tr::kProducerRegs>();
    if (n_lo < n_hi) produce<T, kD, kQuant != kQkNone>(p, si, b, h, m0, rows_q, n_lo, n_hi, base, threadIdx.x);
  } else {
    wg::setmaxnreg_inc<P::Tr::kConsumerRegs>();
    consume<T, kD, kDropout, kQuant>(p, si, pol, b, h, m0, rows_q, n_lo, n_hi, base, wg_idx - 1,
                                     threadIdx.x % 128);
  }
#else
  // only sm_90a has wgmma; the dispatcher launches this kernel only where that code was built
  __trap();
#endif
}

}  // namespace hopper
}  // namespace attn
