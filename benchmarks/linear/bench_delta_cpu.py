"""CPU benchmark of the delta rule (ae.delta_rule_attention: DeltaNet, Gated DeltaNet, KDA)
against the chunked PyTorch form a user writes (reference.delta_rule_chunked: the WY form with
torch.linalg.solve_triangular, chunk 64, autograd backward), timed in the same run, reported as
ratios beside the machine's fp32 matmul ceiling.

    python benchmarks/linear/bench_delta_cpu.py [--levels avx2,avx512bf16] [--quick] [--out FILE.md]

Sections:
1. (B1, H8, S4096, K=V=128), fp32 and bf16, each gate kind: forward and forward+backward.
   GFLOP/s count the recurrence's work, 7 K V flops per token forward (h' = a h, p += k h',
   h += k u, o += q h), read against the measured fp32 FMA peak (forward+backward rows count
   the forward's flops too, so they read low: the backward does about 4.6x the forward's work).
2. The step (delta_rule_step, T = 1, B16 H16 K=V=128 fp32, in place and into a new state): the
   state's bytes (read once, written once) per second, against a copy of as many bytes, every call
   from cold caches (cache_evictor); peer: the PyTorch recurrence.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import (at_isa_levels, cpu_peak_flops, interleaved, interleaved_stats, isa_levels,  # noqa: E402
                    matmul_ceiling)

import attention_ext as ae  # noqa: E402
from attention_ext.bench import cache_evictor  # noqa: E402
from attention_ext.linear import delta, reference  # noqa: E402

HAS_OP = delta.has_kernel(torch.device("cpu"))
LINES = []


def emit(line=""):
    print(line, flush=True)
    LINES.append(line)


def inputs(b, h, s, kd, vd, dtype, gate, grad):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, s, kd, generator=g).to(dtype)
    k = reference._l2n(torch.randn(b, h, s, kd, generator=g)).to(dtype)
    v = torch.randn(b, h, s, vd, generator=g).to(dtype)
    beta = torch.rand(b, h, s, generator=g).to(dtype)
    gt = None
    if gate == "head":
        gt = -0.1 * torch.rand(b, h, s, generator=g)
    elif gate == "key":
        gt = -0.1 * torch.rand(b, h, s, kd, generator=g)
    leaves = [t.requires_grad_(grad) for t in (q, k, v, beta)] + ([gt.requires_grad_(grad)] if gt is not None else [])
    return leaves


def runner(fn, leaves, grad, dout):
    def run():
        out = fn(*leaves)
        if grad:
            for t in leaves:
                t.grad = None  # as after optimizer.zero_grad(): autograd hands over the op's gradients
            out.backward(dout)
    return run


def compare(name, gate, dtype, grad, reps, ceil, shape):
    b, h, s, kd, vd = shape
    leaves = inputs(b, h, s, kd, vd, dtype, gate, grad)
    dout = torch.randn(b, h, s, vd).to(dtype) if grad else None

    def ours(q, k, v, beta, g=None):
        return ae.delta_rule_attention(q, k, v, beta, gate=g)

    def peer(q, k, v, beta, g=None):
        return reference.delta_rule_chunked(q, k, v, beta, g.to(dtype) if g is not None else None, chunk=64)[0]

    fns = {"peer": runner(peer, leaves, grad, dout)}
    if HAS_OP:
        fns["ours"] = runner(ours, leaves, grad, dout)
    with torch.set_grad_enabled(grad):
        t = interleaved(fns, reps=reps)
    fl = 7.0 * b * h * s * kd * vd
    what = "fwd+bwd" if grad else "fwd"
    dt = str(dtype).replace("torch.", "")
    if HAS_OP:
        rate = fl / t["ours"] / 1e9
        emit(f"| {name:<14} | {what:<7} | {dt:<8} | {t['ours'] * 1e3:7.1f} | {rate:6.1f} ({rate * 1e9 / ceil:4.0%}) | "
             f"{t['peer'] * 1e3:7.1f} | {t['peer'] / t['ours']:5.2f}x |")
    else:
        emit(f"| {name:<14} | {what:<7} | {dt:<8} | op not built | - | {t['peer'] * 1e3:7.1f} | - |")


def step_bandwidth(reps, budget=20.0):
    b, h, kd, vd = 16, 16, 128, 128
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(b, h, 1, kd, generator=g), reference._l2n(torch.randn(b, h, 1, kd, generator=g))
    v, beta = torch.randn(b, h, 1, vd, generator=g), torch.rand(b, h, 1, generator=g)
    gt = -0.1 * torch.rand(b, h, 1, generator=g)
    state = torch.randn(b, h, kd, vd, generator=g)
    src, dst = torch.randn(b, h, kd, vd), torch.empty(b, h, kd, vd)

    def pytorch_step():  # the recurrence for one token, as a user writes it
        hh = state * torch.exp(gt)[..., None]
        u = beta[:, :, 0, None] * (v[:, :, 0] - torch.einsum("bhkv,bhk->bhv", hh, k[:, :, 0]))
        hh = hh + k[:, :, 0, :, None] * u[:, :, None, :]
        return torch.einsum("bhkv,bhk->bhv", hh, q[:, :, 0] * kd ** -0.5), hh

    copy = {"copy": lambda: dst.copy_(src)}
    ours = {}
    if HAS_OP:
        ours["inplace"] = lambda: ae.delta_rule_step(q, k, v, beta, state, gate=gt, inplace=True)
        ours["step"] = lambda: ae.delta_rule_step(q, k, v, beta, state, gate=gt)
    # every call starts with cold caches (a decode step finds its state evicted by the other
    # layers), in shuffled rounds: a call right after another on the same state found it in L3.
    # The PyTorch recurrence is timed in rounds of its own: its 16 MiB temporaries, allocated and
    # freed per call, made the in-place step's times bimodal beside it (IQR 2x its median).
    st = {}
    with torch.no_grad():
        for group in (dict(copy, **ours), dict(copy, pytorch=pytorch_step)):
            got = interleaved_stats(group, min_reps=max(reps, 20), budget=budget, shuffle=True, before=cache_evictor())
            st.update({n: x for n, x in got.items() if n not in st})
    t = {n: x.median for n, x in st.items()}
    nbytes = 2 * state.numel() * 4  # read once, written once
    emit(f"Step (delta_rule_step, T=1, B{b} H{h} K=V={kd} fp32, gated, state {state.numel() * 4 / 2**20:.0f} MiB, "
         f"each call from cold caches; copy {nbytes / t['copy'] / 1e9:.1f} GB/s, {t['copy'] * 1e6:.0f} us):")
    for name, what in (("inplace", "delta_rule_step(inplace=True)"), ("step", "delta_rule_step (a new state)"),
                       ("pytorch", "the PyTorch recurrence")):
        if name in t:
            emit(f"  {what}: {nbytes / t[name] / 1e9:.1f} GB/s over the state's bytes, {t['copy'] / t[name]:.0%} of "
                 f"copy bandwidth; {t[name] * 1e6:.0f} us (IQR {st[name].spread:.0%})")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="S = 1024 and one rep: under a minute")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--levels", default=None, help="comma-separated ISA levels (default: this machine's)")
    ap.add_argument("--out", default=None, help="write the markdown report here")
    args = ap.parse_args(argv)
    levels = isa_levels(ap, "--levels", args.levels) if args.levels is not None else [ae.cpu_isa()]
    argv_list = list(sys.argv[1:] if argv is None else argv)
    reps = 1 if args.quick else args.reps
    warnings.simplefilter("ignore", RuntimeWarning)
    mm = matmul_ceiling(torch.float32, n=1024 if args.quick else 2048)
    emit(f"CPU: {platform.processor() or platform.machine()}, ISA level {ae.cpu_isa()}, {torch.get_num_threads()} "
         f"threads, torch {torch.__version__}; fp32 matmul {mm / 1e9:.1f} GFLOP/s; delta op "
         f"{'built' if HAS_OP else 'NOT built'}")
    emit()
    shape = (1, 8, 1024 if args.quick else 4096, 128, 128)
    emit(f"(B, H, S, K, V) = {shape}")
    # the peer (PyTorch) runs at torch's own ISA whatever the level; ours at each level in turn
    for level in at_isa_levels(levels):
        ceil = cpu_peak_flops("fp32_fma") or mm  # the level's vector width
        emit()
        emit(f"ISA level {level}: fp32 FMA peak {ceil / 1e9:.1f} GFLOP/s (cpu_peak_flops)")
        emit()
        emit("| variant | pass | dtype | ours ms | ours GFLOP/s (of fp32 FMA peak) | peer ms | peer / ours |")
        emit("|---|---|---|---|---|---|---|")
        for dtype in (torch.float32, torch.bfloat16):
            for name, gate in (("DeltaNet", None), ("Gated DeltaNet", "head"), ("KDA", "key")):
                for grad in (False, True):
                    compare(name, gate, dtype, grad, reps, ceil, shape)
        emit()
        step_bandwidth(reps, budget=2.0 if args.quick else 20.0)
    emit()
    emit("Peer: reference.delta_rule_chunked (chunk 64, the WY form with torch.linalg.solve_triangular), autograd "
         "backward, in the inputs' dtype. Ratios > 1: ours faster.")
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# Delta rule CPU benchmark, {datetime.date.today()}\n\n")
            f.write(f"Command: `{' '.join(['python benchmarks/linear/bench_delta_cpu.py'] + argv_list)}`\n\n")
            f.write("\n".join(LINES) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
