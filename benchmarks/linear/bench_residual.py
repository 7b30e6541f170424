"""What keeping normalized linear attention's output rounding residual costs (linear_fwd's
keep_residual, read by linear_bwd: attention_ext/linear/ops.py): the CPU op's forward +
backward in bf16 / fp16 with the residual kept and read, and without it, interleaved call by call
in one run, the median of each. The residual is one extra output-sized 16-bit tensor written by
the forward and read by the backward; inference (no autograd) never keeps it.

    python benchmarks/linear/bench_residual.py [--shapes 1x8x4096x64,4x16x1024x128] [--reps 15]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import cpu_model, interleaved, machine_line  # noqa: E402

from attention_ext.linear import ops  # noqa: E402


def case(b: int, h: int, s: int, d: int, dtype: torch.dtype, reps: int) -> dict:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, generator=g).to(dtype) for _ in range(3))
    dout = torch.randn(b, h, s, d, generator=g).to(dtype)
    opts = dict(decay=None, initial_state=None, key_mask=None, cu_seqlens=None, max_seqlen=s, feature_map=1,
                causal=True, normalize=True, eps=1e-6, scale=d ** -0.5)

    def run(keep: bool):
        def f():
            out, den, _, res = torch.ops.attention_ext.linear_fwd(
                *[dict(opts, q=q, k=k, v=v, keep_residual=keep)[n] for n in ops.FWD_ARGS])
            b_ = dict(opts, dout=dout, dfinal_state=None, q=q, k=k, v=v, out=out, den=den,
                      out_residual=res if res.numel() else None)
            torch.ops.attention_ext.linear_bwd(*[b_[n] for n in ops.BWD_ARGS])
        return f

    return interleaved({"kept": run(True), "none": run(False)}, warmup=2, reps=reps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1x8x4096x64,4x16x1024x128", help="BxHxSxD, comma-separated")
    ap.add_argument("--reps", type=int, default=15, help="calls per setting (interleaved)")
    a = ap.parse_args()
    try:
        shapes = [tuple(int(x) for x in sh.split("x")) for sh in a.shapes.split(",")]
        assert all(len(sh) == 4 and min(sh) > 0 for sh in shapes)
    except (ValueError, AssertionError):
        ap.error(f"--shapes: BxHxSxD with positive sizes, comma-separated (got {a.shapes!r})")
    if a.reps < 1:
        ap.error("--reps: at least 1")
    if not ops.has_kernel(torch.device("cpu")):
        print("the linear op is not built: nothing to measure")
        return 1
    print(f"CPU: {cpu_model()}; {machine_line(torch.get_num_threads())}")
    print("| shape (B, H, S, D), causal elu normalized | dtype | fwd+bwd, residual kept (ms) | without (ms) | ratio |")
    print("|---|---|---|---|---|")
    for sh in shapes:
        for dt in (torch.bfloat16, torch.float16):
            t = case(*sh, dt, a.reps)
            print(f"| {sh} | {str(dt).split('.')[-1]} | {t['kept'] * 1e3:.2f} | {t['none'] * 1e3:.2f} | "
                  f"{t['kept'] / t['none']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
