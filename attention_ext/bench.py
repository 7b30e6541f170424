"""`python -m attention_ext bench`: a quick table of the fused kernel against torch SDPA on this
machine, and the timing helpers every benchmark shares (benchmarks/common.py re-exports them):
one FLOP formula, interleaved timing, the measured matmul ceiling."""
from __future__ import annotations

import argparse
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


def layout_pairs(layout, block_size: int, sq: int, sk: int, causal: bool = False) -> float:
    """Allowed (query, key) pairs of a block layout (H or 1, n_qb, n_kb), averaged over its heads:
    the useful work of block-sparse attention (the on blocks, clipped to the lengths and, with
    causal, to the lower triangle)."""
    lay = torch.as_tensor(layout).bool()
    if lay.dim() == 2:
        lay = lay[None]
    rows = torch.arange(sq)
    qb = rows // block_size
    if causal:  # keys j <= i in block c: clamp(i + 1 - c * bs, 0, block width)
        cols0 = torch.arange(lay.shape[2]) * block_size
        width = (torch.clamp(cols0 + block_size, max=sk) - cols0).clamp(min=0)
        per = torch.minimum((rows[:, None] + 1 - cols0[None, :]).clamp(min=0), width[None, :])  # (sq, n_kb)
    else:
        cols0 = torch.arange(lay.shape[2]) * block_size
        per = (torch.clamp(cols0 + block_size, max=sk) - cols0).clamp(min=0)[None, :].expand(sq, -1)
    total = (lay[:, qb, :].double() * per[None].double()).sum()
    return float(total) / lay.shape[0]


def flops(b: int, h: int, sq: int, sk: int, d: int, *, causal: bool = False, bottom_right: bool = False,
          window=(-1, -1), mode: str = "fwd", pairs: Optional[float] = None) -> float:
    """The one FLOP formula every benchmark reports: 2 matmuls (Q K^T, P V) of 2 * D FLOPs per
    allowed pair forward; the backward does 5 such matmuls (2.5x); fwd_bwd = 3.5x. pairs: the
    allowed pairs per (batch, head) when a mask decides them (layout_pairs for a block layout,
    S * k for top-k); else they follow from causal / window."""
    if pairs is None:
        pairs = allowed_pairs(sq, sk, causal, bottom_right, window)
    return flops_from_pairs(b * h * pairs, d, mode=mode)


def flops_from_pairs(pairs: float, d: int, *, mode: str = "fwd") -> float:
    """flops() for any mask (block-sparse layouts, top-k): `pairs` allowed (query, key) pairs in
    all, summed over batch and heads."""
    fwd = 4.0 * d * pairs
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd_bwd": 3.5 * fwd}[mode]


def linear_flops(b: int, h: int, s: int, m: int, dv: int, *, normalize: bool = True, mode: str = "fwd") -> float:
    """The one FLOP formula of linear attention, causal or not, whatever the algorithm (chunked,
    recurrent, two matmuls): each key adds phi(k) v'^T to an M x Dv' state and each query reads
    phi(q)^T S, 2 * M * Dv' FLOPs each (Dv' = Dv + 1 with the normalizer) forward; the backward
    does twice that (dq, and dk / dv through the state's gradient); fwd_bwd = 3x."""
    fwd = 4.0 * b * h * s * m * (dv + 1 if normalize else dv)
    return {"fwd": fwd, "bwd": 2.0 * fwd, "fwd_bwd": 3.0 * fwd}[mode]


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


def interleaved_warm(fns: dict, *, block: int = 20, rounds: int = 10) -> dict:
    """Median seconds per call of each fn called back to back (`block` calls in a row, so its
    data stays in cache from one call to the next), the blocks taken round-robin over `rounds`
    so noise on a shared machine hits every contender alike. `interleaved` measures the other
    regime: every call after the other contenders have run, its data evicted."""
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            fn()  # the first call of a block brings the data in
            for _ in range(block):
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def matmul_ceiling(dtype=torch.float32, n: int = 2048, device="cpu", reps: int = 5) -> float:
    """Measured matmul FLOP/s: the ceiling the attention FLOP/s are read against."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device != "cpu" else None
    t = bench(lambda: a @ b, warmup=2, reps=reps, sync=sync)
    return 2.0 * n ** 3 / t


def cuda_time(fn: Callable[[], object], warmup: int = 3, reps: int = 10) -> float:
    """Median seconds per call on the current CUDA stream, from one event pair per call."""
    for _ in range(warmup):
        fn()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        start[i].record()
        fn()
        end[i].record()
    torch.cuda.synchronize()
    ts = sorted(s.elapsed_time(e) for s, e in zip(start, end))
    return ts[len(ts) // 2] * 1e-3


def copy_bandwidth(nbytes: int = 1 << 28, device="cpu", reps: int = 5) -> float:
    """Measured copy bandwidth in bytes/s (bytes read + written) of one large tensor copy: the
    memory ceiling that the decode kernels' K / V read rate is read against."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    if str(device).startswith("cuda"):
        t = cuda_time(lambda: dst.copy_(src), warmup=3, reps=max(reps, 10))
    else:
        t = bench(lambda: dst.copy_(src), warmup=2, reps=reps)
    return 2.0 * nbytes / t


def decode_bytes(b: int, h_k: int, cache_len: int, d: int, dtype: torch.dtype) -> float:
    """Bytes of K and V one decode step reads: every cached key and value of every kv head once
    (q and out are negligible). cache_len: the keys each sequence attends."""
    return 2.0 * b * h_k * cache_len * d * torch.finfo(dtype).bits / 8


def main(argv=None) -> int:
    import torch.nn.functional as F

    import attention_ext as ae

    ap = argparse.ArgumentParser(prog="python -m attention_ext bench")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode", action="store_true",
                    help="decode steps over a KV cache: GB/s of K / V read against the copy bandwidth and SDPA")
    args = ap.parse_args(argv)
    dev = args.device
    cuda = dev.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else None
    if args.decode:
        return decode_main(dev, args.reps)
    dtypes = (torch.bfloat16, torch.float16) if cuda else (torch.float32, torch.bfloat16)
    shapes = [(4, 16, 2048, 64), (2, 16, 4096, 128)] if cuda else [(1, 8, 1024, 64), (1, 8, 2048, 64)]
    ceil = matmul_ceiling(dtypes[0] if cuda else torch.float32, n=4096 if cuda else 1024, device=dev)
    print(f"device {dev}; {dtypes[0]} matmul ceiling {ceil / 1e12:.2f} TFLOP/s")
    print("| (B, H, S, D) | causal | dtype | ours TFLOP/s | SDPA TFLOP/s | ours / SDPA |")
    print("|---|---|---|---|---|---|")
    for b, h, s, d in shapes:
        for causal in (False, True):
            for dtype in dtypes:
                q, k, v = (torch.randn(b, h, s, d, dtype=dtype, device=dev) for _ in range(3))
                with torch.no_grad():
                    t = interleaved({
                        "ours": lambda: ae.attention(q, k, v, causal=causal),
                        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                    }, reps=args.reps, sync=sync)
                fl = flops(b, h, s, s, d, causal=causal)
                print(f"| {(b, h, s, d)} | {causal} | {str(dtype)[6:]} | {fl / t['ours'] / 1e12:.3f} | "
                      f"{fl / t['sdpa'] / 1e12:.3f} | {t['sdpa'] / t['ours']:.2f}x |")
    return 0


def decode_main(dev: str, reps: int) -> int:
    """One decode step (q_len 1) over contiguous and paged caches, B4, Hq32, Hkv8, D128: K / V
    read rate as a share of the measured copy bandwidth, and the speedup over torch SDPA with
    enable_gqa on a contiguous (B, H_k, S, D) cache (its best layout), timed interleaved."""
    import torch.nn.functional as F

    from attention_ext.decode import decode_fwd

    cuda = dev.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else None
    copy_bw = copy_bandwidth(1 << 28, device=dev)
    b, h, hk, d = (8, 32, 8, 128) if cuda else (4, 32, 8, 128)
    lengths = (4096, 16384, 65536) if cuda else (4096, 16384)
    dtypes = (torch.bfloat16,) if cuda else (torch.float32, torch.bfloat16)
    print(f"device {dev}; copy bandwidth {copy_bw / 1e9:.1f} GB/s (read + write); B{b} Hq{h} Hkv{hk} D{d}, q_len 1")
    print("| cache | dtype | ours GB/s | share of copy | paged-16 / contiguous | SDPA GB/s | ours / SDPA |")
    print("|---|---|---|---|---|---|---|")
    for s in lengths:
        for dtype in dtypes:
            q = torch.randn(b, 1, h, d, dtype=dtype, device=dev)
            kc, vc = (torch.randn(b, s, hk, d, dtype=dtype, device=dev) for _ in range(2))
            lens = torch.full((b,), s, dtype=torch.int32, device=dev)
            page, n = 16, s // 16
            bt = torch.randperm(b * n, device=dev).view(b, n).int()
            kp, vp = (torch.empty(b * n, page, hk, d, dtype=dtype, device=dev) for _ in range(2))
            kp[bt.flatten().long()] = kc.reshape(b * n, page, hk, d)
            vp[bt.flatten().long()] = vc.reshape(b * n, page, hk, d)
            qs, ks, vs = (t.transpose(1, 2).contiguous() for t in (q, kc, vc))
            with torch.no_grad():
                t = interleaved({
                    "ours": lambda: decode_fwd(q, kc, vc, cache_seqlens=lens, scale=d ** -0.5),
                    "paged": lambda: decode_fwd(q, kp, vp, cache_seqlens=lens, block_table=bt, scale=d ** -0.5),
                    "sdpa": lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True),
                }, reps=reps, sync=sync)
            nb = decode_bytes(b, hk, s, d, dtype)
            print(f"| {s} | {str(dtype)[6:]} | {nb / t['ours'] / 1e9:.1f} | {nb / t['ours'] / copy_bw:.0%} | "
                  f"{t['ours'] / t['paged']:.2f} | {nb / t['sdpa'] / 1e9:.1f} | {t['sdpa'] / t['ours']:.2f}x |")
            del q, kc, vc, kp, vp, qs, ks, vs
    return 0
