// cuda_decode_fwd (entry.h): the launches of the decode kernel (kernel.cuh) and, for splits > 1,
// its combine.
//
// Instantiations: 3 storage types x 3 caches (the storage type, int8, fp8 e4m3) x 3 head-dim
// buckets (64, 128, 256; runtime d <= bucket) x 2 row blocks (4: R = G x Sq <= 4, else 8) of
// decode_kernel, 2 x 2 of decode_mma_kernel (fp16 / bf16, head dims 64 / 128) plus 3 combine
// kernels, all in this one TU (CI builds them for sm_80 and sm_90a).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <type_traits>
#include <string>

#include "cuda/launch.h"
#include "decode/cuda/entry.h"
#include "decode/cuda/heuristics.h"
#include "decode/cuda/kernel.cuh"
#include "decode/cuda/mma_kernel.cuh"

namespace attn {

namespace {

constexpr const char* kWhat = "attention_ext.decode (CUDA)";

std::atomic<bool> g_tensor_cores{false}, g_quantized{false};  // DecodeCudaKernels

// Every K / V row starts aligned to the kernel's vector (16 bytes; 8 for 8-bit caches) and d fills
// whole vectors: the kernel may use vector loads.
bool vec_loads_ok(const DecodeParams& p, int elem_bytes) {
  const int64_t vec = elem_bytes == 1 ? 8 : 16 / elem_bytes;
  const uintptr_t align = uintptr_t(vec * elem_bytes);
  auto al = [&](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % align == 0; };
  return al(p.k) && al(p.v) && p.d % vec == 0 && p.k_row_stride % vec == 0 && p.k_head_stride % vec == 0 &&
         p.k_batch_stride % vec == 0 && p.v_row_stride % vec == 0 && p.v_head_stride % vec == 0 &&
         p.v_batch_stride % vec == 0;
}

// C: the cache's elements (E, or an 8-bit type: int8_t, uint8_t for e4m3 bits)
template <typename E, typename C, int kD>
void launch(const DecodeParams& p, int splits, float* part_o, float* part_lse, cudaStream_t stream) {
  const dim3 grid(splits, p.h_k, p.b);
  const int rows = p.h / p.h_k * p.sq;
  const bool vec_ok = vec_loads_ok(p, int(sizeof(C)));
  float* po = splits > 1 ? part_o : nullptr;
  float* pl = splits > 1 ? part_lse : nullptr;
  bool mma = false;
  // the tensor-core kernel for fp16 / bf16 at head dims up to 128 (at 256 its 16 x 256 fp32
  // accumulator per warp leaves ptxas too few registers: it spills, so those calls stay on CUDA
  // cores), on devices whose blocks may take its shared memory (not sm_86 / sm_89 at kD = 128)
  if constexpr (sizeof(E) == 2 && kD <= 128 && std::is_same_v<C, E>) {
    constexpr int smem = decode_cuda::MmaTraits<kD>::kSmemBytes;
    mma = vec_ok && g_tensor_cores.load(std::memory_order_relaxed) && device_max_smem_optin() >= smem;
    if (mma) {
      auto kernel = &decode_cuda::decode_mma_kernel<E, kD>;
      set_smem(kernel, smem, kWhat);
      ATTN_LAUNCH(kernel, grid, dim3(decode_cuda::kMmaThreads), smem, stream)(p, splits, po, pl);
    }
  }
  if (!mma) {
    // fp32 at kD = 256 takes 4 rows per pass at any row count: 8 rows spill on sm_80 (255
    // registers), so that instantiation is never made (the second operand names 4 for it too)
    constexpr bool kNarrow = sizeof(E) == 4 && kD == 256;
    auto kernel = rows <= 4 || kNarrow ? &decode_cuda::decode_kernel<E, C, kD, 4>
                                       : &decode_cuda::decode_kernel<E, C, kD, kNarrow ? 4 : 8>;
    ATTN_LAUNCH(kernel, grid, dim3(decode_cuda::kThreads), 0, stream)(p, splits, po, pl, vec_ok);
  }
  check_launch(kWhat);
  if (splits > 1) {
    const int64_t n_rows = int64_t(p.b) * p.h * p.sq;
    constexpr int kRowsPerCta = decode_cuda::kThreads / 32;
    const int64_t blocks = (n_rows + kRowsPerCta - 1) / kRowsPerCta;
    if (blocks > 0x7fffffff) throw std::runtime_error(std::string(kWhat) + ": too many query rows");
    auto combine = &decode_cuda::combine_kernel<E>;
    ATTN_LAUNCH(combine, dim3(unsigned(blocks)), dim3(decode_cuda::kThreads), 0, stream)
    (p, splits, part_o, part_lse);
    check_launch(kWhat);
  }
}

template <typename E, typename C>
void run_cache(const DecodeParams& p, int splits, float* part_o, float* part_lse, cudaStream_t stream) {
  if (p.d <= 64) {
    launch<E, C, 64>(p, splits, part_o, part_lse, stream);
  } else if (p.d <= 128) {
    launch<E, C, 128>(p, splits, part_o, part_lse, stream);
  } else if (p.d <= 256) {
    launch<E, C, 256>(p, splits, part_o, part_lse, stream);
  } else {
    throw std::runtime_error(std::string(kWhat) + ": head dim must be <= 256, got " + std::to_string(p.d));
  }
}

template <typename E>
void run(const DecodeParams& p, int splits, float* part_o, float* part_lse, cudaStream_t stream) {
  switch (p.kv_quant) {
    case kKvInt8: run_cache<E, int8_t>(p, splits, part_o, part_lse, stream); break;
    case kKvFp8: run_cache<E, uint8_t>(p, splits, part_o, part_lse, stream); break;
    default: run_cache<E, E>(p, splits, part_o, part_lse, stream); break;
  }
}

}  // namespace

void cuda_decode_set_kernels(const DecodeCudaKernels& k) {
  g_tensor_cores.store(k.tensor_cores);
  g_quantized.store(k.quantized);
}

DecodeCudaKernels cuda_decode_kernels() { return DecodeCudaKernels{g_tensor_cores.load(), g_quantized.load()}; }

void cuda_decode_fwd(const DecodeParams& p, DType dt, int splits, float* part_o, float* part_lse,
                     cudaStream_t stream) {
  check_grid(p.h_k, p.b, kWhat);
  if (splits < 1 || splits > kDecodeMaxSplits) {
    throw std::runtime_error(std::string(kWhat) + ": splits must be in [1, " + std::to_string(kDecodeMaxSplits) +
                             "], got " + std::to_string(splits));
  }
  if (splits > 1 && (part_o == nullptr || part_lse == nullptr)) {
    throw std::runtime_error(std::string(kWhat) + ": split scratch missing");
  }
  switch (dt) {
    case DType::kF16: run<__half>(p, splits, part_o, part_lse, stream); break;
    case DType::kBF16: run<__nv_bfloat16>(p, splits, part_o, part_lse, stream); break;
    case DType::kF32: run<float>(p, splits, part_o, part_lse, stream); break;
    default: throw std::runtime_error(std::string(kWhat) + ": float64 runs on the CPU only");
  }
}

}  // namespace attn
