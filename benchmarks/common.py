"""Shared benchmark helpers: one FLOP formula, one timer, ratios against a peer in the same run."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import torch


def allowed_pairs(sq: int, sk: int, causal: bool = False, bottom_right: bool = False, window=(-1, -1)) -> int:
    """Number of (query, key) pairs a query may attend: the work a block-skipping kernel must do."""
    wl, wr = window
    if causal:
        wr = 0 if wr < 0 else min(wr, 0)
    diag = sk - sq if bottom_right else 0
    total = 0
    for i in range(sq):
        lo = 0 if wl < 0 else max(0, i + diag - wl)
        hi = sk - 1 if wr < 0 else min(sk - 1, i + diag + wr)
        total += max(0, hi - lo + 1)
    return total


def flops(b: int, h: int, sq: int, sk: int, d: int, *, causal: bool = False, bottom_right: bool = False,
          window=(-1, -1), mode: str = "fwd") -> float:
    """The one FLOP formula every benchmark reports: 2 matmuls (Q K^T, P V) of 2 * D FLOPs per
    allowed pair forward; the backward does 5 such matmuls (2.5x); fwd_bwd = 3.5x."""
    fwd = 4.0 * b * h * d * allowed_pairs(sq, sk, causal, bottom_right, window)
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd_bwd": 3.5 * fwd}[mode]


def bench(fn: Callable[[], object], *, warmup: int = 1, reps: int = 5, min_time: float = 0.0,
          sync: Optional[Callable[[], None]] = None) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    t_end = time.perf_counter() + min_time
    while len(times) < reps or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved(fns: dict, *, warmup: int = 1, reps: int = 5, sync=None) -> dict:
    """Median seconds per call of each fn, timed round-robin so noise on a shared machine hits
    every contender alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if sync is not None:
                sync()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def matmul_ceiling(dtype=torch.float32, n: int = 2048, device="cpu", reps: int = 5) -> float:
    """Measured matmul FLOP/s: the ceiling the attention FLOP/s are read against."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device != "cpu" else None
    t = bench(lambda: a @ b, warmup=2, reps=reps, sync=sync)
    return 2.0 * n ** 3 / t
