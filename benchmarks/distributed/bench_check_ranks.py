"""What the ranks' agreement before context parallelism's collectives costs (check_ranks,
attention_ext/distributed/agree.py): context_parallel_attention's forward + backward on CPU gloo
ranks with check_ranks=True and False, alternated call by call, the median of each.

    python benchmarks/distributed/bench_check_ranks.py [--world 2] [--seqs 256,4096] [--reps 30]

Each rank runs torch.set_num_threads(1); a barrier before every call starts the ranks together;
a rank's time is the median of its calls and the table takes the slowest rank's. The agreement is
one all-gather of a fixed-size int64 row per rank: its cost does not grow with the sequence, so
it shows at short sequences and vanishes at long ones.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from tests.distributed import harness  # noqa: E402  (the spawn harness the tests use)


def _rank(rank: int, world: int, seqs, reps: int, heads: int, dim: int, modes):
    from attention_ext import distributed as cp
    out = {}
    for mode in modes:
        for s in seqs:
            n = s // world
            g = torch.Generator().manual_seed(rank)
            q, k, v = (torch.randn(1, heads, n, dim, generator=g).requires_grad_() for _ in range(3))
            times = {True: [], False: []}
            for i in range(2 * reps + 4):
                check = i % 2 == 0
                dist.barrier()
                t0 = time.perf_counter()
                o = cp.context_parallel_attention(q, k, v, mode=mode, causal=True, shard_layout="zigzag",
                                                  check_ranks=check)
                o.sum().backward()
                if i >= 4:  # warm-up calls left out
                    times[check].append(time.perf_counter() - t0)
            out[(mode, s)] = {c: statistics.median(t) for c, t in times.items()}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2, help="gloo ranks (>= 2)")
    ap.add_argument("--seqs", default="256,4096", help="global sequence lengths, comma-separated")
    ap.add_argument("--reps", type=int, default=30, help="calls per setting (alternated)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--modes", default="allgather,ring")
    a = ap.parse_args()
    if a.world < 2:
        ap.error("--world: at least 2 ranks")
    seqs = [int(x) for x in a.seqs.split(",")]
    if any(s <= 0 or s % (2 * a.world) for s in seqs):
        ap.error(f"--seqs: each a positive multiple of 2 * --world = {2 * a.world} (the zigzag sharding)")
    from attention_ext.bench import machine_line
    res = harness.run(_rank, a.world, seqs, a.reps, a.heads, a.dim, a.modes.split(","), timeout=1800)
    print(f"{machine_line(1)} per rank, {a.world} gloo ranks; (1, {a.heads}, S, {a.dim}) fp32, causal, zigzag, "
          f"forward + backward; median of {a.reps} calls each, the slowest rank")
    print()
    print("| mode | S | check_ranks=True ms | check_ranks=False ms | difference ms |")
    print("|---|---|---|---|---|")
    for key in res[0]:
        on = max(r[key][True] for r in res) * 1e3
        off = max(r[key][False] for r in res) * 1e3
        print(f"| {key[0]} | {key[1]} | {on:.3f} | {off:.3f} | {on - off:+.3f} |")
    print(f"\nCommand: python benchmarks/distributed/bench_check_ranks.py --world {a.world} --seqs {a.seqs} "
          f"--reps {a.reps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
