// The start of a small emulator module's kernel TU (emu_decode_kernels.cpp,
// emu_delta_kernels.cpp): the half / bfloat16 API the nvcc build sees (torch's CUDA extension
// flags), the emulated device names of cuda_emu.h, then __CUDA_ARCH__ = 800, so that the CUDA
// headers included after this one take their device paths. One sm_80 build stands for both archs
// in these modules: their kernels use no arch-specific code.
#pragma once

#if !defined(ATTN_CUDA_EMULATE)
#error "define ATTN_CUDA_EMULATE"
#endif

#define __CUDA_NO_HALF_OPERATORS__
#define __CUDA_NO_HALF_CONVERSIONS__
#define __CUDA_NO_BFLOAT16_CONVERSIONS__
#define __CUDA_NO_HALF2_OPERATORS__

#include "cuda_emu.h"

#include <cmath>
#include <cstring>

#define __CUDA_ARCH__ 800
