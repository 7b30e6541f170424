// cuda_linear_fwd / cuda_linear_bwd (entry.h): choose and launch the kernels.
//
// fp16 / bf16 inputs with M <= 128 on sm_80+ run on tensor cores (mma_fwd_kernel.cuh,
// mma_bwd_kernel.cuh; feature-width bucket 64 or 128); the rest on the SIMT kernels of
// simt_kernel.cuh (fp32 FMA, every dtype and width). The backward is three steps on one stream:
// the chunked kernel (tensor-core or SIMT: both add into the same zeroed scratch with atomics),
// the conversion of dq / dk / dv, and ddecay's reverse running sum (simt_kernel.cuh's, shared).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "cuda/launch.h"
#include "linear/cuda/chunk_bwd_kernel.cuh"
#include "linear/cuda/chunk_fwd_kernel.cuh"
#include "linear/cuda/entry.h"
#include "linear/cuda/mma_bwd_kernel.cuh"
#include "linear/cuda/mma_fwd_kernel.cuh"
#include "linear/cuda/simt_kernel.cuh"
#include "linear/cuda/step_kernel.cuh"

namespace attn {

namespace linear_cuda {

using linear_simt::kThreads;

int num_tiles(const LinearParamsT<float>& p) {
  const int w = linear_simt::tile_cols(p.d);
  return (p.dim_v + w - 1) / w;
}

// B_t * heads * rows of a scratch part (entry.h)
int64_t scratch_rows(const LinearParamsT<float>& p, int heads) {
  const int64_t bt = p.cu_seqlens != nullptr ? 1 : p.b;
  return bt * heads * p.seq_head_stride;
}

template <typename T>
void run_fwd(const LinearParamsT<float>& p, cudaStream_t stream) {
  const char* what = "attention_ext.linear (CUDA forward)";
  check_grid(p.h, p.b, what);
  const int smem = linear_simt::fwd_smem_floats(p.d) * int(sizeof(float));
  // out's rounding residual: 16-bit normalized calls that keep it (linear_params.h o_res)
  auto kernel = &linear_simt::fwd_kernel<T, false>;
  if constexpr (!std::is_same_v<T, float>) {
    if (p.o_res != nullptr) kernel = &linear_simt::fwd_kernel<T, true>;
  }
  set_smem(kernel, smem, what);
  const dim3 grid(num_tiles(p), p.h, p.b);
  ATTN_LAUNCH(kernel, grid, dim3(kThreads), smem, stream)(p);
  check_launch(what);
}

// fp16 / bf16 only (TypeOps); M <= kM
// the selection in one word (bit 32: chunk_parallel, bit 33: chunk_states, low 32 bits:
// segment_chunks), so that a
// reader never sees half of an update; it starts as LinearCudaKernels{} (entry.h), the defaults'
// one home
constexpr uint64_t pack_kernels(const LinearCudaKernels& k) {
  return (uint64_t(k.chunk_states) << 33) | (uint64_t(k.chunk_parallel) << 32) | uint32_t(k.segment_chunks);
}
std::atomic<uint64_t> g_kernels{pack_kernels(LinearCudaKernels{})};

int value_tiles_tc(const LinearParamsT<float>& p) { return (p.dim_v + linear_tc::kN - 1) / linear_tc::kN; }

// The chunk-parallel forward's segments: enough CTAs (value tiles x heads x sequences x
// segments) for kCtasPerSm waves' worth of the device's SMs, each segment whole chunks; the
// state scratch grows with the segment count (one (M, Dv + 1) fp32 matrix per segment and head,
// 66 KB at M = Dv = 128), so no more segments than that.
linear_tc::SegPlan plan_segments(const LinearParamsT<float>& p, const LinearCudaKernels& k) {
  constexpr int kCtasPerSm = 8;
  const int64_t chunks = std::max<int64_t>(1, (int64_t(p.sq) + linear_simt::kChunk - 1) / linear_simt::kChunk);
  int64_t seg_chunks = k.segment_chunks;
  if (seg_chunks <= 0) {
    const int64_t base = int64_t(value_tiles_tc(p)) * p.h * p.b;
    const int64_t want = (int64_t(kCtasPerSm) * device_sm_count() + base - 1) / base;
    const int64_t n_seg = std::clamp<int64_t>(want, 1, chunks);
    seg_chunks = (chunks + n_seg - 1) / n_seg;
  }
  seg_chunks = std::min(seg_chunks, chunks);
  linear_tc::SegPlan plan;
  plan.n_seg = int((chunks + seg_chunks - 1) / seg_chunks);
  plan.seg_rows = int(seg_chunks * linear_simt::kChunk);
  return plan;
}

// states (and, for the backward, ustates) then gtot, floats
size_t seg_scratch_floats(const LinearParamsT<float>& p, const linear_tc::SegPlan& plan, bool bwd = false) {
  const int64_t heads = int64_t(p.b) * p.h;
  return size_t((bwd ? 2 : 1) * heads * (plan.n_seg + 1) * int64_t(p.d) * p.dim_v_aug + heads * plan.n_seg);
}

linear_tc::SegPlan carve_plan(const LinearParamsT<float>& p, const LinearCudaKernels& k, float* scratch, bool bwd) {
  linear_tc::SegPlan plan = plan_segments(p, k);
  const size_t states = size_t(int64_t(p.b) * p.h * (plan.n_seg + 1) * int64_t(p.d) * p.dim_v_aug);
  plan.states = scratch;
  plan.ustates = bwd ? scratch + states : nullptr;
  plan.gtot = scratch + (bwd ? 2 : 1) * states;
  return plan;
}


// The chunk-state forward (chunk_fwd_kernel.cuh) takes the call: selected, and every row of
// q, k, v and out is whole 16-byte vectors (the kernels copy by cp.async and store pairs).
bool use_chunk_states(const LinearParamsT<float>& p, const LinearCudaKernels& k) {
  if (!k.chunk_parallel || !k.chunk_states) return false;
  auto al = [](const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; };
  auto st = [](int64_t bs, int64_t hs, int64_t rs) { return bs % 8 == 0 && hs % 8 == 0 && rs % 8 == 0; };
  return p.d % 8 == 0 && p.dim_v % 8 == 0 && al(p.q) && al(p.k) && al(p.v) && al(p.o) &&
         st(p.q_batch_stride, p.q_head_stride, p.q_row_stride) && st(p.k_batch_stride, p.k_head_stride, p.k_row_stride) &&
         st(p.v_batch_stride, p.v_head_stride, p.v_row_stride) && st(p.o_batch_stride, p.o_head_stride, p.o_row_stride);
}

// The chunk-state backward: the forward's rule and dout's rows as 16-byte vectors too.
bool use_chunk_states(const LinearBwdParamsT<float>& p, const LinearCudaKernels& k) {
  const LinearParamsT<float>& fp = p;
  return use_chunk_states(fp, k) && (reinterpret_cast<uintptr_t>(p.dout) & 15) == 0 && p.do_batch_stride % 8 == 0 &&
         p.do_head_stride % 8 == 0 && p.do_row_stride % 8 == 0;
}

int feature_bucket(const LinearParamsT<float>& p) { return p.d <= 64 ? 64 : 128; }

// The chunk-state scratch: the 16-bit states (two per float), then z, then sigma (ChunkPlan).
linear_tc::ChunkPlan chunk_plan(const LinearParamsT<float>& p, float* scratch, size_t* floats) {
  linear_tc::ChunkPlan plan;
  plan.nt = int(std::max<int64_t>(1, (int64_t(p.sq) + linear_simt::kChunk - 1) / linear_simt::kChunk));
  plan.tiles = value_tiles_tc(p);
  plan.chunk_slots = p.cu_seqlens != nullptr ? p.seq_head_stride / linear_simt::kChunk + p.b : int64_t(p.b) * plan.nt;
  const int64_t slots = int64_t(p.h) * (plan.chunk_slots + p.b), km = feature_bucket(p);
  const int64_t h_floats = slots * plan.tiles * km * linear_tc::kN / 2, z_floats = slots * km;
  // a multiple of 4 floats, so that a plan carved after this one keeps its states 16-byte aligned
  if (floats != nullptr) *floats = size_t((h_floats + z_floats + slots * plan.tiles + 3) / 4 * 4);
  if (scratch != nullptr) {
    plan.h = scratch;
    plan.z = scratch + h_floats;
    plan.sigma = plan.z + z_floats;
  }
  return plan;
}

template <typename T, int kM>
void run_fwd_chunk_states(const LinearParamsT<float>& p, float* scratch, cudaStream_t stream) {
  const char* what = "attention_ext.linear (CUDA chunk-state forward)";
  const linear_tc::ChunkPlan plan = chunk_plan(p, scratch, nullptr);
  if (int64_t(plan.tiles) * plan.nt > 0x7fffffff) throw std::runtime_error(std::string(what) + ": too many chunks");
  auto state_kernel = &linear_tc::chunk_state_kernel<T, kM>;
  auto out_kernel = &linear_tc::chunk_out_kernel<T, kM>;
  constexpr int state_smem = linear_tc::StateSmem<kM>::kBytes, out_smem = linear_tc::OutSmem<kM>::kBytes;
  set_smem(state_kernel, state_smem, what);
  set_smem(out_kernel, out_smem, what);
  ATTN_LAUNCH(state_kernel, dim3(plan.tiles, p.h, p.b), dim3(linear_tc::kThreads), state_smem, stream)(p, plan);
  check_launch(what);
  ATTN_LAUNCH(out_kernel, dim3(plan.tiles * plan.nt, p.h, p.b), dim3(linear_tc::kThreads), out_smem, stream)(p, plan);
  check_launch(what);
}

template <typename T, int kM>
void run_fwd_tc(const LinearParamsT<float>& p, const LinearCudaKernels& k, float* scratch, cudaStream_t stream) {
  const char* what = "attention_ext.linear (CUDA tensor-core forward)";
  if (scratch != nullptr && use_chunk_states(p, k)) {
    check_grid(p.h, p.b, what);
    run_fwd_chunk_states<T, kM>(p, scratch, stream);
    return;
  }
  check_grid(p.h, p.b, what);
  constexpr int smem = linear_tc::Smem<kM>::kBytes;
  const int tiles = value_tiles_tc(p);
  if (scratch == nullptr) {
    auto kernel = &linear_tc::fwd_kernel<T, kM, linear_tc::FwdMode::kWhole>;
    set_smem(kernel, smem, what);
    ATTN_LAUNCH(kernel, dim3(tiles, p.h, p.b), dim3(linear_tc::kThreads), smem, stream)(p, linear_tc::SegPlan{});
    check_launch(what);
    return;
  }
  const linear_tc::SegPlan plan = carve_plan(p, k, scratch, false);
  if (int64_t(tiles) * plan.n_seg > 0x7fffffff) throw std::runtime_error(std::string(what) + ": too many segments");
  const dim3 grid(tiles * plan.n_seg, p.h, p.b);
  auto state_kernel = &linear_tc::fwd_kernel<T, kM, linear_tc::FwdMode::kSegState>;
  auto out_kernel = &linear_tc::fwd_kernel<T, kM, linear_tc::FwdMode::kSegOut>;
  set_smem(state_kernel, smem, what);
  set_smem(out_kernel, smem, what);
  ATTN_LAUNCH(state_kernel, grid, dim3(linear_tc::kThreads), smem, stream)(p, plan);
  check_launch(what);
  const int64_t per = int64_t(p.d) * p.dim_v_aug;
  const dim3 scan_grid(unsigned((per + linear_tc::kThreads - 1) / linear_tc::kThreads), p.h, p.b);
  ATTN_LAUNCH(linear_tc::seg_scan_kernel, scan_grid, dim3(linear_tc::kThreads), 0, stream)(p, plan, false, p.init_state,
                                                                                            p.final_state);
  check_launch(what);
  ATTN_LAUNCH(out_kernel, grid, dim3(linear_tc::kThreads), smem, stream)(p, plan);
  check_launch(what);
}

template <typename T>
void run_fwd_tc(const LinearParamsT<float>& p, const LinearCudaKernels& k, float* scratch, cudaStream_t stream) {
  if (p.d <= 64) {
    run_fwd_tc<T, 64>(p, k, scratch, stream);
  } else {
    run_fwd_tc<T, 128>(p, k, scratch, stream);
  }
}

bool use_tensor_cores(const LinearParamsT<float>& p, DType dt) {
  return (dt == DType::kF16 || dt == DType::kBF16) && p.d <= kLinearTensorCoreMaxFeatures && device_sm() >= 80;
}

// the dq / dk / dv / dg accumulators of every backward (entry.h)
size_t base_bwd_scratch_floats(const LinearBwdParamsT<float>& p) {
  return size_t(scratch_rows(p, p.h) * (p.d + 1) + scratch_rows(p, p.h_k) * (p.d + p.dim_v));
}

linear_simt::BwdScratch carve_scratch(const LinearBwdParamsT<float>& p, float* scratch) {
  linear_simt::BwdScratch sc;
  sc.dq = scratch;
  sc.dk = sc.dq + scratch_rows(p, p.h) * p.d;
  sc.dv = sc.dk + scratch_rows(p, p.h_k) * p.d;
  sc.dg = sc.dv + scratch_rows(p, p.h_k) * p.dim_v;
  return sc;
}

template <typename T>
void run_bwd_simt(const LinearBwdParamsT<float>& p, const linear_simt::BwdScratch& sc, cudaStream_t stream) {
  const char* what = "attention_ext.linear (CUDA backward)";
  const int smem = linear_simt::bwd_smem_floats(p.d) * int(sizeof(float));
  auto kernel = &linear_simt::bwd_kernel<T>;
  set_smem(kernel, smem, what);
  const dim3 grid(num_tiles(p), p.h, p.b);
  ATTN_LAUNCH(kernel, grid, dim3(kThreads), smem, stream)(p, sc);
  check_launch(what);
}

// fp16 / bf16 only (TypeOps); M <= kM. seg_scratch: the chunk-parallel backward's segment
// states (carve_plan), or null for the sequential kernel.
// The chunk-state backward's scratch after the atomics' (entry.h): the forward states' plan, the
// reverse states' plan, then (normalize) 1 / den and dn per row of q.
size_t chunk_bwd_scratch_floats(const LinearBwdParamsT<float>& p) {
  size_t plan_floats = 0;
  chunk_plan(p, nullptr, &plan_floats);
  return 4 + 2 * plan_floats + (p.normalize ? 2 * size_t(scratch_rows(p, p.h)) : 0);  // 4: to align the start
}

template <typename T, int kM>
void run_bwd_chunk_states(const LinearBwdParamsT<float>& p, const linear_simt::BwdScratch& sc, float* scratch,
                          cudaStream_t stream) {
  const char* what = "attention_ext.linear (CUDA chunk-state backward)";
  // the atomics' scratch before this part has any length: the states need 16-byte alignment
  scratch = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch) + 15) & ~uintptr_t(15));
  size_t plan_floats = 0;
  linear_tc::ChunkPlan sp = chunk_plan(p, scratch, &plan_floats);
  linear_tc::ChunkPlan up = chunk_plan(p, scratch + plan_floats, nullptr);
  if (int64_t(sp.tiles) * sp.nt > 0x7fffffff) throw std::runtime_error(std::string(what) + ": too many chunks");
  const dim3 block(linear_tc::kThreads), walk_grid(sp.tiles, p.h, p.b);
  if (p.normalize) {
    float* inv = scratch + 2 * plan_floats;
    float* dn = inv + scratch_rows(p, p.h);
    ATTN_LAUNCH(linear_tc::chunk_prep_kernel<T>, dim3(sp.nt, p.h, p.b), block, 0, stream)(p, sp, inv, dn);
    check_launch(what);
    sp.inv = up.inv = inv;
    sp.dn = up.dn = dn;
  }
  // the forward states again (no final state written: the forward has it), with dG_T's term
  LinearBwdParamsT<float> fp = p;
  fp.final_state = nullptr;
  linear_tc::ChunkPlan walk = sp;
  walk.inv = walk.dn = nullptr;
  walk.dg = p.decay != nullptr && p.ddecay != nullptr ? sc.dg : nullptr;
  constexpr int walk_smem = linear_tc::StateSmem<kM>::kBytes, grad_smem = linear_tc::GradSmem<kM>::kBytes;
  auto state_kernel = &linear_tc::chunk_state_bwd_kernel<T, kM>;
  auto rev_kernel = &linear_tc::chunk_rev_kernel<T, kM>;
  auto dq_kernel = &linear_tc::chunk_grad_kernel<T, kM, linear_tc::GradPart::kDq>;
  auto dkv_kernel = &linear_tc::chunk_grad_kernel<T, kM, linear_tc::GradPart::kDkv>;
  set_smem(state_kernel, walk_smem, what);
  set_smem(rev_kernel, walk_smem, what);
  set_smem(dq_kernel, grad_smem, what);
  set_smem(dkv_kernel, grad_smem, what);
  ATTN_LAUNCH(state_kernel, walk_grid, block, walk_smem, stream)(fp, walk);
  check_launch(what);
  ATTN_LAUNCH(rev_kernel, walk_grid, block, walk_smem, stream)(fp, up);
  check_launch(what);
  const dim3 grad_grid(sp.tiles * sp.nt, p.h, p.b);
  ATTN_LAUNCH(dq_kernel, grad_grid, block, grad_smem, stream)(fp, sp, up, sc);
  check_launch(what);
  ATTN_LAUNCH(dkv_kernel, grad_grid, block, grad_smem, stream)(fp, sp, up, sc);
  check_launch(what);
}

template <typename T, int kM>
void run_bwd_tc(const LinearBwdParamsT<float>& p, const LinearCudaKernels& k, const linear_simt::BwdScratch& sc,
                float* seg_scratch,
                cudaStream_t stream) {
  using linear_tc::BwdMode;
  const char* what = "attention_ext.linear (CUDA tensor-core backward)";
  if (seg_scratch != nullptr && use_chunk_states(p, k)) {
    run_bwd_chunk_states<T, kM>(p, sc, seg_scratch, stream);
    return;
  }
  constexpr int smem = linear_tc::BwdSmem<kM>::kBytes;
  const int tiles = value_tiles_tc(p);
  const dim3 block(linear_tc::kThreads);
  if (seg_scratch == nullptr) {
    auto kernel = &linear_tc::bwd_kernel<T, kM, BwdMode::kWhole>;
    set_smem(kernel, smem, what);
    ATTN_LAUNCH(kernel, dim3(tiles, p.h, p.b), block, smem, stream)(p, sc, linear_tc::SegPlan{});
    check_launch(what);
    return;
  }
  const linear_tc::SegPlan plan = carve_plan(p, k, seg_scratch, true);
  if (int64_t(tiles) * plan.n_seg > 0x7fffffff) throw std::runtime_error(std::string(what) + ": too many segments");
  const dim3 grid(tiles * plan.n_seg, p.h, p.b);
  const int64_t per = int64_t(p.d) * p.dim_v_aug;
  const dim3 scan_grid(unsigned((per + linear_tc::kThreads - 1) / linear_tc::kThreads), p.h, p.b);
  // the forward's segment states and their scan: the state entering each segment
  constexpr int fwd_smem = linear_tc::Smem<kM>::kBytes;
  auto state_kernel = &linear_tc::fwd_kernel<T, kM, linear_tc::FwdMode::kSegState>;
  set_smem(state_kernel, fwd_smem, what);
  const LinearParamsT<float>& fp = p;
  ATTN_LAUNCH(state_kernel, grid, block, fwd_smem, stream)(fp, plan);
  check_launch(what);
  ATTN_LAUNCH(linear_tc::seg_scan_kernel, scan_grid, block, 0, stream)(fp, plan, false, p.init_state, nullptr);
  check_launch(what);
  // the reverse states: each segment's own, then the reverse scan (dS_0 = dinit_state)
  auto u_kernel = &linear_tc::bwd_kernel<T, kM, BwdMode::kSegU>;
  set_smem(u_kernel, smem, what);
  ATTN_LAUNCH(u_kernel, grid, block, smem, stream)(p, sc, plan);
  check_launch(what);
  ATTN_LAUNCH(linear_tc::seg_scan_kernel, scan_grid, block, 0, stream)(fp, plan, true, p.dfinal_state, p.dinit_state);
  check_launch(what);
  auto dq_kernel = &linear_tc::bwd_kernel<T, kM, BwdMode::kSegDq>;
  auto dkv_kernel = &linear_tc::bwd_kernel<T, kM, BwdMode::kSegDkv>;
  set_smem(dq_kernel, smem, what);
  set_smem(dkv_kernel, smem, what);
  ATTN_LAUNCH(dq_kernel, grid, block, smem, stream)(p, sc, plan);
  check_launch(what);
  ATTN_LAUNCH(dkv_kernel, grid, block, smem, stream)(p, sc, plan);
  check_launch(what);
}

// The chunked kernel (tensor cores when use_tensor_cores), then finalize_kernel and
// ddecay_kernel on the scratch.
template <typename T>
void run_bwd(const LinearBwdParamsT<float>& p, const LinearCudaKernels& k, bool tensor_cores, float* scratch,
             cudaStream_t stream) {
  const char* what = "attention_ext.linear (CUDA backward)";
  check_grid(p.h, p.b, what);
  const linear_simt::BwdScratch sc = carve_scratch(p, scratch);
  if constexpr (!std::is_same_v<T, float>) {
    if (tensor_cores) {
      // the chunk-parallel backward's segment scratch follows the atomics' (entry.h)
      float* seg = k.chunk_parallel ? scratch + base_bwd_scratch_floats(p) : nullptr;
      if (p.d <= 64) {
        run_bwd_tc<T, 64>(p, k, sc, seg, stream);
      } else {
        run_bwd_tc<T, 128>(p, k, sc, seg, stream);
      }
    }
  }
  if (std::is_same_v<T, float> || !tensor_cores) run_bwd_simt<T>(p, sc, stream);
  // grid-stride loops: enough blocks to fill the device, no more
  const int64_t max_blocks = 4096;
  for (int which = 0; which < 3; ++which) {
    const int heads = which == 0 ? p.h : p.h_k;
    const int64_t n = scratch_rows(p, heads) * (which == 2 ? p.dim_v : p.d);
    const int blocks = int(std::max<int64_t>(1, std::min<int64_t>(max_blocks, (n + kThreads - 1) / kThreads)));
    ATTN_LAUNCH(linear_simt::finalize_kernel<T>, dim3(blocks), dim3(kThreads), 0, stream)(p, sc, which);
    check_launch(what);
  }
  if (p.ddecay != nullptr) {
    const int blocks = int((int64_t(p.b) * p.h + kThreads - 1) / kThreads);
    ATTN_LAUNCH(linear_simt::ddecay_kernel, dim3(blocks), dim3(kThreads), 0, stream)(p, sc);
    check_launch(what);
  }
}

}  // namespace linear_cuda

void cuda_linear_step(const LinearStepParamsT<float>& p, DType dt, cudaStream_t stream) {
  const char* what = "attention_ext.linear_step (CUDA)";
  if (p.b > 65535) throw std::runtime_error(std::string(what) + ": batch must be <= 65535");
  const int64_t bytes = int64_t(linear_step_cuda::smem_floats(p.d)) * 4;
  if (bytes > 227 * 1024) {  // sm_90's most; set_smem names a smaller device limit
    throw std::runtime_error(std::string(what) + ": feature width " + std::to_string(p.d) + " needs " +
                             std::to_string(bytes) + " bytes of shared memory (12 floats per feature), more than a CTA has");
  }
  const dim3 grid(unsigned(p.h), unsigned(p.b));
  auto launch = [&](auto kernel) {
    set_smem(kernel, int(bytes), what);
    ATTN_LAUNCH(kernel, grid, dim3(linear_step_cuda::kThreads), size_t(bytes), stream)(p);
    check_launch(what);
  };
  switch (dt) {
    case DType::kF32: launch(&linear_step_cuda::step_kernel<float>); break;
    case DType::kF16: launch(&linear_step_cuda::step_kernel<__half>); break;
    case DType::kBF16: launch(&linear_step_cuda::step_kernel<__nv_bfloat16>); break;
    default: throw std::runtime_error(std::string(what) + ": the CUDA kernels take float32, float16 or bfloat16");
  }
}

void cuda_linear_set_kernels(const LinearCudaKernels& k) {
  if (k.segment_chunks < 0) throw std::runtime_error("attention_ext.linear: segment_chunks must be >= 0");
  linear_cuda::g_kernels.store(linear_cuda::pack_kernels(k));
}

LinearCudaKernels cuda_linear_kernels() {
  const uint64_t w = linear_cuda::g_kernels.load();
  return LinearCudaKernels{((w >> 32) & 1) != 0, int(uint32_t(w)), ((w >> 33) & 1) != 0};
}

size_t cuda_linear_fwd_scratch_floats(const LinearParamsT<float>& p, DType dt, const LinearCudaKernels& k) {
  if (!k.chunk_parallel || !linear_cuda::use_tensor_cores(p, dt)) return 0;
  if (linear_cuda::use_chunk_states(p, k)) {
    size_t n = 0;
    linear_cuda::chunk_plan(p, nullptr, &n);
    return n;
  }
  return linear_cuda::seg_scratch_floats(p, linear_cuda::plan_segments(p, k));
}

void cuda_linear_fwd(const LinearParamsT<float>& p, DType dt, const LinearCudaKernels& k, float* scratch,
                     cudaStream_t stream) {
  if (linear_cuda::use_tensor_cores(p, dt)) {
    if (dt == DType::kF16) {
      linear_cuda::run_fwd_tc<__half>(p, k, scratch, stream);
    } else {
      linear_cuda::run_fwd_tc<__nv_bfloat16>(p, k, scratch, stream);
    }
    return;
  }
  switch (dt) {
    case DType::kF32: linear_cuda::run_fwd<float>(p, stream); break;
    case DType::kF16: linear_cuda::run_fwd<__half>(p, stream); break;
    case DType::kBF16: linear_cuda::run_fwd<__nv_bfloat16>(p, stream); break;
    default: throw std::runtime_error("attention_ext.linear: the CUDA kernels take float32, float16 or bfloat16");
  }
}

size_t cuda_linear_bwd_scratch_floats(const LinearBwdParamsT<float>& p, DType dt, const LinearCudaKernels& k) {
  size_t n = linear_cuda::base_bwd_scratch_floats(p);
  if (k.chunk_parallel && linear_cuda::use_tensor_cores(p, dt)) {
    n += linear_cuda::use_chunk_states(p, k) ? linear_cuda::chunk_bwd_scratch_floats(p)
                                             : linear_cuda::seg_scratch_floats(p, linear_cuda::plan_segments(p, k), true);
  }
  return n;
}

void cuda_linear_bwd(const LinearBwdParamsT<float>& p, DType dt, const LinearCudaKernels& k, float* scratch,
                     cudaStream_t stream) {
  const bool tc = linear_cuda::use_tensor_cores(p, dt);
  switch (dt) {
    case DType::kF32: linear_cuda::run_bwd<float>(p, k, false, scratch, stream); break;
    case DType::kF16: linear_cuda::run_bwd<__half>(p, k, tc, scratch, stream); break;
    case DType::kBF16: linear_cuda::run_bwd<__nv_bfloat16>(p, k, tc, scratch, stream); break;
    default: throw std::runtime_error("attention_ext.linear: the CUDA kernels take float32, float16 or bfloat16");
  }
}

}  // namespace attn
