// Tensor-core forward (sm_80+, fp16/bf16): one CTA per (query block, head, batch), or with
// split-KV (flash-decoding, FwdSplit) per (query block x key split, head, batch) followed by
// fwd_combine_kernel.
//
// Each warp owns 16 * kMT consecutive query rows. Per key block: S = Q K^T on mma.sync with
// both operands read by ldmatrix from swizzled shared memory, the online softmax in registers,
// then O += P V with P re-packed from the S accumulators (no shared-memory round trip).
// K and V are single-buffered but their cp.async loads overlap the other half of the work:
// V[n] streams in during S = Q K^T and the softmax, K[n-1] during P V.
#pragma once

#include "common/split_merge.h"
#include "softmax/cuda/kernel_common.cuh"
#include "cuda/mma.cuh"
#include "softmax/cuda/fragment_softmax.cuh"
#include "softmax/cuda/nonfinite.cuh"
#include "softmax/cuda/q8.cuh"
#include "softmax/cuda/traits.h"

namespace attn {
namespace tc {

// Compile-time schedule choices. The default build instantiates only FwdVariant<>; the tuning
// build (-DATTN_TUNING, tuning.cuh FwdAlt) times others against it.
//   kSUnroll: unroll of the S = Q K^T head-dim loop; 0 = fully (the default). A rolled loop
//             cannot prefetch the next k-step's Q / K fragments, which keeps them from
//             competing with O and S for registers (the loop only moves ldmatrix addresses).
template <int kSUnroll_ = 0>
struct FwdVariant {
  static constexpr int kSUnroll = kSUnroll_;
  static constexpr bool kReverseM = false;
  static constexpr bool kSplit = false;
  static constexpr bool kQ8 = false;
};

// Query blocks in reverse launch order. Under a causal mask block m costs m + 1 key blocks; the
// launch order runs blockIdx.x fastest, so reversing it starts each head's heaviest blocks first
// and leaves light ones for the last wave (a shorter tail). A member, as kSplit below, so that
// FwdVariant<...> and the unchanged kernels keep their names.
template <typename Base>
struct FwdReverseM : Base {
  static constexpr bool kReverseM = true;
};

// The split-KV (flash-decoding) instance of a schedule: grid.x = query blocks x num_splits
// (splits fastest); CTA `split` runs its share of the visible key blocks and writes its partial
// (lse_s, O_s) without the sink, in fp32, through p.o / p.lse, which the launcher points at the
// scratch with query head h * num_splits + split (run_fwd_tc_split). A member rather than a
// template parameter of the kernel: FwdVariant<...> and so the unsplit kernels' names and code
// stay as they were.
template <typename Base>
struct FwdSplit : Base {
  static constexpr bool kSplit = true;
};

// The int8 Q K^T instance (qk_quant, q8.cuh): Q and K come as int8 from the quantize pass
// (p.q8), their tiles hold D bytes per row (half a 16-bit tile), and S = Q K^T runs on
// mma.m16n8k32.s8 in int32, then s = sum * (q_scale * k_scale) + q . mean per element: one
// scale per warp's rows (block_q = 16 kMT) and per key tile (block_k = kBlockN). P V, the
// softmax and every option are the 16-bit kernel's.
template <typename Base>
struct FwdQ8 : Base {
  static constexpr bool kQ8 = true;
};

// Split-KV epilogue of one warp (rows [i0, i0 + 16 * kMT) of the sequence, of which the first
// `rows` exist): the partial lse_s without the sink and O_s = O / l_s (times the dropout rescale)
// in fp32, through p.o / p.lse at query head hs. Empty or fully masked rows (l = 0) write
// lse_s = -inf and O_s = 0. O goes out as float2 per lane, unstaged: split calls are few-row.
template <int kMT, int kDT>
__device__ __forceinline__ void store_split_partial(const SoftmaxParams& p, const SeqInfo& si, int b,
                                                    int hs, int i0, int rows,
                                                    float (&acc_o)[kMT][kDT][4],
                                                    const float (&row_m)[kMT][2],
                                                    const float (&row_l)[kMT][2], float rdrop,
                                                    int lane) {
  const int g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float lse, factor;
      finish_row(row_m[mt][hf], row_l[mt][hf], false, -INFINITY, rdrop, &lse, &factor);
      const int r = mt * 16 + g + hf * 8;
      if (r >= rows) continue;
      if (c == 0) p.lse[lse_index(p, si, b, hs, i0 + r)] = lse;
      float* o = static_cast<float*>(p.o) +
                 si.q_offset(p, b, hs, i0 + r, p.o_batch_stride, p.o_head_stride, p.o_row_stride);
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) {
        if (dt * 8 < p.d) {
          *reinterpret_cast<float2*>(o + dt * 8 + 2 * c) =
              make_float2(acc_o[mt][dt][2 * hf] * factor, acc_o[mt][dt][2 * hf + 1] * factor);
        }
      }
    }
  }
}

// kGeneral = false: the policy is plain (no softcap, ALiBi, bias or mask) and there is no
// dropout, so only the window/length check remains; a separate instantiation keeps the
// general path's registers out of the fast kernel.
template <typename T, int kD, int kBlockM, int kBlockN, int kNWarps, bool kGeneral,
          typename Var = FwdVariant<>>
__global__ void __launch_bounds__(kNWarps * 32, 1) fwd_kernel(const SoftmaxParams p) {
  constexpr int kSUnroll = Var::kSUnroll == 0 ? kD / 16 : Var::kSUnroll;
  using Ops = TypeOps<T>;
  constexpr int kThreads = kNWarps * 32;
  constexpr int kMT = kBlockM / (16 * kNWarps);  // 16-row m-tiles per warp
  constexpr int kNT = kBlockN / 8;                // 8-column n-tiles of S
  constexpr int kDT = kD / 8;                     // 8-column n-tiles of O
  static_assert(kMT * 16 * kNWarps == kBlockM, "the query block splits into 16-row warp tiles");
  static_assert(kBlockN % 16 == 0 && kD % 16 == 0, "mma k-steps are 16 wide");
  using TileQ = SmemTile<kBlockM, kD>;
  using TileKV = SmemTile<kBlockN, kD>;
  // FwdQ8: the int8 Q / K tiles, D bytes per row read as D / 2 16-bit columns
  constexpr bool kQ8 = Var::kQ8;
  using TileQ8 = SmemTile<kBlockM, kD / 2>;
  using TileK8 = SmemTile<kBlockN, kD / 2>;
  static_assert(!kQ8 || (kD % 64 == 0 && !Var::kSplit), "int8 Q K^T: head dims 64 / 128, unsplit");

  ATTN_EXTERN_SMEM(smem);
  const uint32_t sQ = smem_u32(smem);                      // (kBlockM, kD)
  const uint32_t sK = sQ + TileQ::kBytes;                  // (kBlockN, kD)
  const uint32_t sV = sK + TileKV::kBytes;                 // (kBlockN, kD)

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int h = blockIdx.y, b = blockIdx.z;
  int m_block = blockIdx.x, split = 0, num_splits = 1;
  if constexpr (Var::kSplit) {
    num_splits = gridDim.x / ((p.sq + kBlockM - 1) / kBlockM);
    m_block = blockIdx.x / num_splits;
    split = blockIdx.x % num_splits;
  } else if constexpr (Var::kReverseM) {
    m_block = int(gridDim.x) - 1 - int(blockIdx.x);
  }

  const SeqInfo si(p, b);
  const int m0 = m_block * kBlockM;
  if (m0 >= si.len_q) return;
  const Policy pol(p, si, b, h);
  const int hk = h / (p.h / p.h_k);
  const int rows_q = min(kBlockM, si.len_q - m0);

  const T* q = q_ptr<T>(p, si, b, h, m0);
  const T* k = k_ptr<T>(p, si, b, hk, 0);
  const T* v = v_ptr<T>(p, si, b, hk, 0);
  // FwdQ8: q8 / k8 at their own strides (multiples of d, a multiple of 16: every row 16-byte
  // aligned), rows read as 16-bit pairs
  const uint16_t* q8 = nullptr;
  const uint16_t* k8 = nullptr;
  if constexpr (kQ8) {
    q8 = reinterpret_cast<const uint16_t*>(p.q8.q + si.q_offset(p, b, h, m0, p.q8.q_batch_stride, p.q8.q_head_stride,
                                                                 p.q8.q_row_stride));
    k8 = reinterpret_cast<const uint16_t*>(p.q8.k + si.k_offset(p, b, hk, 0, p.q8.k_batch_stride, p.q8.k_head_stride,
                                                                 p.q8.k_row_stride));
  }
  auto load_k = [&](int n0) {  // key tile n0 into sK
    if constexpr (kQ8) {
      load_tile_async<kBlockN, kD / 2, kThreads, uint16_t, TileK8>(sK, k8 + int64_t(n0) * (p.q8.k_row_stride / 2),
                                                                   p.q8.k_row_stride / 2, si.len_k - n0, p.d / 2, tid);
    } else {
      load_tile_async<kBlockN, kD, kThreads>(sK, k + int64_t(n0) * p.k_row_stride, p.k_row_stride, si.len_k - n0,
                                             p.d, tid);
    }
  };

  // The key blocks to visit are steps [n_lo, n_hi): dense, step n is key block n; block-sparse,
  // step e is entry e of this query tile's row of the tile index (its key block sp_idx[e],
  // ascending in e), the entries clipped to the visible blocks. Either way steps run high to low.
  int n_lo, n_hi;
  pol.key_blocks(m0, m0 + rows_q, kBlockN, &n_lo, &n_hi);
  const bool sparse = p.sparse.on();
  const int32_t* sp_idx = p.sparse.fwd.idx;
  const uint8_t* sp_full = p.sparse.fwd.full;
  if (sparse) sparse_entries(p.sparse, p.sparse.fwd, h, m_block, n_lo, n_hi, &n_lo, &n_hi);
  auto key_block = [&](int step) { return sparse ? int(sp_idx[step]) : step; };
  if constexpr (Var::kSplit) {
    // ceil(n / num_splits) of the n visible blocks per split; the last splits may be empty
    const int per = (n_hi - n_lo + num_splits - 1) / num_splits;
    n_lo = imin(n_hi, n_lo + split * per);
    n_hi = imin(n_hi, n_lo + per);
  }

  const bool plain = !kGeneral || policy_is_plain(pol);
  const float scale_log2 = p.scale * kLog2e;
  const bool dropout = kGeneral && p.dropout_p > 0.f;
  const int bh = b * p.h + h;
  const int wm = warp * 16 * kMT;  // first row of this warp inside the block
  // per-thread ldmatrix bases: A of Q, B of K (non-transposed), B of V (transposed)
  const uint32_t q_a = TileQ::lane_a(wm, lane);
  const uint32_t k_b = TileKV::lane_b(0, lane);
  const uint32_t v_b = TileKV::lane_bt(0, lane);

  float acc_o[kMT][kDT][4];
  float row_m[kMT][2], row_l[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] = 0.f;
    row_m[mt][0] = row_m[mt][1] = -INFINITY;
    row_l[mt][0] = row_l[mt][1] = 0.f;
  }

  if (n_lo < n_hi) {
    if constexpr (kQ8) {
      load_tile_async<kBlockM, kD / 2, kThreads, uint16_t, TileQ8>(sQ, q8, p.q8.q_row_stride / 2, rows_q, p.d / 2,
                                                                   tid);
    } else {
      load_tile_async<kBlockM, kD, kThreads>(sQ, q, p.q_row_stride, rows_q, p.d, tid);
    }
    load_k(key_block(n_hi - 1) * kBlockN);
    cp_async_commit();
  }
  // FwdQ8: this warp's q scale and each of its rows' q . mean (rows past the sequence: 0; a warp
  // with none reads no scale, which the quantize pass did not write)
  float q8_qs = 0.f, q8_qm[kMT][2];
  if constexpr (kQ8) {
    if (m0 + wm < si.len_q) q8_qs = p.q8.q_scale[(int64_t(b) * p.h + h) * p.q8.nbq + (m0 + wm) / p.q8.block_q];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = m0 + wm + mt * 16 + g + hf * 8;
        q8_qm[mt][hf] = i < si.len_q ? p.q8.q_mean[lse_index(p, si, b, h, i)] : 0.f;
      }
  }

  // iterate key blocks in reverse so the partially masked diagonal block comes first
  for (int n = n_hi - 1; n >= n_lo; --n) {
    const int n0 = key_block(n) * kBlockN;
    cp_async_wait<0>();
    __syncthreads();  // K[n] landed; every warp finished reading V[n+1]
    load_tile_async<kBlockN, kD, kThreads>(sV, v + int64_t(n0) * p.v_row_stride, p.v_row_stride,
                                           si.len_k - n0, p.d, tid);
    cp_async_commit();

    // ---- S = Q K^T: (16 * kMT, kBlockN) per warp, fp32
    float acc_s[kMT][kNT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_s[mt][nt][e] = 0.f;
    if constexpr (kQ8) {
      // int8: 32 channels (16 16-bit columns) per k-step, exact int32 sums, then one FMA per
      // score. (Key pairs outer with each pair's sums converted before the next keeps 16 sums
      // live instead of 48 but reads Q's fragments once per pair; ptxas spilled more with it.)
      const uint32_t q_a8 = TileQ8::lane_a(wm, lane), k_b8 = TileK8::lane_b(0, lane);
      int32_t acc_i[kMT][kNT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_i[mt][nt][e] = 0;
#pragma unroll
      for (int kk = 0; kk < kD / 32; ++kk) {
        uint32_t a[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) ldmatrix_x4(a[mt], sQ + TileQ8::advance(q_a8, mt * 16, kk * 16));
#pragma unroll
        for (int np = 0; np < kBlockN / 16; ++np) {
          uint32_t bf[4];
          ldmatrix_x4(bf, sK + TileK8::advance(k_b8, np * 16, kk * 16));
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) mma_s8_n16(acc_i[mt][2 * np], a[mt], bf);
        }
      }
      const float sa = q8_qs * p.q8.k_scale[(int64_t(b) * p.h_k + hk) * p.q8.nbk + n0 / p.q8.block_k];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_s[mt][nt][e] = fmaf(float(acc_i[mt][nt][e]), sa, q8_qm[mt][e >> 1]);
    } else {
#pragma unroll kSUnroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        {  // zero-filled head-dim padding contributes zeros: no guard, so loads can be hoisted
          uint32_t a[kMT][4];
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt)
            ldmatrix_x4(a[mt], sQ + TileQ::advance(q_a, mt * 16, kk * 16));
#pragma unroll
          for (int np = 0; np < kBlockN / 16; ++np) {
            uint32_t bf[4];
            ldmatrix_x4(bf, sK + TileKV::advance(k_b, np * 16, kk * 16));
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) mma_n16<T>(acc_s[mt][2 * np], a[mt], bf);
          }
        }
      }
    }

    // ---- logits (log2 domain): a branch-free pass for full tiles of a plain policy, the
    // per-element policy otherwise (the branch is warp-uniform, taken once per tile)
    // (a tile the index does not mark full checks the layout per element too)
    const bool check = !(plain && (!sparse || sp_full[n] != 0) &&
                         pol.tile_full(m0 + wm, m0 + wm + 16 * kMT, n0, n0 + kBlockN));
    if (!check) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
        tile_logits<kNT>(&acc_s[mt][0][0], pol, plain, false, scale_log2, m0 + wm + mt * 16, n0, lane);
    } else {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
        tile_logits<kNT>(&acc_s[mt][0][0], pol, plain, true, scale_log2, m0 + wm + mt * 16, n0, lane);
    }

    // ---- online softmax: rows g and g + 8 of each m-tile, reduced over the quad
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
      online_softmax<kNT, kDT>(&acc_s[mt][0][0], &acc_o[mt][0][0], row_m[mt], row_l[mt]);

    // dropout acts on P after the row sums (the LSE is of the undropped probabilities)
    if (dropout) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) dropout_tile<kNT>(&acc_s[mt][0][0], p, bh, m0 + wm + mt * 16, n0, lane);
    }

    cp_async_wait<0>();
    __syncthreads();  // V[n] landed; every warp finished reading K[n]
    if (n > n_lo) {
      load_k(key_block(n - 1) * kBlockN);
      cp_async_commit();
    }
    // a tile that may hide keys from some of the block's rows: V's non-finite elements become 0
    // (nonfinite.cuh); the vote is also the barrier before any warp reads the zeroed tile
    const bool block_check = tile_may_hide(pol, !sparse || sp_full[n] != 0, m0, m0 + kBlockM, n0, n0 + kBlockN);
    const bool v_fix = block_check && __syncthreads_or(zero_nonfinite<T, TileKV, kBlockN, kThreads>(sV, tid));

    // ---- O += P V. P is packed to 16 bits first, so its fp32 copy dies before the MMAs.
    uint32_t pa[kMT][kBlockN / 16][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) pack_a_frags<T, kNT>(&acc_s[mt][0][0], pa[mt]);
    if (v_fix) {
      // the rows that read a zeroed element v(j, c) get it back: acc_o(i, c) += v(j, c), from
      // global memory (nonfinite.cuh; the loop below is add_back_nonfinite's, written out: the
      // call moved the sm_90a split kernel's spills from 144 to 156 bytes, nvcc 13.0). Not times
      // P(i, j): the element is inf or NaN, so the row's output there is non-finite either way,
      // and the quad's P fragments stay unshuffled
      // (a P = 0 the mma would have turned into NaN leaves inf here).
#pragma unroll 1
      for (int jl = 0; jl < kBlockN && n0 + jl < si.len_k; ++jl) {
        const int j = n0 + jl;
        const T* vrow = v + int64_t(j) * p.v_row_stride;
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const int i = m0 + wm + mt * 16 + g + hf * 8;
            if (i >= si.len_q || !(plain ? plain_allowed(pol, i, j) : pol.allowed(i, j))) continue;
#pragma unroll
            for (int dt = 0; dt < kDT; ++dt) {
              const int col = dt * 8 + 2 * c;  // d % 8 == 0: the pair is inside the row
              if (col >= p.d) continue;
              const uint32_t w = *reinterpret_cast<const uint32_t*>(vrow + col);
              if (bad_bits<T>(w)) acc_o[mt][dt][2 * hf] += Ops::unpack(w).x;
              if (bad_bits<T>(w >> 16)) acc_o[mt][dt][2 * hf + 1] += Ops::unpack(w).y;
            }
          }
      }
    }
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
#pragma unroll
      for (int dp = 0; dp < kD / 16; ++dp) {
        uint32_t bf[4];
        ldmatrix_x4_trans(bf, sV + TileKV::advance(v_b, kk * 16, dp * 16));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) mma_n16<T>(acc_o[mt][2 * dp], pa[mt][kk], bf);
      }
    }
  }

  // ---- epilogue: normalize, LSE, stage O through shared memory for 16-byte stores
  const float rdrop = dropout ? 1.f / (1.f - p.dropout_p) : 1.f;
  if constexpr (Var::kSplit) {
    store_split_partial<kMT, kDT>(p, si, b, h * num_splits + split, m0 + wm, rows_q - wm, acc_o,
                                  row_m, row_l, rdrop, lane);
    return;
  }
  const float sink = p.sinks != nullptr ? p.sinks[h] : -INFINITY;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float lse, factor;
      finish_row(row_m[mt][hf], row_l[mt][hf], p.sinks != nullptr, sink, rdrop, &lse, &factor);
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) {
        acc_o[mt][dt][2 * hf] *= factor;
        acc_o[mt][dt][2 * hf + 1] *= factor;
      }
      const int i = wm + mt * 16 + g + hf * 8;
      if (c == 0 && i < rows_q && p.lse != nullptr) p.lse[lse_index(p, si, b, h, m0 + i)] = lse;
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp finished reading sQ
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = wm + mt * 16 + g + hf * 8;
        const uint32_t val = Ops::pack(acc_o[mt][dt][2 * hf], acc_o[mt][dt][2 * hf + 1]);
        st_shared_b32(sQ + TileQ::offset(r, dt * 8 + 2 * c), val);
      }
  __syncthreads();
  T* o = o_ptr<T>(p, si, b, h, m0);
  constexpr int kTotal = kBlockM * TileQ::kChunks;
#pragma unroll
  for (int it = 0; it < kTotal / kThreads; ++it) {
    const int idx = it * kThreads + tid;
    const int r = idx / TileQ::kChunks, ch = idx % TileQ::kChunks;
    if (r < rows_q && ch * 8 < p.d) {
      const uint4 val = ld_shared_v4(sQ + TileQ::offset(r, ch * 8));
      *reinterpret_cast<uint4*>(o + int64_t(r) * p.o_row_stride + ch * 8) = val;
    }
  }
}

// Split-KV combine: one warp per query row (kCombineRows rows per CTA, grid (row blocks, H, B)),
// merging the num_splits partials that the FwdSplit kernel wrote through ps (p's sizes, the fp32
// scratch with query head h * num_splits + s) into O (T) and the LSE through p, with the sink
// entering here, once. Each lane owns 4 consecutive columns per 128.
constexpr int kCombineRows = 4;
template <typename T, int kD>
__global__ void __launch_bounds__(kCombineRows * 32)
    fwd_combine_kernel(const SoftmaxParams p, const SoftmaxParams ps, int num_splits) {
  using Ops = TypeOps<T>;
  const int lane = threadIdx.x & 31;
  const int i = blockIdx.x * kCombineRows + (threadIdx.x >> 5), h = blockIdx.y, b = blockIdx.z;
  const SeqInfo si(p, b);
  if (i >= si.len_q) return;
  const int hs = h * num_splits;  // split s is query head hs + s of the scratch
  const float* lse_s = ps.lse + lse_index(ps, si, b, hs, i);
  const float sink = p.sinks != nullptr ? p.sinks[h] : -INFINITY;
  const float lse = merge_split_lse<float>(lse_s, num_splits, ps.lse_head_stride, p.sinks != nullptr, sink);
  if (lane == 0 && p.lse != nullptr) p.lse[lse_index(p, si, b, h, i)] = lse;
  const float* o_s =
      static_cast<const float*>(ps.o) + si.q_offset(ps, b, hs, i, ps.o_batch_stride, ps.o_head_stride, ps.o_row_stride);
  T* o = o_ptr<T>(p, si, b, h, i);
#pragma unroll
  for (int c0 = 0; c0 < kD; c0 += 128) {
    const int c = c0 + lane * 4;
    if (c >= p.d) break;  // d % 8 == 0 on this path: a chunk is whole
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < num_splits; ++s) {
      const float w = split_weight(lse_s[s * ps.lse_head_stride], lse);
      if (w == 0.f) continue;  // an empty split (O_s = 0) or a negligible one
      const float4 x = *reinterpret_cast<const float4*>(o_s + s * ps.o_head_stride + c);
      acc.x += w * x.x;
      acc.y += w * x.y;
      acc.z += w * x.z;
      acc.w += w * x.w;
    }
    *reinterpret_cast<uint2*>(o + c) = make_uint2(Ops::pack(acc.x, acc.y), Ops::pack(acc.z, acc.w));
  }
}

}  // namespace tc
}  // namespace attn
