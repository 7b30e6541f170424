"""Linear attention on the GPU (issue 10's H100 targets): ours against flash-linear-attention's
chunked kernel (plain linear attention) and against SDPA's flash backend (causal softmax), timed
interleaved in the same run with CUDA synchronization, bf16.

    python benchmarks/linear/bench_cuda.py [--reps N] [--out FILE] [--step]

Cases: (B, H, S, D) = (4, 16, 8192, 128) and (8, 16, 2048, 64), causal, forward and
forward + backward. Plain linear attention means the feature map and normalization FLA's chunked
kernel computes: identity features, no normalizer (`feature_map="identity", normalize=False`),
scale 1/sqrt(D) on both. FLA is optional (`pip install flash-linear-attention fla-core`; the
device README says how its wheels travel); without it that column says so. Targets: >= 1.0x FLA,
>= 4x SDPA-flash at S = 8192. GFLOP/s: attention_ext.bench.linear_flops, the one shared formula.

"ours" is the default kernels (the chunk-parallel segment kernels), "ours-cs" the chunk-state
forward and backward (attention_ext.linear.set_cuda_kernels(chunk_states=True)).
"""
from __future__ import annotations

import argparse
import inspect
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from common import copy_bandwidth, interleaved, linear_flops, matmul_ceiling  # noqa: E402

import attention_ext as ae  # noqa: E402

CASES = [(4, 16, 8192, 128), (8, 16, 2048, 64)]
# the recurrent step (decode of a linear model): (B, H, M = Dv), one position, bf16 inputs, fp32 state
STEP_CASES = [(8, 32, 128), (64, 32, 128), (256, 16, 64)]


def step_table(reps: int) -> list:
    """The linear_step kernel's state traffic (one read, one write of S and z) against the copy
    bandwidth, and against the PyTorch form a user would write (reference.linear_step in place:
    a scale, an addcmul and a bmm per position), timed interleaved."""
    from attention_ext.linear import ops, reference
    bw = copy_bandwidth(device="cuda")
    lines = ["", f"linear_step, bf16 inputs, fp32 state, T = 1; copy bandwidth {bw / 1e9:.0f} GB/s (read + write)", "",
             "| (B, H, M = Dv) | state MB | ours us | ours GB/s (% of copy) | PyTorch form us | x PyTorch |",
             "|---|---|---|---|---|---|"]
    for b, h, m in STEP_CASES:
        q, k, v = (torch.randn(b, h, 1, m, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        s = torch.randn(b, h, m, m, device="cuda")
        z = torch.rand(b, h, m, device="cuda") + 1
        g = -torch.rand(b, h, 1, device="cuda")
        s2, z2 = s.clone(), z.clone()
        fns = {"ours": lambda: ops.step(q, k, v, s, z, g, feature_map=1, eps=1e-6, scale=1.0),
               "torch": lambda: reference.linear_step(q, k, v, s2, z2, g, feature_map=1, eps=1e-6, scale=1.0)}
        t = interleaved(fns, reps=reps, sync=torch.cuda.synchronize)
        nbytes = 2 * (s.numel() + z.numel()) * 4
        lines.append(f"| {(b, h, m)} | {s.numel() * 4 / 1e6:.0f} | {t['ours'] * 1e6:.1f} | "
                     f"{nbytes / t['ours'] / 1e9:.0f} ({nbytes / t['ours'] / bw:.0%}) | {t['torch'] * 1e6:.1f} | "
                     f"{t['torch'] / t['ours']:.2f}x |")
        print(lines[-1], flush=True)
    return lines


def fla_fn():
    """FLA's chunked plain linear attention on (B, S, H, D) inputs, or None without FLA."""
    try:
        from fla.ops.linear_attn import chunk_linear_attn
    except ImportError:
        return None
    extra = {"head_first": False} if "head_first" in inspect.signature(chunk_linear_attn).parameters else {}

    def run(q, k, v, scale):
        return chunk_linear_attn(q, k, v, scale=scale, normalize=False, **extra)[0]
    return run


def step(fn, grad, dout, leaves):
    def run():
        out = fn()
        if grad:
            for t in leaves:
                t.grad = None  # a training step: optimizer.zero_grad() sets them to None
            out.backward(dout)
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", help="write the markdown table here")
    ap.add_argument("--step", action="store_true", help="only the recurrent step's table")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cuda.py needs a CUDA device")
        return 1
    fla = fla_fn()
    ceil = matmul_ceiling(torch.bfloat16, n=8192, device="cuda")
    lines = [f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16 (matmul ceiling "
             f"{ceil / 1e12:.0f} TFLOP/s); FLA: {'chunk_linear_attn' if fla else 'not installed'}", "",
             "| (B, H, S, D) | pass | ours TFLOP/s (of matmul, ms) | ours / FLA | ours / SDPA-flash causal "
             "| ours-cs TFLOP/s (ms) | ours-cs / FLA | ours-cs / SDPA-flash causal | ours-cs / ours |",
             "|---|---|---|---|---|---|---|---|---|"]
    for b, h, s, d in ([] if args.step else CASES):
        for grad in (False, True):
            torch.manual_seed(0)
            # (B, S, H, D): FLA's layout; ours reads it through strides (layout="bshd")
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
                       for _ in range(3))
            dout = torch.randn_like(q) if grad else None
            scale = 1.0 / math.sqrt(d)
            fns = {"ours": step(lambda: ae.linear_attention(q, k, v, feature_map="identity", normalize=False,
                                                            causal=True, scale=scale, layout="bshd"),
                                grad, dout, (q, k, v))}

            def chunk_states():
                ae.linear.set_cuda_kernels(chunk_states=True)  # until the backward has run
                return ae.linear_attention(q, k, v, feature_map="identity", normalize=False, causal=True,
                                           scale=scale, layout="bshd")

            def default_kernels(fn):
                def run():
                    ae.linear.set_cuda_kernels()
                    return fn()
                return run
            fns["ours"] = default_kernels(fns["ours"])
            fns["ours-cs"] = step(chunk_states, grad, dout, (q, k, v))
            if fla is not None:
                fns["fla"] = step(lambda: fla(q, k, v, scale), grad, dout, (q, k, v))
            qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_(grad) for t in (q, k, v))
            dt = dout.transpose(1, 2) if grad else None

            def sdpa():
                with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
            fns["sdpa"] = step(sdpa, grad, dt, (qt, kt, vt))
            with torch.set_grad_enabled(grad):
                t = interleaved(fns, reps=args.reps, sync=torch.cuda.synchronize)
            fl = linear_flops(b, h, s, d, d, normalize=False, mode="fwd_bwd" if grad else "fwd")
            vs_fla = f"{t['fla'] / t['ours']:.2f}x" if "fla" in t else "-"
            cs_fla = f"{t['fla'] / t['ours-cs']:.2f}x" if "fla" in t else "-"
            lines.append(f"| {(b, h, s, d)} | {'fwd+bwd' if grad else 'fwd'} | {fl / t['ours'] / 1e12:.1f} "
                         f"({fl / t['ours'] / ceil:.0%}, {t['ours'] * 1e3:.2f}) | {vs_fla} | {t['sdpa'] / t['ours']:.2f}x "
                         f"| {fl / t['ours-cs'] / 1e12:.1f} ({t['ours-cs'] * 1e3:.2f}) | {cs_fla} "
                         f"| {t['sdpa'] / t['ours-cs']:.2f}x | {t['ours'] / t['ours-cs']:.2f}x |")
            print(lines[-1], flush=True)
    ae.linear.set_cuda_kernels()  # the default again
    lines += step_table(args.reps)
    text = "\n".join(lines) + "\n\nRatios > 1: ours faster. Command: python benchmarks/linear/bench_cuda.py\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
