"""Block-sparse attention on the GPU: ours (attention_ext.block_sparse_attention, the mma.sync
kernels walking the layout's tile index; and on the sm_90a wgmma kernels,
set_cuda_kernels(hopper_fwd=2, hopper_bwd=2), not yet the default) against torch's FlexAttention compiled with
the equivalent BlockMask, and against our own dense attention on the same inputs, bf16, one run.

    python benchmarks/sparse/bench_cuda.py [--quick] [--reps N] [--out FILE]

Shapes: (B, H, S, D) with S in {16k, 32k, 64k}, H in {8, 16}, D in {64, 128}, B = 1, 128 x 128
layout blocks (FlexAttention's default block, and the forward kernel's query tile), two layouts
at about 10% density:
  bigbird: per query block the 3 nearest key blocks (a sliding window), 2 global blocks (the
           first two rows and columns) and random blocks up to the density, different per head;
  fixed:   Sparse Transformer's "fixed" pattern: local chunks of blocks that attend within
           themselves and one summary column every 20 blocks, shared by the heads.
GFLOP/s per useful FLOP: benchmarks/common.flops_from_pairs over the pairs the layout allows (the
same 4 * D per pair as flops(); backward 2.5x), for every contender, so dense attention's rate is
its real work divided into the sparse problem's useful work (a speedup, not its own throughput).
Times are medians of CUDA-event timings after warm-up; FlexAttention is compiled once per shape
and layout (torch.compile) before timing.

Written without a GPU (2026-11-24): never run yet.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import cuda_time, flops_from_pairs  # noqa: E402

import attention_ext as ae  # noqa: E402
from attention_ext.sparse import layout_to_mask  # noqa: E402

BLOCK = 128


def bigbird_layout(h, n, density=0.10, window=3, n_global=2, seed=0):
    """(H, n, n) bool: sliding window of `window` blocks, `n_global` global rows / columns, random
    blocks per row up to `density`."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.arange(n)
    lay = (idx[:, None] - idx[None, :]).abs() <= window // 2
    lay[:n_global, :] = True
    lay[:, :n_global] = True
    lay = lay.unsqueeze(0).repeat(h, 1, 1)
    n_rand = max(int(density * n) - window - n_global, 0)
    for head in range(h):
        r = torch.randint(0, n, (n, n_rand), generator=g)
        lay[head].scatter_(1, r, True)
    return lay


def fixed_layout(n, density=0.10):
    """(1, n, n) bool: Sparse Transformer's fixed pattern, half of `density` each from the local
    chunks (chunks of density * n / 2 blocks attend within themselves) and from the summary
    columns (every 2 / density-th block)."""
    chunk = max(int(round(density * n / 2)), 1)
    every = max(int(round(2.0 / density)), 1)
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    return ((i // chunk == j // chunk) | (j % every == every - 1)).unsqueeze(0)


def flex_fn(q, k, v, layout):
    """FlexAttention with the layout as a BlockMask of full 128 x 128 blocks, or None without it."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
    except ImportError:
        return None
    h, n, _ = layout.shape
    lay = layout.expand(q.shape[1], n, n).to(q.device)
    full_num = lay.sum(-1, dtype=torch.int32)[None]  # (1, H, n)
    # on blocks first, each row's in ascending order (BlockMask reads the first full_num of them)
    order = torch.sort((~lay).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)[None]
    zeros = torch.zeros_like(full_num)
    mask = BlockMask.from_kv_blocks(zeros, order, full_num, order, BLOCK_SIZE=BLOCK)
    compiled = torch.compile(flex_attention)
    return lambda: compiled(q, k, v, block_mask=mask)


def useful_pairs(layout, s, h):
    """Allowed (query, key) pairs summed over the heads."""
    m = layout_to_mask(layout, BLOCK, s, s)
    return int(m.sum()) * (h // m.shape[0])


def step(fwd, grad, dout, leaves):
    def run():
        out = fwd()
        if grad:
            torch.autograd.grad(out, leaves, dout)
    return run


def with_kernels(fn, **fields):
    """fn run under attention_ext.softmax.set_cuda_kernels with `fields` changed."""
    def run():
        old = ae.softmax.set_cuda_kernels(**{**ae.softmax.cuda_kernels(), **fields})
        try:
            fn()
        finally:
            ae.softmax.set_cuda_kernels(**old)
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="S = 16k only")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", help="write the markdown table here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cuda.py needs a CUDA device")
        return 1
    seqs = [16384] if args.quick else [16384, 32768, 65536]
    lines = [f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, B = 1, {BLOCK} x {BLOCK} blocks",
             "", "| layout | (H, S, D) | density | pass | ours GFLOP/s (ms) | ours, wgmma GFLOP/s (ms) | "
             "flex GFLOP/s (ms) | dense GFLOP/s (ms) | ours / flex | wgmma / flex | ours / dense |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in seqs:
        n = s // BLOCK
        for h in (8, 16):
            for d in (64, 128):
                for name, layout in (("bigbird", bigbird_layout(h, n)), ("fixed", fixed_layout(n))):
                    torch.manual_seed(0)
                    q, k, v = (torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                               for _ in range(3))
                    dout = torch.randn_like(q)
                    lay = layout.cuda()
                    pairs = useful_pairs(layout, s, h)
                    density = pairs / (h * s * s)
                    flex = flex_fn(q, k, v, lay)
                    for grad in (False, True):
                        ours = step(lambda: ae.block_sparse_attention(q, k, v, lay, block_size=BLOCK), grad, dout,
                                    (q, k, v))
                        fns = {
                            "ours": ours,
                            # the same call on the sm_90a wgmma kernels (hopper_fwd=2, hopper_bwd=2:
                            # not yet the default; on other GPUs the same kernels as "ours")
                            "wgmma": with_kernels(ours, hopper_fwd=2, hopper_bwd=2),
                            "dense": step(lambda: ae.attention(q, k, v), grad, dout, (q, k, v)),
                        }
                        if flex is not None:
                            fns["flex"] = step(flex, grad, dout, (q, k, v))
                        t = {}
                        with torch.set_grad_enabled(grad):
                            for key, fn in fns.items():
                                try:
                                    t[key] = cuda_time(fn, reps=args.reps)
                                except (RuntimeError, torch.OutOfMemoryError) as e:  # flex compile, memory
                                    print(f"{key} failed at {(name, h, s, d)}: {str(e).splitlines()[0]}")
                        fl = flops_from_pairs(pairs, d, mode="fwd_bwd" if grad else "fwd")

                        def col(key):
                            return f"{fl / t[key] / 1e9:.0f} ({t[key] * 1e3:.2f})" if key in t else "-"

                        def ratio(key):
                            return f"{t[key] / t['ours']:.2f}x" if key in t and "ours" in t else "-"

                        def ratio_wg(key):
                            return f"{t[key] / t['wgmma']:.2f}x" if key in t and "wgmma" in t else "-"

                        lines.append(f"| {name} | {(h, s, d)} | {density:.1%} | {'fwd+bwd' if grad else 'fwd'} | "
                                     f"{col('ours')} | {col('wgmma')} | {col('flex')} | {col('dense')} | "
                                     f"{ratio('flex')} | {ratio_wg('flex')} | {ratio('dense')} |")
                        print(lines[-1], flush=True)
                    del q, k, v, dout
                    torch.cuda.empty_cache()
    text = "\n".join(lines) + ("\n\nRatios > 1: ours faster. GFLOP/s per useful FLOP (the layout's pairs). "
                               "Command: python benchmarks/sparse/bench_cuda.py\n")
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
