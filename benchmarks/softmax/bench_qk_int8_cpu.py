"""The CPU forward with the int8 Q.K^T (attention(..., qk_quant="int8")) against the same forward
unquantized and against torch's SDPA in the same dtype, measured in the same run (interleaved,
shuffled order per round), at each ISA level asked for.

    python benchmarks/softmax/bench_qk_int8_cpu.py [--levels avx2,avx512bf16] [--quick] [--out FILE.md]
    python benchmarks/softmax/bench_qk_int8_cpu.py --accuracy [--out FILE.md]

Shapes: the issue's (1, 8, 4096, 128) causal, and (1, 8, 4096, 128) and (2, 16, 2048, 64) without
a mask; inputs bf16, fp16 and fp32 (a bf16 forward runs P.V on vdpbf16ps where the CPU has
AVX512-BF16, fp16 / fp32 in float32 FMAs). Columns: ms per call, the ratio of the unquantized
forward's time to this one (> 1: faster), the same against torch's SDPA (torch's best CPU kernel
for the dtype), and TFLOP/s counted as 4 S_q S_k D H (halved when causal). The header gives the
machine's ceilings, measured in the same run: the float32 FMA, bf16 dot (vdpbf16ps) and int8 dot
(vpdpbusd, integer ops counted as FLOPs) loops on every thread. A level forced below the
machine's (set_cpu_isa) runs that level's code on this CPU, not an older CPU. --quick halves S.

--accuracy: cosine similarity and relative L1 of the int8 forward (and of the unquantized bf16
one) against exact float64 attention, (1, 2, S, 128) causal bf16 with one kv head, S 1000 and
4096, on keys: random; with a shared offset of 4; with 1 channel in 16 offset by 20 on top
(a per-channel bias, the outliers the smoothing removes); with 1 channel in 16 of 3x and 15x
the spread (outliers of scale, which it does not remove).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import at_isa_levels, cpu_peak_flops, emit, interleaved, isa_levels  # noqa: E402

import attention_ext as ae  # noqa: E402

SHAPES = [((1, 8, 4096, 128), True), ((1, 8, 4096, 128), False), ((2, 16, 2048, 64), False)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
KEYS = {"random": lambda k, ch: k, "offset 4": lambda k, ch: k + 4,
        "offset 4, 1/16 channels +20": lambda k, ch: k + 4 + 20 * ch,
        "1/16 channels x3 spread": lambda k, ch: k * (1 + 2 * ch),
        "1/16 channels x15 spread": lambda k, ch: k * (1 + 14 * ch)}


def exact(q, k, v, chunk=1024):
    """float64 causal attention (GQA by repeat), in query chunks."""
    k, v = (t.double().repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
    s_k, outs = k.shape[2], []
    for i0 in range(0, q.shape[2], chunk):
        qc = q[:, :, i0:i0 + chunk].double()
        s = qc @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        i = torch.arange(i0, i0 + qc.shape[2])[:, None]
        outs.append(torch.softmax(s.masked_fill(torch.arange(s_k)[None, :] > i, float("-inf")), -1) @ v)
    return torch.cat(outs, 2)


def cos_l1(out, ref):
    o, r = out.double().flatten(), ref.flatten()
    return float(torch.nn.functional.cosine_similarity(o, r, 0)), float((o - r).abs().sum() / r.abs().sum())


def accuracy() -> list:
    lines = ["Accuracy against exact float64 attention, (1, 2, S, 128) causal, bf16, one kv head:", "",
             "| keys | S | int8 cosine | int8 rel. L1 | unquantized cosine | unquantized rel. L1 |",
             "|---|---|---|---|---|---|"]
    ch = (torch.arange(128) % 16 == 0).float()
    for name, mod in KEYS.items():
        for s in (1000, 4096):
            g = torch.Generator().manual_seed(5)
            q, k, v = (torch.randn(1, h, s, 128, generator=g) for h in (2, 1, 1))
            q, k, v = q.bfloat16(), mod(k, ch).bfloat16(), v.bfloat16()
            ref = exact(q, k, v)
            with torch.no_grad():
                a = cos_l1(ae.attention(q, k, v, causal=True, qk_quant="int8"), ref)
                b = cos_l1(ae.attention(q, k, v, causal=True), ref)
            lines.append(f"| {name} | {s} | {a[0]:.5f} | {a[1]:.2%} | {b[0]:.6f} | {b[1]:.2%} |")
            print(lines[-1], flush=True)
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default=None, help="comma-separated ISA levels (default: this machine's)")
    ap.add_argument("--dtypes", default="bf16,fp16,fp32")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--accuracy", action="store_true", help="the accuracy table instead of the timings")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    levels = isa_levels(ap, "--levels", args.levels) if args.levels is not None else [ae.cpu_isa()]
    if args.accuracy:
        emit("\n".join(accuracy()) + "\n\nCommand: python benchmarks/softmax/bench_qk_int8_cpu.py --accuracy\n",
             args.out)
        return 0
    threads = torch.get_num_threads()
    peaks = {k: cpu_peak_flops(k, threads, 0.5) for k in ("fp32_fma", "bf16_dot", "int8_dot", "int8_amx", "bf16_amx")}
    lines = [f"CPU: {platform.processor() or platform.machine()}, {threads} threads, torch {torch.__version__}; "
             "ceilings (every thread): " + ", ".join(f"{k} {v / 1e12:.2f} T/s" for k, v in peaks.items() if v > 0),
             ""]
    for level in at_isa_levels(levels):
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
    emit("\n".join(lines) + "\nCommand: python benchmarks/softmax/bench_qk_int8_cpu.py" +
         (f" --levels {args.levels}" if args.levels else "") + (" --quick" if args.quick else "") + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
