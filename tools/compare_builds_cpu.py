#!/usr/bin/env python3
"""Time the CPU kernels of two checkouts in turn, for "a refactor left the speed alone" proofs.

    python tools/compare_builds_cpu.py NEW_TREE OLD_TREE [--rounds 5] [--reps 5] [--threads N]

Each tree must hold an in-place build (attention_ext/_C*.so, e.g. `python setup.py build_ext
--inplace`). A round runs one fresh process per tree, alternating which goes first; each process
times the fused op (forward, and forward + backward) on benchmarks/softmax/bench_cpu.py's shapes in fp32
and bf16, best of --reps repetitions (the minimum is the figure least moved by other jobs). The report is the median over rounds of NEW / OLD per row
and over all rows: pairing within a round keeps the ratio meaningful while the shared machine's
speed drifts.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

SHAPES = [(1, 8, 2048, 64, False), (1, 8, 2048, 64, True), (1, 16, 4096, 64, True), (2, 8, 1024, 128, False)]

CHILD = r"""
import json, sys, time, torch
import attention_ext as ae
assert ae.__file__.startswith(sys.argv[1]), ae.__file__
shapes, reps, out = json.loads(sys.argv[2]), int(sys.argv[3]), {}
for b, h, s, d, causal in shapes:
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(b, h, s, d, dtype=dtype, requires_grad=True) for _ in range(3))
        for kind in ("fwd", "fwd+bwd"):
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                o = ae.attention(q, k, v, causal=causal)
                if kind == "fwd+bwd":
                    o.sum().backward()
                best = min(best, time.perf_counter() - t0)
            out[f"{kind} {str(dtype)[6:]} B{b} H{h} S{s} D{d}{' causal' if causal else ''}"] = best
print(json.dumps(out))
"""


def run(tree: str, threads: int | None, reps: int) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    res = subprocess.run([sys.executable, "-c", CHILD, os.path.abspath(tree), json.dumps(SHAPES), str(reps)], cwd=tree,
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("new")
    ap.add_argument("old")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    ratios: dict[str, list[float]] = {}
    for r in range(a.rounds):
        order = (a.new, a.old) if r % 2 == 0 else (a.old, a.new)
        t = {tree: run(tree, a.threads, a.reps) for tree in order}
        for row in t[a.new]:
            ratios.setdefault(row, []).append(t[a.new][row] / t[a.old][row])
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
    print(f"{'row':45s} new/old (median of {a.rounds} rounds; min..max)")
    for row, rs in ratios.items():
        print(f"{row:45s} {statistics.median(rs):.3f}  ({min(rs):.3f}..{max(rs):.3f})")
    per_round = [statistics.geometric_mean([rs[i] for rs in ratios.values()]) for i in range(a.rounds)]
    print(f"{'all rows (geometric mean per round)':45s} {statistics.median(per_round):.3f}  "
          f"({min(per_round):.3f}..{max(per_round):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
