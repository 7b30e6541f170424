"""CPU benchmark of linear attention against the natural chunked PyTorch form (chunk 64,
reference.chunked, autograd backward), measured in the same run and reported as ratios.

    python benchmarks/linear/bench_cpu.py [--quick] [--out benchmarks/results/linear-cpu.md]

Sections:
1. (B1, H8, S4096, D64), elu, fp32 and bf16: causal fwd, causal fwd+bwd, non-causal fwd+bwd
   (the peer then is the two-matmul form phi(Q) (phi(K)^T V)). GFLOP/s from the one shared
   linear_flops() of benchmarks/common.py, read against the measured fp32 matmul ceiling.
2. Linear scaling: time(S=65536) / time(S=8192), causal fwd+bwd, ours.
3. Crossover: the first S where causal linear attention beats our fused causal softmax
   (ae.attention) at D=64 and D=128.
4. Recurrent step (B16, H16, M=Dv=64, fp32, one token, in place): linear_attention_step, the
   linear_step op alone and the PyTorch form, each against a copy of the state's bytes (state
   bandwidth = S read once and written once).
Without the compiled linear op, our rows print "op not built" and the peer still runs.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import cpu_model, interleaved, linear_flops, machine_line, matmul_ceiling  # noqa: E402

import attention_ext as ae  # noqa: E402
from attention_ext.linear import LinearAttentionState, linear_attention_step, ops, reference  # noqa: E402

HAS_OP = ops.has_kernel(torch.device("cpu"))
NOT_BUILT = "op not built"
LINES = []


def emit(line=""):
    print(line, flush=True)
    LINES.append(line)


def backward(out, dout, *leaves):
    """A training step's backward: the grads start as None, as after optimizer.zero_grad() (whose
    default is set_to_none=True), so autograd hands over the op's gradients instead of adding
    them into the previous rep's (a 3 x (B, H, S, D) read-modify-write that is not the op's)."""
    for t in leaves:
        t.grad = None
    out.backward(dout)


def ours_fn(q, k, v, causal, grad, dout=None):
    def run():
        out = ae.linear_attention(q, k, v, causal=causal, feature_map="elu")
        if grad:
            backward(out, dout, q, k, v)
    return run


def peer_fn(q, k, v, causal, grad, dout=None):
    def run():
        out = reference.chunked(q, k, v, causal=causal, feature_map=1, chunk=64)
        if grad:
            backward(out, dout, q, k, v)
    return run


def compare(label, b, h, s, d, dtype, causal, grad, reps, ceil):
    q, k, v = (torch.randn(b, h, s, d, dtype=dtype, requires_grad=grad) for _ in range(3))
    dout = torch.randn(b, h, s, d, dtype=dtype) if grad else None
    fns = {"peer": peer_fn(q, k, v, causal, grad, dout)}
    if HAS_OP:
        fns["ours"] = ours_fn(q, k, v, causal, grad, dout)
    with torch.set_grad_enabled(grad):
        t = interleaved(fns, reps=reps)
    fl = linear_flops(b, h, s, d, d, mode="fwd_bwd" if grad else "fwd")
    dt = str(dtype).replace("torch.", "")
    peer = f"{fl / t['peer'] / 1e9:7.1f} ({t['peer'] * 1e3:7.1f} ms)"
    if HAS_OP:
        ours = f"{fl / t['ours'] / 1e9:7.1f} ({fl / t['ours'] / ceil:4.0%}, {t['ours'] * 1e3:7.1f} ms)"
        ratio = f"{t['peer'] / t['ours']:5.2f}x"
    else:
        ours, ratio = NOT_BUILT, "-"
    emit(f"| {label:<16} | {str((b, h, s, d)):<18} | {dt:<8} | {ours} | {peer} | {ratio} |")


def scaling(reps, quick):
    if not HAS_OP:
        emit(f"Linear scaling: {NOT_BUILT}")
        return
    h = 1 if quick else 8
    times = {}
    for s in (8192, 65536):
        q, k, v = (torch.randn(1, h, s, 64, requires_grad=True) for _ in range(3))
        dout = torch.randn(1, h, s, 64)
        times[s] = interleaved({"ours": ours_fn(q, k, v, True, True, dout)}, reps=reps)["ours"]
    emit(f"Linear scaling (causal fwd+bwd, B1 H{h} D64 fp32): time(65536) / time(8192) = "
         f"{times[65536] / times[8192]:.2f} (linear: 8; target <= 9); {times[8192] * 1e3:.1f} ms / "
         f"{times[65536] * 1e3:.1f} ms")


def crossover(reps, quick):
    if not HAS_OP:
        emit(f"Crossover against ae.attention (causal): {NOT_BUILT}")
        return
    lengths = [64, 128, 256, 512, 1024, 2048, 4096] + ([] if quick else [8192])
    modes = [False] if quick else [False, True]
    for d in (64, 128):
        for grad in modes:
            found, cells = None, []
            for s in lengths:
                q, k, v = (torch.randn(1, 8, s, d, requires_grad=grad) for _ in range(3))
                dout = torch.randn(1, 8, s, d) if grad else None

                def softmax():
                    out = ae.attention(q, k, v, causal=True)
                    if grad:
                        backward(out, dout, q, k, v)
                with torch.set_grad_enabled(grad):
                    t = interleaved({"linear": ours_fn(q, k, v, True, grad, dout), "softmax": softmax}, reps=reps)
                cells.append(f"{s}: {t['softmax'] / t['linear']:.2f}x")
                if found is None and t["linear"] < t["softmax"]:
                    found = s
            what = "fwd+bwd" if grad else "fwd"
            emit(f"Crossover D={d} {what} (B1 H8, fp32; softmax time / linear time): {', '.join(cells)}; "
                 f"linear faster from S = {found if found else '> ' + str(lengths[-1])}")


def step_bandwidth(reps):
    """One decode step (T = 1) in place, three ways, timed against a copy of the state's bytes:
    linear_attention_step (the functional API, on the linear_step op when built), the op alone
    (the functional layer's Python cost is the difference) and the PyTorch form
    (reference.linear_step, in place: what the functional layer ran before the op). The state
    bytes are S's read once and written once (z, 1/64 of S here, is left out)."""
    b, h, m, dv = 16, 16, 64, 64
    state = LinearAttentionState(torch.randn(b, h, m, dv), torch.rand(b, h, m))
    q, k, v = (torch.randn(b, h, 1, m) for _ in range(3))
    src, dst = torch.randn(b, h, m, dv), torch.empty(b, h, m, dv)
    fns = {"step": lambda: linear_attention_step(q, k, v, state, inplace=True),
           "pytorch": lambda: reference.linear_step(q, k, v, state.S, state.z, feature_map=1),
           "copy": lambda: dst.copy_(src)}
    if ops.has_step_kernel(torch.device("cpu"), torch.float32):
        fns["op"] = lambda: ops.step(q, k, v, state.S, state.z, feature_map=1)
    with torch.no_grad():
        t = interleaved(fns, reps=max(reps, 20) * 5)
    nbytes = 2 * state.S.numel() * 4  # read once, written once
    emit(f"Recurrent step (B16 H16 M=Dv=64 fp32, T=1, in place, state {state.S.numel() * 4 / 2**20:.0f} MiB; "
         f"copy {nbytes / t['copy'] / 1e9:.1f} GB/s, {t['copy'] * 1e6:.0f} us):")
    for name, what in (("step", "linear_attention_step"), ("op", "torch.ops.attention_ext.linear_step"),
                       ("pytorch", "PyTorch form (reference.linear_step)")):
        if name not in t:
            emit(f"  {what}: {NOT_BUILT}")
            continue
        emit(f"  {what}: {nbytes / t[name] / 1e9:.1f} GB/s over the state's bytes, {t['copy'] / t[name]:.0%} of copy "
             f"bandwidth (target >= 50%); {t[name] * 1e6:.0f} us")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer reps and sizes: under a minute")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the markdown report here")
    ap.add_argument("--step-only", action="store_true", help="only section 4, the recurrent step")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    reps = 1 if args.quick else args.reps
    warnings.simplefilter("ignore", RuntimeWarning)
    if args.step_only:
        emit(f"CPU: {cpu_model()}; {machine_line(torch.get_num_threads())}")
        step_bandwidth(reps)
        _write(args)
        return 0
    ceil = matmul_ceiling(torch.float32, n=1024 if args.quick else 2048)
    emit(f"CPU: {cpu_model()}; {machine_line(torch.get_num_threads())}; fp32 matmul ceiling {ceil / 1e9:.1f} GFLOP/s; linear op "
         f"{'built' if HAS_OP else 'NOT built (ours columns empty)'}")
    emit()
    emit("| case | (B, H, S, D) | dtype | ours GFLOP/s (of fp32 matmul, time) | peer GFLOP/s (time) | "
         "ours / peer |")
    emit("|---|---|---|---|---|---|")
    b, h, s, d = 1, 8, 4096, 64
    for dtype in (torch.float32, torch.bfloat16):
        compare("causal fwd", b, h, s, d, dtype, True, False, reps, ceil)
        compare("causal fwd+bwd", b, h, s, d, dtype, True, True, reps, ceil)
        compare("non-causal fwd+bwd", b, h, s, d, dtype, False, True, reps, ceil)
    emit()
    emit("Peer: reference.chunked (chunk 64; causal: per-chunk phi(K)^T V, exclusive cumsums, intra-chunk tril; "
         "non-causal: two matmuls), autograd backward. GFLOP/s: linear_flops() = 4*B*H*S*M*(Dv+1) forward, 3x "
         "forward+backward. Ratios > 1: ours faster.")
    emit()
    scaling(reps, args.quick)
    crossover(reps, args.quick)
    step_bandwidth(reps)
    _write(args)
    return 0


def _write(args):
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# Linear attention CPU benchmark, {datetime.date.today()}\n\n")
            cmd = " ".join(["python benchmarks/linear/bench_cpu.py"] + args.argv)
            f.write(f"Command: `{cmd}`\n\n")
            f.write("\n".join(LINES) + "\n")


if __name__ == "__main__":
    sys.exit(main())
