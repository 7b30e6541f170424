"""Context-parallel attention efficiency on CPU gloo ranks: T(one process, whole sequence) /
(P * T(rank)), forward + backward, fp32.

    python benchmarks/distributed/bench_cp.py [--seq 8192] [--heads 8] [--dim 64] [--world 2]
        [--modes allgather,ring] [--warmup 2] [--reps 5] [--out benchmarks/results/cp.md]

Design:
- every process (the single-process baseline too) runs with torch.set_num_threads(1), so P ranks
  use P cores and perfect scaling is efficiency 1.0;
- T(one process): the median fwd+bwd time of attention_ext.attention on the whole (1, H, S, D)
  sequence in one spawned process (nothing else running);
- T(rank): P spawned gloo ranks each run context_parallel_attention on its shard, with a barrier
  before every iteration so the ranks start together; a rank's time is the median of its
  iterations, T(rank) the max of those over the ranks (the slowest rank sets the pace);
- cases: non-causal with the contiguous layout, causal with zigzag (balanced causal work); and a
  pack of documents (cu_seqlens), causal: one document of 3/4 of S and S/4 in documents of 32
  tokens (1 x 6144 + 64 x 32 at S = 8192, a skewed length mix), sharded zigzag and "balanced",
  against flash_attn_varlen_func on the whole pack in one process;
- modes: --modes, default every mode in attention_ext.distributed.MODES whose first call does
  not raise NotImplementedError; "allgather-no-overlap" is mode="allgather" with overlap=False
  (one all-gather, then the kernel: nothing overlapped);
- exposed communication: when context_parallel_attention takes a `_stats` / `stats` dict (ring
  fills it), the share of T(rank) the rank spent blocked in wait() on transfers (forward +
  backward), else a key with "exposed" in its name as a share of T(rank), else the dict's keys.
  Without that argument the column is "-".
The GFLOP/s column is the shared flops() (attention_ext.bench) of the whole problem over P *
T(rank): the rate each process sustains, to read against the single-process kernel's.
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import os
import queue
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

# (name, shard_layout, causal, packed documents)
CASES = [("non-causal", "contiguous", False, False), ("causal", "zigzag", True, False),
         ("docs causal", "zigzag", True, True), ("docs causal", "balanced", True, True)]


def pack(s):
    """The documents' offsets: one of 3/4 of s, then s/4 in documents of 32 tokens."""
    big = 3 * s // 4
    return [0] + [big + 32 * i for i in range((s - big) // 32)] + [s]


# -- spawning (self-contained: the shape of tests/distributed/harness.py) --------------------------

def _entry(fn, rank, world, store, results, args):
    torch.set_num_threads(1)
    try:
        if world > 1:
            dist.init_process_group("gloo", init_method=f"file://{store}", world_size=world, rank=rank,
                                    timeout=timedelta(seconds=300))
        results.put((rank, True, fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn, world, *args, timeout=1800.0):
    """fn(rank, world, *args) in `world` spawned processes (a gloo group when world > 1)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="ae_bench_cp_")
    procs = [ctx.Process(target=_entry, args=(fn, r, world, os.path.join(tmp, "store"), results, args), daemon=True)
             for r in range(world)]
    got = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while len(got) < world:
            if time.monotonic() > deadline:
                raise RuntimeError(f"ranks did not finish in {timeout:.0f} s")
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode}")
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        shutil.rmtree(tmp, ignore_errors=True)
    return [got[r] for r in range(world)]


# -- what the processes run ----------------------------------------------------------------------

def _inputs(a, s):
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, a.heads, s, a.dim, generator=g) for _ in range(4))  # (B, H, S, D)
    return q, k, v, do


def single(rank, world, a):
    """Median fwd+bwd seconds of the whole sequence in one process, per case."""
    import attention_ext as ae

    q, k, v, do = _inputs(a, a.seq)
    cu = torch.tensor(pack(a.seq), dtype=torch.int32)
    mx = int((cu[1:] - cu[:-1]).max())
    flat = lambda t: t[0].transpose(0, 1)  # noqa: E731  (1, H, S, D) -> (S, H, D)
    out = {}
    for name, _, causal, docs in CASES:
        if name in out:
            continue
        ts = []
        for it in range(a.warmup + a.reps):
            qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
            t0 = time.perf_counter()
            if docs:
                ae.flash_attn_varlen_func(flat(qr), flat(kr), flat(vr), cu, cu, mx, mx, causal=causal).backward(flat(do))
            else:
                ae.attention(qr, kr, vr, causal=causal).backward(do)
            ts.append(time.perf_counter() - t0)
        out[name] = statistics.median(ts[a.warmup:])
    return out


def ranks(rank, world, a, modes):
    """{(mode, case, shard_layout): (median seconds of this rank, stats)} or {(mode, None): "not built"}."""
    from attention_ext import distributed as cp

    fn = cp.context_parallel_attention
    params = inspect.signature(fn).parameters
    stats_arg = "_stats" if "_stats" in params else ("stats" if "stats" in params else None)
    q, k, v, do = _inputs(a, a.seq)
    res = {}
    for mode in modes:
        for name, layout, causal, docs in CASES:
            cu = pack(a.seq) if docs else None
            ql, kl, vl, dol = (cp.shard_sequence(t, dim=2, shard_layout=layout, cu_seqlens=cu) for t in (q, k, v, do))
            ts, stats = [], []
            try:
                for it in range(a.warmup + a.reps):
                    qr, kr, vr = (t.clone().requires_grad_() for t in (ql, kl, vl))
                    extra = {}
                    if stats_arg is not None:
                        extra[stats_arg] = {}
                    dist.barrier()
                    t0 = time.perf_counter()
                    if docs:
                        extra["cu_seqlens"] = cu
                    if mode == "allgather-no-overlap":
                        extra["overlap"] = False
                    fn(qr, kr, vr, mode=mode.split("-")[0], shard_layout=layout, causal=causal, **extra).backward(dol)
                    ts.append(time.perf_counter() - t0)
                    if stats_arg is not None and it >= a.warmup:
                        stats.append(extra[stats_arg])
            except NotImplementedError as e:  # raised by every rank alike, before any collective
                res[(mode, None)] = f"not built: {e}"
                break
            res[(mode, name, layout)] = (statistics.median(ts[a.warmup:]), stats)
    return res


# -- report --------------------------------------------------------------------------------------

def _exposed(stats, t):
    """The stats column: the median of an 'exposed' entry as a share of t, else the keys seen."""
    if not stats:
        return "-"
    keys = sorted({k for s in stats for k in s})
    waits = [k for k in ("fwd_wait_s", "bwd_wait_s") if k in keys]
    if waits:  # ring.ring_attention's stats: seconds blocked in wait() on transfers, forward + backward
        return f"{statistics.median(sum(float(s.get(k, 0.0)) for k in waits) for s in stats) / t:.0%} (waits)"
    exp = [k for k in keys if "exposed" in k and all(isinstance(s.get(k), (int, float)) for s in stats)]
    if exp:
        return f"{statistics.median(float(s[exp[0]]) for s in stats) / t:.0%} ({exp[0]})"
    return "keys: " + ", ".join(keys) if keys else "-"


def main(argv=None):
    from attention_ext.distributed import MODES, sequence_multiple, shard_work
    from attention_ext.bench import cpu_model, flops, machine_line

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--modes", default=None, help="comma-separated; default: every built mode of MODES")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None, help="also write the markdown table here")
    a = p.parse_args(argv)
    # the arguments the ranks would refuse, refused here: inside a rank they surface as a nested
    # traceback after the single-process baseline has run
    for name in ("seq", "heads", "dim", "reps"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(a, name)}")
    if a.world < 2:
        p.error(f"--world must be >= 2 (the ranks of one gloo group), got {a.world}")
    if a.warmup < 0:
        p.error(f"--warmup must be >= 0, got {a.warmup}")
    known = (*MODES, "allgather-no-overlap")
    modes = a.modes.split(",") if a.modes is not None else list(MODES)
    bad = [m for m in modes if m not in known]
    if bad:
        p.error(f"--modes: unknown {', '.join(repr(m) for m in bad)} (comma-separated, from {', '.join(known)})")
    if "ulysses" in modes and a.heads % a.world:
        p.error(f"--heads {a.heads}: mode ulysses shards the heads over the ranks, so --heads must be a multiple of "
                f"--world {a.world} (or leave ulysses out of --modes)")
    m = max(sequence_multiple(a.world, shard_layout=layout) for _, layout, _, _ in CASES)
    if a.seq % m:
        p.error(f"--seq {a.seq}: the cases' shard layouts over --world {a.world} ranks need a multiple of {m}")
    explicit = a.modes is not None

    t1 = spawn(single, 1, a)[0]
    per_rank = spawn(ranks, a.world, a, modes)
    lines = [f"Context-parallel attention efficiency T1 / (P T_rank), fwd+bwd fp32, B=1 H={a.heads} S={a.seq} "
             f"D={a.dim}, P={a.world} gloo ranks, 1 thread per process, median of {a.reps} after {a.warmup} warmup",
             f"({datetime.date.today()}, {cpu_model()}; {machine_line(1)} in each process)",
             "",
             f"documents: {len(pack(a.seq)) - 1} (1 x {3 * a.seq // 4} + {(a.seq - 3 * a.seq // 4) // 32} x 32); "
             f"work imbalance max / mean: " + ", ".join(
                 f"{lay} {max(w) / (sum(w) / a.world):.2f}" for lay in ("zigzag", "balanced")
                 for w in [shard_work(a.seq, a.world, lay, pack(a.seq))]), "",
             "| mode | case | layout | T1 (ms) | T rank (ms) | efficiency | GFLOP/s per process | exposed comm |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    skipped = []
    for mode in modes:
        if (mode, None) in per_rank[0]:
            skipped.append(f"{mode}: {per_rank[0][(mode, None)]}")
            if not explicit:
                continue
        for name, layout, causal, docs in CASES:
            key = (mode, name, layout)
            if key not in per_rank[0]:
                lines.append(f"| {mode} | {name} | {layout} | {t1[name] * 1e3:.1f} | - | - | - | not built |")
                continue
            times = [r[key][0] for r in per_rank]
            tr = max(times)
            slow = times.index(tr)
            eff = t1[name] / (a.world * tr)
            if docs:  # the documents' causal pairs, as flops() counts a causal square
                fl = sum(flops(1, a.heads, e - b, e - b, a.dim, causal=True, mode="fwd_bwd")
                         for b, e in zip(pack(a.seq)[:-1], pack(a.seq)[1:]))
            else:
                fl = flops(1, a.heads, a.seq, a.seq, a.dim, causal=causal, mode="fwd_bwd")
            gf = fl / (a.world * tr) / 1e9
            lines.append(f"| {mode} | {name} | {layout} | {t1[name] * 1e3:.1f} | {tr * 1e3:.1f} | {eff:.2f} | "
                         f"{gf:.1f} | {_exposed(per_rank[slow][key][1], tr)} |")
    if skipped:
        lines += [""] + [f"skipped {s}" for s in skipped]
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
