// Host entry points of the CUDA linear attention backend (the `linear` family). No torch here:
// csrc/torch/linear_cuda.cpp (and the CPU emulator) fill the params through
// csrc/torch/linear_binding, allocate the scratch sized below, and call these on the current
// stream. Errors are thrown as std::runtime_error naming the cause. common/linear_params.h
// states the math; the kernels compute in float32 for float32, float16 and bfloat16 inputs.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "common/linear_params.h"

namespace attn {

// Forward: writes p.o, p.den and (when not null) p.final_state.
void cuda_linear_fwd(const LinearParamsT<float>& p, DType dt, cudaStream_t stream);

// Float32 elements of the backward's scratch: the pre-feature-map gradients dQ~ (B_t, H, rows, M),
// dK~ (B_t, H_k, rows, M), dV (B_t, H_k, rows, Dv) and the per-row dG (B_t, H, rows), with
// (B_t, rows) the batch and row dims of q: (B, S), or (1, total) for a varlen pack. The value
// tiles of a head and the query heads of a GQA group add into them with atomics.
size_t cuda_linear_bwd_scratch_floats(const LinearBwdParamsT<float>& p);

// Backward: writes p.dq, p.dk, p.dv and, when not null, p.ddecay and p.dinit_state. scratch:
// cuda_linear_bwd_scratch_floats(p) floats, zeroed by the caller.
void cuda_linear_bwd(const LinearBwdParamsT<float>& p, DType dt, float* scratch, cudaStream_t stream);

}  // namespace attn
