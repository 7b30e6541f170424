// The sm_90 build of the emulated CUDA backend (see emu_kernels.h): 16-byte dQ atomics.
#define ATTN_EMU_ARCH 900
#define ATTN_EMU_SM 90
#define ATTN_EMU_NS attn_emu_sm90
#include "emu_kernels.h"
