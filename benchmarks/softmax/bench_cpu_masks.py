"""Masked CPU softmax attention against torch SDPA given the same mask, and against our own unmasked
call, all timed round-robin in one process: a key padding mask (ours: `key_mask`; SDPA:
the equivalent (B, 1, 1, S) bool `attn_mask`) and a dense (B, 1, S, S) bool mask.

    python benchmarks/softmax/bench_cpu_masks.py [--threads 1] [--reps 7] [--bwd] [--isa avx2]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import flops, interleaved, isa_levels, step  # noqa: E402

import attention_ext as ae  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--bwd", action="store_true", help="also time forward + backward")
    ap.add_argument("--isa", default=None, help="force a CPU ISA level (attention_ext.set_cpu_isa)")
    ap.add_argument("--shape", default="1,8,1024,64", help="B,H,S,D")
    args = ap.parse_args()
    if args.isa is not None and len(isa_levels(ap, "--isa", args.isa)) != 1:
        ap.error(f"--isa: one level, got {args.isa!r}")
    try:
        b, h, s, d = (int(x) for x in args.shape.split(","))
    except ValueError:
        ap.error(f"--shape takes B,H,S,D, got {args.shape!r}")
    torch.set_num_threads(args.threads)
    ae.set_cpu_isa(args.isa)
    print(f"CPU: {platform.processor() or platform.machine()}; attention_ext level {ae.cpu_isa()}; "
          f"torch {torch.__version__}; {args.threads} thread(s); B{b} H{h} S{s} D{d}, 80% of keys kept\n")
    print("| dtype | mask | mode | ours ms | GFLOP/s | ours / SDPA speed | ours masked / ours unmasked time |")
    print("|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        x = [torch.randn(b, h, s, d, dtype=dtype) for _ in range(3)]
        g = torch.randn(b, h, s, d, dtype=dtype)
        kpm = torch.rand(b, s) > 0.2  # True = attend
        dense = torch.rand(b, 1, s, s) > 0.2
        for mode in (["fwd", "fwd_bwd"] if args.bwd else ["fwd"]):
            def run(f):
                return step(f, x, g, mode)

            fns = {
                "plain": run(lambda q, k, v: ae.attention(q, k, v)),
                "kpm": run(lambda q, k, v: ae.attention(q, k, v, key_mask=kpm)),
                "kpm_sdpa": run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v,
                                                                               attn_mask=kpm.view(b, 1, 1, s))),
                "dense": run(lambda q, k, v: ae.attention(q, k, v, attn_mask=dense)),
                "dense_sdpa": run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)),
            }
            t = interleaved(fns, reps=args.reps)
            for name, label in (("kpm", "key padding"), ("dense", "dense bool")):
                fl = flops(b, h, s, s, d, mode=mode, pairs=0.8 * s * s)
                print(f"| {str(dtype).replace('torch.', '')} | {label} | {mode} | {t[name] * 1e3:.2f} | "
                      f"{fl / t[name] / 1e9:.0f} | {t[name + '_sdpa'] / t[name]:.2f}x | "
                      f"{t[name] / t['plain']:.2f} |")
    ae.set_cpu_isa(None)


if __name__ == "__main__":
    main()
