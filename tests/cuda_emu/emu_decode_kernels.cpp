// The host build of the CUDA decode kernels (csrc/decode/cuda/dispatch.cu and kernel.cuh),
// compiled by g++ with the device names of cuda_emu.h, for the decode emulator module
// (emu_decode_binding.cpp, built by emulator.load_decode()). The decode kernels use no
// arch-specific code (SIMT, no mma / cp.async), so one sm_80 build stands for both archs, and the
// module is separate from the softmax / linear emulator: its build stays a few small TUs.
#include "emu_sm80_prelude.h"

#include "decode/cuda/dispatch.cu"
