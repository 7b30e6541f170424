// The sm_90 build of the emulated CUDA backend (see emu_kernels.h): 16-byte dQ atomics, and the
// -DATTN_TUNING candidates of launch_template.cuh (they are tuned for the H100), picked per call
// by ATTN_TUNE_FWD / ATTN_TUNE_BWD like in a tuning build; unset, the default kernels run.
#define ATTN_EMU_ARCH 900
#define ATTN_EMU_SM 90
#define ATTN_EMU_NS attn_emu_sm90
#define ATTN_TUNING
#include "emu_kernels.h"
