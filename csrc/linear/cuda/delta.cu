// cuda_delta_fwd (entry.h): the delta rule's forward on CUDA. Two schedules:
//   - delta_kernel.cuh's recurrent kernel, every call: the key width K picks how many lanes share
//     a column (KS) and how many rows each holds (kRows), so that a column's K rows fit in
//     registers: 16 rows per lane up to K = 512, 32 beyond;
//   - delta_chunk_kernel.cuh's chunk-parallel tensor-core kernels (three launches over a scratch),
//     for the calls they take (chunk_fits) when the selection asks (chunked = -1: from kDeltaChunkRows
//     rows on, where the recurrent kernel's one CTA per 16-32 value columns leaves most of the GPU
//     idle for thousands of sequential steps (benchmarks/gpu_cost.py predicts both).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda/launch.h"
#include "linear/cuda/delta_chunk_bwd_kernel.cuh"
#include "linear/cuda/delta_chunk_key_bwd_kernel.cuh"
#include "linear/cuda/delta_chunk_kernel.cuh"
#include "linear/cuda/delta_kernel.cuh"
#include "linear/cuda/entry.h"

namespace attn {

namespace {

std::atomic<int> g_chunked{0};  // entry.h: the recurrent kernel until a GPU run has timed both

bool aligned(const void* ptr, int bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

bool per_key(const DeltaParamsT<float>& p) { return p.gate != nullptr && p.gate_per_key; }

// The calls the chunk kernels (the forward's, or the backward's) take (delta_params.h
// delta_chunk_takes with every call selected) whose rows the 16-byte copies can read.
bool chunk_fits(const DeltaParamsT<float>& p, bool backward) {
  if (!delta_chunk_takes(1, p.dt, p.dim_k, p.dim_v, per_key(p), p.plain, p.s, backward)) return false;
  for (int64_t st : {p.q_batch_stride, p.q_head_stride, p.q_row_stride, p.k_batch_stride, p.k_head_stride,
                     p.k_row_stride, p.v_batch_stride, p.v_head_stride, p.v_row_stride}) {
    if (st % 8 != 0) return false;
  }
  for (int64_t st : {p.o_batch_stride, p.o_head_stride, p.o_row_stride}) {
    if (st % 2 != 0) return false;
  }
  return aligned(p.q, 16) && aligned(p.k, 16) && aligned(p.v, 16) && aligned(p.o, 4);
}

bool use_chunk(const DeltaParamsT<float>& p, const DeltaCudaKernels& k) {
  return chunk_fits(p, false) && delta_chunk_takes(k.chunked, p.dt, p.dim_k, p.dim_v, per_key(p), p.plain, p.s, false);
}

// The plan's sizes (pointers null) and the scratch bytes they need.
delta_chunk::DeltaChunkPlan chunk_plan(const DeltaParamsT<float>& p, size_t* bytes) {
  using delta_chunk::kC;
  delta_chunk::DeltaChunkPlan plan;
  plan.nt = (p.s + kC - 1) / kC;
  plan.tiles = (p.dim_v + delta_chunk::kBV - 1) / delta_chunk::kBV;
  plan.kk = p.dim_k <= 64 ? 64 : 128;
  plan.slots = p.cu_seqlens != nullptr ? int64_t(p.s / kC) + p.b : int64_t(p.b) * plan.nt;
  const int64_t hs = int64_t(p.h_v) * plan.slots;
  const size_t scal = size_t(hs) * delta_chunk::kScalars * 4, wk = size_t(hs) * kC * plan.kk * 2,
               u = size_t(hs) * kC * plan.vp() * 2, hc = size_t(hs) * plan.kk * plan.vp() * 2;
  // per-key gates: w(i, -1) q^ (16-bit) and the scores (fp32)
  const size_t key = per_key(p) ? size_t(hs) * kC * (plan.kk * 2 + kC * 4) : 0;
  *bytes = scal + 2 * wk + u + hc + key;
  return plan;
}

// The backward's extra scratch after the forward's: T, w q^ (per-key gates: the forward's), du,
// dh1 per chunk, the three matrices, with per-key gates A / b and Z, Y, X; then (zeroed by the
// caller) dq and dk in float32.
size_t chunk_bwd_extra(const DeltaParamsT<float>& p, const delta_chunk::DeltaChunkPlan& plan) {
  using delta_chunk::kC;
  const size_t hs = size_t(p.h_v) * plan.slots;
  const size_t key = per_key(p) ? kC * kC * 4 + 3 * kC * plan.kk * 2 : kC * plan.kk * 2;
  return hs * (kC * kC * 2 + key + kC * plan.vp() * 2 + plan.kk * plan.vp() * 2 + 3 * kC * kC * 2);
}
size_t chunk_bwd_zeroed(const DeltaParamsT<float>& p) {
  const size_t rows = p.cu_seqlens != nullptr ? 1 : size_t(p.b);  // a varlen pack is one batch row
  return 2 * rows * p.h_k * p.s * p.dim_k * 4;
}

// The forward's part of a plan carved from `at` (advanced past it).
void carve_fwd(const DeltaParamsT<float>& p, delta_chunk::DeltaChunkPlan& plan, char*& at) {
  const int64_t hs = int64_t(p.h_v) * plan.slots;
  plan.scal = reinterpret_cast<float*>(at);
  at += size_t(hs) * delta_chunk::kScalars * 4;
  plan.w = at;
  at += size_t(hs) * delta_chunk::kC * plan.kk * 2;
  plan.kt = at;
  at += size_t(hs) * delta_chunk::kC * plan.kk * 2;
  plan.u = at;
  at += size_t(hs) * delta_chunk::kC * plan.vp() * 2;
  plan.hc = at;
  at += size_t(hs) * plan.kk * plan.vp() * 2;
  if (per_key(p)) {
    plan.qd = at;
    at += size_t(hs) * delta_chunk::kC * plan.kk * 2;
    plan.sc = reinterpret_cast<float*>(at);
    at += size_t(hs) * delta_chunk::kC * delta_chunk::kC * 4;
  }
}

// One launch of a chunk kernel: its dynamic shared memory reserved, the grid of 128-thread CTAs.
template <typename Params>
void chunk_launch(void (*kernel)(Params, delta_chunk::DeltaChunkPlan), int smem, dim3 grid, const Params& p,
                  const delta_chunk::DeltaChunkPlan& plan, cudaStream_t stream, const char* what) {
  set_smem(kernel, smem, what);
  ATTN_LAUNCH(kernel, grid, dim3(delta_chunk::kThreads), size_t(smem), stream)(p, plan);
  check_launch(what);
}

template <typename T, int kK>
void launch_delta_chunk(const DeltaParamsT<float>& p, delta_chunk::DeltaChunkPlan plan, cudaStream_t stream,
                        const char* what) {
  using namespace delta_chunk;
  if (plan.slots > 0x7fffffff) throw std::runtime_error(std::string(what) + ": too many chunks for one launch");
  const unsigned slots = unsigned(plan.slots);
  const dim3 per_slot(slots, unsigned(p.h_v)), walk(unsigned(plan.tiles), unsigned(p.h_v), unsigned(p.b)),
      per_tile(slots, unsigned(p.h_v), unsigned(plan.tiles));
  if (per_key(p)) {
    chunk_launch(delta_chunk_prep_key_kernel<T, kK>, PrepKeySmem<kK>::kBytes, per_slot, p, plan, stream, what);
    chunk_launch(delta_chunk_state_kernel<T, kK, true>, StateSmem<kK>::kBytes, walk, p, plan, stream, what);
    chunk_launch(delta_chunk_out_key_kernel<T, kK>, OutKeySmem<kK>::kBytes, per_tile, p, plan, stream, what);
    return;
  }
  chunk_launch(delta_chunk_prep_kernel<T, kK>, PrepSmem<kK>::kBytes, per_slot, p, plan, stream, what);
  chunk_launch(delta_chunk_state_kernel<T, kK, false>, StateSmem<kK>::kBytes, walk, p, plan, stream, what);
  chunk_launch(delta_chunk_out_kernel<T, kK>, OutSmem<kK>::kBytes, per_tile, p, plan, stream, what);
}

template <typename T, int KS, int kRows>
void launch_delta_fwd(const DeltaParamsT<float>& p, cudaStream_t stream, const char* what) {
  constexpr int kBV = delta_cuda::kWarps * (32 / KS), kKp = KS * kRows;
  const int per_token = delta_cuda::token_floats(kKp, kBV, per_key(p));
  const int tokens = std::clamp(delta_cuda::kSmemBudget / 4 / per_token - 1, 1, delta_cuda::kMaxTokens);
  const int bytes = (tokens * per_token + 4) * 4;
  const dim3 grid(unsigned((p.dim_v + kBV - 1) / kBV), unsigned(p.h_v), unsigned(p.b));
  auto kernel = &delta_cuda::delta_fwd_kernel<T, KS, kRows>;
  set_smem(kernel, bytes, what);
  ATTN_LAUNCH(kernel, grid, dim3(delta_cuda::kThreads), size_t(bytes), stream)(p, tokens);
  check_launch(what);
}

template <typename T>
void delta_fwd_dtype(const DeltaParamsT<float>& p, cudaStream_t stream, const char* what) {
  const int k = p.dim_k;
  if (k <= 16) return launch_delta_fwd<T, 1, 16>(p, stream, what);
  if (k <= 32) return launch_delta_fwd<T, 2, 16>(p, stream, what);
  if (k <= 64) return launch_delta_fwd<T, 4, 16>(p, stream, what);
  if (k <= 128) return launch_delta_fwd<T, 8, 16>(p, stream, what);
  if (k <= 256) return launch_delta_fwd<T, 16, 16>(p, stream, what);
  if (k <= 512) return launch_delta_fwd<T, 32, 16>(p, stream, what);
  return launch_delta_fwd<T, 32, 32>(p, stream, what);
}

}  // namespace

void cuda_delta_set_kernels(const DeltaCudaKernels& k) { g_chunked.store(k.chunked); }
DeltaCudaKernels cuda_delta_kernels() { return DeltaCudaKernels{g_chunked.load()}; }

size_t cuda_delta_fwd_scratch_bytes(const DeltaParamsT<float>& p, const DeltaCudaKernels& k) {
  size_t bytes = 0;
  if (use_chunk(p, k)) chunk_plan(p, &bytes);
  return bytes;
}

namespace {

template <typename T, int kK>
void launch_delta_chunk_bwd(const DeltaBwdParamsT<float>& p, const delta_chunk::DeltaChunkPlan& plan,
                            cudaStream_t stream, const char* what) {
  using namespace delta_chunk;
  if (plan.slots > 0x7fffffff) throw std::runtime_error(std::string(what) + ": too many chunks for one launch");
  const unsigned slots = unsigned(plan.slots);
  // the forward's chunk quantities, entering states and u (no outputs, no final state)
  DeltaParamsT<float> fp = p;
  fp.final_state = nullptr;
  fp.o = nullptr;
  if (per_key(p)) {
    const dim3 per_slot(slots, unsigned(p.h_v)), walk(unsigned(plan.tiles), unsigned(p.h_v), unsigned(p.b)),
        per_tile(slots, unsigned(p.h_v), unsigned(plan.tiles));
    chunk_launch(delta_chunk_prep_key_kernel<T, kK>, PrepKeySmem<kK>::kBytes, per_slot, fp, plan, stream, what);
    chunk_launch(delta_chunk_state_kernel<T, kK, true>, StateSmem<kK>::kBytes, walk, fp, plan, stream, what);
    chunk_launch(delta_chunk_dlocal_key_kernel<T>, int(tc::SmemTile<kC, kBV>::kBytes), per_tile, p, plan, stream, what);
    chunk_launch(delta_chunk_rev_kernel<T, kK, true>, RevSmem<kK>::kBytes, walk, p, plan, stream, what);
    chunk_launch(delta_chunk_dscal_key_kernel<T, kK>, DscalKeySmem<kK>::kBytes, per_slot, p, plan, stream, what);
    chunk_launch(delta_chunk_dzyx_kernel<T, kK>, DzyxSmem<kK>::kBytes, per_slot, p, plan, stream, what);
    chunk_launch(delta_chunk_dkey_kernel<T, kK>, DkeySmem<kK>::kBytes, per_slot, p, plan, stream, what);
    return;
  }
  chunk_launch(delta_chunk_prep_kernel<T, kK>, PrepSmem<kK>::kBytes, dim3(slots, unsigned(p.h_v)), fp, plan, stream, what);
  chunk_launch(delta_chunk_state_kernel<T, kK, false>, StateSmem<kK>::kBytes, dim3(unsigned(plan.tiles), unsigned(p.h_v), unsigned(p.b)), fp, plan, stream, what);
  chunk_launch(delta_chunk_dlocal_kernel<T, kK>, DlocalSmem<kK>::kBytes, dim3(slots, unsigned(p.h_v), unsigned(plan.tiles)), p, plan, stream, what);
  chunk_launch(delta_chunk_rev_kernel<T, kK, false>, RevSmem<kK>::kBytes, dim3(unsigned(plan.tiles), unsigned(p.h_v), unsigned(p.b)), p, plan, stream, what);
  chunk_launch(delta_chunk_dscal_kernel<T, kK>, DscalSmem<kK>::kBytes, dim3(slots, unsigned(p.h_v)), p, plan, stream, what);
  chunk_launch(delta_chunk_dqk_kernel<T, kK>, DqkSmem<kK>::kBytes, dim3(slots, unsigned(p.h_v)), p, plan, stream, what);
}

}  // namespace

bool cuda_delta_bwd_fits(const DeltaParamsT<float>& p) { return chunk_fits(p, true); }

size_t cuda_delta_bwd_scratch_bytes(const DeltaParamsT<float>& p, size_t* zeroed) {
  size_t bytes = 0;
  const delta_chunk::DeltaChunkPlan plan = chunk_plan(p, &bytes);
  *zeroed = chunk_bwd_zeroed(p);
  return *zeroed + bytes + chunk_bwd_extra(p, plan);
}

void cuda_delta_bwd(const DeltaBwdParamsT<float>& p, void* scratch, cudaStream_t stream) {
  const char* what = "attention_ext.delta_rule_attention backward (CUDA)";
  check_grid(p.h_v, p.b, what);
  if (!chunk_fits(p, true)) {
    throw std::runtime_error(std::string(what) + ": the chunk kernels do not take this call (bf16 or fp16, the "
                             "plain write with per-key gates only, K <= 128, K and V multiples of 8, 16-byte rows)");
  }
  size_t bytes = 0;
  delta_chunk::DeltaChunkPlan plan = chunk_plan(p, &bytes);
  const size_t half = chunk_bwd_zeroed(p) / 2;
  char* at = static_cast<char*>(scratch);
  plan.dq = reinterpret_cast<float*>(at);
  plan.dk = reinterpret_cast<float*>(at + half);
  at += 2 * half;
  carve_fwd(p, plan, at);
  const size_t hs = size_t(p.h_v) * plan.slots;
  using delta_chunk::kC;
  plan.t = at;
  at += hs * kC * kC * 2;
  if (per_key(p)) {  // w(i, -1) q^ is the forward's; A / b and Z, Y, X
    plan.qg = plan.qd;
    plan.aa = reinterpret_cast<float*>(at);
    at += hs * kC * kC * 4;
    plan.zyx = at;
    at += hs * 3 * kC * plan.kk * 2;
  } else {
    plan.qg = at;
    at += hs * kC * plan.kk * 2;
  }
  plan.du = at;
  at += hs * kC * plan.vp() * 2;
  plan.dhc = at;
  at += hs * plan.kk * plan.vp() * 2;
  plan.mm = at;
  const bool f16 = p.dt == DType::kF16;
  if (plan.kk == 64) {
    return f16 ? launch_delta_chunk_bwd<__half, 64>(p, plan, stream, what)
               : launch_delta_chunk_bwd<__nv_bfloat16, 64>(p, plan, stream, what);
  }
  return f16 ? launch_delta_chunk_bwd<__half, 128>(p, plan, stream, what)
             : launch_delta_chunk_bwd<__nv_bfloat16, 128>(p, plan, stream, what);
}

void cuda_delta_fwd(const DeltaParamsT<float>& p, const DeltaCudaKernels& k, void* scratch, cudaStream_t stream) {
  const char* what = "attention_ext.delta_rule_attention (CUDA)";
  check_grid(p.h_v, p.b, what);
  if (p.dim_k > 1024) throw std::runtime_error(std::string(what) + ": K must be <= 1024");
  if (use_chunk(p, k)) {
    size_t bytes = 0;
    delta_chunk::DeltaChunkPlan plan = chunk_plan(p, &bytes);
    if (scratch == nullptr) throw std::runtime_error(std::string(what) + ": the chunked kernels need their scratch");
    char* at = static_cast<char*>(scratch);
    carve_fwd(p, plan, at);
    const bool f16 = p.dt == DType::kF16;
    if (plan.kk == 64) {
      return f16 ? launch_delta_chunk<__half, 64>(p, plan, stream, what)
                 : launch_delta_chunk<__nv_bfloat16, 64>(p, plan, stream, what);
    }
    return f16 ? launch_delta_chunk<__half, 128>(p, plan, stream, what)
               : launch_delta_chunk<__nv_bfloat16, 128>(p, plan, stream, what);
  }
  switch (p.dt) {
    case DType::kF32: return delta_fwd_dtype<float>(p, stream, what);
    case DType::kF16: return delta_fwd_dtype<__half>(p, stream, what);
    case DType::kBF16: return delta_fwd_dtype<__nv_bfloat16>(p, stream, what);
    default: throw std::runtime_error(std::string(what) + ": the CUDA kernels take float32, float16 or bfloat16");
  }
}

}  // namespace attn
