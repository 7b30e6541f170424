// The host build of the CUDA decode kernels (csrc/decode/cuda/dispatch.cu and kernel.cuh),
// compiled by g++ with the device names of cuda_emu.h, for the decode emulator module
// (emu_decode_binding.cpp, built by emulator.load_decode()). The decode kernels use no
// arch-specific code (SIMT, no mma / cp.async), so one sm_80 build stands for both archs, and the
// module is separate from the softmax / linear emulator: its build stays a few small TUs.
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

#include "decode/cuda/dispatch.cu"
