// The sm_80 build of the emulated CUDA backend (see emu_kernels.h).
#define ATTN_EMU_ARCH 800
#define ATTN_EMU_SM 80
#define ATTN_EMU_NS attn_emu_sm80
#include "emu_kernels.h"
