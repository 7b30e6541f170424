"""Static cost report of the CUDA kernels: a predicted H100 time for each kernel before a GPU
measures it, from the kernel's launch shape, its ptxas resources and its instruction counts.

    python benchmarks/gpu_cost.py                # calibration table, then the predictions
    python benchmarks/gpu_cost.py --check-counts  # the count formulas against the CPU emulator

The model (docs/gpu.md, "The static cost report"). Every CTA of a launch costs
    t_cta = t0 + round_trips x LATENCY + mma_flops / cta_rate
and the CTAs run in launch order on 132 SMs x (CTAs per SM) slots, each taking the first free
slot (a list schedule, which gives wave quantization and the tail of unequal CTAs, such as the
causal rows). CTAs per SM come from the registers, shared memory and threads ptxas reports. A
launch takes at least its DRAM bytes / the copy bandwidth, and LAUNCH_S. The constants:
  * COPY_BW and the wgmma ceiling: measured on the H100 (benchmarks/results/2026-11-24-h100.md);
  * LATENCY, one dependent global-memory round trip: fitted on the two linear forward rows of
    that run, whose kernel waits on one load per element it stages (162 / 98 trips per chunk);
    the linear backward rows are then predicted with no constant of their own;
  * per kernel class and head dim, cta_rate and t0: fitted on two rows of the softmax table
    (non-causal S = 16k, causal S = 1k), then checked on the eight other rows.
Counts: mma_flops of the linear kernels are formulas checked against the emulator's count of
mma.sync instructions (--check-counts; tests/cuda_emu/test_linear_emulated.py runs the same
check in CI). Round trips are counted from the source: one per loop iteration that loads global
memory and stores what it loaded before the next load can issue; one per batch of loads issued
together.

Block-sparse calls are the dense mma.sync classes' fits applied to the layout's visible blocks
(no constant of their own). The decode kernels add an instruction-issue term from an estimated
(not counted) instruction budget; the option rows on the wgmma forward are bounded between the
dense kernel with the policy work overlapped and with it serial. Not modelled yet: the option rows'
backward. The report says so rather than print a number.
"""
from __future__ import annotations

import argparse
import heapq
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

# ---------------------------------------------------------------------------------- the device
SMS = 132
REGS_PER_SM = 65536
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_CTA = 1024
THREADS_PER_SM = 2048
CTAS_PER_SM = 32
COPY_BW = 2.97e12          # bytes / s, read + write (2026-11-24 run: 2.97-3.02 TB/s)
WGMMA_PEAK = 794e12        # bf16 dense matmul, measured the same day
LAUNCH_S = 4e-6            # one kernel launch in a stream of launches

# the H100 rows this model is calibrated and checked on (benchmarks/results/2026-11-24-h100.md)
LINEAR_FWD_MEASURED = {(4, 16, 8192, 128): 10.27e-3, (8, 16, 2048, 64): 1.55e-3}
FLA_FWD_MEASURED = {shape: t * r for (shape, t), r in zip(LINEAR_FWD_MEASURED.items(), (0.09, 0.35))}
# forward + backward (the backward alone: the difference; it includes the dq / dk / dv conversions)
LINEAR_FWD_BWD_MEASURED = {(4, 16, 8192, 128): 32.38e-3, (8, 16, 2048, 64): 5.35e-3}
FLA_FWD_BWD_MEASURED = {shape: t * r for (shape, t), r in zip(LINEAR_FWD_BWD_MEASURED.items(), (0.11, 0.36))}
# The segment (chunk-parallel) kernels on the H200 (benchmarks/results/2026-11-29-h200.md), the
# only rows of them measured: forward, forward + backward.
CP_MEASURED_H200 = {(4, 16, 8192, 128): (4.03e-3, 28.70e-3)}
# SDPA flash, causal softmax at the same shapes (the issue's second target: >= 4x it at S = 8192)
SDPA_FWD_MEASURED = {shape: t * r for (shape, t), r in zip(LINEAR_FWD_MEASURED.items(), (0.33, 0.25))}
SDPA_FWD_BWD_MEASURED = {shape: t * r for (shape, t), r in zip(LINEAR_FWD_BWD_MEASURED.items(), (0.38, 0.23))}
# softmax, B * S = 32k, H = 16, bf16: TFLOP/s by (D, S, causal)
SOFTMAX_TFLOPS = {
    # D, S, causal: (mma.sync fwd, wgmma fwd, wgmma bwd, mma.sync bwd)
    (64, 1024, False): (246, 313, 229, 168), (64, 2048, False): (262, 356, 264, 187), (64, 4096, False): (269, 378, 288, 198),
    (64, 8192, False): (273, 392, 298, 205), (64, 16384, False): (275, 366, 306, 210),
    (64, 1024, True): (101, 153, 131, 82), (64, 2048, True): (173, 223, 184, 120), (64, 4096, True): (218, 287, 231, 151),
    (64, 8192, True): (242, 339, 270, 177), (64, 16384, True): (256, 373, 295, 199),
    (128, 1024, False): (251, 448, 286, 197), (128, 2048, False): (278, 494, 324, 215), (128, 4096, False): (276, 522, 350, 226),
    (128, 8192, False): (299, 539, 362, 235), (128, 16384, False): (302, 485, 359, 238),
    (128, 1024, True): (135, 251, 180, 106), (128, 2048, True): (213, 343, 240, 149), (128, 4096, True): (243, 429, 295, 180),
    (128, 8192, True): (266, 487, 332, 208), (128, 16384, True): (282, 530, 363, 231),
}
SOFTMAX_CLASSES = ("mma.sync fwd", "wgmma fwd", "wgmma bwd", "mma.sync bwd")
CAL_ROWS = ((4096, False), (1024, True))  # the two rows each softmax class is fitted on
# block-sparse (mma.sync kernels walking the tile index), B = 1, S = 16k, 128 x 128 blocks, bf16:
# (layout, H, D): (fwd ms, fwd+bwd ms); layouts: benchmarks/sparse/bench_cuda.py
SPARSE_MS = {("bigbird", 8, 64): (0.62, 2.13), ("fixed", 8, 64): (0.21, 1.56), ("bigbird", 8, 128): (1.44, 3.96),
             ("fixed", 8, 128): (0.75, 3.02), ("bigbird", 16, 64): (0.79, 3.08), ("fixed", 16, 64): (0.41, 2.49),
             ("bigbird", 16, 128): (2.32, 6.14), ("fixed", 16, 128): (1.48, 4.95)}
# FlexAttention with the same BlockMask, the same run and rows: (fwd ms, fwd+bwd ms)
FLEX_MS = {("bigbird", 8, 64): (0.37, 1.14), ("fixed", 8, 64): (0.17, 0.86), ("bigbird", 8, 128): (0.55, 1.68),
           ("fixed", 8, 128): (0.27, 1.29), ("bigbird", 16, 64): (0.51, 1.79), ("fixed", 16, 64): (0.28, 1.42),
           ("bigbird", 16, 128): (0.84, 2.77), ("fixed", 16, 128): (0.52, 2.28)}


# ---------------------------------------------------------------------------------- occupancy
@dataclass
class Resources:
    threads: int
    regs: int
    smem: int  # bytes per CTA
    spills: int = 0


def ctas_per_sm(r: Resources) -> int:
    regs = (r.regs + 7) // 8 * 8 * r.threads  # allocated per warp in units of 256 = 8 per thread
    by_regs = REGS_PER_SM // regs
    by_smem = SMEM_PER_SM // (r.smem + SMEM_RESERVED_PER_CTA)
    return max(0, min(by_regs, by_smem, THREADS_PER_SM // r.threads, CTAS_PER_SM))


# Linear: ptxas of the bf16 kernels (nvcc 13.0, sm_90a, -O3; the command is in
# benchmarks/results/2026-11-29-gpu-cost.md) and Smem<kM>::kBytes. Softmax: registers from the
# ncu of 2026-11-24; their shared memory is not recorded there, and the registers alone bound
# them (384 x 168: one CTA per SM; 128 x 255: two), so it is set to fit.
RESOURCES: Dict[str, Resources] = {
    "linear fwd seq, M 128": Resources(128, 165, 108_304),
    "linear fwd seq, M 64": Resources(128, 160, 58_896),
    "linear fwd cp state, M 128": Resources(128, 167, 108_304),
    "linear fwd cp out, M 128": Resources(128, 202, 108_304),
    "linear fwd cp state, M 64": Resources(128, 128, 58_896),
    "linear fwd cp out, M 64": Resources(128, 168, 58_896),
    "linear scan": Resources(128, 18, 0),
    "linear bwd seq, M 128": Resources(128, 248, 108_560),
    "linear bwd seq, M 64": Resources(128, 222, 59_152),
    "linear bwd cp U, M 128": Resources(128, 216, 108_560),
    "linear bwd cp dQ, M 128": Resources(128, 252, 108_560),
    "linear bwd cp dK dV, M 128": Resources(128, 255, 108_560),
    "linear bwd cp U, M 64": Resources(128, 168, 59_152),
    "linear bwd cp dQ, M 64": Resources(128, 211, 59_152),
    "linear bwd cp dK dV, M 64": Resources(128, 246, 59_152),
    "linear finalize": Resources(128, 32, 0),
    # chunk_fwd_kernel.cuh (sm_90a, bf16; StateSmem / OutSmem<kM>::kBytes)
    "linear fwd cs state, M 128": Resources(128, 196, 79_896),
    "linear fwd cs out, M 128": Resources(128, 160, 60_424),
    "linear fwd cs state, M 64": Resources(128, 128, 55_320),
    "linear fwd cs out, M 64": Resources(128, 141, 35_592),
    # chunk_bwd_kernel.cuh (sm_90a, bf16): the walks share StateSmem; GradSmem<kM>::kBytes
    "linear bwd cs walk, M 128": Resources(128, 200, 79_896),
    "linear bwd cs walk, M 64": Resources(128, 146, 55_320),
    "linear bwd cs dQ, M 128": Resources(128, 251, 85_512),
    "linear bwd cs dK dV, M 128": Resources(128, 254, 85_512),
    "linear bwd cs dQ, M 64": Resources(128, 153, 52_232),
    "linear bwd cs dK dV, M 64": Resources(128, 202, 52_232),
    "decode combine": Resources(128, 32, 0),  # one warp per row, few registers
    "linear step": Resources(256, 40, 10_480),  # w per feature: 3 x 4 x M floats of features and gates
    # decode_kernel<bf16, 128, 8 rows> (benchmarks/results/2026-11-24-decode-ptxas.md: 239 on sm_80), 34 KB static
    "decode": Resources(128, 239, 34_048),
    # decode_mma_kernel<bf16, 128> (mma_kernel.cuh): 255 registers; 3 stages x 4 warps x (K, V) 16 x 128
    # tiles + the Q tile + 16 policies of 96 bytes, dynamic
    "decode mma": Resources(128, 255, 98_304 + 4_096 + 1_536),
    "mma.sync fwd": Resources(128, 255, 64 * 1024),
    "wgmma fwd": Resources(384, 168, 64 * 1024),
    "wgmma bwd": Resources(384, 168, 64 * 1024),
    "mma.sync bwd": Resources(256, 255, 64 * 1024),  # the dK / dV kernel (ncu: 256 threads, 255 registers)
}


# ---------------------------------------------------------------------------------- the schedule
@dataclass
class Launch:
    name: str
    res: Resources
    cta_times: List[float]          # seconds per CTA, in launch order
    dram_bytes: float
    mma_flops: float = 0.0
    notes: str = ""


def list_schedule(times: List[float], slots: int) -> float:
    """Makespan of CTAs started in order on `slots` slots, each on the first free one."""
    if len(times) <= slots:
        return max(times, default=0.0)
    heap = [0.0] * slots
    for t in times:
        heapq.heapreplace(heap, heap[0] + t)
    return max(heap)


def predict(launch: Launch) -> Dict[str, float]:
    cps = ctas_per_sm(launch.res)
    if cps == 0:
        raise ValueError(f"{launch.name}: does not fit on an SM")
    slots = SMS * cps
    ctas = len(launch.cta_times)
    t_sched = list_schedule(launch.cta_times, slots)
    t_mem = launch.dram_bytes / COPY_BW
    return dict(ctas=ctas, cps=cps, waves=math.ceil(ctas / slots), t_sched=t_sched, t_mem=t_mem,
                time=max(t_sched, t_mem) + LAUNCH_S)


# ---------------------------------------------------------------------------------- linear attention
CHUNK, KN = 64, 64
LATENCY = None  # fitted by calibrate_latency()
MMA_SYNC_CTA_RATE = None  # flop/s of one 4-warp mma.sync CTA, from the softmax fit (D = 128)


def bucket(m: int) -> int:
    return 64 if m <= 64 else 128


def linear_chunk_mma_flops(m: int, *, out: bool, causal: bool, update: bool) -> float:
    """Tensor-core flops of one chunk of one CTA (kN value columns), as the kernel issues them:
    the feature width padded to its bucket, partial chunks padded to 64 rows."""
    km = bucket(m)
    f = 0.0
    if out:
        f += 2 * CHUNK * km * KN           # Q~ S
        if causal:
            f += 2 * CHUNK * CHUNK * km    # Q~ K~^T
            f += 2 * CHUNK * CHUNK * KN    # A V
    if update:
        f += 2 * km * CHUNK * KN           # (wk K~)^T V
    return f


def seq_trips_per_chunk(m: int, out: bool) -> int:
    """The sequential kernel's staging loops: one global load per iteration, per thread
    (kChunk x kM / 128 for Q~ and for K~, kChunk x kN / 128 for V), plus the row scalars."""
    km = bucket(m)
    return (CHUNK * km // 128) * (2 if out else 1) + CHUNK * KN // 128 + 2


CP_TRIPS_PER_CHUNK = 3  # the row scalars (decay, key mask), then one batch of 16-byte loads


def linear_fwd_seq(b, h, s, m, dv, *, causal=True) -> List[Launch]:
    tiles = math.ceil(dv / KN)
    chunks = math.ceil(s / CHUNK)
    passes = [(True, causal)] if causal else [(False, True), (True, False)]
    t = 0.0
    flops = 0.0
    for out, update in passes:
        f = linear_chunk_mma_flops(m, out=out, causal=causal, update=update)
        t += chunks * (seq_trips_per_chunk(m, out) * LATENCY + f / MMA_SYNC_CTA_RATE)
        flops += chunks * f
    n = tiles * h * b
    io = 2 * b * h * s * (2 * m * tiles + 2 * dv)  # Q~, K~ per value tile; V, O once
    return [Launch(f"linear fwd seq, M {bucket(m)}", RESOURCES[f"linear fwd seq, M {bucket(m)}"], [t] * n, io,
                   flops * n)]


def linear_fwd_cp(b, h, s, m, dv, *, causal=True, segment_chunks=0, overhead=0.0) -> List[Launch]:
    """The chunk-parallel forward's three launches, with dispatch.cu's segment plan; `overhead`
    seconds more per chunk step of a CTA (fit_chunk_overhead)."""
    km = bucket(m)
    tiles = math.ceil(dv / KN)
    chunks = max(1, math.ceil(s / CHUNK))
    if segment_chunks <= 0:
        base = tiles * h * b
        n_seg = min(max(1, math.ceil(8 * SMS / base)), chunks)
        segment_chunks = math.ceil(chunks / n_seg)
    segment_chunks = min(segment_chunks, chunks)
    n_seg = math.ceil(chunks / segment_chunks)
    dva = dv  # plain linear attention of the benchmark: no normalizer column
    state_bytes = b * h * n_seg * m * dva * 4
    launches = []
    # segment states: the update per chunk, the state stored at the end (stores do not wait)
    f_state = linear_chunk_mma_flops(m, out=False, causal=causal, update=True)
    per = [segment_chunks * (CP_TRIPS_PER_CHUNK * LATENCY + f_state / MMA_SYNC_CTA_RATE + overhead)]
    io = 2 * b * h * s * m * tiles + 2 * b * h * s * dv
    launches.append(Launch(f"linear fwd cp state, M {km}", RESOURCES[f"linear fwd cp state, M {km}"],
                           per * (tiles * h * b * n_seg), io + state_bytes, f_state * chunks * tiles * h * b))
    # the scan: per element n_seg dependent load / store steps (the loop is not unrolled)
    n_scan = math.ceil(m * dva / 128) * h * b
    launches.append(Launch("linear scan", RESOURCES["linear scan"], [n_seg * LATENCY] * n_scan,
                           3 * state_bytes))
    # outputs: the state load (4 batches at M 128, 2 at M 64), then every chunk
    f_out = linear_chunk_mma_flops(m, out=True, causal=causal, update=False)
    f_upd = linear_chunk_mma_flops(m, out=False, causal=causal, update=True) if causal else 0.0
    per_cta = (km // 32) * LATENCY + segment_chunks * (CP_TRIPS_PER_CHUNK * LATENCY + f_out / MMA_SYNC_CTA_RATE + overhead) \
        + (segment_chunks - 1) * f_upd / MMA_SYNC_CTA_RATE
    io = 2 * b * h * s * (2 * m * tiles + 2 * dv)
    launches.append(Launch(f"linear fwd cp out, M {km}", RESOURCES[f"linear fwd cp out, M {km}"],
                           [per_cta] * (tiles * h * b * n_seg), io + state_bytes,
                           (f_out * chunks + f_upd * (chunks - n_seg)) * tiles * h * b))
    return launches


def linear_bwd_chunk_mma_flops(m: int, *, causal: bool) -> Dict[str, float]:
    """Tensor-core flops of one chunk of one backward CTA, by product group (mma_bwd_kernel.cuh)."""
    km, c, n = bucket(m), CHUNK, KN
    upd = 2 * km * c * n                                   # add_outer: S or U update
    dq = 2 * c * n * km + (2 * c * n * c + 2 * c * c * km if causal else 0)   # dO' S^T (+ P, P K~)
    dk = 2 * c * n * km + (2 * c * n * c + 2 * c * c * km if causal else 0)   # V U^T (+ P1, P1 Q~)
    dv = 2 * c * km * n + (2 * c * km * c + 2 * c * c * n if causal else 0)   # K~ U (+ P2, P2 dO')
    return dict(update=upd, dq=dq, dkv=dk + dv)


def seq_bwd_trips_per_chunk(m: int) -> int:
    """The sequential backward's staging loops per sweep and chunk (plain linear attention, no
    normalizer: no dout . out dots): the Q~ / K~ loop (kChunk x kM / 128 iterations), V
    (kChunk x kN / 128), dO' (16 rows per warp x kN / 32), the row scalars."""
    return CHUNK * bucket(m) // 128 + CHUNK * KN // 128 + (CHUNK // 4) * (KN // 32) + 2


CP_BWD_TRIPS_PER_CHUNK = 4  # the row scalars, then two batches of 16-byte loads


def fit_chunk_overhead() -> float:
    """Seconds per chunk step of a segment-kernel CTA that the model does not explain: the one
    measured forward row of the segment kernels (H200) against their prediction, by bisection.
    Applied to the chunk-state kernels as a pessimistic bound: their chunk step has none of the
    segment kernels' per-element loops, but nothing has measured where those spend the time."""
    (b, h, s, d), (t_meas, _) = next(iter(CP_MEASURED_H200.items()))
    lo, hi = 0.0, 1e-3
    for _ in range(60):
        mid = (lo + hi) / 2
        if total(linear_fwd_cp(b, h, s, d, d, overhead=mid)) < t_meas:
            lo = mid
        else:
            hi = mid
    return lo


def linear_bwd_cs(b, h, s, m, dv, *, causal=True, overhead=0.0) -> List[Launch]:
    """The chunk-state backward (chunk_bwd_kernel.cuh; the benchmark's call: unnormalized, no
    prep launch): the state walk again, the reverse walk (both as the forward's walk), then one
    CTA per (chunk, value tile, head, sequence) for dQ~ and another for dK~ / dV, then the
    conversions."""
    km = bucket(m)
    tiles = math.ceil(dv / KN)
    chunks = max(1, math.ceil(s / CHUNK))
    n = tiles * h * b
    f = linear_bwd_chunk_mma_flops(m, causal=causal)
    per_chunk = max(f["update"] / MMA_SYNC_CTA_RATE, LATENCY / 2) + overhead
    state_store = (chunks if causal else 1) * km * KN * 2 * n
    walk_io = 2 * b * h * s * (m * tiles + dv) + state_store
    walk = [LATENCY + chunks * per_chunk] * n
    out = [Launch(f"linear bwd cs walk, M {km}", RESOURCES[f"linear bwd cs walk, M {km}"], walk, walk_io,
                  f["update"] * chunks * n),
           Launch(f"linear bwd cs walk, M {km}", RESOURCES[f"linear bwd cs walk, M {km}"], walk, walk_io,
                  f["update"] * chunks * n)]
    io = 2 * b * h * s
    # dQ~: dout, V, K (and Q for dG) per value tile, its state; atomics into the fp32 dQ~ (4 B)
    out.append(Launch(f"linear bwd cs dQ, M {km}", RESOURCES[f"linear bwd cs dQ, M {km}"],
                      [2 * LATENCY + f["dq"] / MMA_SYNC_CTA_RATE + overhead] * (n * chunks),
                      io * tiles * (2 * dv // tiles + m) + state_store + b * h * s * m * 4 * tiles,
                      f["dq"] * chunks * n))
    out.append(Launch(f"linear bwd cs dK dV, M {km}", RESOURCES[f"linear bwd cs dK dV, M {km}"],
                      [2 * LATENCY + f["dkv"] / MMA_SYNC_CTA_RATE + overhead] * (n * chunks),
                      io * tiles * (2 * dv // tiles + 2 * m) + state_store + b * h * s * (m * tiles + dv) * 4,
                      f["dkv"] * chunks * n))
    out.append(finalize_launch(b, h, s, m, dv))
    return out


def linear_fwd_cs(b, h, s, m, dv, *, causal=True, overhead=0.0) -> List[Launch]:
    """The chunk-state forward (chunk_fwd_kernel.cuh): the state walk, one CTA per (value tile,
    head, sequence), each chunk's product behind a copy issued kStages - 1 = 2 chunks earlier (a
    chunk costs its product or half a round trip, whichever is longer), storing each chunk's
    16-bit state; then one CTA per (chunk, value tile, head, sequence): the row scalars, one batch
    of copies, the products."""
    km = bucket(m)
    tiles = math.ceil(dv / KN)
    chunks = max(1, math.ceil(s / CHUNK))
    n = tiles * h * b
    f_upd = linear_chunk_mma_flops(m, out=False, causal=causal, update=True)
    per_chunk = max(f_upd / MMA_SYNC_CTA_RATE, LATENCY / 2) + overhead
    state_store = (chunks if causal else 1) * km * KN * 2 * n
    io = 2 * b * h * s * (m * tiles + dv) + state_store  # K per value tile, V once, the states
    launches = [Launch(f"linear fwd cs state, M {km}", RESOURCES[f"linear fwd cs state, M {km}"],
                       [LATENCY + chunks * per_chunk] * n, io, f_upd * chunks * n)]
    f_out = linear_chunk_mma_flops(m, out=True, causal=causal, update=False)
    per_cta = 2 * LATENCY + f_out / MMA_SYNC_CTA_RATE + overhead
    io = 2 * b * h * s * ((2 if causal else 1) * m * tiles + 2 * dv) + state_store
    launches.append(Launch(f"linear fwd cs out, M {km}", RESOURCES[f"linear fwd cs out, M {km}"],
                           [per_cta] * (n * chunks), io, f_out * chunks * n))
    return launches


def finalize_launch(b, h, s, m, dv) -> Launch:
    # fp32 scratch rows read, 16-bit gradients written: dq, dk (M wide), dv (Dv wide)
    elems = b * h * s * (2 * m + dv)
    return Launch("linear finalize", RESOURCES["linear finalize"], [0.0] * 4096, elems * 6)


def linear_bwd_seq(b, h, s, m, dv, *, causal=True) -> List[Launch]:
    km = bucket(m)
    tiles = math.ceil(dv / KN)
    chunks = math.ceil(s / CHUNK)
    f = linear_bwd_chunk_mma_flops(m, causal=causal)
    per_chunk = f["dq"] + f["dkv"] + 2 * f["update"]  # the S and U updates of the two sweeps
    t = chunks * (2 * seq_bwd_trips_per_chunk(m) * LATENCY + per_chunk / MMA_SYNC_CTA_RATE)
    n = tiles * h * b
    io = 2 * b * h * s * (4 * m * tiles + 3 * dv)
    return [Launch(f"linear bwd seq, M {km}", RESOURCES[f"linear bwd seq, M {km}"], [t] * n, io, per_chunk * chunks * n),
            finalize_launch(b, h, s, m, dv)]


def linear_bwd_cp(b, h, s, m, dv, *, causal=True, segment_chunks=0) -> List[Launch]:
    """The chunk-parallel backward: the forward's segment states and scan, then kSegU, the reverse
    scan, kSegDq and kSegDkv (dispatch.cu), then the conversions."""
    km = bucket(m)
    tiles = math.ceil(dv / KN)
    chunks = max(1, math.ceil(s / CHUNK))
    fwd = linear_fwd_cp(b, h, s, m, dv, causal=causal, segment_chunks=segment_chunks)
    n_ctas = len(fwd[0].cta_times)
    n_seg = n_ctas // (tiles * h * b)
    seg = math.ceil(chunks / n_seg)
    f = linear_bwd_chunk_mma_flops(m, causal=causal)
    trip = CP_BWD_TRIPS_PER_CHUNK * LATENCY
    state_load = (km // 32) * LATENCY
    state_bytes = b * h * n_seg * m * dv * 4
    io = 2 * b * h * s
    out = fwd[:2]
    out.append(Launch(f"linear bwd cp U, M {km}", RESOURCES[f"linear bwd cp U, M {km}"],
                      [seg * (trip + f["update"] / MMA_SYNC_CTA_RATE)] * n_ctas, io * (m + dv) + state_bytes,
                      f["update"] * chunks * tiles * h * b))
    out.append(fwd[1])  # the reverse scan: the same shape as the forward's
    dq_upd = f["update"] if causal else 0.0
    out.append(Launch(f"linear bwd cp dQ, M {km}", RESOURCES[f"linear bwd cp dQ, M {km}"],
                      [state_load + seg * (trip + f["dq"] / MMA_SYNC_CTA_RATE) + (seg - 1) * dq_upd / MMA_SYNC_CTA_RATE]
                      * n_ctas, io * (m + 2 * dv) + state_bytes,
                      (f["dq"] * chunks + dq_upd * (chunks - n_seg)) * tiles * h * b))
    out.append(Launch(f"linear bwd cp dK dV, M {km}", RESOURCES[f"linear bwd cp dK dV, M {km}"],
                      [state_load + seg * (trip + f["dkv"] / MMA_SYNC_CTA_RATE) + (seg - 1) * dq_upd / MMA_SYNC_CTA_RATE]
                      * n_ctas, io * (2 * m + 2 * dv) + state_bytes,
                      (f["dkv"] * chunks + dq_upd * (chunks - n_seg)) * tiles * h * b))
    out.append(finalize_launch(b, h, s, m, dv))
    return out


STEP_CASES = [(8, 32, 128), (64, 32, 128), (256, 16, 64)]  # benchmarks/linear/bench_cuda.py --step


def linear_step_launch(b, h, m, dv, t=1) -> Launch:
    """step_kernel.cuh: one CTA per (b, h); its chain: the features (and decay) of the block's
    positions, z, then per 32-column tile the v loads and one round trip per 32 rows (8 row groups
    x 4 rows in flight); stores do not wait."""
    tiles = math.ceil(dv / 32)
    trips = max(1, math.ceil(t * m / 256)) + math.ceil(m / 256) + tiles * (1 + math.ceil(m / 32))
    nbytes = 2 * b * h * (m * dv + m) * 4 + b * h * t * (2 * m + 2 * dv) * 2
    return Launch("linear step", RESOURCES["linear step"], [trips * LATENCY] * (b * h), nbytes)


# The decode kernel (csrc/decode/cuda/kernel.cuh), bf16, D = 128, GQA 8 rows per pass: per
# thread and key-loop iteration (16 keys of the CTA, 2 per key group) an estimate from the source,
# not a count: 4 16-byte loads and their addresses (14), K / V conversions (32), Q.K FMAs (128),
# the 16-lane reductions (128), scores (48), the online softmax of 8 rows (160), P V (192).
DECODE_INSTR_PER_ITER = 700
# 8-bit caches (the same kernel, 8-byte vectors of 8 elements: the bf16 layout of lanes): the
# widening costs 2 instructions per element for int8 (byte extract, convert) and about 6 for e4m3
# (common/fp8.h: mask, shift, multiply, sign, NaN select), on 32 elements per thread and
# iteration (+32 / +160 over bf16's 32), and the per-row descales 2 loads and 10 multiplies (+12)
DECODE_INSTR_PER_ITER_8BIT = {"int8": DECODE_INSTR_PER_ITER + 32 + 12, "fp8": DECODE_INSTR_PER_ITER + 160 + 12}
SM_CLOCK = 1.755e9   # H100 SXM boost
ISSUE_PER_CLK = 4    # warp instructions per SM per clock (4 schedulers): an upper bound on speed
# SDPA flash (GQA), B = 8, Hq = 32, Hkv = 8, D = 128, bf16, q_len 1: us by cache length (2026-11-24)
SDPA_DECODE_US = {4096: 75.8, 8192: 101.0, 16384: 185.5, 32768: 357.9, 65536: 708.1}


def decode_splits(ctas: int, sk: int, old: bool = False) -> int:
    """csrc/decode/cuda/heuristics.h's count for SMS SMs (old: before 2026-11-29, the count
    around 2 x SMS / ctas rounded up)."""
    target = 2 * SMS
    if ctas * 5 >= target * 4 or sk < 1:
        return 1

    def capped(n):
        return max(1, min(n, sk // 256, 128))
    hi, lo = capped(math.ceil(target / ctas)), capped(target // ctas)
    if old:
        n = hi
    else:
        fill = lambda n: ctas * n / (math.ceil(ctas * n / target) * target)  # noqa: E731
        n = lo if fill(lo) > fill(hi) else hi
    return n if n >= 2 else 1


def decode_launches(b, hq, hk, sk, d=128, old_splits=False, cache: str = "bf16") -> List[Launch]:
    """decode_kernel + combine with decode_num_splits_heuristic's split count (heuristics.h):
    per iteration a CTA waits max(one round trip, its share of the SM's instruction issue).
    cache "int8" / "fp8": an 8-bit cache with per-row descales (its bytes, its instructions)."""
    ctas = b * hk
    splits = decode_splits(ctas, sk, old_splits)
    res = RESOURCES["decode"]
    cps = ctas_per_sm(res)
    keys = math.ceil(sk / splits)
    iters = math.ceil(keys / 16)
    instr = DECODE_INSTR_PER_ITER_8BIT.get(cache, DECODE_INSTR_PER_ITER)
    issue = cps * (res.threads // 32) * instr / ISSUE_PER_CLK / SM_CLOCK
    per_cta = iters * max(LATENCY, issue)
    kv = 2 * b * hk * sk * d * 2 if cache == "bf16" else 2 * b * hk * sk * (d + 4)  # + the float32 descales
    out = [Launch("decode", res, [per_cta] * (ctas * splits), kv)]
    if splits > 1:
        rows = b * hq
        out.append(Launch("decode combine", RESOURCES["decode combine"], [LATENCY * 2] * math.ceil(rows / 4),
                          rows * splits * (d + 1) * 4))
    return out


# The tensor-core decode kernel (csrc/decode/cuda/mma_kernel.cuh), bf16, D = 128: per warp and
# tile of 16 keys an estimate from the source (warp instructions): the tile's 16 cp.async with
# their addresses and the cursor (40), Q K^T (8 k-steps x 2 ldmatrix + 2 mma + addresses: 48), the
# policy, scores and online softmax of 8 logits per lane with the rescale of the 64 accumulators
# (170), P V (8 x ldmatrix.trans + 2 mma + address: 32), the wait and loop (10). The mma.sync
# count itself is checked against the emulator (tests/cuda_emu/test_decode_emulated.py::test_mma_count).
DECODE_MMA_INSTR_PER_TILE = 300


def decode_mma_launches(b, hq, hk, sk, d=128) -> List[Launch]:
    """decode_mma_kernel + combine, same splits as the CUDA-core kernel: a CTA pays the Q load
    and its pipeline's fill (two round trips) and the merge (one), then per 64 keys (a tile per
    warp) its share of the SM's instruction issue; the launch's DRAM bound does the rest (the
    pipelines keep 36-64 KB per SM in flight, above the copy bandwidth x latency)."""
    ctas = b * hk
    splits = decode_splits(ctas, sk)
    res = RESOURCES["decode mma"]
    cps = ctas_per_sm(res)
    keys = math.ceil(sk / splits)
    iters = math.ceil(keys / 64)
    issue = cps * (res.threads // 32) * DECODE_MMA_INSTR_PER_TILE / ISSUE_PER_CLK / SM_CLOCK
    per_cta = 3 * LATENCY + iters * issue
    rows = hq // hk
    flops = 2 * 2 * b * hk * sk * 16 * math.ceil(rows / 16) * d  # Q K^T and P V over 16 padded rows
    out = [Launch("decode mma", res, [per_cta] * (ctas * splits), 2 * b * hk * sk * d * 2, mma_flops=flops)]
    if splits > 1:
        out.append(Launch("decode combine", RESOURCES["decode combine"], [LATENCY * 2] * math.ceil(b * hq / 4),
                          b * hq * splits * (d + 1) * 4))
    return out


def report_decode() -> List[str]:
    lines = ["", "## Decode (B = 8, Hq = 32, Hkv = 8, D = 128, bf16): predicted, no GPU run of these kernels", "",
             "Kernels: the CUDA-core decode_kernel with the split count before 2026-11-29 and now (the default), "
             "and the tensor-core decode_mma_kernel (decode.set_cuda_kernels(tensor_cores=True)).", "",
             "| cache | kernel | splits | CTAs | K + V MB | predicted us | predicted GB/s (% of copy) | "
             "SDPA flash us (2026-11-24) | predicted ours / SDPA speed |", "|---|---|---|---|---|---|---|---|---|"]
    for sk, t_sdpa in SDPA_DECODE_US.items():
        for kind in ("before", "cuda cores", "tensor cores", "int8 cache", "fp8 cache"):
            launches = (decode_mma_launches(8, 32, 8, sk) if kind == "tensor cores"
                        else decode_launches(8, 32, 8, sk, old_splits=kind == "before",
                                             cache=kind.split()[0] if kind.endswith("cache") else "bf16"))
            t = total(launches)
            kv = launches[0].dram_bytes
            splits = len(launches[0].cta_times) // 64
            lines.append(f"| {sk // 1024}k | {kind} | {splits} | {len(launches[0].cta_times)} | "
                         f"{kv / 1e6:.0f} | {t * 1e6:.0f} | {kv / t / 1e9:.0f} ({kv / t / COPY_BW:.0%}) | {t_sdpa:.0f} | "
                         f"{t_sdpa * 1e-6 / t:.2f}x |")
    lines += ["", "The instruction counts are estimates from the source and the issue rate an upper bound (every "
              "scheduler issuing every clock), so these are optimistic; the kernel measured on 2026-11-24 was an "
              "earlier design (256 threads, 44 registers), so no recorded row checks these. The tensor-core kernel "
              "is predicted at the copy bandwidth: its issue time is a fraction of the bytes' time, so the row is "
              "the DRAM bound plus the launches, which SDPA flash already nearly reaches (2.9-3.0 TB/s at 16k-64k). "
              "The int8 / fp8 cache rows (CUDA-core kernel, per-row descales; decode.set_cuda_kernels(quantized=True)) "
              "read half the bytes but issue more instructions (the widening): the CUDA-core kernel being "
              "issue-bound, they are predicted no faster than the bf16 cache; a bandwidth-bound 8-bit decode needs "
              "the tensor-core kernel's schedule."]
    return lines


def total(launches: List[Launch]) -> float:
    return sum(predict(x)["time"] for x in launches)


# ---------------------------------------------------------------------------------- softmax
def softmax_flops(b, h, s, d, causal, bwd=False) -> float:
    f = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    return f * 2.5 if bwd else f


def softmax_ctas(cls: str, b, h, s, d, causal) -> List[float]:
    """Work units (128 x 64 score tiles) per CTA in launch order (blockIdx.x first): forward
    CTAs own 128 query rows, in reverse (m_block = gridDim.x - 1 - blockIdx.x: the longest causal
    rows first), the backward's own 128 keys (key block i is seen by query blocks i..n-1, so
    also the longest first)."""
    n = s // 128
    units = []
    for _ in range(b * h):
        for i in range(n):
            vis = (n - i) if causal else n
            units.append(vis * 2)  # 64-key halves; the diagonal block's are computed whole, then masked
    return units


@dataclass
class SoftmaxFit:
    unit_s: float = 0.0  # one 128 x 64 score tile
    t0: float = 0.0      # per CTA: prologue, epilogue, pipeline fill


def softmax_launch(cls: str, fit: SoftmaxFit, b, h, s, d, causal) -> Launch:
    units = softmax_ctas(cls, b, h, s, d, causal)
    return Launch(cls, RESOURCES[cls], [fit.t0 + u * fit.unit_s for u in units], 4 * b * h * s * d * 2)


def sparse_launch(cls: str, fit: SoftmaxFit, layout, h: int) -> Launch:
    """The block-sparse call on the dense kernel class's fit: per CTA (128-query block, head) in
    the forward, (128-key block, head) in the backward, two 64-key units per visible block;
    layout (1 or H, n, n) bool as the benchmark builds it."""
    lay = layout.expand(h, -1, -1)
    per = lay.sum(-1) if cls.endswith("fwd") else lay.sum(-2)  # (H, n) visible blocks per CTA
    n = lay.shape[-1]
    units = [int(per[hh, n - 1 - i if cls.endswith("fwd") else i]) * 2 for hh in range(h) for i in range(n)]
    d = 64  # bytes: negligible next to the work; the head dim is in the fit
    return Launch(cls, RESOURCES[cls], [fit.t0 + u * fit.unit_s for u in units], 4 * h * n * 128 * d * 2)


def sparse_rows(fits) -> Tuple[List[str], float]:
    """Predicted vs measured block-sparse rows (no constant of their own: the dense fits)."""
    layout_of = sparse_layouts()
    lines, worst = [], 0.0
    for (name, h, d), (t_fwd, t_fb) in SPARSE_MS.items():
        layout = layout_of(name, h)
        fwd = predict(sparse_launch("mma.sync fwd", fits[("mma.sync fwd", d)], layout, h))["time"]
        bwd = predict(sparse_launch("mma.sync bwd", fits[("mma.sync bwd", d)], layout, h))["time"]
        for what, t, meas in (("fwd", fwd, t_fwd), ("fwd+bwd", fwd + bwd, t_fb)):
            worst = max(worst, abs(math.log(t * 1e3 / meas)))
            lines.append(f"| block-sparse {name}, {what} | H {h}, S 16384, D {d} | {meas:.3f} | {t * 1e3:.3f} | "
                         f"{t * 1e3 / meas:.2f} |  |")
    return lines, worst


def sparse_layouts():
    """The benchmark's layouts (benchmarks/sparse/bench_cuda.py), by name."""
    import importlib.util
    root = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("sparse_bench", os.path.join(root, "sparse", "bench_cuda.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    n = 16384 // 128
    return lambda name, h: mod.bigbird_layout(h, n) if name == "bigbird" else mod.fixed_layout(n)


def report_sparse_wgmma(fits) -> List[str]:
    """Block-sparse on the wgmma kernels (set_cuda_kernels(hopper_fwd=2, hopper_bwd=2)): the dense
    wgmma fits on the layout's visible blocks, as the mma.sync rows above are predicted. Full
    blocks skip the element mask there, so a visible block costs a dense tile; the CSR / CSC
    index adds one 4-byte read per block to the producer warp's loads, counted as no time."""
    layout_of = sparse_layouts()
    lines = ["", "## Block-sparse on the wgmma kernels (hopper_fwd=2, hopper_bwd=2): predicted, no GPU timing yet", "",
             "B = 1, S = 16384, 128 x 128 blocks, bf16; ours (mma.sync) and FlexAttention measured on the H100 "
             "(2026-11-24), the same rows as above.", "",
             "| layout | (H, D) | pass | mma.sync measured ms | wgmma predicted ms | Flex measured ms | "
             "predicted wgmma / Flex speed (target >= 1.0x) |", "|---|---|---|---|---|---|---|"]
    for (name, h, d), (t_fwd, t_fb) in SPARSE_MS.items():
        layout = layout_of(name, h)
        fwd = predict(sparse_launch("wgmma fwd", fits[("wgmma fwd", d)], layout, h))["time"] * 1e3
        bwd = predict(sparse_launch("wgmma bwd", fits[("wgmma bwd", d)], layout, h))["time"] * 1e3
        f_fwd, f_fb = FLEX_MS[(name, h, d)]
        for what, ours, pred, flex in (("fwd", t_fwd, fwd, f_fwd), ("fwd+bwd", t_fb, fwd + bwd, f_fb)):
            lines.append(f"| {name} | ({h}, {d}) | {what} | {ours:.2f} | {pred:.3f} | {flex:.2f} | {flex / pred:.2f}x |")
    lines += ["", "The prediction assumes the dense kernels' per-tile rate on every visible block; the layouts' "
              "diagonal blocks are partial only under causal masks, which these rows do not use."]
    return lines


def measured_softmax(cls: str, d: int, s: int, causal: bool) -> float:
    tf = SOFTMAX_TFLOPS[(d, s, causal)][SOFTMAX_CLASSES.index(cls)] * 1e12
    b = 32768 // s
    return softmax_flops(b, 16, s, d, causal, bwd=cls.endswith("bwd")) / tf


def fit_softmax(cls: str, d: int) -> SoftmaxFit:
    """unit_s from the non-causal S = 16k row (equal CTAs), t0 from the causal S = 1k row; a few
    rounds, each solving one with the other fixed (bisection: the time grows with each)."""
    fit = SoftmaxFit()
    (s_a, c_a), (s_b, c_b) = CAL_ROWS
    t_a, t_b = measured_softmax(cls, d, s_a, c_a), measured_softmax(cls, d, s_b, c_b)

    def solve(attr, target, s, causal):
        lo, hi = 0.0, 1e-3
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            setattr(fit, attr, mid)
            if predict(softmax_launch(cls, fit, 32768 // s, 16, s, d, causal))["time"] < target:
                lo = mid
            else:
                hi = mid
        setattr(fit, attr, 0.5 * (lo + hi))

    for _ in range(6):
        solve("unit_s", t_a, s_a, c_a)
        solve("t0", t_b, s_b, c_b)
    return fit


# ---------------------------------------------------------------------------------- calibration
def calibrate() -> Tuple[Dict[Tuple[str, int], SoftmaxFit], List[str]]:
    global LATENCY, MMA_SYNC_CTA_RATE
    fits = {(cls, d): fit_softmax(cls, d) for cls in SOFTMAX_CLASSES for d in (64, 128)}
    # one 4-warp mma.sync CTA's rate: a 128 x 64 x D tile's 2 products (QK^T, PV) per unit_s
    f = fits[("mma.sync fwd", 128)]
    MMA_SYNC_CTA_RATE = 2 * 2 * 128 * 64 * 128 / f.unit_s
    # LATENCY: each linear row alone (one unknown each), then their mean
    fitted = []
    for shape, t_meas in LINEAR_FWD_MEASURED.items():
        lo, hi = 1e-9, 5e-6
        for _ in range(60):
            LATENCY = 0.5 * (lo + hi)
            if total(linear_fwd_seq(*shape[:3], shape[3], shape[3])) < t_meas:
                lo = LATENCY
            else:
                hi = LATENCY
        fitted.append(LATENCY)
    LATENCY = sum(fitted) / len(fitted)
    lines = ["## Calibration (H100 rows of benchmarks/results/2026-11-24-h100.md)", "",
             f"LATENCY = {LATENCY * 1e6:.3f} us per dependent round trip (the two rows alone: "
             + ", ".join(f"{x * 1e6:.3f}" for x in fitted) + " us)",
             f"one 4-warp mma.sync CTA: {MMA_SYNC_CTA_RATE / 1e12:.2f} TFLOP/s", "",
             "| kernel | D | unit (128 x 64 tile) | t0 per CTA | tile rate, % of an SM's wgmma peak |",
             "|---|---|---|---|---|"]
    for (cls, d), f in fits.items():
        cps = ctas_per_sm(RESOURCES[cls])
        rate = 2 * 2 * 128 * 64 * d / f.unit_s * cps * (2.5 if cls.endswith("bwd") else 1)
        lines.append(f"| {cls} | {d} | {f.unit_s * 1e9:.0f} ns | {f.t0 * 1e6:.2f} us | "
                     f"{rate / (WGMMA_PEAK / SMS):.0%} |")
    return fits, lines


def check_table(fits) -> Tuple[List[str], float]:
    lines = ["", "## Predicted vs measured (H100, bf16)", "",
             "| kernel | shape | measured ms | predicted ms | predicted / measured | fitted on |", "|---|---|---|---|---|---|"]
    worst = 0.0
    for shape, t_meas in LINEAR_FWD_MEASURED.items():
        t = total(linear_fwd_seq(*shape[:3], shape[3], shape[3]))
        worst = max(worst, abs(math.log(t / t_meas)))
        lines.append(f"| linear fwd (sequential) | {shape} | {t_meas * 1e3:.3f} | {t * 1e3:.3f} | {t / t_meas:.2f} | LATENCY |")
    for shape, t_fb in LINEAR_FWD_BWD_MEASURED.items():
        t_meas = t_fb - LINEAR_FWD_MEASURED[shape]
        t = total(linear_bwd_seq(*shape[:3], shape[3], shape[3]))
        worst = max(worst, abs(math.log(t / t_meas)))
        lines.append(f"| linear bwd (sequential; fwd+bwd - fwd) | {shape} | {t_meas * 1e3:.3f} | {t * 1e3:.3f} | "
                     f"{t / t_meas:.2f} |  |")
    for (cls, d), f in fits.items():
        for (dd, s, causal) in SOFTMAX_TFLOPS:
            if dd != d:
                continue
            t_meas = measured_softmax(cls, d, s, causal)
            t = predict(softmax_launch(cls, f, 32768 // s, 16, s, d, causal))["time"]
            cal = (s, causal) in CAL_ROWS
            if not cal:
                worst = max(worst, abs(math.log(t / t_meas)))
            lines.append(f"| {cls} | D {d}, S {s}{', causal' if causal else ''} | {t_meas * 1e3:.3f} | {t * 1e3:.3f} | "
                         f"{t / t_meas:.2f} | {'yes' if cal else ''} |")
    sp, w_sp = sparse_rows(fits)
    lines += sp
    worst = max(worst, w_sp)
    lines.append("")
    lines.append(f"Worst row not fitted on: predicted / measured = {math.exp(worst):.2f}x or 1 / that.")
    return lines, worst


# ---------------------------------------------------------------------------------- predictions
def report_linear() -> List[str]:
    lines = ["", "## Linear attention: the chunk-parallel redesign, predicted (no GPU run yet)", "",
             "| (B, H, S, D) | launch | CTAs | CTAs / SM | waves | mma TFLOP | DRAM MB | predicted ms |",
             "|---|---|---|---|---|---|---|---|"]
    for shape in LINEAR_FWD_MEASURED:
        b, h, s, d = shape
        for launch in linear_fwd_seq(b, h, s, d, d) + linear_fwd_cp(b, h, s, d, d) + linear_fwd_cs(b, h, s, d, d):
            p = predict(launch)
            lines.append(f"| {shape} | {launch.name} | {p['ctas']} | {p['cps']} | {p['waves']} | "
                         f"{launch.mma_flops / 1e12:.3f} | {launch.dram_bytes / 1e6:.0f} | {p['time'] * 1e3:.3f} |")
        for launch in linear_bwd_seq(b, h, s, d, d) + linear_bwd_cp(b, h, s, d, d) + linear_bwd_cs(b, h, s, d, d):
            p = predict(launch)
            lines.append(f"| {shape} | {launch.name} | {p['ctas']} | {p['cps']} | {p['waves']} | "
                         f"{launch.mma_flops / 1e12:.3f} | {launch.dram_bytes / 1e6:.0f} | {p['time'] * 1e3:.3f} |")
    lines += ["", "| (B, H, S, D) | pass | sequential measured ms | chunk-parallel predicted ms | FLA measured ms | "
                  "predicted ours-cp / FLA (> 1: ours faster; target >= 1.0x) | SDPA-flash causal measured ms | "
                  "predicted ours-cp / SDPA (target >= 4x at S = 8192) |", "|---|---|---|---|---|---|---|---|"]
    for shape, t_seq in LINEAR_FWD_MEASURED.items():
        b, h, s, d = shape
        t_cp = total(linear_fwd_cp(b, h, s, d, d))
        t_fla = FLA_FWD_MEASURED[shape]
        t_sdpa = SDPA_FWD_MEASURED[shape]
        lines.append(f"| {shape} | fwd | {t_seq * 1e3:.2f} | {t_cp * 1e3:.3f} | {t_fla * 1e3:.2f} | {t_fla / t_cp:.2f}x "
                     f"| {t_sdpa * 1e3:.2f} | {t_sdpa / t_cp:.1f}x |")
        t_cp += total(linear_bwd_cp(b, h, s, d, d))
        t_fla, t_sdpa = FLA_FWD_BWD_MEASURED[shape], SDPA_FWD_BWD_MEASURED[shape]
        lines.append(f"| {shape} | fwd+bwd | {LINEAR_FWD_BWD_MEASURED[shape] * 1e3:.2f} | {t_cp * 1e3:.3f} | "
                     f"{t_fla * 1e3:.2f} | {t_fla / t_cp:.2f}x | {t_sdpa * 1e3:.2f} | {t_sdpa / t_cp:.1f}x |")
    ovh = fit_chunk_overhead()
    lines += ["", "## Linear attention: the chunk-state kernels (set_cuda_kernels(chunk_states=True)), predicted", "",
              "The segment kernels measured 7x slower than this model on the H200 "
              f"({', '.join(f'{k}: {v[0] * 1e3:.2f} ms forward' for k, v in CP_MEASURED_H200.items())}); "
              f"as a per-chunk-step cost that is {ovh * 1e6:.1f} us the model does not explain. The chunk-state "
              "kernels are predicted twice: by the model, and with that cost added to each of their chunk "
              "steps (a pessimistic bound: their chunk step has none of the segment kernels' per-element "
              "loops, but no profile says which part of the step took the time).", "",
              "| (B, H, S, D) | pass | segment kernels predicted (fitted) / measured ms | chunk-state ms: model | "
              "with the fitted cost | FLA measured ms | predicted / FLA (model .. bound) |", "|---|---|---|---|---|---|---|"]
    for shape in LINEAR_FWD_MEASURED:
        b, h, s, d = shape
        meas = CP_MEASURED_H200.get(shape)
        for i, name in enumerate(("fwd", "fwd+bwd")):
            bwd = i == 1
            t_seg = total(linear_fwd_cp(b, h, s, d, d, overhead=ovh))
            t_cs = total(linear_fwd_cs(b, h, s, d, d))
            t_cs_bound = total(linear_fwd_cs(b, h, s, d, d, overhead=ovh))
            if bwd:
                t_seg += total(linear_bwd_cp(b, h, s, d, d))
                t_cs += total(linear_bwd_cs(b, h, s, d, d))
                t_cs_bound += total(linear_bwd_cs(b, h, s, d, d, overhead=ovh))
            t_fla = (FLA_FWD_BWD_MEASURED if bwd else FLA_FWD_MEASURED)[shape]
            seg_meas = "%.2f" % (meas[i] * 1e3) if meas else "not run"
            lines.append(f"| {shape} | {name} | {t_seg * 1e3:.2f} / {seg_meas} | {t_cs * 1e3:.3f} | "
                         f"{t_cs_bound * 1e3:.3f} | {t_fla * 1e3:.2f} | {t_fla / t_cs:.2f}x .. {t_fla / t_cs_bound:.2f}x |")
    lines.append("")
    lines.append("(The segment backward's row is the model without the fitted cost: its own unexplained time, 24.7 "
                 "of its 28.7 ms, has no fit of its own.)")
    return lines


def report_step() -> List[str]:
    lines = ["", "## The recurrent step (linear_step), T = 1, bf16 inputs, fp32 state: predicted (no GPU run yet)", "",
             "| (B, H, M = Dv) | CTAs | CTAs / SM | state read + write MB | predicted us | predicted % of copy |",
             "|---|---|---|---|---|---|"]
    for b, h, m in STEP_CASES:
        launch = linear_step_launch(b, h, m, m)
        p = predict(launch)
        state = 2 * b * h * (m * m + m) * 4
        lines.append(f"| {(b, h, m)} | {p['ctas']} | {p['cps']} | {state / 1e6:.0f} | {p['time'] * 1e6:.1f} | "
                     f"{state / p['time'] / COPY_BW:.0%} |")
    lines.append("")
    lines.append("Target (issue 37): >= 70% of the copy bandwidth on the state's read and write. The small case is "
                 "launch- and latency-bound in the model (4 us launch, one wave of short CTAs).")
    return lines


def report_lpt(fits) -> List[str]:
    """Causal rows on the wgmma forward: the launch order it has (each head's query blocks longest
    first) against a global longest-first (LPT) order over every head and batch entry, and the
    bound with no tail at all (the work spread evenly over the slots)."""
    lines = ["", "## Short causal rows on the wgmma forward: LPT order, predicted", "",
             "B * S = 32k, H = 16, bf16, causal. A persistent or LPT schedule only shortens the tail; "
             "the per-CTA overhead t0 (calibration table) stays.", "",
             "| D | S | launch order ms | global LPT ms | LPT gain | no tail ms | t0 share of the CTA time |",
             "|---|---|---|---|---|---|---|"]
    res = RESOURCES["wgmma fwd"]
    slots = SMS * ctas_per_sm(res)
    for d in (64, 128):
        f = fits[("wgmma fwd", d)]
        for s in (1024, 2048, 4096):
            units = softmax_ctas("wgmma fwd", 32768 // s, 16, s, d, True)
            times = [f.t0 + u * f.unit_s for u in units]
            t_now, t_lpt = list_schedule(times, slots), list_schedule(sorted(times, reverse=True), slots)
            even = sum(times) / slots
            lines.append(f"| {d} | {s} | {t_now * 1e3:.3f} | {t_lpt * 1e3:.3f} | {t_now / t_lpt - 1:+.1%} | "
                         f"{even * 1e3:.3f} | {f.t0 * len(times) / sum(times):.0%} |")
    lines += ["", "So an LPT order buys at most about 2% on these rows, and nothing at S = 1k; the gap to "
              "FlashAttention-2 there (0.69x at D = 64) is the fixed cost per CTA (prologue, pipeline fill, "
              "epilogue), which only a persistent kernel that overlaps one tile's epilogue with the next "
              "tile's loads would hide. Not built."]
    return lines


# The delta rule's recurrent forward (csrc/linear/cuda/delta_kernel.cuh): CTAs of 4 warps, a
# column held by KS lanes with kRows = 16 rows each. Per token and warp, from the source (not
# counted): the gate (kRows multiplies), p = h'^T k and o = h^T q (2 kRows FMAs, 2 x 3 adds and
# 2 log2(KS) shuffles and adds), the update (kRows FMAs), kRows / 2 float4 reads of k and q, about
# 15 more (u, beta, v, o's store, the loop): ~105 at K = 128. The token's dependent chain (gate,
# p's FMAs and shuffles, u, the update's FMAs and o's shuffles) is about DELTA_CHAIN_CLK clocks,
# which the other warps of the SM overlap; the SM's time per token is the longer of that chain
# and its warps' issue time. A staged block of 32 tokens adds one global round trip.
DELTA_CHAIN_CLK = 220
DELTA_CASES = [(4, 16, 8192, 128, 128), (8, 16, 2048, 128, 128), (1, 32, 16384, 128, 128), (16, 8, 1024, 64, 64)]
DELTA_STEP_CASES = [(8, 32, 128, 128), (64, 32, 128, 128), (256, 32, 128, 128)]


def delta_lanes(k: int) -> int:
    return min(32, max(1, 1 << max(0, math.ceil(math.log2(max(k, 1) / 16)))))


def delta_fwd_launch(b, hv, s, k, v) -> Launch:
    ks = delta_lanes(k)
    bv = 4 * (32 // ks)
    instr = 3 * 16 + 8 + 2 * 2 * math.log2(ks) + 6 + 15 + 20
    res = Resources(128, 128, 48 * 1024)  # ptxas: 96-128 registers, no spills (sm_80, sm_90a)
    cps = ctas_per_sm(res)
    # each CTA is one of cps sharing an SM: its token time is the SM's when the SM is full
    t_tok = max(DELTA_CHAIN_CLK, cps * 4 * instr / ISSUE_PER_CLK) / SM_CLOCK
    blocks = math.ceil(s / 32)
    ctas = math.ceil(v / bv) * hv * b
    full = min(1.0, ctas / (SMS * cps))
    t_cta = s * (t_tok if full >= 1.0 else max(DELTA_CHAIN_CLK / SM_CLOCK, t_tok * full)) + blocks * LATENCY
    io = b * s * (2 * hv * k * 2 + hv * v * 2 * 2)  # q, k (per value head's reads, cached) and v, o in bf16
    return Launch("delta fwd", res, [t_cta] * ctas, io, notes=f"KS {ks}, {bv} columns per CTA")


# The chunk-parallel forward (delta_chunk_kernel.cuh), bf16, three launches. Resources from ptxas
# (sm_90a): prep 128 registers / 75.5 KB at K = 128, state 252 / 104 KB, out 109 / 41 KB. The prep
# kernel's T = (I + A)^-1 is a SIMT forward substitution whose longest column walks 63 rows, row i
# costing ~i / 2 dependent smem FMAs (about 4 clocks each) plus a shuffle and its dependency
# (~30 clocks): ~6000 clocks per CTA, overlapped with the other CTAs on the SM only through the
# slots (a pessimistic bound: its issue slots are few).
DELTA_T_SOLVE_CLK = sum(i / 2 * 4 + 30 for i in range(1, 64))


def delta_chunk_launches(b, hv, s, k, v, *, overhead=0.0) -> List[Launch]:
    kk = bucket(k)
    tiles = math.ceil(v / KN)
    vp = tiles * KN
    chunks = max(1, math.ceil(s / CHUNK))
    slots = b * chunks
    f_prep = 2 * CHUNK * CHUNK * kk * 2 + 2 * CHUNK * CHUNK * vp  # A, W; U
    prep_io = slots * hv * (CHUNK * kk * 2 + CHUNK * vp * 2 + 2 * CHUNK * kk * 2 + CHUNK * vp * 2 + 1024)
    prep = Launch(f"delta chunk prep, K {kk}", Resources(128, 128, 75 * 1024 + 512),
                  [2 * LATENCY + DELTA_T_SOLVE_CLK / SM_CLOCK + f_prep / MMA_SYNC_CTA_RATE + overhead] * (slots * hv),
                  prep_io, f_prep * slots * hv)
    f_step = 2 * CHUNK * kk * KN * 2  # W h, K~^T u
    n = tiles * hv * b
    per_chunk = max(f_step / MMA_SYNC_CTA_RATE, LATENCY / 2) + overhead
    state_io = slots * hv * (2 * CHUNK * kk * 2 + 2 * CHUNK * vp * 2 + kk * vp * 2) * 1.0
    state = Launch(f"delta chunk state, K {kk}", Resources(128, 252, 104 * 1024),
                   [LATENCY + chunks * per_chunk] * n, state_io, f_step * chunks * n)
    f_out = 2 * CHUNK * kk * KN * 2 + 2 * CHUNK * CHUNK * KN  # Q h, Q K^T; P u
    out_io = slots * hv * tiles * (2 * CHUNK * kk * 2 + kk * KN * 2 + CHUNK * KN * 2 * 2)
    out = Launch(f"delta chunk out, K {kk}", Resources(128, 110, 41 * 1024),
                 [2 * LATENCY + f_out / MMA_SYNC_CTA_RATE + overhead] * (slots * hv * tiles), out_io,
                 f_out * slots * hv * tiles)
    return [prep, state, out]


# Per-key gates (KDA, delta_chunk_prep_key_kernel): the scores' four 16 x 16 diagonal blocks on the
# CUDA cores, per warp 64 channel pairs x 16 rows of ~8 issued instructions (a shared load of the
# gate, two of q and k, a product step, two FMAs), its 4 warps on the SM's 4 schedulers; and the
# per-channel passes (R tiles, K~, Q ⊙ L, K ⊙ L: 288 steps per thread, each a shared load and a
# dependent multiply, ~40 clocks). Estimates from the code, not counted instructions.
DELTA_KEY_DIAG_CLK = 64 * 16 * 8
DELTA_KEY_PASS_CLK = 288 * 40


def delta_chunk_key_launches(b, hv, s, k, v, *, overhead=0.0) -> List[Launch]:
    """The chunk-parallel forward with per-key gates: the per-key prep (A's and S's off-diagonal
    blocks, W, U on the tensor cores, the SIMT passes above), the walk with a per-channel decay,
    the out kernel over the stored scores. Resources from ptxas (sm_90a, K = 128) and the
    kernels' shared-memory layouts (the prep's 113 KB leaves 2 CTAs per H100 SM)."""
    kk = bucket(k)
    tiles = math.ceil(v / KN)
    vp = tiles * KN
    chunks = max(1, math.ceil(s / CHUNK))
    slots = b * chunks
    ch = CHUNK
    f_prep = 2 * 2 * 16 * (16 + 32 + 48) * kk + 2 * ch * ch * kk + 2 * ch * ch * vp  # S, A blocks; W; U
    prep_io = slots * hv * (2 * ch * kk * 2 + ch * kk * 4 + ch * vp * 2 + 2 * ch * kk * 2 + ch * vp * 2 + ch * kk * 2
                            + ch * ch * 4 + 1024)
    simt = (DELTA_T_SOLVE_CLK + DELTA_KEY_DIAG_CLK + DELTA_KEY_PASS_CLK) / SM_CLOCK
    prep = Launch(f"delta chunk prep (per-key), K {kk}", Resources(128, 130, 113 * 1024),
                  [2 * LATENCY + simt + f_prep / MMA_SYNC_CTA_RATE + overhead] * (slots * hv), prep_io, f_prep * slots * hv)
    _, state, _ = delta_chunk_launches(b, hv, s, k, v, overhead=overhead)
    state.name = f"delta chunk state (per-key), K {kk}"
    f_out = 2 * ch * kk * KN + 2 * ch * ch * KN  # q~ h; S u
    out_io = slots * hv * tiles * (ch * kk * 2 + kk * KN * 2 + ch * KN * 2 * 2 + ch * ch * 4)
    out = Launch(f"delta chunk out (per-key), K {kk}", Resources(128, 138, 40 * 1024),
                 [2 * LATENCY + f_out / MMA_SYNC_CTA_RATE + overhead] * (slots * hv * tiles), out_io,
                 f_out * slots * hv * tiles)
    return [prep, state, out]


# KDA's backward: delta_chunk_dkey_kernel splits the chunk's pairs on its four 16-row blocks: the
# pairs across blocks on the tensor cores (delta_dkey_flop: M1 and Dm against the scaled K^ rows
# for the rows' sums, M1^T and Dm^T against the scaled Q^ / K^ rows for the columns'), each
# block's own pairs per key channel on the CUDA cores: 2 x 4 x 16 x 17 / 2 steps per thread of
# ~10 issued instructions (a gate load and a product step, two shared loads of M1 / Dm
# (broadcast), one of q or k, two FMAs), plus the operands' rows scaled per channel (~6 each;
# 16 + 32 + 48 for the rows' rounds, twice that for the columns'), its 4 warps on the SM's 4
# schedulers (157 KB of shared memory: one CTA per SM). The 9 rounds (an operand, a barrier, the
# product, a barrier) are counted at 2 x 100 clocks each. An estimate from the code.
DELTA_DKEY_CLK = 2 * 4 * 16 * 17 // 2 * 10 + 3 * (16 + 32 + 48) * 6 + 9 * 2 * 100


def delta_dkey_flop(kk: int) -> int:
    """The dkey kernel's tensor-core work per chunk: four products (M1, Dm; rows and columns) of
    16 x 16 I x kk per row block I = 1..3 (and per column block, the same sizes)."""
    return 4 * 2 * 16 * (16 + 32 + 48) * kk


def delta_chunk_key_bwd_launches(b, hv, s, k, v, *, overhead=0.0) -> List[Launch]:
    """KDA's chunk-parallel backward (delta_chunk_key_bwd_kernel.cuh): the per-key prep (T, A / b
    kept) and walk again, dlocal over the stored scores, the reverse walk, dscal, dzyx and the
    per-channel dkey kernel. Resources from ptxas (sm_90a, K = 128) and the shared layouts."""
    kk = bucket(k)
    tiles = math.ceil(v / KN)
    chunks = max(1, math.ceil(s / CHUNK))
    slots = b * chunks
    prep, state, _ = delta_chunk_key_launches(b, hv, s, k, v, overhead=overhead)
    _, _, _, rev, _, _ = delta_chunk_bwd_launches(b, hv, s, k, v, overhead=overhead)
    per = lambda f: 2 * LATENCY + f / MMA_SYNC_CTA_RATE + overhead  # noqa: E731
    ch, t16 = CHUNK, 2
    f_dl = 2 * ch * ch * KN
    dl = Launch(f"delta chunk dlocal (per-key), K {kk}", Resources(128, 64, 8 * 1024), [per(f_dl)] * (slots * hv * tiles),
                slots * hv * tiles * (ch * ch * 4 + 2 * ch * KN * t16), f_dl * slots * hv * tiles)
    f_sc = tiles * (2 * ch * kk * KN + 3 * 2 * ch * ch * KN)
    sc = Launch(f"delta chunk dscal (per-key), K {kk}", Resources(128, 112, 122 * 1024),
                [per(f_sc) + 64 * 40 / SM_CLOCK] * (slots * hv),
                slots * hv * (ch * kk * t16 + ch * kk * 4 + ch * ch * t16 + tiles * (2 * kk * KN + 5 * ch * KN) * t16
                              + ch * ch * 4 + 2 * ch * ch * t16), f_sc * slots * hv)
    f_zyx = tiles * (3 * 2 * ch * KN * kk + 2 * ch * ch * KN)
    zyx = Launch(f"delta chunk dzyx, K {kk}", Resources(128, 180, 64 * 1024), [per(f_zyx)] * (slots * hv),
                 slots * hv * (ch * ch * t16 + 2 * tiles * (2 * kk * KN + 3 * ch * KN) * t16 + 3 * ch * kk * t16),
                 f_zyx * slots * hv)
    f_key = delta_dkey_flop(kk)
    key = Launch(f"delta chunk dkey, K {kk}", Resources(128, 94, 157 * 1024),
                 [2 * LATENCY + DELTA_DKEY_CLK / SM_CLOCK + f_key / MMA_SYNC_CTA_RATE + overhead] * (slots * hv),
                 slots * hv * (2 * ch * kk * t16 + 2 * ch * ch * t16 + ch * kk * 4 + 3 * ch * kk * t16 + 4 * ch * kk * 4))
    return [prep, state, dl, rev, sc, zyx, key]


def delta_chunk_bwd_launches(b, hv, s, k, v, *, overhead=0.0) -> List[Launch]:
    """The chunk-parallel backward (delta_chunk_bwd_kernel.cuh): the forward's prep (T kept) and
    state walk again, then dlocal, the reverse walk, the row scalars and dq / dk. Resources from
    ptxas (sm_90a, K = 128); DRAM bytes counted per tile read."""
    kk = bucket(k)
    tiles = math.ceil(v / KN)
    vp = tiles * KN
    chunks = max(1, math.ceil(s / CHUNK))
    slots = b * chunks
    prep, state, _ = delta_chunk_launches(b, hv, s, k, v, overhead=overhead)
    per = lambda f: 2 * LATENCY + f / MMA_SYNC_CTA_RATE + overhead  # noqa: E731
    ch, t16 = CHUNK, 2  # rows per chunk, bytes per element
    f_dl = 2 * ch * ch * kk + 2 * ch * ch * KN
    dl = Launch(f"delta chunk dlocal, K {kk}", Resources(128, 72, 41 * 1024), [per(f_dl)] * (slots * hv * tiles),
                slots * hv * tiles * (2 * ch * kk * t16 + 2 * ch * KN * t16), f_dl * slots * hv * tiles)
    f_rev = 3 * 2 * ch * kk * KN
    n = tiles * hv * b
    rev = Launch(f"delta chunk rev, K {kk}", Resources(128, 255, 160 * 1024),
                 [LATENCY + chunks * (max(f_rev / MMA_SYNC_CTA_RATE, LATENCY / 2) + overhead)] * n,
                 slots * hv * tiles * (3 * ch * kk * t16 + 4 * ch * KN * t16 + kk * KN * t16), f_rev * chunks * n)
    f_sc = tiles * (2 * ch ** 2 * KN + 3 * 2 * ch * kk * KN + 2 * 2 * ch * ch * KN) + 2 * 2 * ch * ch * kk
    sc = Launch(f"delta chunk dscal, K {kk}", Resources(128, 194, 157 * 1024), [per(f_sc)] * (slots * hv),
                slots * hv * (2 * ch * kk * t16 + tiles * (2 * kk * KN + 5 * ch * KN) * t16 + 4 * ch * ch * t16),
                f_sc * slots * hv)
    f_qk = tiles * (3 * 2 * ch * KN * kk + 2 * ch ** 2 * KN) + 3 * 2 * ch * ch * kk
    qk = Launch(f"delta chunk dqk, K {kk}", Resources(128, 254, 121 * 1024), [per(f_qk)] * (slots * hv),
                slots * hv * (2 * ch * kk * t16 + 4 * ch * ch * t16 + tiles * (2 * kk * KN + 3 * ch * KN) * t16
                              + 2 * ch * kk * 4), f_qk * slots * hv)
    return [prep, state, dl, rev, sc, qk]


def _ms_parts(model: List[Launch]) -> str:
    return " / ".join(f"{predict(x)['time'] * 1e3:.2f}" for x in model)


def _delta_fwd_rows(launches, ovh: float) -> List[str]:
    """report_delta_chunk's forward rows for a launches(b, hv, s, k, v, overhead=) model."""
    rows = []
    for b, hv, s, k, v in DELTA_CASES:
        rec = predict(delta_fwd_launch(b, hv, s, k, v))["time"]
        model = launches(b, hv, s, k, v)
        bound = total(launches(b, hv, s, k, v, overhead=ovh))
        t = total(model)
        rows.append(f"| {(b, hv, s, k, v)} | {rec * 1e3:.2f} | {t * 1e3:.2f} - {bound * 1e3:.2f} | "
                    f"{_ms_parts(model)} | "
                    f"{rec / t:.1f} - {rec / bound:.1f} |")
    return rows


def _delta_bwd_rows(fwd_launches, bwd_launches, ovh: float) -> List[str]:
    """report_delta_chunk's backward rows (the forward's model added for forward + backward)."""
    rows = []
    for b, hv, s, k, v in DELTA_CASES:
        model = bwd_launches(b, hv, s, k, v)
        bound = total(bwd_launches(b, hv, s, k, v, overhead=ovh))
        t = total(model)
        fwd = total(fwd_launches(b, hv, s, k, v))
        rows.append(f"| {(b, hv, s, k, v)} | {t * 1e3:.2f} - {bound * 1e3:.2f} | "
                    f"{_ms_parts(model)} | {(fwd + t) * 1e3:.2f} |")
    return rows


def report_delta_chunk() -> List[str]:
    ovh = fit_chunk_overhead()
    fwd_head = ["| (B, H_v, S, K, V) | recurrent ms | chunked ms (model - bound) | prep / state / out ms (model) | "
                "chunked x recurrent (model - bound) |", "|---|---|---|---|---|"]
    lines = ["", "## The delta rule's chunk-parallel CUDA forward (bf16, delta_chunked): predicted, no GPU run yet", "",
             "Three launches (prep: A, T, W, U, K~ per chunk; state: the walk over chunks; out). 'model' is the "
             "products at the fitted mma.sync CTA rate, the copies' round trips and DRAM; 'bound' adds the "
             f"segment kernels' unexplained {ovh * 1e6:.2f} us per chunk step and per CTA (fit_chunk_overhead) "
             "to every launch.", ""] + fwd_head + _delta_fwd_rows(delta_chunk_launches, ovh)
    lines += ["", "The chunk-parallel backward (training; the forward above plus these launches), same "
              "columns' conventions:", "",
              "| (B, H_v, S, K, V) | backward ms (model - bound) | prep / state / dlocal / rev / dscal / dqk ms "
              "(model) | forward + backward ms (model) |", "|---|---|---|---|"]
    lines += _delta_bwd_rows(delta_chunk_launches, delta_chunk_bwd_launches, ovh)
    lines += ["", "Kimi Delta Attention (per-key gates), forward: the per-key prep adds the scores' diagonal "
              "blocks and per-channel gate products on the CUDA cores (estimated, DELTA_KEY_DIAG_CLK and "
              "DELTA_KEY_PASS_CLK) and stores the output scores; the recurrent column is the per-head model "
              "(the per-key gate read per token is not in it):", ""] + fwd_head
    lines += _delta_fwd_rows(delta_chunk_key_launches, ovh)
    lines += ["", "KDA's backward (per-key gates; the dkey kernel's blocks' own pairs on the CUDA cores, "
              "DELTA_DKEY_CLK, an estimate from the code):", "",
              "| (B, H_v, S, K, V) | backward ms (model - bound) | prep / state / dlocal / rev / dscal / dzyx / "
              "dkey ms (model) | forward + backward ms (model) |", "|---|---|---|---|"]
    lines += _delta_bwd_rows(delta_chunk_key_launches, delta_chunk_key_bwd_launches, ovh)
    lines += ["", "FLA's chunk_gated_delta_rule and chunk_kda have not been timed on a GPU here yet "
              "(bench_delta_cuda.py times them beside ours), so there is no ratio to the issue's target yet."]
    return lines


def report_delta() -> List[str]:
    lines = ["", "## The delta rule's CUDA forward (recurrent; delta_rule_attention without autograd): predicted, "
             "no GPU run yet", "",
             "Gated DeltaNet, bf16 inputs, float32 state. Per token, the SM's time is the longer of the dependent "
             f"chain (~{DELTA_CHAIN_CLK} clocks) and its warps' issue time (estimated instructions, not counted).", "",
             "| (B, H_v, S, K, V) | CTAs | CTAs / SM | predicted ms | TFLOP/s (3 K V FMAs per token) |",
             "|---|---|---|---|---|"]
    for b, hv, s, k, v in DELTA_CASES:
        launch = delta_fwd_launch(b, hv, s, k, v)
        p = predict(launch)
        fl = 2 * 3 * b * hv * s * k * v
        lines.append(f"| {(b, hv, s, k, v)} | {p['ctas']} | {p['cps']} | {p['time'] * 1e3:.2f} | "
                     f"{fl / p['time'] / 1e12:.1f} |")
    lines += ["", "The in-place step (delta_rule_step, T = 1): the state's read and write at the copy bandwidth "
              "(each warp reads 16-byte pieces of 8 rows: half of each 32-byte sector, the other half read by "
              "the neighbouring warp at the same time), plus one token's chain and the launch.", "",
              "| (B, H_v, K, V) | CTAs | state read + write MB | predicted us | predicted % of copy |", "|---|---|---|---|---|"]
    for b, hv, k, v in DELTA_STEP_CASES:
        ctas = math.ceil(v / (4 * (32 // delta_lanes(k)))) * hv * b
        state = 2 * b * hv * k * v * 4
        launch = Launch("delta step", Resources(128, 128, 48 * 1024),
                        [2 * LATENCY + DELTA_CHAIN_CLK / SM_CLOCK] * ctas, state)
        t = predict(launch)["time"]
        lines.append(f"| {(b, hv, k, v)} | {ctas} | {state / 1e6:.0f} | {t * 1e6:.1f} | {state / t / COPY_BW:.0%} |")
    lines += ["", "No peer has been measured on a GPU for these rows yet (benchmarks/linear/bench_delta_cuda.py "
              "times FLA's fused recurrent and chunked Gated DeltaNet kernels beside ours)."]
    return lines


# The option rows on the sm_90a wgmma forward (hopper_fwd=2), B = 8, H = 16, S = 4096, D = 128,
# causal: the per-element policy work a general score adds to the plain kernel, in warp
# instructions per (query, key) element of every computed tile, estimated from the source (not
# counted): the plain softmax (scale, max, exp2, sum, pack) ~8; ALiBi +16 (the window and layout
# tests, the score's branches, |i + diag - j| and its FMA); softcap +40 (tanhf); a bool mask +8 (a
# byte load and its address); dropout +20 (a Philox4x32-10 draw of ~70 instructions per 4 keys,
# the compare and select). An additive (1, H, S, S) float32 bias is read from DRAM once per batch
# entry: its bytes bound the row. Bounds: "overlapped" = the dense kernel's time or the issue time
# of all the softmax work, whichever is longer (the other warpgroup's wgmma hides it);
# "serial" = the dense time plus the extra issue time.
OPTION_SHAPE = (8, 16, 4096, 128)
PLAIN_INSTR_PER_ELEM = 8
OPTION_EXTRA_INSTR = {"ALiBi": 16, "softcap 30": 40, "bool mask (B, 1, S, S)": 8, "dropout 0.1": 20,
                      "additive bias (1, H, S, S)": 4}
# their 2026-11-24 H100 rows (benchmarks/results/2026-11-24-h100.md, causal unless named): the
# mma.sync general kernel's forward TFLOP/s, and the peer's (flash on the unmasked causal problem;
# SDPA's efficient backend with the bias; flash with dropout, non-causal)
OPTION_MEASURED = {"ALiBi": (35, 334), "softcap 30": (34, 334), "additive bias (1, H, S, S)": (24, 131),
                   "dropout 0.1": (98, 286)}


def report_options(fits) -> List[str]:
    b, h, s, d = OPTION_SHAPE
    lines = ["", "## Option rows on the wgmma forward (hopper_fwd=2): predicted bounds, no GPU run yet", "",
             f"B = {b}, H = {h}, S = {s}, D = {d}, bf16; instruction estimates per element (see the source); "
             "peer and mma.sync rates measured 2026-11-24.", "",
             "| row | extra instr / element | wgmma fwd TFLOP/s (serial - overlapped) | x peer (serial - overlapped) | "
             "mma.sync measured TFLOP/s | peer TFLOP/s |", "|---|---|---|---|---|---|"]
    issue_rate = SMS * ISSUE_PER_CLK * SM_CLOCK  # warp instructions per second
    for name, extra in OPTION_EXTRA_INSTR.items():
        causal = not name.startswith("dropout") and not name.startswith("additive")
        dense = predict(softmax_launch("wgmma fwd", fits[("wgmma fwd", d)], b, h, s, d, causal))["time"]
        flops = softmax_flops(b, h, s, d, causal)
        elems = b * h * s * s * (0.5 if causal else 1.0)
        plain_issue = elems * PLAIN_INSTR_PER_ELEM / 32 / issue_rate
        extra_issue = elems * extra / 32 / issue_rate
        serial = dense + extra_issue
        overlapped = max(dense, plain_issue + extra_issue)
        if name.startswith("additive"):
            bias_bytes = b * h * s * s * 4  # fp32, once per batch entry (the mask is broadcast over B)
            serial, overlapped = max(serial, bias_bytes / COPY_BW), max(overlapped, bias_bytes / COPY_BW)
        meas, peer = OPTION_MEASURED.get(name, (float("nan"), float("nan")))
        tf = lambda t: flops / t / 1e12  # noqa: E731
        lines.append(f"| {name}{', causal' if causal else ''} | {extra} | {tf(serial):.0f} - {tf(overlapped):.0f} | "
                     f"{'-' if peer != peer else f'{tf(serial) / peer:.2f} - {tf(overlapped) / peer:.2f}'} | "
                     f"{'-' if meas != meas else meas} | {'-' if peer != peer else peer} |")
    lines += ["", "The bool-mask row has no 2026-11-24 measurement (the table had none); its peer would be "
              "SDPA's efficient backend with the mask. The backward's option rows are not modelled."]
    return lines


NOT_MODELLED = ["", "## Not modelled yet", "",
                "- the decode kernels' instruction counts (estimates above, not counts: the emulator counts tensor-core "
                "instructions only, checked for the tensor-core decode kernel);",
                "- the option rows' backward, and the option rows on the mma.sync kernels (their spills);",
                "- the linear backward's atomics into its fp32 scratch (every value tile and GQA head adds into dQ~ "
                "/ dK~ / dV): counted as no time."]


# ---------------------------------------------------------------------------------- emulator counts
def check_counts() -> List[str]:
    """Runs the linear kernels in the CPU emulator and compares its mma.sync count with
    linear_chunk_mma_flops; returns the lines of the comparison (raises on a mismatch)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    from tests.cuda_emu.test_linear_emulated import count_mma_flops
    out = ["", "## Counts: formula vs the emulator's mma.sync m16n8k16 x 4096 flops; barriers per CTA (emulator)", "",
           "| case | launch | formula flops | emulator flops | barriers / CTA |", "|---|---|---|---|---|"]
    for case in [dict(s=200, m=64, dv=64, causal=True, seg=0), dict(s=200, m=64, dv=64, causal=True, seg=2),
                 dict(s=130, m=128, dv=128, causal=True, seg=1), dict(s=130, m=100, dv=72, causal=False, seg=2),
                 dict(s=200, m=64, dv=64, causal=True, seg=1, states=True)]:
        for bwd in (False, True):
            got = count_mma_flops(**case, bwd=bwd)
            want = expected_bwd_mma_flops(**case) if bwd else expected_mma_flops(**case)
            names = (["bwd", "finalize dq", "finalize dk", "finalize dv"] if case["seg"] == 0 else
                     ["states", "reverse states", "dQ", "dK dV", "finalize dq", "finalize dk", "finalize dv"]
                     if case.get("states") else
                     ["fwd state", "scan", "bwd U", "reverse scan", "bwd dQ", "bwd dK dV", "finalize dq", "finalize dk",
                      "finalize dv"]) if bwd else (["seq"] if case["seg"] == 0 else ["states", "out"] if case.get("states")
                                                   else ["state", "scan", "out"])
            table = count_mma_flops(**case, bwd=bwd, stats=True)
            for name, g, w, row in zip(names, got, want, table.tolist()):
                out.append(f"| {case} | {name} | {w:.0f} | {g:.0f} | {row[3] / row[0]:.1f} |")
            if got != want:
                raise AssertionError(f"{case} bwd={bwd}: formula {want}, emulator {got}")
    return out


def expected_mma_flops(s, m, dv, causal, seg, b=1, h=2, states=False) -> List[float]:
    """The mma flops of each launch of the emulator's call in count_mma_flops (seg 0: the
    sequential kernel, else the chunk-parallel one with `seg` chunks per segment; states: the
    chunk-state forward, unnormalized: no z tile)."""
    tiles = math.ceil(dv / KN)
    chunks = math.ceil(s / CHUNK)
    n = tiles * b * h
    if states:
        return [n * chunks * linear_chunk_mma_flops(m, out=False, causal=causal, update=True),
                n * chunks * linear_chunk_mma_flops(m, out=True, causal=causal, update=False)]
    if seg == 0:
        if causal:
            return [n * chunks * linear_chunk_mma_flops(m, out=True, causal=True, update=True)]
        return [n * chunks * (linear_chunk_mma_flops(m, out=False, causal=False, update=True)
                              + linear_chunk_mma_flops(m, out=True, causal=False, update=False))]
    n_seg = math.ceil(chunks / seg)
    state = n * chunks * linear_chunk_mma_flops(m, out=False, causal=causal, update=True)
    out = n * chunks * linear_chunk_mma_flops(m, out=True, causal=causal, update=False)
    if causal:
        out += n * (chunks - n_seg) * linear_chunk_mma_flops(m, out=False, causal=True, update=True)
    return [state, 0.0, out]


def expected_bwd_mma_flops(s, m, dv, causal, seg, b=1, h=2, states=False) -> List[float]:
    """The mma flops of each launch of the backward in count_mma_flops(..., bwd=True): seg 0 the
    sequential kernel then the three conversions; else the chunk-parallel launches; states: the
    chunk-state backward (unnormalized: no prep launch, no z tile): the state walk, the reverse
    walk, dQ~, dK~ and dV, the conversions."""
    tiles = math.ceil(dv / KN)
    chunks = math.ceil(s / CHUNK)
    n = tiles * b * h
    f = linear_bwd_chunk_mma_flops(m, causal=causal)
    if states:
        return [n * chunks * f["update"], n * chunks * f["update"], n * chunks * f["dq"], n * chunks * f["dkv"],
                0.0, 0.0, 0.0]
    if seg == 0:
        return [n * chunks * (f["dq"] + f["dkv"] + 2 * f["update"]), 0.0, 0.0, 0.0]
    n_seg = math.ceil(chunks / seg)
    inner = f["update"] * (chunks - n_seg) if causal else 0.0
    return [n * chunks * f["update"], 0.0, n * chunks * f["update"], 0.0, n * (chunks * f["dq"] + inner),
            n * (chunks * f["dkv"] + inner), 0.0, 0.0, 0.0]


def report_q8(fits) -> List[str]:
    """The int8 Q.K^T forward (qk_quant; fwd_kernel.cuh FwdQ8 after q8.cuh's quantize pass),
    bounded from the measured mma.sync forward it derives from: its S = Q K^T runs on
    mma.m16n8k32.s8, twice the multiply-adds per instruction of m16n8k16 at the same issue rate,
    while P V, the softmax and the loads are unchanged. If the tile time were all tensor-core
    issue, Q K^T's half of it would halve (0.75 x the tile); if the products were hidden under the
    rest, nothing would change (1.0 x). The quantize pass (four launches) is DRAM-bound: q read
    and written as int8 (2 + 1 bytes per element), k read twice (mean, rounding) and written
    (2 + 2 + 1)."""
    lines = ["", "## int8 Q.K^T forward (qk_quant): predicted bounds, no GPU run yet", "",
             "B * S = 32k, H = 16, bf16 in; the mma.sync and wgmma forwards measured 2026-11-24; the int8 "
             "kernel between 0.75x and 1.0x the mma.sync tile time, plus its quantize pass.", "",
             "| D | S | causal | quantize pass us | int8 fwd ms (best - worst) | mma.sync bf16 ms | "
             "x mma.sync bf16 (A100's default path) | x wgmma bf16 (H100's default; target >= 1.3x) |",
             "|---|---|---|---|---|---|---|---|"]
    for d in (64, 128):
        for s, causal in ((4096, False), (8192, False), (8192, True)):
            b, h = 32768 // s, 16
            mma = predict(softmax_launch("mma.sync fwd", fits[("mma.sync fwd", d)], b, h, s, d, causal))["time"]
            wg = measured_softmax("wgmma fwd", d, s, causal)
            elems = b * h * s * d
            quant = LAUNCH_S * 4 + elems * (3 + 5) / COPY_BW
            best, worst = 0.75 * mma + quant, mma + quant
            lines.append(f"| {d} | {s} | {causal} | {quant * 1e6:.0f} | {best * 1e3:.2f} - {worst * 1e3:.2f} | "
                         f"{mma * 1e3:.2f} | {mma / worst:.2f} - {mma / best:.2f}x | {wg / worst:.2f} - {wg / best:.2f}x |")
    lines += ["", "So the 1.3x target is out of reach on sm_90 for a mma.sync kernel (the default bf16 forward there "
              "is the wgmma one, 1.4-1.9x the mma.sync rate): it needs an s8 / e4m3 wgmma form. On sm_80, where the "
              "bf16 default is the mma.sync kernel, the bound is 0.95-1.3x."]
    lines += ["", "The s8 wgmma form (sm90/fwd_kernel.cuh's kQ8 instance, `set_cuda_kernels(hopper_fwd=2)`; "
              "m64nNk32.s32.s8.s8, twice the multiply-adds per instruction of the bf16 k16 form), bounded the same "
              "way from the measured wgmma bf16 forward: between 0.75x and 1.0x its tile time (one more FMA per "
              "score, in the softmax's shadow), plus the quantize pass.", "",
              "| D | S | causal | int8 wgmma fwd ms (best - worst) | wgmma bf16 ms | x wgmma bf16 (target >= 1.3x) |",
              "|---|---|---|---|---|---|"]
    for d in (64, 128):
        for s, causal in ((4096, False), (8192, False), (8192, True)):
            b, h = 32768 // s, 16
            wg = measured_softmax("wgmma fwd", d, s, causal)
            quant = LAUNCH_S * 4 + b * h * s * d * (3 + 5) / COPY_BW
            best, worst = 0.75 * wg + quant, wg + quant
            lines.append(f"| {d} | {s} | {causal} | {best * 1e3:.2f} - {worst * 1e3:.2f} | {wg * 1e3:.2f} | "
                         f"{wg / worst:.2f} - {wg / best:.2f}x |")
    lines += ["", "At best 1.19-1.27x, at worst 0.91-0.96x: the 1.3x target needs Q K^T's products to be most of "
              "the tile's time, where the measured forward has the softmax and P V beside them; a GPU run decides.",
              "", "The e4m3 form (`qk_quant=\"fp8\"`, m64nNk32.f32.e4m3.e4m3) issues the same instructions at the "
              "same dense rate as the s8 one on H100 / H200 (fp8 and int8 tensor-core peaks are equal) after the "
              "same quantize pass (its rounding a few more integer operations per element, in the DRAM-bound "
              "pass's shadow): the same bounds. It has no speed of its own to offer over int8 on sm_90."]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check-counts", action="store_true", help="compare the count formulas with the CPU emulator")
    ap.add_argument("--out", help="also write the report (markdown) here")
    args = ap.parse_args(argv)
    fits, lines = calibrate()
    check, worst = check_table(fits)
    lines += check + report_linear() + report_step() + report_decode() + report_options(fits) + report_q8(fits) + report_sparse_wgmma(fits) + report_lpt(fits) + report_delta() + report_delta_chunk() + NOT_MODELLED
    if args.check_counts:
        lines += check_counts()
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
