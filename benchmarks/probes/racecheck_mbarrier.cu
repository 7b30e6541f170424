// Does compute-sanitizer racecheck follow an mbarrier hand-off? (gpu_check.sh stage "rprobe")
//
// The sm_90a wgmma backward hands a Q / dO ring slot back to its producer this way: every
// consumer warp ld.shared's the slot's LSE / dot values, __syncwarp (and bar.sync among the
// consumer warpgroups), lane 0 arrives (release) on the slot's "empty" mbarrier, and the producer
// waits on it (acquire) before its cp.async into the slot. By the PTX memory model the reads
// happen before the writes (lane L's read -> bar.warp.sync / bar.sync -> lane 0's
// mbarrier.arrive.release -> try_wait.acquire -> cp.async), yet racecheck reported WAR hazards
// there on an H100 (benchmarks/results/2026-11-24-h100.md). This kernel is that protocol alone:
// warp 0 produces into a 2-slot ring, warps 1-2 consume, each lane reading another lane's word.
//   mode 0: every consumer lane arrives (count 64)        ordered: each reader releases itself
//   mode 1: __syncwarp, lane 0 arrives (count 2)          the backward's protocol
//   mode 2: bar.sync 1, 64 among the consumers + mode 1   the backward's exact shape
//   mode 3: lane 0 arrives BEFORE the reads               a real WAR race (the positive control)
//   mode 4: lane 0 arrives without __syncwarp             a formal gap (lanes 1-31 unordered)
// Reading: modes 0-2 clean and 3 flagged -> racecheck models the protocol and the backward's
// report needs another explanation; mode 0 clean but 1 and 2 flagged, for reader lanes != 0 ->
// racecheck follows an mbarrier edge only for the arriving thread's own accesses, and the
// backward's report is a false positive.
//   nvcc -arch=sm_90a -lineinfo -o probe benchmarks/probes/racecheck_mbarrier.cu
//   compute-sanitizer --tool racecheck --racecheck-report all ./probe <mode>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
__device__ __forceinline__ void arrive(uint32_t b) { asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(b) : "memory"); }
__device__ __forceinline__ void wait(uint32_t b, uint32_t par) {
  uint32_t d = 0;
  while (!d) asm volatile("{.reg .pred p; mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2; selp.u32 %0,1,0,p;}" : "=r"(d) : "r"(b), "r"(par) : "memory");
}
__global__ void probe(const float* src, float* out, int iters, int mode) {
  __shared__ __align__(16) float slot[2][32];
  __shared__ __align__(8) uint64_t bar[4];  // full[0..1], empty[0..1]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t s_slot = (uint32_t)__cvta_generic_to_shared(slot), s_bar = (uint32_t)__cvta_generic_to_shared(bar);
  if (threadIdx.x == 0) for (int i = 0; i < 4; ++i)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(s_bar + 8 * i), "r"(i < 2 ? 32 : (mode == 0 ? 64 : 2)) : "memory");
  __syncthreads();
  float acc = 0.f;
  for (int it = 0; it < iters; ++it) {
    const int s = it & 1; const uint32_t ph = (it >> 1) & 1;
    if (warp == 0) {  // producer: wait empty, cp.async, wait_group, arrive full (every lane)
      wait(s_bar + 8 * (2 + s), ph ^ 1u);
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(s_slot + (s * 32 + lane) * 4), "l"(src + it * 32 + lane) : "memory");
      asm volatile("cp.async.commit_group; cp.async.wait_group 0;" ::: "memory");
      arrive(s_bar + 8 * s);
    } else {          // consumer: wait full, ld.shared another lane's word, release the slot
      wait(s_bar + 8 * s, ph);
      if (mode == 3 && lane == 0) arrive(s_bar + 8 * (2 + s));  // too early: the read follows
      float v; asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(s_slot + (s * 32 + (lane + 7) % 32) * 4));
      acc += v;
      if (mode == 2) asm volatile("bar.sync 1, 64;" ::: "memory");
      if (mode == 0) arrive(s_bar + 8 * (2 + s));
      else if (mode == 4) { if (lane == 0) arrive(s_bar + 8 * (2 + s)); }
      else if (mode != 3) { __syncwarp(); if (lane == 0) arrive(s_bar + 8 * (2 + s)); }
    }
  }
  if (warp > 0) out[threadIdx.x - 32] = acc;
}
int main(int argc, char** argv) {
  const int mode = argc > 1 ? atoi(argv[1]) : 1, iters = 16;
  float *src, *out; cudaMalloc(&src, iters * 32 * 4); cudaMalloc(&out, 64 * 4);
  cudaMemset(src, 0, iters * 32 * 4);
  probe<<<1, 96>>>(src, out, iters, mode);
  printf("mode %d: %s\n", mode, cudaGetErrorString(cudaDeviceSynchronize()));
  return 0;
}
