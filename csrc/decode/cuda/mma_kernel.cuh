// The tensor-core decode kernel (fp16 / bf16): the packed query rows of one (batch, kv head)
// against its split of the KV cache on mma.sync, each warp streaming its own keys through a
// cp.async pipeline of its own.
//
// Why: the CUDA-core kernel (kernel.cuh) spends about 700 instructions per thread on every 16 keys
// of a CTA at 8 rows (each K and V element feeds 8 FMAs, plus shuffles and the softmax), so it is
// bound by instruction issue well below the copy bandwidth (benchmarks/gpu_cost.py). Here the 16
// packed rows (GQA group x Sq, the M of m16n8k16) take Q K^T and P V as 2 * kD / 8 mma per 16 keys
// and the loads are 16-byte cp.async into shared memory, so the kernel stays a streaming copy:
// the schedule of flash-decoding with the rows of a GQA group packed into one tile (FlashInfer's
// and flash-attn's decode).
//
// decode_mma_kernel: grid (splits, H_k, B), kMmaThreads = 128 threads (4 warps).
//   rows        R = G * Sq packed rows as in kernel.cuh (row r: query head hk * G + r / Sq, query
//               row r % Sq), 16 per pass (rows past R are zeros, their results dropped); more
//               rows loop over blocks of 16, re-reading the split's keys from L2.
//   keys        the split [a, e) (a multiple of 64 keys, kernel_common.cuh split_range) is dealt
//               to the warps in tiles of 16: warp w takes keys a + 64 t + 16 w + [0, 16). Each
//               warp runs its own kStages-deep pipeline of (K, V) tiles in shared memory
//               (SmemTile, swizzled), waited for with cp.async.wait_group and __syncwarp: the
//               key loop has no block-wide barrier. A lane copies one key's 16-byte chunks
//               (lane % 16 the key, chunks lane / 16 + 2 u), its address from a KvCursor
//               (contiguous or paged) advanced by 64 keys per tile.
//   S = Q K^T   Q (16 x kD) staged once per row block in shared memory; per tile kD / 16
//               k-steps of ldmatrix (Q as A, K as B) and two mma (two 8-key n-tiles).
//   softmax     per row an online softmax on the C fragments (rows g, g + 8 of each lane, 4
//               keys each); logits through the policy (PolicyT::allowed / score: causal
//               bottom-right, window, ALiBi, softcap), max over the quad by shuffles, the row
//               sum kept per lane and summed over the quad at the end.
//   P V         P rounded to E as the A fragment (the C fragments of S are its layout), V by
//               ldmatrix.trans, kD / 8 mma into the (16 x kD) fp32 accumulator (kD / 2 floats
//               per lane).
//   merge       the 4 warps' (m, l, O) through shared memory (reusing the pipelines), then
//               kernel_common.cuh's finish_elem: out / lse, or the split's partial for the
//               combine kernel (kernel.cuh).
//
// NaN policy (README): a key hidden from some rows of a tile (the causal diagonal or a window
// edge with Sq > 1) enters the mma with P = 0, and 0 x NaN would reach rows that never read it.
// Tiles that are not full (PolicyT::tile_full over the tile's keys) therefore take P V on CUDA
// cores from shared memory, adding only the keys each row sees (the same rounded P), whatever the
// values hold, so a NaN there changes no bit of the rows it is hidden from. A decode step has at
// most a few such tiles per sequence (the diagonal's, the window's two edges).
//
// Requires (dispatch.cu checks, else the CUDA-core kernel runs): 16-byte aligned K / V rows and d a
// multiple of 8 (whole 16-byte chunks; chunks past d are zero-filled, as are keys past e), and
// d <= 128: at kD = 256 the (16 x 256) fp32 accumulator of a warp leaves ptxas too few registers
// (it spills).
//
// ptxas (sm_80 and sm_90a): kD = 64: 168 registers, 3 CTAs per SM (64 KB of shared memory each);
// kD = 128: 255 registers, 2 CTAs per SM (100 KB); no spills.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <type_traits>

#include "common/decode_params.h"
#include "common/policy.h"
#include "cuda/mma.cuh"
#include "decode/cuda/kernel_common.cuh"

namespace attn {
namespace decode_cuda {

constexpr int kMmaWarps = 4;
constexpr int kMmaThreads = 32 * kMmaWarps;
constexpr int kMmaRows = 16;   // packed query rows per pass: the mma's M
constexpr int kTileKeys = 16;  // keys per warp tile
constexpr int kMmaStep = kMmaWarps * kTileKeys;  // keys per iteration of the CTA

template <int kD>
struct MmaTraits {
  using Tile = tc::SmemTile<kTileKeys, kD>;  // a warp's K or V tile, and the Q tile (16 rows)
  // Stages per warp: the CTA's pipelines take 64 / 96 KB at kD = 64 / 128, so 3 / 2 CTAs fit an
  // SM and every SM has 36-64 KB of K / V in flight (the H100's copy bandwidth times its latency
  // is ~25 KB per SM).
  static constexpr int kStages = kD <= 64 ? 4 : 3;
  static constexpr int kChunks = kD / 8;  // 16-byte chunks per key row
  static constexpr int kStageBytes = 2 * Tile::kBytes;  // K tile, then V tile
  static constexpr int kPipeBytes = kMmaWarps * kStages * kStageBytes;
  // the merge buffer, over the drained pipelines: O [warps][16][kD], m and l [warps][16] floats
  static constexpr int kMergeBytes = kMmaWarps * kMmaRows * (kD + 2) * 4;
  static_assert(kMergeBytes <= kPipeBytes, "the merge buffer fits in the pipelines");
  static_assert(kChunks % 2 == 0, "two lanes per key row");
  static constexpr int kQOff = kPipeBytes;
  static constexpr int kPolOff = kQOff + Tile::kBytes;
  static constexpr int kSmemBytes = kPolOff + (kMmaRows * int(sizeof(PolicyT<float>)) + 15) / 16 * 16;
  // CTAs per SM the shared memory allows (228 KB): the register budget asked of ptxas (without
  // it, ptxas picks a smaller budget for kD = 64 and spills)
  static_assert(kD == 64 || kD == 128, "head-dim buckets 64 and 128 (dispatch.cu)");
  static constexpr int kMinBlocks = kD <= 64 ? 3 : 2;
};

// Both halves of a 32-bit pair of E: is either inf or NaN (exponent all ones)?
template <typename E>
__device__ __forceinline__ bool pair_nonfinite(uint32_t w) {
  constexpr uint32_t m = std::is_same_v<E, __half> ? 0x7c00u : 0x7f80u;
  return (w & m) == m || ((w >> 16) & m) == m;
}

template <typename E, int kD>
__global__ void __launch_bounds__(kMmaThreads, MmaTraits<kD>::kMinBlocks) decode_mma_kernel(const DecodeParams p, int splits, float* part_o,
                                                                 float* part_lse) {
  using Tr = MmaTraits<kD>;
  using Tile = typename Tr::Tile;
  using Ops = tc::TypeOps<E>;
  constexpr int kS = Tr::kStages;
  constexpr float kNegInf = -INFINITY;
  ATTN_EXTERN_SMEM(smem);
  const uint32_t sbase = tc::smem_u32(smem);
  PolicyT<float>* pols = reinterpret_cast<PolicyT<float>*>(smem + Tr::kPolOff);

  const int split = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c4 = lane % 4;
  const int group = p.h / p.h_k, rows = group * p.sq, d = p.d;
  const SeqInfo si = decode_seq_info(p, b);
  const KvRows kv(p, b, hk);
  int a, e;
  split_range(p, si, b, hk * group, split, splits, kMmaStep, &a, &e);
  // this warp's tiles: keys [first + kMmaStep t, + kTileKeys) for t < nt
  const int first = a + warp * kTileKeys;
  const int nt = first < e ? (e - first + kMmaStep - 1) / kMmaStep : 0;
  const uint32_t pipe = sbase + uint32_t(warp * kS * Tr::kStageBytes);
  const uint32_t qs = sbase + Tr::kQOff;
  const E* kbase = static_cast<const E*>(p.k);
  const E* vbase = static_cast<const E*>(p.v);
  const E* qbase = static_cast<const E*>(p.q);
  const int ck = lane & 15, ch0 = lane >> 4;  // the key and first chunk this lane copies

  for (int r0 = 0; r0 < rows; r0 += kMmaRows) {
    const int nr = imin(kMmaRows, rows - r0);
    __syncthreads();  // the previous row block's readers of Q, the policies and the merge buffer are done
    if (tid < nr) new (pols + tid) PolicyT<float>(p, si, b, hk * group + (r0 + tid) / p.sq);
    // Q (16 x kD) raw (the policy scales), zeros past nr rows and d columns
    for (int idx = tid; idx < kMmaRows * kD; idx += kMmaThreads) {
      const int rr = idx / kD, col = idx % kD;
      uint16_t bits = 0;
      if (rr < nr && col < d) {
        const int r = r0 + rr, h = hk * group + r / p.sq, i = r % p.sq;
        memcpy(&bits, qbase + int64_t(b) * p.q_batch_stride + int64_t(h) * p.q_head_stride +
                          int64_t(i) * p.q_row_stride + col, 2);
      }
      memcpy(smem + Tr::kQOff + Tile::offset(rr, col), &bits, 2);
    }
    __syncthreads();  // Q and the policies written
    // decode calls carry no bool mask, layout or top-k; the check keeps that explicit
    const bool plain = pols[0].bias_kind == BiasKind::kNone && pols[0].layout == nullptr && pols[0].topk_thr == nullptr;

    // This lane's key of tile t, copied into slot t % kS (keys past e and chunks past d as zeros).
    KvCursor cur;
    int cur_j = -1;
    auto issue = [&](int t) {
      const int j = first + t * kMmaStep + ck;
      const bool valid = j < e;
      if (valid) {
        if (cur_j < 0) {
          cur.start(kv, j);
        } else {
          cur.advance(kv, j - cur_j);
        }
        cur_j = j;
      }
      const uint32_t ks = pipe + uint32_t((t % kS) * Tr::kStageBytes), vs = ks + Tile::kBytes;
#pragma unroll
      for (int u = 0; u < Tr::kChunks / 2; ++u) {
        const int ch = ch0 + 2 * u;
        const bool ok = valid && ch * 8 < d;
        tc::cp_async16(ks + Tile::offset(ck, ch * 8), ok ? kbase + cur.ko + ch * 8 : kbase, ok);
        tc::cp_async16(vs + Tile::offset(ck, ch * 8), ok ? vbase + cur.vo + ch * 8 : vbase, ok);
      }
    };

    float o[kD / 8][4];  // O (16 x kD): n-tile n holds rows g, g + 8 x columns 8 n + 2 c4 + {0, 1}
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};  // rows g, g + 8; l of this lane's keys

#pragma unroll
    for (int s = 0; s < kS - 1; ++s) {
      if (s < nt) issue(s);
      tc::cp_async_commit();
    }
    for (int t = 0; t < nt; ++t) {
      // into the slot of tile t - 1, whose readers passed the __syncwarp ending its iteration
      if (t + kS - 1 < nt) issue(t + kS - 1);
      tc::cp_async_commit();
      tc::cp_async_wait<kS - 1>();
      __syncwarp();  // every lane's copies of tile t landed
      const uint32_t ks = pipe + uint32_t((t % kS) * Tr::kStageBytes), vs = ks + Tile::kBytes;
      const int j0 = first + t * kMmaStep;

      // S = Q K^T: s[0..3] keys j0 + [0, 8), s[4..7] keys j0 + [8, 16)
      float s[8];
#pragma unroll
      for (int x = 0; x < 8; ++x) s[x] = 0.f;
      const uint32_t qa0 = qs + Tile::lane_a(0, lane), kb0 = ks + Tile::lane_b(0, lane);
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        uint32_t qa[4], kb[4];
        tc::ldmatrix_x4(qa, Tile::advance(qa0 - qs, 0, 16 * kk) + qs);
        tc::ldmatrix_x4(kb, Tile::advance(kb0 - ks, 0, 16 * kk) + ks);
        tc::mma_n16<E>(s, qa, kb);
      }

      // every (row, key) of the tile's keys inside the window (rows and heads share it)
      const bool full = plain && pols[0].tile_full(0, p.sq, j0, imin(j0 + kTileKeys, e));
      // online softmax per row; p[hf][x] the probability of key kx(x) = 8 (x / 2) + 2 c4 + x % 2
      float pr[2][4];
      uint32_t seen = 0u;  // bit 4 hf + x: row g + 8 hf sees key kx(x)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int rr = g + 8 * hf;
        const bool row_ok = rr < nr;
        const PolicyT<float>& pol = pols[imin(rr, nr - 1)];
        const int i = (r0 + imin(rr, nr - 1)) % p.sq;
        float mx = m[hf];
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const int j = j0 + 8 * (x / 2) + 2 * c4 + x % 2;
          const bool ok = row_ok && j < e && (full || pol.allowed(i, j));
          const float sc = ok ? pol.score(s[4 * (x / 2) + 2 * hf + x % 2], i, j) : kNegInf;
          seen |= uint32_t(ok) << (4 * hf + x);
          pr[hf][x] = sc;
          mx = fmaxf(mx, sc);  // a NaN logit is skipped here and poisons the sum below
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mu = mx == kNegInf ? 0.f : mx;
        const float corr = m[hf] == mx ? 1.f : expf(m[hf] - mu);
        m[hf] = mx;
        float ps = 0.f;
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          // the sum of the exact P (the lse); P V takes P rounded to E, as the mma's A operand
          // holds it, on either path
          const float pf = expf(pr[hf][x] - mu);
          ps += pf;
          pr[hf][x] = Ops::unpack(Ops::pack(pf, 0.f)).x;
        }
        l[hf] = l[hf] * corr + ps;
#pragma unroll
        for (int n = 0; n < kD / 8; ++n) {
          o[n][2 * hf] *= corr;
          o[n][2 * hf + 1] *= corr;
        }
      }

      if (full) {
        // P V: P (16 rows x 16 keys) is the A fragment laid out as S's C fragments
        const uint32_t pa[4] = {Ops::pack(pr[0][0], pr[0][1]), Ops::pack(pr[1][0], pr[1][1]),
                                Ops::pack(pr[0][2], pr[0][3]), Ops::pack(pr[1][2], pr[1][3])};
        const uint32_t vb0 = Tile::lane_bt(0, lane);
#pragma unroll
        for (int nn = 0; nn < kD / 16; ++nn) {
          uint32_t vb[4];
          tc::ldmatrix_x4_trans(vb, vs + Tile::advance(vb0, 0, 16 * nn));
          tc::mma_n16<E>(&o[2 * nn][0], pa, vb);
        }
      } else {
        // P V on CUDA cores, each row adding only the keys it sees: gather the quad's 16 keys
        // (lane c4 ^ y holds keys 2 (c4 ^ y) + {0, 1}, 8 + 2 (c4 ^ y) + {0, 1})
        // (not unrolled over y: one lane's keys at a time keeps the registers of the mma path)
        const unsigned char* vt = smem + (vs - sbase);
#pragma unroll 1
        for (int y = 0; y < 4; ++y) {
          float py[2][4];
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
#pragma unroll
            for (int x = 0; x < 4; ++x) py[hf][x] = __shfl_xor_sync(0xffffffffu, pr[hf][x], y);
          }
          const uint32_t sy = uint32_t(__shfl_xor_sync(0xffffffffu, int(seen), y));
          const int cy = c4 ^ y;
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            const int key = 8 * (x / 2) + 2 * cy + x % 2;
#pragma unroll
            for (int n = 0; n < kD / 8; ++n) {
              uint32_t w;
              memcpy(&w, vt + Tile::offset(key, 8 * n + 2 * c4), 4);
              const float2 vv = Ops::unpack(w);
#pragma unroll
              for (int hf = 0; hf < 2; ++hf) {
                if (sy >> (4 * hf + x) & 1u) {
                  o[n][2 * hf] = fmaf(py[hf][x], vv.x, o[n][2 * hf]);
                  o[n][2 * hf + 1] = fmaf(py[hf][x], vv.y, o[n][2 * hf + 1]);
                }
              }
            }
          }
        }
      }
      __syncwarp();  // the tile's readers are done before iteration t + 1 refills its slot
    }
    tc::cp_async_wait<0>();
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      l[hf] += __shfl_xor_sync(0xffffffffu, l[hf], 1);
      l[hf] += __shfl_xor_sync(0xffffffffu, l[hf], 2);
    }

    // merge the 4 warps: raw (m, l, O) to shared memory, weighted by exp(m_w - max) when read
    __syncthreads();  // every warp's pipeline is drained and read
    float* red_o = reinterpret_cast<float*>(smem);  // [warp][row][kD]
    float* red_m = red_o + kMmaWarps * kMmaRows * kD;
    float* red_l = red_m + kMmaWarps * kMmaRows;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int rr = g + 8 * hf;
      if (c4 == 0) {
        red_m[warp * kMmaRows + rr] = m[hf];
        red_l[warp * kMmaRows + rr] = l[hf];
      }
#pragma unroll
      for (int n = 0; n < kD / 8; ++n) {
        float* dst = red_o + (warp * kMmaRows + rr) * kD + 8 * n + 2 * c4;
        dst[0] = o[n][2 * hf];
        dst[1] = o[n][2 * hf + 1];
      }
    }
    __syncthreads();
    for (int idx = tid; idx < nr * d; idx += kMmaThreads) {
      const int rr = idx / d, c = idx % d;
      const int r = r0 + rr, h = hk * group + r / p.sq, i = r % p.sq;
      float mr = kNegInf;
#pragma unroll
      for (int w = 0; w < kMmaWarps; ++w) mr = fmaxf(mr, red_m[w * kMmaRows + rr]);
      float lr = 0.f, ov = 0.f;
#pragma unroll
      for (int w = 0; w < kMmaWarps; ++w) {
        // multiplied, not skipped: a warp whose only logit was NaN has m = -inf and l = NaN
        const float mw = red_m[w * kMmaRows + rr];
        const float wt = mw == kNegInf ? 0.f : expf(mw - mr);
        lr += red_l[w * kMmaRows + rr] * wt;
        ov += red_o[(w * kMmaRows + rr) * kD + c] * wt;
      }
      finish_elem<E>(p, splits, split, part_o, part_lse, b, h, i, c, mr, lr, ov);
    }
  }
}

}  // namespace decode_cuda
}  // namespace attn
