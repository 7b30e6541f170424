// Host entry points of the CUDA softmax backend. No torch here: csrc/torch/softmax_cuda.cpp converts
// tensors to SoftmaxParams / SoftmaxBwdParams, allocates the scratch sized by the functions below, and
// calls these on the current stream. Errors (unsupported configs, launch failures) are thrown
// as std::runtime_error with a message that names the cause.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "common/softmax_params.h"  // SoftmaxParams, SoftmaxBwdParams, DType

namespace attn {

// Split-KV (flash-decoding) scratch of the forward, float32: partial O (B_t, H, num_splits,
// rows, d) and partial LSE (B_t, H, num_splits, rows), (B_t, rows) = q's batch and row dims:
// (B, Sq) padded, (1, total_q) varlen. Sizes: cuda_fwd_split_floats().
struct FwdSplitScratch {
  int num_splits = 1;  // <= 1: no split
  int64_t rows = 0;
  float* o_accum = nullptr;
  float* lse_accum = nullptr;
};

// The kernel selection, process-wide (set by the attention_ext::set_cuda_kernels op; the values
// below are the defaults):
//   hopper_fwd / hopper_bwd: 1 = the sm_90a wgmma forward / backward where use_hopper_fwd() /
//               use_hopper_bwd() accept the call, 0 = the mma.sync kernels there; 2 = the wgmma
//               kernel also for softcap, ALiBi, biases (with dbias), bool masks, dropout,
//               block-sparse layouts and the int8 Q K^T (qk_quant; emulator-checked, not yet run
//               on a GPU, so not the default);
//   tune_fwd / tune_bwd: the -DATTN_TUNING candidate (launch_template.cuh), 0 = the default;
//   force_simt: every call on the SIMT kernels.
struct CudaKernels {
  int hopper_fwd = 1, hopper_bwd = 1, tune_fwd = 0, tune_bwd = 0;
  bool force_simt = false;
};
void cuda_set_kernels(const CudaKernels& k);
CudaKernels cuda_kernels();

// How many key splits the forward of this config runs: 1 unless the mma.sync kernels can take it;
// then `requested` (>= 1: that many, clamped to 128; 0: the heuristic in dispatch.cu). A call
// with more than one split runs the mma.sync split kernels, also where the sm_90a wgmma forward
// would take it unsplit. The caller allocates the scratch for that many (if > 1).
int cuda_fwd_num_splits(const SoftmaxParams& p, DType dt, int requested);
// Floats of the O (o = true) or LSE scratch for num_splits splits and q's dims (B_t, rows).
size_t cuda_fwd_split_floats(const SoftmaxParams& p, int num_splits, int64_t batch_t, int64_t rows, bool o);

// Forward: writes p.o and p.lse. split: scratch for split.num_splits > 1 splits, as
// cuda_fwd_num_splits() returned for p (else the forward is unsplit).
void cuda_fwd(const SoftmaxParams& p, DType dt, cudaStream_t stream, const FwdSplitScratch& split = {});

// The forward with the int8 Q K^T (qk_quant = "int8", q8.cuh). cuda_fwd_q8_blocks: the query
// rows per q scale and the keys per k scale of this config's kernel, (0, 0) where none runs it
// (fp16 / bf16 q, k, v with the tensor-core rules, head dim a multiple of 16 up to 128, dense,
// sm_80+). cuda_fwd_q8: writes p.o and p.lse after filling p.q8, which the caller allocated at
// those blocks (nbq = ceil(sq / block_q), nbk = ceil(sk / block_k); q8 / k8 with q's / k's
// strides, q_mean in lse's layout, k_mean (B, H_k, d), k_sum / k_count (B, H_k, nch[, d]) with
// nch = ceil(sk / kQ8MeanKeys), softmax_params.h).
void cuda_fwd_q8_blocks(const SoftmaxParams& p, DType dt, int* block_q, int* block_k);
void cuda_fwd_q8(const SoftmaxParams& p, DType dt, cudaStream_t stream);

// Backward: writes p.dq, p.dk, p.dv and, when not null, p.dbias (zeroed first, then filled:
// dense (B, H, Sq_b, Sk) float32) and p.dsinks ((B, H) float32, zeroed first).
// Needs p.softmax_d with cuda_bwd_softmax_d_floats(p) floats, and p.dq_accum with
// cuda_bwd_dq_accum_floats(p, dt) floats when that is nonzero (else it may be null).
void cuda_bwd(const SoftmaxBwdParams& p, DType dt, cudaStream_t stream);

size_t cuda_bwd_softmax_d_floats(const SoftmaxBwdParams& p);        // B * H * Sq (Sq = max for varlen)
size_t cuda_bwd_dq_accum_floats(const SoftmaxBwdParams& p, DType dt);  // 0 unless atomic dQ path

// Block-sparse calls (p.sparse.layout set): the tiles, query rows x keys, of the kernel that will
// run the forward / the backward's dK / dV, so that the caller builds the layout's tile index at
// them (p.sparse.fwd: CSR, p.sparse.bwd: CSC; block_sparse.h). (0, 0): that kernel reads the
// layout itself (the SIMT kernels) and needs no index.
void cuda_fwd_sparse_tiles(const SoftmaxParams& p, DType dt, int* tile_m, int* tile_n);
void cuda_bwd_sparse_tiles(const SoftmaxBwdParams& p, DType dt, int* tile_m, int* tile_n);

// Which kernel family a config's forward takes: "hopper-wgmma" (sm_90a, when the developer
// selection asks for it), "tensor-core" (mma.sync) or "simt" (for tests and benchmarks).
const char* cuda_path_name(const SoftmaxParams& p, DType dt);

}  // namespace attn
