// The host build of the delta rule's CUDA kernel (csrc/linear/cuda/delta.cu and
// delta_kernel.cuh), compiled by g++ with the device names of cuda_emu.h, for the delta emulator
// module (emu_delta_binding.cpp, built by emulator.load_delta()). The kernel uses no
// arch-specific code (SIMT: shuffles and float4 shared-memory reads), so one sm_80 build stands
// for both archs, in a module of its own, a few small TUs to build.
#include "emu_sm80_prelude.h"

#include "linear/cuda/delta.cu"
