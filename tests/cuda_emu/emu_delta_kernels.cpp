// The host build of the delta rule's CUDA kernel (csrc/linear/cuda/delta.cu and
// delta_kernel.cuh), compiled by g++ with the device names of cuda_emu.h, for the delta emulator
// module (emu_delta_binding.cpp, built by emulator.load_delta()). The kernel uses no
// arch-specific code (SIMT: shuffles and float4 shared-memory reads), so one sm_80 build stands
// for both archs, in a module of its own, a few small TUs to build.
#if !defined(ATTN_CUDA_EMULATE)
#error "define ATTN_CUDA_EMULATE"
#endif

// the half / bfloat16 API the nvcc build sees (torch's CUDA extension flags)
#define __CUDA_NO_HALF_OPERATORS__
#define __CUDA_NO_HALF_CONVERSIONS__
#define __CUDA_NO_BFLOAT16_CONVERSIONS__
#define __CUDA_NO_HALF2_OPERATORS__

#include "cuda_emu.h"

#include <cmath>
#include <cstring>

// only now: the CUDA headers above take device code paths when __CUDA_ARCH__ is defined
#define __CUDA_ARCH__ 800

#include "linear/cuda/delta.cu"
