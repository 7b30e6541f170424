"""The CPU forward with the int8 Q.K^T (attention(..., qk_quant="int8")) against the same forward
unquantized and against torch's SDPA in the same dtype, measured in the same run (interleaved,
shuffled order per round), at each ISA level asked for.

    python benchmarks/softmax/bench_qk_int8_cpu.py [--levels avx2,avx512bf16] [--quick] [--out FILE.md]

Shapes: the issue's (1, 8, 4096, 128) causal, and (1, 8, 4096, 128) and (2, 16, 2048, 64) without
a mask; inputs bf16, fp16 and fp32 (a bf16 forward runs P.V on vdpbf16ps where the CPU has
AVX512-BF16, fp16 / fp32 in float32 FMAs). Columns: ms per call, the ratio of the unquantized
forward's time to this one (> 1: faster), the same against torch's SDPA (torch's best CPU kernel
for the dtype), and TFLOP/s counted as 4 S_q S_k D H (halved when causal). The header gives the
machine's ceilings, measured in the same run: the float32 FMA, bf16 dot (vdpbf16ps) and int8 dot
(vpdpbusd, integer ops counted as FLOPs) loops on every thread. A level forced below the
machine's (set_cpu_isa) runs that level's code on this CPU, not an older CPU. --quick halves S.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import cpu_peak_flops, interleaved  # noqa: E402

import attention_ext as ae  # noqa: E402

SHAPES = [((1, 8, 4096, 128), True), ((1, 8, 4096, 128), False), ((2, 16, 2048, 64), False)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default=None, help="comma-separated ISA levels (default: this machine's)")
    ap.add_argument("--dtypes", default="bf16,fp16,fp32")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()
    peaks = {k: cpu_peak_flops(k, threads, 0.5) for k in ("fp32_fma", "bf16_dot", "int8_dot")}
    lines = [f"CPU: {platform.processor() or platform.machine()}, {threads} threads, torch {torch.__version__}; "
             "ceilings (every thread): " + ", ".join(f"{k} {v / 1e12:.2f} T/s" for k, v in peaks.items() if v > 0),
             ""]
    levels = args.levels.split(",") if args.levels else [ae.cpu_isa()]
    old = ae.cpu_isa()
    try:
        for level in levels:
            ae.set_cpu_isa(level)
            lines += [f"ISA level {level}:", "",
                      "| (B, H, S, D) | mask | dtype | unquantized ms | int8 Q.K^T ms | x unquantized | SDPA ms | "
                      "x SDPA | int8 TFLOP/s |", "|---|---|---|---|---|---|---|---|---|"]
            for (b, h, s, d), causal in SHAPES:
                s = s // 2 if args.quick else s
                flop = 4.0 * b * h * s * s * d / (2 if causal else 1)
                for name in args.dtypes.split(","):
                    dt = DTYPES[name]
                    torch.manual_seed(0)
                    q, k, v = (torch.randn(b, h, s, d).to(dt) for _ in range(3))
                    fns = {"plain": lambda: ae.attention(q, k, v, causal=causal),
                           "int8": lambda: ae.attention(q, k, v, causal=causal, qk_quant="int8"),
                           "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
                    with torch.no_grad():
                        t = interleaved(fns, reps=args.reps, shuffle=True)
                    lines.append(f"| ({b}, {h}, {s}, {d}) | {'causal' if causal else 'none'} | {name} | "
                                 f"{t['plain'] * 1e3:.1f} | {t['int8'] * 1e3:.1f} | {t['plain'] / t['int8']:.2f}x | "
                                 f"{t['sdpa'] * 1e3:.1f} | {t['sdpa'] / t['int8']:.2f}x | "
                                 f"{flop / t['int8'] / 1e12:.2f} |")
                    print(lines[-1], flush=True)
            lines.append("")
    finally:
        ae.set_cpu_isa(old)
    text = "\n".join(lines) + "\nCommand: python benchmarks/softmax/bench_qk_int8_cpu.py" + \
        (f" --levels {args.levels}" if args.levels else "") + (" --quick" if args.quick else "") + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
