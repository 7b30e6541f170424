// cuda_fwd / cuda_bwd: choose the kernel family for a call and launch it.
//
// Tensor cores (mma.sync) take fp16/bf16 on sm_80+ when the head dim is a multiple of 8 (so
// rows are whole 16-byte chunks) and the tensors are 16-byte aligned; everything else, and
// any head-dim bucket compiled out for a faster developer build (ATTN_CUDA_SKIP_HDIM64/128/
// 256), takes the SIMT kernels. ATTN_CUDA_SKIP_BWD compiles out the whole backward.
//
// The sm_90a wgmma forward and backward (sm90/) run only when the developer selection asks for
// them (CudaKernels::hopper_fwd / hopper_bwd, entry.h) and use_hopper_fwd() / use_hopper_bwd()
// accept the call; the rest keeps the mma.sync kernels. They exist when the build compiled sm_90a
// code (setup.py defines ATTN_CUDA_HAVE_SM90A when the arch list has 9.0) and did not compile
// them out (ATTN_CUDA_SKIP_HOPPER). The wgmma backward runs after the same preprocess, and is
// followed by the same dq_accum conversion, as the mma.sync backward's atomic-dQ mode.
//
// Block-sparse calls (p.sparse.on()) take the mma.sync kernels, which walk the layout's tile index
// built at their own tiles (cuda_fwd_sparse_tiles / cuda_bwd_sparse_tiles), unsplit; at the
// hopper_fwd / hopper_bwd selection 2 the wgmma kernels instead, with an index at theirs. Where
// the mma.sync path cannot serve, the SIMT kernels read the layout per block.
// Top-k calls (p.topk_thr set) take the SIMT kernels only: top-k keeps a logit by comparing it
// for equality with its row's threshold, so every kernel applying it must compute q.k bit for bit
// as the threshold pass (csrc/sparse/cuda) does, with the same warp dot product.
//
// Split-KV (flash-decoding): a forward on the mma.sync kernels can split each query block's
// visible key blocks over num_splits CTAs and merge their partials in a combine kernel (the op's
// num_splits argument; 0 = heuristics.h decides; the caller allocates the scratch). Dropout is
// supported in splits: the mask is drawn at the same (row, key) coordinates.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda/launch.h"
#include "cuda/static_switch.h"
#include "softmax/cuda/entry.h"
#include "softmax/cuda/heuristics.h"
#include "softmax/cuda/launchers.h"
#include "softmax/cuda/simt_kernel.cuh"
#include "softmax/cuda/traits.h"

#if defined(ATTN_CUDA_HAVE_SM90A) && !defined(ATTN_CUDA_SKIP_HOPPER)
#define ATTN_HOPPER_FWD 1
#else
#define ATTN_HOPPER_FWD 0
#endif
#if ATTN_HOPPER_FWD && !defined(ATTN_CUDA_SKIP_BWD)
#define ATTN_HOPPER_BWD 1
#else
#define ATTN_HOPPER_BWD 0
#endif

namespace attn {

namespace {

// The developer selection (entry.h), one copy per process.
// The wgmma kernels are the default on sm_90 (they beat the mma.sync ones at every shape
// measured: benchmarks/results/2026-11-24-h100.md); 0 keeps the mma.sync kernels.
std::atomic<int> g_hopper_fwd{1}, g_hopper_bwd{1}, g_tune_fwd{0}, g_tune_bwd{0};
std::atomic<bool> g_force_simt{false};

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }
bool strides8(int64_t a, int64_t b, int64_t c) { return a % 8 == 0 && b % 8 == 0 && c % 8 == 0; }

bool use_tensor_cores(const SoftmaxParams& p, DType dt) {
  if (dt == DType::kF32 || g_force_simt.load(std::memory_order_relaxed)) return false;
  if (p.topk_thr != nullptr) return false;
  if (p.d > 256 || p.d % 8 != 0 || !hdim_compiled(bucket_for_head_dim(p.d))) return false;
  if (device_sm() < 80) return false;
  return aligned16(p.q) && aligned16(p.k) && aligned16(p.v) && aligned16(p.o) &&
         strides8(p.q_batch_stride, p.q_head_stride, p.q_row_stride) &&
         strides8(p.k_batch_stride, p.k_head_stride, p.k_row_stride) &&
         strides8(p.v_batch_stride, p.v_head_stride, p.v_row_stride) &&
         strides8(p.o_batch_stride, p.o_head_stride, p.o_row_stride);
}

bool use_tensor_cores_bwd(const SoftmaxBwdParams& p, DType dt) {
  // dQ/dK/dV/dO are stored 4 bytes at a time and dO is read with cp.async
  return use_tensor_cores(p, dt) && aligned16(p.dout) &&
         strides8(p.do_batch_stride, p.do_head_stride, p.do_row_stride) &&
         strides8(p.dq_batch_stride, p.dq_head_stride, p.dq_row_stride) &&
         strides8(p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride) &&
         strides8(p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride) && aligned16(p.dq) &&
         aligned16(p.dk) && aligned16(p.dv);
}

// The scores the wgmma kernels evaluate at selection level `level` (hopper_fwd / hopper_bwd): the
// plain policy at 1; at 2 any score through the policy, per element (softcap, ALiBi, an additive
// bias and its gradient, a bool mask) and dropout.
bool hopper_scores_ok(const SoftmaxParams& p, int level) {
  return level >= 2 || (level >= 1 && !needs_general_kernel(p));
}

// The mma.sync forward's (query, key) tile: the grid of its block-sparse tile index.
void cuda_fwd_sparse_tiles_tc(int d, int* tile_m, int* tile_n) {
  hdim_switch<64, 128, 256>(d, "attention fwd", [&](auto kD) {
    *tile_m = FwdTraits<decltype(kD)::value>::kBlockM;
    *tile_n = FwdTraits<decltype(kD)::value>::kBlockN;
  });
}

// The wgmma forward's (query, key) tile: the grid of its block-sparse tile index.
void hopper_tiles(int d, int* tile_m, int* tile_n) {
  hdim_switch<64, 128>(d, "attention fwd (wgmma)", [&](auto kD) {
    *tile_m = 64 * FwdHopperTraits<decltype(kD)::value>::kConsumerWGs;
    *tile_n = FwdHopperTraits<decltype(kD)::value>::kBlockN;
  });
}

// The wgmma backward's (query, key) tile: the grid of its block-sparse tile index.
[[maybe_unused]] void hopper_bwd_tiles(int d, int* tile_m, int* tile_n) {
  hdim_switch<64, 128>(d, "attention bwd (wgmma)", [&](auto kD) {
    *tile_m = BwdHopperTraits<decltype(kD)::value>::kBlockM;
    *tile_n = BwdHopperTraits<decltype(kD)::value>::kBlockN;
  });
}

// A block-sparse call's tile index (ix: p.sparse.fwd or .bwd) was built for this kernel's tiles
// (cuda_*_sparse_tiles asked with the same selection): a selection changed by another thread in
// between must not make a kernel walk an index of another grid.
bool index_fits(const SoftmaxParams& p, const TileIndex& ix, int tile_m, int tile_n) {
  return !p.sparse.on() || (ix.tile_m == tile_m && ix.tile_n == tile_n);
}

void throw_foreign_index(const char* what) {
  throw std::runtime_error(std::string(what) + ": the block-sparse tile index was built for another kernel's tiles "
                           "(the CUDA kernel selection changed during the call)");
}

// The wgmma forward takes a call when the selection allows it (hopper_fwd >= 1, 1 the default) and
// its scores (hopper_scores_ok: at 1 the plain policy, lengths, causal, sliding window, sinks;
// at 2 every score and dropout, and block-sparse layouts), its bucket (64 or 128) is compiled,
// the mma.sync path would take it (fp16/bf16, d % 8 == 0, 16-byte aligned rows), d <= 128, and
// the device is sm_90.
bool use_hopper_fwd(const SoftmaxParams& p, DType dt) {
  const int level = g_hopper_fwd.load(std::memory_order_relaxed);
  if (!ATTN_HOPPER_FWD || !hopper_scores_ok(p, level)) return false;
  if (p.d > 128 || !hdim_compiled(bucket_for_head_dim(p.d))) return false;
  // block-sparse layouts at level 2, through a tile index at the wgmma kernel's tiles (hopper_tiles)
  if (p.sparse.on() && (level < 2 || p.topk_thr != nullptr)) return false;
  return use_tensor_cores(p, dt) && device_sm() == 90;
}

// The 8-bit Q K^T (qk_quant) runs on the wgmma forward's quantized instances where the mma.sync
// FwdQ8 kernel would take the call (cuda_fwd_q8_blocks' rules, below) and the device is sm_90:
// int8 at the selection's level 2 (emulator-checked, not yet run on a GPU; else on FwdQ8), fp8
// at levels 1 and 2 (its only kernel: nothing else runs e4m3).
bool use_hopper_q8(const SoftmaxParams& p, DType dt) {
  const int level = g_hopper_fwd.load(std::memory_order_relaxed);
  if (!ATTN_HOPPER_FWD || level < (p.qk_quant == kQkFp8 ? 1 : 2)) return false;
  return use_tensor_cores(p, dt) && p.d <= 128 && p.d % 16 == 0 && !p.sparse.on() &&
         hdim_compiled(bucket_for_head_dim(p.d)) && device_sm() == 90;
}

// The wgmma backward takes a call when the selection allows it (hopper_bwd >= 1, 1 the default), the mma.sync
// backward would take it with atomic dQ (use_tensor_cores_bwd, not deterministic: the wgmma
// kernel adds dQ atomically), d <= 128 and compiled, the device is sm_90, and its scores are the
// selection's (hopper_scores_ok, as for use_hopper_fwd; at 2 with dbias and block-sparse layouts
// too; sinks only touch the LSE it reads and dsinks, which the preprocess computes).
[[maybe_unused]] bool use_hopper_bwd(const SoftmaxBwdParams& p, DType dt) {
  if (!ATTN_HOPPER_BWD || !hopper_scores_ok(p, g_hopper_bwd.load(std::memory_order_relaxed))) return false;
  if (p.d > 128 || !hdim_compiled(bucket_for_head_dim(p.d))) return false;
  if (p.deterministic) return false;  // (dbias implies a bias: level 2 only, by hopper_scores_ok)
  // block-sparse layouts at level 2, through a CSC tile index at the wgmma kernel's tiles
  if (p.sparse.on() && (g_hopper_bwd.load(std::memory_order_relaxed) < 2 || p.topk_thr != nullptr)) return false;
  return use_tensor_cores_bwd(p, dt) && device_sm() == 90;
}

void validate(const SoftmaxParams& p, const char* what) {
  if (p.d < 1 || p.d > simt::kSimtMaxD) {
    throw std::runtime_error(std::string(what) + ": head dim " + std::to_string(p.d) +
                             " is outside the CUDA kernels' range [1, 256]");
  }
  if (p.h_k < 1 || p.h % p.h_k != 0) {
    throw std::runtime_error(std::string(what) + ": query heads must be a multiple of kv heads");
  }
  if (p.dropout_p < 0.f || p.dropout_p >= 1.f) {
    throw std::runtime_error(std::string(what) + ": dropout_p must be in [0, 1)");
  }
}

template <typename T>
void fwd_tc(const SoftmaxParams& p, cudaStream_t stream) {
  hdim_switch<64, 128, 256>(p.d, "attention fwd", [&](auto kD) { run_fwd_tc<T, decltype(kD)::value>(p, stream); });
}

template <typename T>
void fwd_tc_split(const SoftmaxParams& p, const FwdSplitScratch& split, cudaStream_t stream) {
  hdim_switch<64, 128, 256>(p.d, "attention fwd (split-KV)",
                            [&](auto kD) { run_fwd_tc_split<T, decltype(kD)::value>(p, split, stream); });
}

#if ATTN_HOPPER_FWD
// kQ8: the 8-bit Q K^T forms (run_fwd_hopper_q8)
template <typename T, bool kQ8 = false>
void fwd_hopper(const SoftmaxParams& p, cudaStream_t stream) {
  hdim_switch<64, 128>(p.d, kQ8 ? "attention fwd (wgmma, 8-bit Q.K^T)" : "attention fwd (wgmma)", [&](auto kD) {
    if constexpr (kQ8) run_fwd_hopper_q8<T, decltype(kD)::value>(p, stream);
    else run_fwd_hopper<T, decltype(kD)::value>(p, stream);
  });
}
#endif

#if ATTN_HOPPER_BWD
template <typename T>
void bwd_hopper(const SoftmaxBwdParams& p, cudaStream_t stream) {
  hdim_switch<64, 128>(p.d, "attention bwd (wgmma)", [&](auto kD) { run_bwd_hopper<T, decltype(kD)::value>(p, stream); });
}
#endif

#if !defined(ATTN_CUDA_SKIP_BWD)
template <typename T>
void bwd_tc(const SoftmaxBwdParams& p, cudaStream_t stream) {
  hdim_switch<64, 128, 256>(p.d, "attention bwd", [&](auto kD) { run_bwd_tc<T, decltype(kD)::value>(p, stream); });
}
#endif

}  // namespace

void cuda_set_kernels(const CudaKernels& k) {
  g_hopper_fwd.store(k.hopper_fwd);
  g_hopper_bwd.store(k.hopper_bwd);
  g_tune_fwd.store(k.tune_fwd);
  g_tune_bwd.store(k.tune_bwd);
  g_force_simt.store(k.force_simt);
}

CudaKernels cuda_kernels() {
  return CudaKernels{g_hopper_fwd.load(), g_hopper_bwd.load(), g_tune_fwd.load(), g_tune_bwd.load(),
                     g_force_simt.load()};
}

// Both the split count and the launch see a one-query-row GQA call with the heads of each kv
// group packed as rows of one query block (heuristics.h pack_gqa_rows).
int cuda_fwd_num_splits(const SoftmaxParams& call, DType dt, int requested) {
  const SoftmaxParams p = pack_gqa_rows(call);
  if (p.b == 0 || p.h == 0 || p.sq == 0) return 1;
  // decided before the wgmma forward: a call the heuristic splits (few queries, many keys) runs
  // the mma.sync split kernels, which the wgmma forward (one CTA per 128 query rows) cannot match
  if (!use_tensor_cores(p, dt) || p.sparse.on()) return 1;
  if (requested >= 1) return requested < kMaxSplits ? requested : kMaxSplits;
#if defined(ATTN_TUNING)
  if (g_tune_fwd.load(std::memory_order_relaxed) != 0) return 1;  // the tuning candidates are timed unsplit
#endif
  int block_m = 0, block_n = 0;
  hdim_switch<64, 128, 256>(p.d, "attention fwd", [&](auto kD) {
    block_m = FwdTraits<decltype(kD)::value>::kBlockM;
    block_n = FwdTraits<decltype(kD)::value>::kBlockN;
  });
  const int64_t ctas = int64_t((p.sq + block_m - 1) / block_m) * p.h * p.b;
  return num_splits_heuristic(ctas, device_sm_count(), (int64_t(p.sk) + block_n - 1) / block_n);
}
size_t cuda_fwd_split_floats(const SoftmaxParams& p, int num_splits, int64_t batch_t, int64_t rows, bool o) {
  return size_t(batch_t) * p.h * num_splits * rows * (o ? p.d : 1);
}

void cuda_fwd_sparse_tiles(const SoftmaxParams& p, DType dt, int* tile_m, int* tile_n) {
  *tile_m = *tile_n = 0;
  if (!use_tensor_cores(p, dt)) return;
  if (use_hopper_fwd(p, dt)) {  // sparse calls never split, so the wgmma forward will take it
    hopper_tiles(p.d, tile_m, tile_n);
    return;
  }
  cuda_fwd_sparse_tiles_tc(p.d, tile_m, tile_n);
}

// The mma.sync dK / dV kernel's (query, key) tile (run_bwd_tc_impl); the deterministic dQ kernel
// reads the layout itself.
void bwd_sparse_tiles_tc(int d, int* tile_m, int* tile_n) {
  hdim_switch<64, 128, 256>(d, "attention bwd", [&](auto kD) {
    constexpr int D = decltype(kD)::value;
    *tile_m = device_sm() >= 90 ? BwdTraitsSm90<D>::kBlockM : BwdTraits<D>::kBlockM;
    *tile_n = device_sm() >= 90 ? BwdTraitsSm90<D>::kBlockN : BwdTraits<D>::kBlockN;
  });
}

void cuda_bwd_sparse_tiles(const SoftmaxBwdParams& p, DType dt, int* tile_m, int* tile_n) {
  *tile_m = *tile_n = 0;
  if (!use_tensor_cores_bwd(p, dt)) return;
#if ATTN_HOPPER_BWD
  if (use_hopper_bwd(p, dt)) {
    hopper_bwd_tiles(p.d, tile_m, tile_n);
    return;
  }
#endif
  bwd_sparse_tiles_tc(p.d, tile_m, tile_n);
}

const char* cuda_path_name(const SoftmaxParams& p, DType dt) {
  if (use_hopper_fwd(p, dt)) return "hopper-wgmma";
  return use_tensor_cores(p, dt) ? "tensor-core" : "simt";
}

size_t cuda_bwd_softmax_d_floats(const SoftmaxBwdParams& p) { return size_t(p.b) * p.h * p.sq; }

size_t cuda_bwd_dq_accum_floats(const SoftmaxBwdParams& p, DType dt) {
  if (p.deterministic || !use_tensor_cores_bwd(p, dt)) return 0;
  return size_t(p.b) * p.h * p.sq * bucket_for_head_dim(p.d);
}

// The 8-bit Q K^T forward (qk_quant): the mma.sync kernel's rules (use_tensor_cores: fp16 / bf16,
// 16-byte aligned rows, sm_80+), head dims a multiple of 16 (the 8-bit rows are 16-byte chunks)
// up to 128 in a compiled bucket, dense (no block-sparse layout), and never GQA-packed rows (the
// scales are laid out per (batch, head, row block) of the call as given); fp8 only where the
// wgmma kernel takes it. hopper: use_hopper_q8's answer, read once per call by the caller (the
// selection may change between two reads; the blocks and the launch must agree).
static void q8_blocks(const SoftmaxParams& p, DType dt, bool hopper, int* block_q, int* block_k) {
  *block_q = *block_k = 0;
  if (!use_tensor_cores(p, dt) || p.d > 128 || p.d % 16 != 0 || p.sparse.on()) return;
  if (hopper) {  // one warp's 16 rows of a consumer warpgroup; one key tile
    hdim_switch<64, 128>(p.d, "attention fwd (wgmma, 8-bit Q.K^T)", [&](auto kD) {
      *block_q = 16;
      *block_k = FwdHopperTraits<decltype(kD)::value>::kBlockN;
    });
    return;
  }
  if (p.qk_quant == kQkFp8) return;
  hdim_switch<64, 128>(p.d, "attention fwd (int8 Q.K^T)", [&](auto kD) {
    using Tr = FwdTraits<decltype(kD)::value>;
    *block_q = Tr::kBlockM / Tr::kNWarps;  // one warp's rows
    *block_k = Tr::kBlockN;                 // one key tile
  });
}

void cuda_fwd_q8_blocks(const SoftmaxParams& p, DType dt, int* block_q, int* block_k) {
  q8_blocks(p, dt, use_hopper_q8(p, dt), block_q, block_k);
}

void cuda_fwd_q8(const SoftmaxParams& p, DType dt, cudaStream_t stream) {
  NvtxRange range("attention_ext::softmax::cuda_fwd (8-bit Q.K^T)");
  validate(p, "attention fwd (8-bit Q.K^T)");
  const bool hopper = use_hopper_q8(p, dt);
  int bq = 0, bk = 0;
  q8_blocks(p, dt, hopper, &bq, &bk);
  if (bq == 0 || p.q8.block_q != bq || p.q8.block_k != bk || p.q8.q == nullptr ||
      p.q8.nch != std::max(1, (p.sk + kQ8MeanKeys - 1) / kQ8MeanKeys) || p.q8.q_row_stride % 16 != 0 ||
      p.q8.k_row_stride % 16 != 0) {
    throw std::runtime_error("attention fwd (8-bit Q.K^T): the call's 8-bit operands were not allocated at "
                             "cuda_fwd_q8_blocks' blocks (the kernel selection changed during the call?)");
  }
  if (p.b == 0 || p.h == 0 || p.sq == 0) return;
#if ATTN_HOPPER_FWD
  if (hopper) {
    if (dt == DType::kF16) fwd_hopper<__half, true>(p, stream);
    else fwd_hopper<__nv_bfloat16, true>(p, stream);
    return;
  }
#endif
  if (p.qk_quant != kQkInt8) {  // (q8_blocks gives fp8 no other kernel: never e4m3 bytes into FwdQ8)
    throw std::runtime_error("attention fwd (8-bit Q.K^T): only the sm_90a wgmma kernel runs qk_quant='fp8'");
  }
  hdim_switch<64, 128>(p.d, "attention fwd (int8 Q.K^T)", [&](auto kD) {
    if (dt == DType::kF16) run_fwd_q8<__half, decltype(kD)::value>(p, stream);
    else run_fwd_q8<__nv_bfloat16, decltype(kD)::value>(p, stream);
  });
}

void cuda_fwd(const SoftmaxParams& call, DType dt, cudaStream_t stream, const FwdSplitScratch& call_split) {
  NvtxRange range("attention_ext::softmax::cuda_fwd");
  validate(call, "attention fwd");
  const SoftmaxParams p = pack_gqa_rows(call);
  FwdSplitScratch split = call_split;
  if (p.sq != call.sq) split.rows = p.sq;  // packed: the scratch's G rows per (batch, kv head)
  if (p.b == 0 || p.h == 0 || p.sq == 0) return;
#if ATTN_HOPPER_FWD
  const bool hopper = split.num_splits <= 1 && use_hopper_fwd(p, dt);
  int hm = 0, hn = 0;
  if (hopper && p.sparse.on()) hopper_tiles(p.d, &hm, &hn);
  if (hopper && index_fits(p, p.sparse.fwd, hm, hn)) {
    if (dt == DType::kF16) fwd_hopper<__half>(p, stream);
    else fwd_hopper<__nv_bfloat16>(p, stream);
    return;
  }
#endif
  if (use_tensor_cores(p, dt)) {
    if (split.num_splits > 1) {
      if (split.o_accum == nullptr || split.lse_accum == nullptr) {
        throw std::runtime_error("attention fwd: split-KV scratch is missing");
      }
      if (dt == DType::kF16) fwd_tc_split<__half>(p, split, stream);
      else fwd_tc_split<__nv_bfloat16>(p, split, stream);
      return;
    }
    if (p.sparse.on()) {
      int tm = 0, tn = 0;
      cuda_fwd_sparse_tiles_tc(p.d, &tm, &tn);
      if (!index_fits(p, p.sparse.fwd, tm, tn)) throw_foreign_index("attention fwd");
    }
    if (dt == DType::kF16) fwd_tc<__half>(p, stream);
    else fwd_tc<__nv_bfloat16>(p, stream);
    return;
  }
  switch (dt) {
    case DType::kF32: run_fwd_simt<float>(p, stream); break;
    case DType::kF16: run_fwd_simt<__half>(p, stream); break;
    case DType::kBF16: run_fwd_simt<__nv_bfloat16>(p, stream); break;
  }
}

void cuda_bwd(const SoftmaxBwdParams& p, DType dt, cudaStream_t stream) {
  NvtxRange range("attention_ext::softmax::cuda_bwd");
#if defined(ATTN_CUDA_SKIP_BWD)
  (void)p; (void)dt; (void)stream;
  throw std::runtime_error("attention bwd: this build compiled out the CUDA backward (ATTN_CUDA_SKIP_BWD)");
#else
  validate(p, "attention bwd");
  if (p.softmax_d == nullptr) throw std::runtime_error("attention bwd: softmax_d scratch is missing");
  const bool tc = use_tensor_cores_bwd(p, dt);
  const bool atomic_dq = tc && !p.deterministic;
  if (atomic_dq && p.dq_accum == nullptr) {
    throw std::runtime_error("attention bwd: dq_accum scratch is missing");
  }
  if (p.dbias != nullptr) {
    // dense (B, H, Sq_b, Sk): blocks the kernels skip (masked) must read 0
    const int64_t rows = p.dbias_row_stride == 0 ? 1 : p.sq;
    const int64_t extent = int64_t(p.b - 1) * p.dbias_batch_stride +
                           int64_t(p.h - 1) * p.dbias_head_stride +
                           (rows - 1) * p.dbias_row_stride + p.sk;
    if (cudaMemsetAsync(p.dbias, 0, size_t(extent) * sizeof(float), stream) != cudaSuccess) {
      throw std::runtime_error("attention bwd: cannot zero dbias");
    }
  }
  if (p.dsinks != nullptr &&
      cudaMemsetAsync(p.dsinks, 0, size_t(p.b) * p.h * sizeof(float), stream) != cudaSuccess) {
    throw std::runtime_error("attention bwd: cannot zero dsinks");
  }
  // empty problems: the caller zeroes the gradients (alloc_grads in torch/softmax_binding.h)
  if (p.b == 0 || p.h == 0 || p.sq == 0 || p.sk == 0) return;
  const int dq_ld = atomic_dq ? bucket_for_head_dim(p.d) : 0;
  SoftmaxBwdParams q = p;
  if (!atomic_dq) q.dq_accum = nullptr;
  switch (dt) {
    case DType::kF32: run_bwd_preprocess<float>(q, dq_ld, stream); break;
    case DType::kF16: run_bwd_preprocess<__half>(q, dq_ld, stream); break;
    case DType::kBF16: run_bwd_preprocess<__nv_bfloat16>(q, dq_ld, stream); break;
  }
#if ATTN_HOPPER_BWD
  // implies tc and atomic_dq: q.dq_accum is the zeroed (B, H, Sq, bucket) scratch
  const bool hopper = use_hopper_bwd(p, dt);
  int hm = 0, hn = 0;
  if (hopper && p.sparse.on()) hopper_bwd_tiles(p.d, &hm, &hn);
  if (hopper && index_fits(p, p.sparse.bwd, hm, hn)) {
    if (dt == DType::kF16) bwd_hopper<__half>(q, stream);
    else bwd_hopper<__nv_bfloat16>(q, stream);
    return;
  }
#endif
  if (tc) {
    if (p.sparse.on()) {
      int tm = 0, tn = 0;
      bwd_sparse_tiles_tc(p.d, &tm, &tn);
      if (!index_fits(p, p.sparse.bwd, tm, tn)) throw_foreign_index("attention bwd");
    }
    if (dt == DType::kF16) bwd_tc<__half>(q, stream);
    else bwd_tc<__nv_bfloat16>(q, stream);
    return;
  }
  switch (dt) {
    case DType::kF32: run_bwd_simt<float>(q, stream); break;
    case DType::kF16: run_bwd_simt<__half>(q, stream); break;
    case DType::kBF16: run_bwd_simt<__nv_bfloat16>(q, stream); break;
  }
#endif
}

}  // namespace attn
