// Tensor-core (mma.sync m16n8k16, fp16 / bf16 operands, fp32 accumulators) forward of the
// linear attention family: the chunked form of simt_kernel.cuh with the four chunk products on
// tensor cores, for fp16 / bf16 inputs with M <= 128.
//
// One CTA (4 warps) per (value tile of kN columns, head, sequence); warp w owns chunk rows
// [16w, 16w + 16). Per chunk of kChunk rows:
//   A  = Q~ K~^T                  (C, C):  mma, A from Q~ (C, kM), B from K~ (C, kM) rows
//   A <- mask j <= i, e^{g_i - g_j}   in the accumulators, then repacked as the A operand
//   O' = e^{g_i} Q~ S + A V'      (C, kN): B from S (kM, kN) and V (C, kN) with ldmatrix.trans
//   S <- e^{gC} S + (wk K~)^T V   (kM, kN): A from the (kM, C) transposed copy of wk * K~
// The state lives in shared memory twice: fp32 and a scaled 16-bit copy that feeds Q~ S
// (mma_common.cuh). The normalizer column is not a tile column: its state is the fp32 vector
// z (kM) = the running sum of the weighted K~ rows, and den_i = rowsum(A_i) + e^{g_i} Q~_i . z
// + eps, so every value tile has den without spending an 8-column mma tile on one column.
// Non-causal calls take two passes: S over the whole sequence, then O' = Q~ S per chunk.
// Operands are staged by plain 16-bit shared stores (the feature map and the key mask are
// applied while loading), so any row stride and alignment works.
//
// Two schedules (FwdMode):
//   kWhole: one CTA walks the whole sequence (the kernel above). Its parallelism is
//           value tiles x heads x batch: 128 CTAs at (B, H, Dv) = (4, 16, 128), a few percent of an
//           H100's warp slots, each waiting on one global load per element it stages.
//   chunk-parallel, the two-level scan of the chunked forms (GLA, FLA's chunked kernels): the
//           sequence is cut into segments of whole chunks, and grid.x = value tiles x segments.
//     kSegState: each CTA runs its segment from a zero state with no outputs, and writes the
//                segment's local state U_s (its keys' K~^T V', decayed to the segment end) and its
//                total log-decay G_s to the scratch (SegPlan);
//     scan_kernel: per state element, the states entering the segments, in place:
//                S_0 = init, S_{s+1} = e^{G_s} S_s + U_s; slot n_seg holds the final state;
//     kSegOut:   each CTA runs its segment from S_s (non-causal: from the final state) and writes
//                the outputs; the state update is skipped after the segment's last chunk.
//   The segment modes stage a chunk with 16-byte loads, every load of the chunk issued before
//   the first is used, where the rows allow it (stage_vec); the per-chunk math is kWhole's.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "common/linear_params.h"
#include "cuda/mma.cuh"
#include "linear/cuda/mma_common.cuh"

namespace attn {
namespace linear_tc {

enum class FwdMode : int { kWhole = 0, kSegState = 1, kSegOut = 2 };

template <int kM>
struct Smem {
  static_assert(kM == 64 || kM == 128, "feature-width buckets");
  using QTile = tc::SmemTile<kChunk, kM>;   // Q~, K~ (C, kM)
  using KtTile = tc::SmemTile<kM, kChunk>;  // (wk K~)^T (kM, C)
  using VTile = tc::SmemTile<kChunk, kN>;   // V (C, kN)
  using STile = tc::SmemTile<kM, kN>;       // 16-bit S (kM, kN)
  static constexpr int kQ = 0, kK = kQ + QTile::kBytes, kKt = kK + QTile::kBytes, kV = kKt + KtTile::kBytes,
                       kS = kV + VTile::kBytes, kSf = kS + STile::kBytes;  // fp32 S (kM, kN)
  static constexpr int kZ = kSf + kM * kN * 4;                            // fp32 z (kM)
  static constexpr int kQz = kZ + kM * 4;                                  // Q~_i . z (C)
  static constexpr int kScalars = kQz + kChunk * 4;                        // g, wq, wk, kmul, ep (C each)
  static constexpr int kRed = kScalars + 5 * kChunk * 4;                   // per-warp max |S|
  static constexpr int kBytes = kRed + kWarps * 4;
};

// One chunk's Q~ (when want_q), K~, (wk K~)^T and V tiles, as the scalar loop of fwd_kernel
// stages them, from 16-byte loads (mma_common.cuh's staging: one memory round trip per chunk).
template <typename T, typename L, int kM>
__device__ __forceinline__ void stage_vec(unsigned char* smem, const Params& p, const T* qh, const T* kh, const T* vh,
                                          int r0, int n, int c0, int nv, const float* wk, const float* kmul,
                                          bool want_q, int tid) {
  RowVecs<kM> qv, kv;
  RowVecs<kN> vv;
  qv.load(qh, p.q_row_stride, r0, n, p.d, nullptr, want_q, tid);
  kv.load(kh, p.k_row_stride, r0, n, p.d, kmul, true, tid);  // a padded key (kmul 0): 0 without a read
  vv.load(vh + c0, p.v_row_stride, r0, n, nv, kmul, true, tid);
  if (want_q) store_features<T, typename L::QTile, typename L::KtTile, kM>(smem, L::kQ, 0u, qv, p, n, nullptr, nullptr, false, tid);
  store_features<T, typename L::QTile, typename L::KtTile, kM>(smem, L::kK, L::kKt, kv, p, n, kmul, wk, true, tid);
  store_rows<T, typename L::VTile, kN>(smem, L::kV, vv, nullptr, tid);
}

// kWhole: grid (ceil(Dv / kN), H, B); the segment modes: grid (ceil(Dv / kN) * plan.n_seg, H, B).
// kThreads threads, Smem<kM>::kBytes bytes.
template <typename T, int kM, FwdMode kMode = FwdMode::kWhole>
__global__ void __launch_bounds__(kThreads, 1) fwd_kernel(const Params p, const SegPlan plan) {
  using L = Smem<kM>;
  constexpr bool kSeg = kMode != FwdMode::kWhole;
  const int ntiles = (p.dim_v + kN - 1) / kN;
  const int tile = kSeg ? int(blockIdx.x) % ntiles : int(blockIdx.x), seg = kSeg ? int(blockIdx.x) / ntiles : 0;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (p.h / p.h_k);
  const int tid = threadIdx.x, warp = tid / 32;
  int lane = tid % 32;  // opaque() per chunk (mma_common.cuh)
  const int m = p.d, c0 = tile * kN, nv = min(kN, p.dim_v - c0);
  const linear_simt::Seq s(p, b);
  const bool decay = p.decay != nullptr;
  ATTN_EXTERN_SMEM(smem);
  const uint32_t sbase = tc::smem_u32(smem);
  float* Sf = reinterpret_cast<float*>(smem + L::kSf);
  float* z = reinterpret_cast<float*>(smem + L::kZ);
  float* qz = reinterpret_cast<float*>(smem + L::kQz);
  float* g = reinterpret_cast<float*>(smem + L::kScalars);
  float* wq = g + kChunk;
  float* wk = wq + kChunk;
  float* kmul = wk + kChunk;
  float* ep = kmul + kChunk;
  float* red = reinterpret_cast<float*>(smem + L::kRed);
  const T* qh = static_cast<const T*>(p.q) + s.off(p.q_batch_stride, h, p.q_head_stride, 0, p.q_row_stride);
  const T* kh = static_cast<const T*>(p.k) + s.off(p.k_batch_stride, hk, p.k_head_stride, 0, p.k_row_stride);
  const T* vh = static_cast<const T*>(p.v) + s.off(p.v_batch_stride, hk, p.v_head_stride, 0, p.v_row_stride);
  T* oh = static_cast<T*>(p.o) + s.off(p.o_batch_stride, h, p.o_head_stride, 0, p.o_row_stride);

  // this CTA's rows [r_begin, r_end) and the state it starts from
  int r_begin = 0, r_end = s.len;
  const float* s_in = state_at(p.init_state, p, b, h);
  if constexpr (kSeg) {
    // the last segment takes every remaining row: a varlen sequence longer than max_seqlen (the
    // plan's length, not checked on CUDA) is still covered whole
    r_begin = clamp_rows(seg, plan.seg_rows, s.len);
    r_end = seg == plan.n_seg - 1 ? s.len : clamp_rows(seg + 1, plan.seg_rows, s.len);
    s_in = kMode == FwdMode::kSegState ? nullptr : plan.state(p, b, h, p.causal ? seg : plan.n_seg);
  }
  load_state<kM, kSeg>(Sf, z, s_in, p, c0, nv, p.normalize);
  __syncthreads();
  float sigma = refresh_s16<T, L, kM>(smem, Sf, red);
  const bool vec = kSeg && m % 8 == 0 && nv % 8 == 0 && p.q_row_stride % 8 == 0 && p.k_row_stride % 8 == 0 &&
                   p.v_row_stride % 8 == 0 && aligned16(qh) && aligned16(kh) && aligned16(vh + c0);
  float glog = 0.f;  // kSegState: the segment's summed log-decay

  // kWhole: pass 0 (non-causal only): S, z over the whole sequence; pass 1: outputs (and,
  // causal, S). kSegState: pass 0 over the segment; kSegOut: pass 1 over the segment.
  const int pass_begin = kMode == FwdMode::kSegOut ? 1 : (kSeg || !p.causal ? 0 : 1);
  const int pass_end = kMode == FwdMode::kSegState ? 1 : 2;
  for (int pass = pass_begin; pass < pass_end; ++pass) {
    const bool want_out = pass == 1;
    for (int r0 = r_begin; r0 < r_end; r0 += kChunk) {
      const int n = min(kChunk, r_end - r0);
      // kSegOut: the state after the segment's last chunk is not needed
      const bool want_update = pass == 0 || (p.causal && (kMode != FwdMode::kSegOut || r0 + kChunk < r_end));
      lane = opaque(lane);
      linear_simt::load_row_scalars(p, s, h, r0, n, g, wq, wk, kmul, ep);
      __syncthreads();
      const float egc = linear_simt::chunk_decay(wq, n);
      // the segment's log-decay: -inf once a reset is in (its e^ is the scan's factor)
      if constexpr (kMode == FwdMode::kSegState) glog += ep[n - 1] == 0.f ? g[n - 1] : -INFINITY;
      // stage Q~, K~, (wk K~)^T and V as 16-bit tiles
      if (vec) {
        stage_vec<T, L, kM>(smem, p, qh, kh, vh, r0, n, c0, nv, wk, kmul, want_out, tid);
      } else {
      for (int e = tid; e < kChunk * kM; e += kThreads) {
        const int i = e / kM, c = e % kM;
        const bool ok = i < n && c < m;
        if (want_out) {
          const float x = ok ? linear_simt::feature(p.feature_map, to_float(qh[int64_t(r0 + i) * p.q_row_stride + c])) * p.scale : 0.f;
          st16<T>(smem, L::kQ + L::QTile::offset(i, c), x);
        }
        // a padded key (kmul 0): 0 without a read, not 0 x its row (NaN where the row is)
        const float y = ok && kmul[i] != 0.f
                            ? linear_simt::feature(p.feature_map, to_float(kh[int64_t(r0 + i) * p.k_row_stride + c])) * kmul[i]
                            : 0.f;
        st16<T>(smem, L::kK + L::QTile::offset(i, c), y);
        st16<T>(smem, L::kKt + L::KtTile::offset(c, i), y * wk[i]);
      }
      for (int e = tid; e < kChunk * kN; e += kThreads) {
        const int i = e / kN, c = e % kN;
        const float x = i < n && c < nv && kmul[i] != 0.f ? to_float(vh[int64_t(r0 + i) * p.v_row_stride + c0 + c]) : 0.f;
        st16<T>(smem, L::kV + L::VTile::offset(i, c), x);
      }
      }
      __syncthreads();
      if (want_out && tid < kChunk) {  // Q~_i . z with the chunk-start z
        float acc = 0.f;
        for (int c = 0; c < m; ++c) acc += ld16<T>(smem, L::kQ + L::QTile::offset(tid, c)) * z[c];
        qz[tid] = acc;
      }
      if (want_out) {
        const int row_a = 16 * warp;
        float acc_o[kN / 8][4];
        zero(acc_o);
        // O' = Q~ S, rows scaled by e^{g_i} below
        mma_smem<T, typename L::QTile, typename L::STile, kM, kN, true>(acc_o, sbase + L::kQ, row_a, sbase + L::kS, lane);
        const int ra = row_a + lane / 4, rb = ra + 8;  // this thread's two rows of the warp's 16
        const float ea = p.causal ? wq[ra] : 1.f, eb = p.causal ? wq[rb] : 1.f;
#pragma unroll
        for (int t = 0; t < kN / 8; ++t) {
          acc_o[t][0] *= ea * sigma;
          acc_o[t][1] *= ea * sigma;
          acc_o[t][2] *= eb * sigma;
          acc_o[t][3] *= eb * sigma;
        }
        float sum_a = 0.f, sum_b = 0.f;
        if (p.causal) {
          // A = Q~ K~^T for the warp's 16 rows x the chunk's kChunk keys
          float acc_s[kChunk / 8][4];
          zero(acc_s);
          mma_smem<T, typename L::QTile, typename L::QTile, kM, kChunk, false>(acc_s, sbase + L::kQ, row_a, sbase + L::kK,
                                                                              lane);
          // mask j <= i with weights e^{g_i - g_j}; row sums feed den
#pragma unroll
          for (int t = 0; t < kChunk / 8; ++t) {
#pragma unroll
            for (int x = 0; x < 4; ++x) {
              const int i = x < 2 ? ra : rb, j = t * 8 + 2 * (lane % 4) + (x & 1);
              float val = j <= i ? acc_s[t][x] : 0.f;
              if (decay && j <= i) val *= linear_simt::pair_weight(g, ep, i, j);
              acc_s[t][x] = val;
            }
            sum_a += acc_s[t][0] + acc_s[t][1];
            sum_b += acc_s[t][2] + acc_s[t][3];
          }
          // O' += A V: the accumulators of two adjacent key tiles are one A fragment
          mma_reg<T, typename L::VTile, kChunk, kN>(acc_o, acc_s, sbase + L::kV, lane);
#pragma unroll
          for (int o = 1; o <= 2; o <<= 1) {
            sum_a += __shfl_xor_sync(0xffffffffu, sum_a, o);
            sum_b += __shfl_xor_sync(0xffffffffu, sum_b, o);
          }
        }
        __syncthreads();  // qz is complete
        const float den_a = p.normalize ? sum_a + ea * qz[ra] + p.eps : 1.f;
        const float den_b = p.normalize ? sum_b + eb * qz[rb] + p.eps : 1.f;
#pragma unroll
        for (int t = 0; t < kN / 8; ++t) {
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            const int i = x < 2 ? ra : rb, c = t * 8 + 2 * (lane % 4) + (x & 1);
            if (i < n && c < nv) oh[int64_t(r0 + i) * p.o_row_stride + c0 + c] = from_float<T>(acc_o[t][x] / (x < 2 ? den_a : den_b));
          }
        }
        if (tile == 0 && lane % 4 == 0) {
          if (ra < n) p.den[s.row(p, p.h, h, r0 + ra)] = den_a;
          if (rb < n) p.den[s.row(p, p.h, h, r0 + rb)] = den_b;
        }
      }
      __syncthreads();  // every warp is done reading S and z
      if (want_update) {
        // S <- e^{gC} S + (wk K~)^T V, 16-row tiles of the state over the warps
        const float f = p.causal ? egc : 1.f;
        add_outer<T, L, kM>(Sf, sbase + L::kKt, sbase + L::kV, f, warp, lane);
        for (int c = tid; c < kM; c += kThreads) {  // z <- e^{gC} z + sum_j wk_j K~_j
          float acc = 0.f;
          for (int j = 0; j < n; ++j) acc += ld16<T>(smem, L::kKt + L::KtTile::offset(c, j));
          z[c] = f * z[c] + acc;
        }
        __syncthreads();
        // kSegState has no products with S: its 16-bit copy is never read
        if constexpr (kMode != FwdMode::kSegState) sigma = refresh_s16<T, L, kM>(smem, Sf, red);
      }
      __syncthreads();
    }
  }
  if constexpr (kMode == FwdMode::kWhole) {
    if (p.final_state != nullptr) store_state(state_at(p.final_state, p, b, h), Sf, z, p, c0, nv, tile == 0 && p.normalize);
  } else if constexpr (kMode == FwdMode::kSegState) {
    store_state(plan.state(p, b, h, seg), Sf, z, p, c0, nv, tile == 0 && p.normalize);
    if (tile == 0 && tid == 0) plan.gtot[(int64_t(b) * p.h + h) * plan.n_seg + seg] = glog;
  }
}

// The scan over segment states, in place (SegPlan): one thread per element of a (b, h) state
// matrix, grid (ceil(M * dim_v_aug / kThreads), H, B). Forward (plan.states, ascending): slot s
// becomes the state entering segment s, from `init` (null: 0); reverse (plan.ustates, the
// backward, descending): slot s becomes the reverse state at segment s's end, from `init` = dS_T.
// Slot n_seg and `last` (when not null) get the state past the last segment scanned.
__global__ void __launch_bounds__(kThreads) seg_scan_kernel(const Params p, const SegPlan plan, bool reverse,
                                                            const float* init, float* last) {
  const int64_t per = int64_t(p.d) * p.dim_v_aug;
  const int64_t e = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int h = blockIdx.y, b = blockIdx.z;
  if (e >= per) return;
  float* st = (reverse ? plan.ustate(p, b, h, 0) : plan.state(p, b, h, 0)) + e;
  const float* gt = plan.gtot + (int64_t(b) * p.h + h) * plan.n_seg;
  float x = init != nullptr ? state_at(init, p, b, h)[e] : 0.f;
  for (int jj = 0; jj < plan.n_seg; ++jj) {
    const int j = reverse ? plan.n_seg - 1 - jj : jj;
    const float u = st[j * per];
    st[j * per] = x;
    x = expf(gt[j]) * x + u;
  }
  st[plan.n_seg * per] = x;
  if (last != nullptr) state_at(last, p, b, h)[e] = x;
}

}  // namespace linear_tc
}  // namespace attn
