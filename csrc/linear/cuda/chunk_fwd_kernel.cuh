// The chunk-state forward of the tensor-core linear attention (fp16 / bf16, M <= 128): the
// schedule of flash-linear-attention's chunked kernels and of the GLA paper, in two kernels.
//
//   chunk_state_kernel  grid (value tiles, H, B): one CTA walks a sequence's chunks with its
//                       (kM, kN) slab of the state in mma accumulators (fp32 registers, never in
//                       shared memory), and stores the state entering every chunk, rounded to the
//                       input's 16-bit type, to the scratch (ChunkPlan). Per chunk the only work
//                       on the sequential path is one product, S <- e^{gC} S + (wk K~)^T V, whose
//                       operands were copied by cp.async one chunk ahead.
//   chunk_out_kernel    grid (value tiles x chunks, H, B): every chunk at once, from its entering
//                       state: O' = e^{g_i} Q~ S_c + mask(Q~ K~^T, e^{g_i - g_j}) V, the
//                       products of mma_fwd_kernel.cuh with no state update.
//
// Against the segment kernels of mma_fwd_kernel.cuh, which run both the update and the outputs
// per chunk on a slab in shared memory (a 16-bit copy of it refreshed per chunk, a transposed
// copy of K~ stored element by element, scalar loops for the normalizer), every per-element
// transform here happens in the fragments: the feature map, the key mask and the decay weights
// are applied to the ldmatrix results, and A = K~^T is read from K's row-major tile by
// ldmatrix.trans. The normalizer column rides as one extra n-tile whose B fragment is a column of
// ones (z = K~^T w), so z costs no loop either.
//
// The stored states are (kM, kN) 16-bit tiles per (sequence, head, slot, value tile): the same
// rounding as the segment kernels' 16-bit copy, with fp16's power-of-2 scale sigma (mma_common.h)
// stored beside each tile. A final slot per sequence holds the final state (the non-causal
// outputs' state).
//
// The row scalars (load_row_scalars' g, ep, wq, wk, kmul) come from a segmented scan in two
// warps' registers (shuffles, one barrier), not from one thread's loop over the chunk: on the
// state kernel's sequential path a 64-step loop per chunk would cost more than the product.
//
// Needs 16-byte rows (M, Dv, every stride a multiple of 8 elements, 16-byte aligned bases):
// dispatch.cu routes other calls to the segment kernels. The state slots of a varlen pack are
// laid out by position in the pack (ChunkPlan), so a sequence longer than max_seqlen (unchecked
// on CUDA: the offsets live on the device) is still computed whole.
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

// The chunk-state forward's scratch (dispatch.cu carves it). Per head, the chunk slots then one
// final-state slot per sequence; sequence b's chunk c is slot base_b + c, base_b = b nt for a
// batch, and floor(row0_b / kChunk) + b for a varlen pack (total / kChunk + nb chunk slots hold
// every sequence whatever max_seqlen says: sum over b' < b of ceil(len / kChunk) <= that base).
struct ChunkPlan {
  int nt = 1;              // chunks per sequence of the output grid: ceil(max_seqlen / kChunk)
  int tiles = 1;           // value tiles of kN columns
  int64_t chunk_slots = 0;  // chunk slots per head; then nb final slots
  void* h = nullptr;       // (H, chunk_slots + nb, tiles, kM, kN) T: S / sigma
  float* z = nullptr;      // (H, chunk_slots + nb, kM): the normalizer state (normalize only)
  float* sigma = nullptr;  // (H, chunk_slots + nb, tiles)
  // the backward only (null in the forward): per row of q (den's indexing) 1 / den and dn =
  // -(dout . out) / den (chunk_prep_kernel), and the dG scratch the state walk adds <dS_T, S_T> to
  const float* inv = nullptr;
  const float* dn = nullptr;
  float* dg = nullptr;
  __device__ int64_t slot(const Params& p, const linear_simt::Seq& s, int b, int h, int c) const {
    const int64_t base = p.cu_seqlens != nullptr ? s.row0 / kChunk + b : int64_t(b) * nt;
    return int64_t(h) * (chunk_slots + p.b) + base + c;
  }
  __device__ int64_t final_slot(const Params& p, int b, int h) const {
    return int64_t(h) * (chunk_slots + p.b) + chunk_slots + b;
  }
};

// The chunk's row scalars (load_row_scalars' meaning) and the scan's partial results.
struct ChunkScalars {
  float g[kChunk], ep[kChunk], wq[kChunk], wk[kChunk], kmul[kChunk];
  float inv[kChunk], dn[kChunk];  // the backward's 1 / den and dn (1 and 0 without normalize)
};
struct ScanPart {
  float s[kChunk], c[kChunk];
  int f[kChunk];
  float tot_s, tot_c;
};

// Row tid's raw inputs of the chunk at r0 (threads tid < kChunk): its log-gate (0 without decay
// or past n), whether it is a real key, and (the backward) its 1 / den and dn.
struct RowIn {
  float gate = 0.f, inv = 1.f, dn = 0.f;
  bool real = false;
};
__device__ __forceinline__ RowIn row_inputs(const Params& p, const ChunkPlan& plan, const linear_simt::Seq& s, int h,
                                            int r0, int n, int tid) {
  RowIn in;
  if (tid < kChunk && tid < n) {
    const int64_t row = s.row(p, p.h, h, r0 + tid);
    if (p.decay != nullptr) in.gate = p.decay[row];
    in.real = p.key_mask == nullptr || p.key_mask[int64_t(s.bt) * p.key_mask_batch_stride + s.row0 + r0 + tid] != 0;
    if (plan.inv != nullptr) {
      in.inv = plan.inv[row];
      in.dn = plan.dn[row];
    }
  }
  return in;
}

// The chunk's scalars into *out from each row's (gate, real) held by threads tid < kChunk (two
// whole warps). The running sum with resets is a segmented scan: element i is (reset_i, d_i)
// with d_i = 0 on a reset row, and (a o b) = (a.f | b.f, b.f ? b.s : a.s + b.s); a butterfly
// of xor shuffles gives each lane its inclusive prefix within the warp, the second warp adds the
// first's total. Every thread calls it; two barriers inside, so that every field is visible on
// return and the partials may be written by the next call.
__device__ __forceinline__ void chunk_scalars(const Params& p, int n, const RowIn& in, ChunkScalars* out,
                                              ScanPart* part, int tid) {
  static_assert(kChunk == 64, "two warps scan a chunk");
  const float gate = in.gate;
  if (tid < kChunk) {
    const int lane = tid % 32;
    const bool reset = tid < n && p.decay != nullptr && gate <= linear_simt::kResetGate;
    float ps = reset ? 0.f : gate, pc = reset ? 1.f : 0.f;
    int pf = reset ? 1 : 0;
    float ts = ps, tc = pc;
    int tf = pf;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float os = __shfl_xor_sync(0xffffffffu, ts, o), oc = __shfl_xor_sync(0xffffffffu, tc, o);
      const int of = __shfl_xor_sync(0xffffffffu, tf, o);
      if (lane & o) {  // the partner's block precedes this lane's
        ps = pf ? ps : os + ps;
        pf |= of;
        pc += oc;
        ts = tf ? ts : os + ts;
      } else {
        ts = of ? os : ts + os;
      }
      tf |= of;
      tc += oc;
    }
    part->s[tid] = ps;
    part->f[tid] = pf;
    part->c[tid] = pc;
    if (tid == 0) {
      part->tot_s = ts;
      part->tot_c = tc;
    }
    out->kmul[tid] = in.real ? 1.f : 0.f;
    out->inv[tid] = tid < n ? in.inv : 0.f;
    out->dn[tid] = tid < n ? in.dn : 0.f;
  }
  __syncthreads();
  if (tid < kChunk) {
    // row i's inclusive prefix: the second warp's rows add the first warp's total
    auto fin_g = [&](int i) { return part->s[i] + (i >= 32 && !part->f[i] ? part->tot_s : 0.f); };
    auto fin_e = [&](int i) { return part->c[i] + (i >= 32 ? part->tot_c : 0.f); };
    const float gi = fin_g(tid), ei = fin_e(tid), gc = fin_g(n - 1), ec = fin_e(n - 1);
    const bool live = tid < n;
    out->g[tid] = live ? gi : 0.f;
    out->ep[tid] = live ? ei : 0.f;
    out->wq[tid] = live && ei == 0.f ? expf(gi) : 0.f;
    out->wk[tid] = live && ei == ec ? expf(gc - gi) : 0.f;
  }
  __syncthreads();
}

// x -> phi(x) * w for the two elements of a packed 16-bit pair (w 0: 0, whatever x is)
template <typename T>
__device__ __forceinline__ uint32_t feature_pair(uint32_t u, FeatureMap fm, float w0, float w1) {
  using Ops = tc::TypeOps<T>;
  const float2 x = Ops::unpack(u);
  const float a = w0 != 0.f ? linear_simt::feature(fm, x.x) * w0 : 0.f;
  const float b = w1 != 0.f ? linear_simt::feature(fm, x.y) * w1 : 0.f;
  return Ops::pack(a, b);
}

// Rows [0, n) (and, with kmul, only real keys) x columns [0, ncols) of a (kChunk, kCols) row
// tile into the swizzled tile at dst by cp.async; the rest zero-filled, not read.
template <int kCols, typename T>
__device__ __forceinline__ void copy_rows(uint32_t dst, const T* src, int64_t rs, int n, int ncols, const float* kmul,
                                          int tid) {
  using Tile = tc::SmemTile<kChunk, kCols>;
  constexpr int kVecs = kChunk * kCols / 8;
  static_assert(kVecs % kThreads == 0, "whole vectors per thread");
#pragma unroll
  for (int j = 0; j < kVecs / kThreads; ++j) {
    const int idx = tid + j * kThreads, r = idx / (kCols / 8), c = idx % (kCols / 8) * 8;
    const bool ok = r < n && c < ncols && (kmul == nullptr || kmul[r] != 0.f);
    tc::cp_async16(dst + Tile::offset(r, c), ok ? src + int64_t(r) * rs + c : src, ok);
  }
}

// fp16: the power of 2 that keeps |S / sigma| <= 2^14 over the CTA's slab (block-wide max; every
// thread calls it); bf16: 1.
template <typename T, int kMT>
__device__ __forceinline__ float slab_sigma(const float (&acc)[kMT][kN / 8][4], float* red) {
  if constexpr (std::is_same_v<T, __half>) {
    float mx = 0.f;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int t = 0; t < kN / 8; ++t)
#pragma unroll
        for (int x = 0; x < 4; ++x) mx = fmaxf(mx, fabsf(acc[mt][t][x]));
    return fp16_sigma(mx, red);
  } else {
    return 1.f;
  }
}

// The state kernel's pipeline: chunk c + kStages - 1's operands are copied while chunk c's product
// runs, so that a chunk's copy has kStages - 1 products' time to arrive (one product, about half a
// microsecond of tensor-core time per CTA, is less than a loaded HBM round trip).
constexpr int kStages = 3;

template <int kM>
struct StateSmem {
  static_assert(kM == 64 || kM == 128, "feature-width buckets");
  using KTile = tc::SmemTile<kChunk, kM>;
  using VTile = tc::SmemTile<kChunk, kN>;
  static constexpr int kBuf = KTile::kBytes + VTile::kBytes;  // one chunk's K~ then V
  static constexpr int kScal = kStages * kBuf;                 // ChunkScalars, one per stage like K and V
  static constexpr int kPart = kScal + kStages * int(sizeof(ChunkScalars));
  static constexpr int kRed = kPart + int(sizeof(ScanPart));
  static constexpr int kBytes = kRed + kWarps * 4;
};

// The A fragment of K~^T rows [m0, m0 + 16) x chunk rows [j0, j0 + 16) from K's row-major
// (kChunk, kM) tile: ldmatrix.trans of the four 8x8 blocks K[j0 + 8 (l / 16) ..][m0 + 8 ((l / 8) % 2) ..].
template <typename KTile>
__device__ __forceinline__ uint32_t lane_kt(int m0, int j0, int lane) {
  return KTile::offset(j0 + (lane & 7) + ((lane >> 4) << 3), m0 + (((lane >> 3) & 1) << 3));
}

// The state walk of one CTA (value tile, head, sequence), both directions:
//   forward (kReverse false): S from the initial state, ascending; per chunk S <- e^{gC} S +
//     (w K~)^T V with w = wk * kmul, z <- e^{gC} z + (w K~)^T 1; slot c gets S entering chunk c;
//     the final state to p.final_state; in the backward (plan.dg), dG_T += <dS_T, S_T>.
//   reverse (kReverse, the backward's dS): D from dS_T, descending; per chunk D <- e^{gC} D +
//     (wq Q~)^T dO' with dO' = dout / den, Dz <- e^{gC} Dz + (wq Q~)^T dn; slot c gets D at chunk
//     c's end; D_0 to p.dinit_state.
// X is the (kChunk, kM) feature operand (K or q), Y the (kChunk, kN) value one (V or dout).
// Non-causal: no decay, the slots unused; the final slot gets the state past the last chunk.
template <typename T, int kM, bool kReverse, typename P>
__device__ __forceinline__ void state_walk(const P& p, const ChunkPlan& plan) {
  using L = StateSmem<kM>;
  using Ops = tc::TypeOps<T>;
  constexpr int kMT = kM / 64;  // m-tiles of 16 state rows per warp: a warp owns kM / 4 rows
  const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / (p.h / p.h_k);
  const int tid = threadIdx.x, warp = tid / 32;
  int lane = tid % 32;  // opaque() per chunk (mma_common.cuh)
  const int c0 = tile * kN, nv = min(kN, p.dim_v - c0);
  const linear_simt::Seq s(p, b);
  ATTN_EXTERN_SMEM(smem);
  const uint32_t sbase = tc::smem_u32(smem);
  ChunkScalars* scal = reinterpret_cast<ChunkScalars*>(smem + L::kScal);
  ScanPart* part = reinterpret_cast<ScanPart*>(smem + L::kPart);
  float* red = reinterpret_cast<float*>(smem + L::kRed);
  const T* xh;
  const T* yh;
  int64_t xs, ys;
  if constexpr (kReverse) {
    xh = static_cast<const T*>(p.q) + s.off(p.q_batch_stride, h, p.q_head_stride, 0, p.q_row_stride);
    yh = static_cast<const T*>(p.dout) + s.off(p.do_batch_stride, h, p.do_head_stride, 0, p.do_row_stride) + c0;
    xs = p.q_row_stride;
    ys = p.do_row_stride;
  } else {
    xh = static_cast<const T*>(p.k) + s.off(p.k_batch_stride, hk, p.k_head_stride, 0, p.k_row_stride);
    yh = static_cast<const T*>(p.v) + s.off(p.v_batch_stride, hk, p.v_head_stride, 0, p.v_row_stride) + c0;
    xs = p.k_row_stride;
    ys = p.v_row_stride;
  }
  const int nch = (s.len + kChunk - 1) / kChunk;
  const bool with_z = p.normalize && tile == 0;
  const bool decay = p.causal && p.decay != nullptr;
  // forward, identity features, no decay, no mask: every weight is 1, rows past n zero-filled
  const bool plain = !kReverse && p.feature_map == FeatureMap::kIdentity && p.decay == nullptr && p.key_mask == nullptr;
  const int mrow0 = warp * (kM / 4);

  // the slab in accumulators: element x of n-tile t of m-tile mt is (acc_row, acc_col)
  float acc[kMT][kN / 8][4], accz[kMT][4];
  const float* init;
  if constexpr (kReverse) {
    init = state_at(p.dfinal_state, p, b, h);
  } else {
    init = state_at(p.init_state, p, b, h);
  }
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const int r = acc_row(mrow0 + 16 * mt, lane, x);
      const bool zcol = lane % 4 == 0 && (x & 1) == 0;  // column 0 of the z tile
      accz[mt][x] = init != nullptr && with_z && zcol && r < p.d ? init[int64_t(r) * p.dim_v_aug + p.dim_v] : 0.f;
#pragma unroll
      for (int t = 0; t < kN / 8; ++t) {
        const int cc = acc_col(t, lane, x);
        acc[mt][t][x] = init != nullptr && r < p.d && cc < nv ? init[int64_t(r) * p.dim_v_aug + c0 + cc] : 0.f;
      }
    }
  }

  // the slab (scaled to 16 bits) into a slot: chunk c's (see above), or (c < 0) the final one
  auto store_slot = [&](int c) {
    const float sigma = slab_sigma<T, kMT>(acc, red), inv = 1.f / sigma;
    const int64_t slot = c >= 0 ? plan.slot(p, s, b, h, c) : plan.final_slot(p, b, h);
    T* hs = static_cast<T*>(plan.h) + (slot * plan.tiles + tile) * (kM * kN);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = acc_row(mrow0 + 16 * mt, lane, 2 * half);
#pragma unroll
        for (int t = 0; t < kN / 8; ++t) {
          const int cc = acc_col(t, lane, 0);
          *reinterpret_cast<uint32_t*>(hs + r * kN + cc) =
              Ops::pack(acc[mt][t][2 * half] * inv, acc[mt][t][2 * half + 1] * inv);
        }
        if (with_z && lane % 4 == 0) plan.z[slot * kM + r] = accz[mt][2 * half];
      }
    }
    if (tid == 0) plan.sigma[slot * plan.tiles + tile] = sigma;
  };

  // chunk c's operands into stage buf: X rows [0, n) (K: real keys only), Y's likewise
  auto issue = [&](int c, int buf) {
    const int r0 = c * kChunk, n = min(kChunk, s.len - r0);
    const uint32_t xb = sbase + buf * L::kBuf;
    const float* kmul = kReverse ? nullptr : scal[buf].kmul;
    copy_rows<kM>(xb, xh + int64_t(r0) * xs, xs, n, p.d, kmul, tid);
    copy_rows<kN>(xb + L::KTile::kBytes, yh + int64_t(r0) * ys, ys, n, nv, kmul, tid);
  };

  // the walk's i-th chunk (descending in reverse)
  auto chunk_at = [&](int i) { return kReverse ? nch - 1 - i : i; };
  auto chunk_rows = [&](int c) { return min(kChunk, s.len - c * kChunk); };
  // prologue: the first kStages - 1 chunks' scalars and operands, the next chunk's row inputs
  constexpr int kAhead = kStages - 1;
  RowIn in;
  if (nch > 0) in = row_inputs(p, plan, s, h, chunk_at(0) * kChunk, chunk_rows(chunk_at(0)), tid);
#pragma unroll 1
  for (int i = 0; i < kAhead; ++i) {
    if (i < nch) {
      const int c = chunk_at(i);
      chunk_scalars(p, chunk_rows(c), in, &scal[i], part, tid);
      issue(c, i);
      if (i + 1 < nch) in = row_inputs(p, plan, s, h, chunk_at(i + 1) * kChunk, chunk_rows(chunk_at(i + 1)), tid);
    }
    tc::cp_async_commit();
  }

#pragma unroll 1
  for (int i = 0; i < nch; ++i) {
    const int c = chunk_at(i), n = chunk_rows(c), buf = i % kStages;
    lane = opaque(lane);
    if (i + kAhead < nch) {  // walk step i + kAhead's scalars and operands, the next one's row inputs
      const int ia = i + kAhead, ca = chunk_at(ia);
      chunk_scalars(p, chunk_rows(ca), in, &scal[ia % kStages], part, tid);
      issue(ca, ia % kStages);
      if (ia + 1 < nch) in = row_inputs(p, plan, s, h, chunk_at(ia + 1) * kChunk, chunk_rows(chunk_at(ia + 1)), tid);
    }
    tc::cp_async_commit();
    if (p.causal) store_slot(c);
    tc::cp_async_wait<kAhead>();
    __syncthreads();  // the chunk's X and Y are in

    const ChunkScalars& sc = scal[buf];
    if (decay) {
      const float egc = sc.wq[n - 1];  // e^{G_C}, 0 once a reset is in
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          accz[mt][x] *= egc;
#pragma unroll
          for (int t = 0; t < kN / 8; ++t) acc[mt][t][x] *= egc;
        }
    }
    // acc += (w X~)^T Y', accz += (w X~)^T z' with z' = 1 (forward) or dn (reverse)
    const uint32_t xb = sbase + buf * L::kBuf, yb = xb + L::KTile::kBytes;
    const uint32_t yo = L::VTile::lane_bt(0, lane);
#pragma unroll
    for (int kk = 0; kk < kChunk / 16; ++kk) {
      const int j = kk * 16 + 2 * (lane % 4);  // a[0], a[1]: chunk rows j, j + 1; a[2], a[3]: j + 8, j + 9
      uint32_t a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        tc::ldmatrix_x4_trans(a[mt], xb + lane_kt<typename L::KTile>(mrow0 + 16 * mt, kk * 16, lane));
        if (!plain) {
          // a[0], a[2]: feature row f, a[1], a[3]: f + 8 (0 past M: phi(0) is 1 for elu)
          const int f = mrow0 + 16 * mt + lane / 4;
          const float in0 = f < p.d ? 1.f : 0.f, in8 = f + 8 < p.d ? 1.f : 0.f;
          float w0, w1, w8, w9;
          if constexpr (kReverse) {  // wq Q~ = wq * scale * phi(q); wq is 0 past n (and 1 without decay)
            w0 = sc.wq[j] * p.scale, w1 = sc.wq[j + 1] * p.scale, w8 = sc.wq[j + 8] * p.scale, w9 = sc.wq[j + 9] * p.scale;
          } else {  // wk K~ = wk * kmul * phi(k)
            w0 = sc.wk[j] * sc.kmul[j], w1 = sc.wk[j + 1] * sc.kmul[j + 1];
            w8 = sc.wk[j + 8] * sc.kmul[j + 8], w9 = sc.wk[j + 9] * sc.kmul[j + 9];
          }
          a[mt][0] = feature_pair<T>(a[mt][0], p.feature_map, w0 * in0, w1 * in0);
          a[mt][1] = feature_pair<T>(a[mt][1], p.feature_map, w0 * in8, w1 * in8);
          a[mt][2] = feature_pair<T>(a[mt][2], p.feature_map, w8 * in0, w9 * in0);
          a[mt][3] = feature_pair<T>(a[mt][3], p.feature_map, w8 * in8, w9 * in8);
        }
      }
#pragma unroll
      for (int np = 0; np < kN / 16; ++np) {
        uint32_t bf[4];
        tc::ldmatrix_x4_trans(bf, yb + L::VTile::advance(yo, kk * 16, np * 16));
        if constexpr (kReverse) {  // dO' = dout / den: b[0], b[2] rows j, j + 1; b[1], b[3] rows j + 8, j + 9
          const float i0 = sc.inv[j], i1 = sc.inv[j + 1], i8 = sc.inv[j + 8], i9 = sc.inv[j + 9];
          bf[0] = feature_pair<T>(bf[0], FeatureMap::kIdentity, i0, i1);
          bf[2] = feature_pair<T>(bf[2], FeatureMap::kIdentity, i0, i1);
          bf[1] = feature_pair<T>(bf[1], FeatureMap::kIdentity, i8, i9);
          bf[3] = feature_pair<T>(bf[3], FeatureMap::kIdentity, i8, i9);
        }
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) tc::mma_n16<T>(acc[mt][2 * np], a[mt], bf);
      }
      if (with_z) {
        // the z column's B fragment (n = 0: lanes 0-3): 1 in the forward, dn in reverse
        uint32_t bz[2] = {0u, 0u};
        if (lane / 4 == 0) {
          if constexpr (kReverse) {
            bz[0] = Ops::pack(sc.dn[j], sc.dn[j + 1]);
            bz[1] = Ops::pack(sc.dn[j + 8], sc.dn[j + 9]);
          } else {
            bz[0] = bz[1] = Ops::pack(1.f, 1.f);
          }
        }
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) Ops::mma(accz[mt], a[mt], bz);
        if constexpr (kReverse) {
          // dn's rounding residual as a second product: dn stays fp32-exact to the 16-bit
          // operand's precision squared, as the segment kernels' fp32 Dz loop has it
          uint32_t lo[2] = {0u, 0u};
          if (lane / 4 == 0) {
            const float2 h0 = Ops::unpack(bz[0]), h1 = Ops::unpack(bz[1]);
            lo[0] = Ops::pack(sc.dn[j] - h0.x, sc.dn[j + 1] - h0.y);
            lo[1] = Ops::pack(sc.dn[j + 8] - h1.x, sc.dn[j + 9] - h1.y);
          }
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) Ops::mma(accz[mt], a[mt], lo);
        }
      }
    }
    __syncthreads();  // stage `buf` and scal[buf] are free for walk step i + kStages
  }

  if (!p.causal) store_slot(-1);  // the state every non-causal output (or gradient) reads
  // the slab past the last chunk: to the final state (reverse: dinitial_state), and in the
  // backward's forward walk dG_T += <dS_T, S_T> (this tile's columns; tile 0 the normalizer)
  float* fin;
  const float* dfin = nullptr;
  if constexpr (kReverse) {
    fin = state_at(p.dinit_state, p, b, h);
  } else {
    fin = state_at(p.final_state, p, b, h);
    if constexpr (std::is_same_v<P, BwdParams>) {
      if (plan.dg != nullptr && s.len > 0) dfin = state_at(p.dfinal_state, p, b, h);
    }
  }
  float dot = 0.f;
  if (fin != nullptr || dfin != nullptr) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const int r = acc_row(mrow0 + 16 * mt, lane, x);
        if (r >= p.d) continue;
        const int64_t row = int64_t(r) * p.dim_v_aug;
#pragma unroll
        for (int t = 0; t < kN / 8; ++t) {
          const int cc = acc_col(t, lane, x);
          if (cc >= nv) continue;
          if (fin != nullptr) fin[row + c0 + cc] = acc[mt][t][x];
          if (dfin != nullptr) dot += acc[mt][t][x] * dfin[row + c0 + cc];
        }
        if (with_z && lane % 4 == 0 && (x & 1) == 0) {
          if (fin != nullptr) fin[row + p.dim_v] = accz[mt][x];
          if (dfin != nullptr) dot += accz[mt][x] * dfin[row + p.dim_v];
        }
      }
    }
  }
  if (dfin != nullptr) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    if (lane == 0) atomicAdd(plan.dg + s.row(p, p.h, h, s.len - 1), dot);
  }
}

// The forward's state walk (and the backward's recomputation of it: plan.dg set, p a
// LinearBwdParamsT). grid (value tiles, H, B), kThreads threads, StateSmem<kM>::kBytes bytes.
template <typename T, int kM>
__global__ void __launch_bounds__(kThreads, 1) chunk_state_kernel(const Params p, const ChunkPlan plan) {
  state_walk<T, kM, false>(p, plan);
}
template <typename T, int kM>
__global__ void __launch_bounds__(kThreads, 1) chunk_state_bwd_kernel(const BwdParams p, const ChunkPlan plan) {
  state_walk<T, kM, false>(p, plan);
}
// The backward's reverse state walk (dS). Same grid and shared memory.
template <typename T, int kM>
__global__ void __launch_bounds__(kThreads, 1) chunk_rev_kernel(const BwdParams p, const ChunkPlan plan) {
  state_walk<T, kM, true>(p, plan);
}

template <int kM>
struct OutSmem {
  static_assert(kM == 64 || kM == 128, "feature-width buckets");
  using QTile = tc::SmemTile<kChunk, kM>;  // Q, K (kChunk, kM)
  using VTile = tc::SmemTile<kChunk, kN>;
  using HTile = tc::SmemTile<kM, kN>;      // the entering state (kM, kN)
  static constexpr int kQ = 0, kK = kQ + QTile::kBytes, kV = kK + QTile::kBytes, kH = kV + VTile::kBytes;
  static constexpr int kZ = kH + HTile::kBytes;  // fp32 z (kM)
  static constexpr int kScal = kZ + kM * 4;
  static constexpr int kPart = kScal + int(sizeof(ChunkScalars));
  static constexpr int kBytes = kPart + int(sizeof(ScanPart));
};

// grid (value tiles x plan.nt, H, B), kThreads threads, OutSmem<kM>::kBytes bytes.
template <typename T, int kM>
__global__ void __launch_bounds__(kThreads) chunk_out_kernel(const Params p, const ChunkPlan plan) {
  using L = OutSmem<kM>;
  using Ops = tc::TypeOps<T>;
  const int tile = int(blockIdx.x) % plan.tiles, c_first = int(blockIdx.x) / plan.tiles;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (p.h / p.h_k);
  const int tid = threadIdx.x, warp = tid / 32;
  int lane = tid % 32;  // opaque() per chunk
  const int c0 = tile * kN, nv = min(kN, p.dim_v - c0);
  const linear_simt::Seq s(p, b);
  ATTN_EXTERN_SMEM(smem);
  const uint32_t sbase = tc::smem_u32(smem);
  float* z = reinterpret_cast<float*>(smem + L::kZ);
  ChunkScalars* sc = reinterpret_cast<ChunkScalars*>(smem + L::kScal);
  ScanPart* part = reinterpret_cast<ScanPart*>(smem + L::kPart);
  // chunks c_first, c_first + nt, ...: one, unless a varlen sequence is longer than max_seqlen
  // (unchecked on CUDA); none for a shorter one
#pragma unroll 1
  for (int c = c_first; int64_t(c) * kChunk < s.len; c += plan.nt) {
  const int r0 = c * kChunk, n = min(kChunk, s.len - r0);
  lane = opaque(lane);
  const T* qh = static_cast<const T*>(p.q) + s.off(p.q_batch_stride, h, p.q_head_stride, r0, p.q_row_stride);
  const T* kh = static_cast<const T*>(p.k) + s.off(p.k_batch_stride, hk, p.k_head_stride, r0, p.k_row_stride);
  const T* vh = static_cast<const T*>(p.v) + s.off(p.v_batch_stride, hk, p.v_head_stride, r0, p.v_row_stride) + c0;
  T* oh = static_cast<T*>(p.o) + s.off(p.o_batch_stride, h, p.o_head_stride, r0, p.o_row_stride) + c0;
  const bool causal = p.causal, decay = p.decay != nullptr, masked = p.key_mask != nullptr;
  const int64_t slot = causal ? plan.slot(p, s, b, h, c) : plan.final_slot(p, b, h);

  // operands: Q, the state and z at once; K and V too unless a key mask decides which rows to read
  copy_rows<kM>(sbase + L::kQ, qh, p.q_row_stride, n, p.d, nullptr, tid);
  {
    const T* hs = static_cast<const T*>(plan.h) + (slot * plan.tiles + tile) * (kM * kN);
    constexpr int kVecs = kM * kN / 8;
#pragma unroll
    for (int j = 0; j < kVecs / kThreads; ++j) {
      const int idx = tid + j * kThreads, r = idx / (kN / 8), cc = idx % (kN / 8) * 8;
      tc::cp_async16(sbase + L::kH + L::HTile::offset(r, cc), hs + r * kN + cc, true);
    }
  }
  if (p.normalize) {
    for (int r = tid; r < kM; r += kThreads) z[r] = plan.z[slot * kM + r];
  }
  if (causal && !masked) {
    copy_rows<kM>(sbase + L::kK, kh, p.k_row_stride, n, p.d, nullptr, tid);
    copy_rows<kN>(sbase + L::kV, vh, p.v_row_stride, n, nv, nullptr, tid);
  }
  if (causal) {  // a non-causal output needs no row scalar: the state has the key mask
    const RowIn in = row_inputs(p, plan, s, h, r0, n, tid);
    chunk_scalars(p, n, in, sc, part, tid);
  }
  if (causal && masked) {
    copy_rows<kM>(sbase + L::kK, kh, p.k_row_stride, n, p.d, sc->kmul, tid);
    copy_rows<kN>(sbase + L::kV, vh, p.v_row_stride, n, nv, sc->kmul, tid);
  }
  tc::cp_async_commit();
  const float sigma = plan.sigma[slot * plan.tiles + tile];
  tc::cp_async_wait<0>();
  __syncthreads();

  // Q~ = scale * phi(q) for the warp's 16 rows, in A fragments, kept for both products
  const int row_a = 16 * warp, ra = row_a + lane / 4, rb = ra + 8;
  uint32_t qa[kM / 16][4];
  const uint32_t qo = L::QTile::lane_a(row_a, lane);
#pragma unroll
  for (int kk = 0; kk < kM / 16; ++kk) {
    tc::ldmatrix_x4(qa[kk], sbase + L::kQ + L::QTile::advance(qo, 0, kk * 16));
    // qa[0], qa[1]: features f, f + 1, qa[2], qa[3]: f + 8, f + 9; 0 past M (M % 8 == 0)
    const int f = kk * 16 + 2 * (lane % 4);
    const float w0 = f < p.d ? p.scale : 0.f, w8 = f + 8 < p.d ? p.scale : 0.f;
    qa[kk][0] = feature_pair<T>(qa[kk][0], p.feature_map, w0, w0);
    qa[kk][1] = feature_pair<T>(qa[kk][1], p.feature_map, w0, w0);
    qa[kk][2] = feature_pair<T>(qa[kk][2], p.feature_map, w8, w8);
    qa[kk][3] = feature_pair<T>(qa[kk][3], p.feature_map, w8, w8);
  }
  // Q~_i . z, from the rounded Q~ the products use: this lane's columns, then the quad's sum
  float qz_a = 0.f, qz_b = 0.f;
  if (p.normalize) {
#pragma unroll
    for (int kk = 0; kk < kM / 16; ++kk) {
      const int cl = kk * 16 + 2 * (lane % 4);
      const float2 x0 = Ops::unpack(qa[kk][0]), x1 = Ops::unpack(qa[kk][1]);
      const float2 x2 = Ops::unpack(qa[kk][2]), x3 = Ops::unpack(qa[kk][3]);
      qz_a += x0.x * z[cl] + x0.y * z[cl + 1] + x2.x * z[cl + 8] + x2.y * z[cl + 9];
      qz_b += x1.x * z[cl] + x1.y * z[cl + 1] + x3.x * z[cl + 8] + x3.y * z[cl + 9];
    }
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
      qz_a += __shfl_xor_sync(0xffffffffu, qz_a, o);
      qz_b += __shfl_xor_sync(0xffffffffu, qz_b, o);
    }
  }

  // O' = Q~ S_c, rows times e^{g_i} sigma
  float acc_o[kN / 8][4];
  zero(acc_o);
  {
    const uint32_t ho = L::HTile::lane_bt(0, lane);
#pragma unroll
    for (int kk = 0; kk < kM / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < kN / 16; ++np) {
        uint32_t bf[4];
        tc::ldmatrix_x4_trans(bf, sbase + L::kH + L::HTile::advance(ho, kk * 16, np * 16));
        tc::mma_n16<T>(acc_o[2 * np], qa[kk], bf);
      }
    }
  }
  const float ea = causal ? sc->wq[ra] : 1.f, eb = causal ? sc->wq[rb] : 1.f;
#pragma unroll
  for (int t = 0; t < kN / 8; ++t) {
    acc_o[t][0] *= ea * sigma;
    acc_o[t][1] *= ea * sigma;
    acc_o[t][2] *= eb * sigma;
    acc_o[t][3] *= eb * sigma;
  }
  float sum_a = 0.f, sum_b = 0.f;
  if (causal) {
    // A = Q~ K~^T over the chunk's keys; K~ = phi(k) * kmul in the B fragments
    float acc_s[kChunk / 8][4];
    zero(acc_s);
    const uint32_t ko = L::QTile::lane_b(0, lane);
    const bool fmap = p.feature_map != FeatureMap::kIdentity;
#pragma unroll
    for (int kk = 0; kk < kM / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < kChunk / 16; ++np) {
        uint32_t bf[4];
        tc::ldmatrix_x4(bf, sbase + L::kK + L::QTile::advance(ko, np * 16, kk * 16));
        if (fmap) {
          // b[0..1]: key np * 16 + lane / 4, b[2..3]: 8 keys later; b[0], b[2]: features f,
          // f + 1, b[1], b[3]: f + 8, f + 9 (0 past M: phi(0) is 1 for elu)
          const int f = kk * 16 + 2 * (lane % 4);
          const float m0 = sc->kmul[np * 16 + lane / 4], m1 = sc->kmul[np * 16 + 8 + lane / 4];
          const float in0 = f < p.d ? 1.f : 0.f, in8 = f + 8 < p.d ? 1.f : 0.f;
          bf[0] = feature_pair<T>(bf[0], p.feature_map, m0 * in0, m0 * in0);
          bf[1] = feature_pair<T>(bf[1], p.feature_map, m0 * in8, m0 * in8);
          bf[2] = feature_pair<T>(bf[2], p.feature_map, m1 * in0, m1 * in0);
          bf[3] = feature_pair<T>(bf[3], p.feature_map, m1 * in8, m1 * in8);
        }
        tc::mma_n16<T>(acc_s[2 * np], qa[kk], bf);
      }
    }
    // mask j <= i, weights e^{g_i - g_j}; the row sums feed den
#pragma unroll
    for (int t = 0; t < kChunk / 8; ++t) {
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const int i = x < 2 ? ra : rb, j = acc_col(t, lane, x);
        // rows past n are not stored, and their weights are not finite (g past n is 0)
        const bool keep = j <= i && i < n;
        float val = keep ? acc_s[t][x] : 0.f;
        if (decay && keep) val *= linear_simt::pair_weight(sc->g, sc->ep, i, j);
        acc_s[t][x] = val;
      }
      sum_a += acc_s[t][0] + acc_s[t][1];
      sum_b += acc_s[t][2] + acc_s[t][3];
    }
    mma_reg<T, typename L::VTile, kChunk, kN>(acc_o, acc_s, sbase + L::kV, lane);
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
      sum_a += __shfl_xor_sync(0xffffffffu, sum_a, o);
      sum_b += __shfl_xor_sync(0xffffffffu, sum_b, o);
    }
  }
  const float den_a = p.normalize ? sum_a + ea * qz_a + p.eps : 1.f;
  const float den_b = p.normalize ? sum_b + eb * qz_b + p.eps : 1.f;
  // one reciprocal per row, not an IEEE division per element (within an ulp of fp32, far below
  // the 16-bit output's rounding)
  const float inv_a = 1.f / den_a, inv_b = 1.f / den_b;
#pragma unroll
  for (int t = 0; t < kN / 8; ++t) {
    const int cc = acc_col(t, lane, 0);
    if (cc >= nv) continue;
    if (ra < n) {
      *reinterpret_cast<uint32_t*>(oh + int64_t(ra) * p.o_row_stride + cc) =
          Ops::pack(acc_o[t][0] * inv_a, acc_o[t][1] * inv_a);
    }
    if (rb < n) {
      *reinterpret_cast<uint32_t*>(oh + int64_t(rb) * p.o_row_stride + cc) =
          Ops::pack(acc_o[t][2] * inv_b, acc_o[t][3] * inv_b);
    }
  }
  if (tile == 0 && lane % 4 == 0) {
    if (ra < n) p.den[s.row(p, p.h, h, r0 + ra)] = den_a;
    if (rb < n) p.den[s.row(p, p.h, h, r0 + rb)] = den_b;
  }
  __syncthreads();  // the next chunk's copies overwrite the tiles
  }
}

}  // namespace linear_tc
}  // namespace attn
