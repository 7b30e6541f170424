// One emulated architecture's host build of the CUDA backend: dispatch.cu (kernel choice and
// launch sequence) and the instantiation files of the mma.sync and SIMT kernels, compiled
// by g++ with the PTX wrappers of mma.cuh emulated (cuda_emu.h). Included once by
// emu_kernels_sm80.cpp / emu_kernels_sm90.cpp with ATTN_EMU_ARCH = 800 / 900 and ATTN_EMU_NS.
//
// The kernels' `#if __CUDA_ARCH__ >= 900` code (sm_90 vector atomics) is fixed per translation
// unit, and both TUs instantiate the same templates; so each compiles the whole backend,
// params.h included, in its own namespace (ATTN_EMU_NS replaces `attn`) rather than letting the
// linker merge the sm_80 and sm_90 copies of a kernel.
#if !defined(ATTN_EMU_ARCH) || !defined(ATTN_EMU_NS)
#error "define ATTN_EMU_ARCH and ATTN_EMU_NS"
#endif

// the half / bfloat16 API the nvcc build sees (torch's CUDA extension flags)
#define __CUDA_NO_HALF_OPERATORS__
#define __CUDA_NO_HALF_CONVERSIONS__
#define __CUDA_NO_BFLOAT16_CONVERSIONS__
#define __CUDA_NO_HALF2_OPERATORS__

#include "cuda_emu.h"

#include <nvtx3/nvToolsExt.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "emu_entry.h"

// only now: the CUDA headers above take device code paths when __CUDA_ARCH__ is defined
#define __CUDA_ARCH__ ATTN_EMU_ARCH
// (the sm_90a wgmma kernels stay out: ATTN_CUDA_HAVE_SM90A is not defined)
#define attn ATTN_EMU_NS

// a new instantiation file (a new kernel family or variant) joins this list
#include "../dispatch.cu"
#include "../inst_bwd_bf16_hd128.cu"
#include "../inst_bwd_bf16_hd256.cu"
#include "../inst_bwd_bf16_hd64.cu"
#include "../inst_bwd_f16_hd128.cu"
#include "../inst_bwd_f16_hd256.cu"
#include "../inst_bwd_f16_hd64.cu"
#include "../inst_fwd_bf16_hd128.cu"
#include "../inst_fwd_bf16_hd256.cu"
#include "../inst_fwd_bf16_hd64.cu"
#include "../inst_fwd_f16_hd128.cu"
#include "../inst_fwd_f16_hd256.cu"
#include "../inst_fwd_f16_hd64.cu"
#include "../inst_simt_bf16.cu"
#include "../inst_simt_f16.cu"
#include "../inst_simt_f32.cu"

namespace attn {

namespace {
template <typename P>
P params_from(const void* bytes, size_t n) {
  static_assert(std::is_trivially_copyable_v<P>, "params are plain data");
  if (n != sizeof(P)) throw std::runtime_error("emulator: params layout mismatch");
  P p;
  std::memcpy(&p, bytes, sizeof(P));
  return p;
}
void prepare() {
  attn_emu::set_arch(ATTN_EMU_ARCH / 10);
}
}  // namespace
}  // namespace attn

#define ATTN_EMU_CAT2(a, b) a##b
#define ATTN_EMU_CAT(a, b) ATTN_EMU_CAT2(a, b)
attn_emu::Backend attn_emu::ATTN_EMU_CAT(backend_sm, ATTN_EMU_SM)() {
  Backend be;
  be.fwd = [](const void* p, size_t n, int dt, int64_t batch_t, int64_t rows, int requested_splits) {
    attn::prepare();
    const attn::FwdParams fp = attn::params_from<attn::FwdParams>(p, n);
    // split-KV scratch as attention_cuda.cpp sizes it, NaN-filled so an unwritten partial shows
    attn::FwdSplitScratch split;
    split.num_splits = attn::cuda_fwd_num_splits(fp, attn::DType(dt), requested_splits);
    std::vector<float> o_accum, lse_accum;
    if (split.num_splits > 1) {
      split.rows = rows;
      o_accum.assign(attn::cuda_fwd_split_floats(fp, split.num_splits, batch_t, rows, true), NAN);
      lse_accum.assign(attn::cuda_fwd_split_floats(fp, split.num_splits, batch_t, rows, false), NAN);
      split.o_accum = o_accum.data();
      split.lse_accum = lse_accum.data();
    }
    attn::cuda_fwd(fp, attn::DType(dt), nullptr, split);
  };
  be.bwd = [](const void* p, size_t n, int dt) {
    attn::prepare();
    attn::cuda_bwd(attn::params_from<attn::BwdParams>(p, n), attn::DType(dt), nullptr);
  };
  be.softmax_d_floats = [](const void* p, size_t n) {
    attn::prepare();
    return attn::cuda_bwd_softmax_d_floats(attn::params_from<attn::BwdParams>(p, n));
  };
  be.dq_accum_floats = [](const void* p, size_t n, int dt) {
    attn::prepare();
    return attn::cuda_bwd_dq_accum_floats(attn::params_from<attn::BwdParams>(p, n), attn::DType(dt));
  };
  be.path_name = [](const void* p, size_t n, int dt) {
    attn::prepare();
    return attn::cuda_path_name(attn::params_from<attn::FwdParams>(p, n), attn::DType(dt));
  };
  be.set_kernels = [](int hopper_fwd, int hopper_bwd, int tune_fwd, int tune_bwd, bool force_simt) {
    attn::cuda_set_kernels(attn::CudaKernels{hopper_fwd, hopper_bwd, tune_fwd, tune_bwd, force_simt});
  };
  return be;
}
