// Host entry points of the CUDA linear attention backend (the `linear` family). No torch here:
// csrc/torch/linear_cuda.cpp (and the CPU emulator) fill the params through
// csrc/torch/linear_binding, allocate the scratch sized below, and call these on the current
// stream. Errors are thrown as std::runtime_error naming the cause. common/linear_params.h
// states the math; the kernels compute in float32 for float32, float16 and bfloat16 inputs.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "common/delta_params.h"
#include "common/linear_params.h"

namespace attn {

// The schedule of the tensor-core forward and backward, process-wide (set by the attention_ext::linear_set_cuda_kernels op):
//   chunk_parallel: true (the default) = the chunk-parallel forward and backward of
//                   mma_fwd_kernel.cuh / mma_bwd_kernel.cuh for the tensor-core calls (fp16 / bf16,
//                   M <= 128), false = one CTA walks each sequence; fp32 and wider calls keep the
//                   SIMT kernels;
//   segment_chunks: chunks per segment of the chunk-parallel kernels, 0 = fill the device;
//   chunk_states:   the chunk-parallel forward and backward as chunk_fwd_kernel.cuh's and
//                   chunk_bwd_kernel.cuh's (the states entering / leaving every chunk stored by a
//                   walk in registers, then every chunk's outputs or gradients at once: flash-
//                   linear-attention's schedule) where the rows are 16-byte vectors; opt-in until
//                   a GPU run has tested and timed them.
struct LinearCudaKernels {
  bool chunk_parallel = true;
  int segment_chunks = 0;
  bool chunk_states = false;
};
void cuda_linear_set_kernels(const LinearCudaKernels& k);
// The current selection, one consistent snapshot. A call sizes its scratch and launches with the
// same snapshot (the functions below take it), so a selection changed by another thread between
// the two cannot make a launch outgrow its scratch.
LinearCudaKernels cuda_linear_kernels();

// Float32 elements of the forward's scratch (the chunk-parallel forward's segment states), 0
// when the selected kernel needs none; allocated (not zeroed) by the caller.
size_t cuda_linear_fwd_scratch_floats(const LinearParamsT<float>& p, DType dt, const LinearCudaKernels& k);

// Forward: writes p.o, p.den and (when not null) p.final_state. scratch:
// cuda_linear_fwd_scratch_floats(p, dt, k) floats (null when 0).
void cuda_linear_fwd(const LinearParamsT<float>& p, DType dt, const LinearCudaKernels& k, float* scratch,
                     cudaStream_t stream);

// Float32 elements of the backward's scratch: the pre-feature-map gradients dQ~ (B_t, H, rows, M),
// dK~ (B_t, H_k, rows, M), dV (B_t, H_k, rows, Dv) and the per-row dG (B_t, H, rows), with
// (B_t, rows) the batch and row dims of q: (B, S), or (1, total) for a varlen pack. The value
// tiles of a head and the query heads of a GQA group add into them with atomics. Then, when the
// chunk-parallel kernels take the call, their segment states (forward and reverse).
size_t cuda_linear_bwd_scratch_floats(const LinearBwdParamsT<float>& p, DType dt, const LinearCudaKernels& k);

// Backward: writes p.dq, p.dk, p.dv and, when not null, p.ddecay and p.dinit_state. scratch:
// cuda_linear_bwd_scratch_floats(p, dt, k) floats, zeroed by the caller.
void cuda_linear_bwd(const LinearBwdParamsT<float>& p, DType dt, const LinearCudaKernels& k, float* scratch,
                     cudaStream_t stream);

// The recurrent step (linear_step): out (B, H, T, Dv), p.state and p.normalizer advanced in place.
void cuda_linear_step(const LinearStepParamsT<float>& p, DType dt, cudaStream_t stream);

// The delta rule's CUDA forward schedule, process-wide (set by the
// attention_ext::delta_set_cuda_kernels op): chunked 0 (the default until a GPU run has tested
// and timed the chunk kernels) = the recurrent kernel for every call; -1 = the chunk-parallel
// tensor-core kernels (delta_chunk_kernel.cuh) for the calls they take from 256 rows on, the
// recurrent kernel for the rest; 1 = the chunk kernels for every call they take.
struct DeltaCudaKernels {
  int chunked = 0;
};
void cuda_delta_set_kernels(const DeltaCudaKernels& k);
DeltaCudaKernels cuda_delta_kernels();

// Bytes of the forward's scratch under selection k (0: none), allocated (not zeroed) by the caller.
size_t cuda_delta_fwd_scratch_bytes(const DeltaParamsT<float>& p, const DeltaCudaKernels& k);

// The delta rule's forward (delta.cu): writes p.o and, when not null, p.final_state, which may be
// p.init_state itself (the in-place step). Every row of every sequence; a varlen pack's other
// rows are left as they are. scratch: cuda_delta_fwd_scratch_bytes(p, k) bytes.
void cuda_delta_fwd(const DeltaParamsT<float>& p, const DeltaCudaKernels& k, void* scratch, cudaStream_t stream);

// The delta rule's backward on CUDA (delta_chunk_bwd_kernel.cuh): the calls the chunk kernels take
// (cuda_delta_bwd_fits: bf16, no per-key gate, K <= 128, K and V multiples of 8, 16-byte rows).
// Scratch: cuda_delta_bwd_scratch_bytes(p, &zeroed) bytes whose first `zeroed` are zero: they
// end as dq then dk, float32, (B, H_k, S, K) contiguous (a varlen pack: B = 1), which the caller
// converts into p.dq / p.dk (not written by the kernels). Writes p.dv, p.dbeta, p.dgate (when
// not null) and p.dinit_state (when not null).
bool cuda_delta_bwd_fits(const DeltaParamsT<float>& p);
size_t cuda_delta_bwd_scratch_bytes(const DeltaParamsT<float>& p, size_t* zeroed);
void cuda_delta_bwd(const DeltaBwdParamsT<float>& p, void* scratch, cudaStream_t stream);

}  // namespace attn
