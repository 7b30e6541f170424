// The CUDA decode kernels: a few query rows against a long KV cache (flash_attn_with_kvcache),
// bound by the bandwidth of reading K and V once. CUDA cores only: with R <= 8 rows per K / V row
// there is too little reuse for tensor cores to matter.
//
// decode_kernel: grid (splits, H_k, B), kThreads = 128 threads. A CTA computes the R = G * Sq
// packed rows of one (batch b, kv head hk) (row r = query head hk * G + r / Sq, query row r % Sq;
// G = H / H_k, the same packing as the CPU kernel, csrc/decode/cpu/decode.cpp) over its split of
// the keys. Rows go in blocks of kRows = 8 (GQA 8 x Sq 1 in one pass: each K / V row is read from
// memory once per GQA group; more rows loop over blocks, re-reading the split's K / V from L2), or
// kRows = 4 for calls with R <= 4 (fewer registers).
//
//   thread layout  a key row of kD elements is kVecs 16-byte vectors; kTPR = min(32, kVecs) lanes
//                  share one key (each holds kEPT = kD / kTPR elements: its vectors
//                  lane + u * kTPR), so the CTA has kGroups = 128 / kTPR key groups; group g
//                  reads keys a + g, a + g + kGroups, ... of the split [a, e), kUnroll keys in
//                  flight per group (all their K / V vectors are loaded before any is used).
//   scores         per row, the group's lanes dot their kEPT elements and reduce by xor
//                  shuffles inside the group (kTPR lanes are aligned within the warp), then
//                  PolicyT::allowed / score (causal bottom-right, window, ALiBi, softcap: the
//                  shared policy, one per row's head, kept in shared memory).
//   softmax        each group runs its own online softmax (m, l, O in registers: kRows x kEPT),
//                  one update per kUnroll keys, so the key loop has no barrier; at the end the
//                  kGroups partials merge through shared memory (red_o: kGroups x kRows x kD
//                  floats, <= 32 KB).
//   output         splits == 1: out / lse directly, the sink joining the denominator as on the
//                  CPU. splits > 1: the split's O_s (normalized by its own sum) and lse_s to fp32
//                  scratch; combine_kernel merges them with common/split_merge.h, sinks there.
//
// Key addresses come from common/decode_params.h's KvRows (contiguous or paged, cache_batch_idx,
// leftpad); a group steps through its keys with a cursor (one division at the start, then
// page crossings by subtraction) instead of a division per key.
//
// Static cost (benchmarks/gpu_cost.py, "decode" rows): bound by instruction issue at 8 rows per
// pass (about 700 instructions per thread per 16 keys of the CTA: the 8 rows' dots, reductions,
// softmax and P V on CUDA cores) and by how full the last wave of CTAs is (heuristics.h).
//
// Loads: 16-byte vectors when the host found every K / V row 16-byte aligned and d a multiple of
// the vector (vec_ok); otherwise (and for the vector holding d's tail) element by element. Head
// dims up to the bucket kD (64 / 128 / 256) run with the elements past d as zeros.
//
// 8-bit caches (DecodeParams::kv_quant; C = int8_t, or uint8_t holding fp8 e4m3 bits): 8-byte
// vectors of 8 elements (the fp16 layout of lanes and groups, so the merge buffer stays 32 KB),
// widened to float in registers. The descales never touch an element: a key's k descale
// multiplies its q.k, its v descale its probability in P V (the CPU kernel's arithmetic), per row
// (descale_per_token, read at the cursor's descale row) or per (b, hk).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <type_traits>

#include "common/decode_params.h"
#include "common/fp8.h"
#include "common/policy.h"
#include "common/split_merge.h"
#include "cuda/convert.cuh"
#include "decode/cuda/kernel_common.cuh"

namespace attn {
namespace decode_cuda {

constexpr int kThreads = 128;
// packed query rows per pass over the keys: 8 (GQA 8 x Sq 1), or 4 when the call has <= 4 rows
// (MHA, GQA <= 4): half the row registers (~250 -> ~150), so more CTAs fit per SM
constexpr int kMaxRows = 8;
constexpr int kUnroll = 2;   // keys in flight per group

template <typename E, int kD>
struct Traits {
  // elements per vector load: 16 bytes, 8 for 8-bit caches
  static constexpr int kVec = sizeof(E) == 1 ? 8 : 16 / int(sizeof(E));
  static constexpr int kVecs = kD / kVec;                      // vectors per key row
  static constexpr int kTPR = kVecs < 32 ? kVecs : 32;         // lanes per key
  static constexpr int kVPT = kVecs / kTPR;                    // vectors per lane
  static constexpr int kEPT = kVPT * kVec;                     // elements per lane
  static constexpr int kGroups = kThreads / kTPR;              // keys read side by side
  static_assert(kD % kVec == 0 && kVecs % kTPR == 0, "a key row splits evenly over its lanes");
  static_assert(32 % kTPR == 0, "a key's lanes stay inside one warp (xor-shuffle reduction)");
  static_assert(kGroups * kMaxRows * kD * 4 <= 32 * 1024, "the CTA merge buffer fits 32 KB of static smem");
};

// Elements [c0, c0 + kVec) of a row as raw bits (zeros past d; 8-bit elements in x and y).
template <typename E>
__device__ __forceinline__ uint4 load_vec(const E* row, int c0, int d, bool vec_ok) {
  constexpr int kVec = Traits<E, 64>::kVec;
  if constexpr (sizeof(E) == 1) {
    if (vec_ok && c0 + kVec <= d) {
      const uint2 h = *reinterpret_cast<const uint2*>(row + c0);
      return make_uint4(h.x, h.y, 0u, 0u);
    }
  } else {
    if (vec_ok && c0 + kVec <= d) return *reinterpret_cast<const uint4*>(row + c0);
  }
  uint4 u = make_uint4(0u, 0u, 0u, 0u);
  char* dst = reinterpret_cast<char*>(&u);
#pragma unroll
  for (int t = 0; t < kVec; ++t) {
    if (c0 + t < d) memcpy(dst + t * sizeof(E), row + c0 + t, sizeof(E));
  }
  return u;
}

// The kVec elements of a raw vector as floats.
template <typename E>
__device__ __forceinline__ void cvt_vec(const uint4& u, float* f) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
  if constexpr (std::is_same_v<E, int8_t>) {
#pragma unroll
    for (int t = 0; t < 8; ++t) f[t] = float(int8_t(uint8_t(w[t / 4] >> (8 * (t % 4)))));
  } else if constexpr (std::is_same_v<E, uint8_t>) {  // fp8 e4m3 bits
#pragma unroll
    for (int t = 0; t < 8; ++t) f[t] = e4m3_to_float((w[t / 4] >> (8 * (t % 4))) & 0xffu);
  } else if constexpr (sizeof(E) == 4) {
#pragma unroll
    for (int t = 0; t < 4; ++t) f[t] = __uint_as_float(w[t]);
  } else if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    // bf16 is the top half of a float32
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      f[2 * t] = __uint_as_float(w[t] << 16);
      f[2 * t + 1] = __uint_as_float(w[t] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      __half lo, hi;
      const uint16_t blo = uint16_t(w[t] & 0xffffu), bhi = uint16_t(w[t] >> 16);
      memcpy(&lo, &blo, 2);
      memcpy(&hi, &bhi, 2);
      f[2 * t] = to_float(lo);
      f[2 * t + 1] = to_float(hi);
    }
  }
}

// __launch_bounds__ minimums of 1 (here) and 8 (combine_kernel) ask ptxas for the whole register
// budget they allow: without one it aimed lower (32 registers for the combine) and spilled.
// E: q and out; C: the cache's elements (E, or 8-bit: int8_t / uint8_t e4m3 bits).
template <typename E, typename C, int kD, int kRows>
__global__ void __launch_bounds__(kThreads, 1) decode_kernel(const DecodeParams p, int splits, float* part_o,
                                                          float* part_lse, bool vec_ok) {
  using Tr = Traits<C, kD>;
  constexpr bool kQuant = sizeof(C) == 1;
  static_assert(kQuant || std::is_same_v<C, E>, "a cache of another type than q is an 8-bit one");
  static_assert(kRows >= 1 && kRows <= kMaxRows, "rows per pass");
  constexpr int kVec = Tr::kVec, kTPR = Tr::kTPR, kVPT = Tr::kVPT, kEPT = Tr::kEPT, kGroups = Tr::kGroups;
  // (kRows) policies of the rows' heads; the CTA merge of the groups' (m, l, O)
  __shared__ float4 pol_raw[(kRows * sizeof(PolicyT<float>) + 15) / 16];
  __shared__ float red_m[kGroups][kRows];
  __shared__ float red_l[kGroups][kRows];
  __shared__ float red_o[kGroups][kRows][kD];
  PolicyT<float>* pols = reinterpret_cast<PolicyT<float>*>(pol_raw);

  const int split = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, grp = tid / kTPR, lane = tid % kTPR;
  const int group = p.h / p.h_k, rows = group * p.sq, d = p.d;
  const SeqInfo si = decode_seq_info(p, b);
  const KvRows kv(p, b, hk);
  int a, e;
  split_range(p, si, b, hk * group, split, splits, kGroups * kUnroll, &a, &e);
  const C* kbase = static_cast<const C*>(p.k);
  const C* vbase = static_cast<const C*>(p.v);
  const E* qbase = static_cast<const E*>(p.q);
  // 8-bit: the descales of (b, hk) when one serves the whole sequence
  const bool per_token = kQuant && p.descale_per_token;
  const float ks_seq = kQuant && !per_token ? p.k_descale[int64_t(b) * p.h_k + hk] : 1.f;
  const float vs_seq = kQuant && !per_token ? p.v_descale[int64_t(b) * p.h_k + hk] : 1.f;
  constexpr float kNegInf = -INFINITY;

  for (int r0 = 0; r0 < rows; r0 += kRows) {
    const int nr = imin(kRows, rows - r0);
    __syncthreads();  // the previous block's readers of pols / red_* are done
    if (tid < nr) {
      const int r = r0 + tid;
      new (pols + tid) PolicyT<float>(p, si, b, hk * group + r / p.sq);
    }
    // (kRows, kEPT) this lane's slice of the rows' queries, raw (the policy scales)
    float q[kRows][kEPT];
    float acc[kRows][kEPT];
    float m[kRows], l[kRows];
#pragma unroll
    for (int rr = 0; rr < kRows; ++rr) {
      m[rr] = kNegInf;
      l[rr] = 0.f;
      const int r = r0 + imin(rr, nr - 1);  // rows past nr repeat the last (never stored)
      const int h = hk * group + r / p.sq, i = r % p.sq;
      const E* qrow = qbase + int64_t(b) * p.q_batch_stride + int64_t(h) * p.q_head_stride + int64_t(i) * p.q_row_stride;
#pragma unroll
      for (int u = 0; u < kVPT; ++u) {
        const int c0 = (lane + u * kTPR) * kVec;
        if constexpr (kQuant) {  // the cache's vector of elements, read from q element by element
#pragma unroll
          for (int t = 0; t < kVec; ++t) q[rr][u * kVec + t] = c0 + t < d ? to_float(qrow[c0 + t]) : 0.f;
        } else {
          cvt_vec<E>(load_vec(qrow, c0, d, false), &q[rr][u * kVec]);
        }
#pragma unroll
        for (int t = 0; t < kVec; ++t) acc[rr][u * kVec + t] = 0.f;
      }
    }
    __syncthreads();  // pols written
    // every (row, key) of the split inside the window: skip the per-element allowed() (decode
    // calls carry no bool mask, block layout or top-k; the check keeps that explicit)
    const bool full = pols[0].tile_full(0, p.sq, a, e) && pols[0].bias_kind == BiasKind::kNone &&
                      pols[0].layout == nullptr && pols[0].topk_thr == nullptr;

    // built at the group's first key (a key past the end has no page to look up)
    KvCursor cur;
    int cur_j = -1;
    for (int j0 = a; j0 < e; j0 += kGroups * kUnroll) {
      // (kUnroll, kVPT) raw K and V vectors of this group's keys j0 + grp + u * kGroups
      uint4 kr[kUnroll][kVPT], vr[kUnroll][kVPT];
      bool valid[kUnroll];
      float ksc[kUnroll], vsc[kUnroll];  // 8-bit: the keys' descales
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = j0 + grp + u * kGroups;
        valid[u] = j < e;
        ksc[u] = ks_seq;
        vsc[u] = vs_seq;
        if (valid[u]) {
          if (cur_j < 0) {
            cur.start(kv, j);
          } else if (j != cur_j) {
            cur.advance(kv, j - cur_j);
          }
          cur_j = j;
          if (per_token) {
            ksc[u] = p.k_descale[cur.sr * p.h_k + hk];
            vsc[u] = p.v_descale[cur.sr * p.h_k + hk];
          }
#pragma unroll
          for (int w = 0; w < kVPT; ++w) {
            const int c0 = (lane + w * kTPR) * kVec;
            kr[u][w] = load_vec(kbase + cur.ko, c0, d, vec_ok);
            vr[u][w] = load_vec(vbase + cur.vo, c0, d, vec_ok);
          }
        } else {
#pragma unroll
          for (int w = 0; w < kVPT; ++w) kr[u][w] = vr[u][w] = make_uint4(0u, 0u, 0u, 0u);
        }
      }
      // (kUnroll, kEPT) the keys' V as floats; (kRows, kUnroll) their logits (-inf: not seen)
      float vf[kUnroll][kEPT];
      float sc[kRows][kUnroll];
      // bit u of seen[rr]: row rr sees key u. P V skips the keys a row does not see, so a NaN /
      // inf value there (a key the causal diagonal or the window hides from this row but not
      // from the block's other rows) adds nothing, not 0 x NaN (the NaN policy, README)
      uint32_t seen[kRows];
#pragma unroll
      for (int rr = 0; rr < kRows; ++rr) seen[rr] = 0u;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = j0 + grp + u * kGroups;
        float kf[kEPT];
#pragma unroll
        for (int w = 0; w < kVPT; ++w) {
          cvt_vec<C>(kr[u][w], &kf[w * kVec]);
          cvt_vec<C>(vr[u][w], &vf[u][w * kVec]);
        }
#pragma unroll
        for (int rr = 0; rr < kRows; ++rr) {
          float x = 0.f;
#pragma unroll
          for (int t = 0; t < kEPT; ++t) x = fmaf(q[rr][t], kf[t], x);
          // every lane of the warp shuffles (groups of one warp may differ in `valid`)
#pragma unroll
          for (int off = kTPR / 2; off >= 1; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off, 32);
          if constexpr (kQuant) x *= ksc[u];
          float s = kNegInf;
          if (valid[u] && rr < nr) {
            const PolicyT<float>& pol = pols[rr];
            const int i = (r0 + rr) % p.sq;
            if (full || pol.allowed(i, j)) {
              s = pol.score(x, i, j);
              seen[rr] |= 1u << u;
            }
          }
          sc[rr][u] = s;
        }
      }
      // one online-softmax step per row for the kUnroll keys: one rescale of O, none at all
      // when the row's max stays (the common case once a few keys have gone by)
#pragma unroll
      for (int rr = 0; rr < kRows; ++rr) {
        if (rr >= nr) break;
        float mx = m[rr];
        bool nan = false;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          mx = fmaxf(mx, sc[rr][u]);
          nan |= sc[rr][u] != sc[rr][u];
        }
        if (mx == kNegInf && !nan) continue;  // nothing seen yet (a NaN logit poisons the row, as on the CPU)
        const float corr = m[rr] == mx ? 1.f : (m[rr] == kNegInf ? 0.f : expf(m[rr] - mx));
        float pr[kUnroll];
        float psum = 0.f;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          pr[u] = sc[rr][u] == kNegInf ? 0.f : expf(sc[rr][u] - mx);
          psum += pr[u];
        }
        l[rr] = l[rr] * corr + psum;
        m[rr] = mx;
        if constexpr (kQuant) {  // V's descale weighs its probability in P V, not in the sum
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) pr[u] *= vsc[u];
        }
#pragma unroll
        for (int t = 0; t < kEPT; ++t) {
          float o = acc[rr][t] * corr;
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) o = (seen[rr] >> u & 1u) ? fmaf(pr[u], vf[u][t], o) : o;
          acc[rr][t] = o;
        }
      }
    }

    // merge the kGroups partials of each row: rescale to the CTA max, sum through shared memory
#pragma unroll
    for (int rr = 0; rr < kRows; ++rr) {
      if (lane == 0) red_m[grp][rr] = m[rr];
    }
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < kRows; ++rr) {
      float mx = kNegInf;
#pragma unroll
      for (int g = 0; g < kGroups; ++g) mx = fmaxf(mx, red_m[g][rr]);
      const float sc = m[rr] == kNegInf ? 0.f : expf(m[rr] - mx);
      if (lane == 0) red_l[grp][rr] = l[rr] * sc;
#pragma unroll
      for (int w = 0; w < kVPT; ++w) {
#pragma unroll
        for (int t = 0; t < kVec; ++t) red_o[grp][rr][(lane + w * kTPR) * kVec + t] = acc[rr][w * kVec + t] * sc;
      }
    }
    __syncthreads();
    for (int idx = tid; idx < nr * d; idx += kThreads) {
      const int rr = idx / d, c = idx % d;
      const int r = r0 + rr, h = hk * group + r / p.sq, i = r % p.sq;
      float mr = kNegInf, lr = 0.f, o = 0.f;
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        mr = fmaxf(mr, red_m[g][rr]);
        lr += red_l[g][rr];
        o += red_o[g][rr][c];
      }
      finish_elem<E>(p, splits, split, part_o, part_lse, b, h, i, c, mr, lr, o);
    }
  }
}

// out, lse of every (b, h, i) row from its splits' partials (common/split_merge.h, sinks
// included): one warp per row, kThreads / 32 rows per CTA.
template <typename E>
__global__ void __launch_bounds__(kThreads, 8) combine_kernel(const DecodeParams p, int splits, const float* part_o,
                                                           const float* part_lse) {
  const int64_t n_rows = int64_t(p.b) * p.h * p.sq;
  const int64_t row_id = int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row_id >= n_rows) return;
  const int i = int(row_id % p.sq), h = int((row_id / p.sq) % p.h), b = int(row_id / (int64_t(p.sq) * p.h));
  const float* ls = part_lse + row_id * splits;
  const bool has_sink = p.sinks != nullptr;
  const float lse = merge_split_lse<float>(ls, splits, 1, has_sink, has_sink ? p.sinks[h] : 0.f);
  E* orow = static_cast<E*>(p.o) + int64_t(b) * p.o_batch_stride + int64_t(h) * p.o_head_stride +
            int64_t(i) * p.o_row_stride;
  for (int c = lane; c < p.d; c += 32) {
    float o = 0.f;
    for (int s = 0; s < splits; ++s) {
      const float w = split_weight(ls[s], lse);
      if (w != 0.f) o = fmaf(w, part_o[(row_id * splits + s) * p.d + c], o);
    }
    orow[c] = from_float<E>(o);
  }
  if (lane == 0) p.lse[int64_t(b) * p.lse_batch_stride + int64_t(h) * p.lse_head_stride + i] = lse;
}

}  // namespace decode_cuda
}  // namespace attn
