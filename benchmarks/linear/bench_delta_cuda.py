"""The delta rule on the GPU: our two CUDA forwards (csrc/linear/cuda/delta_kernel.cuh, recurrent,
the state in registers; delta_chunk_kernel.cuh, chunk-parallel on the tensor cores, selected by
linear.set_cuda_kernels(delta_chunked=True)) against flash-linear-attention's Gated DeltaNet kernels (the fused recurrent
one, the same schedule, and the chunked one, its training kernel) and against the chunked
PyTorch form a user would write (reference.delta_rule_chunked), timed interleaved in the same run
with CUDA synchronization. Inference calls (no autograd): prefill, and the in-place step of
decode, whose cost is one read and one write of the state.

    python benchmarks/linear/bench_delta_cuda.py [--reps N] [--out FILE]

Gated DeltaNet (a per-head gate), L2-normalized q and k in the kernel, bf16 inputs, float32 state;
then Kimi Delta Attention (per-key gates) prefill against FLA's chunk_kda and fused_recurrent_kda, and
training (forward + backward) of both against FLA's chunked kernels.
FLA is optional (`pip install flash-linear-attention fla-core`; the device README says how its
wheels travel); without it those columns say so. The FMA rate counts 3 K V multiply-adds per
token and value head (p = h'^T k, the update, o = h^T q), against the float32 matmul ceiling
(attention_ext.bench.flop_ceiling; without TF32, cuBLAS runs it on the same FMA units).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from common import copy_bandwidth, interleaved  # noqa: E402

import attention_ext as ae  # noqa: E402
from attention_ext.linear import reference  # noqa: E402

# (B, H_k, H_v, S, K, V): Gated DeltaNet's shapes (Qwen3-Next: 16 q / k heads, 32 value heads, 128 wide)
CASES = [(4, 16, 16, 8192, 128, 128), (8, 16, 16, 2048, 128, 128), (1, 16, 32, 16384, 128, 128),
         (16, 8, 8, 1024, 64, 64)]
TRAIN_CASES = [(4, 16, 16, 8192, 128, 128), (4, 16, 16, 4096, 128, 128), (8, 16, 16, 2048, 128, 128)]
# Kimi Delta Attention (per-key gates), prefill: (B, H_k, H_v, S, K, V)
KDA_CASES = [(4, 16, 16, 8192, 128, 128), (8, 16, 16, 2048, 128, 128)]
# the in-place step, T = 1: (B, H_k, H_v, K, V)
STEP_CASES = [(8, 16, 32, 128, 128), (64, 16, 32, 128, 128), (256, 16, 32, 128, 128)]


def fla_fns():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def fla_kda_fns():
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except ImportError:
        return None
    return chunk_kda, fused_recurrent_kda


def inputs(b, hk, hv, s, kd, vd):
    torch.manual_seed(0)
    q = torch.randn(b, s, hk, kd, device="cuda", dtype=torch.bfloat16)  # (B, S, H, D): FLA's layout
    k = torch.randn(b, s, hk, kd, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, s, hv, vd, device="cuda", dtype=torch.bfloat16)
    beta = torch.rand(b, hv, s, device="cuda", dtype=torch.float32)
    g = -torch.rand(b, hv, s, device="cuda", dtype=torch.float32) * 0.1
    return q, k, v, beta, g


def flush(lines, out) -> None:
    """Print the newest row, and rewrite the markdown file with every row so far (a stage's time
    limit then still leaves the rows it reached)."""
    print(lines[-1], flush=True)
    if out:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")


def selected(chunked: bool, fn):
    """fn under the delta_chunked selection `chunked` (process-wide: set around each call, so that
    the interleaved timing can alternate the two)."""
    def run():
        old = ae.linear.set_cuda_kernels(**{**ae.linear.cuda_kernels(), "delta_chunked": chunked})
        try:
            return fn()
        finally:
            ae.linear.set_cuda_kernels(**old)
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", help="write the markdown table here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_delta_cuda.py needs a CUDA device")
        return 1
    fla = fla_fns()
    from attention_ext.bench import flop_ceiling
    fma, _ = flop_ceiling(torch.float32, "cuda")  # cuBLAS float32 without TF32: the FMA units
    lines = [f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; FLA: "
             f"{'gated_delta_rule' if fla else 'not installed'}; float32 matmul ceiling {fma / 1e12:.0f} TFLOP/s", "",
             "Prefill (no autograd), Gated DeltaNet, bf16 inputs:", "",
             "| (B, H_k, H_v, S, K, V) | ours ms | ours TFLOP/s (of the float32 matmul) | x FLA fused recurrent | x FLA chunk "
             "| x PyTorch chunked | ours chunked ms | chunked x recurrent | chunked x FLA chunk |",
             "|---|---|---|---|---|---|---|---|---|"]
    with torch.no_grad():
        for b, hk, hv, s, kd, vd in CASES:
            q, k, v, beta, g = inputs(b, hk, hv, s, kd, vd)
            rep = hv // hk
            call = lambda: ae.delta_rule_attention(q, k, v, beta, gate=g, qk_l2norm=True, layout="bshd")  # noqa: E731
            fns = {"ours": selected(False, call), "chunked": selected(True, call)}
            if fla is not None:
                chunk, fused = fla
                qf, kf = (t.repeat_interleave(rep, dim=2) if rep > 1 else t for t in (q, k))
                bt, gt = beta.transpose(1, 2).contiguous(), g.transpose(1, 2).contiguous()
                fns["fla_rec"] = lambda: fused(qf, kf, v, g=gt, beta=bt, use_qk_l2norm_in_kernel=True)
                fns["fla_chunk"] = lambda: chunk(qf, kf, v, g=gt, beta=bt, use_qk_l2norm_in_kernel=True)
            if s <= 4096:  # the Python loop over chunks: slow at long S, and it holds every chunk
                qh, kh = (reference._l2n(t.transpose(1, 2).float().repeat_interleave(rep, dim=1)) for t in (q, k))
                vh = v.transpose(1, 2).float()
                fns["torch"] = lambda: reference.delta_rule_chunked(qh, kh, vh, beta, g)
            t = interleaved(fns, reps=args.reps, sync=torch.cuda.synchronize)
            fl = 2 * 3 * b * hv * s * kd * vd
            cols = [f"{t[n] / t['ours']:.2f}x" if n in t else "-" for n in ("fla_rec", "fla_chunk", "torch")]
            cols += [f"{t['chunked'] * 1e3:.3f}", f"{t['ours'] / t['chunked']:.2f}x",
                     f"{t['fla_chunk'] / t['chunked']:.2f}x" if "fla_chunk" in t else "-"]
            lines.append(f"| {(b, hk, hv, s, kd, vd)} | {t['ours'] * 1e3:.3f} | {fl / t['ours'] / 1e12:.1f} "
                         f"({fl / t['ours'] / fma:.0%}) | " + " | ".join(cols) + " |")
            flush(lines, args.out)

    # KDA prefill: the per-key gates' chunk kernels (delta_chunk_prep_key_kernel) against the
    # recurrent kernel and FLA's KDA kernels
    kda = fla_kda_fns()
    lines += ["", f"Prefill (no autograd), Kimi Delta Attention (per-key gates), bf16 inputs; FLA: "
              f"{'kda' if kda else 'not installed'}:", "",
              "| (B, H_k, H_v, S, K, V) | ours recurrent ms | ours chunked ms | chunked x recurrent | "
              "chunked x FLA chunk_kda | chunked x FLA fused_recurrent_kda |", "|---|---|---|---|---|---|"]
    with torch.no_grad():
        for b, hk, hv, s, kd, vd in KDA_CASES:
            q, k, v, beta, _ = inputs(b, hk, hv, s, kd, vd)
            gk = -torch.rand(b, hv, s, kd, device="cuda", dtype=torch.float32) * 0.1
            call = lambda: ae.delta_rule_attention(q, k, v, beta, gate=gk, qk_l2norm=True, layout="bshd")  # noqa: E731
            fns = {"ours": selected(False, call), "chunked": selected(True, call)}
            if kda is not None:
                rep = hv // hk
                qf, kf = (t.repeat_interleave(rep, dim=2) if rep > 1 else t for t in (q, k))
                bt, gt = beta.transpose(1, 2).contiguous(), gk.transpose(1, 2).contiguous()
                fns["fla_chunk"] = lambda: kda[0](qf, kf, v, gt, bt, use_qk_l2norm_in_kernel=True)
                fns["fla_rec"] = lambda: kda[1](qf, kf, v, gt, bt, use_qk_l2norm_in_kernel=True)
            t = interleaved(fns, reps=args.reps, sync=torch.cuda.synchronize)
            vs = [f"{t[n] / t['chunked']:.2f}x" if n in t else "-" for n in ("fla_chunk", "fla_rec")]
            lines.append(f"| {(b, hk, hv, s, kd, vd)} | {t['ours'] * 1e3:.3f} | {t['chunked'] * 1e3:.3f} | "
                         f"{t['ours'] / t['chunked']:.2f}x | {vs[0]} | {vs[1]} |")
            flush(lines, args.out)

    # training: by default PyTorch's chunked WY form (autograd); with delta_chunked=True the chunk
    # kernels forward and backward; Gated DeltaNet against FLA's chunk_gated_delta_rule, KDA (per-key
    # gates) against its chunk_kda
    for model, per_key in (("Gated DeltaNet", False), ("KDA (per-key gates)", True)):
        peer = "chunk_kda" if per_key else "chunk"
        lines += ["", f"Training (forward + backward), {model}, bf16 inputs: 'WY' is the default (PyTorch's "
                  "chunked WY form under autograd), 'chunked' the chunk kernels forward and backward "
                  "(delta_chunked=True):", "",
                  f"| (B, H_k, H_v, S, K, V) | WY ms | chunked ms | chunked x WY | WY x FLA {peer} | "
                  f"chunked x FLA {peer} |", "|---|---|---|---|---|---|"]
        for b, hk, hv, s, kd, vd in TRAIN_CASES:
            q, k, v, beta, g = inputs(b, hk, hv, s, kd, vd)
            if per_key:
                g = -torch.rand(b, hv, s, kd, device="cuda", dtype=torch.float32) * 0.1
            leaves = [t.requires_grad_() for t in (q, k, v, beta, g)]
            dout = torch.randn_like(v)

            def ours():
                out = ae.delta_rule_attention(q, k, v, beta, gate=g, qk_l2norm=True, layout="bshd")
                torch.autograd.grad(out, leaves, dout)
            fns = {"chunked": selected(True, ours)}
            if s <= (2048 if per_key else 4096):  # the WY form's Python loop over chunks: slow at long S
                fns["ours"] = selected(False, ours)
            fla_train = kda[0] if per_key and kda is not None else (fla[0] if not per_key and fla is not None else None)
            if fla_train is not None:
                rep = hv // hk
                qf, kf = (t.repeat_interleave(rep, dim=2) if rep > 1 else t for t in (q, k))
                bt, gt = beta.transpose(1, 2), g.transpose(1, 2)

                def fla_chunk():
                    if per_key:
                        out = fla_train(qf, kf, v, gt, bt, use_qk_l2norm_in_kernel=True)[0]
                    else:
                        out = fla_train(qf, kf, v, g=gt, beta=bt, use_qk_l2norm_in_kernel=True)[0]
                    torch.autograd.grad(out, leaves, dout)
                fns["fla_chunk"] = fla_chunk
            t = interleaved(fns, reps=args.reps, sync=torch.cuda.synchronize)
            vs = [f"{t['fla_chunk'] / t[n]:.2f}x" if "fla_chunk" in t and n in t else "-" for n in ("ours", "chunked")]
            wy = f"{t['ours'] * 1e3:.2f}" if "ours" in t else "-"
            wy_x = f"{t['ours'] / t['chunked']:.2f}x" if "ours" in t else "-"
            lines.append(f"| {(b, hk, hv, s, kd, vd)} | {wy} | {t['chunked'] * 1e3:.2f} | {wy_x} | {vs[0]} | "
                         f"{vs[1]} |")
            flush(lines, args.out)

    with torch.no_grad():
        bw = copy_bandwidth(device="cuda")
        lines += ["", f"The in-place step (decode), T = 1; copy bandwidth {bw / 1e9:.0f} GB/s (read + write):", "",
                  "| (B, H_k, H_v, K, V) | state MB | ours us | ours GB/s (% of copy) | x FLA fused recurrent |",
                  "|---|---|---|---|---|"]
        for b, hk, hv, kd, vd in STEP_CASES:
            q, k, v, beta, g = inputs(b, hk, hv, 1, kd, vd)
            qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
            state = torch.randn(b, hv, kd, vd, device="cuda") * 0.1
            fns = {"ours": lambda: ae.delta_rule_step(qs, ks, vs, beta, state, gate=g, qk_l2norm=True, inplace=True)}
            if fla is not None:
                fused = fla[1]
                rep = hv // hk
                qf, kf = (t.repeat_interleave(rep, dim=2) if rep > 1 else t for t in (q, k))
                bt, gt = beta.transpose(1, 2).contiguous(), g.transpose(1, 2).contiguous()
                st2 = state.clone()
                fns["fla_rec"] = lambda: fused(qf, kf, v, g=gt, beta=bt, initial_state=st2, output_final_state=True,
                                               use_qk_l2norm_in_kernel=True)
            t = interleaved(fns, reps=args.reps, sync=torch.cuda.synchronize)
            nbytes = 2 * state.numel() * 4
            vs_fla = f"{t['fla_rec'] / t['ours']:.2f}x" if "fla_rec" in t else "-"
            lines.append(f"| {(b, hk, hv, kd, vd)} | {state.numel() * 4 / 1e6:.0f} | {t['ours'] * 1e6:.1f} | "
                         f"{nbytes / t['ours'] / 1e9:.0f} ({nbytes / t['ours'] / bw:.0%}) | {vs_fla} |")
            flush(lines, args.out)
    text = "\n".join(lines) + "\n\nRatios > 1: ours faster. Command: python benchmarks/linear/bench_delta_cuda.py\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
