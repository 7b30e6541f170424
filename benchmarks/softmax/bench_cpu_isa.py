"""The CPU ISA levels against each other (csrc/cpu/isa.h): the softmax attention forward at each
level this build has and this CPU runs, timed round-robin in one process (set_cpu_isa between
calls) so that a shared machine's noise hits every level alike; best and median of the rounds,
and each level's time as a ratio to the top level's. A build with ATTENTION_EXT_NATIVE=1 adds the
native (-march=native) level to the comparison.

    python benchmarks/softmax/bench_cpu_isa.py [--threads 1] [--rounds 15] [--shape 1,8,1024,64]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import attention_ext as ae


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--shape", default="1,8,1024,64", help="B,H,S,D")
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    b, h, s, d = (int(x) for x in args.shape.split(","))
    levels = ae.cpu_isas()
    default = ae.cpu_isa()
    print(f"CPU: {platform.processor() or platform.machine()}; levels built {', '.join(ae.cpu_isas(all=True))}, "
          f"run here {', '.join(levels)}; torch {torch.__version__}, {args.threads} thread(s)")
    print(f"forward B{b} H{h} S{s} D{d}{' causal' if args.causal else ''}, {args.rounds} rounds\n")
    print("| dtype | level | best ms | median ms | best / " + default + " |")
    print("|---|---|---|---|---|")
    try:
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            q, k, v = (torch.randn(b, h, s, d, dtype=dtype) for _ in range(3))
            times = {lv: [] for lv in levels}
            for lv in levels:  # warm-up: scratch buffers, pages
                ae.set_cpu_isa(lv)
                ae.attention(q, k, v, causal=args.causal)
            for _ in range(args.rounds):
                for lv in levels:
                    ae.set_cpu_isa(lv)
                    t0 = time.perf_counter()
                    ae.attention(q, k, v, causal=args.causal)
                    times[lv].append(time.perf_counter() - t0)
            top = min(times[default])
            for lv in levels:
                print(f"| {str(dtype).replace('torch.', '')} | {lv} | {min(times[lv]) * 1e3:.2f} | "
                      f"{statistics.median(times[lv]) * 1e3:.2f} | {min(times[lv]) / top:.3f} |")
    finally:
        ae.set_cpu_isa(None)


if __name__ == "__main__":
    main()
