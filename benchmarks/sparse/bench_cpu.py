"""CPU benchmark of the sparse family against its peers, measured in the same run (interleaved)
and reported as ratios, with GFLOP/s per useful FLOP (the shared flops() with the layout's
allowed pairs) read against the measured fp32 matmul ceiling.

    python benchmarks/sparse/bench_cpu.py [--quick] [--out benchmarks/results/sparse-cpu.md]

Sections (B1, H8, D64, fp32, block 64, forward):
1. Block-sparse at S=16384 with BigBird-like and fixed layouts near 10% density: ours against
   FlexAttention (torch.compile(flex_attention) on the CPU with the equivalent BlockMask, at the
   layout's block and at Flex's default 128, the faster taken as the peer) and against our own
   dense fused kernel (ae.attention).
2. Density: random layouts at 5% and 10%, time(5%) / time(10%).
3. Top-k, k_top=64, S=8192: topk_attention against our dense fused kernel.
--quick divides the lengths by 4 (a smoke run, not the issue's sizes).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import cpu_model, flops, interleaved, layout_pairs, machine_line, matmul_ceiling  # noqa: E402

import attention_ext as ae  # noqa: E402
from attention_ext import sparse  # noqa: E402

LINES = []


def emit(line=""):
    print(line, flush=True)
    LINES.append(line)


def flex_peer(lay, bs, s, h, q, k, v):
    """The strongest FlexAttention a user would write for this layout: compiled, with the
    block mask at the layout's block and at Flex's default 128 (the faster wins)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    fa = torch.compile(flex_attention)
    lay_h = lay.expand(h, -1, -1) if lay.shape[0] == 1 else lay

    def mask_mod(b, hh, qi, ki):
        return lay_h[hh, qi // bs, ki // bs]

    fns = {}
    for fb in sorted({bs, 128}):
        t0 = time.perf_counter()
        bm = create_block_mask(mask_mod, B=None, H=h, Q_LEN=s, KV_LEN=s, device="cpu", BLOCK_SIZE=fb)
        fa(q, k, v, block_mask=bm)  # compile
        emit(f"    (flex block {fb}: mask + compile {time.perf_counter() - t0:.0f} s)")
        fns[f"flex{fb}"] = (lambda bm=bm: fa(q, k, v, block_mask=bm))
    return fns


def section_layouts(s, h, d, bs, reps, no_flex):
    emit(f"## 1. Block-sparse forward, S={s}, H{h}, D{d}, block {bs}, fp32")
    emit()
    q, k, v = (torch.randn(1, h, s, d) for _ in range(3))
    nb = s // bs
    layouts = {
        "bigbird(3, 2, 16)": sparse.bigbird(window_blocks=3, n_global=2, n_random=max(1, round(16 * nb / 256)), seed=0,
                                            seq_len=s, block_size=bs, heads=h),
        "fixed(16, 1)": sparse.fixed(stride=max(1, round(16 * (nb / 256) ** 0.5)), c=1, seq_len=s, block_size=bs),
    }
    emit("| layout | density | ours ms | flex ms | dense ms | flex / ours | dense / ours | ours GFLOP/s (useful) |")
    emit("|---|---|---|---|---|---|---|---|")
    out = {}
    for name, lay in layouts.items():
        fns = {"ours": lambda lay=lay: ae.block_sparse_attention(q, k, v, lay, block_size=bs),
               "dense": lambda: ae.attention(q, k, v)}
        if not no_flex:
            try:
                fns.update(flex_peer(lay, bs, s, h, q, k, v))
            except Exception as e:  # noqa: BLE001 - report, keep the other rows
                emit(f"    (flex unavailable: {type(e).__name__}: {str(e)[:200]})")
        t = interleaved(fns, reps=reps)
        flex_names = [n for n in t if n.startswith("flex")]
        flex = min(t[n] for n in flex_names) if flex_names else float("nan")
        dens = lay.float().mean().item()
        gf = flops(1, h, s, s, d, pairs=layout_pairs(lay, bs, s, s)) / t["ours"] / 1e9
        emit(f"| {name} | {dens:.1%} | {t['ours'] * 1e3:.1f} | {flex * 1e3:.1f} | {t['dense'] * 1e3:.1f} | "
             f"{flex / t['ours']:.2f} | {t['dense'] / t['ours']:.2f} | {gf:.1f} |")
        out[name] = t
    emit()
    return out


def section_density(s, h, d, bs, reps):
    emit(f"## 2. Density, random layouts, S={s}, H{h}, D{d}, block {bs}")
    emit()
    q, k, v = (torch.randn(1, h, s, d) for _ in range(3))
    lays = {p: sparse.random(p, seed=1, seq_len=s, block_size=bs, heads=h) for p in (0.05, 0.10)}
    t = interleaved({p: (lambda lay=lay: ae.block_sparse_attention(q, k, v, lay, block_size=bs))
                     for p, lay in lays.items()}, reps=reps)
    emit("| density | ms | GFLOP/s (useful) |")
    emit("|---|---|---|")
    for p, lay in lays.items():
        gf = flops(1, h, s, s, d, pairs=layout_pairs(lay, bs, s, s)) / t[p] / 1e9
        emit(f"| {lay.float().mean().item():.1%} | {t[p] * 1e3:.1f} | {gf:.1f} |")
    emit(f"\ntime(5%) / time(10%) = {t[0.05] / t[0.10]:.2f} (target <= 0.6)\n")


def section_topk(s, h, d, k_top, reps):
    emit(f"## 3. Top-k forward, k_top={k_top}, S={s}, H{h}, D{d}, fp32")
    emit()
    q, k, v = (torch.randn(1, h, s, d) for _ in range(3))
    t = interleaved({"topk": lambda: ae.topk_attention(q, k, v, k_top), "dense": lambda: ae.attention(q, k, v)},
                    reps=reps)
    emit("| ours top-k ms | our dense ms | top-k / dense |")
    emit("|---|---|---|")
    emit(f"| {t['topk'] * 1e3:.1f} | {t['dense'] * 1e3:.1f} | {t['topk'] / t['dense']:.2f} (target <= 1.5) |")
    emit()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="lengths / 4: a smoke run")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-flex", action="store_true", help="skip the FlexAttention peer (its compile is slow)")
    ap.add_argument("--sections", default="123")
    ap.add_argument("--out", default=None, help="also write the tables to this markdown file")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    div = 4 if a.quick else 1
    # the ISA level the kernels run (machine_line), not a flag of the CPU's: a level can be forced lower
    emit(f"# Sparse attention, CPU ({datetime.date.today()}, {cpu_model()}; "
         f"{machine_line(torch.get_num_threads())})")
    emit()
    emit(f"fp32 matmul ceiling: {matmul_ceiling() / 1e9:.0f} GFLOP/s")
    emit()
    if "1" in a.sections:
        section_layouts(16384 // div, 8, 64, 64, a.reps, a.no_flex)
    if "2" in a.sections:
        section_density(16384 // div, 8, 64, 64, a.reps)
    if "3" in a.sections:
        section_topk(8192 // div, 8, 64, 64, a.reps)
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(LINES) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
