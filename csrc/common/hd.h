// ATTN_HD: the qualifier of the code the CPU and CUDA backends share (policies, indices).
#pragma once

#if defined(__CUDACC__)
#define ATTN_HD __host__ __device__ __forceinline__
#else
#define ATTN_HD inline
#endif
