// Host entry points of the CUDA backend. No torch here: csrc/api/attention_cuda.cpp converts
// tensors to FwdParams / BwdParams, allocates the scratch sized by the functions below, and
// calls these on the current stream. Errors (unsupported configs, launch failures) are thrown
// as std::runtime_error with a message that names the cause.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "common/params.h"  // FwdParams, BwdParams, DType

namespace attn {

// Forward: writes p.o and p.lse.
void cuda_fwd(const FwdParams& p, DType dt, cudaStream_t stream);

// Backward: writes p.dq, p.dk, p.dv and, when not null, p.dbias (zeroed first, then filled:
// dense (B, H, Sq_b, Sk) float32) and p.dsinks ((B, H) float32, zeroed first).
// Needs p.softmax_d with cuda_bwd_softmax_d_floats(p) floats, and p.dq_accum with
// cuda_bwd_dq_accum_floats(p, dt) floats when that is nonzero (else it may be null).
void cuda_bwd(const BwdParams& p, DType dt, cudaStream_t stream);

size_t cuda_bwd_softmax_d_floats(const BwdParams& p);        // B * H * Sq (Sq = max for varlen)
size_t cuda_bwd_dq_accum_floats(const BwdParams& p, DType dt);  // 0 unless atomic dQ path

// Which kernel family a config's forward takes: "hopper-wgmma" (sm_90a, opt-in with
// ATTN_CUDA_HOPPER=1), "tensor-core" (mma.sync) or "simt" (for tests and benchmarks).
const char* cuda_path_name(const FwdParams& p, DType dt);

}  // namespace attn
