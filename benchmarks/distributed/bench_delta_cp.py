"""Context-parallel delta rule on CPU gloo ranks: efficiency T(one process, whole sequence) /
(P * T(rank)), forward + backward.

    python benchmarks/distributed/bench_delta_cp.py [--seq 4096] [--heads 8] [--dim 128] [--world 2]
        [--dtype float32] [--warmup 1] [--reps 3] [--out benchmarks/results/delta-cp.md]

Every process runs with torch.set_num_threads(1), so P ranks use P cores and perfect scaling is
efficiency 1.0. T(one process): the median fwd+bwd of attention_ext.delta_rule_attention on the
whole (1, H, S, K) Gated DeltaNet problem (gate (1, H, S)); T(rank): the slowest rank's median of
context_parallel_delta_rule_attention on its contiguous shard, a barrier before each iteration.
By design a rank runs the kernel on V + K value columns (attention_ext/distributed/delta.py), so
at K = V the expected efficiency is about 0.5: context parallelism here buys the sequence length
that fits (each rank holds S / P tokens), not time.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from benchmarks.distributed.bench_cp import spawn  # noqa: E402


def _inputs(a):
    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, a.dtype)
    q, k, v, do = (torch.randn(1, a.heads, a.seq, a.dim, generator=g).to(dt) for _ in range(4))
    k = torch.nn.functional.normalize(k.float(), dim=-1).to(dt)
    beta = torch.rand(1, a.heads, a.seq, generator=g)
    gate = -0.1 * torch.rand(1, a.heads, a.seq, generator=g)
    return q, k, v, do, beta, gate


def single(rank, world, a):
    import attention_ext as ae
    q, k, v, do, beta, gate = _inputs(a)
    ts = []
    for _ in range(a.warmup + a.reps):
        qr, kr, vr, br, gr = (t.clone().requires_grad_() for t in (q, k, v, beta, gate))
        t0 = time.perf_counter()
        ae.delta_rule_attention(qr, kr, vr, br, gate=gr).backward(do)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[a.warmup:])


def ranks(rank, world, a):
    from attention_ext import distributed as cp
    q, k, v, do, beta, gate = _inputs(a)
    n = a.seq // world
    sl = slice(rank * n, (rank + 1) * n)
    ql, kl, vl, dol = (t[:, :, sl].contiguous() for t in (q, k, v, do))
    bl, gl = beta[:, :, sl].contiguous(), gate[:, :, sl].contiguous()
    ts = []
    for _ in range(a.warmup + a.reps):
        qr, kr, vr, br, gr = (t.clone().requires_grad_() for t in (ql, kl, vl, bl, gl))
        dist.barrier()
        t0 = time.perf_counter()
        cp.context_parallel_delta_rule_attention(qr, kr, vr, br, gate=gr).backward(dol)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[a.warmup:])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None, help="also write the markdown table here")
    a = p.parse_args(argv)
    if a.seq % a.world:
        p.error("--seq must be a multiple of --world")
    import attention_ext as ae
    t1, = spawn(single, 1, a)
    tr = max(spawn(ranks, a.world, a))
    lines = [f"# context_parallel_delta_rule_attention, CPU gloo ranks, 1 thread each",
             "", f"{platform.processor() or platform.machine()}, ISA {ae.cpu_isa()}; torch {torch.__version__}; "
             f"(1, {a.heads}, {a.seq}, K = V = {a.dim}) {a.dtype}, Gated DeltaNet; P = {a.world}", "",
             "| T(one process) s | T(rank) s | efficiency T1 / (P T(rank)) |",
             "|---|---|---|",
             f"| {t1:.3f} | {tr:.3f} | {t1 / (a.world * tr):.2f} |"]
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
