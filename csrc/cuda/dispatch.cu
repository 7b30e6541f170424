// cuda_fwd / cuda_bwd: choose the kernel family for a config and launch it.
//
// Tensor cores (mma.sync) take fp16/bf16 on sm_80+ when the head dim is a multiple of 8 (so
// rows are whole 16-byte chunks) and the tensors are 16-byte aligned; everything else, and
// any head-dim bucket compiled out for a faster developer build (ATTN_CUDA_SKIP_HDIM64/128/
// 256), takes the SIMT kernels. ATTN_CUDA_SKIP_BWD compiles out the whole backward.
//
// The sm_90a wgmma forward (fwd_hopper_kernel.cuh) is opt-in until it has been verified on a
// GPU: ATTN_CUDA_HOPPER=1 (or 2: the variant with the softmax overlapped with P V), read on every
// call, sends what use_hopper_fwd() accepts there; the rest keeps the mma.sync kernels. It exists when the build compiled sm_90a code (setup.py
// defines ATTN_CUDA_HAVE_SM90A when the arch list has 9.0) and did not compile it out
// (ATTN_CUDA_SKIP_HOPPER).
//
// The sm_90a wgmma backward (bwd_hopper_kernel.cuh) is opt-in the same way, on its own switch:
// ATTN_CUDA_HOPPER_BWD=1 sends what use_hopper_bwd() accepts there (after the same preprocess,
// and followed by the same dq_accum conversion, as the mma.sync backward's atomic-dQ mode).
//
// Split-KV (flash-decoding): a forward on the mma.sync kernels whose grid would leave most SMs
// idle (few query blocks x heads x batch, e.g. a decode step) splits each query block's visible
// key blocks over num_splits CTAs and merges their partials in a combine kernel
// (cuda_fwd_num_splits; the caller allocates the scratch). Dropout is supported in splits: the
// mask is drawn at the same (row, key) coordinates. Opt-in until verified on a GPU:
// ATTN_CUDA_SPLITS=auto (the heuristic) or =N.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <nvtx3/nvToolsExt.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "launch.h"
#include "launch_impl.h"
#include "simt_kernel.cuh"
#include "traits.h"

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

void check_launch(const char* what) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": CUDA launch failed: " + cudaGetErrorString(e));
  }
}

namespace {

struct NvtxRange {
  explicit NvtxRange(const char* name) { nvtxRangePushA(name); }
  ~NvtxRange() { nvtxRangePop(); }
};

int device_sm() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    throw std::runtime_error("attention: cannot query the current CUDA device");
  }
  return major * 10 + minor;
}

// Streaming multiprocessors of the current device, queried once per device.
int device_sm_count() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) throw std::runtime_error("attention: cannot query the current CUDA device");
  if (dev >= 0 && dev < kMaxDevices) {
    const int n = cache[dev].load(std::memory_order_relaxed);
    if (n > 0) return n;
  }
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n < 1) {
    throw std::runtime_error("attention: cannot query the SM count of the current CUDA device");
  }
  if (dev >= 0 && dev < kMaxDevices) cache[dev].store(n, std::memory_order_relaxed);
  return n;
}

bool bucket_compiled(int bucket) {
  switch (bucket) {
#if !defined(ATTN_CUDA_SKIP_HDIM64)
    case 64: return true;
#endif
#if !defined(ATTN_CUDA_SKIP_HDIM128)
    case 128: return true;
#endif
#if !defined(ATTN_CUDA_SKIP_HDIM256)
    case 256: return true;
#endif
    default: return false;
  }
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }
bool strides8(int64_t a, int64_t b, int64_t c) { return a % 8 == 0 && b % 8 == 0 && c % 8 == 0; }

// The developer selection (launch.h), one copy per process; each field is read once per call.
std::atomic<int> g_hopper_fwd{0}, g_hopper_bwd{0}, g_tune_fwd{0}, g_tune_bwd{0};
std::atomic<bool> g_force_simt{false};

bool force_simt() { return g_force_simt.load(std::memory_order_relaxed); }

bool use_tensor_cores(const FwdParams& p, DType dt) {
  if (dt == DType::kF32 || force_simt()) return false;
  if (p.d > 256 || p.d % 8 != 0 || !bucket_compiled(bucket_for_head_dim(p.d))) return false;
  if (device_sm() < 80) return false;
  return aligned16(p.q) && aligned16(p.k) && aligned16(p.v) && aligned16(p.o) &&
         strides8(p.q_batch_stride, p.q_head_stride, p.q_row_stride) &&
         strides8(p.k_batch_stride, p.k_head_stride, p.k_row_stride) &&
         strides8(p.v_batch_stride, p.v_head_stride, p.v_row_stride) &&
         strides8(p.o_batch_stride, p.o_head_stride, p.o_row_stride);
}

// The wgmma forward covers the 64 and 128 buckets (when they and sm_90a code are compiled).
bool hopper_bucket_compiled(int bucket) {
#if ATTN_HOPPER_FWD
  return bucket != 256 && bucket_compiled(bucket);
#else
  (void)bucket;
  return false;
#endif
}

// 0 = off, 1 = the wgmma forward, 2 = its overlapped variant.
int hopper_mode() { return g_hopper_fwd.load(std::memory_order_relaxed); }

// The sm_90a wgmma forward takes a config when it is requested (ATTN_CUDA_HOPPER=1 or 2) and
// compiled for the bucket, the mma.sync path would take it (fp16/bf16, d % 8 == 0, 16-byte
// aligned rows), d <= 128, the device is sm_90, and the score needs no more than the plain
// policy (lengths, causal, sliding window; sinks only touch the LSE): softcap, ALiBi, bias or
// bool mask, and dropout keep the mma.sync kernel.
bool use_hopper_fwd(const FwdParams& p, DType dt) {
  if (hopper_mode() < 1) return false;
  if (p.d > 128 || !hopper_bucket_compiled(bucket_for_head_dim(p.d))) return false;
  if (p.softcap > 0.f || p.alibi_slopes != nullptr || p.bias_kind != BiasKind::kNone ||
      p.dropout_p > 0.f) {
    return false;
  }
  return use_tensor_cores(p, dt) && device_sm() == 90;
}

bool use_tensor_cores_bwd(const BwdParams& p, DType dt) {
  // dQ/dK/dV/dO are stored 4 bytes at a time and dO is read with cp.async
  return use_tensor_cores(p, dt) && aligned16(p.dout) &&
         strides8(p.do_batch_stride, p.do_head_stride, p.do_row_stride) &&
         strides8(p.dq_batch_stride, p.dq_head_stride, p.dq_row_stride) &&
         strides8(p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride) &&
         strides8(p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride) && aligned16(p.dq) &&
         aligned16(p.dk) && aligned16(p.dv);
}

#if ATTN_HOPPER_BWD
// The wgmma backward covers the 64 and 128 buckets (when they are compiled).
bool hopper_bwd_bucket_compiled(int bucket) { return bucket != 256 && bucket_compiled(bucket); }

// The sm_90a wgmma backward takes a config when it is requested (ATTN_CUDA_HOPPER_BWD=1, read on
// every call) and compiled for the bucket, the mma.sync backward would take it with atomic dQ
// (use_tensor_cores_bwd, not deterministic), d <= 128, the device is sm_90, and the score needs
// no more than the plain policy, as for use_hopper_fwd (sinks only touch the LSE it reads and
// dsinks, which the preprocess computes): softcap, ALiBi, bias or bool mask (so no dbias) and
// dropout keep the mma.sync kernels, and so does deterministic mode (its dQ kernel has no atomics).
bool use_hopper_bwd(const BwdParams& p, DType dt) {
  if (g_hopper_bwd.load(std::memory_order_relaxed) < 1) return false;
  if (p.d > 128 || !hopper_bwd_bucket_compiled(bucket_for_head_dim(p.d))) return false;
  if (p.softcap > 0.f || p.alibi_slopes != nullptr || p.bias_kind != BiasKind::kNone ||
      p.dropout_p > 0.f || p.dbias != nullptr || p.deterministic) {
    return false;
  }
  return use_tensor_cores_bwd(p, dt) && device_sm() == 90;
}
#endif

void validate(const FwdParams& p, const char* what) {
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


// One case per compiled head-dim bucket; use_tensor_cores() never picks a missing one.
template <typename T>
void fwd_tc(const FwdParams& p, cudaStream_t stream) {
  switch (bucket_for_head_dim(p.d)) {
#if !defined(ATTN_CUDA_SKIP_HDIM64)
    case 64: run_fwd_tc<T, 64>(p, stream); return;
#endif
#if !defined(ATTN_CUDA_SKIP_HDIM128)
    case 128: run_fwd_tc<T, 128>(p, stream); return;
#endif
#if !defined(ATTN_CUDA_SKIP_HDIM256)
    case 256: run_fwd_tc<T, 256>(p, stream); return;
#endif
    default: throw std::runtime_error("attention fwd: head-dim bucket not compiled");
  }
}

template <typename T>
void fwd_tc_split(const FwdParams& p, const FwdSplitScratch& split, cudaStream_t stream) {
  switch (bucket_for_head_dim(p.d)) {
#if !defined(ATTN_CUDA_SKIP_HDIM64)
    case 64: run_fwd_tc_split<T, 64>(p, split, stream); return;
#endif
#if !defined(ATTN_CUDA_SKIP_HDIM128)
    case 128: run_fwd_tc_split<T, 128>(p, split, stream); return;
#endif
#if !defined(ATTN_CUDA_SKIP_HDIM256)
    case 256: run_fwd_tc_split<T, 256>(p, split, stream); return;
#endif
    default: throw std::runtime_error("attention fwd: head-dim bucket not compiled");
  }
}

#if ATTN_HOPPER_FWD
// One case per compiled bucket; use_hopper_fwd() never picks a missing one.
template <typename T>
void fwd_hopper(const FwdParams& p, cudaStream_t stream) {
  switch (bucket_for_head_dim(p.d)) {
#if !defined(ATTN_CUDA_SKIP_HDIM64)
    case 64: run_fwd_hopper<T, 64>(p, hopper_mode() == 2, stream); return;
#endif
#if !defined(ATTN_CUDA_SKIP_HDIM128)
    case 128: run_fwd_hopper<T, 128>(p, hopper_mode() == 2, stream); return;
#endif
    default: throw std::runtime_error("attention fwd: no wgmma kernel for this head-dim bucket");
  }
}
#endif

#if ATTN_HOPPER_BWD
// One case per compiled bucket; use_hopper_bwd() never picks a missing one.
template <typename T>
void bwd_hopper(const BwdParams& p, cudaStream_t stream) {
  switch (bucket_for_head_dim(p.d)) {
#if !defined(ATTN_CUDA_SKIP_HDIM64)
    case 64: run_bwd_hopper<T, 64>(p, stream); return;
#endif
#if !defined(ATTN_CUDA_SKIP_HDIM128)
    case 128: run_bwd_hopper<T, 128>(p, stream); return;
#endif
    default: throw std::runtime_error("attention bwd: no wgmma kernel for this head-dim bucket");
  }
}
#endif

#if !defined(ATTN_CUDA_SKIP_BWD)
template <typename T>
void bwd_tc(const BwdParams& p, cudaStream_t stream) {
  switch (bucket_for_head_dim(p.d)) {
#if !defined(ATTN_CUDA_SKIP_HDIM64)
    case 64: run_bwd_tc<T, 64>(p, stream); return;
#endif
#if !defined(ATTN_CUDA_SKIP_HDIM128)
    case 128: run_bwd_tc<T, 128>(p, stream); return;
#endif
#if !defined(ATTN_CUDA_SKIP_HDIM256)
    case 256: run_bwd_tc<T, 256>(p, stream); return;
#endif
    default: throw std::runtime_error("attention bwd: head-dim bucket not compiled");
  }
}
#endif

}  // namespace

constexpr int kMaxSplits = 128;

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

int cuda_fwd_num_splits(const FwdParams& p, DType dt, int requested) {
  if (p.b == 0 || p.h == 0 || p.sq == 0) return 1;
  if (use_hopper_fwd(p, dt) || !use_tensor_cores(p, dt)) return 1;
  // requested >= 1: that many splits (1 = none, the API's default until a GPU has run the split
  // kernels); 0: the heuristic below
  if (requested >= 1) return requested < kMaxSplits ? requested : kMaxSplits;
#if defined(ATTN_TUNING)
  if (g_tune_fwd.load(std::memory_order_relaxed) != 0) return 1;  // the tuning candidates are timed unsplit
#endif
  int block_m = 0, block_n = 0;
  switch (bucket_for_head_dim(p.d)) {
    case 64: block_m = FwdTraits<64>::kBlockM; block_n = FwdTraits<64>::kBlockN; break;
    case 128: block_m = FwdTraits<128>::kBlockM; block_n = FwdTraits<128>::kBlockN; break;
    default: block_m = FwdTraits<256>::kBlockM; block_n = FwdTraits<256>::kBlockN; break;
  }
  // FA2-like: split only when the unsplit grid fills well under one wave (< 0.8 x SMs), into
  // enough CTAs for about two per SM (the mma.sync forward fits two per SM by registers), keeping
  // >= 4 key blocks per split so each amortizes its Q load and the combine pass.
  const int64_t ctas = int64_t((p.sq + block_m - 1) / block_m) * p.h * p.b;
  const int sms = device_sm_count();
  if (ctas * 5 >= int64_t(sms) * 4) return 1;
  const int64_t key_blocks = (int64_t(p.sk) + block_n - 1) / block_n;
  int64_t n = (2 * int64_t(sms) + ctas - 1) / ctas;
  n = n < key_blocks / 4 ? n : key_blocks / 4;
  n = n < kMaxSplits ? n : kMaxSplits;
  return n >= 2 ? int(n) : 1;
}

size_t cuda_fwd_split_floats(const FwdParams& p, int num_splits, int64_t batch_t, int64_t rows, bool o) {
  return size_t(batch_t) * p.h * num_splits * rows * (o ? p.d : 1);
}

const char* cuda_path_name(const FwdParams& p, DType dt) {
  if (use_hopper_fwd(p, dt)) return "hopper-wgmma";
  return use_tensor_cores(p, dt) ? "tensor-core" : "simt";
}

size_t cuda_bwd_softmax_d_floats(const BwdParams& p) { return size_t(p.b) * p.h * p.sq; }

size_t cuda_bwd_dq_accum_floats(const BwdParams& p, DType dt) {
  if (p.deterministic || !use_tensor_cores_bwd(p, dt)) return 0;
  return size_t(p.b) * p.h * p.sq * bucket_for_head_dim(p.d);
}

void cuda_fwd(const FwdParams& p, DType dt, cudaStream_t stream, const FwdSplitScratch& split) {
  NvtxRange range("attention_ext::cuda_fwd");
  validate(p, "attention fwd");
  if (p.b == 0 || p.h == 0 || p.sq == 0) return;
#if ATTN_HOPPER_FWD
  if (use_hopper_fwd(p, dt)) {
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

void cuda_bwd(const BwdParams& p, DType dt, cudaStream_t stream) {
  NvtxRange range("attention_ext::cuda_bwd");
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
  // empty problems: the caller zeroes the gradients (as attention_cuda.cpp does)
  if (p.b == 0 || p.h == 0 || p.sq == 0 || p.sk == 0) return;
  const int dq_ld = atomic_dq ? bucket_for_head_dim(p.d) : 0;
  BwdParams q = p;
  if (!atomic_dq) q.dq_accum = nullptr;
  switch (dt) {
    case DType::kF32: run_bwd_preprocess<float>(q, dq_ld, stream); break;
    case DType::kF16: run_bwd_preprocess<__half>(q, dq_ld, stream); break;
    case DType::kBF16: run_bwd_preprocess<__nv_bfloat16>(q, dq_ld, stream); break;
  }
#if ATTN_HOPPER_BWD
  // implies tc and atomic_dq: q.dq_accum is the zeroed (B, H, Sq, bucket) scratch
  if (use_hopper_bwd(p, dt)) {
    if (dt == DType::kF16) bwd_hopper<__half>(q, stream);
    else bwd_hopper<__nv_bfloat16>(q, stream);
    return;
  }
#endif
  if (tc) {
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
