"""The bf16 forward on a CPU with bf16 dot products (AVX512-BF16: the avx512bf16 level, csrc/cpu/bf16dot.h)
against our float32 forward and torch SDPA in bf16 and float32, all timed round-robin in one process.
Also our bf16 at the level below (avx512: bf16 widened to float32, the path such a CPU took before),
on a CPU with AMX (the avx512amx variant: csrc/cpu/amx.h) our bf16 at avx512bf16 (vdpbf16ps, without
the tiles), and the machine's matmul ceilings in both dtypes. Targets: bf16 forward >= 1.5x our
float32 forward and >= 1.5x torch SDPA in bf16.

    python benchmarks/softmax/bench_cpu_bf16.py [--threads 1 2] [--reps 7] [--bwd]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import flops, interleaved, matmul_ceiling, step  # noqa: E402

import attention_ext as ae  # noqa: E402

SHAPES = [(1, 8, 1024, 64), (1, 8, 1024, 128), (2, 8, 2048, 64), (1, 8, 4096, 128)]


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    keep = [x for x in flags if x.startswith(("avx512", "amx")) or x in ("avx2", "fma")]
    return " ".join(sorted(keep))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--bwd", action="store_true", help="also time forward + backward")
    args = ap.parse_args()
    if "avx512bf16" not in ae.cpu_isas():
        print(f"this CPU has no AVX512-BF16 (levels it runs: {', '.join(ae.cpu_isas())}): the bf16 dot-product "
              "path is not available here, nothing to measure")
        return
    print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; ISA flags: {cpu_flags()}")
    print(f"torch {torch.__version__}; attention_ext level {ae.cpu_isa()}")
    modes = ["fwd", "fwd_bwd"] if args.bwd else ["fwd"]
    amx = ae.cpu_isa() == "avx512amx"
    for threads in args.threads:
        torch.set_num_threads(threads)
        c32, c16 = matmul_ceiling(torch.float32), matmul_ceiling(torch.bfloat16)
        print(f"\n{threads} thread(s): matmul ceiling fp32 {c32 / 1e9:.0f} GFLOP/s, bf16 {c16 / 1e9:.0f} GFLOP/s\n")
        print("| shape B,H,S,D | causal | mode | ours bf16 ms | GFLOP/s | % bf16 ceiling | vs ours fp32 | "
              "vs SDPA bf16 | vs SDPA fp32 | vs ours bf16 widened |" + (" vs ours bf16 vdpbf16ps |" if amx else ""))
        print("|---|---|---|---|---|---|---|---|---|---|" + ("---|" if amx else ""))
        for (b, h, s, d) in SHAPES:
            for causal in (False, True):
                for mode in modes:
                    torch.manual_seed(0)
                    x32 = [torch.randn(b, h, s, d) for _ in range(3)]
                    x16 = [t.bfloat16() for t in x32]
                    g32 = torch.randn(b, h, s, d)
                    g16 = g32.bfloat16()

                    def run(f, xs, g, level=None):
                        inner = step(f, xs, g, mode)
                        if level is None:
                            return inner

                        def call():
                            ae.set_cpu_isa(level)
                            try:
                                inner()
                            finally:
                                ae.set_cpu_isa(None)
                        return call

                    ours = lambda q, k, v: ae.attention(q, k, v, causal=causal)  # noqa: E731
                    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
                    fns = {"bf16": run(ours, x16, g16), "fp32": run(ours, x32, g32),
                           "sdpa_bf16": run(sdpa, x16, g16), "sdpa_fp32": run(sdpa, x32, g32),
                           "widened": run(ours, x16, g16, "avx512")}
                    if amx:
                        fns["dp"] = run(ours, x16, g16, "avx512bf16")
                    t = interleaved(fns, reps=args.reps)
                    fl = flops(b, h, s, s, d, causal=causal, mode=mode)
                    print(f"| {b},{h},{s},{d} | {causal} | {mode} | {t['bf16'] * 1e3:.2f} | "
                          f"{fl / t['bf16'] / 1e9:.0f} | {100 * fl / t['bf16'] / c16:.0f}% | "
                          f"{t['fp32'] / t['bf16']:.2f}x | {t['sdpa_bf16'] / t['bf16']:.2f}x | "
                          f"{t['sdpa_fp32'] / t['bf16']:.2f}x | {t['widened'] / t['bf16']:.2f}x |" +
                          (f" {t['dp'] / t['bf16']:.2f}x |" if amx else ""))


if __name__ == "__main__":
    main()
