"""CUDA fused attention vs torch SDPA (flash and cuDNN backends), bf16, in one run.

    python benchmarks/softmax/bench_cuda.py [--quick] [--md results.md]
    python benchmarks/softmax/bench_cuda.py --ref     # the reference shape of docs/design/hopper-fwd-notes.md
    python benchmarks/softmax/bench_cuda.py --options [--md results.md]   # fp16, deterministic, masks ... (appends)
    python benchmarks/softmax/bench_cuda.py --decode [--md results.md]    # decode steps, split-KV (appends)
    python benchmarks/softmax/bench_cuda.py --tune    # a -DATTN_TUNING build: every candidate vs SDPA flash

(B, S, H, D) storage viewed as (B, H, S, D) for every contender; H = 16, B * S = 32k tokens
(B * H * S = 16k * 32), D in {64, 128}, S in {1k .. 16k}, causal (top-left) and not.
TFLOP/s from benchmarks/common.flops() (forward 4 * B * H * D * allowed pairs, backward 2.5x);
the backward is timed alone (dQ, dK, dV from saved out / LSE). Times are medians of CUDA-event
timings after warm-up. The ceiling is a measured 8192^3 bf16 matmul.

"ours" in the first table is the mma.sync kernels (set_cuda_kernels(hopper_fwd=0, hopper_bwd=0):
the default on sm_80, and on sm_90 for what the wgmma kernels do not take). "ours-hopper" is the
sm_90a wgmma forward (hopper_fwd=1, the default on sm_90), timed on the same inputs when the GPU is
sm_90 and the build has it; its own table gives it against SDPA flash and cuDNN, with the largest
|difference| from the mma.sync output as a sanity check (a broken kernel must not post a time).

"hopper-bwd" is the sm_90a wgmma backward (hopper_bwd=1, the default on sm_90; forward on mma.sync), timed on
the same saved out / LSE as the mma.sync backward; its own table gives it against the mma.sync
backward, SDPA flash and cuDNN, with the largest |difference| of dQ, dK, dV from the mma.sync
backward's.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import cuda_time, flops  # noqa: E402

from attention_ext.softmax import ops  # noqa: E402

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # pragma: no cover
    SDPBackend = sdpa_kernel = None


def matmul_ceiling():
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2.0 * n ** 3 / cuda_time(lambda: a @ b, warmup=3, reps=10)


@contextlib.contextmanager
def kernels(**fields):
    """The CUDA kernel selection (ops.set_cuda_kernels) with `fields` changed, for the calls inside."""
    old = ops.set_cuda_kernels(**{**ops.cuda_kernels(), **fields})
    try:
        yield
    finally:
        ops.set_cuda_kernels(**old)


def hopper_env(mode):
    """The sm_90a wgmma forward: mode 0 off (mma.sync), 1 on (the default), 2 on also for softcap
    and ALiBi."""
    return kernels(hopper_fwd=mode)


def hopper_bwd_env(mode):
    """The sm_90a wgmma backward: mode 0 off (mma.sync), 1 on (the default)."""
    return kernels(hopper_bwd=mode)


def hopper_available():
    """Does hopper_fwd=1 reach the sm_90a kernel here (sm_90 GPU, build with sm_90a)?"""
    from torch.profiler import ProfilerActivity, profile

    q = torch.randn(1, 2, 256, 128, device="cuda", dtype=torch.bfloat16)
    with hopper_env(1), profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.ops.attention_ext.softmax_fwd(q, q, q, *options(128, False))
        torch.cuda.synchronize()
    return any("hopper" in e.name for e in prof.events())


def hopper_bwd_available():
    """Does hopper_bwd=1 reach the sm_90a backward kernel here?"""
    from torch.profiler import ProfilerActivity, profile

    q = torch.randn(1, 2, 256, 128, device="cuda", dtype=torch.bfloat16)
    args = options(128, False)
    with hopper_env(0):
        out, lse = torch.ops.attention_ext.softmax_fwd(q, q, q, *args)
    with hopper_env(0), hopper_bwd_env(1), profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.ops.attention_ext.softmax_bwd(q, q, q, q, out, lse, *args, False, False)
        torch.cuda.synchronize()
    return any("hopper" in e.name and "bwd_kernel" in e.name for e in prof.events())


def max_grad_diff(a, b):
    """Largest |difference| over dQ, dK, dV of two backward results."""
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a[:3], b[:3]))


def options(d, causal):
    o = dict(bias=None, alibi_slopes=None, sinks=None, seqlens_k=None, cu_seqlens_q=None, cu_seqlens_k=None,
             max_seqlen_q=0, max_seqlen_k=0, scale=1.0 / math.sqrt(d), softcap=0.0, window_left=-1,
             window_right=0 if causal else -1, bottom_right=False, dropout_p=0.0, seed=0, offset=0,
             rng_state=None)
    o.update({k: v for k, v in ops._OPTION_DEFAULTS.items() if k not in o})  # dense, no top-k
    return [o[n] for n in ops.OPTION_NAMES]


def sdpa_backend_fns(backend, q, k, v, dout, causal=False, **kw):
    """(fwd, bwd) closures for one SDPA backend, or None when it refuses the inputs. kw: further
    SDPA arguments (attn_mask, dropout_p, enable_gqa, ...)."""
    if sdpa_kernel is None or backend is None:
        return None
    kw.setdefault("is_causal", causal)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    try:
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(qg, kg, vg, **kw)
            torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True)
    except (RuntimeError, TypeError):
        return None

    def fwd():
        with sdpa_kernel([backend]), torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, **kw)

    def bwd():
        torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True)

    return fwd, bwd


def run(quick=False, deterministic=False):
    torch.manual_seed(0)
    ceiling = matmul_ceiling()
    has_hopper = hopper_available()
    if not has_hopper:
        print("ours-hopper: not available here (needs an sm_90 GPU and a build with sm_90a)", flush=True)
    has_hopper_bwd = hopper_bwd_available()
    if not has_hopper_bwd:
        print("hopper-bwd: not available here (needs an sm_90 GPU and a build with sm_90a)", flush=True)
    rows = []
    seqs = [1024, 4096] if quick else [1024, 2048, 4096, 8192, 16384]
    for d in (64, 128):
        for causal in (False, True):
            for s in seqs:
                h = 16
                b = max(1, 32768 // s)
                mk = lambda: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                q, k, v, dout = mk(), mk(), mk(), mk()
                args = options(d, causal)
                out, lse = torch.ops.attention_ext.softmax_fwd(q, k, v, *args)
                ours_fwd = lambda: torch.ops.attention_ext.softmax_fwd(q, k, v, *args)
                ours_bwd = lambda: torch.ops.attention_ext.softmax_bwd(dout, q, k, v, out, lse, *args, False, deterministic)
                f_fwd = flops(b, h, s, s, d, causal=causal, mode="fwd")
                f_bwd = flops(b, h, s, s, d, causal=causal, mode="bwd")
                row = dict(d=d, s=s, b=b, h=h, causal=causal)
                with hopper_env(0), hopper_bwd_env(0):
                    row["ours_fwd"] = f_fwd / cuda_time(ours_fwd) / 1e12
                    row["ours_bwd"] = f_bwd / cuda_time(ours_bwd) / 1e12
                    grads_ref = ours_bwd() if has_hopper_bwd else None
                row["hopper_bwd"] = row["hopper_bwd_diff"] = float("nan")
                if has_hopper_bwd:
                    with hopper_env(0), hopper_bwd_env(1):
                        row["hopper_bwd_diff"] = max_grad_diff(ours_bwd(), grads_ref)
                        row["hopper_bwd"] = f_bwd / cuda_time(ours_bwd) / 1e12
                del grads_ref
                for key, mode in (("hopper", 1),):
                    row[key + "_fwd"] = row[key + "_diff"] = float("nan")
                    if has_hopper:
                        with hopper_env(mode):
                            out_h, _ = ours_fwd()
                            row[key + "_diff"] = (out_h.float() - out.float()).abs().max().item()
                            row[key + "_fwd"] = f_fwd / cuda_time(ours_fwd) / 1e12
                        del out_h
                for name, backend in (("flash", getattr(SDPBackend, "FLASH_ATTENTION", None)),
                                      ("cudnn", getattr(SDPBackend, "CUDNN_ATTENTION", None))):
                    fns = sdpa_backend_fns(backend, q, k, v, dout, causal) if backend is not None else None
                    if fns is None:
                        row[name + "_fwd"] = row[name + "_bwd"] = float("nan")
                        continue
                    row[name + "_fwd"] = f_fwd / cuda_time(fns[0]) / 1e12
                    row[name + "_bwd"] = f_bwd / cuda_time(fns[1]) / 1e12
                rows.append(row)
                print(f"d={d} s={s} causal={causal}: fwd {row['ours_fwd']:.0f} (hopper {row['hopper_fwd']:.0f}) "
                      f"vs flash {row['flash_fwd']:.0f} cudnn {row['cudnn_fwd']:.0f} | bwd {row['ours_bwd']:.0f} "
                      f"(hopper {row['hopper_bwd']:.0f}) "
                      f"vs flash {row['flash_bwd']:.0f} cudnn {row['cudnn_bwd']:.0f} TFLOP/s", flush=True)
                del q, k, v, dout, out, lse
                torch.cuda.empty_cache()
    return ceiling, rows


def parse_variants(spec):
    """'0-6' or '0,3,5' -> [0, ..., 6] / [0, 3, 5]."""
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def tune(fwd_variants, bwd_variants):
    """Time the candidates compiled with -DATTN_TUNING (set_cuda_kernels' tune_fwd / tune_bwd = v;
    0 = the default) against SDPA flash in the same run: bf16, H = 16, B * S = 32k, D 64 / 128,
    S 1k / 4k / 8k, causal and not. Prints one table per direction: flash TFLOP/s, then each
    variant's ratio to flash ("!" after it: its output moved by more than 2% of the output's
    largest magnitude from variant 0's, so its time does not count), and last the geometric mean
    ratio of every variant over all rows."""
    torch.manual_seed(0)
    ops.set_cuda_kernels(hopper_fwd=0)
    res = {"fwd": [], "bwd": []}
    for d in (64, 128):
        for causal in (False, True):
            for s in (1024, 4096, 8192):
                h, b = 16, max(1, 32768 // s)
                mk = lambda: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                q, k, v, dout = mk(), mk(), mk(), mk()
                args = options(d, causal)
                ops.set_cuda_kernels()
                out, lse = torch.ops.attention_ext.softmax_fwd(q, k, v, *args)
                f_fwd = flops(b, h, s, s, d, causal=causal, mode="fwd")
                f_bwd = flops(b, h, s, s, d, causal=causal, mode="bwd")
                fns = sdpa_backend_fns(SDPBackend.FLASH_ATTENTION, q, k, v, dout, causal) if sdpa_kernel else None
                row = {"key": (d, s, causal)}
                row_f, row_b = dict(row), dict(row)
                row_f["flash"] = f_fwd / cuda_time(fns[0]) / 1e12 if fns else float("nan")
                row_b["flash"] = f_bwd / cuda_time(fns[1]) / 1e12 if fns else float("nan")
                ref_f, ref_b, g, o = out, None, None, None
                for var in fwd_variants:
                    ops.set_cuda_kernels(tune_fwd=var)
                    o, _ = torch.ops.attention_ext.softmax_fwd(q, k, v, *args)
                    bad = (o.float() - ref_f.float()).abs().max().item() > 0.02 * ref_f.float().abs().max().item()
                    row_f[var] = (f_fwd / cuda_time(lambda: torch.ops.attention_ext.softmax_fwd(q, k, v, *args)) / 1e12, bad)
                ops.set_cuda_kernels()
                bwd = lambda: torch.ops.attention_ext.softmax_bwd(dout, q, k, v, out, lse, *args, False, False)
                for var in bwd_variants:
                    ops.set_cuda_kernels(tune_bwd=var)
                    g = [t.float() for t in bwd()[:3]]  # dq, dk, dv
                    if ref_b is None:
                        ref_b = g
                    bad = any((x - r).abs().max().item() > 0.02 * r.abs().max().item() for x, r in zip(g, ref_b))
                    row_b[var] = (f_bwd / cuda_time(bwd) / 1e12, bad)
                ops.set_cuda_kernels()
                res["fwd"].append(row_f)
                res["bwd"].append(row_b)
                first = lambda r, vs: f"v{vs[0]} {r[vs[0]][0]:.0f}" if vs else ""
                print(f"tune d={d} s={s} causal={int(causal)}: fwd flash {row_f['flash']:.0f} {first(row_f, fwd_variants)}, "
                      f"bwd flash {row_b['flash']:.0f} {first(row_b, bwd_variants)} TFLOP/s", flush=True)
                del q, k, v, dout, out, lse, ref_f, ref_b, g, o
                torch.cuda.empty_cache()
    for kind, variants in (("fwd", fwd_variants), ("bwd", bwd_variants)):
        print(f"\n{kind}: SDPA flash TFLOP/s, then ours / flash per tune_{kind} variant (v0 = default)")
        print("| D | S | c | flash | " + " | ".join(f"v{v}" for v in variants) + " | best |")
        print("|---|---|---|---|" + "---|" * (len(variants) + 1))
        logs = {v: [] for v in variants}
        for r in res[kind]:
            d, s, causal = r["key"]
            cells, best = [], (0.0, None)
            for v in variants:
                tf, bad = r[v]
                ratio = tf / r["flash"]
                cells.append(f"{ratio:.2f}{'!' if bad else ''}")
                if not bad:
                    logs[v].append(math.log(ratio))
                    best = max(best, (ratio, v))
            print(f"| {d} | {s} | {int(causal)} | {r['flash']:.0f} | " + " | ".join(cells) + f" | v{best[1]} |")
        gm = " | ".join(f"{math.exp(sum(x) / len(x)):.3f}" if len(x) == len(res[kind]) else "bad"
                        for x in logs.values())
        print(f"| geomean | | | | {gm} | |")


def ratio(a, b):
    """a / b to two decimals, or n/a where either is missing (NaN) or b is not positive."""
    return f"{a / b:.2f}" if a == a and b == b and b > 0 else "n/a"


def table(ceiling, rows, gpu):
    head = (f"GPU: {gpu}; bf16 matmul ceiling (8192^3): {ceiling / 1e12:.0f} TFLOP/s\n\n"
            "| D | S | causal | fwd ours | fwd flash | x flash | fwd cudnn | x cudnn | fwd % ceil "
            "| bwd ours | bwd flash | x flash | bwd cudnn | x cudnn | bwd % ceil |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        lines.append(
            f"| {r['d']} | {r['s']} | {'yes' if r['causal'] else 'no'} | {r['ours_fwd']:.0f} | {r['flash_fwd']:.0f} | "
            f"{ratio(r['ours_fwd'], r['flash_fwd'])} | {r['cudnn_fwd']:.0f} | {ratio(r['ours_fwd'], r['cudnn_fwd'])} | "
            f"{100 * r['ours_fwd'] * 1e12 / ceiling:.0f}% | {r['ours_bwd']:.0f} | {r['flash_bwd']:.0f} | "
            f"{ratio(r['ours_bwd'], r['flash_bwd'])} | {r['cudnn_bwd']:.0f} | {ratio(r['ours_bwd'], r['cudnn_bwd'])} | "
            f"{100 * r['ours_bwd'] * 1e12 / ceiling:.0f}% |")
    return head + "\n".join(lines) + "\n" + hopper_table(ceiling, rows) + hopper_bwd_table(ceiling, rows)


def hopper_table(ceiling, rows):
    """Forward only: the mma.sync kernel, the sm_90a wgmma kernel, SDPA flash and cuDNN."""
    head = ("\nForward, sm_90a wgmma kernel (ours-hopper: hopper_fwd=1, the default on sm_90) vs the "
            "mma.sync kernel and SDPA, TFLOP/s; |diff| = max |out - out_mma.sync|\n\n"
            "| D | S | causal | ours (mma.sync) | ours-hopper | SDPA flash | cuDNN | x mma.sync "
            "| x flash | x cudnn | % ceil | \\|diff\\| |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        best = r["hopper_fwd"]
        lines.append(
            f"| {r['d']} | {r['s']} | {'yes' if r['causal'] else 'no'} | {r['ours_fwd']:.0f} | "
            f"{r['hopper_fwd']:.0f} | {r['flash_fwd']:.0f} | {r['cudnn_fwd']:.0f} | "
            f"{ratio(best, r['ours_fwd'])} | {ratio(best, r['flash_fwd'])} | {ratio(best, r['cudnn_fwd'])} | "
            f"{100 * best * 1e12 / ceiling:.0f}% | {r['hopper_diff']:.1e} |")
    return head + "\n".join(lines) + "\n"


def hopper_bwd_table(ceiling, rows):
    """Backward only: the mma.sync kernel, the sm_90a wgmma kernel, SDPA flash and cuDNN."""
    head = ("\nBackward, sm_90a wgmma kernel (hopper-bwd: hopper_bwd=1) vs the mma.sync kernel "
            "and SDPA, TFLOP/s (2.5x the forward's FLOPs); |diff| = max |dX - dX_mma.sync| over dQ, dK, dV\n\n"
            "| D | S | causal | ours (mma.sync) | hopper-bwd | SDPA flash | cuDNN | x mma.sync | x flash "
            "| x cudnn | % ceil | \\|diff\\| |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        hb = r["hopper_bwd"]
        lines.append(
            f"| {r['d']} | {r['s']} | {'yes' if r['causal'] else 'no'} | {r['ours_bwd']:.0f} | {hb:.0f} | "
            f"{r['flash_bwd']:.0f} | {r['cudnn_bwd']:.0f} | {ratio(hb, r['ours_bwd'])} | "
            f"{ratio(hb, r['flash_bwd'])} | {ratio(hb, r['cudnn_bwd'])} | "
            f"{100 * hb * 1e12 / ceiling:.0f}% | {r['hopper_bwd_diff']:.1e} |")
    return head + "\n".join(lines) + "\n"


def reference_shape():
    """The reference shape of docs/design/hopper-fwd-notes.md: B * H = 132 (one (b, h) per
    SM of an H100 SXM, 64 query blocks each), S = 8192, D = 128, bf16, (B, S, H, D) storage. Prints
    the two floors (FLOPs / measured matmul rate, bytes / measured copy bandwidth) and the measured
    forward times of every contender."""
    torch.manual_seed(0)
    b, h, s, d = 4, 33, 8192, 128
    n = 1 << 28  # 512 MiB copy: read + write bytes over the time
    src = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    bw = 2 * 2 * n / cuda_time(lambda: dst.copy_(src))
    del src, dst
    ceiling = matmul_ceiling()
    has_hopper = hopper_available()
    has_hopper_bwd = hopper_bwd_available()
    mk = lambda: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    q, k, v = mk(), mk(), mk()
    nbytes = 4 * b * h * s * d * 2 + b * h * s * 4  # Q, K, V read once, O and the LSE written once
    print(f"reference shape B={b} H={h} S={s} D={d} bf16; copy {bw / 1e12:.2f} TB/s, matmul {ceiling / 1e12:.0f} TFLOP/s")
    for causal in (False, True):
        f = flops(b, h, s, s, d, causal=causal, mode="fwd")
        args = options(d, causal)
        fwd = lambda: torch.ops.attention_ext.softmax_fwd(q, k, v, *args)
        res = {}
        with hopper_env(0):
            res["ours (mma.sync)"] = cuda_time(fwd)
        if has_hopper:
            for name, mode in (("ours-hopper", 1),):
                with hopper_env(mode):
                    res[name] = cuda_time(fwd)
        for name, backend in (("SDPA flash", getattr(SDPBackend, "FLASH_ATTENTION", None)),
                              ("cuDNN", getattr(SDPBackend, "CUDNN_ATTENTION", None))):
            fns = sdpa_backend_fns(backend, q, k, v, torch.randn_like(q), causal) if backend is not None else None
            if fns is not None:
                res[name] = cuda_time(fns[0])
        floor_c, floor_m = f / ceiling, nbytes / bw
        print(f"causal={causal}: {f / 1e12:.2f} TFLOP -> {1e3 * floor_c:.2f} ms at the matmul rate; "
              f"{nbytes / 1e9:.2f} GB -> {1e3 * floor_m:.2f} ms at the copy rate; floor {1e3 * max(floor_c, floor_m):.2f} ms")
        for name, sec in res.items():
            print(f"  {name:16s} {1e3 * sec:7.2f} ms  {f / sec / 1e12:5.0f} TFLOP/s  "
                  f"{max(floor_c, floor_m) / sec:5.1%} of the floor's speed")
        # the backward alone, from the same saved out / LSE (2.5x the forward's FLOPs)
        fb = flops(b, h, s, s, d, causal=causal, mode="bwd")
        dout = torch.randn_like(q)
        with hopper_env(0):
            out, lse = fwd()
        bwd = lambda: torch.ops.attention_ext.softmax_bwd(dout, q, k, v, out, lse, *args, False, False)
        resb = {}
        with hopper_bwd_env(0):
            resb["ours (mma.sync)"] = cuda_time(bwd)
        if has_hopper_bwd:
            with hopper_bwd_env(1):
                resb["hopper-bwd"] = cuda_time(bwd)
        for name, backend in (("SDPA flash", getattr(SDPBackend, "FLASH_ATTENTION", None)),
                              ("cuDNN", getattr(SDPBackend, "CUDNN_ATTENTION", None))):
            fns = sdpa_backend_fns(backend, q, k, v, dout, causal) if backend is not None else None
            if fns is not None:
                resb[name] = cuda_time(fns[1])
        print(f"  backward: {fb / 1e12:.2f} TFLOP -> {1e3 * fb / ceiling:.2f} ms at the matmul rate")
        for name, sec in resb.items():
            print(f"  {name:16s} {1e3 * sec:7.2f} ms  {fb / sec / 1e12:5.0f} TFLOP/s  "
                  f"{fb / ceiling / sec:5.1%} of the floor's speed")
        del out, lse, dout


def option_rows(b=8, h=16, s=4096, d=128, device="cuda"):
    """Features beyond the bf16 main table, each against the closest peer measured in the same run:
    fp16, the deterministic backward, GQA, a sliding window, ALiBi, softcap, an additive bias,
    dropout and sinks. D = 128, S = 4096, H = 16, B = 8, (B, S, H, D) storage. TFLOP/s count the
    allowed (query, key) pairs (common.flops), so a window is credited only with what it computes.
    The peer is SDPA's flash backend where it computes the same thing, else the backend SDPA
    picks for the same math (an additive bias: memory-efficient), else flash on the unmasked
    problem (marked "*": a masking option's overhead or block-skipping gain, not a like-for-like
    race). Returns markdown."""
    torch.manual_seed(0)
    lines = ["| case | fwd ours | fwd peer | x peer | fwd ours, wgmma (hopper_fwd=2) | x peer | bwd ours | bwd peer | "
             "x peer | bwd ours, wgmma (hopper_bwd=2) | x peer | peer |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def mk(heads, dtype=torch.bfloat16):
        return torch.randn(b, s, heads, d, device=device, dtype=dtype).transpose(1, 2)  # (B, H, S, D)

    sm90 = hopper_available()

    def row(name, hk=h, dtype=torch.bfloat16, causal=False, window=(-1, -1), peer="flash", peer_kw=None,
            deterministic=False, like=True, **opt):
        # like: the peer computes the same function (else it runs the unmasked problem)
        q, k, v, dout = mk(h, dtype), mk(hk, dtype), mk(hk, dtype), mk(h, dtype)
        o = dict(zip(ops.OPTION_NAMES, options(d, causal)))
        if window != (-1, -1):
            o["window_left"], o["window_right"] = window
        o.update(opt)
        args = [o[n] for n in ops.OPTION_NAMES]
        out, lse = torch.ops.attention_ext.softmax_fwd(q, k, v, *args)
        want_dbias = o["bias"] is not None and o["bias"].requires_grad
        f_fwd = flops(b, h, s, s, d, causal=causal, window=window, mode="fwd")
        f_bwd = flops(b, h, s, s, d, causal=causal, window=window, mode="bwd")
        with hopper_env(0):
            t_fwd = cuda_time(lambda: torch.ops.attention_ext.softmax_fwd(q, k, v, *args))
            t_bwd = cuda_time(lambda: torch.ops.attention_ext.softmax_bwd(dout, q, k, v, out, lse, *args, want_dbias,
                                                                  deterministic))
        # the sm_90 selection with the score options on wgmma; "-" where a wgmma kernel does not
        # take the call (another GPU, a bias, dropout, deterministic) and the time would repeat the
        # mma.sync column
        t_wg = t_wg_bwd = float("nan")
        if sm90:
            with kernels(hopper_fwd=2, hopper_bwd=2):
                fn = lambda: torch.ops.attention_ext.softmax_fwd(q, k, v, *args)  # noqa: E731
                if any("hopper" in n for n in kernel_names(fn)):
                    t_wg = cuda_time(fn)
                fb = lambda: torch.ops.attention_ext.softmax_bwd(dout, q, k, v, out, lse, *args, want_dbias,  # noqa: E731
                                                                 deterministic)
                if any("hopper" in n for n in kernel_names(fb)):
                    t_wg_bwd = cuda_time(fb)
        backend = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}[peer]
        kw = dict(peer_kw or {})
        kw.setdefault("is_causal", causal)
        fns = sdpa_backend_fns(getattr(SDPBackend, backend, None), q, k, v, dout, **kw)
        p_fwd, p_bwd = (cuda_time(fns[0]), cuda_time(fns[1])) if fns else (float("nan"), float("nan"))
        # the peer's FLOPs: the same formula on what it computes (the full or causal square)
        pf_fwd = flops(b, h, s, s, d, causal=kw["is_causal"], mode="fwd")
        pf_bwd = flops(b, h, s, s, d, causal=kw["is_causal"], mode="bwd")
        tf = lambda f, t: f / t / 1e12
        wg = f"{tf(f_fwd, t_wg):.0f} | {ratio(p_fwd, t_wg)}" if t_wg == t_wg else "- | -"
        wgb = f"{tf(f_bwd, t_wg_bwd):.0f} | {ratio(p_bwd, t_wg_bwd)}" if t_wg_bwd == t_wg_bwd else "- | -"
        lines.append(f"| {name} | {tf(f_fwd, t_fwd):.0f} | {tf(pf_fwd, p_fwd):.0f} | {ratio(p_fwd, t_fwd)} | "
                     f"{wg} | {tf(f_bwd, t_bwd):.0f} | {tf(pf_bwd, p_bwd):.0f} | {ratio(p_bwd, t_bwd)} | {wgb} | "
                     f"{peer}{'' if like else '*'} |")
        print(lines[-1], flush=True)

    cuda = dict(device=device)
    row("bf16, non-causal")
    row("fp16, non-causal", dtype=torch.float16)
    row("fp16, causal", dtype=torch.float16, causal=True)
    row("deterministic bwd, non-causal", deterministic=True)
    row(f"GQA {h}:{h // 4}, causal", hk=h // 4, causal=True, peer_kw=dict(enable_gqa=True))
    row("window (256, 0)", window=(256, 0), like=False, peer_kw=dict(is_causal=True))
    row("ALiBi, causal", causal=True, like=False, alibi_slopes=torch.rand(h, **cuda))
    row("softcap 30, causal", causal=True, like=False, softcap=30.0)
    row("sinks, causal", causal=True, like=False, sinks=torch.randn(h, **cuda))
    # ours takes a float32 bias with 16-bit inputs; SDPA wants the inputs' dtype
    bias = torch.randn(1, h, s, s, **cuda)
    row("additive bias (1, H, S, S)", peer="efficient", peer_kw=dict(attn_mask=bias.bfloat16()), bias=bias)
    row("dropout 0.1", peer_kw=dict(dropout_p=0.1), dropout_p=0.1, seed=1)
    # x peer = peer time / our time (> 1: ours is faster), on the FLOPs of each column
    return (f"Options, bf16 unless named, B={b} H={h} S={s} D={d}, TFLOP/s; x peer = peer time / our time; "
            "* = peer computes the unmasked problem\n\n" + "\n".join(lines) + "\n")


def qk_int8_rows(device="cuda"):
    """The int8 Q.K^T forward (softmax_fwd_quant: the quantize pass, then the mma.sync FwdQ8
    kernel; "int8 wgmma": its s8 wgmma form at hopper_fwd=2, sm_90 only; "fp8 wgmma": qk_quant="fp8",
    the e4m3 wgmma form, sm_90 only) against our bf16 forward
    as the default runs it (the wgmma kernel on sm_90), the bf16 mma.sync kernel it is built on
    (hopper_fwd=0) and SDPA flash, at the issue's shapes: B * S = 32k, H = 16, D 64 / 128, S 4096
    / 8192, causal and not. TFLOP/s count the allowed pairs; x = the bf16 default's (or the
    other's) time / the int8 time (target: >= 1.3x our bf16 forward). Returns markdown."""
    lines = ["| D | S | causal | int8 TFLOP/s | int8 wgmma TFLOP/s | fp8 wgmma TFLOP/s | bf16 default | x | x wgmma | "
             "x fp8 | bf16 mma.sync | x | SDPA flash | x |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for d in (128, 64):
        for s in (4096, 8192):
            for causal in (False, True):
                b, h = 32768 // s, 16
                q, k, v = (torch.randn(b, s, h, d, device=device, dtype=torch.bfloat16).transpose(1, 2)
                           for _ in range(3))
                o = dict(zip(ops.OPTION_NAMES, options(d, causal)))
                args = [o[n] for n in ops.OPTION_NAMES]
                t8 = cuda_time(lambda: torch.ops.attention_ext.softmax_fwd_quant(q, k, v, *args, "int8"))
                t8w = t8f = float("nan")
                if torch.cuda.get_device_capability()[0] == 9:
                    with kernels(hopper_fwd=2):
                        t8w = cuda_time(lambda: torch.ops.attention_ext.softmax_fwd_quant(q, k, v, *args, "int8"))
                    t8f = cuda_time(lambda: torch.ops.attention_ext.softmax_fwd_quant(q, k, v, *args, "fp8"))
                t_def = cuda_time(lambda: torch.ops.attention_ext.softmax_fwd(q, k, v, *args))
                with hopper_env(0):
                    t_mma = cuda_time(lambda: torch.ops.attention_ext.softmax_fwd(q, k, v, *args))
                fns = sdpa_backend_fns(getattr(SDPBackend, "FLASH_ATTENTION", None), q, k, v, q, is_causal=causal)
                t_sdpa = cuda_time(fns[0]) if fns else float("nan")
                f = flops(b, h, s, s, d, causal=causal, mode="fwd")
                lines.append(f"| {d} | {s} | {causal} | {f / t8 / 1e12:.0f} | {f / t8w / 1e12:.0f} | "
                             f"{f / t8f / 1e12:.0f} | {f / t_def / 1e12:.0f} | {ratio(t_def, t8)} | "
                             f"{ratio(t_def, t8w)} | {ratio(t_def, t8f)} | "
                             f"{f / t_mma / 1e12:.0f} | {ratio(t_mma, t8)} | "
                             f"{f / t_sdpa / 1e12:.0f} | {ratio(t_sdpa, t8)} |")
                print(lines[-1], flush=True)
    return "int8 Q.K^T forward (qk_quant), bf16 inputs, H=16, B*S=32k; x = other time / int8 time\n\n" + \
        "\n".join(lines) + "\n"


def kernel_names(fn):
    """The CUDA kernels fn launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events()}


def decode_rows(d=128, device="cuda"):
    """Decode steps: one query row per sequence (Sq = 1) against a KV cache of Sk keys, bf16,
    D = 128, (B, H, Hk) in {(1, 32, 8), (8, 32, 8), (32, 32, 8)}, Sk in {1k, 8k, 32k}, (B, S, H, D)
    storage. Ours with the split-KV heuristic (num_splits=0; "split": whether it split, from the profiler) and
    with num_splits=1 (the unsplit grid of B * H CTAs), against SDPA's flash backend in the
    same run: with enable_gqa when it accepts that, else on K / V repeated to H heads (marked "rep";
    the copy is made once, outside the timing). One query sees the whole cache, so no mask.
    GB/s = the K + V bytes of the cache (B * Hk * Sk * D * 2 tensors * 2 bytes) / time for every
    column, the repeated peer included (what a decode step has to read). x = time / our split
    time (> 1: the split path is faster). Returns markdown."""
    torch.manual_seed(0)
    lines = ["| B | H | Hk | Sk | split | ours ms | GB/s | unsplit ms | GB/s | x unsplit | "
             "SDPA flash ms | GB/s | x SDPA | peer |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    args = options(d, False)
    backend = getattr(SDPBackend, "FLASH_ATTENTION", None) if SDPBackend is not None else None
    for sk in (1024, 8192, 32768):
        for b, h, hk in ((1, 32, 8), (8, 32, 8), (32, 32, 8)):
            q = torch.randn(b, 1, h, d, device=device, dtype=torch.bfloat16).transpose(1, 2)
            k, v = (torch.randn(b, sk, hk, d, device=device, dtype=torch.bfloat16).transpose(1, 2)
                    for _ in range(2))
            kv_bytes = 2 * k.numel() * k.element_size()
            fwd = lambda: torch.ops.attention_ext.softmax_fwd(q, k, v, *args, 0)  # num_splits=0: the heuristic
            unsplit = lambda: torch.ops.attention_ext.softmax_fwd(q, k, v, *args, 1)
            with hopper_env(0):
                split = any("fwd_combine_kernel" in n for n in kernel_names(fwd))
                t_ours = cuda_time(fwd)
                ref, _ = unsplit()
                t_one = cuda_time(unsplit)
                out, _ = fwd()
            diff = (out.float() - ref.float()).abs().max().item()
            assert diff <= 2e-2, f"split and unsplit outputs differ by {diff} (B={b} Sk={sk})"
            dout = torch.zeros_like(q)
            fns, peer = sdpa_backend_fns(backend, q, k, v, dout, enable_gqa=True), "gqa"
            if fns is None:
                kr, vr = (t.repeat_interleave(h // hk, dim=1) for t in (k, v))
                fns, peer = sdpa_backend_fns(backend, q, kr, vr, dout), "rep"
            t_peer = cuda_time(fns[0]) if fns else float("nan")
            gbs = lambda t: f"{kv_bytes / t / 1e9:.0f}" if t == t else "n/a"
            lines.append(f"| {b} | {h} | {hk} | {sk} | {'yes' if split else 'no'} | {1e3 * t_ours:.3f} | "
                         f"{gbs(t_ours)} | {1e3 * t_one:.3f} | {gbs(t_one)} | {t_one / t_ours:.2f} | "
                         f"{1e3 * t_peer:.3f} | {gbs(t_peer)} | {t_peer / t_ours:.2f} | "
                         f"{peer if fns else 'refused'} |")
            print(lines[-1], flush=True)
            del q, k, v, fns
    return (f"Decode (Sq = 1), bf16, D={d}; ours = split-KV heuristic, unsplit = num_splits=1; "
            "GB/s = K + V cache bytes / time; x = that time / ours\n\n" + "\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--md", default=None)
    ap.add_argument("--tune", action="store_true", help="time the -DATTN_TUNING candidates")
    ap.add_argument("--fwd-variants", default="0-7", help="tune_fwd values for --tune (e.g. 0-7 or 0,1,5)")
    ap.add_argument("--bwd-variants", default="0-12", help="tune_bwd values for --tune")
    ap.add_argument("--ref", action="store_true", help="the reference shape: floors, forward and backward times")
    ap.add_argument("--options", action="store_true",
                    help="fp16, deterministic, GQA, window, ALiBi, softcap, sinks, bias, dropout vs SDPA")
    ap.add_argument("--qk-int8", action="store_true",
                    help="the int8 Q.K^T forward (qk_quant) vs our bf16 forward and SDPA flash")
    ap.add_argument("--decode", action="store_true",
                    help="decode steps (Sq = 1, KV cache 1k-32k, GQA): split-KV vs unsplit vs SDPA flash")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not ops.has_kernel(torch.device("cuda")):
        print("bench_cuda: needs a GPU and the compiled CUDA kernels; skipped")
        return
    if args.ref:
        reference_shape()
        return
    if args.tune:
        tune(parse_variants(args.fwd_variants), parse_variants(args.bwd_variants))
        return
    if args.options or args.decode or args.qk_int8:
        md = "\n".join(f() for f, on in ((option_rows, args.options), (decode_rows, args.decode),
                                         (qk_int8_rows, args.qk_int8)) if on)
        if args.md:
            with open(args.md, "a") as f:
                f.write("\n" + md)
        print(md)
        return
    ceiling, rows = run(args.quick)
    md = table(ceiling, rows, torch.cuda.get_device_name())
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    print(md)


if __name__ == "__main__":
    main()
