// The sm_90 build of the emulated CUDA backend (see emu_kernels.h): 16-byte dQ atomics, and the
// -DATTN_TUNING candidates of tuning.cuh (they are tuned for sm_90), picked by set_cuda_kernels'
// tune_fwd / tune_bwd like in a tuning build; 0, the default kernels run.
#define ATTN_EMU_ARCH 900
#define ATTN_EMU_SM 90
#define ATTN_EMU_NS attn_emu_sm90
#define ATTN_TUNING
#include "emu_kernels.h"
