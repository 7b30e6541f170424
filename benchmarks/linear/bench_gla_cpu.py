"""CPU benchmark of linear attention with GLA's per-feature gates (ae.linear_attention with a
(B, H, S, M) decay) against the chunked PyTorch form a user writes (gla_chunked below: the GLA
paper's chunk form, autograd backward), timed in the same run, beside the fp32 FMA peak.

    python benchmarks/linear/bench_gla_cpu.py [--quick] [--step-only] [--out benchmarks/results/<file>.md]

(B1, H8, S4096, M = V = 128), fp32 and bf16, causal, unnormalized (GLA's form), identity feature
map on features given (the peer's inputs): forward and forward+backward. GFLOP/s count the
recurrence's work, 4 M V flops per token forward (S = a S, S += k v^T, o = S^T q), against the
fp32 FMA peak. Then the decode step (linear_attention_step with (B, H, 1, M) gates, in place)
against the same update in PyTorch in place and against the per-head gates' step, beside a copy
of the state's bytes.
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
from common import cpu_peak_flops, interleaved  # noqa: E402

import attention_ext as ae  # noqa: E402
from attention_ext.linear import delta  # noqa: E402

LINES = []


def emit(line=""):
    print(line, flush=True)
    LINES.append(line)


def gla_chunked(q, k, v, g, chunk=64):
    """GLA's chunk form in PyTorch (the peer): within a chunk the gates enter as q * exp(G) and
    k * exp(-G) (G the cumulative log-gate from the chunk start), across chunks a (M, V) state per
    head. q, k, g (B, H, S, M), v (B, H, S, V), S a multiple of chunk; computed in q's dtype."""
    b, h, s, m = q.shape
    n = s // chunk
    q, k, g = (t.reshape(b, h, n, chunk, m) for t in (q, k, g))
    v = v.reshape(b, h, n, chunk, v.shape[-1])
    gc = g.cumsum(-2)
    qg, kg = q * gc.exp(), k * (-gc).exp()
    mask = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    a = (qg @ kg.transpose(-1, -2)).masked_fill(~mask, 0.0)
    o = a @ v  # (B, H, N, C, V) within each chunk
    kd = k * (gc[..., -1:, :] - gc).exp()  # to the chunk's end
    local = kd.transpose(-1, -2) @ v  # (B, H, N, M, V)
    total = gc[..., -1, :].exp()  # (B, H, N, M)
    state = q.new_zeros(b, h, m, v.shape[-1])
    inter = []
    for i in range(n):
        inter.append(qg[:, :, i] @ state)
        state = total[:, :, i].unsqueeze(-1) * state + local[:, :, i]
    return (o + torch.stack(inter, 2)).reshape(b, h, s, -1)


def compare(dtype, grad, reps, ceil, shape):
    b, h, s, m, dv = shape
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(b, h, s, m, generator=gen) * m ** -0.5 for _ in range(2))
    v = torch.randn(b, h, s, dv, generator=gen)
    gt = -0.1 * torch.rand(b, h, s, m, generator=gen)  # gates near 1, as GLA's log-sigmoid gives them
    leaves = [t.to(dtype).requires_grad_(grad) for t in (q, k, v)] + [gt.requires_grad_(grad)]
    dout = torch.randn(b, h, s, dv).to(dtype) if grad else None

    def runner(fn):
        def run():
            out = fn(*leaves)
            if grad:
                for t in leaves:
                    t.grad = None
                out.backward(dout)
        return run

    fns = {"peer": runner(lambda q, k, v, g: gla_chunked(q, k, v, g.to(dtype))),
           "ours": runner(lambda q, k, v, g: ae.linear_attention(q, k, v, causal=True, decay=g, feature_map="identity",
                                                                 normalize=False))}
    with torch.set_grad_enabled(grad):
        t = interleaved(fns, reps=reps)
    fl = 4.0 * b * h * s * m * dv
    rate = fl / t["ours"] / 1e9
    emit(f"| {'fwd+bwd' if grad else 'fwd':<7} | {str(dtype).replace('torch.', ''):<8} | {t['ours'] * 1e3:7.1f} | "
         f"{rate:6.1f} ({rate * 1e9 / ceil:4.0%}) | {t['peer'] * 1e3:7.1f} | {t['peer'] / t['ours']:5.2f}x |")


def step(reps):
    """One decode step (T = 1, B16 H16 M = V = 128 fp32, identity features) in place, state in
    memory: linear_attention_step with per-feature gates, unnormalized (GLA's form) and
    normalized; the PyTorch in-place update a user writes for GLA's step (S = exp(g) S + k v^T,
    o = S^T q: mul_, baddbmm_, matmul); the per-head gates' step (the linear_step op); a copy of the
    state's bytes. Each call reads and writes S (z is 1/128 of it)."""
    b, h, m, dv = 16, 16, 128, 128
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(b, h, 1, m, generator=gen) * m ** -0.5 for _ in range(2))
    v = torch.randn(b, h, 1, dv, generator=gen)
    gf, gh = -0.1 * torch.rand(b, h, 1, m, generator=gen), -0.1 * torch.rand(b, h, 1, generator=gen)
    st = {n: ae.LinearAttentionState(torch.randn(b, h, m, dv, generator=gen) * 0.1,
                                     torch.rand(b, h, m, generator=gen) if n == "norm" else None)
          for n in ("plain", "norm", "head", "torch")}
    S = st["torch"].S.view(b * h, m, dv)
    kk, vv, qq, ee = k.reshape(b * h, m, 1), v.reshape(b * h, 1, dv), q.reshape(b * h, 1, m), torch.empty(b * h, m, 1)

    def pytorch():
        torch.exp(gf.reshape(b * h, m, 1), out=ee)
        S.mul_(ee).baddbmm_(kk, vv)
        return torch.bmm(qq, S)

    src, dst = torch.randn(b, h, m, dv), torch.empty(b, h, m, dv)
    step_ = ae.linear_attention_step
    fns = {"plain": lambda: step_(q, k, v, st["plain"], decay_t=gf, feature_map="identity", normalize=False,
                                  inplace=True),
           "norm": lambda: step_(q, k, v, st["norm"], decay_t=gf, feature_map="identity", inplace=True),
           "torch": pytorch,
           "head": lambda: step_(q, k, v, st["head"], decay_t=gh, feature_map="identity", normalize=False,
                                 inplace=True),
           "copy": lambda: dst.copy_(src)}
    with torch.no_grad():
        t = interleaved(fns, reps=max(reps, 20) * 5)
    nbytes = 2 * b * h * m * dv * 4
    emit(f"Decode step (B16 H16 M=V=128 fp32, T=1, in place, state {nbytes / 2 / 2**20:.0f} MiB; copy "
         f"{nbytes / t['copy'] / 1e9:.1f} GB/s, {t['copy'] * 1e6:.0f} us):")
    emit()
    emit("| step | us | GB/s over S (of copy) | PyTorch in place / this |")
    emit("|---|---|---|---|")
    for name, what in (("plain", "per-feature gates, unnormalized"), ("norm", "per-feature gates, normalized"),
                       ("torch", "PyTorch in place (mul_, baddbmm_, bmm)"), ("head", "per-head gates, unnormalized")):
        emit(f"| {what} | {t[name] * 1e6:.0f} | {nbytes / t[name] / 1e9:.1f} ({t['copy'] / t[name]:.0%}) | "
             f"{t['torch'] / t[name]:.2f}x |")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="S = 1024 and one rep")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--step-only", action="store_true", help="only the decode step's table")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not delta.has_kernel(torch.device("cpu")):
        sys.exit("the delta-rule CPU kernel is not built")
    warnings.simplefilter("ignore", RuntimeWarning)
    reps = 1 if args.quick else args.reps
    ceil = cpu_peak_flops("fp32_fma")
    shape = (1, 8, 1024 if args.quick else 4096, 128, 128)
    emit(f"CPU: {platform.processor() or platform.machine()}, ISA level {ae.cpu_isa()}, {torch.get_num_threads()} "
         f"threads, torch {torch.__version__}; fp32 FMA peak {ceil / 1e9:.1f} GFLOP/s (cpu_peak_flops); "
         f"{datetime.date.today()}")
    emit()
    if not args.step_only:
        emit(f"(B, H, S, M, V) = {shape}, causal, unnormalized, identity features; peer: gla_chunked (chunk 64)")
        emit()
        emit("| pass | dtype | ours ms | ours GFLOP/s (of fp32 FMA peak) | peer ms | peer / ours |")
        emit("|---|---|---|---|---|---|")
        for dtype in (torch.float32, torch.bfloat16):
            for grad in (False, True):
                compare(dtype, grad, reps, ceil, shape)
        emit()
    step(reps)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
